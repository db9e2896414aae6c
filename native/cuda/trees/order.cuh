// Ordering of the parallel expansion's candidates by the heap's key (-logw, then the rank
// path): by counting up to kCountSortMax candidates, else by a bitonic network on (score,
// index) pairs.
#pragma once

#include <math.h>
#include <stdint.h>

#include "cands.cuh"
#include "plan.cuh"

namespace kdt {
namespace trees {

// Up to this many candidates (and blockDim.x), parallel_expand orders them by counting.
constexpr int kCountSortMax = 256;
// Up to this many candidates whose score equals an earlier-listed one's (a group of g equal
// scores counts g - 1), the counting sort orders each group by walking rank paths; beyond
// it by 128-bit path keys where they fit, else the bitonic network sorts the set.
constexpr int kCountSortMaxTies = 4;

// Heap order of two sort entries (score, candidate index; index -1: padding, last).
// Branch-free but for exact ties of two candidates (rare), which compare their rank paths:
// the branchy form cost ~400 cycles per bitonic stage on an H200.
__device__ inline bool sort_entry_before(const Cands& c, double wa, int32_t oa, double wb, int32_t ob) {
    const bool eq = wa == wb;  // also -0.0 == +0.0, as the heap compares
    bool before = wa > wb || (eq && oa >= 0 && ob < 0);
    if (eq && oa >= 0 && ob >= 0) before = cand_path_before(c, oa, ob);
    return before;
}

// The bitonic stages (k, j) for k = k_lo .. k_hi and j = min(k / 2, 32) .. 1 over the
// sort arrays c.logw / c.order [P] (P a multiple of 64): each warp takes 64-entry
// segments, a lane holds entries lane and lane + 32 of a segment, and partners at
// distance j < 32 are exchanged by shuffles. Same comparisons as the block-wide stages.
__device__ void warp_bitonic_stages(const Cands& c, int P, int k_lo, int k_hi) {
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    for (int seg = threadIdx.x / 32; seg < P / 64; seg += warps) {
        const int base = seg * 64;
        double w[2] = {c.logw[base + lane], c.logw[base + lane + 32]};
        int32_t o[2] = {c.order[base + lane], c.order[base + lane + 32]};
        for (int k = k_lo; k <= k_hi; k <<= 1) {
            for (int j = min(k >> 1, 32); j > 0; j >>= 1) {
                if (j == 32) {  // the pair is the lane's own two entries
                    const bool up = ((base + lane) & k) == 0;
                    if (up == sort_entry_before(c, w[1], o[1], w[0], o[0])) {
                        const double tw = w[0];
                        const int32_t to = o[0];
                        w[0] = w[1];
                        o[0] = o[1];
                        w[1] = tw;
                        o[1] = to;
                    }
                    continue;
                }
                const bool lower = (lane & j) == 0;
                double pw[2];
                int32_t po[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    pw[h] = __shfl_xor_sync(kFullMask, w[h], j);
                    po[h] = __shfl_xor_sync(kFullMask, o[h], j);
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int i = base + lane + 32 * h;
                    const bool up = (i & k) == 0;  // the same for both entries of the pair
                    // The pair's higher-index entry before its lower one? (operands selected,
                    // not branched on, so both halves of the warp run one comparison)
                    const double hw = lower ? pw[h] : w[h], lw = lower ? w[h] : pw[h];
                    const int32_t ho = lower ? po[h] : o[h], lo = lower ? o[h] : po[h];
                    if (up == sort_entry_before(c, hw, ho, lw, lo)) {
                        w[h] = pw[h];
                        o[h] = po[h];
                    }
                }
            }
        }
        c.logw[base + lane] = w[0];
        c.logw[base + lane + 32] = w[1];
        c.order[base + lane] = o[0];
        c.order[base + lane + 32] = o[1];
    }
}

// The counting sort's shared scratch: the number of tied candidates, and their rank paths
// as 128-bit keys. Declared by parallel_expand, after its own shared arrays (declared here
// they came first in the block's static shared memory and cost 16 bytes of padding).
struct SortScratch {
    int ties;
    uint64_t khi[kCountSortMax], klo[kCountSortMax];
};

// Sorts P_T (M candidates) by the heap's key: afterwards c.order [M] lists the candidates
// in that order and c.logw [M] their scores (permuted along with c.order; the candidates'
// other fields stay where they are). Block-wide; bins: parallel_expand's 512 words, free
// here; sc: shared.
__device__ inline void order_candidates(const Cands& c, int M, int64_t L, int64_t kp, bool counting, unsigned* bins,
                                        SortScratch& sc) {
    // By counting up to kCountSortMax (below), else by a bitonic network on (score, index)
    // pairs held side by side (c.logw is permuted along with c.order; no candidate table is
    // read except the rank paths of exactly equal scores). Padding (index -1, score -inf)
    // goes last. (A counting sort as a scalar loop with a branchy comparison was slower than
    // the network from 64 candidates up; docs/performance.md.)
    // Stages whose pairs lie inside one 64-candidate segment (j <= 32) run in registers,
    // one warp per segment, with no block barrier between them: all of k <= 64 in one
    // phase, then for each larger k the stages j >= 64 one by one and j <= 32 as one phase.
    bool sorted = false;
    if (counting && M <= kCountSortMax && M <= (int)blockDim.x) {
        // Up to 256 candidates: each one's position is the number of candidates before it
        // (scores compared eight at a time from 16-byte loads, no branch), then every
        // candidate is written at its position. Candidates with an exactly equal score
        // then scan again, comparing rank paths with each equal one: by walking the paths
        // up to kCountSortMaxTies ties (below), beyond that by 128-bit path keys made
        // once per candidate when L x bits(K') <= 128, else the bitonic network below runs
        // instead (the same order): the rank-path walks diverge across lanes (H200: a flat
        // drafter's many equal log-probs made N = 64 38.5 -> 45.3 us). (The network is
        // latency-bound at these sizes: one warp's 21 dependent stages took 3.2 us for 64 candidates;
        // counting 423 took 7.7 us against its 8.8, and ~2x that with a tie, so larger sets
        // keep the network.)
        // Candidates of equal score hold positions gt .. ge - 1 of the order (the same gt and
        // ge for each of them): every candidate lists itself from its gt on (s_member, s_fill
        // counting the members placed by group start), so a group's size is s_fill[gt] and
        // each tied candidate compares its rank path with its group's only. (A scan of all M
        // candidates, one shared-memory round trip each, was ~2.8 us of the round's build on
        // an H200.)
        // Both live in `bins` (no static shared memory of their own: 2 KB more moved some
        // budgets near the shared-memory limit to slower paths). `bins` is free here: its
        // last use (descend_threshold's thresholds and owner lists) is followed by a
        // barrier before descend_threshold returns; bisect_threshold does not use it.
        static_assert(2 * kCountSortMax <= 512, "s_fill and s_member fit in bins");
        int* const s_fill = reinterpret_cast<int*>(bins);
        int* const s_member = s_fill + kCountSortMax;
        const int i = (int)threadIdx.x;
        if (threadIdx.x == 0) sc.ties = 0;
        if (i < M) s_fill[i] = 0;
        __syncthreads();
        const double2* w2 = reinterpret_cast<const double2*>(c.logw);
        const int M8 = M & ~7;  // whole groups of eight; the rest one by one
        double wi = 0.0;
        int at = 0;
        bool joined = false;  // not the first of its group to list itself
        int gt = 0;
        if (i < M) {
            wi = c.logw[i];  // finite: every candidate was admitted at a finite T
            for (int j = 0; j < M8 / 2; j += 4) {
                double2 q[4];
#pragma unroll
                for (int u = 0; u < 4; u++) q[u] = w2[j + u];
#pragma unroll
                for (int u = 0; u < 4; u++) gt += (q[u].x > wi) + (q[u].y > wi);
            }
            for (int j = M8; j < M; j++) gt += c.logw[j] > wi;
            at = gt;
            // Every candidate lists itself in its group (one member for most); the group's
            // size, read after the barrier, replaces a second count of the scores >= its
            // own (~1,900 warp instructions a block at N = 64, H200 ncu).
            const int k = atomicAdd(&s_fill[gt], 1);
            s_member[gt + k] = i;
            joined = k > 0;
        }
        const unsigned joined_lanes = __ballot_sync(kFullMask, joined);
        if ((threadIdx.x & 31) == 0 && joined_lanes) atomicAdd(&sc.ties, __popc(joined_lanes));
        __syncthreads();
        const int ge = i < M ? gt + s_fill[gt] : 0;
        const bool tied = ge - gt > 1;
        // Rank paths as 128-bit keys when they fit: field t (from the top, b bits) holds the
        // rank at depth t plus one, zeros past the path's depth, so the keys order the paths
        // as the heap does (lexicographically, a proper prefix first).
        const int kb = 32 - __clz((unsigned)kp);  // bits of the largest rank + 1
        const bool path_keys = sc.ties > kCountSortMaxTies && (int64_t)kb * L <= 128;
        if (sc.ties <= kCountSortMaxTies || path_keys) {
            uint64_t khi = 0, klo = 0;
            if (path_keys) {
                if (tied) {
                    for (int32_t cur = i, d = c.depth[i]; cur >= 0; cur = c.parent[cur], d--) {
                        const int lo_bit = 128 - d * kb;  // the field of depth d: [lo_bit, lo_bit + kb)
                        const uint64_t f = (uint64_t)(c.rank[cur] + 1);
                        if (lo_bit >= 64) {
                            khi |= f << (lo_bit - 64);
                        } else {
                            klo |= f << lo_bit;
                            if (lo_bit + kb > 64) khi |= f >> (64 - lo_bit);
                        }
                    }
                    sc.khi[i] = khi;
                    sc.klo[i] = klo;
                }
                __syncthreads();
                if (tied) {  // the heap's order among equal scores, by the keys
                    for (int q = gt; q < ge; q++) {
                        const int j = s_member[q];
                        const uint64_t hj = sc.khi[j], lj = sc.klo[j];
                        at += (hj < khi) | ((hj == khi) & (lj < klo));
                    }
                }
            } else if (tied) {  // the heap's order among equal scores, by walking the paths
                for (int q = gt; q < ge; q++) {
                    const int j = s_member[q];
                    if (j != i && cand_path_before(c, j, i)) at++;
                }
            }
            __syncthreads();
            if (i < M) {
                c.logw[at] = wi;
                c.order[at] = i;
            }
            __syncthreads();
            sorted = true;
        }
    }
    if (!sorted) {
        int P = 1;
        while (P < M) P <<= 1;
        const bool warp_stages = c.cap >= 64;  // c.order and c.logw hold >= 64 entries
        if (warp_stages && P < 64) P = 64;
        for (int i = threadIdx.x; i < P; i += blockDim.x) {
            c.order[i] = i < M ? i : -1;
            if (i >= M) c.logw[i] = -INFINITY;
        }
        __syncthreads();
        int k_first = 2;
        if (warp_stages) {
            warp_bitonic_stages(c, P, 2, 64);
            __syncthreads();
            k_first = 128;
        }
        const int half = P >> 1;
        for (int k = k_first; k <= P; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                if (warp_stages && j <= 32) {
                    warp_bitonic_stages(c, P, k, k);
                    __syncthreads();
                    break;
                }
                // Four disjoint pairs per thread: all loaded before any is compared.
                for (int q0 = threadIdx.x; q0 < half; q0 += 4 * blockDim.x) {
                    int ii[4];
                    double wi[4], wl[4];
                    int32_t ai[4], al[4];
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int q = q0 + u * (int)blockDim.x;
                        ii[u] = q < half ? (((q & ~(j - 1)) << 1) | (q & (j - 1))) : -1;  // the pair (i, i ^ j)
                        if (ii[u] >= 0) {
                            wi[u] = c.logw[ii[u]];
                            wl[u] = c.logw[ii[u] + j];
                            ai[u] = c.order[ii[u]];
                            al[u] = c.order[ii[u] + j];
                        }
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        if (ii[u] < 0) continue;
                        const int i = ii[u], l = i + j;
                        const bool l_first = sort_entry_before(c, wl[u], al[u], wi[u], ai[u]);  // l before i?
                        const bool up = (i & k) == 0;  // this run ascends in heap order
                        if (up == l_first) {
                            c.logw[i] = wl[u];
                            c.logw[l] = wi[u];
                            c.order[i] = al[u];
                            c.order[l] = ai[u];
                        }
                    }
                }
                __syncthreads();
            }
        }
    }
}

}  // namespace trees
}  // namespace kdt
