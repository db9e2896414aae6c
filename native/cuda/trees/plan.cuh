// The tree builder's parameters and memory plan: the launch parameters, the device-memory
// workspace layout (version 1's tables, and the parents the separate mask launch reads),
// the shared-memory layout of build_kernel_smem and its validation plan. Computed on the
// host once per call and passed in BuildParams (computed by every thread they were ~1,900
// warp instructions a block at N = 64, H200 ncu).
#pragma once

#include <algorithm>

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "internal.h"
}

namespace kdt {
namespace trees {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Block of build_kernel (version 1) and mask_kernel.
constexpr int kThreads = 256;
// build_kernel_smem's block: 512 threads measured faster than 256 at every budget on an
// H200 (N = 256: 88 -> 77 us, N = 1024: 282 -> 238 us; its validation, thresholds and
// sort are instruction-bound with one block per SM).
constexpr int kSmemThreads = 512;
static_assert((kSmemThreads & (kSmemThreads - 1)) == 0, "the validation plan takes a power-of-two block");
constexpr int64_t kMaxBudget = (int64_t)INT32_MAX - 2;
// From this budget the shared-memory kernel leaves the masks to a second, wide launch.
constexpr int64_t kSeparateMasksMinBudget = 256;
// Trees of up to this many rows have their masks staged in shared memory (5 words a row).
constexpr size_t kStagedMaskMaxRows = 160;
constexpr size_t kStagedMaskMaxWords = (kStagedMaskMaxRows + 31) / 32;
// From this budget the parallel expansion (versions 4 and 3) runs, the heap being its
// fallback; below it (budget 0) the heap. Every budget: one thread's heap was 2-2.5x
// slower than the block's parallel expansion even at N = 2 (H200, B = 64, the round's
// top-k, graph: N = 2 / 8 / 15 34.1 / 40.2 / 45.0 us against 16.1 / 18.0 / 22.2; the
// heap's ~3,300 inlined instructions run once, by one warp, fetched cold).
constexpr int64_t kParallelMinBudget = 1;
// Up to this budget version 4 resumes a round's chains one warp per owner; above it one
// thread per owner (H200: N = 64 37.1 vs 39.9 us, N = 256 63.2 vs 63.9, N = 1024 200.1 vs
// 189.8, where rounds hold hundreds of owners).
constexpr int64_t kWarpChainsMaxBudget = 512;

// BuildParams::descent: the threshold search that runs before version 3's bisection.
constexpr int32_t kDescentNone = 0;          // the bisection alone
constexpr int32_t kDescentWarpChains = 1;    // version 4, a warp per chain owner
constexpr int32_t kDescentThreadChains = 3;  // version 4, a thread per chain owner

// Shared-memory layout of build_kernel_smem for one request (byte offsets).
struct SmemLayout {
    size_t lp, heap, tables, logw, links, hash, cands, total;
};

// build_kernel_smem's validation plan (validate.cuh: load_and_check_rows).
struct ValidationPlan {
    size_t tab_offset;   // shared-memory byte offset of the rows' hash sets of ids
    uint32_t group;      // rows checked at a time (their hash sets fit at once)
    int32_t slot_bits;   // log2 of the hash slots per row
    int32_t tpr_bits;    // log2 of the threads per row: min(ceil_log2(K'), log2(block))
    int32_t rpt_bits;    // log2 of the rank slots per thread and row: ceil_log2(K') - tpr_bits, >= 0
    int32_t rows_par_bits;  // log2 of the rows taken at a time: log2(block) - tpr_bits
};

struct BuildParams {
    kdt_draft draft;  // device pointers inside
    kdt_trees out;    // device pointers inside
    int32_t* status;  // [B]
    char* workspace;  // B * per_request bytes
    size_t per_request;
    int64_t eff_width;  // K' = min(K, N)
    int64_t cap;        // node capacity
    int64_t hash_slots; // power of two >= 2 K' (0 when K' == 0)
    int32_t cap3;       // version 3's candidate capacity (power of two), 0: heap only
    int32_t masks_separate; // 1: build_kernel_smem leaves the masks to mask_kernel
    int32_t descent;        // kDescent*: version 4's threshold descent before version 3's bisection
    int32_t walk;           // 1: version 4 walks first children at once (walk_first_children)
    int32_t counting;       // 1: small candidate sets sorted, and small thresholds selected, by counting
    int32_t ids_distinct;   // 1: the caller guarantees distinct ids per row (no duplicate-id check)
    SmemLayout lay;
    ValidationPlan val;
    // The staged bool mask's word walk (budget + 1 = rows >= 4): floor(2^32 / rows) + 1 (k /
    // rows = umulhi(k, magic) for k < 2^32 / rows), and the row and column steps of
    // 4 x kSmemThreads bytes.
    uint32_t mask_magic, mask_di, mask_dj;
};

__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
// The smallest b with 2^b >= x (0 for x <= 1).
inline int ceil_log2(uint64_t x) {
    int b = 0;
    while (b < 63 && (uint64_t{1} << b) < x) b++;
    return b;
}

// Node capacity: min(N, K' + K'^2 + ... + K'^L), as in trees.c.
inline int64_t node_capacity(int64_t budget, int64_t depth, int64_t eff_width) {
    int64_t total = 0, level = 1;
    for (int64_t d = 0; d < depth && total < budget; d++) {
        if (eff_width == 0) break;
        level = level > budget / eff_width ? budget : level * eff_width;
        total = total > budget - level ? budget : total + level;
    }
    return total < budget ? total : budget;
}

inline int64_t hash_slots_for(int64_t eff_width) {
    if (eff_width <= 0) return 0;
    int64_t slots = 1;
    while (slots < 2 * eff_width) slots *= 2;
    return slots;
}

// Layout of one request's device workspace: heap [cap + 2], node tables 4 x [cap + 1],
// hash set.
struct Layout {
    size_t heap, tables, hash, total;
};

__host__ __device__ inline bool layout_for(int64_t cap, int64_t hash_slots, Layout* l) {
    const double approx = (double)(cap + 2) * 16.0 + (double)(cap + 1) * 16.0 + (double)hash_slots * 4.0;
    if (approx > 1e18) return false;
    l->heap = 0;
    l->tables = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    l->hash = l->tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    l->total = align_up(l->hash + (size_t)hash_slots * sizeof(int32_t), 256);
    return true;
}

// The parents of request b's nodes in the device workspace (the node-table slot of
// version 1's layout): build_kernel_smem leaves them there for mask_kernel.
__device__ inline int32_t* workspace_parents(const BuildParams& p, int64_t b) {
    Layout glay;
    layout_for(p.cap, p.hash_slots, &glay);
    return reinterpret_cast<int32_t*>(p.workspace + (size_t)b * p.per_request + glay.tables) + (p.cap + 1);
}

// build_kernel_smem's shared-memory layout for one request (passed in BuildParams::lay).
inline SmemLayout smem_layout(int64_t L, int64_t kp, int64_t N, int64_t cap, int64_t hash_slots) {
    SmemLayout s;
    s.heap = 0;
    s.logw = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    s.tables = s.logw + align_up((size_t)(N + 1) * sizeof(double), 16);
    s.links = s.tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    s.hash = s.links + align_up((size_t)(N + 1) * 2 * sizeof(int32_t), 16);
    s.lp = s.hash + align_up((size_t)hash_slots * sizeof(int32_t), 16);
    s.cands = s.lp + align_up((size_t)(L * kp) * sizeof(float), 16);
    s.total = s.cands;  // + cands_bytes(cap3) when version 3 runs
    return s;
}

// Bytes of the version-3 candidate arrays for `cap3` (a power of two) candidates.
__host__ __device__ inline size_t cands_bytes(int64_t cap3) { return (size_t)cap3 * (8 + 8 * 4); }

// build_kernel_smem's validation plan for `threads` (a power of two) threads. The rows' hash
// sets of ids go in the idle candidate arrays when those are larger than one row's set,
// else in the layout's own set; as many rows are checked at a time as have sets there.
inline ValidationPlan validation_plan(const SmemLayout& lay, int64_t L, int64_t kp, int64_t hash_slots, int32_t cap3,
                                      int threads) {
    ValidationPlan v;
    const size_t slots = (size_t)hash_slots;
    const size_t cand_bytes = cap3 > 0 ? cands_bytes(cap3) : 0;
    const bool in_cands = cand_bytes > slots * 4;
    v.tab_offset = in_cands ? lay.cands : lay.hash;
    const size_t tab_slots = (in_cands ? cand_bytes : slots * 4) / 4;
    v.group = slots > 0 ? (uint32_t)std::min((int64_t)(tab_slots / slots), L) : 1u;
    v.slot_bits = ceil_log2(slots);  // slots: a power of two
    const int block_bits = ceil_log2((uint64_t)threads);
    v.tpr_bits = std::min(ceil_log2((uint64_t)kp), block_bits);
    v.rpt_bits = std::max(0, ceil_log2((uint64_t)kp) - v.tpr_bits);
    v.rows_par_bits = block_bits - v.tpr_bits;
    return v;
}

}  // namespace trees
}  // namespace kdt
