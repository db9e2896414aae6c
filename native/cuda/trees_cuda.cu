// The CUDA draft-tree builder (kdt_trees_build_cuda): host-side argument checks, the
// choice of kernel and path, the launches. Exact: every path gives the CPU builder's bits
// (native/trees.c), ties included. The device code lives in trees/, one concern a header:
//   plan.cuh            parameters, workspace and shared-memory layouts, validation plan
//   validate.cuh        the rows' checks (both kernels) and the CPU builder's verdict
//   global_heap.cuh     version 1: validation and heap in device memory (build_kernel)
//   smem_kernel.cuh     version 2: everything in shared memory (build_kernel_smem)
//   expand.cuh          the parallel expansion: threshold search, sort, order check
//   descent.cuh         version 4's threshold descent, its passes
//   descent_chains.cuh  version 4's chain resumption and first-child walks
//   bisect.cuh          version 3's bisection of thresholds
//   select.cuh          threshold selection (counting, bin rounds)
//   order.cuh           the sort by the heap's key (counting, bitonic)
//   cands.cuh           the candidate arrays
//   masks.cuh           the masks (one warp per row, staged, the separate mask_kernel)
//
// Fallback chain, decided here and in the kernels:
//   1. build_kernel_smem when the request's arrays (and the candidates, when the parallel
//      expansion runs) fit the device's shared memory; else build_kernel (version 1).
//   2. In build_kernel_smem, for a valid request with N >= kParallelMinBudget and room for
//      the candidates: version 4's descent (warp chains up to kWarpChainsMaxBudget, thread
//      chains above; L <= kDescentMaxDepth), then version 3's bisection, then the heap
//      (parallel_expand, expand.cuh). Otherwise, and for a bad request, the heap.
//   3. Masks: from N >= kSeparateMasksMinBudget a second launch (mask_kernel); up to
//      kStagedMaskMaxRows rows staged in shared memory; else one warp per row.
// native/kdt_testing.h forces each alternative (KDT_TESTING_TREES_*) for the tests.
#include <cuda_runtime.h>

#include <atomic>

#include <stdint.h>

extern "C" {
#include "internal.h"
}
#include "common.cuh"
#include "trees/global_heap.cuh"
#include "trees/masks.cuh"
#include "trees/plan.cuh"
#include "trees/smem_kernel.cuh"

using namespace kdt::trees;

namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_smem_max[kMaxDevices];  // cudaDevAttrMaxSharedMemoryPerBlockOptin, 0: unknown
std::atomic<int> g_smem_set[kMaxDevices];  // dynamic shared memory build_kernel_smem may use

}  // namespace

extern "C" kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth,
                                                           int64_t width, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    if (batch < 0 || budget < 0 || depth < 0 || width < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch (%lld), budget (%lld), depth (%lld) and width (%lld) must be >= 0",
                        (long long)batch, (long long)budget, (long long)depth, (long long)width);
    }
    if (budget > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld exceeds the maximum %lld", (long long)budget,
                        (long long)kMaxBudget);
    }
    const int64_t kp = width < budget ? width : budget;
    Layout l;
    if (!layout_for(node_capacity(budget, depth, kp), hash_slots_for(kp), &l) ||
        !kdt_mul_size(l.total, (size_t)batch, bytes)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace for batch %lld, budget %lld overflows", (long long)batch,
                        (long long)budget);
    }
    return kdt_ok();
}

extern "C" kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status,
                                           void* workspace, size_t workspace_bytes, void* stream) {
    return kdt::build_trees_cuda(draft, out, request_status, workspace, workspace_bytes, stream, false);
}

kdt_status kdt::build_trees_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status, void* workspace,
                                 size_t workspace_bytes, void* stream, bool ids_distinct) {
    if (draft == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "draft is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const int64_t B = draft->batch, L = draft->depth, K = draft->width, N = out->budget;
    if (B < 0 || L < 0 || K < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "draft batch (%lld), depth (%lld) and width (%lld) must be >= 0",
                        (long long)B, (long long)L, (long long)K);
    }
    if (N < 0 || N > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %lld]", (long long)N,
                        (long long)kMaxBudget);
    }
    if (L > INT32_MAX - 1) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "depth %lld exceeds %d", (long long)L, INT32_MAX - 1);
    if (draft->vocab_size < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab_size %lld is negative", (long long)draft->vocab_size);
    }
    if (out->batch != B) {
        return kdt_fail(KDT_ERR_SHAPE, "out->batch (%lld) != draft->batch (%lld)", (long long)out->batch, (long long)B);
    }
    if (B > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld exceeds %d", (long long)B, INT32_MAX);
    if (B == 0) return kdt_ok();
    if (out->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out->num_nodes is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    size_t cells;
    if (!kdt_mul_size((size_t)B, (size_t)L, &cells) || !kdt_mul_size(cells, (size_t)K, &cells)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "draft size B*L*K overflows");
    }
    if (cells > 0 && (draft->logprobs == NULL || draft->token_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "draft->%s is NULL", draft->logprobs == NULL ? "logprobs" : "token_ids");
    }
    if (out->visibility != NULL) {
        size_t vb;
        kdt_status st = kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &vb);
        if (st != KDT_OK) return st;
    }
    {
        const struct {
            const void* ptr;
            size_t align;
            const char* name;
        } aligned[] = {{draft->logprobs, 4, "draft->logprobs"}, {draft->token_ids, 4, "draft->token_ids"},
                       {draft->root_tokens, 4, "draft->root_tokens"}, {draft->root_positions, 8, "draft->root_positions"},
                       {out->num_nodes, 4, "out->num_nodes"}, {out->tokens, 4, "out->tokens"},
                       {out->depths, 4, "out->depths"}, {out->parents, 4, "out->parents"},
                       {out->logw, 8, "out->logw"}, {out->positions, 8, "out->positions"},
                       {out->visibility_bits, 4, "out->visibility_bits"}, {out->first_child, 4, "out->first_child"},
                       {out->next_sibling, 4, "out->next_sibling"}, {request_status, 4, "request_status"},
                       {draft->request_budgets, 4, "draft->request_budgets"},
                       {draft->request_depths, 4, "draft->request_depths"}};
        for (const auto& a : aligned) {
            const kdt_status st = kdt::check_aligned(a.ptr, a.align, a.name);
            if (st != KDT_OK) return st;
        }
    }
    size_t need;
    kdt_status st = kdt_trees_build_cuda_workspace_bytes(B, N, L, K, &need);
    if (st != KDT_OK) return st;
    if (workspace == NULL || workspace_bytes < need) {
        return kdt_fail(workspace == NULL ? KDT_ERR_NULL_POINTER : KDT_ERR_BUFFER_TOO_SMALL,
                        "workspace has %zu bytes, %zu needed", workspace == NULL ? (size_t)0 : workspace_bytes, need);
    }
    if (((uintptr_t)workspace & 255u) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
    }
    BuildParams p;
    p.masks_separate = 0;
    p.descent = kDescentNone;
    p.walk = 0;
    p.counting = 0;
    p.ids_distinct = ids_distinct ? 1 : 0;
    p.draft = *draft;
    p.out = *out;
    p.status = request_status;
    p.workspace = static_cast<char*>(workspace);
    p.per_request = need / (size_t)B;
    p.eff_width = K < N ? K : N;
    p.cap = node_capacity(N, L, p.eff_width);
    p.hash_slots = hash_slots_for(p.eff_width);
    // Version 2 (everything the expansion touches in shared memory) when it fits the
    // device's per-block limit; version 1 (global memory) otherwise.
    const SmemLayout sl = smem_layout(L, p.eff_width, N, p.cap, p.hash_slots);
    p.lay = sl;
    // The device's per-block shared-memory limit and the kernel's raised limit are cached
    // per device: those runtime calls cost tens of microseconds, more than small builds.
    int dev = 0, smem_max = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        return kdt_fail(KDT_ERR_NO_DEVICE, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
    const int slot = dev >= 0 && dev < kMaxDevices ? dev : 0;
    smem_max = g_smem_max[slot].load(std::memory_order_relaxed);
    if (smem_max == 0) {
        // The dynamic shared memory build_kernel_smem can get: the device's opt-in limit
        // less the kernel's static shared memory.
        cudaFuncAttributes attr;
        err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, build_kernel_smem);
        if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
        smem_max -= (int)attr.sharedSizeBytes;
        g_smem_max[slot].store(smem_max, std::memory_order_relaxed);
    }
    // Forced paths (native/kdt_testing.h); 0 in normal use.
    const uint32_t forced = kdt::testing_tree_paths();
    // The parallel expansion's candidates: a power of two >= 4N where it fits beside version
    // 2's arrays (fewer overflows of version 4's passes), else >= 2N; none: the heap only.
    p.cap3 = 0;
    if (!(forced & KDT_TESTING_TREES_HEAP) && N >= kParallelMinBudget) {
        for (int64_t want = 4 * N; want >= 2 * N && p.cap3 == 0; want -= 2 * N) {
            int64_t cap3 = 1;
            while (cap3 < want) cap3 <<= 1;
            if (cap3 <= (1 << 20) && sl.total + cands_bytes(cap3) <= (size_t)smem_max) p.cap3 = (int32_t)cap3;
        }
    }
    p.descent = (forced & KDT_TESTING_TREES_BISECT)                                          ? kDescentNone
                : (forced & KDT_TESTING_TREES_THREAD_CHAINS) || N > kWarpChainsMaxBudget ? kDescentThreadChains
                                                                                           : kDescentWarpChains;
    p.walk = (forced & KDT_TESTING_TREES_NO_WALK) ? 0 : 1;
    p.counting = (forced & KDT_TESTING_TREES_NO_COUNTING) ? 0 : 1;
    const size_t smem_bytes = sl.total + (p.cap3 > 0 ? cands_bytes(p.cap3) : 0);
    if (smem_bytes <= (size_t)smem_max && !(forced & KDT_TESTING_TREES_GLOBAL_HEAP)) {
        if ((int)smem_bytes > g_smem_set[slot].load(std::memory_order_relaxed)) {
            // Raise the kernel's limit once to the device maximum (idempotent, so racing
            // threads are harmless).
            err = cudaFuncSetAttribute(build_kernel_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
            if (err != cudaSuccess) {
                return kdt_fail(KDT_ERR_CUDA, "shared memory request failed: %s", cudaGetErrorString(err));
            }
            g_smem_set[slot].store(smem_max, std::memory_order_relaxed);
        }
        // Large trees: the masks in a second, wide launch (measured on an H200:
        // docs/performance.md).
        const bool any_mask = out->visibility != NULL || out->visibility_bits != NULL;
        p.masks_separate =
            any_mask && N >= kSeparateMasksMinBudget && B <= 65535 && !(forced & KDT_TESTING_TREES_INLINE_MASKS);
        p.val = validation_plan(sl, L, p.eff_width, p.hash_slots, p.cap3, kSmemThreads);
        p.mask_magic = p.mask_di = p.mask_dj = 0;
        if (N + 1 >= 4 && N + 1 <= (int64_t)kStagedMaskMaxRows) {
            const uint32_t rows = (uint32_t)(N + 1), step = 4u * (uint32_t)kSmemThreads;
            p.mask_magic = (uint32_t)((uint64_t{1} << 32) / rows) + 1u;
            p.mask_di = step / rows;
            p.mask_dj = step - p.mask_di * rows;
        }
        build_kernel_smem<<<(unsigned)B, kSmemThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(p);
        if (p.masks_separate) {
            err = cudaGetLastError();
            if (err != cudaSuccess) {
                return kdt_fail(KDT_ERR_CUDA, "tree build launch failed: %s", cudaGetErrorString(err));
            }
            const dim3 grid((unsigned)((N + 1 + kMaskRowsPerBlock - 1) / kMaskRowsPerBlock), (unsigned)B);
            mask_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
        }
    } else {
        build_kernel<<<(unsigned)B, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "tree build launch failed: %s", cudaGetErrorString(err));
    return kdt_ok();
}
