// Version 4's chain resumption (descent.cuh runs the passes): every candidate (and the
// root) owns the chain of its children, kept as (next rank, last emitted child) in
// c.order / c.pos until the sort needs them; a pass at a threshold T resumes chains and
// emits the candidates whose scores are >= T. A round's owners are resumed one warp each
// (resume_chain_warp) up to kWarpChainsMaxBudget, else one thread each (resume_chain); the
// root's chain by the whole block (root_chain_block); paths of first children are walked
// at once (walk_first_children*). Every variant emits the same candidates and links.
#pragma once

#include <math.h>
#include <stdint.h>

#include "cands.cuh"
#include "plan.cuh"

namespace kdt {
namespace trees {

// The score of the next candidate of owner o's chain of children (o = -1: the root's),
// or -inf when the chain is exhausted (no rank left, depth L, a -inf log-prob).
__device__ inline double chain_head(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o,
                                    const int32_t* root_next, const int32_t* root_last) {
    // The root's chain state is read only for the root: thread 0 writes it in round 0
    // while the other threads work on their own owners.
    const int32_t d = o < 0 ? 0 : c.depth[o];
    const int32_t r = o < 0 ? *root_next : c.order[o];
    const int32_t last = o < 0 ? *root_last : c.pos[o];
    if (d >= L || r >= kp) return -INFINITY;
    const float* row = lp_s + (int64_t)d * kp;
    if (last < 0) return o < 0 ? (double)row[0] : c.logw[o] + (double)row[0];
    return (c.logw[last] - (double)row[r - 1]) + (double)row[r];  // spec: subtract first, then add
}

// Emits, from `node` (a candidate with no child yet), its first child, that child's first
// child, and so on while the scores stay >= T (a first child scores its parent's score +
// lp[d][0], the spec's rule), each taking one slot and becoming its parent's chain so far
// (next rank 1). One thread. The nodes it adds are owners in the next round, which
// resume their chains at rank 1 (and find a head below T or -inf where the walk stopped),
// so P_T is unchanged; what changes is that a path of first children costs no round per
// depth: a round's run that starts at rank 0 walks its first node's first children at
// once (a spine of 16 took 16 rounds; the rounds were ~0.6-1.5 us each on an H200).
__device__ void walk_first_children(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t node, double T,
                                    int* count, int* overflow) {
    for (;;) {
        const int32_t dn = c.depth[node];
        if (dn >= L) return;
        const double w = c.logw[node] + (double)lp_s[(int64_t)dn * kp];
        if (isinf(w) || !(w >= T)) return;  // the node's own round sees this head
        const int slot = atomicAdd(count, 1);
        if (slot + 1 > c.cap) {
            *overflow = 1;
            return;
        }
        new_cand(c, slot, w, node, 0, dn + 1, -1, node);
        c.fc[node] = slot;
        c.order[node] = 1;
        c.pos[node] = slot;
        node = slot;
    }
}

// n > 0 consecutive candidate slots for the calling warp (every lane calls it with the same
// n): lane 0 takes them with one atomic; returns the first on every lane, or -1 with
// *overflow set when they do not fit (the pass is then rolled back).
__device__ inline int warp_take_slots(int* count, int n, int cap, int* overflow) {
    int slot0 = 0;
    if ((threadIdx.x & 31) == 0) slot0 = atomicAdd(count, n);
    slot0 = __shfl_sync(kFullMask, slot0, 0);
    if (slot0 + n > cap) {
        if ((threadIdx.x & 31) == 0) *overflow = 1;
        return -1;
    }
    return slot0;
}

// walk_first_children by a whole warp (every lane calls it with the same node): lane k
// scores the walk's k-th step, ((w + lp[d][0]) + lp[d + 1][0]) + ... + lp[d + k][0], the
// same additions in the same order as the one-thread walk, so the same doubles; the walk
// takes the steps before the first one not admitted (not finite, or < T), as the
// one-thread walk stops there.
// They take their slots with one atomic and are written one lane each: the same nodes,
// fields and links as walk_first_children, with no dependent atomic per step (the
// one-thread walk cost ~0.1 us a step on an H200). On overflow nothing is written (the
// pass is rolled back). At most 32 steps: a longer path goes on in the next round, where
// the last node's run starts at rank 0 and walks again.
__device__ void walk_first_children_warp(const Cands& c, int64_t L, int32_t node,
                                         double T, int* count, int* overflow) {
    const int lane = threadIdx.x & 31;
    const int32_t d0 = c.depth[node];
    const int steps = (int)min((int64_t)32, L - d0);
    if (steps <= 0) return;
    const double* col = c.lp0 + d0;  // lp[d][0] for d = d0, d0 + 1, ...
    double w = c.logw[node];
    // Four steps at a time. Lanes up to a chunk's last step then hold their final scores,
    // and the walk ends at its first refused step: once one is refused, later steps are not
    // needed (all 16 steps of every walk were ~3,500 warp instructions a block at N = 64,
    // H200 ncu; most walks end in their first chunk).
    for (int j0 = 0; j0 < steps; j0 += 4) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = j0 + u;
            if (j < steps) {
                const double v = col[j];
                if (j <= lane) w = w + v;
            }
        }
        const bool refused_here = lane <= min(j0 + 3, steps - 1) && !(!isinf(w) && w >= T);
        if (__any_sync(kFullMask, refused_here)) break;
    }
    // (Lanes past the chunk where the loop stopped hold partial sums, but lie after the
    // first refused step: they are not taken.)
    const bool admitted = lane < steps && !isinf(w) && w >= T;
    const unsigned refused = __ballot_sync(kFullMask, !admitted);
    const int n = refused ? __ffs(refused) - 1 : 32;
    if (n == 0) return;
    const int slot0 = warp_take_slots(count, n, c.cap, overflow);
    if (slot0 < 0) return;
    if (lane < n) {
        const int32_t slot = slot0 + lane;
        const int32_t parent = lane == 0 ? node : slot - 1;
        new_cand(c, slot, w, parent, 0, d0 + 1 + lane, -1, parent);
        if (lane + 1 < n) {  // this step has a child in the walk, its chain so far
            c.fc[slot] = slot + 1;
            c.order[slot] = 1;
            c.pos[slot] = slot + 1;
        }
        if (lane == 0) {
            c.fc[node] = slot;
            c.order[node] = 1;
            c.pos[node] = slot;
        }
    }
}

// Resumes owner o's chain of children (o >= 0) at threshold T: emits the next candidates
// while their scores are >= T (one atomic per eight, whose slots are consecutive), links
// them after the chain's last child and makes each of them an owner with an empty chain.
// The run waits for the next round, but for a walk of its first node's first children
// (when it starts the chain and `walk` is on). A chain walked again in a later round of
// the same pass starts below T and emits nothing.
__device__ inline void resume_chain(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o, double T,
                                    int* count, int* pruned, int* overflow, bool walk) {
    const int32_t d = c.depth[o];
    const int32_t r0 = c.order[o];
    int32_t prev = c.pos[o];  // the chain's last child so far
    if (d >= L || r0 >= kp) return;
    const float* row = lp_s + (int64_t)d * kp;
    // The chain's head, as chain_head scores it.
    const double head =
        prev < 0 ? c.logw[o] + (double)row[0] : (c.logw[prev] - (double)row[r0 - 1]) + (double)row[r0];
    if (isinf(head)) return;
    if (head < T) {
        *pruned = 1;
        return;
    }
    int32_t first_new = -1, r = r0;
    double w = head;
    bool more = true;
    // Up to eight candidates are scored (in the spec's order, one after another) into
    // registers, then take their slots with one atomic and are written; repeat.
    while (more) {
        double ws[8];
        int nb = 0;
        float v[9];  // the row's values for this batch, loaded before the dependent scoring
#pragma unroll
        for (int j = 0; j < 9; j++) v[j] = r + j < kp ? row[r + j] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (!more) break;
            if (r + j >= kp || isinf(w)) {  // no rank left; -inf: never emitted, nor the rest
                more = false;
                break;
            }
            if (w < T) {
                *pruned = 1;
                more = false;
                break;
            }
            ws[j] = w;
            nb = j + 1;
            if (r + j + 1 < kp) w = (w - (double)v[j]) + (double)v[j + 1];  // subtract, then add
        }
        if (nb == 0) break;
        const int slot0 = atomicAdd(count, nb);
        if (slot0 + nb > c.cap) {
            *overflow = 1;
            return;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j >= nb) break;
            const int32_t slot = slot0 + j;
            new_cand(c, slot, ws[j], o, r + j, d + 1, j + 1 < nb ? slot + 1 : -1,
                     j > 0 ? slot - 1 : (prev >= 0 ? prev : o));
        }
        if (prev >= 0) c.ns[prev] = slot0;
        else c.fc[o] = slot0;
        if (first_new < 0) first_new = slot0;
        prev = slot0 + nb - 1;
        r += nb;
        if (r >= kp) more = false;
    }
    c.order[o] = r;
    c.pos[o] = prev;
    if (first_new >= 0 && walk && r0 == 0) walk_first_children(c, lp_s, L, kp, first_new, T, count, overflow);
}


// resume_chain for one owner o >= 0 by a whole warp (every lane calls it with the same o),
// breadth first: the run it emits waits for the next round. The chain's scores follow the
// spec's recurrence w' = (w - lp[r]) + lp[r + 1], i.e. w_r = fl(x_r + lp[r]) with
// x_{r+1} = fl(w_r - lp[r]). Where x_{r+1} == x_r bit for bit (usual: a parent's score and
// a float log-prob sum exactly in a double), every score of the run is fl(x + lp[r]),
// which the 32 lanes compute for 32 ranks at once; each lane checks that identity for its
// rank, and the run is cut after the first lane where it fails (its score is still
// right), then resumes from the x that lane computed. So the candidates are exactly
// resume_chain's, one lane per candidate instead of one thread per chain.
// (When pos[o] >= 0, the last child's score and lp[d][order[o] - 1] are finite: it was
// emitted.)
__device__ void resume_chain_warp(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o, double T,
                                  int* count, int* pruned, int* overflow, bool walk) {
    const int lane = threadIdx.x & 31;
    const int32_t d = c.depth[o];
    int32_t r = c.order[o];     // the chain's next rank
    int32_t prev = c.pos[o];    // its last child so far, -1: none
    if (d >= L || r >= kp) return;
    const bool first_run = r == 0;
    int32_t walk_from = -1;     // the rank-0 child emitted here, if any
    const float* row = lp_s + (int64_t)d * kp;
    double x = prev < 0 ? c.logw[o] : c.logw[prev] - (double)row[r - 1];  // spec: subtract first, then add
    for (;;) {
        const int32_t rk = r + lane;
        const bool in = rk < kp;
        const double v = in ? (double)row[rk] : 0.0;
        const double w = x + v;
        const double x_next = w - v;
        const bool same_x = in && __double_as_longlong(x_next) == __double_as_longlong(x);
        const bool admitted = in && !isinf(w) && w >= T;
        const unsigned x_changes = __ballot_sync(kFullMask, !same_x);
        const unsigned refused = __ballot_sync(kFullMask, !admitted);
        const int valid = x_changes ? __ffs(x_changes) - 1 : 31;  // lanes <= valid hold true scores
        const int stop = refused ? __ffs(refused) - 1 : 32;      // the first rank not admitted
        const int m = stop <= valid ? stop : valid + 1;          // lanes [0, m) are emitted now
        if (m > 0) {
            // Too many for the arrays: this threshold is too low. order[o] / pos[o] are left
            // as they were, and any link made by an earlier step of this call is cut by the
            // pass's rollback.
            const int slot0 = warp_take_slots(count, m, c.cap, overflow);
            if (slot0 < 0) return;
            if (lane < m) {
                const int32_t slot = slot0 + lane;
                new_cand(c, slot, w, o, rk, d + 1, lane + 1 < m ? slot + 1 : -1,
                         lane > 0 ? slot - 1 : (prev >= 0 ? prev : o));
            }
            __syncwarp();  // the last step's final lane wrote ns[prev] = -1: lane 0 links after it
            if (lane == 0) {
                if (prev >= 0) c.ns[prev] = slot0;
                else c.fc[o] = slot0;
            }
            if (first_run && r == 0) walk_from = slot0;
            prev = slot0 + m - 1;
            r += m;
        }
        if (stop <= valid) {
            // Stopped at rank r (lane `stop`): pruned when it exists with a finite score
            // (below T); no rank left or -inf (and the rest -inf) is not pruning.
            const bool prunes = in && !isinf(w) && !(w >= T);
            if (__shfl_sync(kFullMask, prunes, stop) && lane == 0) *pruned = 1;
            break;
        }
        x = __shfl_sync(kFullMask, x_next, valid);  // every lane up to `valid` was emitted
    }
    __syncwarp();  // every lane has read the chain's state (above) before lane 0 moves it on
    if (lane == 0) {
        c.order[o] = r;
        c.pos[o] = prev;
    }
    if (walk && walk_from >= 0) {  // (warp-uniform: from the broadcast slot)
        __syncwarp();  // walk_from's fields, written by lane 0, are read by every lane
        walk_first_children_warp(c, L, walk_from, T, count, overflow);
    }
}

// The root's chain of children, resumed at T by the whole block. Its scores need no
// sequential pass: the spec's recurrence (w - lp[r - 1]) + lp[r] starting from w = lp[0]
// gives every rank its own log-prob exactly (x - x = +0 and +0 + y = y), except that a
// -0.0 becomes +0.0 after rank 0. The row descends, so the ranks admitted are a prefix of
// what is left: thread 0 finds its length by bisection and takes the slots, then every
// thread writes some. Same candidates, links and flags as resume_chain(-1) would leave
// (round 0 of a pass spent ~10-20 us on the root's ~600 siblings at N = 1024 on one
// thread). Block-wide; L >= 1.
__device__ inline double root_child_score(const float* row0, int32_t r) {
    const double v = (double)row0[r];
    return r > 0 && v == 0.0 ? 0.0 : v;
}
__device__ void root_chain_block(const Cands& c, const float* lp_s, int64_t L, int64_t kp, double T, int* count,
                                 int* pruned, int* overflow, int32_t* root_next, int32_t* root_last, int* root_fc,
                                 bool walk) {
    __shared__ int s_n, s_slot0, s_prev, s_r0;
    if (threadIdx.x == 0) {
        const int32_t r0 = *root_next;
        // Admitted: finite and >= T; a prefix of [r0, kp) since the row descends.
        int32_t lo = r0, hi = (int32_t)kp;  // the first rank not admitted is in [lo, hi]
        while (lo < hi) {
            const int32_t mid = lo + (hi - lo) / 2;
            const double w = root_child_score(lp_s, mid);
            if (!isinf(w) && w >= T) lo = mid + 1;
            else hi = mid;
        }
        const int n = lo - r0;
        if (lo < kp && !isinf(root_child_score(lp_s, lo))) *pruned = 1;  // a finite head below T
        s_n = 0;
        if (n > 0) {
            const int slot0 = atomicAdd(count, n);
            if (slot0 + n > c.cap) {
                *overflow = 1;  // the chain's state is left as it was (as resume_chain does)
            } else {
                const int32_t prev = *root_last;
                if (prev >= 0) c.ns[prev] = slot0;
                else *root_fc = slot0;
                *root_next = r0 + n;
                *root_last = slot0 + n - 1;
                s_n = n;
                s_slot0 = slot0;
                s_prev = prev;
                s_r0 = r0;
            }
        }
    }
    __syncthreads();
    const int n = s_n, slot0 = s_slot0, prev = s_prev, r0 = s_r0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int32_t slot = slot0 + j;
        new_cand(c, slot, root_child_score(lp_s, r0 + j), -1, r0 + j, 1, j + 1 < n ? slot + 1 : -1,
                 j > 0 ? slot - 1 : prev);
    }
    __syncthreads();
    if (walk && r0 == 0 && n > 0) {  // the spine below the root's first child
        if (threadIdx.x < 32) walk_first_children_warp(c, L, slot0, T, count, overflow);
        __syncthreads();
    }
}

}  // namespace trees
}  // namespace kdt
