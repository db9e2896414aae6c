// GPU verification (spec: ddtree-tree-build.md, "Verification"): the walk of
// kdt_verify_greedy_cpu (native/verify.c) on given target tokens, on the argmax of the
// target's logits, or on Gumbel-max samples of them. One thread block per request.
//
// Every block first checks its tree's links in parallel (verify.c's check_tree) and, for
// trees of up to kStageMax rows, copies tokens and links into shared memory while doing
// so; then warp 0 walks (lane 0 follows the child list, the warp checks stop tokens).
// From logits, each step first reduces the current node's row with the whole block
// (16-byte loads when the row is 16-byte aligned, groups of four scalar loads otherwise),
// so only the rows the walk visits are read. On sm_90 and later, when the batch leaves SMs
// idle, the logits calls give each request a thread-block cluster of csize blocks
// (cluster_size): each block reduces 1/csize of every visited row, the blocks exchange
// their maxima through distributed shared memory, and every block then takes the same
// walk step (only rank 0 writes outputs). Each row's result is a maximum over (value,
// ~token) keys, so it is the same however the row is split. Statuses and their order per
// request are verify.c's: links (KDT_ERR_VALUE), then the cap (KDT_ERR_INVALID_ARGUMENT),
// then the walk (negative or NaN target: KDT_ERR_VALUE; path too long: KDT_ERR_SHAPE).
//
// Sampling draws, for request b, node i, token v (documented in include/kdtree.h):
//   key     = (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32))
//   counter = (v / 4, i, b, offset & 0xFFFFFFFF)
//   x       = word v % 4 of Philox4x32-10(counter, key)
//   u       = ((x >> 8) + 0.5) * 2^-24 = (2k + 1) * 2^-25 with k = x >> 8, in (0, 1)
//   score   = logit / temperature - log(-log(u)), float32, ties by lower id.
// u itself is not representable in float32 when u > 0.5, and rounding it would give
// u = 1 (an infinite score) for k = 2^24 - 1; so -log(u) is evaluated from exact float32
// arguments: -logf((2k + 1) * 2^-25) for k < 2^23, else
// -log1pf(-(2^25 - 2k - 1) * 2^-25). The division and the sum are IEEE round-to-nearest.
//
// kdt_verify_sample_batch_cuda (kBatch) reads each request's settings in its block: the
// argmax at temperature 0, the same draw as above without a cut (reduce_row<kSample>,
// the other calls' speed), and for a top-k / top-p row the thresholds of
// sample_select.cuh (whole-row radix selection by every block of a cluster, so all agree)
// before the draw over the tokens they keep.
#include "common.cuh"
#include "sample_select.cuh"

#include <cooperative_groups.h>
#include <math.h>
#include <string.h>

#include <atomic>

namespace {

constexpr int kWalkThreads = 128;    // given tokens: the block checks links, warp 0 walks
constexpr int kRowThreads = 512;     // from logits: the block reduces each visited row
constexpr int kUnroll = 4;           // 16-byte loads in flight per thread in a row scan
constexpr int64_t kStageMax = 2048;  // trees with N + 1 <= kStageMax rows go to shared memory
constexpr int64_t kMaxBudget = (int64_t)INT32_MAX - 2;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr uint64_t kRowBad = ~0ull;  // reduced row value: NaN (or, sampling, +inf) in the row
constexpr float kTwoPowM25 = 2.98023223876953125e-8f;  // 2^-25, exact
// Above every Gumbel value the generator can give: u <= 1 - 2^-25, so -log(u) >= ~2^-25
// and -log(-log(u)) <= 25 log 2 = 17.33 (plus rounding).
constexpr float kGumbelMax = 18.0f;
constexpr int kMaxCluster = 8;       // the portable cluster size limit
constexpr int kMaxDevices = 64;

// kBatch: per-request settings (kdt_sampling): argmax, kSample, or kSample over a cut row.
enum Mode { kGiven = 0, kArgmax = 1, kSample = 2, kBatch = 3 };

struct Params {
    int64_t batch, budget;
    const int32_t* num_nodes;
    const int32_t* tokens;
    const int32_t* first_child;
    const int32_t* next_sibling;
    const int32_t* target_tokens;  // kGiven: [B, N+1]
    kdt_logits logits;             // kArgmax, kSample: [B, N+1, V]
    float temperature;             // kSample
    uint32_t key0, key1, ctr3;     // kSample: Philox key and the counter's last word
    kdt_sampling sampling;         // kBatch: device arrays [B]
    const int32_t* stop_tokens;
    int64_t num_stop_tokens;
    kdt_stop_sequences stops;   // count 0: none (device arrays)
    const int64_t* max_commit;  // [B] or NULL
    int64_t path_capacity;
    int32_t* accepted_nodes;  // [B, path_capacity]
    int32_t* accept_length;   // [B]
    int32_t* bonus_token;     // [B]
    int32_t* target_out;      // kArgmax, kSample: [B, N+1] or NULL
    int32_t* status;          // [B]
    int stage;                // 1: the tree arrays are copied to shared memory
    int csize;                // blocks per request: 1, or a cluster of 2 .. kMaxCluster (sm_90+)
};

// One request's tree as the walk reads it (shared or device memory).
struct TreeView {
    const int32_t* tok;
    const int32_t* fc;
    const int32_t* ns;
    const int32_t* target;  // kGiven only
    const int32_t* hist;    // [history_length] of the stop sequences, or NULL
    int32_t n;
};

// The walk's state; warp 0 holds it (every lane the same values).
struct Walk {
    int32_t cur;
    int32_t bonus;
    int32_t status;
    int64_t len;                            // accepted draft nodes
    int32_t tail[KDT_MAX_STOP_LENGTH - 1];  // the last accepted tokens, most recent first
};

// Whether accepting `want` completes one of the stop sequences (verify.c's
// ends_sequence): lanes take sequences; the stream is the request's history, then the
// accepted tokens (w.tail). Called by all 32 lanes of warp 0.
__device__ bool ends_sequence(const Walk& w, int32_t want, const TreeView& t, const Params& p) {
    const kdt_stop_sequences& q = p.stops;
    int hit = 0;
    for (int64_t i = threadIdx.x & 31; i < q.count; i += 32) {
        const int64_t hi = q.offsets[i + 1], m = hi - q.offsets[i];
        bool ok = q.tokens[hi - 1] == want;
        for (int64_t k = 1; ok && k < m; k++) {
            int32_t have = -1;
            if (k <= w.len) {
                have = w.tail[k - 1];
            } else if (t.hist != nullptr && q.history_length - (k - w.len) >= 0) {
                have = t.hist[q.history_length - (k - w.len)];
            }
            ok = have == q.tokens[hi - 1 - k];
        }
        hit |= ok;
    }
    return __any_sync(kFullMask, hit) != 0;
}

// One step of verify.c's walk from w.cur, given the target's token `want` (>= 0) there.
// Called by all 32 lanes of warp 0 with the same arguments; returns true when the walk
// ends (w.status, w.bonus say how). Writes path[len] (lane 0) for an accepted node unless
// path is NULL (the cluster blocks other than rank 0).
__device__ bool walk_step(Walk& w, int32_t want, const TreeView& t, const Params& p, int64_t cap, int32_t* path) {
    const int lane = threadIdx.x & 31;
    int32_t next = -1, cycle = 0;
    if (lane == 0) {
        int32_t steps = 0;
        for (int32_t c = t.fc[w.cur]; c != -1; c = t.ns[c]) {
            if (++steps > t.n) {  // unreachable after the link check; verify.c has it
                cycle = 1;
                break;
            }
            if (t.tok[c] == want) {
                next = c;
                break;
            }
        }
    }
    next = __shfl_sync(kFullMask, next, 0);
    cycle = __shfl_sync(kFullMask, cycle, 0);
    if (cycle) {
        w.status = KDT_ERR_VALUE;
        return true;
    }
    if (next < 0) {  // no child matches: the target's token is the bonus
        w.bonus = want;
        return true;
    }
    int stop = 0;
    for (int64_t j = lane; j < p.num_stop_tokens; j += 32) stop |= p.stop_tokens[j] == want;
    stop = __any_sync(kFullMask, stop);
    if (!stop && p.stops.count > 0) stop = ends_sequence(w, want, t, p);
    if (!stop && w.len + 2 > cap) {  // accepting `next` plus a bonus would pass the cap
        w.bonus = want;
        return true;
    }
    if (w.len + 2 > p.path_capacity) {
        w.status = KDT_ERR_SHAPE;
        return true;
    }
    if (w.len >= t.n) {  // unreachable after the link check (the path increases)
        w.status = KDT_ERR_VALUE;
        return true;
    }
    w.cur = next;
#pragma unroll
    for (int k = KDT_MAX_STOP_LENGTH - 2; k > 0; k--) w.tail[k] = w.tail[k - 1];
    w.tail[0] = want;
    w.len++;
    if (lane == 0 && path != nullptr) path[w.len] = next;
    return stop != 0;  // an accepted stop token ends the walk without a bonus
}

// One request's draw: the temperature, the Philox key and counter word, and (a cut row,
// reduce_row's Cut) the threshold keys of the top-k and top-p cuts (sample_select.cuh).
struct Draw {
    float temperature;
    uint32_t key0, key1, ctr3;
    uint64_t cut_logit, cut_score;
};

// Best element a thread has seen in a row: value (logit or score) and token id (-1: none).
struct Best {
    float x;
    int32_t v;
    int bad;
};

// Gumbel noise -log(-log(u)) for one Philox word, u = ((bits >> 8) + 0.5) * 2^-24 (see the
// file comment for the exact float32 evaluation). Always finite: in [-2.86, 17.34].
__device__ __forceinline__ float gumbel_noise(uint32_t bits) {
    const uint32_t k = bits >> 8;
    float e;  // -log(u) > 0
    if (k < (1u << 23)) {
        e = -logf((float)(2u * k + 1u) * kTwoPowM25);
    } else {
        e = -log1pf(-(float)((1u << 25) - 2u * k - 1u) * kTwoPowM25);
    }
    return -logf(e);
}

// Folds `cnt` (1..4) consecutive logits x[0..cnt) of tokens v0.. (v0 % 4 == 0) into best.
// dr: the Params of a kSample call (read from the kernel's parameters) or a kBatch request's
// Draw (then Cut: only the tokens whose keys reach dr.cut_logit and dr.cut_score are drawn).
template <int M, bool Cut, class D>
__device__ __forceinline__ void take_group(Best& best, const float* x, int cnt, int64_t v0, const D& dr,
                                           uint32_t node, uint32_t req) {
    if constexpr (M == kArgmax) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (k < cnt) {
                best.bad |= isnan(x[k]);
                if (best.v < 0 || x[k] > best.x) {  // increasing ids per thread: ties keep the lower
                    best.x = x[k];
                    best.v = (int32_t)(v0 + k);
                }
            }
        }
    } else {
        float s[4], smax = -INFINITY;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s[k] = -INFINITY;
            if (k < cnt) {
                best.bad |= isnan(x[k]) || x[k] == INFINITY;
                s[k] = __fdiv_rn(x[k], dr.temperature);
                if constexpr (Cut) {
                    if (kdt::token_key(x[k], v0 + k) < dr.cut_logit || kdt::token_key(s[k], v0 + k) < dr.cut_score) {
                        s[k] = -INFINITY;
                    }
                }
                smax = fmaxf(smax, s[k]);
            }
        }
        // Exact skip: every score of this group is below the thread's best (g <= kGumbelMax
        // and rounding is monotone), so it could neither win nor tie.
        if (smax == -INFINITY || smax + kGumbelMax < best.x) return;
        const kdt::Philox4 r = kdt::philox4x32_10((uint32_t)(v0 >> 2), node, req, dr.ctr3, dr.key0, dr.key1);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (k < cnt) {
                const float score = __fadd_rn(s[k], gumbel_noise(r.x[k]));
                if (score > best.x) {  // -inf (a -inf logit) never passes; ties keep the lower id
                    best.x = score;
                    best.v = (int32_t)(v0 + k);
                }
            }
        }
    }
}

// The 16 / esize logits of one 16-byte chunk, in order.
template <int Dtype>
__device__ __forceinline__ void unpack_chunk(const uint4& q, float* x) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    if constexpr (Dtype == KDT_DTYPE_FLOAT32) {
#pragma unroll
        for (int k = 0; k < 4; k++) x[k] = __uint_as_float(w[k]);
    } else if constexpr (Dtype == KDT_DTYPE_BFLOAT16) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            x[2 * k] = __uint_as_float(w[k] << 16);
            x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            x[2 * k] = __half2float(__ushort_as_half((unsigned short)(w[k] & 0xFFFFu)));
            x[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
        }
    }
}

// The larger of two pairs of 16-bit logits, lane by lane, NaN if either is NaN.
template <int Dtype>
__device__ __forceinline__ uint32_t max2_nan(uint32_t a, uint32_t b) {
    uint32_t r;
    if constexpr (Dtype == KDT_DTYPE_BFLOAT16) {
        const __nv_bfloat162 m = __hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                             *reinterpret_cast<const __nv_bfloat162*>(&b));
        r = *reinterpret_cast<const uint32_t*>(&m);
    } else {
        const __half2 m =
            __hmax2_nan(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
        r = *reinterpret_cast<const uint32_t*>(&m);
    }
    return r;
}

// Argmax of one 16-byte chunk of 8 16-bit logits of tokens v0 .. v0 + 7 into best, with
// take_group's result: the chunk's max by three packed NaN-propagating max operations; only
// when it beats the thread's best (or the thread has none) is the chunk unpacked to find
// the first token holding it (so ties keep the lower id, -0 and +0 alike). A NaN anywhere
// in the chunk sets best.bad (the row is then reported as bad whatever best holds).
template <int Dtype>
__device__ __forceinline__ void take_chunk_max(Best& best, const uint4& q, int64_t v0) {
    const uint32_t m2 = max2_nan<Dtype>(max2_nan<Dtype>(q.x, q.y), max2_nan<Dtype>(q.z, q.w));
    float lo, hi;
    if constexpr (Dtype == KDT_DTYPE_BFLOAT16) {
        lo = __uint_as_float(m2 << 16);
        hi = __uint_as_float(m2 & 0xFFFF0000u);
    } else {
        lo = __half2float(__ushort_as_half((unsigned short)(m2 & 0xFFFFu)));
        hi = __half2float(__ushort_as_half((unsigned short)(m2 >> 16)));
    }
    best.bad |= isnan(lo) | isnan(hi);
    const float m = fmaxf(lo, hi);
    if (best.v < 0 || m > best.x) {  // false for NaN (best.bad is set then)
        float x[8];
        unpack_chunk<Dtype>(q, x);
        int k = 7;
#pragma unroll
        for (int j = 6; j >= 0; j--) k = x[j] == m ? j : k;
        best.x = m;
        best.v = (int32_t)(v0 + k);
    }
}

// Max over the block of one uint64 per thread; every thread gets the result. Contains one
// barrier; the caller must pass another barrier before the next call (s_warp is reused).
__device__ __forceinline__ uint64_t block_max_u64(uint64_t v, uint64_t* s_warp) {
    for (int off = 16; off > 0; off >>= 1) {
        const uint64_t o = __shfl_xor_sync(kFullMask, v, off);
        v = o > v ? o : v;
    }
    if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = v;
    __syncthreads();
    uint64_t r = 0;
    const int warps = (int)(blockDim.x >> 5);
    for (int k = 0; k < warps; k++) r = s_warp[k] > r ? s_warp[k] : r;
    return r;
}

// The target's token at one node from part `part` of `parts` of its logits row (argmax,
// or the Gumbel-max draw), computed by the whole block: the 16-byte chunks and the scalar
// groups after them are each split into `parts` contiguous slices. Returns
// (order_key(value) << 32) | ~token of the slice's best; kRowBad for a NaN (sampling: also
// +inf) logit; 0 when no token has a score above -inf (sampling) or the slice is empty.
template <int M, int Dtype, bool Cut = false, class D>
__device__ uint64_t reduce_row(const char* row, int64_t V, const D& dr, uint32_t node, uint32_t req,
                               int part, int parts, uint64_t* s_warp) {
    constexpr int kEsize = Dtype == KDT_DTYPE_FLOAT32 ? 4 : 2;
    constexpr int kChunk = 16 / kEsize;  // logits per 16-byte load: 4 or 8 (1 or 2 groups)
    const int64_t nthreads = blockDim.x;
    Best best = {-INFINITY, -1, 0};
    int64_t v_scalar = 0;  // the scalar loop below starts here (a multiple of 4)
    if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
        const uint4* vec = reinterpret_cast<const uint4*>(row);
        const int64_t chunks = V / kChunk;
        const int64_t c_lo = chunks * part / parts, c_hi = chunks * (part + 1) / parts;
        // Thread t takes chunks c_lo + t, c_lo + t + T, ... (T threads): each warp load is
        // 512 contiguous bytes; kU loads are issued before any is used (8 for the light
        // 16-bit argmax, whose scan waits on memory; kUnroll otherwise).
        constexpr int kU = M == kArgmax && Dtype != KDT_DTYPE_FLOAT32 ? 2 * kUnroll : kUnroll;
        for (int64_t c0 = c_lo + threadIdx.x; c0 < c_hi; c0 += kU * nthreads) {
            uint4 q[kU];
#pragma unroll
            for (int u = 0; u < kU; u++) {
                const int64_t c = c0 + u * nthreads;
                q[u] = c < c_hi ? __ldg(vec + c) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < kU; u++) {
                const int64_t c = c0 + u * nthreads;
                if (c >= c_hi) continue;
                if constexpr (M == kArgmax && Dtype != KDT_DTYPE_FLOAT32) {
                    take_chunk_max<Dtype>(best, q[u], c * kChunk);
                } else {
                    float x[kChunk];
                    unpack_chunk<Dtype>(q[u], x);
#pragma unroll
                    for (int g = 0; g < kChunk / 4; g++) {
                        take_group<M, Cut>(best, x + 4 * g, 4, c * kChunk + 4 * g, dr, node, req);
                    }
                }
            }
        }
        v_scalar = chunks * kChunk;
    }
    // The tail of an aligned row, or all of an unaligned one: groups of four tokens (one
    // Philox call each when sampling), scalar loads.
    const int64_t groups = (V + 3) / 4, g0 = v_scalar / 4;
    const int64_t g_lo = g0 + (groups - g0) * part / parts, g_hi = g0 + (groups - g0) * (part + 1) / parts;
    for (int64_t g = g_lo + threadIdx.x; g < g_hi; g += nthreads) {
        const int64_t v0 = 4 * g;
        const int cnt = V - v0 < 4 ? (int)(V - v0) : 4;
        float x[4];
#pragma unroll
        for (int k = 0; k < 4; k++) x[k] = k < cnt ? kdt::load_logit<Dtype>(row, v0 + k) : 0.0f;
        take_group<M, Cut>(best, x, cnt, v0, dr, node, req);
    }
    uint64_t mine = 0;
    if (best.bad) {
        mine = kRowBad;
    } else if (best.v >= 0) {
        const float x = best.x == 0.0f ? 0.0f : best.x;  // -0 ties with +0: the lower id wins
        mine = ((uint64_t)kdt::float_order_key(x) << 32) | (uint64_t)(~(uint32_t)best.v);
    }
    return block_max_u64(mine, s_warp);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The maximum of the cluster's csize block results r (each block passes its own; every
// thread gets the maximum). Each block writes r into slot `rank` of every block's
// `slots`, then the cluster barrier (release / acquire) makes them visible. Callers
// alternate between two slot arrays: a block that is one step ahead writes into the
// other array, and cannot get two steps ahead of a block still reading (the barrier).
__device__ uint64_t cluster_max(uint64_t r, uint64_t* slots, int csize) {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    const unsigned rank = cl.block_rank();
    if ((int)threadIdx.x < csize) *cl.map_shared_rank(slots + rank, threadIdx.x) = r;
    cl.sync();
    uint64_t m = 0;
    for (int i = 0; i < csize; i++) m = slots[i] > m ? slots[i] : m;
    return m;
}
#endif

// A kBatch request's settings (uniform over its block).
struct Request {
    bool greedy;    // temperature 0: the argmax
    int64_t top_k;  // a top-k cut when 0 < top_k < V
    float top_p;    // a top-p cut when < 1
};

// The candidates of the top-k cut: every token, keyed by logit, weight 1.
struct LogitItem {
    __device__ bool key(int64_t v, float x, uint64_t* k) const {
        *k = kdt::token_key(x, v);
        return true;
    }
    __device__ uint64_t weight(int64_t, float) const { return 1u; }
};

// The candidates of the top-p cut: the tokens the top-k cut kept, keyed by score, weighted
// floor(E(s - m) * 2^S).
struct ScoreItem {
    float temperature, m;
    double two_s;
    uint64_t cut_logit;
    __device__ bool key(int64_t v, float x, uint64_t* k) const {
        if (kdt::token_key(x, v) < cut_logit) return false;
        *k = kdt::token_key(__fdiv_rn(x, temperature), v);
        return true;
    }
    __device__ uint64_t weight(int64_t, float x) const {
        return kdt::sample_weight(__fdiv_rn(x, temperature), m, two_s);
    }
};

// reduce_row for a kBatch request: the argmax at temperature 0, the plain draw without a
// cut, else the cuts (each block of a cluster selects over the whole row, so all find the
// same thresholds) and the draw over the tokens they keep, on part `part` of the row.
template <int Dtype>
__device__ uint64_t batch_row(const char* row, int64_t V, const Request& rq, Draw dr, uint32_t node, uint32_t req,
                              int part, int parts, uint64_t* s_warp) {
    __shared__ kdt::SelectHist s_hist;
    if (rq.greedy) return reduce_row<kArgmax, Dtype>(row, V, dr, node, req, part, parts, s_warp);
    const bool cut_k = rq.top_k > 0 && rq.top_k < V, cut_p = rq.top_p < 1.0f;
    if (!cut_k && !cut_p) return reduce_row<kSample, Dtype>(row, V, dr, node, req, part, parts, s_warp);
    dr.cut_logit = 0;
    dr.cut_score = 0;
    if (cut_k) {
        dr.cut_logit = kdt::radix_select<Dtype, false>(row, V, LogitItem{}, kdt::CountTarget{(uint64_t)rq.top_k},
                                                       &s_hist);
    }
    if (cut_p) {
        // The weights need the row's largest score; a row that cannot be sampled (NaN, +inf,
        // only -inf) fails here, as reduce_row would report it.
        const uint64_t top = reduce_row<kArgmax, Dtype>(row, V, dr, node, req, 0, 1, s_warp);
        __syncthreads();  // s_warp is reused below
        const float mx = kdt::float_from_order_key((uint32_t)(top >> 32));
        if (top == kRowBad || isinf(mx)) return kRowBad;
        const ScoreItem item = {dr.temperature, __fdiv_rn(mx, dr.temperature),
                                __longlong_as_double((long long)(1023 + kdt::weight_shift(V)) << 52),
                                dr.cut_logit};
        dr.cut_score = kdt::radix_select<Dtype, true>(row, V, item, kdt::MassTarget{(double)rq.top_p}, &s_hist);
    }
    return reduce_row<kSample, Dtype, true>(row, V, dr, node, req, part, parts, s_warp);
}

template <int M, int Dtype>
__global__ void __launch_bounds__(M == kGiven ? kWalkThreads : kRowThreads) verify_kernel(Params p) {
    extern __shared__ int32_t s_tree[];  // staged tok, fc, ns (and, kGiven, targets): rows each
    __shared__ uint64_t s_warp[32];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ uint64_t s_part[2][kMaxCluster];  // the cluster's row results (cluster_max)
#endif
    __shared__ int64_t s_len;
    __shared__ int32_t s_cur, s_done, s_status, s_bonus;

    // Request b; this block's rank in the request's cluster (0 when csize is 1).
    const int csize = p.csize;
    const int64_t b = blockIdx.x / csize;
    const int rank = (int)(blockIdx.x % csize);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int parts = csize;  // this block reduces slice `rank` of every visited row
#else
    // No cluster exchange in this code (compiled below sm_90, e.g. compute_80 PTX that the
    // driver compiled for an sm_90 device while the host chose clusters): every block
    // reduces whole rows, so each one still takes the right steps (rank 0 writes).
    const int parts = 1;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // A block may write into another block's shared memory only once that block has
    // started: every thread arrives here and waits below, after the link check.
    if (csize > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    const int64_t rows = p.budget + 1;
    const int64_t base = b * rows;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t nthreads = blockDim.x;
    const int32_t n = p.num_nodes[b];
    const int32_t* g_tok = p.tokens + base;
    const int32_t* g_fc = p.first_child + base;
    const int32_t* g_ns = p.next_sibling + base;
    TreeView t;
    t.n = n;
    t.hist = p.stops.history != nullptr ? p.stops.history + b * p.stops.history_length : nullptr;
    if (p.stage) {
        t.tok = s_tree;
        t.fc = s_tree + rows;
        t.ns = s_tree + 2 * rows;
        t.target = M == kGiven ? s_tree + 3 * rows : nullptr;
    } else {
        t.tok = g_tok;
        t.fc = g_fc;
        t.ns = g_ns;
        t.target = M == kGiven ? p.target_tokens + base : nullptr;
    }

    // 1. verify.c's check_tree, in parallel; stage the tree on the way.
    int bad = n < 0 || (int64_t)n > p.budget;
    if (!bad) {
        for (int64_t i = tid; i <= n; i += nthreads) {
            const int32_t fc = g_fc[i], ns = g_ns[i];
            bad |= fc != -1 && (fc <= i || fc > n);
            bad |= ns != -1 && (i == 0 || ns <= i || ns > n);
            if (p.stage) {
                s_tree[i] = g_tok[i];
                s_tree[rows + i] = fc;
                s_tree[2 * rows + i] = ns;
                if constexpr (M == kGiven) s_tree[3 * rows + i] = p.target_tokens[base + i];
            }
        }
    }
    if (M != kGiven && p.target_out != nullptr && rank == 0) {
        for (int64_t i = tid; i < rows; i += nthreads) p.target_out[base + i] = -1;
    }
    bad = __syncthreads_or(bad);
    // The stop sequences' arrays (device memory, checked here as verify.c checks them on the
    // host): a malformed one fails every request.
    int bad_stops = 0;
    for (int64_t i = tid; i < p.stops.count; i += nthreads) {
        const int64_t lo = p.stops.offsets[i], m = p.stops.offsets[i + 1] - lo;
        bad_stops |= (i == 0 && lo != 0) || m < 1 || m > KDT_MAX_STOP_LENGTH;
        for (int64_t k = 0; !bad_stops && k < m; k++) bad_stops |= p.stops.tokens[lo + k] < 0;
    }
    bad_stops = __syncthreads_or(bad_stops);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (csize > 1) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
    const int64_t cap = p.max_commit != nullptr ? p.max_commit[b] : INT64_MAX;
    // kBatch: the request's settings, checked here.
    Draw dr = {0.0f, 0u, 0u, 0u, 0u, 0u};
    Request rq = {false, 0, 1.0f};
    bool bad_setting = false;
    if constexpr (M == kBatch) {
        const float T = p.sampling.temperature[b];
        const uint64_t seed = p.sampling.seed[b], offset = p.sampling.offset[b];
        rq.top_p = p.sampling.top_p != nullptr ? p.sampling.top_p[b] : 1.0f;
        rq.top_k = p.sampling.top_k != nullptr ? p.sampling.top_k[b] : 0;
        rq.greedy = T == 0.0f;
        bad_setting = !(rq.greedy || (isfinite(T) && T >= 1e-6f)) || !(rq.top_p > 0.0f && rq.top_p <= 1.0f) ||
                      rq.top_k < 0;
        dr.temperature = T;
        dr.key0 = (uint32_t)seed;
        dr.key1 = (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32);
        dr.ctr3 = (uint32_t)offset;
    }
    const int32_t status0 = bad_stops          ? KDT_ERR_INVALID_ARGUMENT
                            : bad              ? KDT_ERR_VALUE
                            : cap < 0          ? KDT_ERR_INVALID_ARGUMENT
                            : bad_setting      ? KDT_ERR_VALUE
                                               : KDT_OK;
    if (tid == 0) {
        s_cur = 0;
        s_done = 0;
        s_status = status0;
        s_len = 0;
        s_bonus = -1;
    }
    __syncthreads();

    // 2. The walk (cap 0: nothing is committed and no row is read).
    int32_t* path = rank == 0 ? p.accepted_nodes + b * p.path_capacity : nullptr;
    if constexpr (M == kGiven) {
        if (warp == 0 && status0 == KDT_OK && cap > 0) {
            Walk w = {0, -1, KDT_OK, 0, {}};
            for (;;) {
                const int32_t want = t.target[w.cur];
                if (want < 0) {
                    w.status = KDT_ERR_VALUE;
                    break;
                }
                if (walk_step(w, want, t, p, cap, path)) break;
            }
            if (lane == 0) {
                s_status = w.status;
                s_len = w.len;
                s_bonus = w.bonus;
            }
        }
    } else if (status0 == KDT_OK && cap > 0) {  // uniform over the block
        const size_t esize = Dtype == KDT_DTYPE_FLOAT32 ? 4 : 2;
        const char* logits = static_cast<const char*>(p.logits.data);
        Walk w = {0, -1, KDT_OK, 0, {}};  // meaningful in warp 0 only
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        int parity = 0;  // which s_part array this step's cluster_max uses
#endif
        for (;;) {
            // Everyone reads s_cur here; warp 0 writes it only after reduce_row's barrier.
            const int32_t cur = s_cur;
            const int64_t at = b * p.logits.batch_stride + (int64_t)cur * p.logits.row_stride;
            const char* row = logits + at * (int64_t)esize;
            uint64_t r;
            if constexpr (M == kBatch) {
                r = batch_row<Dtype>(row, p.logits.vocab, rq, dr, (uint32_t)cur, (uint32_t)b, parts == 1 ? 0 : rank,
                                     parts, s_warp);
            } else {
                r = reduce_row<M, Dtype>(row, p.logits.vocab, p, (uint32_t)cur, (uint32_t)b, parts == 1 ? 0 : rank,
                                         parts, s_warp);
            }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if (csize > 1) {  // every block of the cluster takes the same steps
                r = cluster_max(r, s_part[parity], csize);
                parity ^= 1;
            }
#endif
            if (warp == 0) {
                bool done;
                if (r == kRowBad || r == 0) {  // NaN, or (sampling) +inf or nothing above -inf
                    w.status = KDT_ERR_VALUE;
                    done = true;
                } else {
                    const int32_t want = (int32_t)~(uint32_t)r;
                    if (lane == 0 && p.target_out != nullptr && rank == 0) p.target_out[base + cur] = want;
                    done = walk_step(w, want, t, p, cap, path);
                }
                if (lane == 0) {
                    s_cur = w.cur;
                    s_done = done;
                    if (done) {
                        s_status = w.status;
                        s_len = w.len;
                        s_bonus = w.bonus;
                    }
                }
            }
            __syncthreads();
            if (s_done) break;  // s_done changes again only after the next reduce_row barrier
        }
    }
    __syncthreads();

    // 3. Outputs: the rest of the path row (a failed request: all of it), length, bonus.
    // Rank 0 writes them; the other blocks of a cluster are done (no block writes into
    // another's shared memory after the last cluster barrier).
    if (rank != 0) return;
    const int32_t status = s_status;
    const int64_t len = status == KDT_OK ? s_len : 0;
    for (int64_t j = tid; j < p.path_capacity; j += nthreads) {
        if (status != KDT_OK || j > len) {
            path[j] = -1;
        } else if (j == 0) {
            path[0] = 0;
        }
    }
    if (tid == 0) {
        p.accept_length[b] = (int32_t)len;
        p.bonus_token[b] = status == KDT_OK ? s_bonus : -1;
        p.status[b] = status;
    }
}

// Host checks shared by the three entry points that need no device data; fills the tree,
// stop-token, cap and size fields of p. B == 0 is accepted here (the caller returns).
kdt_status check_scalars(const kdt_trees* trees, int64_t num_stop_tokens, const kdt_stop_sequences* stops,
                         int64_t path_capacity, Params* p) {
    if (trees == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees is NULL");
    const int64_t B = trees->batch, N = trees->budget;
    if (B < 0 || B > INT32_MAX || N < 0 || N > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "trees batch (%lld) must be in [0, %d] and budget (%lld) in [0, %lld]", (long long)B,
                        INT32_MAX, (long long)N, (long long)kMaxBudget);
    }
    if (num_stop_tokens < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "num_stop_tokens %lld is negative", (long long)num_stop_tokens);
    }
    if (stops != NULL && (stops->count < 0 || stops->history_length < 0)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "stop_sequences: count (%lld) and history_length (%lld) must be >= 0",
                        (long long)stops->count, (long long)stops->history_length);
    }
    if (stops != NULL && stops->count > 0 && (stops->offsets == NULL || stops->tokens == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_sequences->%s is NULL with count %lld",
                        stops->offsets == NULL ? "offsets" : "tokens", (long long)stops->count);
    }
    if (stops != NULL && stops->history_length > 0 && stops->history == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_sequences->history is NULL with history_length %lld",
                        (long long)stops->history_length);
    }
    if (path_capacity < 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "path_capacity %lld must be >= 1", (long long)path_capacity);
    }
    // Element offsets b * (N + 1) + i and b * path_capacity + j, in bytes, fit int64.
    if ((unsigned __int128)B * (uint64_t)(N + 1) * 4u > (unsigned __int128)INT64_MAX ||
        (unsigned __int128)B * (uint64_t)path_capacity * 4u > (unsigned __int128)INT64_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "batch %lld x path_capacity %lld (or budget %lld + 1) overflows",
                        (long long)B, (long long)path_capacity, (long long)N);
    }
    memset(p, 0, sizeof *p);
    p->batch = B;
    p->budget = N;
    p->num_stop_tokens = num_stop_tokens;
    if (stops != NULL && stops->count > 0) {
        p->stops = *stops;
        if (p->stops.history_length == 0) p->stops.history = nullptr;
    }
    p->path_capacity = path_capacity;
    return KDT_OK;
}

// Host checks of the device pointers (B > 0), then the rest of p.
kdt_status check_pointers(const kdt_trees* trees, const int32_t* stop_tokens, const int64_t* max_commit,
                          int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                          int32_t* request_status, Params* p) {
    if (trees->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->num_nodes is NULL");
    if (trees->tokens == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->tokens is NULL");
    if (trees->first_child == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->first_child is NULL");
    if (trees->next_sibling == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->next_sibling is NULL");
    if (p->num_stop_tokens > 0 && stop_tokens == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_tokens is NULL with num_stop_tokens %lld",
                        (long long)p->num_stop_tokens);
    }
    if (accepted_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accepted_nodes is NULL");
    if (accept_length == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accept_length is NULL");
    if (bonus_token == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bonus_token is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    const struct {
        const void* ptr;
        size_t align;
        const char* name;
    } aligned[] = {{trees->num_nodes, 4, "trees->num_nodes"}, {trees->tokens, 4, "trees->tokens"},
                   {trees->first_child, 4, "trees->first_child"}, {trees->next_sibling, 4, "trees->next_sibling"},
                   {stop_tokens, 4, "stop_tokens"}, {p->stops.tokens, 4, "stop_sequences->tokens"},
                   {p->stops.offsets, 8, "stop_sequences->offsets"}, {p->stops.history, 4, "stop_sequences->history"},
                   {max_commit, 8, "max_commit"},
                   {accepted_nodes, 4, "accepted_nodes"}, {accept_length, 4, "accept_length"},
                   {bonus_token, 4, "bonus_token"}, {request_status, 4, "request_status"}};
    for (const auto& a : aligned) {
        const kdt_status st = kdt::check_aligned(a.ptr, a.align, a.name);
        if (st != KDT_OK) return st;
    }
    p->num_nodes = trees->num_nodes;
    p->tokens = trees->tokens;
    p->first_child = trees->first_child;
    p->next_sibling = trees->next_sibling;
    p->stop_tokens = stop_tokens;
    p->max_commit = max_commit;
    p->accepted_nodes = accepted_nodes;
    p->accept_length = accept_length;
    p->bonus_token = bonus_token;
    p->status = request_status;
    return KDT_OK;
}

// The host checks shared by the two *_from_logits calls, in the CPU's order; fills p.
// `sample`: the sampling call, whose `temperature` is checked (ignored otherwise).
// *empty: an empty batch, nothing to launch (the status is then KDT_OK).
kdt_status prepare_from_logits(const kdt_trees* trees, const kdt_logits* target_logits, const int32_t* stop_tokens,
                               int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences,
                               const int64_t* max_commit, int64_t path_capacity,
                               int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                               int32_t* target_tokens, int32_t* request_status, bool sample, float temperature,
                               Params* p, bool* empty) {
    kdt_status st = check_scalars(trees, num_stop_tokens, stop_sequences, path_capacity, p);
    if (st != KDT_OK) return st;
    // Below 1e-6, logit / temperature can overflow float32 and every score become -inf or
    // +inf: the draw would no longer be a sample (greedy is verify_greedy_from_logits).
    if (sample && !(isfinite(temperature) && temperature >= 1e-6f)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "temperature %g must be finite and >= 1e-6", (double)temperature);
    }
    st = kdt::check_logits(target_logits, "target_logits", p->batch, p->budget + 1);
    if (st != KDT_OK) return st;
    if (p->batch == 0) {
        *empty = true;
        return kdt_ok();
    }
    st = check_pointers(trees, stop_tokens, max_commit, accepted_nodes, accept_length, bonus_token, request_status,
                        p);
    if (st != KDT_OK) return st;
    p->logits = *target_logits;
    st = kdt::check_aligned(target_tokens, 4, "target_tokens");
    if (st != KDT_OK) return st;
    p->target_out = target_tokens;
    return KDT_OK;
}

std::atomic<int> g_sm_count[kMaxDevices];  // the device's SMs when its major version is >= 9, -1 below; 0: unknown

// Blocks per request for the logits calls: the largest power of two up to kMaxCluster
// with batch x csize <= the SMs, on sm_90 and later (thread-block clusters); 1 before
// sm_90 or when the batch fills the SMs. One block a SM: two blocks of a cluster on one SM
// share its issue slots, and a row's scan is bound by them (measured on an H200, B = 64:
// clusters of 4, two blocks a SM, were no faster than one block a request; clusters of 2
// were 35% faster on 17-row walks; docs/performance.md). Sets *out or returns a status.
// kdt_testing_set_verify_cluster forces 1, 2, 4 or 8 (more than 1 only on sm_90 and later).
kdt_status cluster_size(int64_t batch, int* out) {
    const int forced = kdt::testing_verify_cluster();
    *out = 1;
    if (forced == 1) return KDT_OK;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return kdt_fail(err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ? KDT_ERR_NO_DEVICE
                                                                                        : KDT_ERR_CUDA,
                        "device query failed: %s", cudaGetErrorString(err));
    }
    const bool cached = dev >= 0 && dev < kMaxDevices;
    int sms = cached ? g_sm_count[dev].load(std::memory_order_relaxed) : 0;
    if (sms == 0) {  // cached: the queries cost more than a small launch
        int major = 0;
        err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
        if (major < 9 || sms < 1) sms = -1;
        if (cached) g_sm_count[dev].store(sms, std::memory_order_relaxed);
    }
    if (sms < 0) return KDT_OK;
    if (forced > 1) {
        *out = batch * forced <= (int64_t)INT32_MAX ? forced : 1;
        return KDT_OK;
    }
    int c = 1;
    while (c < kMaxCluster && batch * 2 * c <= (int64_t)sms) c *= 2;
    *out = c;
    return KDT_OK;
}

// The largest cluster size <= csize (powers of two) of which the device can schedule at
// least one cluster of `kernel` (512 threads, the largest staged tree's shared memory):
// MPS or a partitioned device may not. Asked once per kernel and device (per device
// ordinal below kMaxDevices; above, every time); 1 when the query fails (not cached: the
// query may also return an earlier launch's error).
template <class Kernel>
int schedulable_cluster_size(Kernel* kernel, int csize) {
    static std::atomic<int> fits[kMaxDevices];  // per device: 1 + the largest size that fits, 0: unknown
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    const bool cached = dev >= 0 && dev < kMaxDevices;
    int best = cached ? fits[dev].load(std::memory_order_relaxed) - 1 : -1;
    if (best < 0) {
        best = 1;
        bool failed = false;
        for (int c = kMaxCluster; c > 1 && !failed; c /= 2) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3((unsigned)c);
            cfg.blockDim = dim3(kRowThreads);
            cfg.dynamicSmemBytes = (size_t)3 * kStageMax * sizeof(int32_t);
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = (unsigned)c;
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            int n = 0;
            if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
                cudaGetLastError();
                failed = true;
                n = 0;
            }
            if (n > 0) {
                best = c;
                break;
            }
        }
        if (cached && !failed) fits[dev].store(best + 1, std::memory_order_relaxed);
    }
    return csize < best ? csize : best;
}

template <int M, int Dtype>
kdt_status launch(Params p, void* stream, const char* what) {
    const int64_t rows = p.budget + 1;
    p.stage = rows <= kStageMax;
    const size_t smem = p.stage ? (size_t)(M == kGiven ? 4 : 3) * (size_t)rows * sizeof(int32_t) : 0;
    p.csize = 1;
    if (M != kGiven) {
        const kdt_status st = cluster_size(p.batch, &p.csize);
        if (st != KDT_OK) return st;
    }
    if (p.csize > 1) p.csize = schedulable_cluster_size(verify_kernel<M, Dtype>, p.csize);
    if (p.csize > 1) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((unsigned)(p.batch * p.csize));
        cfg.blockDim = dim3(kRowThreads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = kdt::as_stream(stream);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = (unsigned)p.csize;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t err = cudaLaunchKernelEx(&cfg, verify_kernel<M, Dtype>, p);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return kdt_fail(KDT_ERR_CUDA, "%s launch (clusters of %d blocks) failed: %s", what, p.csize,
                            cudaGetErrorString(err));
        }
    } else {
        verify_kernel<M, Dtype><<<(unsigned)p.batch, M == kGiven ? kWalkThreads : kRowThreads, smem,
                                  kdt::as_stream(stream)>>>(p);
    }
    const kdt_status st = kdt::launch_status(what);
    return st != KDT_OK ? st : kdt_ok();
}

template <int M>
kdt_status launch_dtype(const Params& p, void* stream, const char* what) {
    switch (p.logits.dtype) {
        case KDT_DTYPE_FLOAT32: return launch<M, KDT_DTYPE_FLOAT32>(p, stream, what);
        case KDT_DTYPE_FLOAT16: return launch<M, KDT_DTYPE_FLOAT16>(p, stream, what);
        case KDT_DTYPE_BFLOAT16: return launch<M, KDT_DTYPE_BFLOAT16>(p, stream, what);
        default: return kdt_fail(KDT_ERR_INTERNAL, "%s: dtype %d passed the checks", what, (int)p.logits.dtype);
    }
}

}  // namespace

extern "C" kdt_status kdt_verify_greedy_cuda(const kdt_trees* trees, const int32_t* target_tokens,
                                             const int32_t* stop_tokens, int64_t num_stop_tokens,
                                             const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
                                             int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
                                             int32_t* bonus_token, int32_t* request_status, void* stream) {
    Params p;
    kdt_status st = check_scalars(trees, num_stop_tokens, stop_sequences, path_capacity, &p);
    if (st != KDT_OK) return st;
    if (p.batch == 0) return kdt_ok();
    st = check_pointers(trees, stop_tokens, max_commit, accepted_nodes, accept_length, bonus_token, request_status,
                        &p);
    if (st != KDT_OK) return st;
    if (target_tokens == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "target_tokens is NULL");
    st = kdt::check_aligned(target_tokens, 4, "target_tokens");
    if (st != KDT_OK) return st;
    p.target_tokens = target_tokens;
    return launch<kGiven, KDT_DTYPE_FLOAT32>(p, stream, "kdt_verify_greedy_cuda");
}

extern "C" kdt_status kdt_verify_greedy_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                         const int32_t* stop_tokens, int64_t num_stop_tokens,
                                                         const kdt_stop_sequences* stop_sequences,
                                                         const int64_t* max_commit, int64_t path_capacity,
                                                         int32_t* accepted_nodes, int32_t* accept_length,
                                                         int32_t* bonus_token, int32_t* target_tokens,
                                                         int32_t* request_status, void* stream) {
    Params p;
    bool empty = false;
    const kdt_status st = prepare_from_logits(trees, target_logits, stop_tokens, num_stop_tokens, stop_sequences,
                                              max_commit, path_capacity, accepted_nodes, accept_length, bonus_token,
                                              target_tokens, request_status, false, 0.0f, &p, &empty);
    if (st != KDT_OK || empty) return st;
    return launch_dtype<kArgmax>(p, stream, "kdt_verify_greedy_from_logits_cuda");
}

extern "C" kdt_status kdt_verify_sample_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                         float temperature, uint64_t seed, uint64_t offset,
                                                         const int32_t* stop_tokens, int64_t num_stop_tokens,
                                                         const kdt_stop_sequences* stop_sequences,
                                                         const int64_t* max_commit, int64_t path_capacity,
                                                         int32_t* accepted_nodes, int32_t* accept_length,
                                                         int32_t* bonus_token, int32_t* target_tokens,
                                                         int32_t* request_status, void* stream) {
    Params p;
    bool empty = false;
    const kdt_status st = prepare_from_logits(trees, target_logits, stop_tokens, num_stop_tokens, stop_sequences,
                                              max_commit, path_capacity, accepted_nodes, accept_length, bonus_token,
                                              target_tokens, request_status, true, temperature, &p, &empty);
    if (st != KDT_OK || empty) return st;
    p.temperature = temperature;
    p.key0 = (uint32_t)seed;
    p.key1 = (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32);
    p.ctr3 = (uint32_t)offset;
    return launch_dtype<kSample>(p, stream, "kdt_verify_sample_from_logits_cuda");
}

extern "C" kdt_status kdt_verify_sample_batch_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                   const kdt_sampling* sampling, const int32_t* stop_tokens,
                                                   int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences,
                                                   const int64_t* max_commit, int64_t path_capacity,
                                                   int32_t* accepted_nodes, int32_t* accept_length,
                                                   int32_t* bonus_token, int32_t* target_tokens,
                                                   int32_t* request_status, void* stream) {
    Params p;
    bool empty = false;
    kdt_status st = prepare_from_logits(trees, target_logits, stop_tokens, num_stop_tokens, stop_sequences,
                                        max_commit, path_capacity, accepted_nodes, accept_length, bonus_token,
                                        target_tokens, request_status, false, 0.0f, &p, &empty);
    if (st != KDT_OK || empty) return st;
    if (sampling == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "sampling is NULL");
    const struct {
        const void* ptr;
        size_t align;
        bool required;
        const char* name;
    } fields[] = {{sampling->temperature, 4, true, "sampling->temperature"},
                  {sampling->top_p, 4, false, "sampling->top_p"},
                  {sampling->top_k, 4, false, "sampling->top_k"},
                  {sampling->seed, 8, true, "sampling->seed"},
                  {sampling->offset, 8, true, "sampling->offset"}};
    for (const auto& f : fields) {
        if (f.required && f.ptr == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", f.name);
        st = kdt::check_aligned(f.ptr, f.align, f.name);
        if (st != KDT_OK) return st;
    }
    p.sampling = *sampling;
    return launch_dtype<kBatch>(p, stream, "kdt_verify_sample_batch_cuda");
}

// ---- kdt_choices_shard_cuda: each row's best of a vocabulary slice ----------------------
//
// One block per row (b, i) of a rank's slice of the target's logits: the argmax (temperature
// 0) or the Gumbel-max draw above keyed by the GLOBAL token id (vocab_offset + column), so
// each token's score is the one the unsharded verification computes, bit for bit. Each
// thread takes the columns tid, tid + blockDim.x, ... (increasing ids: strict comparisons
// keep the lower id on a tie) and one Philox call per token (its word v % 4); the block
// reduces (order_key(value) << 32) | ~id keys, so the lowest id wins a tie there too.

namespace {

constexpr int kShardThreads = 256;

struct ShardParams {
    const void* data;
    int64_t batch_stride, row_stride, vocab, rows_per_request, vocab_offset;
    kdt_sampling sampling;
    const int32_t* nodes;
    double* out;
};

template <int Dtype>
__global__ void __launch_bounds__(kShardThreads) choices_shard_kernel(ShardParams p) {
    __shared__ uint64_t s_warp[kShardThreads / 32];
    const int64_t row = blockIdx.x;
    const int64_t b = row / p.rows_per_request, i = row % p.rows_per_request;
    const float T = p.sampling.temperature[b];
    const bool greedy = T == 0.0f;
    const bool bad_setting = !(greedy || (isfinite(T) && T >= 1e-6f));
    const uint64_t seed = p.sampling.seed[b], offset = p.sampling.offset[b];
    const uint32_t key0 = (uint32_t)seed, key1 = (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32);
    const uint32_t ctr3 = (uint32_t)offset;
    const uint32_t node = p.nodes != nullptr ? (uint32_t)p.nodes[row] : (uint32_t)i;
    constexpr int64_t kEsize = Dtype == KDT_DTYPE_FLOAT32 ? 4 : 2;
    const char* base = static_cast<const char*>(p.data) + (b * p.batch_stride + i * p.row_stride) * kEsize;
    float best = -INFINITY;
    int64_t best_v = -1;
    int bad = 0, any = 0;
    for (int64_t c = threadIdx.x; c < p.vocab; c += blockDim.x) {
        const float x = kdt::load_logit<Dtype>(base, c);
        const int64_t v = p.vocab_offset + c;
        if (greedy) {
            bad |= isnan(x);
            if (best_v < 0 || x > best) {
                best = x;
                best_v = v;
            }
            continue;
        }
        bad |= isnan(x) || x == INFINITY;
        const float s = __fdiv_rn(x, T);
        if (s == -INFINITY) continue;  // its score is -inf: never drawn
        const kdt::Philox4 r = kdt::philox4x32_10((uint32_t)(v >> 2), node, (uint32_t)b, ctr3, key0, key1);
        const float score = __fadd_rn(s, gumbel_noise(r.x[v & 3]));
        if (score > best) {
            best = score;
            best_v = v;
        }
    }
    uint64_t mine = 0;
    if (best_v >= 0) {
        const float x = best == 0.0f ? 0.0f : best;  // -0 ties with +0: the lower id wins
        mine = ((uint64_t)kdt::float_order_key(x) << 32) | (uint64_t)(~(uint32_t)best_v);
        any = best > -INFINITY;
    }
    const uint64_t top = block_max_u64(mine, s_warp);
    bad = __syncthreads_or(bad);
    any = __syncthreads_or(any);
    if (threadIdx.x == 0) {
        double* o = p.out + 4 * row;
        if (top == 0) {
            o[0] = -INFINITY;
            o[1] = -1.0;
        } else {
            o[0] = (double)kdt::float_from_order_key((uint32_t)(top >> 32));
            o[1] = (double)(~(uint32_t)(top & 0xFFFFFFFFu));
        }
        o[2] = (bad || bad_setting) ? 1.0 : 0.0;
        o[3] = any ? 1.0 : 0.0;
    }
}

}  // namespace

extern "C" kdt_status kdt_choices_shard_cuda(const kdt_logits* logits, int64_t vocab_offset,
                                             const kdt_sampling* sampling, const int32_t* nodes, double* out,
                                             void* stream) {
    kdt_status st = kdt::check_logits(logits, "logits", -1, -1);
    if (st != KDT_OK) return st;
    const int64_t rows = logits->batch * logits->length;
    if (vocab_offset < 0 || (rows > 0 && vocab_offset + logits->vocab > (int64_t)INT32_MAX + 1)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab_offset (%lld) + the slice's vocab (%lld) must be in [0, 2^31]",
                        (long long)vocab_offset, (long long)logits->vocab);
    }
    if (rows > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "rows %lld exceeds %d", (long long)rows, INT32_MAX);
    if (rows == 0) return kdt_ok();
    if (sampling == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "sampling is NULL");
    if (sampling->top_p != NULL || sampling->top_k != NULL) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "sampling->top_p and sampling->top_k must be NULL: their cuts need "
                        "the whole row");
    }
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const struct {
        const void* ptr;
        size_t align;
        bool required;
        const char* name;
    } fields[] = {{sampling->temperature, 4, true, "sampling->temperature"},
                  {sampling->seed, 8, true, "sampling->seed"},
                  {sampling->offset, 8, true, "sampling->offset"},
                  {nodes, 4, false, "nodes"},
                  {out, 8, true, "out"}};
    for (const auto& f : fields) {
        if (f.required && f.ptr == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", f.name);
        st = kdt::check_aligned(f.ptr, f.align, f.name);
        if (st != KDT_OK) return st;
    }
    ShardParams p;
    p.data = logits->data;
    p.batch_stride = logits->batch_stride;
    p.row_stride = logits->row_stride;
    p.vocab = logits->vocab;
    p.rows_per_request = logits->length;
    p.vocab_offset = vocab_offset;
    p.sampling = *sampling;
    p.nodes = nodes;
    p.out = out;
    const cudaStream_t s = kdt::as_stream(stream);
    switch (logits->dtype) {
        case KDT_DTYPE_FLOAT32:
            choices_shard_kernel<KDT_DTYPE_FLOAT32><<<(unsigned)rows, kShardThreads, 0, s>>>(p);
            break;
        case KDT_DTYPE_FLOAT16:
            choices_shard_kernel<KDT_DTYPE_FLOAT16><<<(unsigned)rows, kShardThreads, 0, s>>>(p);
            break;
        default:
            choices_shard_kernel<KDT_DTYPE_BFLOAT16><<<(unsigned)rows, kShardThreads, 0, s>>>(p);
            break;
    }
    return kdt::launch_status("kdt_choices_shard_cuda");
}
