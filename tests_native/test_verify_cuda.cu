// The GPU verification walks (native/cuda/verify_cuda.cu) against the CPU walk
// (kdt_verify_greedy_cpu, itself checked against the Python reference by test_verify):
//  (a) kdt_verify_greedy_cuda, request by request, on thousands of random trees
//      (kdt_trees_build_cpu on random drafts) with target tokens biased so walks go deep,
//      stop tokens (short and > 32-entry lists), caps (none, 0, 1, 2, small, INT64_MAX),
//      path capacities (some too small), budgets past the shared-memory staging limit, and
//      bad requests (broken links, num_nodes out of range, negative targets and caps,
//      garbage in padding rows, rewired but in-range links) mixed with good ones: each
//      request's status is the CPU's verdict for it alone, its neighbours unaffected;
//  (b) kdt_verify_greedy_from_logits_cuda in float32, float16 and bfloat16, contiguous and
//      strided / misaligned layouts (padding elements are NaN, so a read outside a row
//      shows), V from 1 to 151,936: planted maxima (often a child's token), exact ties
//      (lower id wins; -0 ties with +0), +inf and -inf logits, NaN in a visited row
//      (KDT_ERR_VALUE) and in unvisited rows (no effect: only visited rows are read),
//      against a host argmax and the CPU walk, target_tokens included;
//  (c) kdt_verify_sample_from_logits_cuda: the same outputs on a repeated call and for a
//      differently aligned copy of the logits; different offsets (low or high 32 bits) or
//      seeds give different draws; every draw at a visited node reproduced on the host
//      from the documented formula evaluated in float64 (Philox4x32-10 written here and
//      checked against the Random123 known-answer vectors); the walk of the drawn tokens
//      equals the CPU walk; a chi-square goodness-of-fit test of the draws against
//      softmax(logits / T) for V = 16 and T in {0.5, 1, 2} at the root and at a deeper
//      node (critical values at p = 1e-6, so a correct kernel fails with probability
//      ~1e-6 per test; the seeds are fixed, so the outcome is deterministic); a -inf
//      logit never drawn; NaN, +inf and all -inf rows give KDT_ERR_VALUE;
//  plus the host-side argument checks, and all three calls captured in a CUDA graph.
// KDT_CUDA_QUICK=1 shrinks it (for compute-sanitizer). Exits 77 (skipped) without a GPU.
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kdtree.h"
#define KDT_TEST_SEED 0x2545F4914F6CDD1Dull
#define KDT_TEST_EXPECT
#include "cuda_harness.h"

static cudaStream_t g_stream;

// ---- Random numbers (xorshift64; fixed seed, so every run is the same) ----------------

static float normal() {
    const double u = unit() + 1e-12, v = unit();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

// ---- Float formats ------------------------------------------------------------------

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static float f32_from(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static uint16_t f32_to_bf16(float x) {  // round to nearest even
    uint32_t u = f32_bits(x);
    if (isnan(x)) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf16_to_f32(uint16_t h) { return f32_from((uint32_t)h << 16); }
static uint16_t f32_to_f16(float f) {  // round to nearest even
    const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xFFu;
    uint32_t man = x & 0x7FFFFFu;
    if (exp == 0xFFu) return (uint16_t)(sign | 0x7C00u | (man ? 0x200u : 0u));
    const int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7C00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        const int shift = 14 - e;
        uint32_t h = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rem = man & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {
        const float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 31) return f32_from(sign | 0x7F800000u | (man << 13));
    return f32_from(sign | ((exp - 15 + 127) << 23) | (man << 13));
}
static size_t dtype_bytes(int32_t dtype) { return dtype == KDT_DTYPE_FLOAT32 ? 4 : 2; }
// x as the dtype stores it.
static float round_to(int32_t dtype, float x) {
    if (dtype == KDT_DTYPE_FLOAT16) return f16_to_f32(f32_to_f16(x));
    if (dtype == KDT_DTYPE_BFLOAT16) return bf16_to_f32(f32_to_bf16(x));
    return x;
}
static const char* dtype_name(int32_t dtype) {
    return dtype == KDT_DTYPE_FLOAT32 ? "float32" : dtype == KDT_DTYPE_FLOAT16 ? "float16" : "bfloat16";
}

// ---- Device buffers -----------------------------------------------------------------

struct DevBuf {
    void* ptr = nullptr;
    size_t cap = 0;
};
static void* reserve(DevBuf& d, size_t bytes) {
    if (bytes < 256) bytes = 256;
    if (bytes > d.cap) {
        if (d.ptr != nullptr) CUDA_OK(cudaFree(d.ptr));
        CUDA_OK(cudaMalloc(&d.ptr, bytes));
        d.cap = bytes;
    }
    return d.ptr;
}
static void release(DevBuf& d) {
    if (d.ptr != nullptr) CUDA_OK(cudaFree(d.ptr));
    d.ptr = nullptr;
    d.cap = 0;
}
template <class T>
static T* upload(DevBuf& d, const std::vector<T>& v) {
    T* p = static_cast<T*>(reserve(d, v.size() * sizeof(T)));
    if (!v.empty()) CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
template <class T>
static std::vector<T> download(const T* p, size_t n) {
    std::vector<T> v(n);
    if (n > 0) CUDA_OK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

// ---- Trees --------------------------------------------------------------------------

struct Trees {
    int64_t B = 0, N = 0;
    std::vector<int32_t> num, tok, fc, ns;
    int64_t rows() const { return N + 1; }
};

// B trees from random drafts (depth L, width K <= vocab): peaked (deep chains), flat
// (wide) and mixed rows, sometimes with -inf tails.
static Trees random_trees(int64_t B, int64_t N, int64_t L, int64_t K, int64_t vocab) {
    Trees t;
    t.B = B;
    t.N = N;
    t.num.assign(B, -7);
    t.tok.assign(B * (N + 1), -7);
    t.fc.assign(B * (N + 1), -7);
    t.ns.assign(B * (N + 1), -7);
    std::vector<float> lp(B * L * K);
    std::vector<int32_t> ids(B * L * K), roots(B), perm(vocab);
    for (int64_t v = 0; v < vocab; v++) perm[v] = (int32_t)v;
    for (int64_t b = 0; b < B; b++) {
        const int kind = unit() < 0.5 ? 0 : (int)uniform(1, 2);
        roots[b] = (int32_t)uniform(0, vocab - 1);
        for (int64_t d = 0; d < L; d++) {
            float* row = &lp[(b * L + d) * K];
            for (int64_t r = 0; r < K; r++) {
                const int64_t j = uniform(r, vocab - 1);
                std::swap(perm[r], perm[j]);
                ids[(b * L + d) * K + r] = perm[r];
                row[r] = kind == 0   ? (r == 0 ? -0.05f * (float)unit() : -4.0f - 4.0f * (float)unit())
                         : kind == 1 ? -logf((float)K) + 0.3f * normal()
                                     : -2.0f * fabsf(normal());
            }
            for (int64_t r = 0; r < K; r++) row[r] = fminf(row[r], 0.0f);  // log-probs: <= 0
            std::sort(row, row + K, [](float a, float c) { return a > c; });
            if (unit() < 0.1) {
                for (int64_t r = uniform(1, K); r < K; r++) row[r] = -INFINITY;
            }
        }
    }
    kdt_draft d = {B, L, K, lp.data(), ids.data(), roots.data(), NULL, vocab, -1};
    kdt_trees out;
    memset(&out, 0, sizeof out);
    out.batch = B;
    out.budget = N;
    out.num_nodes = t.num.data();
    out.tokens = t.tok.data();
    out.first_child = t.fc.data();
    out.next_sibling = t.ns.data();
    KDT_OK_OR_DIE(kdt_trees_build_cpu(&d, &out, NULL, 0));
    return t;
}

// Children of node i (a valid tree), in list order.
static std::vector<int32_t> children(const Trees& t, int64_t b, int32_t i) {
    std::vector<int32_t> c;
    const int64_t base = b * t.rows();
    for (int32_t x = t.fc[base + i]; x != -1; x = t.ns[base + x]) c.push_back(x);
    return c;
}

// Request b alone, as a batch of one for the CPU walk.
static kdt_trees one_tree(Trees& t, int64_t b) {
    kdt_trees o;
    memset(&o, 0, sizeof o);
    o.batch = 1;
    o.budget = t.N;
    o.num_nodes = &t.num[b];
    o.tokens = &t.tok[b * t.rows()];
    o.first_child = &t.fc[b * t.rows()];
    o.next_sibling = &t.ns[b * t.rows()];
    return o;
}

struct DevTrees {
    DevBuf num, tok, fc, ns;
};
static kdt_trees upload_trees(DevTrees& d, const Trees& t) {
    kdt_trees o;
    memset(&o, 0, sizeof o);
    o.batch = t.B;
    o.budget = t.N;
    o.num_nodes = upload(d.num, t.num);
    o.tokens = upload(d.tok, t.tok);
    o.first_child = upload(d.fc, t.fc);
    o.next_sibling = upload(d.ns, t.ns);
    return o;
}
static void release(DevTrees& d) {
    release(d.num);
    release(d.tok);
    release(d.fc);
    release(d.ns);
}

// Breaks (or, kinds 7 and 8, only disturbs) request b. targets may be NULL (logits tests).
static void corrupt(Trees& t, int64_t b, std::vector<int32_t>* targets, std::vector<int64_t>* caps) {
    const int64_t base = b * t.rows();
    const int32_t n = t.num[b];
    switch (uniform(0, 8)) {
        case 0: t.num[b] = (int32_t)t.N + 1; break;                       // num_nodes past N
        case 1: t.num[b] = -1; break;                                       // negative num_nodes
        case 2: { const int32_t i = (int32_t)uniform(0, n); t.fc[base + i] = i; break; }  // not a later node
        case 3: t.ns[base] = n >= 1 ? 1 : 3; break;                         // the root has a sibling
        case 4: {
            const int32_t i = (int32_t)uniform(0, n);
            if (i > 0) t.ns[base + i] = n + 1;  // a sibling past num_nodes
            else t.fc[base] = n + 1;            // a first child past num_nodes
            break;
        }
        case 5:
            if (targets != NULL) (*targets)[base + uniform(0, n)] = -3;  // negative target (if visited)
            else t.fc[base] = -5;
            break;
        case 6:
            if (caps != NULL) (*caps)[b] = -1;  // negative cap
            else t.num[b] = (int32_t)t.N + 5;
            break;
        case 7:  // garbage in padding rows: ignored, the request stays valid
            for (int64_t i = n + 1; i <= t.N; i++) {
                t.fc[base + i] = (int32_t)uniform(-9, 9);
                t.ns[base + i] = (int32_t)uniform(-9, 9);
                t.tok[base + i] = (int32_t)uniform(-9, 9);
            }
            break;
        default:  // links rewired inside the rules (later nodes only): valid, not a tree
            for (int k = 0; k < 3 && n >= 2; k++) {
                const int32_t i = (int32_t)uniform(0, n - 1);
                t.fc[base + i] = unit() < 0.2 ? -1 : (int32_t)uniform(i + 1, n);
                if (i > 0) t.ns[base + i] = unit() < 0.3 ? -1 : (int32_t)uniform(i + 1, n);
            }
            break;
    }
}

// ---- The walk, as the test understands the contract ---------------------------------

struct Ref {
    int32_t status = KDT_OK;
    std::vector<int32_t> path;     // accepted nodes, root first
    int32_t bonus = -1;
    std::vector<int32_t> visited;  // nodes whose target token was read, in walk order
};

// chosen[i]: the target's token at node i; bad_row (or NULL): rows whose read fails
// (NaN logits). Mirrors the contract of kdt_verify_greedy_cpu for one request.
static Ref ref_walk(const Trees& t, int64_t b, const int32_t* chosen, const std::vector<char>* bad_row,
                    const std::vector<int32_t>& stops, int64_t cap, int64_t P) {
    Ref r;
    const int64_t base = b * t.rows();
    const int32_t n = t.num[b];
    if (n < 0 || n > t.N) {
        r.status = KDT_ERR_VALUE;
        return r;
    }
    for (int32_t i = 0; i <= n; i++) {
        const int32_t fc = t.fc[base + i], ns = t.ns[base + i];
        if ((fc != -1 && (fc <= i || fc > n)) || (ns != -1 && (i == 0 || ns <= i || ns > n))) {
            r.status = KDT_ERR_VALUE;
            return r;
        }
    }
    if (cap < 0) {
        r.status = KDT_ERR_INVALID_ARGUMENT;
        return r;
    }
    r.path.push_back(0);
    int32_t cur = 0;
    while (cap > 0) {
        if (bad_row != NULL && (*bad_row)[cur]) {
            r.status = KDT_ERR_VALUE;
            return r;
        }
        const int32_t want = chosen[cur];
        if (want < 0) {
            r.status = KDT_ERR_VALUE;
            return r;
        }
        r.visited.push_back(cur);
        int32_t next = -1;
        for (int32_t c = t.fc[base + cur]; c != -1; c = t.ns[base + c]) {
            if (t.tok[base + c] == want) {
                next = c;
                break;
            }
        }
        const int64_t accepted = (int64_t)r.path.size() - 1;
        if (next < 0) {
            r.bonus = want;
            break;
        }
        const bool stop = std::find(stops.begin(), stops.end(), want) != stops.end();
        if (!stop && accepted + 2 > cap) {
            r.bonus = want;
            break;
        }
        if (accepted + 2 > P) {
            r.status = KDT_ERR_SHAPE;
            return r;
        }
        r.path.push_back(next);
        cur = next;
        if (stop) break;
    }
    return r;
}

// GPU outputs of one launch, on the host.
struct Out {
    std::vector<int32_t> nodes, len, bonus, status, target;
};
struct DevOut {
    DevBuf nodes, len, bonus, status, target;
};
// Output buffers for B requests, filled with a byte pattern so unwritten entries show.
static void prepare_out(DevOut& d, int64_t B, int64_t P, int64_t rows) {
    CUDA_OK(cudaMemset(reserve(d.nodes, B * P * 4), 0x5a, B * P * 4));
    CUDA_OK(cudaMemset(reserve(d.len, B * 4), 0x5a, B * 4));
    CUDA_OK(cudaMemset(reserve(d.bonus, B * 4), 0x5a, B * 4));
    CUDA_OK(cudaMemset(reserve(d.status, B * 4), 0x5a, B * 4));
    CUDA_OK(cudaMemset(reserve(d.target, B * rows * 4), 0x5a, B * rows * 4));
}
static Out fetch_out(const DevOut& d, int64_t B, int64_t P, int64_t rows, bool with_target) {
    CUDA_OK(cudaStreamSynchronize(g_stream));
    Out o;
    o.nodes = download(static_cast<const int32_t*>(d.nodes.ptr), B * P);
    o.len = download(static_cast<const int32_t*>(d.len.ptr), B);
    o.bonus = download(static_cast<const int32_t*>(d.bonus.ptr), B);
    o.status = download(static_cast<const int32_t*>(d.status.ptr), B);
    if (with_target) o.target = download(static_cast<const int32_t*>(d.target.ptr), B * rows);
    return o;
}
static void release(DevOut& d) {
    release(d.nodes);
    release(d.len);
    release(d.bonus);
    release(d.status);
    release(d.target);
}

// Request b of `o` against the expected walk: status; then the path row (failed: all -1),
// length (failed: 0) and bonus (failed: -1). Returns true when identical.
static bool same_walk(const Out& o, int64_t b, int64_t P, const Ref& e) {
    const bool ok = e.status == KDT_OK;
    if (o.status[b] != e.status) return false;
    if (o.len[b] != (ok ? (int32_t)e.path.size() - 1 : 0)) return false;
    if (o.bonus[b] != (ok ? e.bonus : -1)) return false;
    for (int64_t j = 0; j < P; j++) {
        const int32_t want = ok && j < (int64_t)e.path.size() ? e.path[j] : -1;
        if (o.nodes[b * P + j] != want) return false;
    }
    return true;
}

// target_tokens row b: token[i] at the visited nodes, -1 elsewhere.
static bool same_targets(const Out& o, int64_t b, int64_t rows, const Ref& e, const int32_t* token) {
    std::vector<int32_t> want(rows, -1);
    for (int32_t i : e.visited) want[i] = token[i];
    return memcmp(&o.target[b * rows], want.data(), rows * 4) == 0;
}

static void print_request(const char* what, int64_t it, int64_t b, const Out& o, int64_t P, const Ref& e) {
    fprintf(stderr, "%s launch %lld request %lld: GPU status %d len %d bonus %d path", what, (long long)it,
            (long long)b, o.status[b], o.len[b], o.bonus[b]);
    for (int64_t j = 0; j < P && j < 12; j++) fprintf(stderr, " %d", o.nodes[b * P + j]);
    fprintf(stderr, " | expected status %d len %d bonus %d path", e.status, (int)e.path.size() - 1, e.bonus);
    for (size_t j = 0; j < e.path.size() && j < 12; j++) fprintf(stderr, " %d", e.path[j]);
    fprintf(stderr, "\n");
}

// Random stop tokens: none, one or two, or a list longer than a warp whose only tokens
// inside the vocabulary sit past its first 32 entries.
static std::vector<int32_t> random_stops(int64_t vocab) {
    std::vector<int32_t> s;
    const double r = unit();
    if (r < 0.5) return s;
    if (r < 0.85) {
        for (int64_t k = uniform(1, 2); k > 0; k--) s.push_back((int32_t)uniform(0, vocab - 1));
        return s;
    }
    for (int64_t k = uniform(33, 45); k > 0; k--) s.push_back((int32_t)uniform(vocab, vocab + 100));
    s[uniform(32, (int64_t)s.size() - 1)] = (int32_t)uniform(0, vocab - 1);
    return s;
}
// Random caps (empty: none): 0, 1, 2, INT64_MAX or small.
static std::vector<int64_t> random_caps(int64_t B, int64_t L) {
    std::vector<int64_t> c;
    if (unit() < 0.3) return c;
    for (int64_t b = 0; b < B; b++) {
        const double r = unit();
        c.push_back(r < 0.07 ? 0 : r < 0.14 ? 1 : r < 0.2 ? 2 : r < 0.3 ? INT64_MAX : uniform(0, L + 2));
    }
    return c;
}
static int64_t random_path_capacity(int64_t L) {
    const double r = unit();
    return r < 0.6 ? L + 1 : r < 0.8 ? L + 1 + uniform(1, 5) : uniform(1, L + 1);
}

// ---- (a) given target tokens --------------------------------------------------------

static void test_given(int64_t launches) {
    DevTrees dt;
    DevOut dout;
    DevBuf d_target, d_stop, d_cap;
    int64_t trees = 0, failed = 0, mismatched = 0, accepted_total = 0, longest = 0, stopped = 0;
    for (int64_t it = 0; it < launches; it++) {
        const int64_t B = uniform(1, 64);
        const bool big = it % 20 == 19;  // past the shared-memory staging limit (2048 rows)
        const int64_t N = big ? uniform(2048, 2600) : unit() < 0.1 ? uniform(0, 2) : uniform(1, 96);
        const int64_t L = big ? uniform(20, 40) : uniform(1, 12);
        const int64_t K = big ? uniform(4, 10) : uniform(1, 6);
        const int64_t vocab = K + uniform(0, 10);
        Trees t = random_trees(B, N, L, K, vocab);
        const int64_t rows = t.rows();
        std::vector<int32_t> targets(B * rows);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < rows; i++) {
                if (i > t.num[b]) {
                    targets[b * rows + i] = (int32_t)uniform(-3, vocab);  // padding: ignored
                    continue;
                }
                const std::vector<int32_t> kids = children(t, b, (int32_t)i);
                targets[b * rows + i] = !kids.empty() && unit() < 0.9
                                            ? t.tok[b * rows + kids[uniform(0, (int64_t)kids.size() - 1)]]
                                            : (int32_t)uniform(0, vocab);
            }
        }
        const std::vector<int32_t> stops = random_stops(vocab);
        std::vector<int64_t> caps = random_caps(B, L);
        const int64_t P = random_path_capacity(L);
        for (int64_t b = 0; b < B; b++) {
            if (unit() < 0.06) corrupt(t, b, &targets, caps.empty() ? NULL : &caps);
        }
        kdt_trees d = upload_trees(dt, t);
        const int32_t* d_t = upload(d_target, targets);
        const int32_t* d_s = stops.empty() ? NULL : upload(d_stop, stops);
        const int64_t* d_c = caps.empty() ? NULL : upload(d_cap, caps);
        prepare_out(dout, B, P, rows);
        KDT_OK_OR_DIE(kdt_verify_greedy_cuda(&d, d_t, d_s, (int64_t)stops.size(), NULL, d_c, P, (int32_t*)dout.nodes.ptr,
                                             (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr,
                                             (int32_t*)dout.status.ptr, g_stream));
        const Out o = fetch_out(dout, B, P, rows, false);
        for (int64_t b = 0; b < B; b++) {
            // The CPU walk on this request alone is the reference.
            kdt_trees one = one_tree(t, b);
            std::vector<int32_t> nodes(P, 0x7f7f7f7f);
            int32_t len = 77, bonus = 77;
            const kdt_status st =
                kdt_verify_greedy_cpu(&one, &targets[b * rows], stops.empty() ? NULL : stops.data(),
                                      (int64_t)stops.size(), NULL, caps.empty() ? NULL : &caps[b], P, nodes.data(), &len,
                                      &bonus);
            Ref e;
            e.status = st;
            if (st == KDT_OK) {
                e.path.assign(nodes.begin(), nodes.begin() + len + 1);
                e.bonus = bonus;
                EXPECT(std::count(nodes.begin() + len + 1, nodes.end(), -1) == P - len - 1, "CPU path padding");
                accepted_total += len;
                longest = std::max<int64_t>(longest, len);
                stopped += len > 0 && bonus == -1;
            } else {
                failed++;
            }
            // The test's own model of the contract agrees with the CPU walk.
            const Ref m = ref_walk(t, b, &targets[b * rows], NULL, stops, caps.empty() ? INT64_MAX : caps[b], P);
            EXPECT(m.status == e.status && (st != KDT_OK || (m.path == e.path && m.bonus == e.bonus)),
                   "launch %lld request %lld: test model disagrees with the CPU walk", (long long)it, (long long)b);
            const bool same = same_walk(o, b, P, e);
            if (!same && mismatched < 5) print_request("given", it, b, o, P, e);
            mismatched += !same;
            EXPECT(same, "given tokens: launch %lld (B=%lld N=%lld P=%lld) request %lld differs from the CPU",
                   (long long)it, (long long)B, (long long)N, (long long)P, (long long)b);
            trees++;
        }
    }
    printf("given tokens: %lld trees in %lld launches (%lld failed requests, %lld accepted nodes, longest path %lld, "
           "%lld ended by a stop token), %lld mismatches\n",
           (long long)trees, (long long)launches, (long long)failed, (long long)accepted_total, (long long)longest,
           (long long)stopped, (long long)mismatched);
    release(dt);
    release(dout);
    release(d_target);
    release(d_stop);
    release(d_cap);
}

// ---- Logits on the device -----------------------------------------------------------

// A [B, rows, V] logits tensor laid out with strides and a start offset; elements outside
// the rows (row and batch padding, the offset) are NaN.
struct Layout {
    int64_t row_stride = 0, batch_stride = 0, offset = 0;
};
static Layout random_layout(int64_t rows, int64_t V, bool strided) {
    Layout l;
    if (!strided) {
        l.row_stride = V;
        l.batch_stride = rows * V;
        return l;
    }
    l.row_stride = V + uniform(0, 9);
    l.batch_stride = rows * l.row_stride + uniform(0, 13);
    l.offset = uniform(0, 7);
    return l;
}
// Uploads values [B, rows, V] (float, already representable in dtype) in layout l;
// returns the kdt_logits description.
static kdt_logits upload_logits(DevBuf& d, const std::vector<float>& values, int64_t B, int64_t rows, int64_t V,
                                int32_t dtype, const Layout& l) {
    const size_t es = dtype_bytes(dtype);
    const int64_t total = l.offset + (B - 1) * l.batch_stride + (rows - 1) * l.row_stride + V;
    std::vector<uint8_t> bytes(total * es);
    auto put = [&](int64_t at, float x) {
        if (dtype == KDT_DTYPE_FLOAT32) {
            memcpy(&bytes[at * 4], &x, 4);
        } else {
            const uint16_t h = dtype == KDT_DTYPE_FLOAT16 ? f32_to_f16(x) : f32_to_bf16(x);
            memcpy(&bytes[at * 2], &h, 2);
        }
    };
    for (int64_t at = 0; at < total; at++) put(at, NAN);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < rows; i++) {
            for (int64_t v = 0; v < V; v++) {
                put(l.offset + b * l.batch_stride + i * l.row_stride + v, values[(b * rows + i) * V + v]);
            }
        }
    }
    uint8_t* p = static_cast<uint8_t*>(reserve(d, bytes.size()));
    CUDA_OK(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    kdt_logits g;
    memset(&g, 0, sizeof g);
    g.data = p + l.offset * es;
    g.dtype = dtype;
    g.batch = B;
    g.length = rows;
    g.vocab = V;
    g.batch_stride = l.batch_stride;
    g.row_stride = l.row_stride;
    return g;
}

// Host argmax of a row (ties: the lower id; -0 == +0). The row holds no NaN.
static int32_t host_argmax(const float* row, int64_t V) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; v++) {
        if (row[v] > row[best]) best = v;
    }
    return (int32_t)best;
}

// ---- (b) greedy from logits ---------------------------------------------------------

static void test_greedy_logits(int64_t launches, bool quick) {
    static const int64_t kVocabs[] = {1, 2, 5, 8, 33, 256, 1000, 1027};
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits, d_stop, d_cap;
    int64_t requests = 0, mismatched = 0, nan_visited = 0, poisoned = 0, ties = 0;
    for (int64_t it = 0; it < launches; it++) {
        const bool huge = it == 1;           // a real vocabulary, bfloat16
        const bool big = it == 4 && !quick;  // past the shared-memory staging limit
        const int32_t dtype = huge || it % 3 == 2 ? KDT_DTYPE_BFLOAT16
                              : it % 3 == 0       ? KDT_DTYPE_FLOAT32
                                                  : KDT_DTYPE_FLOAT16;
        const int64_t V = huge ? 151936 : big ? 64 : kVocabs[uniform(0, 7)];
        const int64_t B = huge || big ? 2 : uniform(1, 12);
        const int64_t N = huge ? 24 : big ? 2100 : unit() < 0.1 ? 0 : uniform(1, 40);
        const int64_t L = big ? 30 : uniform(1, 8);
        const int64_t K = big ? 6 : uniform(1, std::min<int64_t>(V, 5));
        const int64_t vocab = std::min<int64_t>(V, K + uniform(0, 8));
        Trees t = random_trees(B, N, L, std::min(K, vocab), vocab);
        const int64_t rows = t.rows();
        // Values on a 1/16 grid in [-4, 4] (exact in every dtype), a planted maximum 6.0
        // per node (often a child's token), sometimes a second 6.0 (a tie), special rows.
        std::vector<float> values(B * rows * V);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < rows; i++) {
                float* row = &values[(b * rows + i) * V];
                const double kind = unit();
                for (int64_t v = 0; v < V; v++) row[v] = (float)uniform(-64, 64) / 16.0f;
                if (kind < 0.04) {  // constant row: token 0
                    for (int64_t v = 0; v < V; v++) row[v] = 1.5f;
                    continue;
                }
                if (kind < 0.08) {  // -0 and +0 tie at the top
                    for (int64_t v = 0; v < V; v++) row[v] = -1.0f;
                    row[uniform(0, V - 1)] = -0.0f;
                    row[uniform(0, V - 1)] = 0.0f;
                    continue;
                }
                if (kind < 0.11) row[uniform(0, V - 1)] = INFINITY;
                if (kind < 0.16) {
                    for (int64_t v = 0; v < V; v++) {
                        if (unit() < 0.3) row[v] = -INFINITY;
                    }
                }
                int32_t plant = (int32_t)uniform(0, V - 1);
                if (i <= t.num[b]) {
                    const std::vector<int32_t> kids = children(t, b, (int32_t)i);
                    if (!kids.empty() && unit() < 0.75) {
                        plant = t.tok[b * rows + kids[uniform(0, (int64_t)kids.size() - 1)]];
                    }
                }
                if (plant >= 0 && plant < V && row[plant] != INFINITY) row[plant] = 6.0f;
                if (unit() < 0.15) {  // a second maximum: the lower id must win
                    row[uniform(0, V - 1)] = 6.0f;
                    ties++;
                }
            }
        }
        for (float& x : values) x = round_to(dtype, x);
        std::vector<int32_t> argmax(B * rows);
        for (int64_t r = 0; r < B * rows; r++) argmax[r] = host_argmax(&values[r * V], V);
        const std::vector<int32_t> stops = random_stops(vocab);
        std::vector<int64_t> caps = random_caps(B, L);
        const int64_t P = random_path_capacity(L);
        for (int64_t b = 0; b < B; b++) {
            if (unit() < 0.04) corrupt(t, b, NULL, caps.empty() ? NULL : &caps);
        }
        // Expected walks; then NaN in one visited row of some requests (the request fails
        // there) and in every unvisited row of others (nothing changes).
        std::vector<Ref> want(B);
        std::vector<std::vector<char>> bad_rows(B, std::vector<char>(rows, 0));
        for (int64_t b = 0; b < B; b++) {
            const int64_t cap = caps.empty() ? INT64_MAX : caps[b];
            want[b] = ref_walk(t, b, &argmax[b * rows], NULL, stops, cap, P);
            kdt_trees one = one_tree(t, b);
            std::vector<int32_t> nodes(P);
            int32_t len = 0, bonus = 0;
            const kdt_status st = kdt_verify_greedy_cpu(&one, &argmax[b * rows], stops.empty() ? NULL : stops.data(),
                                                        (int64_t)stops.size(), NULL, caps.empty() ? NULL : &caps[b], P,
                                                        nodes.data(), &len, &bonus);
            EXPECT(st == want[b].status &&
                       (st != KDT_OK || (std::vector<int32_t>(nodes.begin(), nodes.begin() + len + 1) == want[b].path &&
                                         bonus == want[b].bonus)),
                   "launch %lld request %lld: test model disagrees with the CPU walk", (long long)it, (long long)b);
            const double r = unit();
            if (r < 0.1 && !want[b].visited.empty()) {
                const size_t k = (size_t)uniform(0, (int64_t)want[b].visited.size() - 1);
                const int32_t node = want[b].visited[k];
                values[(b * rows + node) * V + uniform(0, V - 1)] = NAN;
                bad_rows[b][node] = 1;
                want[b] = ref_walk(t, b, &argmax[b * rows], &bad_rows[b], stops, cap, P);
                EXPECT(want[b].status == KDT_ERR_VALUE && want[b].visited.size() == k, "NaN model");
                nan_visited++;
            } else if (r < 0.25) {
                std::vector<char> seen(rows, 0);
                for (int32_t i : want[b].visited) seen[i] = 1;
                for (int64_t i = 0; i < rows; i++) {
                    if (!seen[i]) values[(b * rows + i) * V + uniform(0, V - 1)] = NAN;
                }
                poisoned++;
            }
        }
        const Layout lay = random_layout(rows, V, it % 2 == 1);
        const kdt_logits g = upload_logits(d_logits, values, B, rows, V, dtype, lay);
        kdt_trees d = upload_trees(dt, t);
        const int32_t* d_s = stops.empty() ? NULL : upload(d_stop, stops);
        const int64_t* d_c = caps.empty() ? NULL : upload(d_cap, caps);
        const bool with_target = it % 5 != 3;
        prepare_out(dout, B, P, rows);
        KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d, &g, d_s, (int64_t)stops.size(), NULL, d_c, P,
                                                         (int32_t*)dout.nodes.ptr, (int32_t*)dout.len.ptr,
                                                         (int32_t*)dout.bonus.ptr,
                                                         with_target ? (int32_t*)dout.target.ptr : NULL,
                                                         (int32_t*)dout.status.ptr, g_stream));
        const Out o = fetch_out(dout, B, P, rows, with_target);
        for (int64_t b = 0; b < B; b++) {
            bool same = same_walk(o, b, P, want[b]);
            if (with_target) same = same && same_targets(o, b, rows, want[b], &argmax[b * rows]);
            if (!same && mismatched < 5) print_request("greedy logits", it, b, o, P, want[b]);
            mismatched += !same;
            EXPECT(same, "greedy from logits: launch %lld (%s, V=%lld, B=%lld, N=%lld, strides %lld/%lld, offset %lld) "
                   "request %lld differs", (long long)it, dtype_name(dtype), (long long)V, (long long)B, (long long)N,
                   (long long)lay.row_stride, (long long)lay.batch_stride, (long long)lay.offset, (long long)b);
            requests++;
        }
    }
    printf("greedy from logits: %lld requests in %lld launches (%lld NaN in a visited row, %lld with NaN in every "
           "unvisited row, %lld second maxima), %lld mismatches\n",
           (long long)requests, (long long)launches, (long long)nan_visited, (long long)poisoned, (long long)ties,
           (long long)mismatched);
    release(dt);
    release(dout);
    release(d_logits);
    release(d_stop);
    release(d_cap);
}

// ---- (c) sampling ---------------------------------------------------------------------

// Philox4x32-10 (Salmon et al., SC 2011), written independently of the library's.
static void philox_host(const uint32_t ctr[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int r = 0; r < 10; r++) {
        const uint64_t a = (uint64_t)0xD2511F53u * c0, m = (uint64_t)0xCD9E8D57u * c2;
        const uint32_t n0 = (uint32_t)(m >> 32) ^ c1 ^ k0, n1 = (uint32_t)m;
        const uint32_t n2 = (uint32_t)(a >> 32) ^ c3 ^ k1, n3 = (uint32_t)a;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

static void test_philox_kat() {
    // Known-answer vectors of Random123 (kat_vectors, philox4x32_10).
    static const uint32_t kCases[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
        {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
        {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0xd16cfe09u, 0x94fdccebu,
         0x5001e420u, 0x24126ea1u}};
    for (const auto& c : kCases) {
        uint32_t out[4];
        philox_host(c, c[4], c[5], out);
        EXPECT(out[0] == c[6] && out[1] == c[7] && out[2] == c[8] && out[3] == c[9], "Philox known answer %08x",
               c[6]);
    }
}

// The documented draw for request b, node i, evaluated in float64: argmax over v of
// logit / T - log(-log(u)), u = ((x >> 8) + 0.5) * 2^-24, x = word v % 4 of
// Philox4x32-10(counter (v / 4, i, b, offset low), key (seed low, seed high ^ offset high)).
// -inf logits are skipped. *gap: best minus second-best score (to skip near-ties).
static int32_t host_draw(const float* row, int64_t V, float T, uint64_t seed, uint64_t offset, uint32_t b,
                         uint32_t i, double* gap) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32);
    double best = -INFINITY, second = -INFINITY;
    int32_t arg = -1;
    for (int64_t v = 0; v < V; v++) {
        if (row[v] == -INFINITY) continue;
        const uint32_t ctr[4] = {(uint32_t)(v / 4), i, b, (uint32_t)offset};
        uint32_t x[4];
        philox_host(ctr, k0, k1, x);
        const double u = ((double)(x[v % 4] >> 8) + 0.5) * 0x1p-24;
        const double score = (double)row[v] / (double)T - log(-log(u));
        if (score > best) {
            second = best;
            best = score;
            arg = (int32_t)v;
        } else if (score > second) {
            second = score;
        }
    }
    *gap = best - second;
    return arg;
}

static bool same_out(const Out& a, const Out& b) {
    return a.nodes == b.nodes && a.len == b.len && a.bonus == b.bonus && a.status == b.status && a.target == b.target;
}

// Random trees and logits (child tokens boosted so walks go deep), several dtypes and
// layouts: repeatability, alignment independence, unvisited rows never read, the walk of
// the draws, and every draw against the host formula.
static void test_sample_walks(int64_t launches) {
    static const float kTemps[] = {0.6f, 1.0f, 1.8f};
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits, d_stop, d_cap;
    int64_t requests = 0, draws = 0, near_ties = 0, draw_mismatch = 0, walk_mismatch = 0, accepted = 0;
    for (int64_t it = 0; it < launches; it++) {
        const int32_t dtype = it % 3 == 0 ? KDT_DTYPE_FLOAT32 : it % 3 == 1 ? KDT_DTYPE_BFLOAT16 : KDT_DTYPE_FLOAT16;
        const int64_t V = it % 4 == 0 ? 1003 : it % 4 == 1 ? 1000 : it % 4 == 2 ? 37 : 4;
        const int64_t B = uniform(1, 10), N = uniform(0, 30), L = uniform(1, 8);
        const int64_t K = uniform(1, std::min<int64_t>(V, 4));
        const int64_t vocab = std::min<int64_t>(V, K + uniform(0, 6));
        Trees t = random_trees(B, N, L, K, vocab);
        const int64_t rows = t.rows();
        const float T = kTemps[uniform(0, 2)];
        const uint64_t seed = next_u64(), offset = it % 2 ? next_u64() : (uint64_t)uniform(0, 1000);
        std::vector<float> values(B * rows * V);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < rows; i++) {
                float* row = &values[(b * rows + i) * V];
                for (int64_t v = 0; v < V; v++) row[v] = 1.5f * normal();
                if (unit() < 0.1) row[uniform(0, V - 1)] = -INFINITY;
                if (i <= t.num[b]) {  // one child's token made likely (often, but not always, drawn)
                    const std::vector<int32_t> kids = children(t, b, (int32_t)i);
                    if (!kids.empty()) {
                        const int32_t tok = t.tok[b * rows + kids[uniform(0, (int64_t)kids.size() - 1)]];
                        if (tok >= 0 && tok < V) row[tok] += 6.0f + (float)V / 100.0f;
                    }
                }
            }
        }
        for (float& x : values) x = round_to(dtype, x);
        const std::vector<int32_t> stops = random_stops(vocab);
        std::vector<int64_t> caps = random_caps(B, L);
        const int64_t P = random_path_capacity(L);
        for (int64_t b = 0; b < B; b++) {
            if (unit() < 0.04) corrupt(t, b, NULL, caps.empty() ? NULL : &caps);
        }
        kdt_trees d = upload_trees(dt, t);
        const int32_t* d_s = stops.empty() ? NULL : upload(d_stop, stops);
        const int64_t* d_c = caps.empty() ? NULL : upload(d_cap, caps);
        auto run = [&](const Layout& lay, const std::vector<float>& vals) {
            const kdt_logits g = upload_logits(d_logits, vals, B, rows, V, dtype, lay);
            prepare_out(dout, B, P, rows);
            KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(
                &d, &g, T, seed, offset, d_s, (int64_t)stops.size(), NULL, d_c, P, (int32_t*)dout.nodes.ptr,
                (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr, (int32_t*)dout.target.ptr,
                (int32_t*)dout.status.ptr, g_stream));
            return fetch_out(dout, B, P, rows, true);
        };
        const Layout aligned = random_layout(rows, V, false);
        Layout shifted;
        shifted.row_stride = V + 3;
        shifted.batch_stride = rows * shifted.row_stride + 1;
        shifted.offset = 1;
        const Out o = run(aligned, values);
        EXPECT(same_out(o, run(aligned, values)), "sampling launch %lld: a repeated call differs", (long long)it);
        EXPECT(same_out(o, run(shifted, values)), "sampling launch %lld (%s, V=%lld): a misaligned copy differs",
               (long long)it, dtype_name(dtype), (long long)V);
        // NaN in every row the walk did not read: nothing changes.
        std::vector<float> poisoned = values;
        for (int64_t r = 0; r < B * rows; r++) {
            if (o.target[r] < 0) poisoned[r * V + uniform(0, V - 1)] = NAN;
        }
        EXPECT(same_out(o, run(aligned, poisoned)), "sampling launch %lld: NaN in an unvisited row changed the result",
               (long long)it);
        for (int64_t b = 0; b < B; b++) {
            // The walk of the drawn tokens (-1 at unvisited nodes: reading one would fail).
            const Ref e = ref_walk(t, b, &o.target[b * rows], NULL, stops, caps.empty() ? INT64_MAX : caps[b], P);
            bool same = same_walk(o, b, P, e) && same_targets(o, b, rows, e, &o.target[b * rows]);
            if (!same && walk_mismatch < 5) print_request("sample", it, b, o, P, e);
            walk_mismatch += !same;
            EXPECT(same, "sampling launch %lld request %lld: the walk of the draws differs", (long long)it,
                   (long long)b);
            if (e.status == KDT_OK) accepted += (int64_t)e.path.size() - 1;
            for (int32_t i : e.visited) {
                double gap;
                const int32_t want =
                    host_draw(&values[(b * rows + i) * V], V, T, seed, offset, (uint32_t)b, (uint32_t)i, &gap);
                draws++;
                if (gap < 1e-4) {
                    near_ties++;
                    continue;
                }
                const bool ok = want == o.target[b * rows + i];
                if (!ok && draw_mismatch < 5) {
                    fprintf(stderr, "sampling launch %lld request %lld node %d: GPU drew %d, host %d (gap %g)\n",
                            (long long)it, (long long)b, (int)i, o.target[b * rows + i], want, gap);
                }
                draw_mismatch += !ok;
                EXPECT(ok, "sampling: draw differs from the documented formula");
            }
            requests++;
        }
    }
    printf("sampling walks: %lld requests in %lld launches, %lld accepted nodes, %lld draws checked on the host "
           "(%lld near-ties skipped), %lld draw mismatches, %lld walk mismatches\n",
           (long long)requests, (long long)launches, (long long)accepted, (long long)draws, (long long)near_ties,
           (long long)draw_mismatch, (long long)walk_mismatch);
    EXPECT(near_ties * 20 <= draws + 20, "too many near-ties (%lld of %lld)", (long long)near_ties, (long long)draws);
    release(dt);
    release(dout);
    release(d_logits);
    release(d_stop);
    release(d_cap);
}

// Root-only (N = 0) or root-plus-one-child (N = 1, the root's row forcing the child)
// trees for B requests, all reading the same logits rows (batch stride 0).
static Trees star_trees(int64_t B, int64_t N, int32_t child_token) {
    Trees t;
    t.B = B;
    t.N = N;
    t.num.assign(B, (int32_t)N);
    t.tok.assign(B * (N + 1), 0);
    t.fc.assign(B * (N + 1), -1);
    t.ns.assign(B * (N + 1), -1);
    if (N == 1) {
        for (int64_t b = 0; b < B; b++) {
            t.tok[b * 2 + 1] = child_token;
            t.fc[b * 2] = 1;
        }
    }
    return t;
}

// B root-only draws of one shared row (batch stride 0) with seed and offset.
static std::vector<int32_t> shared_row_draws(DevTrees& dt, DevOut& dout, const Trees& t, const kdt_logits& g, float T,
                                             uint64_t seed, uint64_t offset) {
    kdt_trees d = upload_trees(dt, t);
    prepare_out(dout, t.B, 2, t.rows());
    KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(&d, &g, T, seed, offset, NULL, 0, NULL, NULL, 2,
                                                     (int32_t*)dout.nodes.ptr, (int32_t*)dout.len.ptr,
                                                     (int32_t*)dout.bonus.ptr, (int32_t*)dout.target.ptr,
                                                     (int32_t*)dout.status.ptr, g_stream));
    const Out o = fetch_out(dout, t.B, 2, t.rows(), true);
    for (int64_t b = 0; b < t.B; b++) EXPECT(o.status[b] == KDT_OK, "shared-row draw status %d", o.status[b]);
    return o.bonus;
}

// Different offsets (low or high words) and seeds give different draws; each draw is the
// host formula's.
static void test_sample_offsets() {
    const int64_t B = 64, V = 4096;
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits;
    const Trees t = star_trees(B, 0, 0);
    std::vector<float> row(V);
    for (int64_t v = 0; v < V; v++) row[v] = 0.01f * normal();
    Layout lay;
    lay.row_stride = V;
    const kdt_logits g = upload_logits(d_logits, row, 1, 1, V, KDT_DTYPE_FLOAT32, lay);
    kdt_logits shared = g;
    shared.batch = B;  // batch stride 0: every request reads the same row
    const uint64_t seed = 0x0123456789ABCDEFull;
    const uint64_t cases[4][2] = {{seed, 1}, {seed, 2}, {seed, 1 + (1ull << 32)}, {seed ^ (1ull << 40), 1}};
    std::vector<std::vector<int32_t>> draws;
    for (const auto& c : cases) draws.push_back(shared_row_draws(dt, dout, t, shared, 1.0f, c[0], c[1]));
    for (size_t k = 1; k < draws.size(); k++) {
        int64_t same = 0;
        for (int64_t b = 0; b < B; b++) same += draws[k][b] == draws[0][b];
        EXPECT(same <= 8, "(seed, offset) case %zu repeats %lld of %lld draws of case 0", k, (long long)same,
               (long long)B);
    }
    int64_t distinct = 0;  // requests must not share draws either
    std::vector<int32_t> sorted = draws[0];
    std::sort(sorted.begin(), sorted.end());
    distinct = std::unique(sorted.begin(), sorted.end()) - sorted.begin();
    EXPECT(distinct >= B - 8, "only %lld distinct draws among %lld requests", (long long)distinct, (long long)B);
    int64_t checked = 0;
    for (size_t k = 0; k < draws.size(); k++) {
        for (int64_t b = 0; b < B; b++) {
            double gap;
            const int32_t want = host_draw(row.data(), V, 1.0f, cases[k][0], cases[k][1], (uint32_t)b, 0, &gap);
            if (gap < 1e-4) continue;
            checked++;
            EXPECT(want == draws[k][b], "offset case %zu request %lld: GPU %d, host %d", k, (long long)b, draws[k][b],
                   want);
        }
    }
    printf("sampling offsets: 4 (seed, offset) pairs x %lld requests, %lld draws reproduced on the host\n",
           (long long)B, (long long)checked);
    release(dt);
    release(dout);
    release(d_logits);
}

// Chi-square goodness of fit of the draws to softmax(logits / T), V = 16 with one -inf
// logit (never drawn), at the root (N = 0) and at node 1 (N = 1: the root's row has a
// single finite logit, the child's token, so the walk always reaches node 1 and the bonus
// is node 1's draw). Cells expecting fewer than 5 draws are pooled. Critical values at
// p = 1e-6 (scipy.stats.chi2.isf(1e-6, df), rounded up).
static void test_chi_square(bool quick) {
    static const double kCritical[16] = {0,     23.93, 27.64, 30.67, 33.38, 35.89, 38.27, 40.53,
                                         42.70, 44.82, 46.87, 48.88, 50.84, 52.76, 54.64, 56.50};
    static const float kLogits[16] = {0.3f,  -1.2f, 0.8f, 0.0f,  -0.5f, -INFINITY, 1.1f,  -2.0f,
                                      0.45f, -0.9f, 0.2f, 1.4f, -1.6f, 0.65f,     -0.3f, 0.95f};
    const int64_t V = 16, B = 2048, rounds = quick ? 2 : 8;
    const int32_t child = 11;
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits;
    struct Case {
        float T;
        int64_t N;
        int32_t dtype;
    };
    const Case cases[4] = {{0.5f, 0, KDT_DTYPE_FLOAT32}, {1.0f, 0, KDT_DTYPE_BFLOAT16}, {2.0f, 0, KDT_DTYPE_FLOAT32},
                           {1.0f, 1, KDT_DTYPE_FLOAT16}};
    for (const Case& c : cases) {
        // Rows: [root row (N = 1 only), test row]; the test row's values as the dtype stores them.
        std::vector<float> vals;
        if (c.N == 1) {
            for (int64_t v = 0; v < V; v++) vals.push_back(v == child ? 0.0f : -INFINITY);
        }
        for (int64_t v = 0; v < V; v++) vals.push_back(round_to(c.dtype, kLogits[v]));
        Layout lay;
        lay.row_stride = V;
        kdt_logits g = upload_logits(d_logits, vals, 1, c.N + 1, V, c.dtype, lay);
        g.batch = B;  // batch stride 0
        const Trees t = star_trees(B, c.N, child);
        kdt_trees d = upload_trees(dt, t);
        std::vector<int64_t> counts(V, 0);
        int64_t total = 0, bad = 0;
        for (int64_t r = 0; r < rounds; r++) {
            prepare_out(dout, B, 3, c.N + 1);
            KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(&d, &g, c.T, 0xC0FFEEull + (uint64_t)c.N, (uint64_t)r,
                                                             NULL, 0, NULL, NULL, 3, (int32_t*)dout.nodes.ptr,
                                                             (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr,
                                                             (int32_t*)dout.target.ptr, (int32_t*)dout.status.ptr,
                                                             g_stream));
            const Out o = fetch_out(dout, B, 3, c.N + 1, true);
            for (int64_t b = 0; b < B; b++) {
                const bool ok = o.status[b] == KDT_OK && o.len[b] == c.N && o.bonus[b] >= 0 && o.bonus[b] < V &&
                                (c.N == 0 || (o.target[b * 2] == child && o.nodes[b * 3 + 1] == 1));
                bad += !ok;
                if (ok) {
                    counts[o.bonus[b]]++;
                    total++;
                }
            }
        }
        EXPECT(bad == 0, "chi-square T=%g N=%lld: %lld malformed results", (double)c.T, (long long)c.N, (long long)bad);
        EXPECT(counts[5] == 0, "a -inf logit was drawn %lld times", (long long)counts[5]);
        // Expected probabilities from the stored values.
        const float* test_row = &vals[c.N * V];
        double z = 0.0, mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = std::max(mx, (double)test_row[v] / c.T);
        std::vector<double> p(V, 0.0);
        for (int64_t v = 0; v < V; v++) {
            p[v] = test_row[v] == -INFINITY ? 0.0 : exp((double)test_row[v] / c.T - mx);
            z += p[v];
        }
        // Cells: finite-logit tokens, the smallest expected ones pooled until each >= 5.
        std::vector<std::pair<double, int64_t>> cells;  // (expected, observed)
        for (int64_t v = 0; v < V; v++) {
            if (p[v] > 0.0) cells.push_back({p[v] / z * (double)total, counts[v]});
        }
        std::sort(cells.begin(), cells.end());
        while (cells.size() > 2 && cells[0].first < 5.0) {
            cells[1].first += cells[0].first;
            cells[1].second += cells[0].second;
            cells.erase(cells.begin());
            std::sort(cells.begin(), cells.end());
        }
        double stat = 0.0;
        for (const auto& cell : cells) stat += (cell.second - cell.first) * (cell.second - cell.first) / cell.first;
        const size_t df = cells.size() - 1;
        printf("chi-square: T=%g at %s (%s), %lld draws, %zu cells, statistic %.2f, critical %.2f (p=1e-6)\n",
               (double)c.T, c.N == 0 ? "the root" : "node 1", dtype_name(c.dtype), (long long)total, cells.size(),
               stat, kCritical[df]);
        EXPECT(df >= 1 && df <= 15 && stat < kCritical[df], "chi-square T=%g N=%lld: %.2f >= %.2f", (double)c.T,
               (long long)c.N, stat, kCritical[df]);
    }
    release(dt);
    release(dout);
    release(d_logits);
}

// Rows that cannot be sampled: NaN, +inf, all -inf (KDT_ERR_VALUE when visited, no effect
// otherwise); greedy accepts +inf and all -inf (argmax 0).
static void test_invalid_rows() {
    const int64_t V = 40, B = 2;
    const int32_t child = 7;
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits;
    const Trees t = star_trees(B, 1, child);
    kdt_trees d = upload_trees(dt, t);
    for (int kind = 0; kind < 3; kind++) {
        for (int visit = 0; visit < 2; visit++) {
            // Request 0's root row leads to node 1 (visit) or away from it; request 1 is a
            // clean neighbour. Node 1's row is the bad one.
            std::vector<float> vals(B * 2 * V);
            for (int64_t b = 0; b < B; b++) {
                for (int64_t v = 0; v < V; v++) {
                    vals[(b * 2) * V + v] = v == (visit || b == 1 ? child : child + 1) ? 0.0f : -INFINITY;
                    vals[(b * 2 + 1) * V + v] = 0.1f * (float)v;
                }
            }
            float* bad_row = &vals[1 * V];
            if (kind == 0) bad_row[13] = NAN;
            if (kind == 1) bad_row[3] = INFINITY;
            if (kind == 2) {
                for (int64_t v = 0; v < V; v++) bad_row[v] = -INFINITY;
            }
            Layout lay;
            lay.row_stride = V;
            lay.batch_stride = 2 * V;
            const kdt_logits g = upload_logits(d_logits, vals, B, 2, V, KDT_DTYPE_FLOAT32, lay);
            prepare_out(dout, B, 3, 2);
            KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(&d, &g, 1.0f, 5, 6, NULL, 0, NULL, NULL, 3,
                                                             (int32_t*)dout.nodes.ptr, (int32_t*)dout.len.ptr,
                                                             (int32_t*)dout.bonus.ptr, (int32_t*)dout.target.ptr,
                                                             (int32_t*)dout.status.ptr, g_stream));
            Out o = fetch_out(dout, B, 3, 2, true);
            if (visit) {
                EXPECT(o.status[0] == KDT_ERR_VALUE && o.len[0] == 0 && o.bonus[0] == -1 && o.nodes[0] == -1 &&
                           o.nodes[1] == -1 && o.target[0] == child && o.target[1] == -1,
                       "sampling bad row kind %d: status %d len %d bonus %d target %d %d", kind, o.status[0], o.len[0],
                       o.bonus[0], o.target[0], o.target[1]);
            } else {
                EXPECT(o.status[0] == KDT_OK && o.len[0] == 0 && o.bonus[0] == child + 1 && o.target[1] == -1,
                       "sampling bad unvisited row kind %d: status %d bonus %d", kind, o.status[0], o.bonus[0]);
            }
            EXPECT(o.status[1] == KDT_OK && o.len[1] == 1 && o.bonus[1] >= 0 && o.bonus[1] < V,
                   "sampling neighbour of a bad row: status %d", o.status[1]);
            // Greedy: NaN fails a visited row; +inf is the argmax; all -inf gives token 0.
            prepare_out(dout, B, 3, 2);
            KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d, &g, NULL, 0, NULL, NULL, 3, (int32_t*)dout.nodes.ptr,
                                                             (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr,
                                                             (int32_t*)dout.target.ptr, (int32_t*)dout.status.ptr,
                                                             g_stream));
            o = fetch_out(dout, B, 3, 2, true);
            const int32_t want_status = kind == 0 && visit ? KDT_ERR_VALUE : KDT_OK;
            const int32_t want_bonus = !visit ? child + 1 : kind == 0 ? -1 : kind == 1 ? 3 : 0;
            EXPECT(o.status[0] == want_status && o.bonus[0] == want_bonus && o.len[0] == (visit && kind ? 1 : 0),
                   "greedy bad row kind %d visit %d: status %d bonus %d len %d", kind, visit, o.status[0], o.bonus[0],
                   o.len[0]);
            EXPECT(o.status[1] == KDT_OK && o.bonus[1] == V - 1, "greedy neighbour: status %d bonus %d", o.status[1],
                   o.bonus[1]);
        }
    }
    release(dt);
    release(dout);
    release(d_logits);
}

// Exact ties resolved across threads and load paths: -0 and +0 (equal: the lower id
// wins, whichever sign it has), equal maxima in the 16-byte part and the scalar tail, a
// row of -inf (token 0), in every dtype, aligned and misaligned.
static void test_greedy_ties() {
    const int64_t V = 3001, B = 5;
    DevTrees dt;
    DevOut dout;
    DevBuf d_logits;
    const Trees t = star_trees(B, 0, 0);
    kdt_trees d = upload_trees(dt, t);
    std::vector<float> vals(B * V);
    for (int64_t v = 0; v < V; v++) {
        vals[0 * V + v] = -1.0f;
        vals[1 * V + v] = -1.0f;
        vals[2 * V + v] = 0.5f;
        vals[3 * V + v] = 0.5f;
        vals[4 * V + v] = -INFINITY;
    }
    vals[0 * V + 3] = -0.0f;
    vals[0 * V + 2900] = 0.0f;
    vals[1 * V + 3] = 0.0f;
    vals[1 * V + 2900] = -0.0f;
    vals[2 * V + 3000] = 2.5f;  // the scalar tail (V % 8 == 1)
    vals[2 * V + 1234] = 2.5f;
    vals[3 * V + 3000] = 2.5f;
    vals[3 * V + 2999] = 2.5f;
    const int32_t want[B] = {3, 3, 1234, 2999, 0};
    for (int k = 0; k < B; k++) EXPECT(host_argmax(&vals[k * V], V) == want[k], "host argmax of tie row %d", k);
    static const int32_t kTypes[] = {KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16};
    for (int32_t dtype : kTypes) {
        for (int shift = 0; shift < 2; shift++) {
            Layout lay;
            lay.row_stride = V + shift;
            lay.batch_stride = V + shift;
            lay.offset = shift;
            const kdt_logits g = upload_logits(d_logits, vals, B, 1, V, dtype, lay);
            prepare_out(dout, B, 1, 1);
            KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d, &g, NULL, 0, NULL, NULL, 1, (int32_t*)dout.nodes.ptr,
                                                             (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr,
                                                             (int32_t*)dout.target.ptr, (int32_t*)dout.status.ptr,
                                                             g_stream));
            const Out o = fetch_out(dout, B, 1, 1, true);
            for (int64_t b = 0; b < B; b++) {
                EXPECT(o.status[b] == KDT_OK && o.bonus[b] == want[b] && o.target[b] == want[b] && o.len[b] == 0 &&
                           o.nodes[b] == 0,
                       "tie row %lld (%s, shift %d): status %d bonus %d, expected %d", (long long)b, dtype_name(dtype),
                       shift, o.status[b], o.bonus[b], want[b]);
            }
        }
    }
    release(dt);
    release(dout);
    release(d_logits);
}

// ---- Host-side argument checks --------------------------------------------------------

static void test_host_errors() {
    DevTrees dt;
    DevOut dout;
    DevBuf d_target, d_logits;
    const Trees t = star_trees(2, 1, 3);
    kdt_trees d = upload_trees(dt, t);
    prepare_out(dout, 2, 3, 2);
    int32_t* nodes = (int32_t*)dout.nodes.ptr;
    int32_t* len = (int32_t*)dout.len.ptr;
    int32_t* bonus = (int32_t*)dout.bonus.ptr;
    int32_t* status = (int32_t*)dout.status.ptr;
    int32_t* target_out = (int32_t*)dout.target.ptr;
    const int32_t* target = upload(d_target, std::vector<int32_t>(4, 3));
    std::vector<float> vals(2 * 2 * 8, 0.0f);
    Layout lay;
    lay.row_stride = 8;
    lay.batch_stride = 16;
    const kdt_logits g = upload_logits(d_logits, vals, 2, 2, 8, KDT_DTYPE_FLOAT32, lay);
    const int32_t* stops = target;  // any device int32 array

    // Shared checks, for each of the three entry points.
    for (int f = 0; f < 3; f++) {
        auto call = [&](const kdt_trees* tr, const kdt_logits* lg, const int32_t* st, int64_t nst, int64_t P,
                        int32_t* nd, int32_t* rs, float T) -> kdt_status {
            if (f == 0) return kdt_verify_greedy_cuda(tr, target, st, nst, NULL, NULL, P, nd, len, bonus, rs, g_stream);
            if (f == 1) {
                return kdt_verify_greedy_from_logits_cuda(tr, lg, st, nst, NULL, NULL, P, nd, len, bonus, target_out, rs,
                                                          g_stream);
            }
            return kdt_verify_sample_from_logits_cuda(tr, lg, T, 1, 2, st, nst, NULL, NULL, P, nd, len, bonus, target_out,
                                                      rs, g_stream);
        };
        EXPECT_STATUS(call(&d, &g, stops, 1, 3, nodes, status, 1.0f), KDT_OK);
        EXPECT_STATUS(call(NULL, &g, stops, 1, 3, nodes, status, 1.0f), KDT_ERR_NULL_POINTER);
        kdt_trees bad = d;
        bad.batch = -1;
        EXPECT_STATUS(call(&bad, &g, stops, 1, 3, nodes, status, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        bad = d;
        bad.budget = -1;
        EXPECT_STATUS(call(&bad, &g, stops, 1, 3, nodes, status, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        EXPECT_STATUS(call(&d, &g, stops, -1, 3, nodes, status, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        EXPECT_STATUS(call(&d, &g, stops, 1, 0, nodes, status, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        EXPECT_STATUS(call(&d, &g, NULL, 2, 3, nodes, status, 1.0f), KDT_ERR_NULL_POINTER);
        EXPECT_STATUS(call(&d, &g, stops, 1, 3, NULL, status, 1.0f), KDT_ERR_NULL_POINTER);
        EXPECT_STATUS(call(&d, &g, stops, 1, 3, nodes, NULL, 1.0f), KDT_ERR_NULL_POINTER);
        bad = d;
        bad.first_child = NULL;
        EXPECT_STATUS(call(&bad, &g, stops, 1, 3, nodes, status, 1.0f), KDT_ERR_NULL_POINTER);
        bad = d;
        bad.budget = (int64_t)INT32_MAX;  // past the CPU walk's limit too
        EXPECT_STATUS(call(&bad, &g, stops, 1, 3, nodes, status, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        // An empty batch: nothing to check beyond the scalars, nothing launched.
        kdt_trees empty;
        memset(&empty, 0, sizeof empty);
        kdt_logits empty_logits = g;
        empty_logits.batch = 0;
        empty_logits.length = 1;
        EXPECT_STATUS(call(&empty, &empty_logits, NULL, 0, 1, NULL, NULL, 1.0f), KDT_OK);
    }
    EXPECT_STATUS(kdt_verify_greedy_cuda(&d, NULL, NULL, 0, NULL, NULL, 3, nodes, len, bonus, status, g_stream),
                  KDT_ERR_NULL_POINTER);
    // Logits descriptions.
    for (int f = 1; f < 3; f++) {
        auto call = [&](const kdt_logits* lg, float T) -> kdt_status {
            if (f == 1) {
                return kdt_verify_greedy_from_logits_cuda(&d, lg, NULL, 0, NULL, NULL, 3, nodes, len, bonus, NULL, status,
                                                          g_stream);
            }
            return kdt_verify_sample_from_logits_cuda(&d, lg, T, 1, 2, NULL, 0, NULL, NULL, 3, nodes, len, bonus, NULL,
                                                      status, g_stream);
        };
        EXPECT_STATUS(call(&g, 1.0f), KDT_OK);
        EXPECT_STATUS(call(NULL, 1.0f), KDT_ERR_NULL_POINTER);
        kdt_logits bad = g;
        bad.dtype = KDT_DTYPE_INT32;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        bad = g;
        bad.reserved = 1;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        bad = g;
        bad.length = 3;  // must be N + 1 = 2
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_SHAPE);
        bad = g;
        bad.batch = 3;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_SHAPE);
        bad = g;
        bad.vocab = 0;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        bad = g;
        bad.row_stride = -1;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_INVALID_ARGUMENT);
        bad = g;
        bad.data = NULL;
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_NULL_POINTER);
        bad = g;
        bad.data = static_cast<const char*>(g.data) + 1;  // not aligned to 4-byte elements
        EXPECT_STATUS(call(&bad, 1.0f), KDT_ERR_INVALID_ARGUMENT);
    }
    static const float kBadTemps[] = {0.0f, -1.0f, NAN, INFINITY, -INFINITY, -0.0f, 1e-30f, 9.9e-7f};
    for (float T : kBadTemps) {
        EXPECT_STATUS(kdt_verify_sample_from_logits_cuda(&d, &g, T, 1, 2, NULL, 0, NULL, NULL, 3, nodes, len, bonus, NULL,
                                                         status, g_stream),
                      KDT_ERR_INVALID_ARGUMENT);
    }
    // The smallest temperature accepted (smaller ones could overflow logit / T).
    EXPECT_STATUS(kdt_verify_sample_from_logits_cuda(&d, &g, 1e-6f, 1, 2, NULL, 0, NULL, NULL, 3, nodes, len, bonus, NULL,
                                                     status, g_stream),
                  KDT_OK);
    CUDA_OK(cudaStreamSynchronize(g_stream));
    release(dt);
    release(dout);
    release(d_target);
    release(d_logits);
}

// ---- CUDA graph capture ----------------------------------------------------------------

// All three entry points captured on a stream, replayed twice: the same outputs as the
// direct calls (they neither synchronise nor allocate).
static void test_graph_capture() {
    const int64_t B = 6, N = 20, L = 5, K = 3, V = 300, vocab = 12;
    DevTrees dt;
    DevBuf d_target, d_logits, d_out[2][5];
    Trees t = random_trees(B, N, L, K, vocab);
    const int64_t rows = t.rows(), P = L + 1;
    std::vector<int32_t> targets(B * rows);
    std::vector<float> values(B * rows * V);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < rows; i++) {
            const std::vector<int32_t> kids = i <= t.num[b] ? children(t, b, (int32_t)i) : std::vector<int32_t>();
            const int32_t tok = kids.empty() ? (int32_t)uniform(0, vocab) : t.tok[b * rows + kids[0]];
            targets[b * rows + i] = tok;
            for (int64_t v = 0; v < V; v++) values[(b * rows + i) * V + v] = normal();
            values[(b * rows + i) * V + tok] = 5.0f;
        }
    }
    kdt_trees d = upload_trees(dt, t);
    const int32_t* d_t = upload(d_target, targets);
    const kdt_logits g = upload_logits(d_logits, values, B, rows, V, KDT_DTYPE_BFLOAT16, random_layout(rows, V, false));
    // Buffers: [0] direct calls, [1] the graph; per call slot nodes/len/bonus/status/target.
    struct Slots {
        int32_t *nodes, *len, *bonus, *status, *target;
    };
    auto slots = [&](int k, int call) {
        Slots s;
        s.nodes = (int32_t*)reserve(d_out[k][0], 3 * B * P * 4) + call * B * P;
        s.len = (int32_t*)reserve(d_out[k][1], 3 * B * 4) + call * B;
        s.bonus = (int32_t*)reserve(d_out[k][2], 3 * B * 4) + call * B;
        s.status = (int32_t*)reserve(d_out[k][3], 3 * B * 4) + call * B;
        s.target = (int32_t*)reserve(d_out[k][4], 3 * B * rows * 4) + call * B * rows;
        return s;
    };
    auto enqueue = [&](int k, cudaStream_t s) {
        const Slots a = slots(k, 0), b = slots(k, 1), c = slots(k, 2);
        KDT_OK_OR_DIE(kdt_verify_greedy_cuda(&d, d_t, NULL, 0, NULL, NULL, P, a.nodes, a.len, a.bonus, a.status, s));
        KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d, &g, NULL, 0, NULL, NULL, P, b.nodes, b.len, b.bonus, b.target,
                                                         b.status, s));
        KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(&d, &g, 0.8f, 99, 7, NULL, 0, NULL, NULL, P, c.nodes, c.len,
                                                         c.bonus, c.target, c.status, s));
    };
    auto clear = [&](int k) {
        for (int a = 0; a < 5; a++) CUDA_OK(cudaMemset(d_out[k][a].ptr, 0x5a, d_out[k][a].cap));
    };
    slots(0, 0);
    slots(1, 0);
    clear(0);
    enqueue(0, g_stream);
    CUDA_OK(cudaStreamSynchronize(g_stream));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    enqueue(1, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        clear(1);
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        for (int a = 0; a < 5; a++) {
            const size_t n = d_out[0][a].cap;
            const std::vector<uint8_t> x = download(static_cast<const uint8_t*>(d_out[0][a].ptr), n);
            const std::vector<uint8_t> y = download(static_cast<const uint8_t*>(d_out[1][a].ptr), n);
            EXPECT(x == y, "graph replay %d: output array %d differs from the direct calls", rep, a);
        }
    }
    const std::vector<int32_t> st = download(slots(0, 0).status, 3 * B);
    for (int64_t k = 0; k < 3 * B; k++) EXPECT(st[k] == KDT_OK, "graph test request status %d", st[k]);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(s));
    printf("graph capture: 3 calls captured and replayed twice\n");
    release(dt);
    release(d_target);
    release(d_logits);
    for (auto& k : d_out) {
        for (auto& a : k) release(a);
    }
}

// kdt_verify_sample_batch_cuda (per-request settings in device memory) on random trees:
// with no cut, every request's outputs equal kdt_verify_sample_from_logits_cuda's with the
// same temperature, seed and offset (bit for bit, target tokens included); requests at
// temperature 0 equal kdt_verify_greedy_from_logits_cuda's; top-k requests draw, at every
// visited node, the host formula's token over the row's top-k tokens (ties lower id); bad
// settings (NaN / negative / tiny / infinite temperature, top_p outside (0, 1], negative
// top_k) fail their request alone; plus the host-side checks of the sampling struct.
// (The top-p cut is checked against the Python reference by tests_py/test_sampling_graph.py.)
static void test_sample_batch(int64_t launches) {
    DevTrees dt;
    DevOut dout, dref;
    DevBuf d_logits, d_temp, d_topp, d_topk, d_seed, d_offset;
    int64_t checked = 0, near_ties = 0;
    for (int64_t it = 0; it < launches; it++) {
        const int32_t dtype = it % 3 == 0 ? KDT_DTYPE_FLOAT32 : it % 3 == 1 ? KDT_DTYPE_BFLOAT16 : KDT_DTYPE_FLOAT16;
        const int64_t V = it == 1 ? 151936 : it % 4 == 0 ? 1003 : it % 4 == 1 ? 37 : it % 4 == 2 ? 4 : 1000;
        const int64_t B = uniform(1, 12), N = uniform(0, 20), L = uniform(1, 6);
        const int64_t K = uniform(1, std::min<int64_t>(V, 4));
        Trees t = random_trees(B, N, L, K, std::min<int64_t>(V, K + uniform(0, 6)));
        const int64_t rows = t.rows(), P = L + 1;
        std::vector<float> values(B * rows * V);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < rows; i++) {
                float* row = &values[(b * rows + i) * V];
                for (int64_t v = 0; v < V; v++) row[v] = 1.5f * normal();
                if (i <= t.num[b]) {
                    const std::vector<int32_t> kids = children(t, b, (int32_t)i);
                    if (!kids.empty()) {
                        const int32_t tok = t.tok[b * rows + kids[uniform(0, (int64_t)kids.size() - 1)]];
                        if (tok >= 0 && tok < V) row[tok] += 5.0f;
                    }
                }
            }
        }
        for (float& x : values) x = round_to(dtype, x);
        Layout lay;
        lay.row_stride = V;
        lay.batch_stride = rows * V;
        const kdt_logits g = upload_logits(d_logits, values, B, rows, V, dtype, lay);
        kdt_trees d = upload_trees(dt, t);
        const float T = it % 2 ? 0.7f : 1.3f;
        const uint64_t seed = next_u64(), offset = next_u64();
        auto batch_call = [&](const std::vector<float>& temp, const std::vector<float>* topp,
                              const std::vector<int32_t>* topk, DevOut& o) {
            kdt_sampling sp;
            sp.temperature = upload(d_temp, temp);
            sp.top_p = topp ? upload(d_topp, *topp) : NULL;
            sp.top_k = topk ? upload(d_topk, *topk) : NULL;
            sp.seed = upload(d_seed, std::vector<uint64_t>(B, seed));
            sp.offset = upload(d_offset, std::vector<uint64_t>(B, offset));
            prepare_out(o, B, P, rows);
            KDT_OK_OR_DIE(kdt_verify_sample_batch_cuda(&d, &g, &sp, NULL, 0, NULL, NULL, P, (int32_t*)o.nodes.ptr,
                                                       (int32_t*)o.len.ptr, (int32_t*)o.bonus.ptr,
                                                       (int32_t*)o.target.ptr, (int32_t*)o.status.ptr, g_stream));
            return fetch_out(o, B, P, rows, true);
        };
        // 1. No cut (top_p 1, top_k 0 or >= V, or NULL): the scalar call's outputs.
        prepare_out(dref, B, P, rows);
        KDT_OK_OR_DIE(kdt_verify_sample_from_logits_cuda(&d, &g, T, seed, offset, NULL, 0, NULL, NULL, P,
                                                         (int32_t*)dref.nodes.ptr, (int32_t*)dref.len.ptr,
                                                         (int32_t*)dref.bonus.ptr, (int32_t*)dref.target.ptr,
                                                         (int32_t*)dref.status.ptr, g_stream));
        const Out want = fetch_out(dref, B, P, rows, true);
        std::vector<float> ones(B, 1.0f);
        std::vector<int32_t> no_k(B);
        for (int64_t b = 0; b < B; b++) no_k[b] = b % 2 ? 0 : (int32_t)(V + b);
        EXPECT(same_out(want, batch_call(std::vector<float>(B, T), NULL, NULL, dout)),
               "batch launch %lld: no settings arrays but temperature: differs from the scalar call", (long long)it);
        EXPECT(same_out(want, batch_call(std::vector<float>(B, T), &ones, &no_k, dout)),
               "batch launch %lld (%s, V=%lld): top_p 1 and top_k 0 / >= V differ from the scalar call", (long long)it,
               dtype_name(dtype), (long long)V);
        // 2. Temperature 0 (greedy) and top-k requests in one batch.
        prepare_out(dref, B, P, rows);
        KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d, &g, NULL, 0, NULL, NULL, P, (int32_t*)dref.nodes.ptr,
                                                         (int32_t*)dref.len.ptr, (int32_t*)dref.bonus.ptr,
                                                         (int32_t*)dref.target.ptr, (int32_t*)dref.status.ptr,
                                                         g_stream));
        const Out greedy = fetch_out(dref, B, P, rows, true);
        std::vector<float> temp(B);
        std::vector<int32_t> topk(B);
        for (int64_t b = 0; b < B; b++) {
            temp[b] = b % 3 == 0 ? 0.0f : T;
            topk[b] = (int32_t)std::min<int64_t>(V, b % 4 == 1 ? 1 : b % 4 == 2 ? 3 : 25);
        }
        const Out o = batch_call(temp, NULL, &topk, dout);
        for (int64_t b = 0; b < B; b++) {
            EXPECT(o.status[b] == want.status[b], "batch launch %lld request %lld: status %d, scalar call %d",
                   (long long)it, (long long)b, o.status[b], want.status[b]);
            if (temp[b] == 0.0f) {
                bool same = o.len[b] == greedy.len[b] && o.bonus[b] == greedy.bonus[b];
                for (int64_t i = 0; i < rows; i++) same &= o.target[b * rows + i] == greedy.target[b * rows + i];
                EXPECT(same, "batch launch %lld request %lld: temperature 0 differs from the greedy call",
                       (long long)it, (long long)b);
                continue;
            }
            for (int64_t i = 0; i < rows; i++) {
                const int32_t got = o.target[b * rows + i];
                if (got < 0) continue;
                const float* row = &values[(b * rows + i) * V];
                std::vector<int32_t> ids(V);
                for (int64_t v = 0; v < V; v++) ids[v] = (int32_t)v;
                std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t c) { return row[a] > row[c]; });
                std::vector<float> kept(V, -INFINITY);
                for (int64_t r = 0; r < topk[b]; r++) kept[ids[r]] = row[ids[r]];
                double gap;
                const int32_t w = host_draw(kept.data(), V, T, seed, offset, (uint32_t)b, (uint32_t)i, &gap);
                if (gap < 1e-4) {
                    near_ties++;
                    continue;
                }
                checked++;
                EXPECT(w == got, "batch launch %lld request %lld node %lld: top-%d draw %d, host %d", (long long)it,
                       (long long)b, (long long)i, topk[b], got, w);
            }
        }
        // 3. Bad settings fail their request alone.
        std::vector<float> tp(B, 1.0f);
        std::vector<int32_t> tk(B, 0);
        std::vector<float> tt(B, T);
        for (int64_t b = 0; b < B; b++) {
            switch (b % 8) {
                case 1: tt[b] = NAN; break;
                case 2: tt[b] = -1.0f; break;
                case 3: tt[b] = 1e-7f; break;
                case 4: tp[b] = 0.0f; break;
                case 5: tp[b] = 1.5f; break;
                case 6: tk[b] = -1; break;
                case 7: tt[b] = INFINITY; break;
                default: break;
            }
        }
        const Out bad = batch_call(tt, &tp, &tk, dout);
        for (int64_t b = 0; b < B; b++) {
            if (b % 8 == 0) {
                EXPECT(bad.status[b] == want.status[b] && bad.bonus[b] == want.bonus[b],
                       "batch launch %lld request %lld: a neighbour's bad setting changed it", (long long)it,
                       (long long)b);
                continue;
            }
            bool failed = bad.status[b] == KDT_ERR_VALUE && bad.len[b] == 0 && bad.bonus[b] == -1;
            for (int64_t j = 0; j < P; j++) failed &= bad.nodes[b * P + j] == -1;
            for (int64_t i = 0; i < rows; i++) failed &= bad.target[b * rows + i] == -1;
            EXPECT(failed, "batch launch %lld request %lld: a bad setting (case %lld) gave status %d", (long long)it,
                   (long long)b, (long long)(b % 8), bad.status[b]);
        }
    }
    printf("sample batch: %lld launches, %lld top-k draws reproduced on the host (%lld near-ties skipped)\n",
           (long long)launches, (long long)checked, (long long)near_ties);
    EXPECT(checked > 0, "no top-k draw was checked");
    // Host-side checks of the sampling struct.
    {
        Trees t = star_trees(2, 1, 3);
        kdt_trees d = upload_trees(dt, t);
        std::vector<float> vals(2 * 2 * 8, 0.0f);
        Layout lay;
        lay.row_stride = 8;
        lay.batch_stride = 16;
        const kdt_logits g = upload_logits(d_logits, vals, 2, 2, 8, KDT_DTYPE_FLOAT32, lay);
        prepare_out(dout, 2, 3, 2);
        kdt_sampling sp;
        sp.temperature = upload(d_temp, std::vector<float>(2, 1.0f));
        sp.top_p = NULL;
        sp.top_k = NULL;
        sp.seed = upload(d_seed, std::vector<uint64_t>(2, 1));
        sp.offset = upload(d_offset, std::vector<uint64_t>(2, 2));
        auto call = [&](const kdt_sampling* s) {
            return kdt_verify_sample_batch_cuda(&d, &g, s, NULL, 0, NULL, NULL, 3, (int32_t*)dout.nodes.ptr,
                                                (int32_t*)dout.len.ptr, (int32_t*)dout.bonus.ptr, NULL,
                                                (int32_t*)dout.status.ptr, g_stream);
        };
        EXPECT_STATUS(call(&sp), KDT_OK);
        EXPECT_STATUS(call(NULL), KDT_ERR_NULL_POINTER);
        kdt_sampling s2 = sp;
        s2.seed = NULL;
        EXPECT_STATUS(call(&s2), KDT_ERR_NULL_POINTER);
        s2 = sp;
        s2.temperature = NULL;
        EXPECT_STATUS(call(&s2), KDT_ERR_NULL_POINTER);
        s2 = sp;
        s2.offset = (const uint64_t*)((const char*)sp.offset + 4);
        EXPECT_STATUS(call(&s2), KDT_ERR_INVALID_ARGUMENT);
        CUDA_OK(cudaStreamSynchronize(g_stream));
    }
    release(dt);
    release(dout);
    release(dref);
    for (DevBuf* b : {&d_logits, &d_temp, &d_topp, &d_topk, &d_seed, &d_offset}) release(*b);
}

// Multi-token stop sequences on a hand tree, two requests (path 0 -> 1 (10) -> 3 (30),
// bonus 42): the CPU walk's results, and malformed device arrays failing every request.
static void test_stop_sequences() {
    const int32_t num[2] = {3, 3};
    const int32_t tok[10] = {5, 10, 20, 30, -1, 5, 10, 20, 30, -1};
    const int32_t fc[10] = {1, 3, -1, -1, -1, 1, 3, -1, -1, -1};
    const int32_t ns[10] = {-1, 2, -1, -1, -1, -1, 2, -1, -1, -1};
    const int32_t target[10] = {10, 30, 0, 42, 0, 10, 30, 0, 42, 0};
    const int32_t seq_tokens[5] = {7, 5, 10, 10, 30};
    const int64_t offsets[3] = {0, 3, 5}, bad_offsets[3] = {0, 3, 3};
    const int32_t history[6] = {-1, 7, 5, -1, -1, 5};  // request 0 ends with 7 5, request 1 does not
    void* dev[10];
    const void* host[10] = {num, tok, fc, ns, target, seq_tokens, offsets, history, bad_offsets, nullptr};
    const size_t bytes[10] = {sizeof num, sizeof tok, sizeof fc, sizeof ns, sizeof target, sizeof seq_tokens,
                              sizeof offsets, sizeof history, sizeof bad_offsets, 64};
    for (int i = 0; i < 10; i++) {
        CUDA_OK(cudaMalloc(&dev[i], bytes[i]));
        if (host[i] != nullptr) CUDA_OK(cudaMemcpy(dev[i], host[i], bytes[i], cudaMemcpyHostToDevice));
    }
    int32_t* out = static_cast<int32_t*>(dev[9]);  // nodes [2, 3], len [2], bonus [2], status [2]
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = 2;
    t.budget = 4;
    t.num_nodes = static_cast<int32_t*>(dev[0]);
    t.tokens = static_cast<int32_t*>(dev[1]);
    t.first_child = static_cast<int32_t*>(dev[2]);
    t.next_sibling = static_cast<int32_t*>(dev[3]);
    kdt_stop_sequences q = {static_cast<const int32_t*>(dev[5]), static_cast<const int64_t*>(dev[6]), 2,
                            static_cast<const int32_t*>(dev[7]), 3};
    int32_t got[12];
    auto run = [&](const kdt_stop_sequences* stops) {
        KDT_OK_OR_DIE(kdt_verify_greedy_cuda(&t, static_cast<const int32_t*>(dev[4]), NULL, 0, stops, NULL, 3, out,
                                             out + 6, out + 8, out + 10, g_stream));
        CUDA_OK(cudaStreamSynchronize(g_stream));
        CUDA_OK(cudaMemcpy(got, out, sizeof got, cudaMemcpyDeviceToHost));
    };
    run(&q);
    // Request 0: 7 5 10 completes at node 1; request 1: 10 30 at node 3. No bonus either.
    EXPECT(got[6] == 1 && got[7] == 2 && got[8] == -1 && got[9] == -1 && got[10] == KDT_OK && got[11] == KDT_OK,
           "stop sequences: lengths %d %d, bonus %d %d, status %d %d", got[6], got[7], got[8], got[9], got[10],
           got[11]);
    // The CPU walk agrees, request by request.
    for (int b = 0; b < 2; b++) {
        kdt_trees one;
        memset(&one, 0, sizeof one);
        one.batch = 1;
        one.budget = 4;
        one.num_nodes = const_cast<int32_t*>(&num[b]);
        one.tokens = const_cast<int32_t*>(&tok[5 * b]);
        one.first_child = const_cast<int32_t*>(&fc[5 * b]);
        one.next_sibling = const_cast<int32_t*>(&ns[5 * b]);
        kdt_stop_sequences hq = {seq_tokens, offsets, 2, &history[3 * b], 3};
        int32_t nodes[3], len, bonus;
        KDT_OK_OR_DIE(kdt_verify_greedy_cpu(&one, &target[5 * b], NULL, 0, &hq, NULL, 3, nodes, &len, &bonus));
        EXPECT(len == got[6 + b] && bonus == got[8 + b], "request %d: CPU %d / %d, GPU %d / %d", b, len, bonus,
               got[6 + b], got[8 + b]);
    }
    // A sequence of length 0 in device memory: every request fails, outputs as a failure.
    kdt_stop_sequences bad = q;
    bad.offsets = static_cast<const int64_t*>(dev[8]);
    run(&bad);
    EXPECT(got[10] == KDT_ERR_INVALID_ARGUMENT && got[11] == KDT_ERR_INVALID_ARGUMENT && got[6] == 0 &&
               got[8] == -1 && got[0] == -1,
           "malformed stop sequences: status %d %d", got[10], got[11]);
    // Host-side checks.
    bad = q;
    bad.count = -1;
    EXPECT_STATUS(kdt_verify_greedy_cuda(&t, static_cast<const int32_t*>(dev[4]), NULL, 0, &bad, NULL, 3, out,
                                         out + 6, out + 8, out + 10, g_stream),
                  KDT_ERR_INVALID_ARGUMENT);
    bad = q;
    bad.history = NULL;
    EXPECT_STATUS(kdt_verify_greedy_cuda(&t, static_cast<const int32_t*>(dev[4]), NULL, 0, &bad, NULL, 3, out,
                                         out + 6, out + 8, out + 10, g_stream),
                  KDT_ERR_NULL_POINTER);
    for (int i = 0; i < 10; i++) CUDA_OK(cudaFree(dev[i]));
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    set_forced_paths(argc, argv);
    const char* q = getenv("KDT_CUDA_QUICK");
    const bool quick = q != NULL && atoi(q) != 0;
    CUDA_OK(cudaStreamCreate(&g_stream));
    test_philox_kat();
    test_host_errors();
    test_given(quick ? 20 : 200);
    test_greedy_logits(quick ? 8 : 60, quick);
    test_greedy_ties();
    test_sample_walks(quick ? 4 : 30);
    test_sample_offsets();
    test_chi_square(quick);
    test_invalid_rows();
    test_graph_capture();
    test_sample_batch(quick ? 4 : 24);
    test_stop_sequences();
    CUDA_OK(cudaStreamDestroy(g_stream));
    printf("%lld checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
