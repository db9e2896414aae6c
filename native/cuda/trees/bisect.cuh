// Version 3: the bisection of thresholds. P_T is enumerated from scratch for each threshold
// T tried, level by level (one thread per parent running its chain of children), and T is
// moved by bisection with log-count interpolation until N <= |P_T| <= cap (or P_T holds
// every finite node). The fallback of version 4's descent (descent.cuh), and the first
// choice for drafts deeper than kDescentMaxDepth.
#pragma once

#include <math.h>
#include <stdint.h>

#include "cands.cuh"

namespace kdt {
namespace trees {

// One parent's chain of children (parent -1: the root's, at row 0) with scores >= T: the
// chain is scored twice (once to count it, once to write it) so that it takes one atomic
// add for all its slots, which are consecutive.
__device__ inline void enumerate_chain(const Cands& c, const float* lp_s, int64_t kp, int32_t parent, int32_t d,
                                       double T, int* count, int* pruned, int* root_fc) {
    const float* row = lp_s + (int64_t)d * kp;
    const double first = parent < 0 ? (double)row[0] : c.logw[parent] + (double)row[0];
    // The chain's scores depend on each other (spec order: subtract, then add, rounded at
    // each step), so they are computed one after another; the row values are fetched
    // eight at a time ahead of that dependency chain.
    double w = first;
    int32_t len = 0;
    bool prune = false, stop = false;
    for (int32_t r0 = 0; r0 < kp && !stop; r0 += 8) {
        float v[9];
#pragma unroll
        for (int j = 0; j < 9; j++) v[j] = r0 + j < kp ? row[r0 + j] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {  // w: the score of rank r0 + j
            if (r0 + j >= kp || isinf(w)) {  // -inf: never emitted; the rest of the row is -inf too
                stop = true;
                break;
            }
            if (w < T) {
                prune = stop = true;
                break;
            }
            len++;
            w = (w - (double)v[j]) + (double)v[j + 1];  // spec: subtract first, then add
        }
    }
    if (prune) atomicOr(pruned, 1);
    if (len == 0) return;
    const int slot0 = atomicAdd(count, len);
    if (slot0 + len > c.cap) return;  // overflow: this threshold is too low
    w = first;
    for (int32_t r0 = 0; r0 < len; r0 += 8) {
        float v[9];
#pragma unroll
        for (int j = 0; j < 9; j++) v[j] = r0 + j < kp ? row[r0 + j] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int32_t r = r0 + j;
            if (r >= len) break;
            const int32_t slot = slot0 + r;
            new_cand(c, slot, w, parent, r, d + 1, r + 1 < len ? slot + 1 : -1, r > 0 ? slot - 1 : parent);
            w = (w - (double)v[j]) + (double)v[j + 1];
        }
    }
    if (parent >= 0) c.fc[parent] = slot0;
    else *root_fc = slot0;
}

// Enumerates P_T level by level; returns |P_T| (> c.cap on overflow). Block-wide.
__device__ int enumerate_pt(const Cands& c, const float* lp_s, int64_t L, int64_t kp, double T, int* s_count,
                            int* s_pruned, int* s_root_fc) {
    __syncthreads();
    if (threadIdx.x == 0) {
        *s_count = 0;
        *s_pruned = 0;
        *s_root_fc = -1;
        enumerate_chain(c, lp_s, kp, -1, 0, T, s_count, s_pruned, s_root_fc);
    }
    __syncthreads();
    // Every thread reads the shared count between two barriers (no thread adds to it
    // there), so all of them take the same branch at the loop test.
    int count_now = *s_count;
    int lo = 0, hi = min(count_now, c.cap);
    __syncthreads();
    for (int32_t d = 1; d < L && lo < hi && count_now <= c.cap; d++) {
        for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
            enumerate_chain(c, lp_s, kp, i, d, T, s_count, s_pruned, s_root_fc);
        }
        __syncthreads();
        count_now = *s_count;
        lo = hi;
        hi = min(count_now, c.cap);
        __syncthreads();
    }
    const int total = *s_count;
    __syncthreads();
    return total;
}

// Version 3's threshold search: bisection (with log-count interpolation) until
// N <= |P_T| <= cap or P_T holds every finite node. Returns |P_T|, or -1 for the heap.
__device__ int bisect_threshold(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N, int* s_count,
                                int* s_pruned, int* s_root_fc) {
    const double top = (double)lp_s[0];
    // Bracket: t_high gives too few nodes, t_low too many (more than cap). The next
    // threshold interpolates log(count) linearly in T towards 1.5 N (counts grow about
    // exponentially as T falls), kept inside the bracket; plain halving when that stalls.
    double t_high = top + 1.0, t_low = -INFINITY, T = top - 4.0;
    double c_high = 0.0, c_low = 0.0;  // counts seen at the bracket ends (c_low: a lower bound)
    const double target = 1.5 * (double)N;
    int found = 0;
    for (int iter = 0; iter < 60; iter++) {
        const int cnt = enumerate_pt(c, lp_s, L, kp, T, s_count, s_pruned, s_root_fc);
        const int pruned = *s_pruned;
        if (cnt > c.cap) {
            t_low = T;
            c_low = (double)cnt;
        } else if (cnt < N && pruned) {
            t_high = T;
            c_high = (double)cnt;
        } else {
            found = 1;
            break;
        }
        if (isinf(t_low)) {
            T = top - 2.0 * (top - T) - 1.0;  // widen downwards until too many
            continue;
        }
        const double gap = t_high - t_low;
        double next = 0.5 * (t_low + t_high);
        if (c_high >= 1.0 && c_low > c_high && iter % 3 != 2) {  // every third step halves
            next = t_high - gap * (log(target) - log(c_high)) / (log(c_low) - log(c_high));
            next = fmin(fmax(next, t_low + 0.05 * gap), t_high - 0.05 * gap);
        }
        if (!(next > t_low && next < t_high)) break;  // cannot separate: fall back
        T = next;
    }
    return found ? *s_count : -1;
}

}  // namespace trees
}  // namespace kdt
