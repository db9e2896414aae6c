// The parallel expansion (versions 4 and 3 with their shared sort and check), the first
// choice of build_kernel_smem for a valid request.
//
// Every candidate's score is fixed by its path (a sibling from the previous sibling, a
// first child from its parent), so the tree can be found without a heap: take a score
// threshold T and enumerate P_T, the nodes whose whole generator chain scores >= T (a
// prefix-closed set, one thread per parent running its chain of children); choose T by
// bisection so that N <= |P_T| <= cap (or P_T is every finite node); sort P_T by the heap's
// key (-logw, rank path). If in that order every node comes after its generator (its
// previous sibling, or its parent for a first child), the heap pops exactly the first N
// of it: at each step the next node is in the heap's frontier, and any frontier node with
// a smaller key would be in P_T and earlier. Scores are computed by the same operations as
// the heap's, so the result is bit-identical. When the check fails (a rounding step made a
// child score above its parent) or no threshold fits, the caller falls back to the heap.
//
// Fallback chain (parallel_expand): version 4's descent (descent.cuh) when L <= kDescentMaxDepth
// and not turned off; when it gives up (too many passes, or thresholds it cannot separate),
// version 3's bisection (bisect.cuh); when that gives up, or the order check fails, -1: the
// caller runs the heap.
#pragma once

#include <math.h>
#include <stdint.h>

#include "bisect.cuh"
#include "cands.cuh"
#include "descent.cuh"
#include "order.cuh"
#include "plan.cuh"

namespace kdt {
namespace trees {

// Returns n >= 0 with the node tables, scores and links filled (as kdt_expand_tree would),
// or -1 when the caller must run the heap. Block-wide; kp > 0, L > 0, N > 0 (the most
// nodes emitted, the request's budget); rows 0..N_rows (>= N) of the scores and links are
// written, those past the nodes as padding. descent: kDescent*; walk, counting:
// BuildParams'.
__device__ int64_t parallel_expand(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N,
                                   int64_t N_rows, double* logw_s, int32_t* fc_s, int32_t* ns_s, int32_t* node_rank,
                                   int32_t* node_par, int32_t* node_depth, int descent, bool walk,
                                   bool counting) {
    __shared__ int s_count, s_pruned, s_root_fc, s_fail;
    __shared__ __align__(16) unsigned s_bins[512];  // also 256 doubles (block_threshold)
    __shared__ double s_spine[kDescentMaxDepth];
    __shared__ SortScratch s_sort;
    const double top = (double)lp_s[0];
    if (isinf(top)) return -1;  // (the heap handles the empty tree)
    int M = -1;
    if (descent != kDescentNone && L <= kDescentMaxDepth) {
        Cands cw = c;
        cw.lp0 = s_spine;  // the spine's array, after the first threshold (descend_threshold)
        M = descend_threshold(cw, lp_s, L, kp, N, &s_count, &s_root_fc, s_bins, s_spine,
                              descent == kDescentWarpChains, walk, counting);
    }
    if (M < 0) M = bisect_threshold(c, lp_s, L, kp, N, &s_count, &s_pruned, &s_root_fc);
    if (M < 0) return -1;
    const int64_t n = M < N ? M : N;
    order_candidates(c, M, L, kp, counting, s_bins, s_sort);
    if (threadIdx.x == 0) s_fail = 0;
    for (int k = threadIdx.x; k < M; k += blockDim.x) c.pos[c.order[k]] = k;
    __syncthreads();
    // Every selected node after its generator: then this order is the heap's.
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int32_t g = c.gen[c.order[k]];
        if (g >= 0 && c.pos[g] >= k) atomicOr(&s_fail, 1);
    }
    __syncthreads();
    if (s_fail) return -1;
    const int root_fc = s_root_fc;
    for (int64_t i = threadIdx.x; i <= N_rows; i += blockDim.x) {
        if (i == 0) {
            logw_s[0] = 0.0;
            fc_s[0] = (root_fc >= 0 && c.pos[root_fc] < n) ? c.pos[root_fc] + 1 : -1;
            ns_s[0] = -1;
            node_rank[0] = 0;
            node_par[0] = -1;
            node_depth[0] = 0;
        } else if (i <= n) {
            const int32_t a = c.order[i - 1];
            logw_s[i] = c.logw[i - 1];  // sorted along with c.order
            node_rank[i] = c.rank[a];
            node_depth[i] = c.depth[a];
            node_par[i] = c.parent[a] < 0 ? 0 : c.pos[c.parent[a]] + 1;
            fc_s[i] = (c.fc[a] >= 0 && c.pos[c.fc[a]] < n) ? c.pos[c.fc[a]] + 1 : -1;
            ns_s[i] = (c.ns[a] >= 0 && c.pos[c.ns[a]] < n) ? c.pos[c.ns[a]] + 1 : -1;
        } else {
            logw_s[i] = -INFINITY;
            fc_s[i] = -1;
            ns_s[i] = -1;
        }
    }
    __syncthreads();
    return n;
}

}  // namespace trees
}  // namespace kdt
