// Threshold selection for the descent (descent.cuh): block_threshold picks a score T with
// at least k of a set of values >= T, by counting for small sets, else by two rounds of
// 256 bins; the bin helpers also serve the descent's first threshold.
#pragma once

#include <math.h>
#include <stdint.h>

#include "plan.cuh"

namespace kdt {
namespace trees {

// An order-preserving map of doubles (NaN excluded) to unsigned 64-bit integers.
__device__ inline unsigned long long double_key(double x) {
    const unsigned long long u = (unsigned long long)__double_as_longlong(x);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
__device__ inline double key_double(unsigned long long k) {
    return __longlong_as_double((long long)((k >> 63) ? (k & 0x7FFFFFFFFFFFFFFFull) : ~k));
}

// Counts digit (< 256; 0x100: none) into bins, one shared atomic per warp and digit.
// Every lane of the warp must call it.
__device__ inline void warp_count_digit(unsigned digit, unsigned* bins) {
    const unsigned same = __match_any_sync(kFullMask, digit);
    if (digit < 0x100u && (__ffs(same) - 1) == (int)(threadIdx.x & 31)) atomicAdd(&bins[digit], __popc(same));
}

// Warp 0: the first bin (from bin 0) at which the running count of bins[0..255] reaches
// *k; stores it in *bin and the count still wanted inside it in *k.
__device__ inline void warp_find_bin(const unsigned* bins, int* k, int* bin) {
    const int lane = threadIdx.x;
    unsigned own[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        own[j] = bins[8 * lane + j];
        sum += own[j];
    }
    unsigned incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += t;
    }
    const unsigned before = incl - sum, want = (unsigned)*k;
    __syncwarp();
    if (before < want && want <= incl) {
        unsigned acc = before;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (acc + own[j] >= want) {
                *bin = 8 * lane + j;
                *k = (int)(want - acc);
                break;
            }
            acc += own[j];
        }
    }
}

// Up to this many values (and blockDim.x), block_threshold selects exactly by counting.
constexpr int kCountSelectMax = 256;

// A threshold T with at least min(k, F) of value(i), i in [0, count), >= T, where F is
// the number of finite values (k >= 1); -inf when F = 0. T is one of the values and at
// most the k-th largest, usually just below it: two rounds of 256 bins, the second inside
// the first's chosen bin, then the smallest value of the chosen sub-bin. The bins are
// monotone in the value, so every value counted before the chosen sub-bin is >= T.
// Block-wide; bins: 512 words.
template <class Value>
__device__ double block_threshold(const Value& value, int count, int k, unsigned* bins, bool counting) {
    __shared__ unsigned long long s_lo, s_hi, s_min;
    __shared__ int s_k, s_bin_a, s_bin_b, s_finite;
    if (counting && count <= kCountSelectMax && count <= (int)blockDim.x) {
        // Few values (a pass's chain heads at N <= 256): the exact k-th largest, min(k, F),
        // by counting: the value v with #(> v) < k <= #(>= v), one thread per value, the
        // values staged in the bins' 2 KB (H200: the two bin rounds cost ~3 us for 65).
        double* vals = reinterpret_cast<double*>(bins);
        const int i = (int)threadIdx.x;
        double v = -INFINITY;
        if (i < count) {
            v = value(i);
            vals[i] = v;  // finite or -inf (a sum of <= 64 finite floats cannot overflow a double)
        }
        if (i == 0) {
            s_finite = 0;
            s_min = 0;  // the largest key chosen; 0: none
        }
        __syncthreads();
        const bool finite = !isinf(v);
        const unsigned f = __ballot_sync(kFullMask, finite);
        if ((threadIdx.x & 31) == 0 && f) atomicAdd(&s_finite, __popc(f));
        __syncthreads();
        const int want = min(k, s_finite);
        if (finite) {
            int gt = 0, ge = 0;
#pragma unroll 8
            for (int j = 0; j < count; j++) {
                const double u = vals[j];
                gt += u > v;
                ge += u >= v;
            }
            if (gt < want && want <= ge) atomicMax(&s_min, double_key(v));  // all such v are equal
        }
        __syncthreads();
        const unsigned long long key = s_min;
        __syncthreads();  // the bins are free again
        return key == 0 ? -INFINITY : key_double(key);
    }
    if (threadIdx.x == 0) {
        s_lo = ~0ull;
        s_hi = 0;
        s_min = ~0ull;
        s_finite = 0;
        s_bin_a = 255;
        s_bin_b = 255;
    }
    for (int i = threadIdx.x; i < 512; i += blockDim.x) bins[i] = 0;
    unsigned long long lo = ~0ull, hi = 0;
    int finite = 0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const double v = value(i);
        if (isinf(v)) continue;
        finite++;
        const unsigned long long key = double_key(v);
        lo = key < lo ? key : lo;
        hi = key > hi ? key : hi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long l2 = __shfl_xor_sync(kFullMask, lo, o), h2 = __shfl_xor_sync(kFullMask, hi, o);
        lo = l2 < lo ? l2 : lo;
        hi = h2 > hi ? h2 : hi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) finite += __shfl_xor_sync(kFullMask, finite, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && hi >= lo) {
        atomicMin(&s_lo, lo);
        atomicMax(&s_hi, hi);
        atomicAdd(&s_finite, finite);
    }
    __syncthreads();
    if (s_hi < s_lo) return -INFINITY;  // no finite value
    const double top = key_double(s_hi), bottom = key_double(s_lo);
    if (top == bottom || k >= s_finite) return bottom;
    if (threadIdx.x == 0) s_k = k;  // read by warp 0 after the next barrier
    const double scale_a = 256.0 / (top - bottom);
    for (int base = 0; base < count; base += blockDim.x) {
        const int i = base + (int)threadIdx.x;
        unsigned digit = 0x100u;
        if (i < count) {
            const double v = value(i);
            if (!isinf(v)) digit = (unsigned)min(255, (int)((top - v) * scale_a));
        }
        warp_count_digit(digit, bins);
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_find_bin(bins, &s_k, &s_bin_a);
    __syncthreads();
    const int bin_a = s_bin_a;
    const double top_b = top - (double)bin_a / scale_a, scale_b = 256.0 * scale_a;
    for (int base = 0; base < count; base += blockDim.x) {
        const int i = base + (int)threadIdx.x;
        unsigned digit = 0x100u;
        if (i < count) {
            const double v = value(i);
            if (!isinf(v) && min(255, (int)((top - v) * scale_a)) == bin_a) {
                digit = (unsigned)min(255, max(0, (int)((top_b - v) * scale_b)));
            }
        }
        warp_count_digit(digit, bins + 256);
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_find_bin(bins + 256, &s_k, &s_bin_b);
    __syncthreads();
    const int bin_b = s_bin_b;
    unsigned long long m = ~0ull;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const double v = value(i);
        if (!isinf(v) && min(255, (int)((top - v) * scale_a)) == bin_a &&
            min(255, max(0, (int)((top_b - v) * scale_b))) == bin_b) {
            const unsigned long long key = double_key(v);
            m = key < m ? key : m;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long m2 = __shfl_xor_sync(kFullMask, m, o);
        m = m2 < m ? m2 : m;
    }
    if ((threadIdx.x & 31) == 0 && m != ~0ull) atomicMin(&s_min, m);
    __syncthreads();
    return key_double(s_min);
}

}  // namespace trees
}  // namespace kdt
