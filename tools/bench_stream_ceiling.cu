// What the top-k row kernel's structure can reach at best: one 256-thread block per row of
// V = 151,936 bfloat16 logits (B * L = 1,024 rows), 16-byte loads, U vectors per thread per
// trip, the next trip's loads issued before the current trip is used (kAhead trips ahead),
// with or without a block barrier per trip, with or without the per-logit arithmetic
// (running max, 2^(x log2 e - c) summed). Against a flat grid-stride read of the same bytes.
// Medians of CUDA events over three rotated inputs. Standalone (no libkdtree); built as
// `kdtree_bench_stream` when CUDA is enabled. Results: docs/performance.md, "Top-k log-probs".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <vector>

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) { fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); return 1; } \
    } while (0)

namespace {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.44269504088896340736f;

__device__ __forceinline__ float ex2(float y) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    return r;
}

__device__ __forceinline__ uint32_t bmax2(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const __nv_bfloat162 r = __hmax2_nan(x, y);
    uint32_t o;
    memcpy(&o, &r, 4);
    return o;
}

struct Acc {
    float m = -3.0e38f, sum = 0.0f;
    uint32_t x = 0;
};

template <int kMath>
__device__ __forceinline__ void consume(const uint4& v, Acc& a) {
    if (kMath == 0) {
        a.x ^= v.x ^ v.y ^ v.z ^ v.w;
        return;
    }
    const uint32_t pm = bmax2(bmax2(v.x, v.y), bmax2(v.z, v.w));
    const float vm = fmaxf(__uint_as_float(pm << 16), __uint_as_float(pm & 0xFFFF0000u));
    if (vm > a.m) {
        a.sum *= ex2((a.m - vm) * kLog2e);
        a.m = vm;
    }
    const float c = a.m * kLog2e;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float e[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        e[2 * i] = ex2(__fmaf_rn(__uint_as_float(w[i] << 16), kLog2e, -c));
        e[2 * i + 1] = ex2(__fmaf_rn(__uint_as_float(w[i] & 0xFFFF0000u), kLog2e, -c));
    }
    a.sum += ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}

// One block per row; trip t covers vectors [t * 256 U, (t + 1) * 256 U) of the row.
// (The register bound asks for at most 6 blocks of 256 threads: 1,536 threads is the most
// an SM holds on some of the default architectures, e.g. sm_120; the 8-block variant needs
// only 32 registers anyway.)
template <int U, int kAhead, bool kBarrier, int kMath, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks > 6 ? 6 : kMinBlocks)
    row_stream(const uint4* data, int nvec, float* out) {
    const uint4* row = data + (size_t)blockIdx.x * nvec;
    const int trip_vecs = kThreads * U;
    const int trips = (nvec + trip_vecs - 1) / trip_vecs;
    uint4 buf[kAhead + 1][U];
    Acc a;
    auto load = [&](int t, uint4 (&r)[U]) {
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int v = t * trip_vecs + j * kThreads + (int)threadIdx.x;
            r[j] = v < nvec ? __ldcs(row + v) : make_uint4(0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u);
        }
    };
#pragma unroll
    for (int i = 0; i < kAhead; i++) load(i, buf[i]);
    for (int t = 0; t < trips; t += kAhead + 1) {
#pragma unroll
        for (int s = 0; s <= kAhead; s++) {  // register set s holds trip t + s
            if (t + s < trips) {
                if (t + s + kAhead < trips) load(t + s + kAhead, buf[(s + kAhead) % (kAhead + 1)]);
#pragma unroll
                for (int j = 0; j < U; j++) consume<kMath>(buf[s][j], a);
                if (kBarrier && __syncthreads_or(a.sum < 0.0f)) a.x += 1;  // never true; keeps the vote
            }
        }
    }
    float r = a.sum + a.m + (float)a.x;
    for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(0xFFFFFFFFu, r, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, r);
}

// Grid-stride read of all vectors, four loads in flight per thread.
template <int kMath>
__global__ void __launch_bounds__(kThreads) flat_stream(const uint4* data, size_t total, float* out) {
    Acc a;
    const size_t stride = (size_t)gridDim.x * kThreads;
    size_t i = (size_t)blockIdx.x * kThreads + threadIdx.x;
    for (; i + 3 * stride < total; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = __ldcs(data + i + j * stride);
#pragma unroll
        for (int j = 0; j < 4; j++) consume<kMath>(v[j], a);
    }
    for (; i < total; i += stride) consume<kMath>(__ldcs(data + i), a);
    float r = a.sum + a.m + (float)a.x;
    for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(0xFFFFFFFFu, r, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + (blockIdx.x & 1023), r);
}

}  // namespace

template <class Launch>
static float median_us(Launch&& launch, int reps) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> t;
    for (int r = 0; r < reps + 2; r++) {
        cudaEventRecord(e0);
        launch(r % 3);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (r >= 2) t.push_back(ms * 1000.0f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main() {
    const int rows = 1024, V = 151936, nvec = V * 2 / 16;
    const size_t bytes = (size_t)rows * nvec * 16;
    uint4* d[3];
    float* out;
    for (auto& p : d) {
        CK(cudaMalloc(&p, bytes));
        CK(cudaMemset(p, 0x3C, bytes));  // bf16 0x3C3C ~ 0.0115: finite logits
    }
    CK(cudaMalloc(&out, 4096 * 4));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int reps = 15;
    printf("%s, %d SMs; %d rows x V = %d bf16 = %.1f MB; medians of %d\n", prop.name, prop.multiProcessorCount, rows, V,
           bytes / 1e6, reps);
    printf("| variant | us | GB/s |\n|---|---|---|\n");
    auto report = [&](const char* name, float us) { printf("| %s | %.1f | %.0f |\n", name, us, bytes / us / 1e3); };
    const int flat_grid = prop.multiProcessorCount * 8;
    report("flat read, 4 loads in flight", median_us([&](int s) { flat_stream<0><<<flat_grid, kThreads>>>(d[s], bytes / 16, out); }, reps));
    report("flat read + max/exp-sum", median_us([&](int s) { flat_stream<1><<<flat_grid, kThreads>>>(d[s], bytes / 16, out); }, reps));
    // Dynamic shared memory (unused) holds each variant to MB blocks per SM, as the top-k
    // kernel's 49 KB of shared memory holds it to 4.
#define ROW(U, A, BAR, MATH, MB, NAME)                                                              \
    do {                                                                                            \
        const int smem = (int)(prop.sharedMemPerMultiprocessor / (MB)) - 2048;                      \
        CK(cudaFuncSetAttribute(row_stream<U, A, BAR, MATH, MB>,                                    \
                                cudaFuncAttributeMaxDynamicSharedMemorySize, smem));                \
        report(NAME, median_us([&](int s) { row_stream<U, A, BAR, MATH, MB><<<rows, kThreads, smem>>>(d[s], nvec, out); }, reps)); \
    } while (0)
    ROW(2, 1, false, 0, 4, "row/block U=2 ahead 1, no barrier, read only");
    ROW(2, 1, true, 0, 4, "row/block U=2 ahead 1, barrier per trip, read only");
    ROW(2, 1, false, 1, 4, "row/block U=2 ahead 1, no barrier, max/exp-sum");
    ROW(2, 1, true, 1, 4, "row/block U=2 ahead 1, barrier per trip, max/exp-sum (the top-k kernel's skeleton)");
    ROW(4, 1, true, 1, 4, "row/block U=4 ahead 1, barrier per trip, max/exp-sum");
    ROW(4, 1, false, 1, 4, "row/block U=4 ahead 1, no barrier, max/exp-sum");
    ROW(2, 2, true, 1, 4, "row/block U=2 ahead 2, barrier per trip, max/exp-sum");
    ROW(2, 3, true, 1, 4, "row/block U=2 ahead 3, barrier per trip, max/exp-sum");
    ROW(1, 3, true, 1, 4, "row/block U=1 ahead 3, barrier per trip, max/exp-sum");
    ROW(2, 1, true, 1, 8, "row/block U=2 ahead 1, barrier per trip, max/exp-sum, 8 blocks/SM");
    ROW(2, 1, true, 1, 3, "row/block U=2 ahead 1, barrier per trip, max/exp-sum, 3 blocks/SM");
    CK(cudaDeviceSynchronize());
    return 0;
}
