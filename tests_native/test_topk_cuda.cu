// kdt_topk_logprobs_cuda against an independent host reference written here: float64
// logsumexp and a (value descending, id ascending) partial sort of the row, for every
// dtype (float32, float16, bfloat16; the test logits are exact values of the dtype),
// vocabularies 1, 7, 1025, 8193, 151936 and 262144, k in {1, 2, 64, 128, 129, 1024} (where
// <= V; k <= 128 runs the row kernel, larger k the chunk kernels),
// padded and misaligned strides (the gaps hold NaN, which must never be read), a broadcast
// row (stride 0), exact ties, all-equal rows, sorted rows, logits near +-3e38, -inf
// entries (masked rows, rows with fewer finite logits than k), and bad rows (NaN, +inf, all
// -inf) next to good ones. Ids must be exactly the reference's, every id < V; log-probs
// within 2e-6 * |ref| + 2e-6.
//
// The bound: the kernel computes lp = (x - m) - log(S) in float32, S the float32 sum of
// exp(x - m) over the row. x - m and the two subtractions round at most 1.5 ulp of |lp|
// together (|x - m| and log S are both <= |lp|) and logf is within 1 ulp: ~3e-7 * |lp|,
// the relative term. A relative error e on S is an absolute error e on log S: the hardware
// 2^x is within 2 ulp (2.4e-7) per term, and the sums round along any path ~45 times in
// the chunk kernels (per-thread chains of <= 16 terms, warp trees, 8 warps, the chunks)
// and ~140 times in the row kernel (a tree of each trip's 16 terms, a per-thread chain of
// ceil(V / 2048) <= 128 trip sums for 16-bit dtypes (float32: 8-term trees, <= 256 trip
// sums), each rescale of the running sum, warp trees, 4 warps): ~5e-7 and ~8e-7 typically
// (random walk), ~3e-6 and ~9e-6 in the very worst case (~1.4e-5 for float32 at V =
// 262,144). 2e-6 absolute covers the typical error 2.5-4x; a host emulation of the chunk
// kernels peaked at 10% of this tolerance.
// Also: the host-side argument checks (each returns its documented status and launches
// nothing: the outputs keep their sentinel), k = 0 (only row_status), a reused workspace
// full of garbage, and a call captured in a CUDA graph.
// Exits 77 (skipped) where there is no GPU. KDT_CUDA_QUICK=1 runs a smaller set (for
// compute-sanitizer).
#include <cuda_runtime.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "harness.h"
#define KDT_TEST_SEED 0x2545F4914F6CDD1Dull
#include "cuda_harness.h"




static double normal() {
    const double u = unit() + 1e-12, v = unit();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

// ---- dtype encodings (round to nearest even), written independently of CUDA ---------

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static float f32_from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static uint16_t bf16_encode(float x) {
    uint32_t u = f32_bits(x);
    if (isnan(x)) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf16_decode(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }
static uint16_t f16_encode(float x) {
    if (isnan(x)) return 0x7E00;
    const uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u;
    const float a = fabsf(x);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7C00u);  // rounds to inf
    if (a < 6.103515625e-05f) {                             // subnormal: multiples of 2^-24
        const float q = rintf(a * 16777216.0f);              // round to nearest even
        return (uint16_t)(sign | (uint32_t)q);
    }
    int e;
    const float m = frexpf(a, &e);                 // a = m * 2^e, m in [0.5, 1)
    float q = rintf(m * 2048.0f);                  // 11 significant bits
    if (q >= 2048.0f) {
        q = 1024.0f;
        e++;
    }
    return (uint16_t)(sign | ((uint32_t)(e + 14) << 10) | ((uint32_t)q - 1024u));
}
static float f16_decode(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) ? 1u : 0u, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
    float v;
    if (e == 0) {
        v = ldexpf((float)f, -24);
    } else if (e == 31) {
        v = f ? NAN : INFINITY;
    } else {
        v = ldexpf((float)(f | 0x400u), (int)e - 25);
    }
    return sign ? -v : v;
}

static size_t dtype_bytes(int32_t dtype) { return dtype == KDT_DTYPE_FLOAT32 ? 4 : 2; }
static const char* dtype_name(int32_t dtype) {
    return dtype == KDT_DTYPE_FLOAT32 ? "float32" : dtype == KDT_DTYPE_FLOAT16 ? "float16" : "bfloat16";
}
// Rounds x to the dtype and returns the exact value; *bits gets its encoding.
static float quantize(int32_t dtype, float x, uint32_t* bits) {
    if (dtype == KDT_DTYPE_FLOAT32) {
        *bits = f32_bits(x);
        return x;
    }
    if (dtype == KDT_DTYPE_BFLOAT16) {
        const uint16_t h = bf16_encode(x);
        *bits = h;
        return bf16_decode(h);
    }
    const uint16_t h = f16_encode(x);
    *bits = h;
    return f16_decode(h);
}

// ---- row contents ---------------------------------------------------------------------

enum {
    kNormal, kPeaked, kTies, kAllEqual, kMasked, kSparse, kLarge, kNaN, kPosInf, kAllNegInf, kSomeNegInf,
    kNegInfHead, kAscending, kDescending, kHuge, kHugeNeg, kSignedZeros, kFullBuffer, kKinds
};
static const char* kKindNames[] = {"normal", "peaked", "ties",    "all-equal", "masked", "sparse", "large",
                                   "nan",    "+inf",   "all-inf", "some-inf",  "inf-head",
                                   "ascending", "descending", "huge", "huge-negative", "signed-zeros",
                                   "full-buffer"};

// kFullBuffer fills the row kernel's candidate buffer to its capacity exactly, for a 16-bit
// dtype, a row on a 16-byte boundary and k = 128. The kernel (128 threads) buffers vector
// keys (a vector: 8 logits), 3 x 128 + 4 x 256 = 1,408 of them; a trip appends the keys of
// its vectors whose key is above tau, and after trips 0, 4, 8, ... a refine runs when the
// buffer holds more than refine_at = 384 keys. Trip t holds vectors (2t + j) * 128 +
// thread, columns vector * 8 + e; the row has 9 trips.
//   trip 0: every thread's vector j = 0 has one 1.0, so t0 = 1.0; those 128 vectors'
//           keys are appended;
//   trip 1: every vector has a 1.0 at e = 0 and ranks above tau = key(1.0, 2^32 - 1) - 1:
//           256 keys, 384 in all;
//   trips 2-4: nothing (-1.0); 384 keys at the check after trip 4, not above refine_at;
//   trips 5-8: every logit is 2.0: 1,024 keys, 1,408, the buffer's size, at the check after
//           trip 8, where the refine runs.
static const int64_t kFullBufferTrips = 9;
static double full_buffer_logit(int64_t col) {
    const int64_t e = col % 8, vec = col / 8, trip = vec / 256, j = (vec / 128) % 2;
    if (trip == 0) return j == 0 && e == 0 ? 1.0 : -1.0;
    if (trip == 1) return e == 0 ? 1.0 : -1.0;
    return trip >= 5 ? 2.0 : -1.0;
}

static void make_row(float* x, int64_t V, int64_t K, int kind) {
    const double scale = 0.5 + 3.0 * unit();
    for (int64_t v = 0; v < V; v++) {
        double y;
        switch (kind) {
            case kPeaked: y = normal() - 8.0; break;
            case kTies: y = (double)uniform(-3, 3); break;
            case kAllEqual: y = 1.5; break;
            case kMasked: y = unit() < 0.95 ? -INFINITY : scale * normal(); break;
            case kSparse: y = -INFINITY; break;
            case kLarge: y = 40.0 + scale * normal(); break;
            case kAllNegInf: y = -INFINITY; break;
            case kSomeNegInf: y = unit() < 0.1 ? -INFINITY : scale * normal(); break;
            case kNegInfHead: y = v < 100 ? -INFINITY : scale * normal(); break;
            // Sorted rows: ascending makes every element a new maximum (the row kernel's
            // running threshold trails the whole row); descending settles it at once.
            case kAscending: y = -8.0 + 16.0 * (double)v / (double)V; break;
            case kDescending: y = 8.0 - 16.0 * (double)v / (double)V; break;
            // |max| above FLT_MAX / log2 e: the row kernel's m log2 e overflows and it
            // sums the row again (float16 rounds these to +-inf: bad rows there).
            case kHuge: y = (unit() < 0.5 ? 3.0e38 : -3.0e38) * (0.9 + 0.1 * unit()); break;
            case kHugeNeg: y = -3.0e38 * (0.9 + 0.1 * unit()); break;
            // -0 and +0 at random, a few negative logits: the top k tie at zero and go by
            // lower id whatever the sign (the order key alone would put every +0 first).
            case kSignedZeros: y = unit() < 0.1 ? -1.0 - unit() : (unit() < 0.5 ? -0.0 : 0.0); break;
            case kFullBuffer: y = full_buffer_logit(v); break;
            default: y = scale * normal(); break;
        }
        x[v] = (float)y;
    }
    if (kind == kPeaked) x[uniform(0, V - 1)] = 5.0f;
    if (kind == kSparse) {  // fewer finite logits than k (when k > 1): -inf fills the rest by id
        const int64_t finite = K / 2 + 1 < V ? K / 2 + 1 : V;
        for (int64_t i = 0; i < finite; i++) x[uniform(0, V - 1)] = (float)normal();
    }
    if (kind == kNaN) x[uniform(0, V - 1)] = NAN;
    if (kind == kPosInf) x[uniform(0, V - 1)] = INFINITY;
}

// ---- the reference --------------------------------------------------------------------

struct RowRef {
    int32_t status;
    double max, log_sum;  // logsumexp = max + log_sum, kept apart so that x - max is exact at any scale
    std::vector<int32_t> order;  // the top min(V, 1024) ids, (value desc, id asc)
};

static RowRef reference(const float* x, int64_t V) {
    RowRef r;
    r.status = KDT_OK;
    r.max = 0;
    r.log_sum = 0;
    bool finite = false;
    double m = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
        if (isnan(x[v]) || (isinf(x[v]) && x[v] > 0)) r.status = KDT_ERR_VALUE;
        if (x[v] > -INFINITY) finite = true;
        if (x[v] > m) m = x[v];
    }
    if (!finite) r.status = KDT_ERR_VALUE;
    if (r.status != KDT_OK) return r;
    double sum = 0.0;
    for (int64_t v = 0; v < V; v++) sum += exp((double)x[v] - m);
    r.max = m;
    r.log_sum = log(sum);
    std::vector<int32_t> idx((size_t)V);
    for (int64_t v = 0; v < V; v++) idx[(size_t)v] = (int32_t)v;
    const int64_t top = V < 1024 ? V : 1024;
    std::partial_sort(idx.begin(), idx.begin() + top, idx.end(), [&](int32_t a, int32_t b) {
        return x[a] > x[b] || (x[a] == x[b] && a < b);
    });
    r.order.assign(idx.begin(), idx.begin() + top);
    return r;
}

// ---- one launch ---------------------------------------------------------------------------

struct Shape {
    int32_t dtype;
    int64_t B, L, V;
    int64_t row_pad;    // row_stride = V + row_pad (or 0 when broadcast)
    int64_t batch_pad;  // batch_stride = L * row_stride + batch_pad
    int64_t offset;     // elements before the tensor's first element (misalignment)
    bool broadcast;     // row_stride = batch_stride = 0: every row is row 0
};

static int mismatched_rows = 0;
static int launches = 0;

// Logits on the device plus the host copy of each row's exact values.
struct Tensor {
    kdt_logits desc;
    void* base;                   // device allocation
    std::vector<float> values;    // [rows, V] exact values
    std::vector<int> kinds;       // [rows]
    std::vector<RowRef> refs;     // [rows]
};

static void make_tensor(const Shape& sh, int kind_base, Tensor* t) {
    const int64_t rows = sh.B * sh.L, V = sh.V;
    const int64_t row_stride = sh.broadcast ? 0 : V + sh.row_pad;
    const int64_t batch_stride = sh.broadcast ? 0 : sh.L * row_stride + sh.batch_pad;
    const int64_t span = sh.offset + (sh.B - 1) * batch_stride + (sh.L - 1) * row_stride + V;
    const size_t es = dtype_bytes(sh.dtype);
    std::vector<unsigned char> image((size_t)span * es, 0xFF);  // NaN in every gap
    t->values.assign((size_t)(rows * V), 0.0f);
    t->kinds.assign((size_t)rows, 0);
    std::vector<float> raw((size_t)V);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / sh.L, l = r % sh.L;
        float* dst = &t->values[(size_t)(r * V)];
        if (sh.broadcast && r > 0) {
            memcpy(dst, &t->values[0], (size_t)V * sizeof(float));
            t->kinds[(size_t)r] = t->kinds[0];
            continue;
        }
        const int kind = (kind_base + (int)r) % kKinds;
        t->kinds[(size_t)r] = kind;
        make_row(raw.data(), V, 1024, kind);
        unsigned char* row = &image[(size_t)(sh.offset + b * batch_stride + l * row_stride) * es];
        for (int64_t v = 0; v < V; v++) {
            uint32_t bits;
            dst[v] = quantize(sh.dtype, raw[(size_t)v], &bits);
            memcpy(row + (size_t)v * es, &bits, es);
        }
    }
    t->refs.resize((size_t)rows);
    for (int64_t r = 0; r < rows; r++) t->refs[(size_t)r] = reference(&t->values[(size_t)(r * V)], V);
    CUDA_OK(cudaMalloc(&t->base, image.size()));
    CUDA_OK(cudaMemcpy(t->base, image.data(), image.size(), cudaMemcpyHostToDevice));
    t->desc.data = (const char*)t->base + (size_t)sh.offset * es;
    t->desc.dtype = sh.dtype;
    t->desc.reserved = 0;
    t->desc.batch = sh.B;
    t->desc.length = sh.L;
    t->desc.vocab = V;
    t->desc.batch_stride = batch_stride;
    t->desc.row_stride = row_stride;
}

// Compares one call's outputs with the reference; returns the number of bad rows.
static int compare(const Tensor& t, int64_t K, const std::vector<float>& lp, const std::vector<int32_t>& ids,
                   const std::vector<int32_t>& status, const char* what) {
    const int64_t rows = t.desc.batch * t.desc.length, V = t.desc.vocab;
    int bad_rows = 0;
    for (int64_t r = 0; r < rows; r++) {
        const RowRef& ref = t.refs[(size_t)r];
        const float* x = &t.values[(size_t)(r * V)];
        char why[256] = "";
        if (status[(size_t)r] != ref.status) {
            snprintf(why, sizeof why, "status %d, expected %d", status[(size_t)r], ref.status);
        } else {
            for (int64_t i = 0; i < K && !why[0]; i++) {
                const float got = lp[(size_t)(r * K + i)];
                const int32_t id = ids[(size_t)(r * K + i)];
                if (ref.status != KDT_OK) {
                    if (!isnan(got) || id != (int32_t)i) {
                        snprintf(why, sizeof why, "bad row, rank %lld: %g id %d (want NaN, id %lld)", (long long)i,
                                 got, id, (long long)i);
                    }
                    continue;
                }
                if (id < 0 || id >= V) {
                    snprintf(why, sizeof why, "rank %lld: id %d outside [0, %lld)", (long long)i, id, (long long)V);
                    continue;
                }
                const int32_t want_id = ref.order[(size_t)i];
                const double want = (double)(float)(((double)x[want_id] - ref.max) - ref.log_sum);
                if (id != want_id) {
                    snprintf(why, sizeof why, "rank %lld: id %d (value %.9g), expected %d (value %.9g)", (long long)i,
                             id, x[id], want_id, x[want_id]);
                } else if (isinf(want) ? got != want
                                       : !(fabs((double)got - want) <= 2e-6 * fabs(want) + 2e-6)) {
                    snprintf(why, sizeof why, "rank %lld (id %d): log-prob %.9g, expected %.9g", (long long)i, id,
                             got, want);
                }
            }
        }
        if (why[0]) {
            if (mismatched_rows < 12) {
                fprintf(stderr, "%s, row %lld (%s): %s\n", what, (long long)r, kKindNames[t.kinds[(size_t)r]], why);
            }
            mismatched_rows++;
            bad_rows++;
        }
    }
    return bad_rows;
}

struct Device {
    void* ws;
    size_t ws_cap;
    float* lp;
    int32_t* ids;
    int32_t* status;
    size_t out_cap;   // rows * k capacity
    size_t rows_cap;
    cudaStream_t stream;
};

static void ensure(Device* d, int64_t rows, int64_t K, size_t ws_bytes) {
    if (ws_bytes > d->ws_cap) {
        if (d->ws) CUDA_OK(cudaFree(d->ws));
        CUDA_OK(cudaMalloc(&d->ws, ws_bytes));
        d->ws_cap = ws_bytes;
    }
    const size_t cells = (size_t)(rows * (K > 0 ? K : 1));
    if (cells > d->out_cap) {
        if (d->lp) CUDA_OK(cudaFree(d->lp));
        if (d->ids) CUDA_OK(cudaFree(d->ids));
        CUDA_OK(cudaMalloc(&d->lp, cells * 4));
        CUDA_OK(cudaMalloc(&d->ids, cells * 4));
        d->out_cap = cells;
    }
    if ((size_t)rows > d->rows_cap) {
        if (d->status) CUDA_OK(cudaFree(d->status));
        CUDA_OK(cudaMalloc(&d->status, (size_t)rows * 4));
        d->rows_cap = (size_t)rows;
    }
}

// Runs one k on a tensor (outputs and workspace poisoned first) and compares.
static void run_case(Device* d, const Tensor& t, int64_t K, const char* label) {
    const int64_t rows = t.desc.batch * t.desc.length;
    size_t ws_bytes = 0;
    KDT_OK_OR_DIE(kdt_topk_logprobs_cuda_workspace_bytes(rows, t.desc.vocab, K, &ws_bytes));
    ensure(d, rows, K, ws_bytes);
    CUDA_OK(cudaMemset(d->ws, 0xA5, d->ws_cap));
    CUDA_OK(cudaMemset(d->lp, 0x7B, d->out_cap * 4));
    CUDA_OK(cudaMemset(d->ids, 0x7B, d->out_cap * 4));
    CUDA_OK(cudaMemset(d->status, 0x7B, d->rows_cap * 4));
    KDT_OK_OR_DIE(kdt_topk_logprobs_cuda(&t.desc, K, d->lp, d->ids, d->status, d->ws, ws_bytes, d->stream));
    CUDA_OK(cudaStreamSynchronize(d->stream));
    std::vector<float> lp((size_t)(rows * K));
    std::vector<int32_t> ids((size_t)(rows * K)), status((size_t)rows);
    CUDA_OK(cudaMemcpy(lp.data(), d->lp, lp.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ids.data(), d->ids, ids.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(status.data(), d->status, status.size() * 4, cudaMemcpyDeviceToHost));
    char what[200];
    snprintf(what, sizeof what, "%s %s B=%lld L=%lld V=%lld k=%lld strides (%lld, %lld)", label,
             dtype_name(t.desc.dtype), (long long)t.desc.batch, (long long)t.desc.length, (long long)t.desc.vocab,
             (long long)K, (long long)t.desc.batch_stride, (long long)t.desc.row_stride);
    const int bad = compare(t, K, lp, ids, status, what);
    launches++;
    harness_checks++;
    if (bad) harness_failures++;
}

// ---- logits up to float32's largest ------------------------------------------------------

// A float32 [1, rows, V] tensor of the given rows (row-major, rows * V values).
static void tensor_of_rows(const std::vector<float>& values, int64_t rows, int64_t V, Tensor* t) {
    t->values = values;
    t->kinds.assign((size_t)rows, kLarge);
    t->refs.resize((size_t)rows);
    for (int64_t r = 0; r < rows; r++) t->refs[(size_t)r] = reference(&t->values[(size_t)(r * V)], V);
    CUDA_OK(cudaMalloc(&t->base, values.size() * 4));
    CUDA_OK(cudaMemcpy(t->base, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
    t->desc.data = t->base;
    t->desc.dtype = KDT_DTYPE_FLOAT32;
    t->desc.reserved = 0;
    t->desc.batch = 1;
    t->desc.length = rows;
    t->desc.vocab = V;
    t->desc.batch_stride = rows * V;
    t->desc.row_stride = V;
}

// Rows whose log-probs need (x - m) - log S, never x - (m + log S): six equal 6.17e16, ties
// at 1e12, +-FLT_MAX, all -3.4e38, mixed signs (padded with -inf to V), and random rows
// around large offsets (1e4 .. 1e12, +-), where the row kernel's log S correction for its
// float32 c = m log2 e must be exact (c_max ln 2 - m was 1.3e-8 |m| off: 0.013 at 1e6).
// Each at k = 8 and 64 (the row kernel) and 129 (the chunk kernels).
static void extreme_rows(Device* d, int64_t V) {
    const float big = 6.17e16f, t12 = 1e12f, sp = 65536.0f, fm = FLT_MAX, ninf = -INFINITY;
    const float heads[][8] = {
        {big, big, big, big, big, big, ninf, ninf},
        {t12, t12, t12, t12 - sp, t12 - 2 * sp, -t12, 0.0f, ninf},
        {fm, fm, -fm, 0.0f, ninf, fm / 2, -fm, 1.0f},
        {-fm, -fm, -fm, -fm, ninf, ninf, ninf, ninf},
        {-3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f},
        {3.4e38f, -3.4e38f, 1e38f, -1e38f, 3.4e38f, 0.0f, 1e-38f, -3.4e38f},
        {1e6f, 1e6f + 1.0f, 1e6f - 2.0f, 1e6f + 0.5f, -1e6f, 1e6f, 1e6f - 0.0625f, 1e6f + 3.0f},
    };
    const double offsets[] = {30.0, 1e4, 1e6, -1e6, 3e7, 9e7, 1e9, -1e9, 1e12, 3e38};
    const int64_t n_heads = (int64_t)(sizeof heads / sizeof heads[0]);
    const int64_t n_off = (int64_t)(sizeof offsets / sizeof offsets[0]);
    const int64_t rows = n_heads + n_off;
    std::vector<float> values((size_t)(rows * V), -INFINITY);
    for (int64_t r = 0; r < n_heads; r++) {
        for (int64_t i = 0; i < 8 && i < V; i++) values[(size_t)(r * V + i)] = heads[r][i];
    }
    for (int64_t j = 0; j < n_off; j++) {
        const double off = offsets[j];
        const float o = (float)fabs(off);
        const double spacing = (double)(nextafterf(o, INFINITY) - o);
        const double spread = spacing * 2 > 3.0 ? spacing * 2 : 3.0;
        float* x = &values[(size_t)((n_heads + j) * V)];
        for (int64_t v = 0; v < V; v++) x[v] = (float)(off + spread * normal());
        for (int i = 0; i < 5; i++) x[uniform(0, V - 1)] = (float)(off + 4 * spread);  // ties at the top
    }
    Tensor t;
    tensor_of_rows(values, rows, V, &t);
    for (int64_t K : {8, 64, 129}) {
        if (K <= V) run_case(d, t, K, "extreme logits");
    }
    CUDA_OK(cudaFree(t.base));
}

// ---- host-side checks ---------------------------------------------------------------------

static void host_checks(Device* d) {
    size_t ws = 0;
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(4, 100, 8, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(-1, 100, 8, &ws), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(4, -1, 0, &ws), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(4, 100, -1, &ws), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(4, 100, 101, &ws), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("vocab");
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(4, 5000, 1025, &ws), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("1024");
    CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(INT64_MAX / 2, INT32_MAX, 1024, &ws), KDT_ERR_OVERFLOW);
    CHECK_OK(kdt_topk_logprobs_cuda_workspace_bytes(0, 100, 8, &ws));
    CHECK_EQ(ws, 0);
    size_t ws1 = 0, ws2 = 0;
    CHECK_OK(kdt_topk_logprobs_cuda_workspace_bytes(1, 151936, 64, &ws1));
    CHECK_OK(kdt_topk_logprobs_cuda_workspace_bytes(2, 151936, 64, &ws2));
    CHECK(ws1 > 0 && ws1 % 256 == 0 && ws2 >= ws1);

    // A valid description of a real tensor; each case breaks one thing and must return its
    // status without launching (the outputs keep their sentinel).
    const int64_t B = 2, L = 3, V = 300, K = 8;
    void* data;
    CUDA_OK(cudaMalloc(&data, (size_t)(B * L * V) * 2 + 64));
    CUDA_OK(cudaMemset(data, 0, (size_t)(B * L * V) * 2 + 64));
    kdt_logits good;
    good.data = data;
    good.dtype = KDT_DTYPE_BFLOAT16;
    good.reserved = 0;
    good.batch = B;
    good.length = L;
    good.vocab = V;
    good.batch_stride = L * V;
    good.row_stride = V;
    KDT_OK_OR_DIE(kdt_topk_logprobs_cuda_workspace_bytes(B * L, V, K, &ws));
    ensure(d, B * L, K, ws);
    const int32_t sentinel = 0x7B7B7B7B;
    CUDA_OK(cudaMemset(d->status, 0x7B, d->rows_cap * 4));
    CUDA_OK(cudaMemset(d->ids, 0x7B, d->out_cap * 4));
    auto untouched = [&]() {
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<int32_t> st((size_t)(B * L)), id((size_t)(B * L * K));
        CUDA_OK(cudaMemcpy(st.data(), d->status, st.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(id.data(), d->ids, id.size() * 4, cudaMemcpyDeviceToHost));
        for (int32_t v : st) {
            if (v != sentinel) return false;
        }
        for (int32_t v : id) {
            if (v != sentinel) return false;
        }
        return true;
    };
    kdt_logits l = good;
    CHECK_STATUS(kdt_topk_logprobs_cuda(NULL, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_NULL_POINTER);
    l.dtype = KDT_DTYPE_FLOAT64;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("dtype");
    l = good;
    l.reserved = 1;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    l = good;
    l.row_stride = -1;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    l = good;
    l.data = NULL;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_NULL_POINTER);
    l = good;
    l.data = (const char*)data + 1;  // not aligned to its 2-byte elements
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("aligned");
    l = good;
    l.vocab = 0;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, 0, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    l.vocab = (int64_t)INT32_MAX + 1;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    l = good;
    l.batch_stride = INT64_MAX / 2;
    CHECK_STATUS(kdt_topk_logprobs_cuda(&l, K, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_OVERFLOW);
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, V + 1, d->lp, d->ids, d->status, d->ws, ws, NULL),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("vocab");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, 1025, d->lp, d->ids, d->status, d->ws, ws, NULL),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, -1, d->lp, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, NULL, d->ids, d->status, d->ws, ws, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("out_logprobs");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, d->lp, NULL, d->status, d->ws, ws, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("out_ids");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, d->lp, d->ids, NULL, d->ws, ws, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("row_status");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, d->lp, d->ids, d->status, NULL, ws, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("workspace");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, d->lp, d->ids, d->status, d->ws, ws - 1, NULL),
                 KDT_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, d->lp, d->ids, d->status, (char*)d->ws + 16, ws, NULL),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("256-byte");
    CHECK_STATUS(kdt_topk_logprobs_cuda(&good, K, (float*)((char*)d->lp + 2), d->ids, d->status, d->ws, ws, NULL),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK(untouched());
    // An empty tensor needs nothing (no pointers, no workspace) and launches nothing.
    l = good;
    l.batch = 0;
    l.data = NULL;
    l.vocab = 0;
    CHECK_OK(kdt_topk_logprobs_cuda(&l, 0, NULL, NULL, NULL, NULL, 0, NULL));
    l = good;
    l.length = 0;
    CHECK_OK(kdt_topk_logprobs_cuda(&l, 5, NULL, NULL, NULL, NULL, 0, NULL));
    CHECK(untouched());
    CUDA_OK(cudaFree(data));
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    set_forced_paths(argc, argv);
    const char* quick_env = getenv("KDT_CUDA_QUICK");
    const bool quick = quick_env != NULL && atoi(quick_env) != 0;
    Device d;
    memset(&d, 0, sizeof d);
    CUDA_OK(cudaStreamCreate(&d.stream));
    host_checks(&d);

    const int32_t dtypes[] = {KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16};
    const int64_t vocabs_full[] = {1, 7, 1025, 8193, 151936, 262144};
    const int64_t vocabs_quick[] = {1, 7, 1025, 20000};
    const int64_t ks[] = {1, 2, 64, 128, 129, 1024};  // 128: the row kernel's largest k
    const int64_t* vocabs = quick ? vocabs_quick : vocabs_full;
    const int n_vocabs = quick ? 4 : 6;
    for (int di = 0; di < 3; di++) {
        for (int vi = 0; vi < n_vocabs; vi++) {
            const int64_t V = vocabs[vi];
            // Shapes rotate: contiguous, padded rows and batches, misaligned start, broadcast.
            Shape sh;
            sh.dtype = dtypes[di];
            sh.V = V;
            sh.B = V >= 100000 ? 2 : 3;
            sh.L = quick ? 4 : (V >= 100000 ? 6 : 8);
            sh.row_pad = 0;
            sh.batch_pad = 0;
            sh.offset = 0;
            sh.broadcast = false;
            switch ((di + vi) % 4) {
                case 1: sh.row_pad = 1 + (int64_t)uniform(0, 12); sh.batch_pad = 5; break;
                case 2: sh.offset = uniform(1, 7); sh.row_pad = uniform(0, 3); break;
                case 3: sh.offset = uniform(0, 7); sh.row_pad = 8; sh.batch_pad = 2 * V + 3; break;
                default: break;
            }
            Tensor t;
            make_tensor(sh, di * 5 + vi, &t);
            for (int64_t K : ks) {
                if (K > V) continue;
                run_case(&d, t, K, "topk");
            }
            CUDA_OK(cudaFree(t.base));
        }
    }

    extreme_rows(&d, 1025);
    if (!quick) extreme_rows(&d, 8193);

    // The row that fills the row kernel's buffer exactly (k = 128, 16-bit dtypes).
    for (int32_t dtype : {KDT_DTYPE_BFLOAT16, KDT_DTYPE_FLOAT16}) {
        Shape sh = {dtype, 1, 1, kFullBufferTrips * 2048, 0, 0, 0, false};
        Tensor t;
        make_tensor(sh, kFullBuffer, &t);
        run_case(&d, t, 128, "full buffer");
        CUDA_OK(cudaFree(t.base));
    }

    // More requests than a grid's y dimension holds (65,535): the row kernel's blocks loop
    // over requests (and the chunk kernels over their 1-D grid).
    {
        Shape sh = {KDT_DTYPE_FLOAT32, 70000, 1, 9, 0, 0, 0, false};
        Tensor t;
        make_tensor(sh, 0, &t);
        run_case(&d, t, 3, "many requests");
        CUDA_OK(cudaFree(t.base));
    }

    // A broadcast row (strides 0), k = 0 (only row_status), the benchmark shape (fewer rows).
    {
        Shape sh = {KDT_DTYPE_BFLOAT16, 2, 3, 5000, 0, 0, 3, true};
        Tensor t;
        make_tensor(sh, 0, &t);
        run_case(&d, t, 64, "broadcast");
        run_case(&d, t, 0, "k=0");
        CUDA_OK(cudaFree(t.base));
    }
    {
        Shape sh = {KDT_DTYPE_BFLOAT16, quick ? 1 : 4, quick ? 2 : 16, 151936, 0, 0, 0, false};
        Tensor t;
        make_tensor(sh, 0, &t);
        run_case(&d, t, 64, "bench shape");
        if (!quick) run_case(&d, t, 1024, "bench shape");

        // The same call captured in a CUDA graph and replayed (twice: the workspace's old
        // contents must not matter).
        const int64_t K = 64, rows = sh.B * sh.L;
        size_t ws_bytes = 0;
        KDT_OK_OR_DIE(kdt_topk_logprobs_cuda_workspace_bytes(rows, sh.V, K, &ws_bytes));
        ensure(&d, rows, K, ws_bytes);
        CUDA_OK(cudaMemset(d.ids, 0x7B, d.out_cap * 4));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamBeginCapture(d.stream, cudaStreamCaptureModeThreadLocal));
        const kdt_status st = kdt_topk_logprobs_cuda(&t.desc, K, d.lp, d.ids, d.status, d.ws, ws_bytes, d.stream);
        CUDA_OK(cudaStreamEndCapture(d.stream, &graph));
        CHECK_OK(st);
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        for (int rep = 0; rep < 2; rep++) {
            CUDA_OK(cudaGraphLaunch(exec, d.stream));
            CUDA_OK(cudaStreamSynchronize(d.stream));
            std::vector<float> lp((size_t)(rows * K));
            std::vector<int32_t> ids((size_t)(rows * K)), status((size_t)rows);
            CUDA_OK(cudaMemcpy(lp.data(), d.lp, lp.size() * 4, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(ids.data(), d.ids, ids.size() * 4, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(status.data(), d.status, status.size() * 4, cudaMemcpyDeviceToHost));
            launches++;
            harness_checks++;
            if (compare(t, K, lp, ids, status, "graph replay")) harness_failures++;
        }
        CUDA_OK(cudaGraphExecDestroy(exec));
        CUDA_OK(cudaGraphDestroy(graph));
        CUDA_OK(cudaFree(t.base));
    }

    printf("cuda top-k: %d launches compared with the float64 reference, %d mismatched rows\n", launches,
           mismatched_rows);
    CUDA_OK(cudaStreamDestroy(d.stream));
    if (d.ws) CUDA_OK(cudaFree(d.ws));
    if (d.lp) CUDA_OK(cudaFree(d.lp));
    if (d.ids) CUDA_OK(cudaFree(d.ids));
    if (d.status) CUDA_OK(cudaFree(d.status));
    HARNESS_EXIT();
}
