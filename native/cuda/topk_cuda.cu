// Top-k log-probs from logits on the GPU (kdt_topk_logprobs_cuda), on the caller's stream.
// k <= 128: the row kernel (one block per row, described at its definition below). Larger
// k (or forced by kdt_testing_set_topk_chunked, for tests): the chunk and finish kernels here.
//
// Chunk kernel, one block per (row, chunk): a chunk is 256 threads x 32 words of the row
// (16384 elements for float16/bfloat16, 8192 for float32), loaded once into registers with
// 16-byte loads (a row that does not start on a 16-byte boundary is read in the frame of
// the aligned address below it, and the at most two vectors that stick out of the row are
// read element by element, so every row, stride and slice takes the vector path). Each
// block writes to the workspace
//   - its chunk's max m_c, sum s_c = sum exp(x - m_c) (float32, the hardware 2^x of
//     (x - m_thread) * log2(e), per-thread sums rescaled to the block max with expf) and
//     NaN / +inf flags;
//   - the k largest keys of its chunk (unsorted, padded with key 0 when the chunk holds
//     fewer than k elements), where an element's key is
//         (float_order_key(x) << 32) | ~id        (NaN: 0 in the upper half)
//     A larger key is a larger value, or an equal value with a lower id; keys are unique
//     and every real one is > 0 (float_order_key(-inf) = 0x007FFFFF), so "the k largest
//     keys" is exactly the spec's order (value descending, ties to the lower id).
// Selection in a block is exact. A cheap lower bound first: the k-th largest of the
// group maxima t (a group is the whole thread for k <= 128, else 1/16 of it): k groups
// each hold an element >= t, so at least k elements are >= t and every element of the
// chunk's top k is >= t. The elements >= t (typically about 1.1 k) go to a shared-memory
// buffer, and a radix select finds the k-th largest key among them. When t is -inf (fewer
// than k groups hold a finite logit: a short chunk, a masked row) the buffer takes every
// finite element and the chunk's first k columns instead, which again contain the top k
// (the finite ones, then -inf ones by increasing column). When ties at t overflow the
// buffer (or it holds fewer than k keys, which a NaN can cause), the radix select runs
// over all the chunk's keys.
// The radix select (block_select) walks 8-bit digits from the top of the 64-bit key,
// skipping digits that every item shares, histogramming the items that still match the
// chosen prefix, and stops once the digit's bin holds exactly the keys still needed: the
// result T then has exactly k keys >= T (keys are unique), which are written out.
//
// Finish kernel, one block per row: m = max m_c, S = sum s_c * expf(m_c - m), the row's
// status from the flags and m; a radix select of the k-th largest key over the chunks'
// keys (staged in shared memory when they fit), the k keys >= it gathered and sorted by a
// bitonic network, written as logprob = (x - m) - logf(S) and id = ~low half. Rows with a
// NaN, a +inf or only -inf get status KDT_ERR_VALUE, NaN log-probs and ids 0 .. k-1.
//
// Nothing here synchronises the host or allocates; the only host work is argument checks
// and two launches, so a call can be captured in a CUDA graph.
#include "common.cuh"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

namespace {

constexpr int kThreads = 256;              // threads per block in both kernels = radix bins
constexpr int kWarps = kThreads / 32;
constexpr int kWords = 32;                 // 32-bit words of logits per thread (8 x 16 bytes)
constexpr int kVecWords = 4;               // words per 16-byte load
constexpr int64_t kMinChunk = (int64_t)kThreads * kWords;  // elements per chunk, float32
constexpr int kMaxVecElems = 8;            // elements per 16-byte load, 16-bit dtypes
constexpr int kFastMaxK = kThreads / 2;    // k up to this: groups are whole threads
constexpr int kGroups = 16;                // larger k: 16 groups per thread
constexpr int kCandCap = 4096;             // keys in the candidate buffer
constexpr int kStageCap = 4096;            // finish kernel: keys staged in shared memory up to this
constexpr int kHist32Words = 256 * 32;     // the per-lane histogram: 256 bins x 32 lanes
constexpr int64_t kMaxK = 1024;
constexpr float kLog2e = 1.44269504088896340736f;
constexpr uint32_t kNegInfKey = 0x007FFFFFu;  // float_order_key(-INFINITY)
constexpr uint32_t kFlagNaN = 1u, kFlagPosInf = 2u, kFlagFinite = 4u;  // kFlagFinite: the row kernel only

// Finish kernel: blocks per SM to fit (registers <= 32 at 8), within the SM's thread limit:
// 2048 on sm_80/90/100/103, 1536 on sm_86/87/89/120/121, at least 1024 elsewhere.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || \
                               __CUDA_ARCH__ == 1030)
#define KDT_TOPK_FINISH_BLOCKS 8
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || \
                                 __CUDA_ARCH__ == 1200 || __CUDA_ARCH__ == 1210)
#define KDT_TOPK_FINISH_BLOCKS 6
#else
#define KDT_TOPK_FINISH_BLOCKS 4
#endif

static_assert(kThreads == 256, "block_select uses one histogram bin per thread");
static_assert(kWords % kVecWords == 0 && kWords % kGroups == 0, "tile shape");
static_assert(kStageCap * 8 >= kHist32Words * 4, "the finish kernel's dynamic buffer holds the histogram");
static_assert(kCandCap * 8 == kThreads * kWords * 4 && kHist32Words == kThreads * kWords, "one 32 KB buffer");

// Per (row, chunk) statistics written by the chunk kernel.
struct ChunkStats {
    float max;      // max of the chunk's logits (-inf when empty or all -inf)
    float sum;      // sum of exp(x - max) over the chunk, 0 when max is -inf
    uint32_t flags; // kFlagNaN | kFlagPosInf
    uint32_t unused;
};
static_assert(sizeof(ChunkStats) == 16, "16-byte records");

__host__ __device__ inline size_t align256(size_t x) { return (x + 255u) / 256u * 256u; }

// Workspace: ChunkStats [rows, chunks], then keys uint64 [rows, chunks, k], each 256-byte
// aligned; chunks = ceil((vocab + 7) / kMinChunk) covers every dtype's chunking (float32
// has the smallest chunks, 16-bit types the most slack at the start of a row).
struct Layout {
    int64_t chunks;
    size_t keys, total;
};

bool layout_for(int64_t rows, int64_t vocab, int64_t k, Layout* l) {
    l->chunks = 0;
    l->keys = 0;
    l->total = 0;
    if (rows == 0) return true;
    l->chunks = (vocab + kMaxVecElems - 1 + kMinChunk - 1) / kMinChunk;
    size_t cells, stats, keys;
    if (!kdt_mul_size((size_t)rows, (size_t)l->chunks, &cells) || !kdt_mul_size(cells, sizeof(ChunkStats), &stats) ||
        !kdt_mul_size(cells, (size_t)k, &keys) || !kdt_mul_size(keys, sizeof(uint64_t), &keys) ||
        stats > SIZE_MAX - 512 || keys > SIZE_MAX - 512 - align256(stats)) {
        return false;
    }
    l->keys = align256(stats);
    l->total = l->keys + align256(keys);
    return true;
}

// ---- Device helpers ---------------------------------------------------------------

// max that returns NaN when either input is NaN (so a thread's max flags its NaNs).
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return (isnan(a) || isnan(b)) ? __int_as_float(0x7FFFFFFF) : fmaxf(a, b);
#endif
}

// 2^y with the hardware approximation (max relative error 2 ulp; exp2f's core).
__device__ __forceinline__ float hw_exp2(float y) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    return r;
#else
    return exp2f(y);
#endif
}

// The dtypes, seen as 32-bit words of one (float32) or two (16-bit types, element 0 in
// the low half) elements.
template <int D>
struct Elem;

template <>
struct Elem<KDT_DTYPE_FLOAT32> {
    static constexpr int kPerWord = 1;
    static constexpr uint32_t kNegInfBits = 0xFF800000u;
    __device__ static __forceinline__ float get(uint32_t w, int) { return __uint_as_float(w); }
    __device__ static __forceinline__ uint32_t load_bits(const char* pa, uint32_t u) {
        return *reinterpret_cast<const uint32_t*>(pa + (size_t)u * 4u);
    }
    __device__ static __forceinline__ uint32_t word_max(uint32_t a, uint32_t b) {
        return __float_as_uint(fmax_nan(__uint_as_float(a), __uint_as_float(b)));
    }
};

template <>
struct Elem<KDT_DTYPE_BFLOAT16> {
    static constexpr int kPerWord = 2;
    static constexpr uint32_t kNegInfBits = 0xFF80u;
    __device__ static __forceinline__ float get(uint32_t w, int h) {
        return __uint_as_float(h ? (w & 0xFFFF0000u) : (w << 16));
    }
    __device__ static __forceinline__ uint32_t load_bits(const char* pa, uint32_t u) {
        return *reinterpret_cast<const uint16_t*>(pa + (size_t)u * 2u);
    }
    __device__ static __forceinline__ uint32_t word_max(uint32_t a, uint32_t b) {
        __nv_bfloat162 x, y;
        memcpy(&x, &a, 4);
        memcpy(&y, &b, 4);
        const __nv_bfloat162 r = __hmax2_nan(x, y);
        uint32_t out;
        memcpy(&out, &r, 4);
        return out;
    }
};

template <>
struct Elem<KDT_DTYPE_FLOAT16> {
    static constexpr int kPerWord = 2;
    static constexpr uint32_t kNegInfBits = 0xFC00u;
    __device__ static __forceinline__ float get(uint32_t w, int h) {
        return __half2float(__ushort_as_half((unsigned short)(h ? (w >> 16) : (w & 0xFFFFu))));
    }
    __device__ static __forceinline__ uint32_t load_bits(const char* pa, uint32_t u) {
        return *reinterpret_cast<const uint16_t*>(pa + (size_t)u * 2u);
    }
    __device__ static __forceinline__ uint32_t word_max(uint32_t a, uint32_t b) {
        __half2 x, y;
        memcpy(&x, &a, 4);
        memcpy(&y, &b, 4);
        const __half2 r = __hmax2_nan(x, y);
        uint32_t out;
        memcpy(&out, &r, 4);
        return out;
    }
};

// The max of a word's elements, NaN if either is NaN.
template <int D>
__device__ __forceinline__ float word_elems_max(uint32_t w) {
    using E = Elem<D>;
    if (E::kPerWord == 1) return E::get(w, 0);
    return fmax_nan(E::get(w, 0), E::get(w, 1));
}

// -0 and +0 are equal logits: both take +0's key, so that their tie goes to the lower id
// as everywhere else (the CPU top-k, the reference, the verify kernels).
__device__ __forceinline__ uint64_t element_key(float x, uint32_t id) {
    const uint32_t hi = isnan(x) ? 0u : kdt::float_order_key(x == 0.0f ? 0.0f : x);
    return ((uint64_t)hi << 32) | (uint64_t)(uint32_t)~id;
}

// Key of a group maximum for the threshold search: value only, NaN as -inf.
__device__ __forceinline__ uint64_t max_key(float v) {
    return (uint64_t)(isnan(v) ? kNegInfKey : kdt::float_order_key(v == 0.0f ? 0.0f : v)) << 32;
}

// The warp's max of m and OR of flags, stored by lane 0 in s.red_max[warp] and
// s.red_flags[warp] (the chunk and row kernels' first step of a block reduction).
template <class Smem>
__device__ __forceinline__ void store_warp_max_flags(Smem& s, float m, uint32_t flags) {
    for (int off = 16; off > 0; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        flags |= __shfl_xor_sync(0xFFFFFFFFu, flags, off);
    }
    if ((threadIdx.x & 31) == 0) {
        s.red_max[threadIdx.x >> 5] = m;
        s.red_flags[threadIdx.x >> 5] = flags;
    }
}

// The block's max and OR of flags from the W warps' entries that store_warp_max_flags
// left in s.red_max and s.red_flags (read after a barrier).
template <int W, class Smem>
__device__ __forceinline__ void load_block_max_flags(const Smem& s, float& mx, uint32_t& flags) {
    mx = s.red_max[0];
    flags = s.red_flags[0];
    for (int i = 1; i < W; i++) {
        mx = fmaxf(mx, s.red_max[i]);
        flags |= s.red_flags[i];
    }
}

struct SelectSmem {
    uint32_t hist[256];  // all zero between calls
    uint64_t red_or[kWarps], red_and[kWarps];
    uint32_t wsum[kWarps];
    uint32_t sel_digit, sel_above, sel_count;
};

// The k-th largest of the block's items (1 <= k <= number of items), as a threshold T:
// when the items are unique, exactly k of them are >= T; otherwise at least k are, and
// fewer than k are > T. With retain_max > k the walk may stop earlier, at the first digit
// whose boundary bin leaves at most retain_max items >= T (still at least k: a looser but
// cheaper cut). Every thread of the block must call it, with the same k and retain_max;
// for_each(f) calls f(key) on each of the calling thread's items (the same items on every
// call). kCopies = 1: one shared histogram; 32: one per lane (hist32, 256 x 32 words,
// zero on entry and left zero), so lanes of a warp never add to the same word.
// NT: the block's threads (256 or 128); each thread owns 256 / NT consecutive bins.
template <int kCopies, int NT = kThreads, class ForEach>
__device__ __forceinline__ uint64_t block_select(SelectSmem& s, uint32_t* hist32, uint32_t k, ForEach&& for_each,
                                                 uint32_t retain_max = 0) {
    static_assert(NT == 256 || NT == 128, "256 / NT bins per thread");
    static_assert(kCopies == 1 || NT == kThreads, "the per-lane histogram is for 256-thread blocks");
    constexpr int kBins = 256 / NT, kW = NT / 32;
    if (retain_max < k) retain_max = k;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint64_t o = 0, a = ~0ull;
    for_each([&](uint64_t key) {
        o |= key;
        a &= key;
    });
    for (int off = 16; off > 0; off >>= 1) {
        o |= __shfl_xor_sync(0xFFFFFFFFu, o, off);
        a &= __shfl_xor_sync(0xFFFFFFFFu, a, off);
    }
    __syncthreads();  // earlier readers of red_* and sel_* are done
    if (lane == 0) {
        s.red_or[warp] = o;
        s.red_and[warp] = a;
    }
    __syncthreads();
    o = 0;
    a = ~0ull;
    for (int w = 0; w < kW; w++) {
        o |= s.red_or[w];
        a &= s.red_and[w];
    }
    // Bits every item shares are decided already; the rest are found 8 at a time.
    const uint64_t diff = o ^ a;
    uint64_t pmask = ~diff, prefix = a & ~diff;
    uint32_t needed = k;
    for (int lo = 56; lo >= 0; lo -= 8) {
        const uint64_t wmask = 0xFFull << lo;
        if ((diff & wmask) == 0) continue;
        // Histogram of the matching items' digits; a thread adds runs of equal digits at
        // once (long runs: -inf tails, ties, one exponent).
        uint32_t run_d = 0, run_n = 0;
        auto add = [&](uint32_t d, uint32_t n) {
            if (kCopies == 1) {
                atomicAdd(&s.hist[d], n);
            } else {
                atomicAdd(&hist32[d * 32u + (uint32_t)lane], n);
            }
        };
        for_each([&](uint64_t key) {
            if ((key & pmask) == prefix) {
                const uint32_t d = (uint32_t)(key >> lo) & 0xFFu;
                if (d != run_d && run_n != 0) {
                    add(run_d, run_n);
                    run_n = 0;
                }
                run_d = d;
                run_n++;
            }
        });
        if (run_n != 0) add(run_d, run_n);
        __syncthreads();
        // Thread t owns digits 255 - (t kBins + i), i < kBins: scanning in thread order
        // counts from the top.
        uint32_t cb[kBins], c = 0;
#pragma unroll
        for (int i = 0; i < kBins; i++) {
            const uint32_t bin = 255u - (uint32_t)(tid * kBins + i);
            if (kCopies == 1) {
                cb[i] = s.hist[bin];
                s.hist[bin] = 0;
            } else {
                cb[i] = 0;
#pragma unroll 8
                for (int j = 0; j < 32; j++) {
                    uint32_t* h = &hist32[bin * 32u + (uint32_t)((j + lane) & 31)];  // bank (j + lane) % 32
                    cb[i] += *h;
                    *h = 0;
                }
            }
            c += cb[i];
        }
        uint32_t incl = c;
        for (int off = 1; off < 32; off <<= 1) {
            const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, off);
            if (lane >= off) incl += v;
        }
        if (lane == 31) s.wsum[warp] = incl;
        __syncthreads();
        uint32_t above = incl - c;  // matching items with a larger digit
        for (int w = 0; w < warp; w++) above += s.wsum[w];
#pragma unroll
        for (int i = 0; i < kBins; i++) {
            if (cb[i] > 0 && above < needed && needed <= above + cb[i]) {
                s.sel_digit = 255u - (uint32_t)(tid * kBins + i);
                s.sel_above = above;
                s.sel_count = cb[i];
            }
            above += cb[i];
        }
        __syncthreads();
        needed -= s.sel_above;
        prefix |= (uint64_t)s.sel_digit << lo;
        pmask |= wmask;
        // Every matching item is taken (always so once the bin holds exactly the keys still
        // needed): T = prefix, with k - needed + sel_count items >= T.
        if (k - needed + s.sel_count <= retain_max) break;
    }
    return prefix;
}

// The 16-byte vector v of a row read in the frame of the 16-byte boundary pa (column u is
// frame position u + a), with -inf for the positions outside the row [0, V) and past the
// frame's nvec vectors: one 16-byte load when the vector lies inside the row, else one
// load per element.
template <int D>
__device__ __forceinline__ uint4 load_vector_checked(const char* pa, uint32_t v, uint32_t nvec, uint32_t a,
                                                    uint32_t V) {
    using E = Elem<D>;
    constexpr int kPer = E::kPerWord, kVec = kVecWords * kPer;
    const int64_t id0 = (int64_t)v * kVec - (int64_t)a;
    if (v < nvec && id0 >= 0 && id0 + kVec <= (int64_t)V) {
        return __ldcs(reinterpret_cast<const uint4*>(pa + (size_t)v * 16u));
    }
    uint32_t w[kVecWords];
#pragma unroll
    for (int q = 0; q < kVecWords; q++) {
        uint32_t word = 0;
#pragma unroll
        for (int h = 0; h < kPer; h++) {
            const int64_t id = id0 + q * kPer + h;
            const uint32_t bits = (v < nvec && id >= 0 && id < (int64_t)V)
                                      ? E::load_bits(pa, v * kVec + (uint32_t)(q * kPer + h))
                                      : E::kNegInfBits;
            word |= bits << (16 * h);
        }
        w[q] = word;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- Chunk kernel -----------------------------------------------------------------

struct ChunkParams {
    const char* data;        // logits->data
    int64_t batch_stride;    // elements
    int64_t row_stride;      // elements
    int64_t length;          // L (>= 1)
    int64_t rows;            // B * L
    int64_t vocab;           // V
    int64_t chunks;          // chunks per row for this dtype
    int32_t k;
    uint64_t* keys;          // [rows, chunks, k]
    ChunkStats* stats;       // [rows, chunks]
};

struct ChunkSmem {
    SelectSmem sel;
    union __align__(16) {
        uint64_t cand[kCandCap];             // candidate keys
        uint32_t hist32[kHist32Words];       // per-lane histogram (k > kFastMaxK)
        uint32_t words[kThreads * kWords];   // the chunk, for the exact fallback
    } u;
    float red_max[kWarps];
    float red_sum[kWarps];
    uint32_t red_flags[kWarps];
    uint32_t cand_n, out_n;
};

__device__ __forceinline__ void zero_hist32(uint32_t* h) {
    uint4* h4 = reinterpret_cast<uint4*>(h);
    for (int i = threadIdx.x; i < kHist32Words / 4; i += kThreads) h4[i] = make_uint4(0u, 0u, 0u, 0u);
}

template <int D, int G>
__global__ void __launch_bounds__(kThreads, G == 1 ? 4 : 3) topk_chunk_kernel(ChunkParams p) {
    using E = Elem<D>;
    constexpr int kPer = E::kPerWord;
    constexpr int kVec = kVecWords * kPer;                 // elements per 16-byte load
    constexpr uint32_t kChunk = (uint32_t)(kThreads * kWords * kPer);
    constexpr int kEsize = 4 / kPer;
    constexpr int kGroupWords = kWords / G;
    __shared__ ChunkSmem s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    s.sel.hist[tid] = 0;  // ordered before any use by the first barrier below
    const uint32_t V = (uint32_t)p.vocab;
    const int64_t total = p.rows * p.chunks;
    for (int64_t blk = blockIdx.x; blk < total; blk += gridDim.x) {
        const int64_t row = blk / p.chunks;
        const uint32_t chunk = (uint32_t)(blk - row * p.chunks);
        const int64_t b = row / p.length, l = row - b * p.length;
        const char* rowp = p.data + (b * p.batch_stride + l * p.row_stride) * kEsize;
        // Frame: position u holds column u - a; pa is 16-byte aligned.
        const uint32_t a = (uint32_t)(((uintptr_t)rowp & 15u) / kEsize);
        const char* pa = rowp - (size_t)a * kEsize;
        const uint32_t cbase = chunk * kChunk;
        const int64_t lo_in = (int64_t)cbase > (int64_t)a ? (int64_t)cbase : (int64_t)a;
        const int64_t hi_end = (int64_t)cbase + kChunk < (int64_t)a + V ? (int64_t)cbase + kChunk : (int64_t)a + V;
        const int64_t n_in = hi_end > lo_in ? hi_end - lo_in : 0;  // columns in this chunk

        // Load: vector j of thread t is frame [cbase + (j * kThreads + t) * kVec, + kVec).
        uint32_t w[kWords];
#pragma unroll
        for (int j = 0; j < kWords / kVecWords; j++) {
            const uint32_t u0 = cbase + (uint32_t)(j * kThreads + tid) * kVec;
            const uint4 v = load_vector_checked<D>(pa, u0 / kVec, UINT32_MAX, a, V);  // every vector counts
            w[j * 4 + 0] = v.x;
            w[j * 4 + 1] = v.y;
            w[j * 4 + 2] = v.z;
            w[j * 4 + 3] = v.w;
        }
        // Calls fn(x, id) on every element of this thread; id wraps outside [0, V), where
        // x is -inf, and such keys sort below every column's key.
        auto each_in = [&](int q0, int q1, auto&& fn) {
#pragma unroll
            for (int q = q0; q < q1; q++) {
#pragma unroll
                for (int h = 0; h < kPer; h++) {
                    const int e = q * kPer + h, j = e / kVec, i = e % kVec;
                    const uint32_t id = cbase + (uint32_t)(j * kThreads + tid) * kVec + (uint32_t)i - a;
                    fn(E::get(w[q], h), id);
                }
            }
        };

        // Group maxima (NaN-propagating) and the thread's max.
        float gmax[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            uint32_t pm = w[g * kGroupWords];
#pragma unroll
            for (int q = 1; q < kGroupWords; q++) pm = E::word_max(pm, w[g * kGroupWords + q]);
            gmax[g] = word_elems_max<D>(pm);
        }
        float m = gmax[0];
#pragma unroll
        for (int g = 1; g < G; g++) m = fmax_nan(m, gmax[g]);

        // The thread's sum of exp(x - m) and flags.
        const bool finite = m > -INFINITY && m < INFINITY;  // false for NaN
        uint32_t flags = isnan(m) ? kFlagNaN : (m == INFINITY ? kFlagPosInf : 0u);
        float tsum = 0.0f;
        if (finite) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int q = 0; q < kWords; q++) {
#pragma unroll
                for (int h = 0; h < kPer; h++) {
                    const float x = E::get(w[q], h);
                    acc[(q * kPer + h) & 3] += hw_exp2(__fmul_rn(__fsub_rn(x, m), kLog2e));
                }
            }
            tsum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        // Later passes convert the words again instead of keeping 64 floats live.
#pragma unroll
        for (int q = 0; q < kWords; q++) asm volatile("" : "+r"(w[q]));

        // Chunk max, flags, then the sum rescaled to the chunk max.
        store_warp_max_flags(s, m, flags);
        if (tid == 0) {
            s.cand_n = 0;
            s.out_n = 0;
        }
        __syncthreads();
        float cmax;
        uint32_t cflags;
        load_block_max_flags<kWarps>(s, cmax, cflags);
        float term = finite ? tsum * expf(m - cmax) : 0.0f;
        for (int off = 16; off > 0; off >>= 1) term += __shfl_xor_sync(0xFFFFFFFFu, term, off);
        if (lane == 0) s.red_sum[warp] = term;
        __syncthreads();
        if (tid == 0) {
            float csum = 0.0f;
            for (int i = 0; i < kWarps; i++) csum += s.red_sum[i];
            ChunkStats st;
            st.max = cmax;
            st.sum = cmax > -INFINITY ? csum : 0.0f;
            st.flags = cflags;
            st.unused = 0;
            p.stats[blk] = st;
        }

        const int k = p.k;
        if (k > 0) {
            uint64_t* out = p.keys + (size_t)blk * (size_t)k;
            if (n_in <= k) {
                // Every column of the chunk is kept: slot = column - first column.
                const uint32_t first = (uint32_t)(lo_in - (int64_t)a);
                each_in(0, kWords, [&](float x, uint32_t id) {
                    if (id < V) out[id - first] = element_key(x, id);
                });
                for (int i = (int)n_in + tid; i < k; i += kThreads) out[i] = 0;
            } else {
                // A threshold t that at least k elements reach: the k-th largest group max.
                uint64_t tkey;
                if constexpr (G == 1) {
                    tkey = block_select<1>(s.sel, nullptr, (uint32_t)k, [&](auto&& f) { f(max_key(m)); });
                } else {
                    zero_hist32(s.u.hist32);
                    tkey = block_select<32>(s.sel, s.u.hist32, (uint32_t)k, [&](auto&& f) {
#pragma unroll
                        for (int g = 0; g < G; g++) f(max_key(gmax[g]));
                    });
                }
                // Candidates: every element >= t0 (NaN never). When t0 is -inf (fewer than k
                // groups hold a finite value: a short chunk, a masked row), every finite
                // element and the chunk's first k columns instead: the top k are the finite
                // ones, then -inf ones by increasing column.
                const uint32_t thi = (uint32_t)(tkey >> 32);
                const bool all_finite = thi <= kNegInfKey;
                const float t0 = all_finite ? -INFINITY : kdt::float_from_order_key(thi);
                const uint32_t first = (uint32_t)(lo_in - (int64_t)a);  // the chunk's first column
#pragma unroll
                for (int g = 0; g < G; g++) {
                    if (all_finite || gmax[g] >= t0) {
                        each_in(g * kGroupWords, (g + 1) * kGroupWords, [&](float x, uint32_t id) {
                            if (all_finite ? (x > -INFINITY || id - first < (uint32_t)k) : x >= t0) {
                                const uint32_t at = atomicAdd(&s.cand_n, 1u);
                                if (at < (uint32_t)kCandCap) s.u.cand[at] = element_key(x, id);
                            }
                        });
                    }
                }
                __syncthreads();
                const uint32_t n = s.cand_n;
                if (n >= (uint32_t)k && n <= (uint32_t)kCandCap) {
                    const uint64_t T = block_select<1>(s.sel, nullptr, (uint32_t)k, [&](auto&& f) {
                        for (uint32_t i = tid; i < n; i += kThreads) f(s.u.cand[i]);
                    });
                    for (uint32_t i = tid; i < n; i += kThreads) {
                        const uint64_t key = s.u.cand[i];
                        if (key >= T) {
                            const uint32_t at = atomicAdd(&s.out_n, 1u);
                            if (at < (uint32_t)k) out[at] = key;
                        }
                    }
                } else {
                    // Ties at t0 overflow the buffer (or a NaN hid candidates): an exact
                    // select over every element, read back from shared memory (each thread
                    // its own words, so no barrier is needed) to keep the registers free
                    // for the common path.
                    uint32_t* ws = s.u.words;
#pragma unroll
                    for (int q = 0; q < kWords; q++) ws[q * kThreads + tid] = w[q];
                    auto each_shared = [&](auto&& fn) {
#pragma unroll 2
                        for (int q = 0; q < kWords; q++) {
                            const uint32_t word = ws[q * kThreads + tid];
#pragma unroll
                            for (int h = 0; h < kPer; h++) {
                                const int e = q * kPer + h, j = e / kVec, i = e % kVec;
                                const uint32_t id = cbase + (uint32_t)(j * kThreads + tid) * kVec + (uint32_t)i - a;
                                fn(E::get(word, h), id);
                            }
                        }
                    };
                    const uint64_t T = block_select<1>(s.sel, nullptr, (uint32_t)k, [&](auto&& f) {
                        each_shared([&](float x, uint32_t id) { f(element_key(x, id)); });
                    });
                    each_shared([&](float x, uint32_t id) {
                        const uint64_t key = element_key(x, id);
                        if (key >= T) {
                            const uint32_t at = atomicAdd(&s.out_n, 1u);
                            if (at < (uint32_t)k) out[at] = key;
                        }
                    });
                }
            }
        }
        __syncthreads();  // the next chunk reuses the shared state
    }
}

// ---- Finish kernel ----------------------------------------------------------------

struct FinishParams {
    const uint64_t* keys;      // [rows, chunks, k]
    const ChunkStats* stats;   // [rows, chunks]
    int64_t rows;
    int64_t chunks;
    int64_t vocab;
    int32_t k;
    int32_t stage;             // 1: the row's keys fit the dynamic shared buffer
    float* out_logprobs;       // [rows, k]
    int32_t* out_ids;          // [rows, k]
    int32_t* row_status;       // [rows]
};

struct FinishSmem {
    SelectSmem sel;
    uint64_t sorted[kMaxK];
    float red_max[kWarps];
    float red_sum[kWarps];
    uint32_t red_flags[kWarps];
    uint32_t out_n;
};

// Sorts buf[0, n) descending (n a power of two) with a bitonic network.
__device__ __forceinline__ void bitonic_desc(uint64_t* buf, uint32_t n) {
    for (uint32_t size = 2; size <= n; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t i = threadIdx.x; i < n / 2; i += kThreads) {
                const uint32_t lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const uint64_t x = buf[lo], y = buf[hi];
                const bool desc = (lo & size) == 0;
                if (desc ? x < y : x > y) {
                    buf[lo] = y;
                    buf[hi] = x;
                }
            }
            __syncthreads();
        }
    }
}

__global__ void __launch_bounds__(kThreads, KDT_TOPK_FINISH_BLOCKS) topk_finish_kernel(FinishParams p) {
    __shared__ FinishSmem s;
    extern __shared__ __align__(16) uint64_t dyn[];  // staged keys, or the per-lane histogram
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    s.sel.hist[tid] = 0;
    const int k = p.k;
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const ChunkStats* st = p.stats + row * p.chunks;
        float m = -INFINITY;
        uint32_t flags = 0;
        for (int64_t c = tid; c < p.chunks; c += kThreads) {
            m = fmaxf(m, st[c].max);
            flags |= st[c].flags;
        }
        for (int off = 16; off > 0; off >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
            flags |= __shfl_xor_sync(0xFFFFFFFFu, flags, off);
        }
        if (lane == 0) {
            s.red_max[warp] = m;
            s.red_flags[warp] = flags;
        }
        if (tid == 0) s.out_n = 0;
        __syncthreads();
        float rmax = s.red_max[0];
        uint32_t rflags = s.red_flags[0];
        for (int i = 1; i < kWarps; i++) {
            rmax = fmaxf(rmax, s.red_max[i]);
            rflags |= s.red_flags[i];
        }
        const bool bad = rflags != 0 || !(rmax > -INFINITY);
        float sum = 0.0f;
        if (!bad) {
            for (int64_t c = tid; c < p.chunks; c += kThreads) {
                const float cm = st[c].max;
                if (cm > -INFINITY) sum += st[c].sum * expf(cm - rmax);
            }
        }
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
        if (lane == 0) s.red_sum[warp] = sum;
        __syncthreads();
        float rsum = 0.0f;
        for (int i = 0; i < kWarps; i++) rsum += s.red_sum[i];
        if (tid == 0) p.row_status[row] = bad ? KDT_ERR_VALUE : KDT_OK;

        if (k > 0) {
            float* lp = p.out_logprobs + row * k;
            int32_t* ids = p.out_ids + row * k;
            if (bad) {
                for (int i = tid; i < k; i += kThreads) {
                    lp[i] = __int_as_float(0x7FC00000);
                    ids[i] = i;
                }
            } else {
                const int64_t n = p.chunks * k;
                const uint64_t* keys = p.keys + row * n;
                uint64_t T;
                if (p.stage) {
                    for (int64_t i = tid; i < n; i += kThreads) dyn[i] = keys[i];
                    __syncthreads();
                    T = block_select<1>(s.sel, nullptr, (uint32_t)k, [&](auto&& f) {
                        for (int64_t i = tid; i < n; i += kThreads) f(dyn[i]);
                    });
                } else {
                    uint32_t* hist32 = reinterpret_cast<uint32_t*>(dyn);
                    zero_hist32(hist32);
                    T = block_select<32>(s.sel, hist32, (uint32_t)k, [&](auto&& f) {
                        for (int64_t i = tid; i < n; i += kThreads) f(keys[i]);
                    });
                }
                // Exactly k keys are >= T; gather them, pad to a power of two with 0.
                for (int64_t i = tid; i < n; i += kThreads) {
                    const uint64_t key = p.stage ? dyn[i] : keys[i];
                    if (key >= T) {
                        const uint32_t at = atomicAdd(&s.out_n, 1u);
                        if (at < (uint32_t)k) s.sorted[at] = key;
                    }
                }
                uint32_t pow2 = 1;
                while (pow2 < (uint32_t)k) pow2 <<= 1;
                for (uint32_t i = (uint32_t)k + tid; i < pow2; i += kThreads) s.sorted[i] = 0;
                __syncthreads();
                bitonic_desc(s.sorted, pow2);
                const float log_sum = logf(rsum);
                const uint32_t V = (uint32_t)p.vocab;
                for (int i = tid; i < k; i += kThreads) {
                    const uint64_t key = s.sorted[i];
                    const float x = kdt::float_from_order_key((uint32_t)(key >> 32));
                    uint32_t id = ~(uint32_t)key;
                    const bool broken = (key >> 32) < kNegInfKey || id >= V;  // cannot happen: a bug
                    if (broken) {
                        // The entry is marked unusable (NaN, id 0), as a bad row's are, so a
                        // tree built from it fails even where the status is not read.
                        p.row_status[row] = KDT_ERR_INTERNAL;
                        id = 0;
                    }
                    lp[i] = broken ? __int_as_float(0x7FC00000) : __fsub_rn(__fsub_rn(x, rmax), log_sum);
                    ids[i] = (int32_t)id;
                }
            }
        }
        __syncthreads();  // the next row reuses the shared state
    }
}

// ---- Row kernel (k <= kRowMaxK) ---------------------------------------------------
//
// One block of kRowThreads (128) threads per row, reading it once. The row is streamed in
// trips: in trip t thread tid holds the 16-byte vectors v = (t * 2 + j) * 128 + tid,
// j = 0, 1 (2,048 elements of a 16-bit dtype, 1,024 of float32, per trip), and the next
// trip's loads are issued before the current trip is processed, so every thread keeps
// loads in flight.
// Per thread: a running max m and a sum of 2^((x - m) log2 e) (rescaled when m grows,
// tested once per trip; a trip's terms are summed as a tree first, so the thread's chain
// is ~V / 2,048 trip sums long) and the NaN / +inf flags.
// The selection works on vectors, not elements. A vector's key is
//     (float_order_key(vector max) << 32) | ~(vector index)
// which orders the vectors as their largest elements' keys are ordered (the vectors are
// disjoint runs of columns, so between two vectors with the same max the lower index
// holds the lower column). So the row's k largest elements lie in its k largest vectors:
// an element outside them sits in a vector that k vectors beat, and each of those
// vectors' largest element beats it. The block keeps a buffer of vector keys in shared
// memory and a bound tau, valid at all times (at least k buffered keys are > tau, so a
// vector with a smaller key is not among the k largest); a thread appends the keys > tau
// of its trip's two vectors at once (one ballot a vector, one shared atomic a warp).
// tau starts from trip 0's thread maxima: each warp sorts its 32 maxima (a bitonic
// network over shuffles) and takes the ceil(k / 4)-th; the smallest of the 4 warps'
// values, t0, has at least k vectors >= it (ceil(k / 4) threads in each warp hold one).
// After trips 0, 4, 8, ... (kRowCheckEvery), when the buffer holds more than refine_at =
// max(3k, 192) keys, the block radix-selects a cut keeping between k and retain =
// k + max(k / 4, 8) keys (block_select with a retain bound), compacts the buffer and sets
// tau = cut - 1 (both constants measured on the H200 for element keys; docs/performance.md).
// A trip adds at most 256 keys and the buffer has room for kRowCheckEvery
// trips past refine_at, so it never overflows (a refine that finds more keys than it
// holds marks the row KDT_ERR_INTERNAL: a tripwire for the tests). At the row's end
// (finish_row) at most 128 buffered vectors are kept (a cut with retain 128 when more are
// buffered) and read again (16 bytes each); their elements whose value reaches the cut's
// (or tau's) value are the candidates, at least k of them, ranked by counting (a radix
// select to exactly k first when more than kRowRankMax tie), and the k largest written as
// the finish kernel does. No workspace is used.
constexpr int kRowMaxK = 128;
// Vectors per thread per trip. 4 measured ~1 us faster on the H200 but spills
// 40 bytes at the 64 registers that 8 blocks a SM allow.
constexpr int kRowU = 2;
// Trips between refine checks (a power of two): each check is a block barrier, and the
// buffer must hold the keys that many trips can add. On the H200 (two runs each)
// 1 / 2 / 4 gave 117.2 / 116.2 / 114.7 us; later 8 matched 4.
constexpr uint32_t kRowCheckEvery = 4;
static_assert((kRowCheckEvery & (kRowCheckEvery - 1)) == 0, "a power of two");
constexpr uint32_t kRowRankMax = 256;  // final candidates ranked by counting, without a select

// The row kernel's shape for NT threads a block. 128 threads (8 blocks per SM on sm_90)
// are used: on the H200 they beat 256 threads (4 blocks per SM) by ~6% (docs/performance.md):
// twice as many rows stream at once, so a block waiting at its per-trip
// barrier leaves more of the SM to the others, and the benchmark's 1,024 rows fit in one
// wave of 1,056 blocks.
constexpr int kRowThreads = 128;
template <int NT>
struct RowShape {
    static_assert(NT == 128, "the sizes below are for 128 threads");
    static constexpr int kWarps = NT / 32;
    static constexpr int kMinBlocks = 8;
    static constexpr int kTripVecs = NT * kRowU;           // vectors (keys) per trip
    static constexpr int kRefineMax = 3 * kRowMaxK;       // the largest refine_at
    static constexpr int kCap = kRefineMax + kTripVecs * kRowCheckEvery;  // buffered keys
    static_assert(kRowMaxK <= kWarps * 32, "t0 needs ceil(k / warps) <= 32 lanes per warp");
    static_assert(kRowMaxK <= NT, "the final step reads one vector a thread");
    static_assert(kRefineMax > kRowMaxK + kRowMaxK / 4, "a refine keeps at most retain keys and must free room");
    static_assert(kCap - kTripVecs * (int)kRowCheckEvery >= kRefineMax,
                  "the trips between two checks fit above refine_at (row_refine_at is at most kRefineMax)");
};

struct RowParams {
    const char* data;        // logits->data
    int64_t batch_stride;    // elements
    int64_t row_stride;      // elements
    int64_t length;          // L (>= 1)
    int64_t rows;            // B * L
    int64_t batch;           // B (>= 1)
    int64_t vocab;           // V
    int32_t k;               // 0 .. kRowMaxK
    float* out_logprobs;     // [rows, k]
    int32_t* out_ids;        // [rows, k]
    int32_t* row_status;     // [rows]
    uint32_t refine_at;      // buffered keys above which a refine runs (row_refine_at)
    uint32_t retain;         // a refine keeps k .. retain keys (row_retain)
};

template <int NT>
struct RowSmem {
    SelectSmem sel;
    union {
        uint64_t buf[RowShape<NT>::kCap];  // candidate vector keys
        uint64_t ekeys[kRowMaxK * 8];      // finish_row: the chosen vectors' candidate element keys
    };
    union {
        uint64_t kept[kRowMaxK + kRowMaxK / 4];  // a refine's survivors (<= retain)
        uint32_t vsel[NT];             // finish_row: the chosen vectors' indices, then
        uint64_t sorted[kRowMaxK];     // the k largest element keys (no refine runs then)
    };
    float warp_t0[kWarps];
    float red_max[kWarps], red_sum[kWarps];
    uint32_t red_flags[kWarps];
    uint32_t count, kept_n, out_n, vsel_n, cand_n;
    uint32_t overflow;  // a refine found more keys than buf holds (a bug)
};
static_assert(sizeof(RowSmem<kRowThreads>) + 1024 <= 228 * 1024 / 8,
              "8 blocks a SM on sm_90 / sm_100 (228 KB of shared memory, 1 KB reserved a block)");

// atomicAdd on shared memory as one instruction: the compiler wraps atomicAdd in its own
// warp aggregation even when one lane calls it.
__device__ __forceinline__ uint32_t shared_add(uint32_t* p, uint32_t v) {
    uint32_t r;
    asm volatile("atom.shared.add.u32 %0, [%1], %2;"
                 : "=r"(r)
                 : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(v)
                 : "memory");
    return r;
}

// The row kernel's next row (b, l) in a grid of (x: positions, y: requests) blocks.
__device__ __forceinline__ void next_row(int64_t& b, int64_t& l, int64_t length) {
    l += gridDim.x;
    if (l >= length) {
        l = blockIdx.x;
        b += gridDim.y;
    }
}

// The j-th largest (1 <= j <= 32) of the warp's values x (NaN as -inf), on every lane.
__device__ __forceinline__ float warp_jth_largest(float x, int j) {
    const int lane = threadIdx.x & 31;
    if (isnan(x)) x = -INFINITY;
    // Bitonic sort, descending by lane.
    for (int size = 2; size <= 32; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const float y = __shfl_xor_sync(0xFFFFFFFFu, x, stride);
            const bool lower = (lane & stride) == 0, desc = (lane & size) == 0 || size == 32;
            x = (lower == desc) ? fmaxf(x, y) : fminf(x, y);
        }
    }
    return __shfl_sync(0xFFFFFFFFu, x, j - 1);
}

// The sum of n (a power of two) floats as a balanced tree: log2 n dependent adds.
template <int n>
__device__ __forceinline__ float tree_sum(const float* x) {
    if constexpr (n == 1) {
        return x[0];
    } else {
        return tree_sum<n / 2>(x) + tree_sum<n / 2>(x + n / 2);
    }
}

// A trip's U vectors (w[j]: vector j's four 32-bit words) into a thread's running
// statistics: mx (NaN-propagating max, for the flags), m (the max of the finite part,
// starting at -FLT_MAX) and sum, the sum of 2^(x log2 e - c) with c = m log2 e rounded to
// float (one fma per logit; the rounding of c scales every term of the thread alike and
// cancels when the threads' sums are combined with the same c, see finish_row). One max
// test, one rescale (when the trip's largest non-NaN vector max exceeds m) and one c per
// trip, so the trip's U * kVec terms are independent of each other (one tree sum).
// vmax[j]: vector j's max (NaN if it holds a NaN).
template <int D, int U>
__device__ __forceinline__ void accumulate_trip(const uint32_t (&w)[U][kVecWords], float& m, float& sum, float& mx,
                                                float (&vmax)[U]) {
    using E = Elem<D>;
    constexpr int kPer = E::kPerWord, kVec = kVecWords * kPer;
    float tm = -INFINITY;
#pragma unroll
    for (int j = 0; j < U; j++) {
        const uint32_t pm = E::word_max(E::word_max(w[j][0], w[j][1]), E::word_max(w[j][2], w[j][3]));
        vmax[j] = word_elems_max<D>(pm);
        mx = fmax_nan(mx, vmax[j]);
        tm = fmaxf(tm, vmax[j]);
    }
    // Without a branch (a warp's lanes rarely agree): the factor is exactly 1 unless m grows.
    const float m_new = fmaxf(m, tm);
    const float c_old = m == -FLT_MAX ? -FLT_MAX : __fmul_rn(m, kLog2e);
    const float c = m_new == -FLT_MAX ? -FLT_MAX : __fmul_rn(m_new, kLog2e);
    sum *= m_new > m ? hw_exp2(__fsub_rn(c_old, c)) : 1.0f;
    m = m_new;
    float e[U * kVec];
#pragma unroll
    for (int j = 0; j < U; j++) {
#pragma unroll
        for (int q = 0; q < kVec; q++) {
            e[j * kVec + q] = hw_exp2(__fmaf_rn(E::get(w[j][q / kPer], q % kPer), kLog2e, -c));
        }
    }
    sum += tree_sum<U * kVec>(e);
}

template <int D, int NT, class Smem>
__device__ void finish_row(Smem& s, const RowParams& p, int64_t row, const char* rowp, const char* pa,
                           uint32_t a, uint32_t nvec, uint64_t tau, float m, float sum, float mx);

template <int D, int NT>
__global__ void __launch_bounds__(NT, RowShape<NT>::kMinBlocks) topk_row_kernel(RowParams p) {
    using E = Elem<D>;
    using Shape = RowShape<NT>;
    constexpr int kPer = E::kPerWord;
    constexpr int kVec = kVecWords * kPer;                  // elements per 16-byte load
    constexpr int kEsize = 4 / kPer;
    constexpr int kW = Shape::kWarps;
    constexpr uint32_t kTrip = (uint32_t)(NT * kRowU);   // vectors per trip
    __shared__ RowSmem<NT> s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int i = 0; i < 256 / NT; i++) s.sel.hist[tid + i * NT] = 0;
    const uint32_t V = (uint32_t)p.vocab;
    const uint32_t k = (uint32_t)p.k;
    const uint32_t retain = p.retain;        // k .. kRowMaxK + kRowMaxK / 4 (kept)
    const uint32_t refine_at = p.refine_at;  // > retain, <= kRefineMax (kRowCheckEvery trips fit above it)
    // Rows (b, l) from a grid of (L, B) blocks (each at most the grid's limit; larger
    // shapes loop): no division, so the row's values stay in the uniform registers.
    for (int64_t b = blockIdx.y, l = blockIdx.x; b < p.batch; next_row(b, l, p.length)) {
        const int64_t row = b * p.length + l;
        const char* rowp = p.data + (b * p.batch_stride + l * p.row_stride) * kEsize;
        const uint32_t a = (uint32_t)(((uintptr_t)rowp & 15u) / kEsize);  // frame: position u is column u - a
        const char* pa = rowp - (size_t)a * kEsize;
        const uint32_t nvec = (a + V + kVec - 1) / kVec;
        const uint32_t trips = (nvec + kTrip - 1) / kTrip;
        // Vectors [v_lo, v_hi) lie wholly inside the row; trips made of them, the trips in
        // [in_lo, in_lo + in_n), load unchecked.
        const uint32_t v_lo = (a + kVec - 1) / kVec, v_hi = (a + V) / kVec;
        const uint32_t in_lo = (v_lo + kTrip - 1) / kTrip, in_hi = v_hi / kTrip;
        const uint32_t in_n = in_hi > in_lo ? in_hi - in_lo : 0u;
        __syncthreads();  // the previous row is done with the shared state
        // Reset after that barrier: the previous row's last step reads cand_n, and threads
        // leaving a bad or overflowed row read overflow, with no barrier after. The first
        // reads of this row's count and overflow come after trip 0's barrier (k > 0; with
        // k = 0 nothing is buffered and only thread 0 reads overflow).
        if (tid == 0) {
            s.count = 0;
            s.overflow = 0;
            s.out_n = 0;
            s.vsel_n = 0;
            s.cand_n = 0;
        }

        const uint4* row_vecs = reinterpret_cast<const uint4*>(pa) + tid;  // this thread's vector of trip 0
        auto load = [&](uint32_t trip, uint32_t (&w)[kRowU][kVecWords]) {
            if (trip - in_lo < in_n) {  // the whole trip is inside the row
                const uint4* q = row_vecs + trip * kTrip;
#pragma unroll
                for (int j = 0; j < kRowU; j++) {
                    const uint4 x = __ldcs(q + j * NT);
                    w[j][0] = x.x;
                    w[j][1] = x.y;
                    w[j][2] = x.z;
                    w[j][3] = x.w;
                }
                return;
            }
#pragma unroll
            for (int j = 0; j < kRowU; j++) {
                const uint4 x = load_vector_checked<D>(pa, trip * kTrip + (uint32_t)(j * NT + tid), nvec, a, V);
                w[j][0] = x.x;
                w[j][1] = x.y;
                w[j][2] = x.z;
                w[j][3] = x.w;
            }
        };

        // The running statistics (accumulate_trip). m starts at the lowest finite value,
        // not -inf, so that no term is -inf - -inf; mx (NaN-propagating) gives the flags and
        // whether any logit is finite.
        float m = -FLT_MAX, sum = 0.0f, mx = -INFINITY;
        uint64_t tau = k == 0 ? ~0ull : 0;  // k = 0: nothing is buffered
        float tv = -INFINITY;               // tau's value, rounded down
        auto set_tau = [&](uint64_t t_new) {
            tau = t_new;
            const uint32_t th = (uint32_t)(tau >> 32);  // the keys just below -inf's are NaN patterns
            tv = th <= kNegInfKey ? -INFINITY : kdt::float_from_order_key(th);
        };
        set_tau(tau);
        const uint32_t lt_mask = (1u << lane) - 1u;
        // A refine (see above): keeps between k and retain keys and raises tau. Whole block.
        auto refine = [&]() {
            const uint32_t n = s.count;
            if (tid == 0 && n > (uint32_t)Shape::kCap) s.overflow = 1;
            const uint64_t cut = block_select<1, NT>(
                s.sel, nullptr, k,
                [&](auto&& f) {
                    for (uint32_t i = (uint32_t)tid; i < n; i += NT) f(s.buf[i]);
                },
                retain);
            if (tid == 0) s.kept_n = 0;
            __syncthreads();
            for (uint32_t i = (uint32_t)tid; i < n; i += NT) {
                const uint64_t key = s.buf[i];
                if (key >= cut) s.kept[atomicAdd(&s.kept_n, 1u)] = key;
            }
            __syncthreads();
            const uint32_t kn = s.kept_n;  // k .. retain
            for (uint32_t i = (uint32_t)tid; i < kn; i += NT) s.buf[i] = s.kept[i];
            if (tid == 0) s.count = kn;
            set_tau(cut - 1);  // cut > 0: the buffer holds no NaN key (0)
            __syncthreads();
        };
        // first: std::true_type for trip 0 only (t0 is set there), so later trips do not test t.
        uint32_t last_acc = 0;  // the buffer's count after this warp's insertions since the last check
        auto trip_body = [&](auto first, uint32_t t, uint32_t (&cur)[kRowU][kVecWords],
                             uint32_t (&nxt)[kRowU][kVecWords]) {
            if (t + 1 < trips) load(t + 1, nxt);
            float vmax[kRowU];
            accumulate_trip<D, kRowU>(cur, m, sum, mx, vmax);
            if (decltype(first)::value && k > 0) {
                // t0 from the thread maxima of trip 0 (see above): tau = key(t0, index
                // 2^32 - 1) - 1, so every vector whose max is >= t0 passes.
                float tmax = vmax[0];
#pragma unroll
                for (int j = 1; j < kRowU; j++) tmax = fmax_nan(tmax, vmax[j]);
                const float wt = warp_jth_largest(tmax, (int)((k + kW - 1) / kW));
                if (lane == 0) s.warp_t0[warp] = wt;
                __syncthreads();
                float t0 = s.warp_t0[0];
                for (int i = 1; i < kW; i++) t0 = fminf(t0, s.warp_t0[i]);
                if (t0 == 0.0f) t0 = 0.0f;  // +0's key, which both zeros' keys equal (element_key)
                set_tau(((uint64_t)kdt::float_order_key(t0) << 32) - 1u);
            }
            // Vector j of this thread is v0 + j * NT; vectors past the frame hold no column.
            const uint32_t v0 = t * kTrip + (uint32_t)tid;
            bool want[kRowU], want_any = false;
#pragma unroll
            for (int j = 0; j < kRowU; j++) {
                want[j] = vmax[j] >= tv && v0 + (uint32_t)(j * NT) < nvec;  // false for NaN
                want_any |= want[j];
            }
            uint32_t last = 0;  // the buffer's count after this warp's insertion
            if (__any_sync(0xFFFFFFFFu, want_any)) {  // most trips insert nothing
                uint64_t key[kRowU];
                uint32_t ballot[kRowU], total = 0;
#pragma unroll
                for (int j = 0; j < kRowU; j++) {
                    const float x = vmax[j] == 0.0f ? 0.0f : vmax[j];  // -0: +0's key
                    key[j] = ((uint64_t)kdt::float_order_key(x) << 32) | (uint32_t)~(v0 + (uint32_t)(j * NT));
                    want[j] = want[j] && key[j] > tau;
                    ballot[j] = __ballot_sync(0xFFFFFFFFu, want[j]);
                    total += (uint32_t)__popc(ballot[j]);
                }
                uint32_t base = 0;
                if (lane == 0 && total != 0) base = shared_add(&s.count, total);
                base = __shfl_sync(0xFFFFFFFFu, base, 0);
#pragma unroll
                for (int j = 0; j < kRowU; j++) {
                    if (want[j]) s.buf[base + (uint32_t)__popc(ballot[j] & lt_mask)] = key[j];
                    base += (uint32_t)__popc(ballot[j]);
                }
                if (total != 0) last = base;
            }
            // Every kRowCheckEvery trips: the largest `last` of the block is the buffer's
            // count (or nobody inserted and the count is what it was, <= refine_at).
            last_acc = max(last_acc, last);
            if ((t & (kRowCheckEvery - 1)) == 0) {
                if (__syncthreads_or(last_acc > refine_at)) refine();
                last_acc = 0;
            }
        };
        uint32_t wa[kRowU][kVecWords], wb[kRowU][kVecWords];
        load(0, wa);
        trip_body(std::true_type(), 0, wa, wb);  // trip 0 sets t0
        for (uint32_t t = 1; t < trips; t += 2) {
            trip_body(std::false_type(), t, wb, wa);
            if (t + 1 < trips) trip_body(std::false_type(), t + 1, wa, wb);
        }

        finish_row<D, NT>(s, p, row, rowp, pa, a, nvec, tau, m, sum, mx);
    }
}

// The end of a row, for every thread of the block (after a barrier): the row's max, flags
// and log-sum-exp from the threads' statistics (m, sum, mx: accumulate_trip), its status,
// and for k > 0 the row's k largest elements, sorted, as log-probs and ids: they lie in the
// k largest of the s.count buffered vector keys (see the kernel's comment), whose vectors
// are read again from the row's frame (pa, a, nvec as in the kernel). Smem is the
// kernel's shared state (sel, buf, vsel, sorted, red_*, count, out_n, vsel_n, overflow).
template <int D, int NT, class Smem>
__device__ void finish_row(Smem& s, const RowParams& p, int64_t row, const char* rowp, const char* pa,
                           uint32_t a, uint32_t nvec, uint64_t tau, float m, float sum, float mx) {
    using E = Elem<D>;
    constexpr int kPer = E::kPerWord, kVec = kVecWords * kPer;
    constexpr int kW = NT / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t V = (uint32_t)p.vocab;
    const uint32_t k = (uint32_t)p.k;
    // The row's max, flags and sum rescaled to the max.
    store_warp_max_flags(s, m, isnan(mx) ? kFlagNaN : mx == INFINITY ? kFlagPosInf : mx > -INFINITY ? kFlagFinite : 0u);
    __syncthreads();
    float rmax;
    uint32_t rflags;
    load_block_max_flags<kW>(s, rmax, rflags);
    const bool bad = (rflags & (kFlagNaN | kFlagPosInf)) != 0 || (rflags & kFlagFinite) == 0;
    // S = sum over threads of sum * 2^(c - c_max) = sum over the row of 2^(x log2e_f -
    // c_max), c_max = rmax log2e_f rounded to float as the threads rounded it (log2e_f:
    // kLog2e, the float32 log2 e). So S = 2^-delta sum exp(x - rmax) with delta = c_max -
    // rmax log2e_f (2^(y log2e_f) is e^y within 1.3e-8 |y|, nothing for the terms that
    // count), and log sum exp(x - rmax) = log S + delta ln 2. delta comes from one fma, the
    // same rounding as a tie's term 2^(fma(rmax, log2e_f, -c_max)), so ties cancel exactly.
    // (c_max ln 2 - rmax instead of delta ln 2 is off by (log2e_f ln 2 - 1) rmax = -1.3e-8
    // rmax: 0.013 at 1e6.)
    const float c_max = __fmul_rn(rmax, kLog2e);
    float term = bad ? 0.0f : sum * exp2f((m == -FLT_MAX ? -FLT_MAX : __fmul_rn(m, kLog2e)) - c_max);
    for (int off = 16; off > 0; off >>= 1) term += __shfl_xor_sync(0xFFFFFFFFu, term, off);
    if (lane == 0) s.red_sum[warp] = term;
    __syncthreads();
    float rsum = 0.0f;
    for (int i = 0; i < kW; i++) rsum += s.red_sum[i];
    const float delta = __fmaf_rn(-rmax, kLog2e, c_max);
    float log_sum = logf(rsum) + __fmul_rn(delta, 0.69314718055994530942f);
    if (!bad && !(rsum > 0.0f && rsum < INFINITY && fabsf(delta) <= 4.0f)) {
        // c overflowed (|rmax| > FLT_MAX / log2 e), or c's rounding is coarse (|delta| > 4,
        // possible from |c_max| >= 2^27, |rmax| >= 9.3e7), where log S and delta ln 2 would
        // cancel in float and the threads' terms (each thread rounds its own c) could
        // leave float's range. Read the row again with x - rmax.
        float s2 = 0.0f;
        for (uint32_t id = (uint32_t)tid; id < V; id += NT) {
            s2 += hw_exp2(__fmul_rn(__fsub_rn(kdt::load_logit<D>(rowp, id), rmax), kLog2e));
        }
        for (int off = 16; off > 0; off >>= 1) s2 += __shfl_xor_sync(0xFFFFFFFFu, s2, off);
        __syncthreads();  // every thread has read red_sum
        if (lane == 0) s.red_sum[warp] = s2;
        __syncthreads();
        rsum = 0.0f;
        for (int i = 0; i < kW; i++) rsum += s.red_sum[i];
        log_sum = logf(rsum);
    }
    if (tid == 0) p.row_status[row] = s.overflow ? KDT_ERR_INTERNAL : bad ? KDT_ERR_VALUE : KDT_OK;
    if (k == 0) return;
    float* lp = p.out_logprobs + row * (int64_t)k;
    int32_t* ids = p.out_ids + row * (int64_t)k;
    if (bad || s.overflow) {  // (an overflow is a bug's tripwire: the selection may be wrong)
        for (int i = tid; i < (int)k; i += NT) {
            lp[i] = __int_as_float(0x7FC00000);
            ids[i] = i;
        }
        return;
    }
    // The buffered vector keys are all > tau and hold the k largest (every vector with a
    // larger key is there; when fewer than k are buffered tau never rose, so every vector of
    // the row is there; a NaN, which no vector key holds, made the row bad above). At most
    // NT of them are read again, one a thread: all when they fit, else the k .. NT keys
    // >= a cut (block_select's retain bound), which again hold the k largest.
    const uint32_t n = s.count;
    uint64_t bound = tau + 1;  // every chosen vector key is >= bound, and at least k are
    if (n > (uint32_t)NT) {
        bound = block_select<1, NT>(
            s.sel, nullptr, k,
            [&](auto&& f) {
                for (uint32_t i = (uint32_t)tid; i < n; i += NT) f(s.buf[i]);
            },
            (uint32_t)NT);
        for (uint32_t i = (uint32_t)tid; i < n; i += NT) {
            const uint64_t key = s.buf[i];
            if (key >= bound) {
                const uint32_t at = atomicAdd(&s.vsel_n, 1u);
                if (at < (uint32_t)NT) s.vsel[at] = ~(uint32_t)key;
            }
        }
        __syncthreads();
    }
    const uint32_t nv = n > (uint32_t)NT ? min(s.vsel_n, (uint32_t)NT) : n;
    const bool has = (uint32_t)tid < nv;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    uint32_t v = 0;
    if (has) {
        v = n > (uint32_t)NT ? s.vsel[tid] : ~(uint32_t)s.buf[tid];
        x = load_vector_checked<D>(pa, v, nvec, a, V);
    }
    // Candidates: the chosen vectors' elements whose value reaches the bound's (at least k
    // do: the largest element of each of the >= k vectors at or above it), which hold the
    // row's k largest. They go to ekeys, which shares buf's storage.
    __syncthreads();  // every thread has read buf and vsel
    const uint64_t lo = bound >> 32 << 32;
    if (has) {
        const uint32_t w[kVecWords] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int q = 0; q < kVec; q++) {
            const uint32_t id = v * kVec + (uint32_t)q - a;  // wraps below column 0
            if ((uint64_t)v * kVec + (uint32_t)q >= a && id < V) {
                const uint64_t key = element_key(E::get(w[q / kPer], q % kPer), id);
                if (key >= lo) s.ekeys[atomicAdd(&s.cand_n, 1u)] = key;
            }
        }
    }
    __syncthreads();
    // Up to kRankMax candidates are ranked directly; more (ties, -inf runs) are first cut to
    // exactly the k largest (keys are unique, so T leaves exactly k keys >= T).
    uint32_t c = s.cand_n;
    const uint64_t* list = s.ekeys;
    if (c > kRowRankMax) {
        const uint64_t T = block_select<1, NT>(s.sel, nullptr, k, [&](auto&& f) {
            for (uint32_t i = (uint32_t)tid; i < c; i += NT) f(s.ekeys[i]);
        });
        for (uint32_t i = (uint32_t)tid; i < c; i += NT) {
            const uint64_t key = s.ekeys[i];
            if (key >= T) {
                const uint32_t at = atomicAdd(&s.out_n, 1u);
                if (at < k) s.sorted[at] = key;
            }
        }
        __syncthreads();
        c = k;
        list = s.sorted;
    }
    // c >= k different keys: each one's rank is the number of larger ones; ranks below k
    // are written.
    for (uint32_t i = (uint32_t)tid; i < c; i += NT) {
        const uint64_t key = list[i];
        uint32_t rank = 0;
        for (uint32_t j = 0; j < c; j++) rank += list[j] > key ? 1u : 0u;
        if (rank >= k) continue;
        const float xv = kdt::float_from_order_key((uint32_t)(key >> 32));
        uint32_t id = ~(uint32_t)key;
        const bool broken = (key >> 32) < kNegInfKey || id >= V;  // cannot happen: a bug
        if (broken) {  // (NaN and id 0, as in the finish kernel)
            p.row_status[row] = KDT_ERR_INTERNAL;
            id = 0;
        }
        lp[rank] = broken ? __int_as_float(0x7FC00000) : __fsub_rn(__fsub_rn(xv, rmax), log_sum);
        ids[rank] = (int32_t)id;
    }
}

// The row kernel's refine threshold: max(3k, 192) buffered keys, at most kRefineMax, so the
// keys of the kRowCheckEvery trips between two checks always fit behind it (constants
// measured on the H200).
uint32_t row_refine_at(int64_t k) {
    const int64_t r = 3 * k > 192 ? 3 * k : 192;
    return (uint32_t)(r < RowShape<kRowThreads>::kRefineMax ? r : RowShape<kRowThreads>::kRefineMax);
}

// What a refine keeps: k .. k + max(k / 4, 8) keys (at most kRowMaxK + kRowMaxK / 4, the
// size of RowSmem::kept; measured on the H200).
uint32_t row_retain(int64_t k) { return (uint32_t)(k + (k / 4 > 8 ? k / 4 : 8)); }

template <int D>
void launch_rows(const RowParams& p, cudaStream_t stream) {
    const dim3 grid((unsigned)(p.length < (int64_t)INT32_MAX ? p.length : (int64_t)INT32_MAX),
                    (unsigned)(p.batch < 65535 ? p.batch : 65535));
    // 8 blocks of ~14 KB a SM want a large shared-memory carveout: a hint, set once
    // (a failure only costs occupancy, and its error is cleared).
    static const bool carved = cudaFuncSetAttribute(topk_row_kernel<D, kRowThreads>,
                                                    cudaFuncAttributePreferredSharedMemoryCarveout,
                                                    (int)cudaSharedmemCarveoutMaxShared) == cudaSuccess ||
                               (cudaGetLastError(), false);
    (void)carved;
    topk_row_kernel<D, kRowThreads><<<grid, kRowThreads, 0, stream>>>(p);
}

template <int D>
void launch_chunks(const ChunkParams& p, int64_t k, cudaStream_t stream) {
    const int64_t blocks = p.rows * p.chunks;
    const unsigned grid = (unsigned)(blocks < (int64_t)INT32_MAX ? blocks : (int64_t)INT32_MAX);
    if (k <= kFastMaxK) {
        topk_chunk_kernel<D, 1><<<grid, kThreads, 0, stream>>>(p);
    } else {
        topk_chunk_kernel<D, kGroups><<<grid, kThreads, 0, stream>>>(p);
    }
}

}  // namespace

extern "C" kdt_status kdt_topk_logprobs_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    if (rows < 0 || vocab < 0 || k < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "rows (%lld), vocab (%lld) and k (%lld) must be >= 0",
                        (long long)rows, (long long)vocab, (long long)k);
    }
    if (k > kMaxK) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds %lld", (long long)k, (long long)kMaxK);
    if (k > vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds vocab (%lld)", (long long)k, (long long)vocab);
    }
    if (rows > 0 && vocab > INT32_MAX) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab %lld exceeds %d", (long long)vocab, INT32_MAX);
    }
    Layout l;
    if (!layout_for(rows, vocab, k, &l)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace for %lld rows of %lld logits, k %lld overflows", (long long)rows,
                        (long long)vocab, (long long)k);
    }
    *bytes = l.total;
    return kdt_ok();
}

extern "C" kdt_status kdt_topk_logprobs_cuda(const kdt_logits* logits, int64_t k, float* out_logprobs, int32_t* out_ids,
                                             int32_t* row_status, void* workspace, size_t workspace_bytes,
                                             void* stream) {
    kdt_status st = kdt::check_logits(logits, "logits", -1, -1);
    if (st != KDT_OK) return st;
    if (k < 0 || k > kMaxK) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) is outside [0, %lld]", (long long)k, (long long)kMaxK);
    }
    const int64_t B = logits->batch, L = logits->length, V = logits->vocab;
    if (B == 0 || L == 0) return kdt_ok();
    if (B > INT64_MAX / L) return kdt_fail(KDT_ERR_OVERFLOW, "logits: batch * length overflows");
    const int64_t rows = B * L;
    if (k > V) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds logits->vocab (%lld)", (long long)k, (long long)V);
    if (row_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "row_status is NULL");
    if (k > 0 && (out_logprobs == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", out_logprobs == NULL ? "out_logprobs" : "out_ids");
    }
    if (((uintptr_t)out_logprobs | (uintptr_t)out_ids | (uintptr_t)row_status) & 3u) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s is not 4-byte aligned",
                        ((uintptr_t)row_status & 3u) ? "row_status"
                        : ((uintptr_t)out_ids & 3u)  ? "out_ids"
                                                     : "out_logprobs");
    }
    Layout l;
    if (!layout_for(rows, V, k, &l)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace for %lld rows of %lld logits, k %lld overflows", (long long)rows,
                        (long long)V, (long long)k);
    }
    if (workspace == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "workspace is NULL (%zu bytes needed)", l.total);
    }
    if (workspace_bytes < l.total) {
        return kdt_fail(KDT_ERR_BUFFER_TOO_SMALL, "workspace has %zu bytes, %zu needed", workspace_bytes, l.total);
    }
    if (((uintptr_t)workspace & 255u) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
    }

    cudaStream_t s = kdt::as_stream(stream);
    const bool force_chunked = kdt::testing_topk_chunked();  // tests of the k > 128 path (native/kdt_testing.h)
    if (k <= kRowMaxK && !force_chunked) {
        RowParams rp;
        rp.data = static_cast<const char*>(logits->data);
        rp.batch_stride = logits->batch_stride;
        rp.row_stride = logits->row_stride;
        rp.length = L;
        rp.rows = rows;
        rp.batch = B;
        rp.vocab = V;
        rp.k = (int32_t)k;
        rp.out_logprobs = out_logprobs;
        rp.out_ids = out_ids;
        rp.row_status = row_status;
        rp.refine_at = row_refine_at(k);
        rp.retain = row_retain(k);
        switch (logits->dtype) {
            case KDT_DTYPE_FLOAT32: launch_rows<KDT_DTYPE_FLOAT32>(rp, s); break;
            case KDT_DTYPE_FLOAT16: launch_rows<KDT_DTYPE_FLOAT16>(rp, s); break;
            default: launch_rows<KDT_DTYPE_BFLOAT16>(rp, s); break;
        }
        return kdt::launch_status("top-k row kernel");
    }

    const size_t esize = kdt::float_dtype_size(logits->dtype);
    const int64_t vec = (int64_t)(16 / esize);
    const int64_t chunk = kMinChunk * (int64_t)(4 / esize);
    ChunkParams cp;
    cp.data = static_cast<const char*>(logits->data);
    cp.batch_stride = logits->batch_stride;
    cp.row_stride = logits->row_stride;
    cp.length = L;
    cp.rows = rows;
    cp.vocab = V;
    cp.chunks = (V + vec - 1 + chunk - 1) / chunk;  // <= l.chunks
    cp.k = (int32_t)k;
    cp.stats = reinterpret_cast<ChunkStats*>(workspace);
    cp.keys = reinterpret_cast<uint64_t*>(static_cast<char*>(workspace) + l.keys);
    switch (logits->dtype) {
        case KDT_DTYPE_FLOAT32: launch_chunks<KDT_DTYPE_FLOAT32>(cp, k, s); break;
        case KDT_DTYPE_FLOAT16: launch_chunks<KDT_DTYPE_FLOAT16>(cp, k, s); break;
        default: launch_chunks<KDT_DTYPE_BFLOAT16>(cp, k, s); break;
    }
    st = kdt::launch_status("top-k chunk kernel");
    if (st != KDT_OK) return st;

    FinishParams fp;
    fp.keys = cp.keys;
    fp.stats = cp.stats;
    fp.rows = rows;
    fp.chunks = cp.chunks;
    fp.vocab = V;
    fp.k = (int32_t)k;
    fp.stage = cp.chunks * k <= kStageCap ? 1 : 0;
    fp.out_logprobs = out_logprobs;
    fp.out_ids = out_ids;
    fp.row_status = row_status;
    // Staged keys, or (when they do not fit) the 32 KB per-lane histogram.
    const size_t dyn_bytes = fp.stage ? (size_t)(cp.chunks * k) * sizeof(uint64_t) : (size_t)kHist32Words * 4u;
    const unsigned grid = (unsigned)(rows < (int64_t)INT32_MAX ? rows : (int64_t)INT32_MAX);
    topk_finish_kernel<<<grid, kThreads, dyn_bytes, s>>>(fp);
    st = kdt::launch_status("top-k finish kernel");
    if (st != KDT_OK) return st;
    return kdt_ok();
}
