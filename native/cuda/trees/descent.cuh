// Version 4: threshold descent.
// Version 3 re-enumerates P_T from scratch for every threshold it tries. Version 4 only
// lowers the threshold and resumes: every candidate (and the root) owns the chain of its
// children, kept as (next rank, last emitted child) in c.order / c.pos until the sort
// needs them, so a pass at a lower T continues each chain where the last pass stopped
// and P_T grows in place. A pass runs in rounds: round 0 resumes every owner's chain,
// round k the chains of the candidates round k - 1 emitted (one depth deeper each round).
// The first T comes from a model (the spine, the top-1 path, and its children: the
// (N/2)-th best of spine[d] + lp[d][r]); the next ones from the frontier, the heads of
// the chains: with m = N - |P_T| more nodes wanted, T = the m-th best head (every head
// >= T then enters, so the next pass ends with >= N nodes), or the lowest head when there
// are fewer than m. The result is the same P_T version 3 would enumerate at the last T,
// so the sort and the generator-order check that follow are shared. A pass that overflows
// the candidate arrays is rolled back (each chain cut back to the candidates of the last
// pass that fit) and retried halfway up; too many passes hand over to version 3.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "cands.cuh"
#include "descent_chains.cuh"
#include "plan.cuh"
#include "select.cuh"

namespace kdt {
namespace trees {

constexpr int kDescentMaxPasses = 8;
// Owners listed at a time in a round: the list and its two counts fill `bins` (512 words).
constexpr int kGoListMax = 510;
constexpr int64_t kDescentPreciseFirstMin = 512;  // from this budget the first threshold takes two rounds
// Up to this budget the first threshold aims at 3N/4 spine children, not N/2: one pass
// where N/2 took 1.1-2.4 on average (tools/emulate_descent.py, the benchmarks' drafters at
// N = 64), for a P_T of ~2-2.7 N, which the counting sort (<= 256) mostly still takes. H200,
// B = 64: N = 64 25.2 -> 22.2 us; at N = 128 the larger P_T went to the bitonic network,
// 32.9 -> 40.5 us, and at 256 its P_Ts of ~800 would too.
constexpr int64_t kFirstWideTargetMax = 96;
constexpr int64_t kDescentMaxDepth = 64;  // the spine's scores live in a static array

// The descent (above). Returns |P_T| >= 0 with the candidates, links and *root_fc filled,
// or -1 for version 3. Block-wide; kp > 0, L > 0, N > 0, lp_s[0] finite; c.lp0 is
// `spine`'s array (it holds the walks' rank-0 column once the first threshold is chosen).
__device__ int descend_threshold(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N, int* s_count,
                                 int* s_root_fc, unsigned* bins, double* spine, bool warp_rounds, bool walk,
                                 bool counting) {
    __shared__ int s_pruned, s_overflow;
    __shared__ int32_t s_root_next, s_root_last;
    // The first threshold: about the (N/2)-th best spine child, spine[d] + lp[d][r] over
    // the first `width` ranks of each row (an estimate: any threshold gives the exact tree;
    // the passes below correct it), the (3N/4)-th up to kFirstWideTargetMax,
    // from one round of 256 bins between the best value lp[0][0] and the lowest finite one.
    const int64_t half = N / 2 > 1 ? N / 2 : 1;
    const int width = (int)(kp < half ? kp : half);
    const int items = (int)L * width;
    const int64_t target = N <= kFirstWideTargetMax ? (3 * N / 4 > 1 ? 3 * N / 4 : 1) : half;
    __shared__ double s_low;
    __shared__ int s_want, s_bin;
    if (threadIdx.x == 0) {
        *s_count = 0;
        *s_root_fc = -1;
        s_root_next = 0;
        s_root_last = -1;
        double w = 0.0, low = (double)lp_s[0];  // spine[d]: the score of the top-1 path's node at depth d
        for (int64_t d = 0; d < L; d++) {
            spine[d] = w;
            const double v = w + (double)lp_s[d * kp + width - 1];
            if (!isinf(v) && v < low) low = v;
            w = w + (double)lp_s[d * kp];
        }
        s_low = low;
        s_want = (int)(target < items ? target : items);
        s_bin = -1;
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
    __syncthreads();
    const double top = (double)lp_s[0], low = s_low;
    double T = low;
    if (N >= kDescentPreciseFirstMin) {
        // Large trees: the two-round threshold (one of the values, just under the target
        // count): a coarse bin's overshoot overflows the candidates there (H200: N = 1024
        // 274 us this way, 441 us with the single round; docs/performance.md).
        T = block_threshold(
            [&](int i) {
                const int d = i / width, r = i - d * width;
                return spine[d] + (double)lp_s[(int64_t)d * kp + r];
            },
            items, (int)(half < items ? half : items), bins, counting);
    } else if (low < top) {
        const double scale = 256.0 / (top - low);
        for (int base = 0; base < items; base += blockDim.x) {
            const int i = base + (int)threadIdx.x;
            unsigned digit = 0x100u;
            if (i < items) {
                const int d = i / width, r = i - d * width;
                const double v = spine[d] + (double)lp_s[(int64_t)d * kp + r];
                if (!isinf(v)) digit = (unsigned)min(255, max(0, (int)((top - v) * scale)));
            }
            warp_count_digit(digit, bins);
        }
        __syncthreads();
        if (threadIdx.x < 32) warp_find_bin(bins, &s_want, &s_bin);
        __syncthreads();
        // The chosen bin's lower edge. (Its upper edge, a little under the target count,
        // cost N = 64 a third pass on an H200: 47 -> 70 us; docs/performance.md.)
        if (s_bin >= 0) T = top - (double)(s_bin + 1) / scale;
    }
    if (!(T > -INFINITY)) T = -DBL_MAX;
    // The spine's scores are dead (their last reads are behind a barrier above): the same
    // array now holds lp[d][0] as doubles for the first-child walks, which start after the
    // barrier at the top of the first pass. (No static shared memory of its own: more
    // moves budgets near the shared-memory limit to slower paths.)
    for (int i = threadIdx.x; i < L; i += blockDim.x) c.lp0[i] = (double)lp_s[(int64_t)i * kp];
    int kept = 0;               // candidates after the last pass that fit (and ended below N)
    double t_kept = top;        // its threshold (before any pass: lp[0][0], which admits few)
    bool have_over = false;     // a pass overflowed: at t_over, with more than c_over candidates
    double t_over = 0.0, c_over = 0.0;
    const int spread = (int)(threadIdx.x % 32) * (int)(blockDim.x / 32) + (int)(threadIdx.x / 32);  // thread 0: 0
    for (int pass = 0; pass < kDescentMaxPasses; pass++) {
        // The rounds' lists of owners to resume: their lengths by chunk parity, after the
        // list in `bins` (which the thresholds between the passes overwrite).
        unsigned* const s_ngo = bins + kGoListMax;
        if (threadIdx.x == 0) {
            s_pruned = 0;
            s_overflow = 0;
            s_ngo[0] = 0;
            s_ngo[1] = 0;
        }
        int go_parity = 0;  // which of s_ngo the next chunk of owners counts its list in
        __syncthreads();
        root_chain_block(c, lp_s, L, kp, T, s_count, &s_pruned, &s_overflow, &s_root_next, &s_root_last, s_root_fc,
                         walk);
        int lo = 0;  // the root's chain is done
        int hi = s_overflow ? lo : min(*s_count, c.cap);  // round 0: every candidate (and the root)
        __syncthreads();  // everyone has read the count before round 0 adds to it
        while (lo < hi) {
            if (warp_rounds) {
                // One warp per owner whose chain head is >= T, one lane per candidate
                // (resume_chain_warp). The heads are read one owner per thread (most owners
                // of a round are leaves of P_T, whose head is below T or -inf), the owners to
                // resume are listed in `bins` (free during the rounds), and the list is dealt
                // to the warps in turn: a round's k resumptions take ceil(k / 16) in its
                // slowest warp. (Owners dealt by index, owner k to warp k % 16, left one warp
                // 3 of a round's 15 on the synthetic drafter at N = 64, H200: ~1.3 us each.)
                const int nw = (int)(blockDim.x / 32), lane = (int)(threadIdx.x & 31);
                const int warp = (int)(threadIdx.x / 32), chunk = min((int)blockDim.x, kGoListMax);
                for (int base = lo; base < hi; base += chunk) {
                    const int i = base + (int)threadIdx.x;
                    bool go = false;
                    if ((int)threadIdx.x < chunk && i < hi) {
                        const double head = chain_head(c, lp_s, L, kp, i, &s_root_next, &s_root_last);
                        if (!isinf(head)) {
                            if (head >= T) go = true;
                            else s_pruned = 1;
                        }
                    }
                    const unsigned m = __ballot_sync(kFullMask, go);
                    int at = 0;
                    if (lane == 0 && m) at = (int)atomicAdd(&s_ngo[go_parity], (unsigned)__popc(m));
                    at = __shfl_sync(kFullMask, at, 0) + __popc(m & ((1u << lane) - 1u));
                    if (go) bins[at] = (unsigned)i;
                    __syncthreads();
                    const int n = (int)s_ngo[go_parity];
                    // The other count was last read before the barrier between the chunks
                    // (or the rounds) before this one, and is next added to after the next.
                    if (threadIdx.x == 0) s_ngo[go_parity ^ 1] = 0;
                    go_parity ^= 1;
                    for (int g = warp; g < n; g += nw) {
                        resume_chain_warp(c, lp_s, L, kp, (int32_t)bins[g], T, s_count, &s_pruned,
                                          &s_overflow, walk);
                    }
                    // The list is read before the next chunk writes it.
                    if (base + chunk < hi) __syncthreads();
                }
            } else {
                // One thread per owner. Consecutive owners go to different warps (owner k to
                // warp k % 16): a warp runs its lanes' diverging chain walks one after
                // another, so a round of a few owners packed into one warp took as long as
                // their sum (H200 profile).
                for (int i = lo + spread; i < hi; i += blockDim.x) {
                    resume_chain(c, lp_s, L, kp, i, T, s_count, &s_pruned, &s_overflow, walk);
                }
            }
            __syncthreads();
            lo = hi;
            hi = min(*s_count, c.cap);
            if (s_overflow) break;
            __syncthreads();  // everyone has read the count before the next round adds to it
        }
        const int M = *s_count;
        if (s_overflow) {
            // T was too low for the candidate arrays: drop this pass's candidates (every
            // chain is cut back to its children below `kept`, which come first in its
            // list) and try halfway between the last threshold that fit and T.
            for (int o = (int)threadIdx.x - 1; o < kept; o += blockDim.x) {
                int32_t first = o < 0 ? *s_root_fc : c.fc[o];
                if (first >= kept) first = -1;
                int32_t last = -1;
                for (int32_t a = first; a >= 0 && a < kept; a = c.ns[a]) last = a;
                if (last >= 0) c.ns[last] = -1;
                const int32_t next = last >= 0 ? c.rank[last] + 1 : 0;
                if (o < 0) {
                    *s_root_fc = first;
                    s_root_next = next;
                    s_root_last = last;
                } else {
                    c.fc[o] = first;
                    c.order[o] = next;
                    c.pos[o] = last;
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) *s_count = kept;
            if (!have_over || T > t_over) {
                have_over = true;
                t_over = T;
                c_over = (double)M;
            }
            const double mid = 0.5 * (t_kept + T);
            if (!(mid > T && mid < t_kept)) return -1;  // cannot separate them: version 3
            T = mid;
            continue;
        }
        if (M >= N || !s_pruned) return M;
        kept = M;
        t_kept = T;
        // The next threshold from the chain heads (the heap's frontier).
        auto head = [&](int i) { return chain_head(c, lp_s, L, kp, i - 1, &s_root_next, &s_root_last); };
        T = block_threshold(head, M + 1, (int)(N - M), bins, counting);
        if (isinf(T)) return -1;  // (cannot happen: a pruned chain has a finite head; version 3 if it does)
        if (have_over && !(T > t_over)) {
            // Never at or below a threshold that already overflowed: interpolate log(count)
            // between the last pass that fit and it, towards 1.2 N (tools/emulate_descent.py,
            // policy C: 3-4 passes instead of up to 8 on bf16 logits at N = 1024).
            const double lo_c = kept > 1 ? (double)kept : 1.0;
            double f = (log(1.2 * (double)N) - log(lo_c)) / (log(c_over) - log(lo_c));
            f = fmin(fmax(f, 0.1), 0.9);
            T = t_kept + (t_over - t_kept) * f;
            if (!(T > t_over && T < t_kept)) return -1;
        }
        __syncthreads();
    }
    return -1;
}

}  // namespace trees
}  // namespace kdt
