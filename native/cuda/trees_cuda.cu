// The CUDA draft-tree builder, version 1: exact, one thread block per request.
//
// Each block validates its request in parallel (values, id ranges, duplicate ids through
// a hash set in global workspace), then one thread runs the same best-first expansion as
// the CPU builder (native/tree_expand.h, compiled for the device with -fmad=false), then
// the whole block writes the two masks row by row. Bit-identical to the CPU builder by
// construction; the single-thread expansion is the part a later version parallelises.
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "internal.h"
}
#include "tree_expand.h"

namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxBudget = (int64_t)INT32_MAX - 2;

struct BuildParams {
    kdt_draft draft;  // device pointers inside
    kdt_trees out;    // device pointers inside
    int32_t* status;  // [B]
    char* workspace;  // B * per_request bytes
    size_t per_request;
    int64_t eff_width;  // K' = min(K, N)
    int64_t cap;        // node capacity
    int64_t hash_slots; // power of two >= 2 K' (0 when K' == 0)
};

__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Node capacity: min(N, K' + K'^2 + ... + K'^L), as in trees.c.
int64_t node_capacity(int64_t budget, int64_t depth, int64_t eff_width) {
    int64_t total = 0, level = 1;
    for (int64_t d = 0; d < depth && total < budget; d++) {
        if (eff_width == 0) break;
        level = level > budget / eff_width ? budget : level * eff_width;
        total = total > budget - level ? budget : total + level;
    }
    return total < budget ? total : budget;
}

int64_t hash_slots_for(int64_t eff_width) {
    if (eff_width <= 0) return 0;
    int64_t slots = 1;
    while (slots < 2 * eff_width) slots *= 2;
    return slots;
}

// Layout of one request's workspace: heap [cap + 2], node tables 4 x [cap + 1], hash set.
struct Layout {
    size_t heap, tables, hash, total;
};

__host__ __device__ bool layout_for(int64_t cap, int64_t hash_slots, Layout* l) {
    const double approx = (double)(cap + 2) * 16.0 + (double)(cap + 1) * 16.0 + (double)hash_slots * 4.0;
    if (approx > 1e18) return false;
    l->heap = 0;
    l->tables = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    l->hash = l->tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    l->total = align_up(l->hash + (size_t)hash_slots * sizeof(int32_t), 256);
    return true;
}

__device__ inline uint64_t mix_id(int32_t id) {
    uint64_t z = (uint64_t)(uint32_t)id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The CPU builder's verdict for one request, computed sequentially (the error path only):
// root position, root token, then row by row: values (NaN, +inf, order) before ids
// (range, repeats of an earlier id), each in rank order.
__device__ int32_t exact_status(const kdt_draft& d, int64_t b, int64_t kp) {
    const int64_t L = d.depth, K = d.width;
    if (d.root_positions) {
        const int64_t rp = d.root_positions[b];
        if (rp < 0 || rp > INT64_MAX - L) return KDT_ERR_OUT_OF_RANGE;
    }
    if (d.root_tokens) {
        const int32_t rt = d.root_tokens[b];
        if (rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size)) return KDT_ERR_OUT_OF_RANGE;
    }
    for (int64_t r0 = 0; r0 < L; r0++) {
        const float* lp = d.logprobs + ((size_t)b * L + r0) * K;
        const int32_t* ids = d.token_ids + ((size_t)b * L + r0) * K;
        for (int64_t r = 0; r < kp; r++) {
            const float v = lp[r];
            if (isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp[r - 1])) return KDT_ERR_VALUE;
        }
        for (int64_t r = 0; r < kp; r++) {
            const int32_t id = ids[r];
            if (id < 0 || (d.vocab_size > 0 && id >= d.vocab_size)) return KDT_ERR_OUT_OF_RANGE;
            for (int64_t q = 0; q < r; q++) {
                if (ids[q] == id) return KDT_ERR_VALUE;
            }
        }
    }
    return KDT_OK;
}

__global__ void __launch_bounds__(kThreads) build_kernel(BuildParams p) {
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget, kp = p.eff_width;
    const size_t rows = (size_t)N + 1;
    const size_t words = (rows + 31) / 32;
    const size_t base = (size_t)b * rows;
    char* ws = p.workspace + (size_t)b * p.per_request;
    Layout lay;
    layout_for(p.cap, p.hash_slots, &lay);
    int32_t* tables = reinterpret_cast<int32_t*>(ws + lay.tables);
    int32_t* hash = reinterpret_cast<int32_t*>(ws + lay.hash);
    __shared__ int s_bad;
    __shared__ int64_t s_n;

    // 1. Validation in parallel: any problem sends the request to exact_status.
    if (threadIdx.x == 0) {
        int bad = 0;
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - L;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
        s_bad = bad;
    }
    __syncthreads();
    const float* lp = d.logprobs ? d.logprobs + (size_t)b * L * K : nullptr;
    const int32_t* ids = d.token_ids ? d.token_ids + (size_t)b * L * K : nullptr;
    int bad = 0;
    for (int64_t idx = threadIdx.x; idx < L * kp; idx += blockDim.x) {
        const int64_t row = idx / kp, r = idx % kp;
        const float v = lp[row * K + r];
        const int32_t id = ids[row * K + r];
        bad |= isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp[row * K + r - 1]);
        bad |= id < 0 || (d.vocab_size > 0 && id >= d.vocab_size);
    }
    if (bad) atomicOr(&s_bad, 1);
    // Duplicate ids, row by row, with a hash set of ids (-1: empty).
    const uint64_t mask = (uint64_t)p.hash_slots - 1;
    int shift = 64;
    for (int64_t h = p.hash_slots; h > 1; h >>= 1) shift--;
    for (int64_t row = 0; row < L && kp > 0; row++) {
        for (int64_t i = threadIdx.x; i < p.hash_slots; i += blockDim.x) hash[i] = -1;
        __syncthreads();
        int dup = 0;
        for (int64_t r = threadIdx.x; r < kp; r += blockDim.x) {
            const int32_t id = ids[row * K + r];
            if (id < 0) continue; // reported as a range error
            uint64_t slot = shift >= 64 ? 0 : (mix_id(id) >> shift) & mask;
            for (;;) {
                const int32_t prev = atomicCAS(&hash[slot], -1, id);
                if (prev == -1) break;
                if (prev == id) {
                    dup = 1;
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
        if (dup) atomicOr(&s_bad, 1);
        __syncthreads();
    }
    __syncthreads();

    // 2. The expansion, on one thread (a failed request becomes a root-only tree).
    if (threadIdx.x == 0) {
        int32_t status = KDT_OK;
        if (s_bad) status = exact_status(d, b, kp);
        const bool ok = status == KDT_OK;
        kdt_expand_scratch s;
        s.heap = reinterpret_cast<kdt_cand*>(ws + lay.heap);
        s.node_rank = tables;
        s.node_par = tables + (p.cap + 1);
        s.node_depth = tables + 2 * (p.cap + 1);
        s.last_child = tables + 3 * (p.cap + 1);
        kdt_expand_out o;
        o.tokens = p.out.tokens ? p.out.tokens + base : nullptr;
        o.depths = p.out.depths ? p.out.depths + base : nullptr;
        o.parents = p.out.parents ? p.out.parents + base : nullptr;
        o.logw = p.out.logw ? p.out.logw + base : nullptr;
        o.positions = p.out.positions ? p.out.positions + base : nullptr;
        o.first_child = p.out.first_child ? p.out.first_child + base : nullptr;
        o.next_sibling = p.out.next_sibling ? p.out.next_sibling + base : nullptr;
        o.visibility = nullptr;  // written below by the whole block
        o.visibility_bits = nullptr;
        o.words = words;
        int64_t root_pos = d.root_positions ? d.root_positions[b] : 0;
        int32_t root_tok = d.root_tokens ? d.root_tokens[b] : d.pad_token;
        if (!ok) {
            if (root_pos < 0 || root_pos > INT64_MAX - L) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        const int64_t n = kdt_expand_tree(lp, ids, L, K, ok ? kp : 0, N, p.cap, root_pos, root_tok,
                                          d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
    }
    __syncthreads();

    // 3. Masks: one warp per row; the lanes clear it, then lane 0 sets the row's own
    // column and its ancestors' (node rows) or just the diagonal (padding rows).
    const int64_t n = s_n;
    const int32_t* node_par = tables + (p.cap + 1);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (size_t i = warp; i < rows; i += warps) {
        uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
        uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
        if (vrow) for (size_t j = lane; j < rows; j += 32) vrow[j] = 0;
        if (brow) for (size_t j = lane; j < words; j += 32) brow[j] = 0u;
        __syncwarp();
        if (lane == 0) {
            for (int64_t a = (int64_t)i; a >= 0; a = ((int64_t)i <= n) ? node_par[a] : -1) {
                if (vrow) vrow[a] = 1;
                if (brow) brow[a / 32] |= 1u << (a % 32);
            }
        }
        __syncwarp();
    }
}

// Shared-memory layout of build_kernel_smem for one request.
struct SmemLayout {
    size_t lp, heap, tables, logw, links, hash, total;
};

__host__ __device__ inline SmemLayout smem_layout(int64_t L, int64_t kp, int64_t N, int64_t cap, int64_t hash_slots) {
    SmemLayout s;
    s.heap = 0;
    s.logw = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    s.tables = s.logw + align_up((size_t)(N + 1) * sizeof(double), 16);
    s.links = s.tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    s.hash = s.links + align_up((size_t)(N + 1) * 2 * sizeof(int32_t), 16);
    s.lp = s.hash + align_up((size_t)hash_slots * sizeof(int32_t), 16);
    s.total = s.lp + align_up((size_t)(L * kp) * sizeof(float), 16);
    return s;
}

// Version 2: the request's used log-probs, the heap, the node tables, scores and links all
// live in shared memory, so the one thread that runs the expansion never waits on device
// memory; tokens, depths, parents, positions and the masks are then written by the whole
// block from the node tables.
__global__ void __launch_bounds__(kThreads) build_kernel_smem(BuildParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget, kp = p.eff_width;
    const size_t rows = (size_t)N + 1;
    const size_t words = (rows + 31) / 32;
    const size_t base = (size_t)b * rows;
    const SmemLayout lay = smem_layout(L, kp, N, p.cap, p.hash_slots);
    float* lp_s = reinterpret_cast<float*>(smem + lay.lp);
    int32_t* tables = reinterpret_cast<int32_t*>(smem + lay.tables);
    double* logw_s = reinterpret_cast<double*>(smem + lay.logw);
    int32_t* fc_s = reinterpret_cast<int32_t*>(smem + lay.links);
    int32_t* ns_s = fc_s + rows;
    int32_t* hash = reinterpret_cast<int32_t*>(smem + lay.hash);
    __shared__ int s_bad;
    __shared__ int64_t s_n;
    __shared__ int32_t s_root_tok;
    __shared__ int64_t s_root_pos;

    const float* lp = d.logprobs ? d.logprobs + (size_t)b * L * K : nullptr;
    const int32_t* ids = d.token_ids ? d.token_ids + (size_t)b * L * K : nullptr;
    if (threadIdx.x == 0) {
        int bad = 0;
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - L;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
        s_bad = bad;
    }
    // Load the used part [L, K'] (row stride K' in shared memory).
    for (int64_t idx = threadIdx.x; idx < L * kp; idx += blockDim.x) {
        const int64_t row = idx / kp, r = idx % kp;
        lp_s[idx] = lp[row * K + r];
    }
    __syncthreads();
    int bad = 0;
    for (int64_t idx = threadIdx.x; idx < L * kp; idx += blockDim.x) {
        const int64_t r = idx % kp;
        const float v = lp_s[idx];
        const int32_t id = ids[(idx / kp) * K + r];
        bad |= isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp_s[idx - 1]);
        bad |= id < 0 || (d.vocab_size > 0 && id >= d.vocab_size);
    }
    if (bad) atomicOr(&s_bad, 1);
    const uint64_t mask = (uint64_t)p.hash_slots - 1;
    int shift = 64;
    for (int64_t h = p.hash_slots; h > 1; h >>= 1) shift--;
    for (int64_t row = 0; row < L && kp > 0; row++) {
        for (int64_t i = threadIdx.x; i < p.hash_slots; i += blockDim.x) hash[i] = -1;
        __syncthreads();
        int dup = 0;
        for (int64_t r = threadIdx.x; r < kp; r += blockDim.x) {
            const int32_t id = ids[row * K + r];
            if (id < 0) continue;
            uint64_t slot = shift >= 64 ? 0 : (mix_id(id) >> shift) & mask;
            for (;;) {
                const int32_t prev = atomicCAS(&hash[slot], -1, id);
                if (prev == -1) break;
                if (prev == id) {
                    dup = 1;
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
        if (dup) atomicOr(&s_bad, 1);
        __syncthreads();
    }

    if (threadIdx.x == 0) {
        int32_t status = KDT_OK;
        if (s_bad) status = exact_status(d, b, kp);
        const bool ok = status == KDT_OK;
        kdt_expand_scratch s;
        s.heap = reinterpret_cast<kdt_cand*>(smem + lay.heap);
        s.node_rank = tables;
        s.node_par = tables + (p.cap + 1);
        s.node_depth = tables + 2 * (p.cap + 1);
        s.last_child = tables + 3 * (p.cap + 1);
        kdt_expand_out o;
        o.tokens = nullptr;  // written below from the node tables
        o.depths = nullptr;
        o.parents = nullptr;
        o.positions = nullptr;
        o.logw = logw_s;
        o.first_child = fc_s;
        o.next_sibling = ns_s;
        o.visibility = nullptr;
        o.visibility_bits = nullptr;
        o.words = words;
        int64_t root_pos = d.root_positions ? d.root_positions[b] : 0;
        int32_t root_tok = d.root_tokens ? d.root_tokens[b] : d.pad_token;
        if (!ok) {
            if (root_pos < 0 || root_pos > INT64_MAX - L) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        const int64_t n = kdt_expand_tree(lp_s, nullptr, L, kp, ok ? kp : 0, N, p.cap, root_pos, root_tok,
                                          d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
        s_root_tok = root_tok;
        s_root_pos = root_pos;
    }
    __syncthreads();

    const int64_t n = s_n;
    const int32_t* node_rank = tables;
    const int32_t* node_par = tables + (p.cap + 1);
    const int32_t* node_depth = tables + 2 * (p.cap + 1);
    for (size_t i = threadIdx.x; i < rows; i += blockDim.x) {
        const bool node = i >= 1 && (int64_t)i <= n;
        const int32_t depth = node ? node_depth[i] : 0;
        if (p.out.tokens) {
            p.out.tokens[base + i] = i == 0 ? s_root_tok
                                     : node ? ids[(size_t)(depth - 1) * K + (size_t)node_rank[i]]
                                            : d.pad_token;
        }
        if (p.out.depths) p.out.depths[base + i] = depth;
        if (p.out.parents) p.out.parents[base + i] = node ? node_par[i] : -1;
        if (p.out.positions) p.out.positions[base + i] = s_root_pos + depth;
        if (p.out.logw) p.out.logw[base + i] = logw_s[i];
        if (p.out.first_child) p.out.first_child[base + i] = fc_s[i];
        if (p.out.next_sibling) p.out.next_sibling[base + i] = ns_s[i];
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (size_t i = warp; i < rows; i += warps) {
        uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
        uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
        if (vrow) for (size_t j = lane; j < rows; j += 32) vrow[j] = 0;
        if (brow) for (size_t j = lane; j < words; j += 32) brow[j] = 0u;
        __syncwarp();
        if (lane == 0) {
            for (int64_t a = (int64_t)i; a >= 0; a = ((int64_t)i <= n) ? node_par[a] : -1) {
                if (vrow) vrow[a] = 1;
                if (brow) brow[a / 32] |= 1u << (a % 32);
            }
        }
        __syncwarp();
    }
}

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
    int dev = 0, smem_max = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
    const size_t smem_static = 64;  // the kernel's own __shared__ scalars
    if (sl.total + smem_static <= (size_t)smem_max && getenv("KDTREE_CUDA_TREES_V1") == NULL) {
        err = cudaFuncSetAttribute(build_kernel_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sl.total);
        if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "shared memory request failed: %s", cudaGetErrorString(err));
        build_kernel_smem<<<(unsigned)B, kThreads, sl.total, static_cast<cudaStream_t>(stream)>>>(p);
    } else {
        build_kernel<<<(unsigned)B, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "tree build launch failed: %s", cudaGetErrorString(err));
    return kdt_ok();
}
