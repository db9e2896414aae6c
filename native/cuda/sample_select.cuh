// The top-k and top-p cuts of kdt_verify_sample_batch_cuda (definition: include/kdtree.h),
// computed by one thread block over one logits row.
//
// Both cuts are thresholds in a total order of the row's tokens: a token's 64-bit key is
// (float_order_key(value) << 32) | ~id, so a larger key is a larger value, or the same
// value and a lower id; a cut keeps the tokens whose key is >= the threshold key. The
// threshold is found by radix selection, one byte of key a pass from the top: each pass
// histograms (count and integer weight) the candidates whose key starts with the bytes
// chosen so far, and the byte is the first bin, from the top, at which the cumulative
// weight reaches the target. When the chosen bin holds a single token, the bytes chosen
// so far already separate it from every other token and the search stops (the usual case
// after 3 or 4 passes: float values rarely tie). Weights are integers, so every sum is
// exact and independent of the order the threads add them in; the host reference
// (python/kdtree/core/sampling.py) computes the same integers and thresholds.
#pragma once

#include "common.cuh"

namespace kdt {

constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// Keys of the two orders: by logit (top-k) and by scaled score s = logit / T (top-p).
// -0 is keyed as +0 (equal values: the lower id ranks first).
__device__ __forceinline__ uint64_t token_key(float x, int64_t v) {
    const float y = x == 0.0f ? 0.0f : x;
    return ((uint64_t)float_order_key(y) << 32) | (uint64_t)(~(uint32_t)v);
}

// 1 / n! for n = 0 .. 13, correctly rounded (float.hex(1 / math.factorial(n))).
__constant__ const double kInvFactorial[14] = {
    0x1.0000000000000p+0,  0x1.0000000000000p+0,  0x1.0000000000000p-1,  0x1.5555555555555p-3,
    0x1.5555555555555p-5,  0x1.1111111111111p-7,  0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13,
    0x1.a01a01a01a01ap-16, 0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26,
    0x1.1eed8eff8d898p-29, 0x1.6124613a86d09p-33};

// E(d), the float64 exponential of the top-p weights, for d in [-64, 0]: k = floor(d / ln 2
// + 1/2) (as d * (1 / ln 2) + 0.5), r = (d - k ln2_hi) - k ln2_lo (fdlibm's split of ln 2),
// the degree-13 Taylor polynomial of exp(r) by Horner, times 2^k. Every operation is an
// explicitly rounded IEEE float64 one (no fused multiply-add), so numpy's element-wise
// evaluation of the same sequence gives the same bits.
__device__ __forceinline__ double sample_exp(double d) {
    const double kInvLn2 = 0x1.71547652b82fep+0, kLn2Hi = 0x1.62e42fee00000p-1, kLn2Lo = 0x1.a39ef35793c76p-33;
    const double k = floor(__dadd_rn(__dmul_rn(d, kInvLn2), 0.5));
    const double r = __dsub_rn(__dsub_rn(d, __dmul_rn(k, kLn2Hi)), __dmul_rn(k, kLn2Lo));
    double q = kInvFactorial[13];
#pragma unroll
    for (int n = 12; n >= 0; n--) q = __dadd_rn(__dmul_rn(q, r), kInvFactorial[n]);
    const double two_k = __longlong_as_double((long long)(1023 + (int)k) << 52);  // k >= -93: normal
    return __dmul_rn(q, two_k);
}

// A token's top-p weight floor(E(s - m) * 2^S) (0 below s - m = -64, and for s = -inf).
__device__ __forceinline__ uint64_t sample_weight(float s, float m, double two_s) {
    const double d = __dsub_rn((double)s, (double)m);
    if (!(d >= -64.0)) return 0;
    return __double2ull_rz(__dmul_rn(sample_exp(d), two_s));
}

// S = 63 - ceil(log2(V)): V tokens of weight <= 2^S sum to at most 2^63.
__device__ __forceinline__ int weight_shift(int64_t V) {
    const int d = V <= 1 ? 0 : 64 - __clzll((long long)(V - 1));
    return 63 - d;
}

// The histogram of one selection pass (shared memory).
struct SelectHist {
    unsigned int count[256];
    unsigned long long weight[256];
    uint64_t prefix, above, total;  // bytes chosen so far; weight of the keys above them; total
    int done;
};

// The target of a selection: the threshold key is the key of the first token, in
// decreasing key order, at which the cumulative weight `cum` reaches it.
struct CountTarget {  // top-k: `k` tokens (weights are 1)
    uint64_t k;
    __device__ bool reached(uint64_t cum, uint64_t) const { return cum >= k; }
};
struct MassTarget {  // top-p: a share `top_p` of the total weight
    double top_p;
    __device__ bool reached(uint64_t cum, uint64_t total) const {
        return __ull2double_rn(cum) >= __dmul_rn(top_p, __ull2double_rn(total));
    }
};

// The threshold key of a selection over the row's tokens, computed by the whole block
// (every thread returns it). Item supplies, for token v with logit x,
//   bool key(v, x, &key):   whether v is a candidate, and its key;
//   uint64_t weight(v, x):  its weight (called for the candidates still in the search).
// Contains barriers; every thread of the block must call it.
template <int Dtype, bool Weighted, class Item, class Target>
__device__ uint64_t radix_select(const char* row, int64_t V, const Item& item, const Target& target,
                                 SelectHist* h) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t nthreads = blockDim.x;
    for (int shift = 56;; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            h->count[d] = 0;
            h->weight[d] = 0;
        }
        if (threadIdx.x == 0 && shift == 56) {
            h->prefix = 0;
            h->above = 0;
            h->done = 0;
        }
        __syncthreads();
        const uint64_t prefix = h->prefix;
        // Warps stride over the row together (all 32 lanes in every iteration), so the lanes
        // that fall in one bin add once: a row's values crowd into a few bins.
        for (int64_t base = (int64_t)warp * 32; base < V; base += nthreads) {
            const int64_t v = base + lane;
            unsigned digit = 256u;
            uint64_t w = 0;
            if (v < V) {
                const float x = load_logit<Dtype>(row, v);
                uint64_t key;
                if (item.key(v, x, &key) && (shift == 56 || (key >> (shift + 8)) == (prefix >> (shift + 8)))) {
                    digit = (unsigned)(key >> shift) & 255u;
                    w = Weighted ? item.weight(v, x) : 1u;
                }
            }
            const unsigned peers = __match_any_sync(kFullWarp, digit);
            if constexpr (Weighted) {
                // Three 21-bit pieces: 32 of each sum below 2^26 (weights are below 2^64).
                const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0x1FFFFFu));
                const unsigned mid = __reduce_add_sync(peers, (unsigned)((w >> 21) & 0x1FFFFFu));
                const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 42));
                w = ((uint64_t)hi << 42) + ((uint64_t)mid << 21) + (uint64_t)lo;
            } else {
                w = (uint64_t)__popc(peers);
            }
            if (digit < 256u && lane == __ffs(peers) - 1) {
                atomicAdd(&h->count[digit], (unsigned)__popc(peers));
                atomicAdd(&h->weight[digit], (unsigned long long)w);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 - 8l down to 248 - 8l; an inclusive scan over lanes gives
            // the weight of every bin above each lane's.
            uint64_t mine = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) mine += h->weight[255 - 8 * lane - j];
            uint64_t incl = mine;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const uint64_t o = __shfl_up_sync(kFullWarp, incl, off);
                if (lane >= off) incl += o;
            }
            const uint64_t total = shift == 56 ? __shfl_sync(kFullWarp, incl, 31) : h->total;
            const uint64_t above = h->above;
            const unsigned hit = __ballot_sync(kFullWarp, target.reached(above + incl, total));
            // hit == 0 cannot happen (the whole row reaches any target); lane 31's last bin then.
            const int first = hit ? __ffs(hit) - 1 : 31;
            if (lane == first) {
                uint64_t cum = above + incl - mine;
                int digit = 248 - 8 * lane;
                for (int j = 0; j < 8; j++) {
                    const int d = 255 - 8 * lane - j;
                    if (target.reached(cum + h->weight[d], total) || j == 7) {
                        digit = d;
                        break;
                    }
                    cum += h->weight[d];
                }
                h->above = cum;
                h->prefix = prefix | ((uint64_t)digit << shift);
                h->done = h->count[digit] <= 1u || shift == 0;
                if (shift == 56) h->total = total;
            }
        }
        __syncthreads();
        if (h->done) {
            const uint64_t r = h->prefix;
            __syncthreads();  // h is reused by the next selection
            return r;
        }
    }
}

}  // namespace kdt
