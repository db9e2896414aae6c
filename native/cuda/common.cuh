// Helpers shared by the CUDA sources of libkdtree (not part of the ABI).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "internal.h"
}
#include "kdt_testing.h"

namespace kdt {

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// The test-only settings of native/kdt_testing.h (testing.cu): the forced tree paths
// (KDT_TESTING_TREES_* bits), the top-k's chunk kernels at every k, the verify calls'
// blocks per request (0: automatic).
uint32_t testing_tree_paths();
bool testing_topk_chunked();
int testing_verify_cluster();
int testing_attention_warp_tiles();
bool testing_attention_mma_sync();
int testing_attention_sm90();
int testing_topk_merge();

// After a launch: KDT_OK, or KDT_ERR_CUDA naming `what` and the runtime's message.
kdt_status launch_status(const char* what);

// Host-side checks of a kdt_logits description (dtype, reserved, sizes, strides, data
// pointer and its alignment, largest element offset fits int64). `name` prefixes errors
// ("logits", "target_logits"). When expected_batch / expected_length are >= 0 they must
// match. Returns KDT_OK or a kdt_fail status.
kdt_status check_logits(const kdt_logits* logits, const char* name, int64_t expected_batch,
                        int64_t expected_length);

// KDT_OK, or KDT_ERR_INVALID_ARGUMENT naming `name` when the (device) pointer `p` is not
// aligned to `align` bytes: a misaligned access would leave a sticky error on the device.
// NULL passes (the callers check required pointers separately).
kdt_status check_aligned(const void* p, size_t align, const char* name);

// kdt_trees_build_cuda, for callers that guarantee each draft row's ids are distinct (the
// GPU top-k's output, valid rows and flagged ones alike): then the kernel skips its
// duplicate-id check (a hash set per row), and everything else is the same.
kdt_status build_trees_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status, void* workspace,
                            size_t workspace_bytes, void* stream, bool ids_distinct);

// Bytes per element of a logits / KV dtype (float32, float16, bfloat16), 0 for others.
inline size_t float_dtype_size(int32_t dtype) {
    return dtype == KDT_DTYPE_FLOAT32 ? 4 : (dtype == KDT_DTYPE_FLOAT16 || dtype == KDT_DTYPE_BFLOAT16) ? 2 : 0;
}

// One logit as float32 (exact: float16 and bfloat16 widen without rounding).
template <int Dtype> __device__ __forceinline__ float load_logit(const void* base, int64_t index);
template <> __device__ __forceinline__ float load_logit<KDT_DTYPE_FLOAT32>(const void* base, int64_t index) {
    return static_cast<const float*>(base)[index];
}
template <> __device__ __forceinline__ float load_logit<KDT_DTYPE_FLOAT16>(const void* base, int64_t index) {
    return __half2float(static_cast<const __half*>(base)[index]);
}
template <> __device__ __forceinline__ float load_logit<KDT_DTYPE_BFLOAT16>(const void* base, int64_t index) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
}

// Order-preserving map of a float's bits to uint32: a < b (as floats, no NaN) exactly when
// key(a) < key(b); -0.0 and +0.0 map to different keys (-0 just below +0).
__host__ __device__ __forceinline__ uint32_t float_order_key(float x) {
#ifdef __CUDA_ARCH__
    const uint32_t u = __float_as_uint(x);
#else
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
#endif
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__host__ __device__ __forceinline__ float float_from_order_key(uint32_t k) {
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    __builtin_memcpy(&x, &u, 4);
    return x;
#endif
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// four 32-bit words from a 128-bit counter and a 64-bit key.
struct Philox4 {
    uint32_t x[4];
};
__host__ __device__ inline Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
    const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = (uint64_t)M0 * c0, p1 = (uint64_t)M1 * c2;
        const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += W0;
        k1 += W1;
    }
    Philox4 r;
    r.x[0] = c0;
    r.x[1] = c1;
    r.x[2] = c2;
    r.x[3] = c3;
    return r;
}

}  // namespace kdt
