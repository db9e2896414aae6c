// kdt_compact_kv_cuda against a host gather done on a copy of the cache (row p + j of the
// result = row p + a_j of the original, j = 0 .. m, for every layer, K and V, head):
// float16, bfloat16 and float32 caches filled with random bits, [B, H, S, D] and
// [B, S, H, D] layouts through the strides, padded rows, several layers, V present or
// not, layer tensors at 16-byte aligned, element-aligned and odd addresses, random
// accepted paths (strictly increasing from 0), contiguous paths, m = 0, long paths; failed
// requests (bad path, accept_length out of range, negative prefix, a row past
// seq_capacity) next to good ones must leave their rows untouched. Every byte of every
// tensor is compared, padding included. Also a CUDA graph capture and the host-side
// argument checks. KDT_CUDA_QUICK=1 shrinks it. Exits 77 (skipped) without a GPU.
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "kdtree.h"
#define KDT_TEST_SEED 0x13198A2E03707344ull
#define KDT_TEST_EXPECT
#include "cuda_harness.h"

static cudaStream_t stream;

// One random cache and one round of accepted paths.
struct Case {
    int32_t dtype = KDT_DTYPE_FLOAT16;
    size_t esize = 2;
    int64_t layers = 1, B = 1, H = 1, S = 1, D = 1, P = 1;
    bool bshd = false, with_v = true;
    int64_t bs = 0, hs = 0, ss = 0;   // element strides
    int64_t byte_offset = 0;          // the tensors start this many bytes into their buffers
    size_t tensor_bytes = 0;          // bytes of one tensor's buffer (offset included)
    std::vector<int64_t> prefix;
    std::vector<int32_t> nodes, length;  // [B, P], [B]
    std::string what;
};

// The documented status of request b.
static int32_t ref_status(const Case& c, int64_t b) {
    const int32_t m = c.length[b];
    if (m < 0 || m > c.P - 1) return KDT_ERR_VALUE;
    const int32_t* a = &c.nodes[b * c.P];
    if (a[0] != 0) return KDT_ERR_VALUE;
    for (int32_t j = 1; j <= m; j++)
        if (a[j] <= a[j - 1]) return KDT_ERR_VALUE;
    if (c.prefix[b] < 0 || c.prefix[b] + a[m] >= c.S) return KDT_ERR_OUT_OF_RANGE;
    return KDT_OK;
}

// The host gather on a copy: for every valid request, row p + j <- original row p + a_j.
static void ref_compact(const Case& c, const std::vector<uint8_t>& orig, std::vector<uint8_t>& out) {
    out = orig;
    for (int64_t b = 0; b < c.B; b++) {
        if (ref_status(c, b) != KDT_OK) continue;
        const int64_t p = c.prefix[b];
        for (int64_t h = 0; h < c.H; h++) {
            for (int64_t j = 0; j <= c.length[b]; j++) {
                const int64_t a = c.nodes[b * c.P + j];
                const size_t dst = (size_t)c.byte_offset + (size_t)(b * c.bs + h * c.hs + (p + j) * c.ss) * c.esize;
                const size_t src = (size_t)c.byte_offset + (size_t)(b * c.bs + h * c.hs + (p + a) * c.ss) * c.esize;
                memcpy(&out[dst], &orig[src], (size_t)c.D * c.esize);
            }
        }
    }
}

// A strictly increasing path from 0 of m + 1 nodes whose last node is at most `limit`.
static void random_path(int32_t* a, int32_t m, bool contiguous, int64_t limit) {
    a[0] = 0;
    for (int32_t j = 1; j <= m; j++) {
        const int64_t room = limit - (m - j) - a[j - 1] - 1;  // gap allowed at step j
        a[j] = a[j - 1] + 1 + (int32_t)(contiguous || room <= 0 || unit() < 0.4 ? 0 : uniform(0, room < 6 ? room : 6));
    }
}

static Case make_case(const char* what, bool faults) {
    Case c;
    const int dt = (int)uniform(0, 2);
    c.dtype = dt == 0 ? KDT_DTYPE_FLOAT16 : dt == 1 ? KDT_DTYPE_BFLOAT16 : KDT_DTYPE_FLOAT32;
    c.esize = c.dtype == KDT_DTYPE_FLOAT32 ? 4 : 2;
    c.layers = uniform(1, 4);
    c.B = uniform(1, 8);
    c.H = uniform(1, 4);
    c.S = uniform(8, 96);
    static const int64_t kDims[] = {1, 2, 3, 7, 8, 16, 24, 64, 80, 128};
    c.D = kDims[uniform(0, 9)];
    const int64_t Dp = c.D + (unit() < 0.3 ? uniform(1, 9) : 0);  // padded rows
    c.bshd = unit() < 0.5;
    if (c.bshd) {
        c.hs = Dp;
        c.ss = c.H * Dp;
        c.bs = c.S * c.ss;
    } else {
        c.ss = Dp;
        c.hs = c.S * Dp;
        c.bs = c.H * c.hs;
    }
    c.with_v = unit() < 0.75;
    const double u = unit();
    c.byte_offset = u < 0.75 ? 0 : u < 0.95 ? (int64_t)c.esize * uniform(1, 3) : 1;  // odd: byte copies
    c.tensor_bytes = (size_t)c.byte_offset + (size_t)(c.B * c.bs) * c.esize + 32;
    c.P = uniform(1, 24);
    c.prefix.assign(c.B, 0);
    c.nodes.assign(c.B * c.P, -1);
    c.length.assign(c.B, 0);
    for (int64_t b = 0; b < c.B; b++) {
        int32_t* a = &c.nodes[b * c.P];
        const int64_t max_m = c.P - 1 < c.S - 1 ? c.P - 1 : c.S - 1;
        const double v = unit();
        const int32_t m = v < 0.1 ? 0 : (int32_t)uniform(0, max_m);
        const int64_t p = uniform(0, c.S - 1 - m);
        random_path(a, m, v < 0.3, c.S - 1 - p);
        c.length[b] = m;
        c.prefix[b] = p;
        if (faults && c.B > 1 && unit() < 0.15) {
            switch (uniform(0, 5)) {
                case 0: a[0] = 1; break;
                case 1:
                    if (m >= 1) a[m] = a[m - 1];  // not strictly increasing
                    else a[0] = -1;
                    break;
                case 2: c.length[b] = (int32_t)c.P; break;
                case 3: c.length[b] = -1; break;
                case 4: c.prefix[b] = unit() < 0.5 ? -1 : -uniform(2, 1000); break;
                default: c.prefix[b] = c.S - a[m]; break;  // the last row is past seq_capacity
            }
        }
    }
    c.what = std::string(what) + " dtype=" + std::to_string(c.dtype) + (c.bshd ? " BSHD" : " BHSD") +
             " L=" + std::to_string(c.layers) + " B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) +
             " S=" + std::to_string(c.S) + " D=" + std::to_string(c.D) + " Dp=" + std::to_string(Dp) +
             " offset=" + std::to_string(c.byte_offset) + (c.with_v ? " K+V" : " K");
    return c;
}

// Runs one compaction (through a captured graph when asked) and compares every byte.
static void run_case(const Case& c, bool graph) {
    const int64_t tensors = c.layers * (c.with_v ? 2 : 1);
    std::vector<std::vector<uint8_t>> orig(tensors);
    std::vector<uint8_t*> bufs(tensors);
    std::vector<void*> kptr(c.layers), vptr(c.layers);
    for (int64_t t = 0; t < tensors; t++) {
        orig[t].resize(c.tensor_bytes);
        for (auto& x : orig[t]) x = (uint8_t)next_u64();
        CUDA_OK(cudaMalloc(&bufs[t], c.tensor_bytes));
        CUDA_OK(cudaMemcpy(bufs[t], orig[t].data(), c.tensor_bytes, cudaMemcpyHostToDevice));
        void* p = bufs[t] + c.byte_offset;
        if (t < c.layers) kptr[t] = p;
        else vptr[t - c.layers] = p;
    }
    void **d_k, **d_v = nullptr;
    int64_t* d_pre;
    int32_t *d_nodes, *d_len, *d_status;
    CUDA_OK(cudaMalloc(&d_k, c.layers * sizeof(void*)));
    CUDA_OK(cudaMemcpy(d_k, kptr.data(), c.layers * sizeof(void*), cudaMemcpyHostToDevice));
    if (c.with_v) {
        CUDA_OK(cudaMalloc(&d_v, c.layers * sizeof(void*)));
        CUDA_OK(cudaMemcpy(d_v, vptr.data(), c.layers * sizeof(void*), cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMalloc(&d_pre, c.B * 8));
    CUDA_OK(cudaMalloc(&d_nodes, c.B * c.P * 4));
    CUDA_OK(cudaMalloc(&d_len, c.B * 4));
    CUDA_OK(cudaMalloc(&d_status, c.B * 4));
    CUDA_OK(cudaMemcpy(d_pre, c.prefix.data(), c.B * 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_nodes, c.nodes.data(), c.B * c.P * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_len, c.length.data(), c.B * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_status, 0x7F, c.B * 4));
    kdt_kv_cache kv;
    memset(&kv, 0, sizeof kv);
    kv.k_layers = d_k;
    kv.v_layers = d_v;
    kv.num_layers = c.layers;
    kv.dtype = c.dtype;
    kv.batch = c.B;
    kv.heads = c.H;
    kv.seq_capacity = c.S;
    kv.head_dim = c.D;
    kv.batch_stride = c.bs;
    kv.head_stride = c.hs;
    kv.seq_stride = c.ss;
    if (graph) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        const kdt_status st = kdt_compact_kv_cuda(&kv, d_pre, d_nodes, d_len, c.P, d_status, stream);
        CUDA_OK(cudaStreamEndCapture(stream, &g));
        KDT_OK_OR_DIE(st);
        CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
        CUDA_OK(cudaGraphLaunch(exec, stream));  // once: compaction is not idempotent
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaGraphExecDestroy(exec));
        CUDA_OK(cudaGraphDestroy(g));
    } else {
        KDT_OK_OR_DIE(kdt_compact_kv_cuda(&kv, d_pre, d_nodes, d_len, c.P, d_status, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<int32_t> status(c.B);
    CUDA_OK(cudaMemcpy(status.data(), d_status, c.B * 4, cudaMemcpyDeviceToHost));
    for (int64_t b = 0; b < c.B; b++) {
        const int32_t want = ref_status(c, b);
        EXPECT(status[b] == want, "%s: request %lld status %d, expected %d", c.what.c_str(), (long long)b, status[b],
               want);
    }
    std::vector<uint8_t> got(c.tensor_bytes), want;
    for (int64_t t = 0; t < tensors; t++) {
        CUDA_OK(cudaMemcpy(got.data(), bufs[t], c.tensor_bytes, cudaMemcpyDeviceToHost));
        ref_compact(c, orig[t], want);
        if (memcmp(got.data(), want.data(), c.tensor_bytes) != 0) {
            size_t at = 0;
            while (got[at] == want[at]) at++;
            const size_t e = (at - (size_t)c.byte_offset) / c.esize;
            EXPECT(false, "%s: tensor %lld differs at byte %zu (element %zu: b %lld): %02x, expected %02x",
                   c.what.c_str(), (long long)t, at, e, (long long)(c.bs ? (int64_t)e / c.bs : 0), got[at], want[at]);
        }
        CUDA_OK(cudaFree(bufs[t]));
    }
    CUDA_OK(cudaFree(d_k));
    if (d_v) CUDA_OK(cudaFree(d_v));
    CUDA_OK(cudaFree(d_pre));
    CUDA_OK(cudaFree(d_nodes));
    CUDA_OK(cudaFree(d_len));
    CUDA_OK(cudaFree(d_status));
}

static void host_errors() {
    void** d_k;
    int64_t* d_pre;
    int32_t *d_nodes, *d_len, *d_status;
    CUDA_OK(cudaMalloc(&d_k, 2 * sizeof(void*)));
    CUDA_OK(cudaMemset(d_k, 0, 2 * sizeof(void*)));  // NULL layer tensors: skipped
    CUDA_OK(cudaMalloc(&d_pre, 16));
    CUDA_OK(cudaMalloc(&d_nodes, 2 * 4 * 4));
    CUDA_OK(cudaMalloc(&d_len, 8));
    CUDA_OK(cudaMalloc(&d_status, 8));
    const int64_t pre[2] = {3, -1};
    const int32_t nodes[8] = {0, 2, 3, -1, 0, 1, -1, -1}, len[2] = {2, 1};
    CUDA_OK(cudaMemcpy(d_pre, pre, 16, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_nodes, nodes, 32, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_len, len, 8, cudaMemcpyHostToDevice));
    kdt_kv_cache good;
    memset(&good, 0, sizeof good);
    good.k_layers = d_k;
    good.num_layers = 2;
    good.dtype = KDT_DTYPE_BFLOAT16;
    good.batch = 2;
    good.heads = 2;
    good.seq_capacity = 16;
    good.head_dim = 8;
    good.seq_stride = 8;
    good.head_stride = 16 * 8;
    good.batch_stride = 2 * 16 * 8;
    void* s = stream;
    EXPECT_STATUS(kdt_compact_kv_cuda(nullptr, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_NULL_POINTER);
    kdt_kv_cache c = good;
    c.dtype = KDT_DTYPE_INT32;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_INVALID_ARGUMENT);
    c = good;
    c.reserved = 1;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_INVALID_ARGUMENT);
    for (int field = 0; field < 8; field++) {
        c = good;
        int64_t* f[8] = {&c.num_layers, &c.batch, &c.heads, &c.seq_capacity, &c.head_dim, &c.batch_stride,
                         &c.head_stride, &c.seq_stride};
        *f[field] = -1;
        EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_INVALID_ARGUMENT);
    }
    c = good;
    c.seq_stride = 7;  // < head_dim
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_compact_kv_cuda(&good, d_pre, d_nodes, d_len, 0, d_status, s), KDT_ERR_INVALID_ARGUMENT);
    c = good;
    c.k_layers = nullptr;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_compact_kv_cuda(&good, nullptr, d_nodes, d_len, 4, d_status, s), KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_compact_kv_cuda(&good, d_pre, nullptr, d_len, 4, d_status, s), KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_compact_kv_cuda(&good, d_pre, d_nodes, nullptr, 4, d_status, s), KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_compact_kv_cuda(&good, d_pre, d_nodes, d_len, 4, nullptr, s), KDT_ERR_NULL_POINTER);
    c = good;
    c.batch_stride = INT64_MAX / 2;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_OVERFLOW);
    c = good;
    c.seq_stride = INT64_MAX / 8;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_ERR_OVERFLOW);
    // An empty batch does nothing; no layers (or NULL layer tensors) still give statuses.
    c = good;
    c.batch = 0;
    EXPECT_STATUS(kdt_compact_kv_cuda(&c, nullptr, nullptr, nullptr, 4, nullptr, s), KDT_OK);
    for (int variant = 0; variant < 2; variant++) {
        c = good;
        if (variant == 0) {
            c.num_layers = 0;
            c.k_layers = nullptr;
        }
        CUDA_OK(cudaMemset(d_status, 0x7F, 8));
        EXPECT_STATUS(kdt_compact_kv_cuda(&c, d_pre, d_nodes, d_len, 4, d_status, s), KDT_OK);
        CUDA_OK(cudaStreamSynchronize(stream));
        int32_t st[2];
        CUDA_OK(cudaMemcpy(st, d_status, 8, cudaMemcpyDeviceToHost));
        EXPECT(st[0] == KDT_OK && st[1] == KDT_ERR_OUT_OF_RANGE, "statuses without tensors: %d %d", st[0], st[1]);
    }
    CUDA_OK(cudaFree(d_k));
    CUDA_OK(cudaFree(d_pre));
    CUDA_OK(cudaFree(d_nodes));
    CUDA_OK(cudaFree(d_len));
    CUDA_OK(cudaFree(d_status));
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    set_forced_paths(argc, argv);
    const bool quick = getenv("KDT_CUDA_QUICK") != nullptr && atoi(getenv("KDT_CUDA_QUICK")) != 0;
    CUDA_OK(cudaStreamCreate(&stream));
    host_errors();
    const int iterations = quick ? 12 : 150;
    for (int it = 0; it < iterations; it++) {
        const Case c = make_case("random", true);
        run_case(c, it % 10 == 3);
    }
    // A long path (batches of moves cross several times) in every dtype and layout.
    for (int v = 0; v < (quick ? 2 : 6); v++) {
        Case c = make_case("long path", false);
        c.P = 64;
        c.S = 200;
        c.nodes.assign(c.B * c.P, -1);
        c.prefix.assign(c.B, 0);
        c.length.assign(c.B, 0);
        if (c.bshd) {
            c.bs = c.S * c.ss;
        } else {
            c.hs = c.S * c.ss;
            c.bs = c.H * c.hs;
        }
        c.tensor_bytes = (size_t)c.byte_offset + (size_t)(c.B * c.bs) * c.esize + 32;
        for (int64_t b = 0; b < c.B; b++) {
            const int32_t m = (int32_t)uniform(20, 63);
            c.prefix[b] = uniform(0, 40);
            random_path(&c.nodes[b * c.P], m, false, c.S - 1 - c.prefix[b]);
            c.length[b] = m;
        }
        run_case(c, false);
    }
    if (!quick) {  // more requests than a grid's y extent (65,535): blocks loop over requests
        Case c = make_case("batch 70000", true);
        c.B = 70000;
        c.layers = 1;
        c.H = 1;
        c.S = 12;
        c.D = 8;
        c.byte_offset = 0;
        c.P = 5;
        c.ss = c.D;
        c.hs = c.S * c.D;
        c.bs = c.hs;
        c.tensor_bytes = (size_t)(c.B * c.bs) * c.esize + 32;
        c.prefix.assign(c.B, 0);
        c.nodes.assign(c.B * c.P, -1);
        c.length.assign(c.B, 0);
        for (int64_t b = 0; b < c.B; b++) {
            const int32_t m = (int32_t)uniform(0, 4);
            c.prefix[b] = uniform(0, 11 - m);
            random_path(&c.nodes[b * c.P], m, unit() < 0.3, 11 - c.prefix[b]);
            c.length[b] = m;
            if (unit() < 0.05) c.prefix[b] = -1;
        }
        c.what = "batch 70000";
        run_case(c, false);
    }
    CUDA_OK(cudaStreamDestroy(stream));
    printf("cuda compaction: %lld checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
