// Tree attention for the target's verify forward (kdt_tree_attention_cuda).
//
// For request b with p cached prefix tokens and n draft nodes, the R = N + 1 tree rows
// (root first) attend to the keys 0 .. p + n of the cache: the prefix (every real row sees
// all of it) and the tree's own rows, written by the verify forward at p + j, of which row
// i sees j == i and its ancestors (bit j of visibility_bits[b][i]).
//
// Work split: one CTA takes one (request, KV head, split of the keys, tile of 128 query
// vectors). The query vectors of a KV head are its G = q_heads / kv_heads query heads at
// each tree row, packed as m = row * G + g, so each K/V byte of a tile is read once for all
// G heads. Eight warps take 16 query vectors each (a warp past the real rows only loads);
// scores and the output accumulate in float32 through mma.sync m16n8k16 (16-bit inputs,
// fragments by ldmatrix, V's transposed), with the online softmax of FlashAttention-2 in
// registers. Long contexts split the keys into chunks of `chunk`
// keys (the last chunk holds the tree's keys too); each split writes its normalised output
// and log-sum-exp to the workspace and a merge kernel combines them exactly:
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
//
// A check kernel first sets each request's status (tree size, prefix length, cache
// bounds, page ids); the attention kernels read it and write a failed request's rows as
// zeros with lse -inf, so every output element is written on every call.
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kTileM = 128;          // query vectors a CTA
constexpr int kChunkAlign = 64;      // split boundaries (a multiple of every tile's keys)
constexpr int kPad = 8;              // shared-memory row padding (elements): conflict-free fragment loads
constexpr int64_t kMaxBudget = 262143;
constexpr int64_t kMaxPrefix = (INT64_C(1) << 31) - (INT64_C(1) << 19);  // keys (prefix + rows) fit int32
constexpr int64_t kTargetCtas = 264;  // 2 CTAs per SM of a 132-SM H100/H200
constexpr int64_t kMinChunk = 256;    // keys a split at least

struct AttnParams {
    const char* q;
    int64_t q_bs, q_rs, q_hs;  // elements
    char* out;
    int64_t o_bs, o_rs, o_hs;
    float* lse;  // [B, R, Hq] or NULL
    const char* k;
    const char* v;
    int64_t c_outer, c_head, c_token;  // elements
    const int32_t* block_table;       // NULL: contiguous
    int64_t bt_stride, page_size, capacity;
    int64_t batch, rows, q_heads, kv_heads, group, words;
    int64_t q_tiles;
    const int32_t* num_nodes;
    const uint32_t* vis;
    const int64_t* prefix;
    int64_t max_prefix;
    float scale_log2;
    int64_t chunk;
    int32_t splits;
    float* part_o;    // [splits, B, R, Hq, D]
    float* part_lse;  // [splits, B, R, Hq]
    int32_t* status;
};

// ---- 16-bit element helpers ----------------------------------------------------------

template <typename T> struct Elem;
template <> struct Elem<__half> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// 16 bytes global -> shared without registers (cp.async, L2 only); zeros when !live.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool live) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(live ? 16 : 0));
}

// ---- per-request checks ----------------------------------------------------------------

__global__ void check_kernel(AttnParams c) {
    const int64_t b = blockIdx.x;
    __shared__ int32_t verdict;
    if (threadIdx.x == 0) {
        int32_t st = KDT_OK;
        const int32_t n = c.num_nodes[b];
        const int64_t p = c.prefix[b];
        if (n < 0 || (int64_t)n > c.rows - 1) {
            st = KDT_ERR_VALUE;
        } else if (p < 0 || p > c.max_prefix) {
            st = KDT_ERR_OUT_OF_RANGE;
        } else if (c.block_table == nullptr) {
            if (p + n + 1 > c.capacity) st = KDT_ERR_OUT_OF_RANGE;
        } else if ((p + n) / c.page_size >= c.bt_stride) {
            st = KDT_ERR_OUT_OF_RANGE;
        }
        verdict = st;
    }
    __syncthreads();
    // Every page the request reads must be a page of the pool. The condition is read before
    // the barrier, so the whole block takes the same branch; failures go to another flag.
    __shared__ int32_t bad_page;
    const bool scan = verdict == KDT_OK && c.block_table != nullptr;
    if (threadIdx.x == 0) bad_page = 0;
    __syncthreads();
    if (scan) {
        const int64_t pages = (c.prefix[b] + c.num_nodes[b]) / c.page_size + 1;
        for (int64_t i = threadIdx.x; i < pages; i += blockDim.x) {
            const int32_t pg = c.block_table[b * c.bt_stride + i];
            if (pg < 0 || (int64_t)pg >= c.capacity) bad_page = 1;  // benign race: same value
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) c.status[b] = bad_page ? KDT_ERR_OUT_OF_RANGE : verdict;
}

// ---- the tile steps every kernel shares ------------------------------------------------
//
// A score tile in registers has the accumulator layout of mma m16n8 (and of each warp's
// 16 rows of a wgmma m64): element sc[j][e] of a thread is row m_lo (e < 2) or m_lo + 8
// (e >= 2) and key t0 + 8 j + 2 tig + (e & 1).

// Sets to -inf the scores of keys at or past k_end and of tree keys (>= p) that the row
// does not see (bit key - p of its visibility row; rows past the real ones read the last
// real row's bits, their outputs are never used).
template <int TN>
__device__ __forceinline__ void mask_tile(float (&sc)[TN / 8][4], const AttnParams& c, int64_t b, int m_lo, int m_real,
                                          int group, int t0, int p, int k_end, int tig) {
    const int r_lo = min(m_lo, m_real - 1) / group, r_hi = min(m_lo + 8, m_real - 1) / group;
    const uint32_t* vis_lo = c.vis + (b * c.rows + r_lo) * c.words;
    const uint32_t* vis_hi = c.vis + (b * c.rows + r_hi) * c.words;
#pragma unroll
    for (int j = 0; j < TN / 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = t0 + j * 8 + tig * 2 + (e & 1);
            bool visible = key < k_end;
            if (visible && key >= p) {
                const int jj = key - p;
                const uint32_t w = (e >= 2 ? vis_hi : vis_lo)[jj >> 5];
                visible = (w >> (jj & 31)) & 1u;
            }
            if (!visible) sc[j][e] = -INFINITY;
        }
    }
}

// 2^x by the special-function unit alone (results below 2^-126 flush to 0: a weight that
// small is nothing beside the row's largest, which is 1).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The online softmax step of FlashAttention-2 over one tile, in log2 units: updates the two
// rows' running max mx (raw scores) and sum l (this thread's keys; the quad's sum is taken
// at the end), turns the scores into weights exp2((s - mx) * scale) and returns in alpha
// the factors exp2((mx_old - mx) * scale) the output accumulator is to be rescaled by.
template <int TN>
__device__ __forceinline__ void softmax_weights(float (&sc)[TN / 8][4], float (&mx)[2], float (&l)[2],
                                                float (&alpha)[2], float scale) {
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < TN / 8; j++) {
        tmax[0] = fmaxf(tmax[0], fmaxf(sc[j][0], sc[j][1]));
        tmax[1] = fmaxf(tmax[1], fmaxf(sc[j][2], sc[j][3]));
    }
    float msub[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
        const float mnew = fmaxf(mx[h], tmax[h]);
        // No visible key yet (mnew = -inf): nothing to rescale, every weight 0.
        alpha[h] = mnew == -INFINITY ? 1.f : exp2f((mx[h] - mnew) * scale);
        msub[h] = mnew == -INFINITY ? 0.f : mnew * scale;
        mx[h] = mnew;
    }
    float rsum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < TN / 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float pv = fast_exp2(fmaf(sc[j][e], scale, -msub[e >> 1]));
            sc[j][e] = pv;
            rsum[e >> 1] += pv;
        }
    }
    l[0] = l[0] * alpha[0] + rsum[0];
    l[1] = l[1] * alpha[1] + rsum[1];
}

template <int NO>
__device__ __forceinline__ void rescale(float (&o)[NO][4], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < NO; i++) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
    }
}

// The whole step: weights, then the output rescaled.
template <int TN, int NO>
__device__ __forceinline__ void softmax_tile(float (&sc)[TN / 8][4], float (&mx)[2], float (&l)[2], float (&o)[NO][4],
                                             float scale) {
    float alpha[2];
    softmax_weights<TN>(sc, mx, l, alpha, scale);
    rescale(o, alpha);
}

// The A fragment of keys 16 kk .. 16 kk + 15 of P (the weights of a score tile), for
// mma m16n8k16 and wgmma m64 (A from registers): the accumulator layout, two n8 tiles.
template <typename T, int TN>
__device__ __forceinline__ void pack_p(const float (&sc)[TN / 8][4], int kk, uint32_t (&a)[4]) {
    a[0] = Elem<T>::pack(sc[2 * kk][0], sc[2 * kk][1]);
    a[1] = Elem<T>::pack(sc[2 * kk][2], sc[2 * kk][3]);
    a[2] = Elem<T>::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
    a[3] = Elem<T>::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
}

// The end of a tile of query vectors: this thread's two rows m_lo and m_lo + 8 (of KV head
// hk) get the quad's row sums, then their output columns d0 + 8 i + 2 tig (+1) of dv: the
// normalised output and lse straight to out (one split), or to the split's partial output
// and lse (real rows only). Rows past the real ones (padding rows, a failed request) are
// written as zeros with lse -inf; query vectors past m_count are not rows. lse_writer: the
// thread that writes the row's lse among warps sharing its columns.
template <typename T, int NO>
__device__ __forceinline__ void write_rows(const AttnParams& c, const float (&o)[NO][4], const float (&mx)[2],
                                           float (&l)[2], int64_t b, int64_t hk, int m_lo, int m_count, int m_real,
                                           int s, int d0, int dv, bool lse_writer, int tig) {
    const int group = (int)c.group;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int m = m_lo + 8 * h;
        if (m >= m_count) continue;
        const int64_t row = m / group, hq = hk * group + m % group;
        const bool seen = m < m_real && l[h] > 0.f;
        const float inv = seen ? 1.f / l[h] : 0.f;
        const float lse = seen ? (mx[h] * c.scale_log2 + log2f(l[h])) * 0.69314718055994531f : -INFINITY;
        if (c.splits == 1) {
            T* dst = reinterpret_cast<T*>(c.out) + b * c.o_bs + row * c.o_rs + hq * c.o_hs + d0;
#pragma unroll
            for (int i = 0; i < NO; i++) {
                const int d = i * 8 + tig * 2;
                *reinterpret_cast<uint32_t*>(dst + d) = Elem<T>::pack(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
            }
            if (c.lse != nullptr && tig == 0 && lse_writer) c.lse[(b * c.rows + row) * c.q_heads + hq] = lse;
        } else if (m < m_real) {
            const int64_t cell = (((int64_t)s * c.batch + b) * c.rows + row) * c.q_heads + hq;
            float* dst = c.part_o + cell * dv + d0;
#pragma unroll
            for (int i = 0; i < NO; i++) {
                const int d = i * 8 + tig * 2;
                *reinterpret_cast<float2*>(dst + d) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
            }
            if (tig == 0 && lse_writer) c.part_lse[cell] = lse;
        }
    }
}

// ---- the attention kernel ---------------------------------------------------------------

// Fragments of mma.m16n8k16 from shared memory (row addresses 16-byte aligned).
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// A kernel configuration: MT m16 tiles of query vectors a warp, kTileM / (16 MT) warps,
// two shared K/V buffers of kN keys (32 for head_dim 256, whose output fragments fill the
// registers).
template <int D, int MT> struct Config {
    static constexpr int kMT = MT;
    static constexpr int kWarpsC = kTileM / (16 * MT);
    static constexpr int kThreadsC = kWarpsC * 32;
    static constexpr int kN = D > 128 ? 32 : 64;
    static constexpr int kLD = D + kPad;  // shared row length (elements)
    static constexpr size_t smem_bytes(size_t elem) { return (size_t)(kTileM + 4 * kN) * kLD * elem; }
};

template <typename T, int D, typename C>
__global__ void __launch_bounds__(C::kThreadsC, (D > 128 || C::kMT > 1) ? 1 : 2) attention_kernel(AttnParams c) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int MT = C::kMT;
    constexpr int NT = C::kThreadsC;
    constexpr int TN = C::kN;
    constexpr int LD = C::kLD;
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + kTileM * LD;  // two buffers of [K tile; V tile]

    const int64_t tile = blockIdx.x % c.q_tiles;
    const int64_t bh = blockIdx.x / c.q_tiles;
    const int64_t hk = bh % c.kv_heads;
    const int64_t b = bh / c.kv_heads;
    const int32_t s = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const bool direct = c.splits == 1;

    // Key positions are int32: prefix + rows < 2^31 (kMaxPrefix).
    const int32_t st = c.status[b];
    const int n = st == KDT_OK ? c.num_nodes[b] : -1;
    const int p = st == KDT_OK ? (int)c.prefix[b] : 0;
    const int total = st == KDT_OK ? p + n + 1 : 0;  // keys of this request
    const int k_begin = (int)min((int64_t)s * c.chunk, (int64_t)INT32_MAX);
    const int k_end = (int)min((int64_t)total, (int64_t)k_begin + c.chunk);
    const int group = (int)c.group;
    const int m0 = (int)tile * kTileM;
    const int m_count = (int)c.rows * group;  // query vectors of this KV head (all rows; < 2^31 by the launch check)
    const int m_real = (n + 1) * group;       // of real rows (0 when failed)

    // Split s has no keys for this request: when writing straight to the output, split 0
    // still writes its rows (zeros for a failed request / padding rows); the merge reads
    // only the splits that have keys.
    if (k_begin >= k_end) {
        if (!direct || s != 0) return;
    }

    // Q tile -> shared (zeros past the real rows).
    constexpr int kVec = 8;  // 16-byte vectors of 8 elements
    for (int idx = threadIdx.x; idx < kTileM * (D / kVec); idx += NT) {
        const int r = idx / (D / kVec), cv = idx % (D / kVec);
        const int m = m0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (m < m_real) {
            const int64_t row = m / group, hq = hk * group + m % group;
            val = *reinterpret_cast<const uint4*>(c.q + (b * c.q_bs + row * c.q_rs + hq * c.q_hs + cv * kVec) *
                                                            (int64_t)sizeof(T));
        }
        *reinterpret_cast<uint4*>(sQ + r * LD + cv * kVec) = val;
    }

    // The warp's query vectors: m16 tile t covers wm + 16 t .. + 15; this thread's rows of
    // tile t are wm + 16 t + gid (lo) and + 8 (hi). A warp whose rows are all past the real
    // ones only helps load the tiles.
    const int wm = m0 + warp * 16 * MT;
    const bool warp_live = wm < m_real;

    float o[MT][D / 8][4];
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int i = 0; i < D / 8; i++) o[t][i][0] = o[t][i][1] = o[t][i][2] = o[t][i][3] = 0.f;
    float mx[MT][2], l[MT][2];  // running max (raw scores) and sum of each row
#pragma unroll
    for (int t = 0; t < MT; t++) mx[t][0] = mx[t][1] = -INFINITY, l[t][0] = l[t][1] = 0.f;

    const bool any_row = m0 < m_real;
    // K and V tiles go global -> shared by cp.async. Keys past k_end are zero-filled (never
    // NaN under a zero weight).
    // Each thread moves the same 16-byte column of kLoads rows every tile.
    constexpr int kCols = D / kVec;
    constexpr int kLoads = TN * kCols / NT;
    static_assert(TN * kCols % NT == 0, "whole tiles per thread");
    const int my_col = threadIdx.x % kCols, my_row = threadIdx.x / kCols;
    constexpr int kRowStep = NT / kCols;
    const bool paged = c.block_table != nullptr;
    const char* kbase = c.k + ((paged ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
    const char* vbase = c.v + ((paged ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
    const int64_t tok_bytes = c.c_token * (int64_t)sizeof(T);
    auto issue_tile = [&](int t0, int buf) {
        if (t0 < k_end) {
            T* dk = sKV + buf * 2 * TN * LD;
            T* dv = dk + TN * LD;
#pragma unroll
            for (int it = 0; it < kLoads; it++) {
                const int r = my_row + it * kRowStep;
                const int t = t0 + r;
                const bool live = t < k_end;
                int64_t off = 0;
                if (live) {
                    if (!paged) {
                        off = (int64_t)t * tok_bytes;
                    } else {
                        const int pg_size = (int)c.page_size;
                        const int64_t page = c.block_table[b * c.bt_stride + t / pg_size];
                        off = (page * c.c_outer + (int64_t)(t % pg_size) * c.c_token) * (int64_t)sizeof(T);
                    }
                }
                cp_async16(dk + r * LD + my_col * kVec, kbase + off, live);
                cp_async16(dv + r * LD + my_col * kVec, vbase + off, live);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);  // (empty past the end: wait_group 1 stays right)
    };
    if (any_row) issue_tile(k_begin, 0);

    // ldmatrix addresses (element offsets in a tile): lane i gives row i % 8 of matrix i / 8.
    const int mat = lane / 8, mrow = lane % 8;
    const int q_off = (warp * 16 * MT + mrow + (mat & 1) * 8) * LD + (mat >> 1) * 8;  // A: rows lo/hi x k lo/hi
    const int k_off = ((mat >> 1) * 8 + mrow) * LD + (mat & 1) * 8;                   // B of two key groups
    const int v_off = ((mat & 1) * 8 + mrow) * LD + (mat >> 1) * 8;                   // B^T of two d groups
    const float scale = c.scale_log2;

    // Two buffers: tile i + 1 is requested before waiting for tile i (issue, wait, sync,
    // compute, sync). Measured on an H200 (b9d4dff + the configurations of Config): this
    // order beat waiting first, and three or four buffers at one CTA a SM lost to two
    // CTAs a SM with two.
    int buf = 0;
    for (int t0 = k_begin; any_row && t0 < k_end; t0 += TN, buf ^= 1) {
        issue_tile(t0 + TN, buf ^ 1);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();  // tile t0 (and, the first time, Q) visible to every warp
        if (warp_live) {
            const T* sK = sKV + buf * 2 * TN * LD;
            const T* sV = sK + TN * LD;

            // S = Q K^T for the warp's rows and the tile's keys (raw scores).
            float sc[MT][TN / 8][4];
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int j = 0; j < TN / 8; j++) sc[t][j][0] = sc[t][j][1] = sc[t][j][2] = sc[t][j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++) ldmatrix_x4(a[t], sQ + q_off + t * 16 * LD + kk * 16);
#pragma unroll
                for (int j = 0; j < TN / 8; j += 2) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, sK + k_off + j * 8 * LD + kk * 16);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        Elem<T>::mma(sc[t][j], a[t], bf);
                        Elem<T>::mma(sc[t][j + 1], a[t], bf + 2);
                    }
                }
            }

            // Masking, only where the tile reaches the tree or the end of the split's keys;
            // then the online softmax (rows lo: elements 0, 1; hi: 2, 3).
#pragma unroll
            for (int t = 0; t < MT; t++) {
                if (t0 + TN > min(p, k_end)) mask_tile<TN>(sc[t], c, b, wm + 16 * t + gid, m_real, group, t0, p, k_end, tig);
                softmax_tile<TN, D / 8>(sc[t], mx[t], l[t], o[t], scale);
            }

            // O += P V: P's accumulator layout is the A operand's, 16 keys at a time; V's
            // fragments come transposed by ldmatrix.trans, two d groups of 8 at a time.
#pragma unroll
            for (int kk = 0; kk < TN / 16; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++) pack_p<T, TN>(sc[t], kk, a[t]);
#pragma unroll
                for (int i = 0; i < D / 8; i += 2) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, sV + v_off + kk * 16 * LD + i * 8);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        Elem<T>::mma(o[t][i], a[t], bf);
                        Elem<T>::mma(o[t][i + 1], a[t], bf + 2);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is loaded again
    }
    asm volatile("cp.async.wait_group 0;\n" ::);  // no copy outlives the CTA

    // Row sums across the quad, then the rows' outputs.
#pragma unroll
    for (int t = 0; t < MT; t++) write_rows<T, D / 8>(c, o[t], mx[t], l[t], b, hk, wm + 16 * t + gid, m_count, m_real, s, 0, D, true, tig);
}

// ---- MLA (absorbed multi-head latent attention) ------------------------------------------
//
// DeepSeek-V3 / Kimi-K2 layout: one latent KV head of kMlaDk = 576 values a token (the
// 512-value latent c, then the 64 rotary key values); the query heads' absorbed queries have
// 576 values too; V is the latent itself, the first kMlaDv = 512 values of each cached
// token. A CTA takes 64 query vectors (m = row * heads + h) and 32-key tiles; its 8 warps
// pair up on an m16 tile: warp w takes tile w % 4 and half w / 4 of the work: the half of
// the 576 dims of Q K^T (the pair sums its two partial scores through shared memory, in the
// same order in both warps, so both see the same scores and softmax) and the half of the
// 512 output dims.
constexpr int kMlaDk = 576;
constexpr int kMlaDv = 512;
constexpr int kMlaM = 64;
constexpr int kMlaN = 32;
constexpr int kMlaThreads = 256;
constexpr int kMlaLD = kMlaDk + kPad;
constexpr int kMlaTargetCtas = 132;  // one CTA a SM
constexpr size_t kMlaSmem =
    (size_t)(kMlaM + 2 * kMlaN) * kMlaLD * 2 + (size_t)(kMlaThreads / 32) * 16 * kMlaN * sizeof(float);

template <typename T>
__global__ void __launch_bounds__(kMlaThreads, 1) mla_kernel(AttnParams c) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int LD = kMlaLD, TN = kMlaN;
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + kMlaM * LD;  // two buffers of a K tile (V is its first 512 columns)
    float* xs = reinterpret_cast<float*>(sK + 2 * TN * LD);  // [warp][16 x TN] partial scores

    const int64_t tile = blockIdx.x % c.q_tiles;
    const int64_t b = blockIdx.x / c.q_tiles;
    const int32_t s = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const int mt = warp & 3, half = warp >> 2;
    const bool direct = c.splits == 1;

    const int32_t st = c.status[b];
    const int n = st == KDT_OK ? c.num_nodes[b] : -1;
    const int p = st == KDT_OK ? (int)c.prefix[b] : 0;
    const int total = st == KDT_OK ? p + n + 1 : 0;
    const int k_begin = (int)min((int64_t)s * c.chunk, (int64_t)INT32_MAX);
    const int k_end = (int)min((int64_t)total, (int64_t)k_begin + c.chunk);
    const int group = (int)c.group;  // = q_heads (one KV head)
    const int m0 = (int)tile * kMlaM;
    const int m_count = (int)c.rows * group;
    const int m_real = (n + 1) * group;
    if (k_begin >= k_end) {
        if (!direct || s != 0) return;
    }

    constexpr int kVec = 8;
    constexpr int kCols = kMlaDk / kVec;  // 72 16-byte vectors a row
    for (int idx = threadIdx.x; idx < kMlaM * kCols; idx += kMlaThreads) {
        const int r = idx / kCols, cv = idx % kCols;
        const int m = m0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (m < m_real) {
            const int64_t row = m / group, hq = m % group;
            val = *reinterpret_cast<const uint4*>(c.q + (b * c.q_bs + row * c.q_rs + hq * c.q_hs + cv * kVec) *
                                                            (int64_t)sizeof(T));
        }
        *reinterpret_cast<uint4*>(sQ + r * LD + cv * kVec) = val;
    }

    const int wm = m0 + mt * 16;
    const bool warp_live = wm < m_real;  // (the same for both warps of a pair)

    float o[kMlaDv / 2 / 8][4];
#pragma unroll
    for (int i = 0; i < kMlaDv / 2 / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    const bool any_row = m0 < m_real;
    const bool paged = c.block_table != nullptr;
    const char* kbase = c.k + (paged ? 0 : b * c.c_outer) * (int64_t)sizeof(T);
    const int64_t tok_bytes = c.c_token * (int64_t)sizeof(T);
    constexpr int kLoads = TN * kCols / kMlaThreads;  // 9
    static_assert(TN * kCols % kMlaThreads == 0, "whole tiles per thread");
    auto issue_tile = [&](int t0, int buf) {
        if (t0 < k_end) {
            T* dk = sK + buf * TN * LD;
#pragma unroll
            for (int it = 0; it < kLoads; it++) {
                const int idx = threadIdx.x + it * kMlaThreads;
                const int r = idx / kCols, cv = idx % kCols;
                const int t = t0 + r;
                const bool live = t < k_end;
                int64_t off = 0;
                if (live) {
                    if (!paged) {
                        off = (int64_t)t * tok_bytes;
                    } else {
                        const int pg_size = (int)c.page_size;
                        const int64_t page = c.block_table[b * c.bt_stride + t / pg_size];
                        off = (page * c.c_outer + (int64_t)(t % pg_size) * c.c_token) * (int64_t)sizeof(T);
                    }
                }
                cp_async16(dk + r * LD + cv * kVec, kbase + off + cv * kVec * (int64_t)sizeof(T), live);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (any_row) issue_tile(k_begin, 0);

    const int mat = lane / 8, mrow = lane % 8;
    const int q_off = (mt * 16 + mrow + (mat & 1) * 8) * LD + (mat >> 1) * 8;
    const int k_off = ((mat >> 1) * 8 + mrow) * LD + (mat & 1) * 8;
    const int v_off = ((mat & 1) * 8 + mrow) * LD + (mat >> 1) * 8;
    const int qk0 = half * (kMlaDk / 2);  // this warp's half of Q K^T's dims
    const int dv0 = half * (kMlaDv / 2);  // and of the output's
    const float scale = c.scale_log2;
    float* my_xs = xs + warp * 16 * TN;
    const float* pair_xs = xs + (warp ^ 4) * 16 * TN;

    int buf = 0;
    for (int t0 = k_begin; any_row && t0 < k_end; t0 += TN, buf ^= 1) {
        issue_tile(t0 + TN, buf ^ 1);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();  // tile t0 (and, the first time, Q) visible to every warp
        const T* tK = sK + buf * TN * LD;
        float sc[TN / 8][4];
#pragma unroll
        for (int j = 0; j < TN / 8; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
        if (warp_live) {
#pragma unroll 6
            for (int kk = 0; kk < kMlaDk / 2 / 16; kk++) {
                uint32_t a[4];
                ldmatrix_x4(a, sQ + q_off + qk0 + kk * 16);
#pragma unroll
                for (int j = 0; j < TN / 8; j += 2) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tK + k_off + j * 8 * LD + qk0 + kk * 16);
                    Elem<T>::mma(sc[j], a, bf);
                    Elem<T>::mma(sc[j + 1], a, bf + 2);
                }
            }
#pragma unroll
            for (int j = 0; j < TN / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) my_xs[(j * 4 + e) * 32 + lane] = sc[j][e];
        }
        __syncthreads();  // both halves' partial scores are in shared memory
        if (warp_live) {
            // The pair's sum, the low half's partial first in both warps (the same bits).
#pragma unroll
            for (int j = 0; j < TN / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float other = pair_xs[(j * 4 + e) * 32 + lane];
                    sc[j][e] = half == 0 ? sc[j][e] + other : other + sc[j][e];
                }
            if (t0 + TN > min(p, k_end)) mask_tile<TN>(sc, c, b, wm + gid, m_real, group, t0, p, k_end, tig);
            softmax_tile<TN, kMlaDv / 2 / 8>(sc, mx, l, o, scale);
#pragma unroll
            for (int kk = 0; kk < TN / 16; kk++) {
                uint32_t a[4];
                pack_p<T, TN>(sc, kk, a);
#pragma unroll
                for (int i = 0; i < kMlaDv / 2 / 8; i += 2) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, tK + v_off + kk * 16 * LD + dv0 + i * 8);
                    Elem<T>::mma(o[i], a, bf);
                    Elem<T>::mma(o[i + 1], a, bf + 2);
                }
            }
        }
        __syncthreads();  // the tile's buffer and the partial scores are free again
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    write_rows<T, kMlaDv / 2 / 8>(c, o, mx, l, b, 0, wm + gid, m_count, m_real, s, dv0, kMlaDv, half == 0, tig);
}

// ---- Hopper (sm_90a): warpgroup MMA --------------------------------------------------------
//
// attention_kernel's work split and results with wgmma, the tensor-core path of sm_90a: a
// CTA's 128 query vectors are two warpgroups of 64 rows (warp w has rows 16 w .. 16 w + 15,
// in the m16n8 accumulator layout, so the tile steps above apply unchanged). S = Q K^T
// takes both operands from shared memory; O += P V takes P from registers and V from
// shared memory, N-major. Q, K and V sit in shared memory in the 128-byte swizzled layout
// wgmma reads: blocks of 64 columns (128 bytes a row), the 16-byte chunk c of row r at
// chunk c ^ (r % 8), every block 1024-byte aligned. K/V tiles of kN keys load by cp.async
// into Layout::kStages buffers; one barrier a tile.
#if defined(KDT_CUDA_SM90A)
namespace sm90 {

constexpr int kN = 128;        // keys a tile
constexpr int kThreads = 256;  // two warpgroups
constexpr int kSmemMax = 227 * 1024;  // a CTA's shared memory on sm_90

// Shared memory: Q, then kStages buffers of a K and a V tile; as many buffers (at most 6)
// as fit, so that up to kStages - 2 tiles load while the warpgroups work.
template <int D> struct Layout {
    static constexpr int kQBytes = kTileM * D * 2;
    static constexpr int kTileBytes = kN * D * 2;  // a K or V tile
    static constexpr int kFit = (kSmemMax - 1024 - kQBytes) / (2 * kTileBytes);
    static constexpr int kStages = kFit < 6 ? kFit : 6;
    static_assert(kStages >= 3, "the pipeline needs three buffers");
    static constexpr size_t kSmem = 1024 + kQBytes + (size_t)kStages * 2 * kTileBytes;  // + alignment slack
};

// The device helpers exist in the sm_90a pass only (other passes build an empty kernel).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk `chunk` (of D / 8) of row r in a swizzled [rows x D] tile.
__device__ __forceinline__ int swizzled(int r, int chunk, int rows) {
    return (chunk >> 3) * rows * 128 + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
}

// The shared-memory matrix descriptor of wgmma: start address, leading and stride byte
// offsets (>> 4), 128-byte swizzle.
__device__ __forceinline__ uint64_t descriptor(const void* smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (UINT64_C(1) << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are pending (groups complete in
// order).
template <int N>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Registers an asynchronous wgmma writes are read only after its wait: this keeps the
// compiler from moving their reads above it.
template <int N>
__device__ __forceinline__ void hold(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(r[i][e])::"memory");
}

// d (+)= A B for a 64 x N x 16 step, float32 accumulators in the m16n8 layout: ss (N 64 or
// 128) takes A and B (both K-major) from shared memory, accumulate = 0 overwriting d; rs
// (N 64) takes A from
// registers and B N-major (transposed) from shared memory, accumulating into the n8 tiles
// k .. k + 7 of d (k a compile-time constant after unrolling).
#define KDT_WGMMA_D32(d, k) \
    "+f"(d[(k) + 0][0]), "+f"(d[(k) + 0][1]), "+f"(d[(k) + 0][2]), "+f"(d[(k) + 0][3]), \
    "+f"(d[(k) + 1][0]), "+f"(d[(k) + 1][1]), "+f"(d[(k) + 1][2]), "+f"(d[(k) + 1][3]), \
    "+f"(d[(k) + 2][0]), "+f"(d[(k) + 2][1]), "+f"(d[(k) + 2][2]), "+f"(d[(k) + 2][3]), \
    "+f"(d[(k) + 3][0]), "+f"(d[(k) + 3][1]), "+f"(d[(k) + 3][2]), "+f"(d[(k) + 3][3]), \
    "+f"(d[(k) + 4][0]), "+f"(d[(k) + 4][1]), "+f"(d[(k) + 4][2]), "+f"(d[(k) + 4][3]), \
    "+f"(d[(k) + 5][0]), "+f"(d[(k) + 5][1]), "+f"(d[(k) + 5][2]), "+f"(d[(k) + 5][3]), \
    "+f"(d[(k) + 6][0]), "+f"(d[(k) + 6][1]), "+f"(d[(k) + 6][2]), "+f"(d[(k) + 6][3]), \
    "+f"(d[(k) + 7][0]), "+f"(d[(k) + 7][1]), "+f"(d[(k) + 7][2]), "+f"(d[(k) + 7][3])
#define KDT_WGMMA_D64(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
    "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
    "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define KDT_WGMMA_SS128(TY)                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY \
    " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
#define KDT_WGMMA_SS(TY)                                                                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY \
    " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
#define KDT_WGMMA_RS(TY)                                                                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY \
    " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
        asm volatile(KDT_WGMMA_SS("f16") : KDT_WGMMA_D32(d, 0) : "l"(a), "l"(b), "r"(accumulate));
    }
    static __device__ __forceinline__ void ss(float (&d)[16][4], uint64_t a, uint64_t b, int accumulate) {
        asm volatile(KDT_WGMMA_SS128("f16") : KDT_WGMMA_D64(d) : "l"(a), "l"(b), "r"(accumulate));
    }
    template <int NO>
    static __device__ __forceinline__ void rs(float (&d)[NO][4], int k, const uint32_t (&a)[4], uint64_t b) {
        asm volatile(KDT_WGMMA_RS("f16") : KDT_WGMMA_D32(d, k) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
        asm volatile(KDT_WGMMA_SS("bf16") : KDT_WGMMA_D32(d, 0) : "l"(a), "l"(b), "r"(accumulate));
    }
    static __device__ __forceinline__ void ss(float (&d)[16][4], uint64_t a, uint64_t b, int accumulate) {
        asm volatile(KDT_WGMMA_SS128("bf16") : KDT_WGMMA_D64(d) : "l"(a), "l"(b), "r"(accumulate));
    }
    template <int NO>
    static __device__ __forceinline__ void rs(float (&d)[NO][4], int k, const uint32_t (&a)[4], uint64_t b) {
        asm volatile(KDT_WGMMA_RS("bf16") : KDT_WGMMA_D32(d, k) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    }
};
#undef KDT_WGMMA_SS
#undef KDT_WGMMA_SS128
#undef KDT_WGMMA_D64
#undef KDT_WGMMA_RS
#undef KDT_WGMMA_D32
// The first 1024-byte aligned address of the dynamic shared memory (the swizzle repeats
// every 1024 bytes of shared address; Layout's slack covers the offset).
__device__ __forceinline__ unsigned char* aligned(unsigned char* smem) {
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem);
    return smem + ((1024u - (raw & 1023u)) & 1023u);
}

// What a CTA of the sm_90 kernels takes: request b, KV head hk, split s (keys k_begin ..
// k_end of the request's p + n + 1), query vectors m0 .. m0 + 127 of the KV head's m_count
// (m_real of them real rows; a failed request has none).
struct Cta {
    int64_t b, hk;
    int32_t s;
    int p, k_begin, k_end, m0, m_count, m_real;
    __device__ __forceinline__ explicit Cta(const AttnParams& c) {
        const int64_t bh = blockIdx.x / c.q_tiles;
        hk = bh % c.kv_heads;
        b = bh / c.kv_heads;
        s = blockIdx.y;
        const int32_t st = c.status[b];
        const int n = st == KDT_OK ? c.num_nodes[b] : -1;
        p = st == KDT_OK ? (int)c.prefix[b] : 0;
        const int total = st == KDT_OK ? p + n + 1 : 0;
        k_begin = (int)min((int64_t)s * c.chunk, (int64_t)INT32_MAX);
        k_end = (int)min((int64_t)total, (int64_t)k_begin + c.chunk);
        m0 = (int)(blockIdx.x % c.q_tiles) * kTileM;
        m_count = (int)(c.rows * c.group);
        m_real = (n + 1) * (int)c.group;
    }
};

// The CTA's 128 query vectors (zeros past the real rows) into the swizzled Q tile, by
// `threads` threads.
template <typename T, int D>
__device__ __forceinline__ void load_q(const AttnParams& c, unsigned char* sQ, int64_t b, int64_t hk, int m0,
                                       int m_real, int threads) {
    constexpr int kCols = D / 8;
    const int64_t group = c.group;
    for (int idx = threadIdx.x; idx < kTileM * kCols; idx += threads) {
        const int r = idx / kCols, cv = idx % kCols;
        const int m = m0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (m < m_real) {
            const int64_t row = m / group, hq = hk * group + m % group;
            val = *reinterpret_cast<const uint4*>(c.q + (b * c.q_bs + row * c.q_rs + hq * c.q_hs + cv * 8) *
                                                            (int64_t)sizeof(T));
        }
        *reinterpret_cast<uint4*>(sQ + swizzled(r, cv, kTileM)) = val;
    }
}

// S = Q K^T of a warpgroup's 64 query vectors (qa: their rows of the Q tile) against the
// K tile at sK (asynchronous; one committed group).
template <typename T, int D>
__device__ __forceinline__ void issue_scores(float (&sc)[kN / 8][4], const unsigned char* qa, const unsigned char* sK) {
    hold(sc);
    fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const uint64_t da = descriptor(qa + (kk >> 2) * kTileM * 128 + (kk & 3) * 32, 16, 1024);
        const uint64_t db = descriptor(sK + (kk >> 2) * kN * 128 + (kk & 3) * 32, 16, 1024);
        Mma<T>::ss(sc, da, db, kk > 0);
    }
    commit();
}

// O += P V, 64 output columns (one swizzled block of the V tile at sV) a step; within a
// block the 8-key groups are 1024 bytes apart (asynchronous; one committed group).
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 8][4], const uint32_t (&a)[kN / 16][4],
                                         const unsigned char* sV) {
    hold(o);
    fence();
#pragma unroll
    for (int kk = 0; kk < kN / 16; kk++) {
#pragma unroll
        for (int nb = 0; nb < D / 64; nb++) {
            const uint64_t dvd = descriptor(sV + nb * kN * 128 + kk * 16 * 128, 1024, 1024);
            Mma<T>::rs(o, nb * 8, a[kk], dvd);
        }
    }
    commit();
}

// The scores of the tile at key t0 are in sc: masked (where the tile reaches the tree or
// k_end), then turned into weights; alpha: the rescale the output still owes. m_lo: this
// thread's first row.
__device__ __forceinline__ void tile_weights(float (&sc)[kN / 8][4], float (&mx)[2], float (&l)[2],
                                             float (&alpha)[2], const AttnParams& c, int64_t b, int m_lo,
                                             int m_real, int t0, int p, int k_end, int tig) {
    hold(sc);
    if (__shfl_sync(0xffffffffu, t0 + kN > min(p, k_end), 0)) {
        mask_tile<kN>(sc, c, b, m_lo, m_real, (int)c.group, t0, p, k_end, tig);
    }
    softmax_weights<kN>(sc, mx, l, alpha, c.scale_log2);
    hold(sc);  // the weights are computed here, before the wait that follows
}

// The A fragments of P for the P V product.
template <typename T>
__device__ __forceinline__ void pack(const float (&sc)[kN / 8][4], uint32_t (&a)[kN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; kk++) pack_p<T, kN>(sc, kk, a[kk]);
}
// The pipelined loop of a warpgroup with real rows over ntiles K/V tiles (tile i in buffer
// i % S of sKV, each buffer a K tile then a V tile), FlashAttention-3's overlap within a
// warpgroup: while P(i) V(i) runs on the tensor cores, the warpgroup takes the softmax of
// tile i + 1, whose scores S(i + 1) were issued just before. The kernels differ only in
// their synchronisation: ready(i) returns once tile i is in shared memory; turn_begin()
// and turn_end() bracket each issue of products; done(i) follows the wait for the P V
// product that read buffer i. No branch inside the loop (a branch around a wgmma or its
// accumulators makes the compiler serialise the products).
template <typename T, int D, int S, typename Ready, typename TurnBegin, typename TurnEnd, typename Done>
__device__ __forceinline__ void run_tiles(float (&o)[D / 8][4], float (&mx)[2], float (&l)[2], const AttnParams& c,
                                          const Cta& w, const unsigned char* qa, const unsigned char* sKV,
                                          int ntiles, int m_lo, int tig, Ready ready, TurnBegin turn_begin,
                                          TurnEnd turn_end, Done done) {
    constexpr int kTileBytes = kN * D * 2;
    float sc[kN / 8][4];
#pragma unroll
    for (int j = 0; j < kN / 8; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    uint32_t a[kN / 16][4];
    float alpha[2];
    auto weights = [&](int i) {
        tile_weights(sc, mx, l, alpha, c, w.b, m_lo, w.m_real, w.k_begin + i * kN, w.p, w.k_end, tig);
    };
    ready(0);
    turn_begin();
    issue_scores<T, D>(sc, qa, sKV);
    turn_end();
    wait<0>();
    weights(0);  // (o is still zero: no rescale)
    pack<T>(sc, a);
    for (int i = 0; i + 1 < ntiles; i++) {
        ready(i + 1);
        turn_begin();
        issue_scores<T, D>(sc, qa, sKV + ((i + 1) % S) * 2 * kTileBytes);
        issue_pv<T, D>(o, a, sKV + (i % S) * 2 * kTileBytes + kTileBytes);
        turn_end();
        wait<1>();  // S(i + 1) (committed before P(i) V(i))
        weights(i + 1);
        wait<0>();
        done(i);
        hold(o);
        rescale(o, alpha);
        pack<T>(sc, a);
    }
    turn_begin();
    issue_pv<T, D>(o, a, sKV + ((ntiles - 1) % S) * 2 * kTileBytes + kTileBytes);
    turn_end();
    wait<0>();
    hold(o);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace sm90
#endif

#if defined(KDT_CUDA_SM90A)
template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(sm90::kThreads, 1) attention_sm90_kernel(AttnParams c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = sm90::Layout<D>;
    constexpr int TN = sm90::kN;
    constexpr int S = L::kStages;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* sQ = sm90::aligned(smem_raw);
    unsigned char* sKV = sQ + L::kQBytes;  // S buffers of [K tile; V tile]

    const sm90::Cta w(c);
    const int64_t b = w.b, hk = w.hk;
    const int32_t s = w.s;
    const int k_begin = w.k_begin, k_end = w.k_end, m0 = w.m0, m_count = w.m_count, m_real = w.m_real;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const int wg = warp / 4;
    if (k_begin >= k_end) {
        if (c.splits != 1 || s != 0) return;
    }

    constexpr int kVec = 8;
    constexpr int kCols = D / kVec;
    sm90::load_q<T, D>(c, sQ, b, hk, m0, m_real, sm90::kThreads);

    // The warpgroup's 64 rows start at m0 + 64 wg; this warp's 16 at m0 + 16 warp.
    // (Broadcast from lane 0 so that the compiler sees the branches around wgmma as
    // warp-uniform; otherwise it serialises the asynchronous products.)
    const bool wg_live = __shfl_sync(0xffffffffu, m0 + 64 * wg < m_real, 0);
    const int wm = m0 + warp * 16;
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    const bool any_row = m0 < m_real;
    constexpr int kLoads = TN * kCols / sm90::kThreads;
    static_assert(TN * kCols % sm90::kThreads == 0, "whole tiles per thread");
    const int my_col = threadIdx.x % kCols, my_row = threadIdx.x / kCols;
    constexpr int kRowStep = sm90::kThreads / kCols;
    // A thread moves the same 16-byte column of kLoads rows (kRowStep apart) of every tile;
    // their shared-memory offsets are the same in every buffer. A contiguous cache's rows
    // are a fixed stride apart; a paged one's come through the block table.
    const char* kbase = c.k + ((PAGED ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
    const char* vbase = c.v + ((PAGED ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
    const int64_t tok_bytes = c.c_token * (int64_t)sizeof(T);
    int soff[kLoads];
#pragma unroll
    for (int it = 0; it < kLoads; it++) soff[it] = sm90::swizzled(my_row + it * kRowStep, my_col, TN);
    auto issue_tile = [&](int t0, int buf) {
        if (t0 < k_end) {
            unsigned char* dk = sKV + buf * 2 * L::kTileBytes;
            unsigned char* dv = dk + L::kTileBytes;
            const int t_first = t0 + my_row;
            const int64_t first = (int64_t)t_first * tok_bytes;
#pragma unroll
            for (int it = 0; it < kLoads; it++) {
                const int t = t_first + it * kRowStep;
                const bool live = t < k_end;
                int64_t off = 0;
                if constexpr (!PAGED) {
                    off = live ? first + (int64_t)(it * kRowStep) * tok_bytes : 0;
                } else if (live) {
                    const int pg_size = (int)c.page_size;
                    const int64_t page = c.block_table[b * c.bt_stride + t / pg_size];
                    off = (page * c.c_outer + (int64_t)(t % pg_size) * c.c_token) * (int64_t)sizeof(T);
                }
                cp_async16(dk + soff[it], kbase + off, live);
                cp_async16(dv + soff[it], vbase + off, live);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    // Software pipeline (FlashAttention-3's overlap within a warpgroup): while P(i) V(i)
    // runs on the tensor cores, the warpgroup takes the softmax of tile i + 1, whose
    // scores S(i + 1) were issued just before. S buffers: tile i's V, tile i + 1's K and
    // tiles i + 2 .. i + S - 1 loading; a buffer is reloaded only after the barrier that
    // follows every warpgroup's wait for the P V product that read it.
    const int ntiles = __shfl_sync(0xffffffffu, any_row ? (k_end - k_begin + TN - 1) / TN : 0, 0);
    if (any_row) {
#pragma unroll
        for (int i = 0; i < S - 1; i++) issue_tile(k_begin + i * TN, i);
    }
    // Tile i + 1 is in (this thread's copies waited for, then the barrier), every warpgroup
    // is done with the buffer tile i + S - 1 goes to, and that tile is on its way. The
    // barrier is the non-aligned form: the warpgroups past the real rows reach it from
    // another branch (they only load).
    auto next_tile = [&](int i) {
        if (i == 0) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
        } else {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 3));
        }
        // cp.async and the Q stores write through the generic proxy; wgmma reads through
        // the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("barrier.sync 0;\n" ::: "memory");
        if (i > 0) issue_tile(k_begin + (i + S - 2) * TN, (i + S - 2) % S);
    };
    // The warpgroups with real rows run the pipelined loop, the others only keep the loads
    // and barriers in step.
    if (wg_live) {
        if (ntiles > 0) {
            auto none = [] {};
            sm90::run_tiles<T, D, S>(o, mx, l, c, w, sQ + wg * 64 * 128, sKV, ntiles, wm + gid, tig, next_tile, none,
                                     none, [](int) {});
        }
    } else {
        for (int i = 0; i < ntiles; i++) next_tile(i);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    write_rows<T, D / 8>(c, o, mx, l, b, hk, wm + gid, m_count, m_real, s, 0, D, true, tig);
#else
    // Built without sm_90a code for this device (the launcher takes this kernel only where
    // it is): fail every request of the CTA rather than leave its rows unwritten.
    if (threadIdx.x == 0) c.status[blockIdx.x / c.q_tiles / c.kv_heads] = KDT_ERR_UNSUPPORTED;
#endif
}
#endif

// ---- Hopper, warp-specialized: a producer warpgroup and two ping-ponging consumers ---------
//
// The same tiles, layouts and products as attention_sm90_kernel, with the roles of
// FlashAttention-3: warpgroup 0 only loads (cp.async of each K/V tile, the contiguous cache
// by a fixed stride or the paged one through the block table; every producer thread's
// copies of a tile end in one cp.async.mbarrier.arrive on the buffer's "full" barrier) and
// keeps few registers (setmaxnreg); warpgroups 1 and 2 take 64 query vectors each, wait for
// a buffer's "full" barrier, and give it back through its "empty" barrier once their P V
// product that read it is done, so no CTA-wide barrier remains in the loop. The two
// consumers take turns to issue their products (two named barriers): one warpgroup's
// softmax runs while the other's products are on the tensor cores. A consumer whose 64
// vectors are all past the real rows takes no part (the barriers count the live ones).
#if defined(KDT_CUDA_SM90A)
namespace sm90 {
constexpr int kWsThreads = 384;  // producer + two consumers
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "the register file");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Waits until the phase of the given parity of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nKDT_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra KDT_WAIT;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival on the barrier once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void mbar_arrive_copies(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif
}  // namespace sm90

template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(sm90::kWsThreads, 1) attention_ws_kernel(AttnParams c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = sm90::Layout<D>;
    constexpr int TN = sm90::kN;
    constexpr int S = L::kStages;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ uint64_t full[S], empty[S];
    unsigned char* sQ = sm90::aligned(smem_raw);
    unsigned char* sKV = sQ + L::kQBytes;

    const sm90::Cta w(c);
    const int64_t b = w.b, hk = w.hk;
    const int32_t s = w.s;
    const int k_begin = w.k_begin, k_end = w.k_end, m0 = w.m0, m_count = w.m_count, m_real = w.m_real;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
    if (k_begin >= k_end) {
        if (c.splits != 1 || s != 0) return;
    }
    // Consumers with real rows (0, 1 or 2; the first one's rows come first), and the tiles.
    const int live = (m0 < m_real) + (m0 + 64 < m_real);
    const int ntiles = live > 0 && k_begin < k_end ? (k_end - k_begin + TN - 1) / TN : 0;

    constexpr int kVec = 8;
    constexpr int kCols = D / kVec;
    sm90::load_q<T, D>(c, sQ, b, hk, m0, m_real, sm90::kWsThreads);
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; i++) {
            sm90::mbar_init(&full[i], 128);        // every producer thread's copies
            sm90::mbar_init(&empty[i], 4 * max(live, 1));  // every live consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // The Q stores write through the generic proxy; wgmma reads through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();

    if (wg == 0) {
        // ---- producer: tile j into buffer j % S once the consumers gave it back ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(sm90::kProducerRegs));
        constexpr int kLoads = TN * kCols / 128;
        static_assert(TN * kCols % 128 == 0, "whole tiles per thread");
        const int my_col = threadIdx.x % kCols, my_row = threadIdx.x / kCols;
        constexpr int kRowStep = 128 / kCols;
        const char* kbase = c.k + ((PAGED ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
        const char* vbase = c.v + ((PAGED ? 0 : b * c.c_outer) + hk * c.c_head + my_col * kVec) * (int64_t)sizeof(T);
        const int64_t tok_bytes = c.c_token * (int64_t)sizeof(T);
        for (int j = 0; j < ntiles; j++) {
            const int buf = j % S;
            if (j >= S) sm90::mbar_wait(&empty[buf], (uint32_t)((j / S - 1) & 1));
            unsigned char* dk = sKV + buf * 2 * L::kTileBytes;
            unsigned char* dv = dk + L::kTileBytes;
            const int t_first = k_begin + j * TN + my_row;
#pragma unroll
            for (int it = 0; it < kLoads; it++) {
                const int t = t_first + it * kRowStep;
                const bool ok = t < k_end;
                int64_t off = 0;
                if constexpr (!PAGED) {
                    off = ok ? (int64_t)t * tok_bytes : 0;
                } else if (ok) {
                    const int pg_size = (int)c.page_size;
                    const int64_t page = c.block_table[b * c.bt_stride + t / pg_size];
                    off = (page * c.c_outer + (int64_t)(t % pg_size) * c.c_token) * (int64_t)sizeof(T);
                }
                const int so = sm90::swizzled(my_row + it * kRowStep, my_col, TN);
                cp_async16(dk + so, kbase + off, ok);
                cp_async16(dv + so, vbase + off, ok);
            }
            sm90::mbar_arrive_copies(&full[buf]);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(sm90::kConsumerRegs));
    const int cw = wg - 1;  // 0 or 1: rows m0 + 64 cw ..
    const bool mine = cw < live;
    const bool pingpong = live == 2;
    const int wm = m0 + 64 * cw + (warp % 4) * 16;
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    if (mine && ntiles > 0) {
        // Tile i's buffer is full: the producer's copies landed (acquired through the
        // barrier; the proxy fence orders them before this warpgroup's wgmma reads).
        auto wait_full = [&](int i) {
            sm90::mbar_wait(&full[i % S], (uint32_t)((i / S) & 1));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        };
        auto release = [&](int i) {
            if (lane == 0) sm90::mbar_arrive(&empty[i % S]);
        };
        // Turns: a warpgroup issues its products after the other one's previous issue
        // (named barriers 1 and 2: each consumer's own, 256 threads: its sync and the other's
        // arrive). The second consumer opens the first turn for the first one.
        auto turn_begin = [&]() {
            if (pingpong) sm90::named_sync(1 + cw, 256);
        };
        auto turn_end = [&]() {
            if (pingpong) sm90::named_arrive(2 - cw, 256);
        };
        if (pingpong && cw == 1) sm90::named_arrive(1, 256);
        sm90::run_tiles<T, D, S>(o, mx, l, c, w, sQ + cw * 64 * 128, sKV, ntiles, wm + gid, tig, wait_full,
                                 turn_begin, turn_end, release);
        // The second consumer's last turn opened one more for the first: take it.
        if (pingpong && cw == 0) sm90::named_sync(1, 256);
    }
    write_rows<T, D / 8>(c, o, mx, l, b, hk, wm + gid, m_count, m_real, s, 0, D, true, tig);
#else
    if (threadIdx.x == 0) c.status[blockIdx.x / c.q_tiles / c.kv_heads] = KDT_ERR_UNSUPPORTED;
#endif
}
#endif

// Combines the splits of one (request, row, query head) per block of D threads; padding
// rows and failed requests get zeros and lse -inf. The splits' lse values are read once,
// in parallel (thread d takes splits d, d + D, ...), reduced in shared memory to the
// weights exp(lse_s - lse); then thread d sums its output column over the splits, the
// loads independent of each other.
constexpr int kMaxSplits = 1024;
template <typename T, int D>
__global__ void __launch_bounds__(D) merge_kernel(AttnParams c) {
    __shared__ float w[kMaxSplits];
    __shared__ float red[D / 32];
    const int64_t cell = blockIdx.x;  // (b * R + row) * Hq + hq
    const int64_t hq = cell % c.q_heads;
    const int64_t row = (cell / c.q_heads) % c.rows;
    const int64_t b = cell / (c.q_heads * c.rows);
    const int d = threadIdx.x, lane = d % 32, wid = d / 32;
    const int32_t st = c.status[b];
    const int64_t n = st == KDT_OK ? c.num_nodes[b] : -1;
    float acc = 0.f, lse = -INFINITY;
    if (row <= n) {  // (the same for the whole block)
        const int64_t total = c.prefix[b] + n + 1;
        const int32_t used = (int32_t)((total + c.chunk - 1) / c.chunk);
        const int64_t stride = c.batch * c.rows * c.q_heads;
        float mx = -INFINITY;
        for (int32_t s = d; s < used; s += D) {
            w[s] = c.part_lse[s * stride + cell];
            mx = fmaxf(mx, w[s]);
        }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (lane == 0) red[wid] = mx;
        __syncthreads();
        mx = red[0];
#pragma unroll
        for (int i = 1; i < D / 32; i++) mx = fmaxf(mx, red[i]);
        __syncthreads();  // red is reused for the sum
        if (mx != -INFINITY) {
            float sum = 0.f;
            for (int32_t s = d; s < used; s += D) {
                w[s] = __expf(w[s] - mx);
                sum += w[s];
            }
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) red[wid] = sum;
            __syncthreads();  // the weights and the partial sums are visible
            sum = 0.f;
#pragma unroll
            for (int i = 0; i < D / 32; i++) sum += red[i];
            const float* po = c.part_o + cell * D + d;
#pragma unroll 4
            for (int32_t s = 0; s < used; s++) acc += w[s] * po[s * stride * D];
            acc /= sum;
            lse = mx + __logf(sum);
        }
    }
    T* dst = reinterpret_cast<T*>(c.out) + b * c.o_bs + row * c.o_rs + hq * c.o_hs;
    dst[d] = Elem<T>::from(acc);
    if (c.lse != nullptr && d == 0) c.lse[cell] = lse;
}

// The split plan: how many chunks the keys of the longest request are cut into.
// tile_m: query vectors a CTA; target: CTAs that fill the GPU (two or one a SM).
void plan_splits(int64_t batch, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t max_prefix,
                 int32_t* splits, int64_t* chunk, int64_t tile_m = kTileM, int64_t target = kTargetCtas) {
    const int64_t group = q_heads / kv_heads;
    const int64_t tiles = (rows * group + tile_m - 1) / tile_m;
    const int64_t ctas = batch * kv_heads * tiles;
    const int64_t keys = max_prefix + rows;
    int64_t sp = 1;
    if (ctas > 0 && ctas < target && keys > 2 * kMinChunk) {  // (no requests: nothing to split)
        sp = (target + ctas - 1) / ctas;
        const int64_t most = keys / kMinChunk;
        if (sp > most) sp = most;
        if (sp > kMaxSplits) sp = kMaxSplits;
        if (sp < 1) sp = 1;
    }
    int64_t ch = (keys + sp - 1) / sp;
    ch = (ch + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    sp = (keys + ch - 1) / ch;
    *splits = (int32_t)sp;
    *chunk = ch;
}

// head_dim 0: MLA (fixed dims, checked by its caller).
kdt_status check_sizes(int64_t batch, int64_t budget, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       int64_t max_prefix) {
    if (batch < 0 || batch > INT32_MAX) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld is outside [0, %d]", (long long)batch, INT32_MAX);
    }
    if (budget < 0 || budget > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %lld]", (long long)budget,
                        (long long)kMaxBudget);
    }
    if (kv_heads < 1 || q_heads < 1 || q_heads % kv_heads != 0 || q_heads > 4096) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "q_heads (%lld) must be a multiple of kv_heads (%lld), both in [1, 4096]",
                        (long long)q_heads, (long long)kv_heads);
    }
    if (head_dim != 0 && head_dim != 64 && head_dim != 128 && head_dim != 256) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "head_dim %lld is not 64, 128 or 256", (long long)head_dim);
    }
    if (max_prefix < 0 || max_prefix > kMaxPrefix) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "max_prefix %lld is outside [0, 2^31 - 2^19]",
                        (long long)max_prefix);
    }
    return KDT_OK;
}

size_t workspace_for(int64_t batch, int64_t rows, int64_t q_heads, int64_t head_dim, int32_t splits) {
    if (splits <= 1) return 0;
    const size_t cells = (size_t)splits * (size_t)batch * (size_t)rows * (size_t)q_heads;
    // + 512: up to 255 bytes to align the workspace pointer to 256 and up to 252 to align
    // the partial outputs after the lse values (64 cells).
    return cells * (size_t)(head_dim + 1) * sizeof(float) + 512;
}

bool misaligned(const void* ptr, size_t alignment) { return ((uintptr_t)ptr % alignment) != 0; }

template <typename T, int D, typename C>
kdt_status launch_config(const AttnParams& c, cudaStream_t stream) {
    const size_t smem = C::smem_bytes(sizeof(T));
    if (cudaFuncSetAttribute(attention_kernel<T, D, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
        cudaSuccess) {
        return kdt::launch_status("tree attention (shared memory size)");
    }
    const dim3 grid((unsigned)(c.batch * c.kv_heads * c.q_tiles), (unsigned)c.splits);
    attention_kernel<T, D, C><<<grid, C::kThreadsC, smem, stream>>>(c);
    return kdt::launch_status("tree attention");
}

#if defined(KDT_CUDA_SM90A)
// Whether the current device runs the sm_90a code of this library (compute capability 9.0).
bool wgmma_device() {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        (void)cudaGetLastError();  // (the launch that follows reports a lasting failure)
        return false;
    }
    return major == 9 && minor == 0;
}

// Launches one of the sm_90 kernels (the same grid and shared memory; `threads` a CTA).
template <typename Kernel>
kdt_status launch_sm90(Kernel kernel, int threads, size_t smem, const AttnParams& c, cudaStream_t stream) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
        return kdt::launch_status("tree attention (shared memory size)");
    }
    const dim3 grid((unsigned)(c.batch * c.kv_heads * c.q_tiles), (unsigned)c.splits);
    kernel<<<grid, threads, smem, stream>>>(c);
    return kdt::launch_status("tree attention");
}

template <typename T, int D, bool PAGED>
kdt_status launch_sm90(const AttnParams& c, cudaStream_t stream) {
    const size_t smem = sm90::Layout<D>::kSmem;
    if (kdt::testing_attention_sm90() == 1) {
        return launch_sm90(attention_sm90_kernel<T, D, PAGED>, sm90::kThreads, smem, c, stream);
    }
    return launch_sm90(attention_ws_kernel<T, D, PAGED>, sm90::kWsThreads, smem, c, stream);
}
#endif

template <typename T, int D>
kdt_status launch(const AttnParams& c, cudaStream_t stream) {
    kdt_status st = KDT_OK;
    // Two m16 tiles a warp (four warps) halve the shared-memory reads of K and V per mma
    // where a KV head has at least two tiles of query vectors; fewer vectors spread over
    // eight warps of one tile each (the warps past the real rows skip the math).
    const int forced = kdt::testing_attention_warp_tiles();  // (native/kdt_testing.h)
    const bool two = forced ? forced == 2 : c.rows * c.group >= 2 * kTileM;
    bool wgmma = false;
#if defined(KDT_CUDA_SM90A)
    wgmma = D <= 128 && forced == 0 && !kdt::testing_attention_mma_sync() && wgmma_device();
#endif
    if (wgmma) {
#if defined(KDT_CUDA_SM90A)
        if constexpr (D <= 128) {
            st = c.block_table != nullptr ? launch_sm90<T, D, true>(c, stream) : launch_sm90<T, D, false>(c, stream);
        }
#endif
    } else if constexpr (D > 128) {
        st = launch_config<T, D, Config<D, 1>>(c, stream);
    } else if (two) {
        st = launch_config<T, D, Config<D, 2>>(c, stream);
    } else {
        st = launch_config<T, D, Config<D, 1>>(c, stream);
    }
    if (st != KDT_OK || c.splits == 1) return st;
    merge_kernel<T, D><<<(unsigned)(c.batch * c.rows * c.q_heads), D, 0, stream>>>(c);
    return kdt::launch_status("tree attention merge");
}

template <typename T>
kdt_status launch_mla(const AttnParams& c, cudaStream_t stream) {
    if (cudaFuncSetAttribute(mla_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMlaSmem) !=
        cudaSuccess) {
        return kdt::launch_status("MLA tree attention (shared memory size)");
    }
    const dim3 grid((unsigned)(c.batch * c.q_tiles), (unsigned)c.splits);
    mla_kernel<T><<<grid, kMlaThreads, kMlaSmem, stream>>>(c);
    kdt_status st = kdt::launch_status("MLA tree attention");
    if (st != KDT_OK || c.splits == 1) return st;
    merge_kernel<T, kMlaDv><<<(unsigned)(c.batch * c.rows * c.q_heads), kMlaDv, 0, stream>>>(c);
    return kdt::launch_status("MLA tree attention merge");
}

}  // namespace

extern "C" kdt_status kdt_tree_attention_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads,
                                                              int64_t kv_heads, int64_t head_dim, int64_t max_prefix,
                                                              size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    const kdt_status st = check_sizes(batch, budget, q_heads, kv_heads, head_dim, max_prefix);
    if (st != KDT_OK) return st;
    int32_t splits;
    int64_t chunk;
    plan_splits(batch, budget + 1, q_heads, kv_heads, max_prefix, &splits, &chunk);
    *bytes = batch == 0 ? 0 : workspace_for(batch, budget + 1, q_heads, head_dim, splits);
    return kdt_ok();
}

namespace {

// The host-side checks and the launch parameters of both entry points (head_dim 0: MLA,
// 576 / 512 values, one KV head). Sets *empty for a batch of 0 (nothing to launch).
kdt_status setup(const kdt_trees* trees, const int64_t* prefix_lengths, int64_t max_prefix,
                 const kdt_attention_rows* q, const kdt_attention_cache* cache, int32_t dtype, int64_t q_heads,
                 int64_t head_dim, float softmax_scale, kdt_attention_rows* out, float* lse,
                 int32_t* request_status, void* workspace, size_t workspace_bytes, AttnParams* params, bool* empty) {
    const bool mla = head_dim == 0;
    *empty = false;
    if (trees == NULL || q == NULL || cache == NULL || out == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        trees == NULL ? "trees" : q == NULL ? "q" : cache == NULL ? "cache" : "out");
    }
    if (dtype != KDT_DTYPE_FLOAT16 && dtype != KDT_DTYPE_BFLOAT16) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "dtype %d is not float16 (%d) or bfloat16 (%d)", (int)dtype,
                        KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16);
    }
    const int64_t B = trees->batch, N = trees->budget, R = N + 1;
    kdt_status st = check_sizes(B, N, q_heads, cache->kv_heads, head_dim, max_prefix);
    if (st != KDT_OK) return st;
    if (!(softmax_scale > 0.f) || softmax_scale > 1e30f) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "softmax_scale %g must be finite and > 0", (double)softmax_scale);
    }
    if (mla && cache->kv_heads != 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "MLA: cache->kv_heads %lld must be 1 (one latent head)",
                        (long long)cache->kv_heads);
    }
    if (mla && cache->v != NULL && cache->v != cache->k) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "MLA: cache->v must be NULL or cache->k (V is the latent, read from k)");
    }
    const bool paged = cache->block_table != NULL;
    if (paged) {
        if (cache->page_size < 1 || cache->page_size > 256) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->page_size %lld is outside [1, 256]",
                            (long long)cache->page_size);
        }
        if (cache->block_table_stride < 1 || cache->block_table_stride > ((int64_t)1 << 40)) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->block_table_stride %lld is outside [1, 2^40]",
                            (long long)cache->block_table_stride);
        }
    } else if (cache->page_size != 0 || cache->block_table_stride != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "cache->page_size and block_table_stride must be 0 for a contiguous cache (block_table NULL)");
    }
    if (cache->capacity < 0 || cache->outer_stride < 0 || cache->head_stride < 0 || cache->token_stride < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache: capacity (%lld) and strides (%lld, %lld, %lld) must be >= 0",
                        (long long)cache->capacity, (long long)cache->outer_stride, (long long)cache->head_stride,
                        (long long)cache->token_stride);
    }
    const int64_t strides[] = {q->batch_stride, q->row_stride, q->head_stride, out->batch_stride, out->row_stride,
                               out->head_stride, cache->outer_stride, cache->head_stride, cache->token_stride};
    for (int i = 0; i < 9; i++) {
        if (strides[i] < 0 || strides[i] % 8 != 0) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                            "%s stride %lld must be a non-negative multiple of 8 elements (16-byte rows)",
                            i < 3 ? "q" : i < 6 ? "out" : "cache", (long long)strides[i]);
        }
    }
    if (B == 0) {
        *empty = true;
        return kdt_ok();
    }
    if (trees->num_nodes == NULL || trees->visibility_bits == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "trees->%s is NULL",
                        trees->num_nodes == NULL ? "num_nodes" : "visibility_bits");
    }
    if (prefix_lengths == NULL || request_status == NULL || q->data == NULL || out->data == NULL ||
        cache->k == NULL || (cache->v == NULL && !mla)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        prefix_lengths == NULL   ? "prefix_lengths"
                        : request_status == NULL ? "request_status"
                        : q->data == NULL        ? "q->data"
                        : out->data == NULL      ? "out->data"
                        : cache->k == NULL       ? "cache->k"
                                                 : "cache->v");
    }
    if (misaligned(q->data, 16) || misaligned(out->data, 16) || misaligned(cache->k, 16) ||
        (!mla && misaligned(cache->v, 16))) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "q->data, out->data, cache->k and cache->v must be 16-byte aligned");
    }
    if (misaligned(prefix_lengths, 8) || misaligned(trees->num_nodes, 4) || misaligned(trees->visibility_bits, 4) ||
        misaligned(request_status, 4) || misaligned(lse, 4) || misaligned(cache->block_table, 4)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "prefix_lengths (8 bytes), num_nodes, visibility_bits, request_status, lse and block_table (4 "
                        "bytes) must be aligned to their elements");
    }
    int32_t splits;
    int64_t chunk;
    if (mla) {
        plan_splits(B, R, q_heads, 1, max_prefix, &splits, &chunk, kMlaM, kMlaTargetCtas);
    } else {
        plan_splits(B, R, q_heads, cache->kv_heads, max_prefix, &splits, &chunk);
    }
    const size_t need = workspace_for(B, R, q_heads, mla ? kMlaDv : head_dim, splits);
    if (need > 0 && (workspace == NULL || workspace_bytes < need)) {
        return kdt_fail(KDT_ERR_BUFFER_TOO_SMALL,
                        "workspace: %zu bytes needed for %d splits of the keys, %zu given "
                        "(kdt_tree_attention_cuda_workspace_bytes)",
                        need, (int)splits, workspace == NULL ? (size_t)0 : workspace_bytes);
    }

    AttnParams& c = *params;
    c = AttnParams{};
    c.q = static_cast<const char*>(q->data);
    c.q_bs = q->batch_stride;
    c.q_rs = q->row_stride;
    c.q_hs = q->head_stride;
    c.out = static_cast<char*>(out->data);
    c.o_bs = out->batch_stride;
    c.o_rs = out->row_stride;
    c.o_hs = out->head_stride;
    c.lse = lse;
    c.k = static_cast<const char*>(cache->k);
    c.v = static_cast<const char*>(mla ? cache->k : cache->v);
    c.c_outer = cache->outer_stride;
    c.c_head = cache->head_stride;
    c.c_token = cache->token_stride;
    c.block_table = cache->block_table;
    c.bt_stride = cache->block_table_stride;
    c.page_size = cache->page_size;
    c.capacity = cache->capacity;
    c.batch = B;
    c.rows = R;
    c.q_heads = q_heads;
    c.kv_heads = cache->kv_heads;
    c.group = q_heads / cache->kv_heads;
    c.words = (R + 31) / 32;
    const int64_t tile_m = mla ? kMlaM : kTileM;
    c.q_tiles = (R * c.group + tile_m - 1) / tile_m;
    c.num_nodes = trees->num_nodes;
    c.vis = trees->visibility_bits;
    c.prefix = prefix_lengths;
    c.max_prefix = max_prefix;
    c.scale_log2 = softmax_scale * 1.4426950408889634f;
    c.chunk = chunk;
    c.splits = splits;
    if (splits > 1) {
        const uintptr_t base = ((uintptr_t)workspace + 255) / 256 * 256;
        c.part_lse = reinterpret_cast<float*>(base);
        const size_t cells = (size_t)splits * (size_t)B * (size_t)R * (size_t)q_heads;
        c.part_o = c.part_lse + (cells + 63) / 64 * 64;
    }
    c.status = request_status;
    if ((unsigned __int128)(B * cache->kv_heads) * (unsigned __int128)c.q_tiles > INT32_MAX ||
        (unsigned __int128)B * (unsigned __int128)R * (unsigned __int128)q_heads > INT32_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "too many (request, head, row) cells for one launch");
    }

    return KDT_OK;
}

}  // namespace

extern "C" kdt_status kdt_tree_attention_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
                                              int64_t max_prefix, const kdt_attention_rows* q,
                                              const kdt_attention_cache* cache, int32_t dtype, int64_t q_heads,
                                              int64_t head_dim, float softmax_scale, kdt_attention_rows* out,
                                              float* lse, int32_t* request_status, void* workspace,
                                              size_t workspace_bytes, void* stream) {
    if (head_dim == 0) {  // (0 selects MLA inside setup)
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "head_dim 0 is not 64, 128 or 256");
    }
    AttnParams c;
    bool empty;
    kdt_status st = setup(trees, prefix_lengths, max_prefix, q, cache, dtype, q_heads, head_dim, softmax_scale, out,
                          lse, request_status, workspace, workspace_bytes, &c, &empty);
    if (st != KDT_OK || empty) return st;
    const cudaStream_t s = kdt::as_stream(stream);
    check_kernel<<<(unsigned)c.batch, 128, 0, s>>>(c);
    st = kdt::launch_status("tree attention check");
    if (st != KDT_OK) return st;
    if (dtype == KDT_DTYPE_BFLOAT16) {
        st = head_dim == 64    ? launch<__nv_bfloat16, 64>(c, s)
             : head_dim == 128 ? launch<__nv_bfloat16, 128>(c, s)
                               : launch<__nv_bfloat16, 256>(c, s);
    } else {
        st = head_dim == 64    ? launch<__half, 64>(c, s)
             : head_dim == 128 ? launch<__half, 128>(c, s)
                               : launch<__half, 256>(c, s);
    }
    if (st != KDT_OK) return st;
    return kdt_ok();
}

extern "C" kdt_status kdt_tree_attention_mla_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads,
                                                                  int64_t max_prefix, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    const kdt_status st = check_sizes(batch, budget, q_heads, 1, 0, max_prefix);
    if (st != KDT_OK) return st;
    int32_t splits;
    int64_t chunk;
    plan_splits(batch, budget + 1, q_heads, 1, max_prefix, &splits, &chunk, kMlaM, kMlaTargetCtas);
    *bytes = batch == 0 ? 0 : workspace_for(batch, budget + 1, q_heads, kMlaDv, splits);
    return kdt_ok();
}

extern "C" kdt_status kdt_tree_attention_mla_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
                                                  int64_t max_prefix, const kdt_attention_rows* q,
                                                  const kdt_attention_cache* cache, int32_t dtype, int64_t q_heads,
                                                  float softmax_scale, kdt_attention_rows* out, float* lse,
                                                  int32_t* request_status, void* workspace, size_t workspace_bytes,
                                                  void* stream) {
    AttnParams c;
    bool empty;
    kdt_status st = setup(trees, prefix_lengths, max_prefix, q, cache, dtype, q_heads, 0, softmax_scale, out, lse,
                          request_status, workspace, workspace_bytes, &c, &empty);
    if (st != KDT_OK || empty) return st;
    const cudaStream_t s = kdt::as_stream(stream);
    check_kernel<<<(unsigned)c.batch, 128, 0, s>>>(c);
    st = kdt::launch_status("tree attention check");
    if (st != KDT_OK) return st;
    st = dtype == KDT_DTYPE_BFLOAT16 ? launch_mla<__nv_bfloat16>(c, s) : launch_mla<__half>(c, s);
    if (st != KDT_OK) return st;
    return kdt_ok();
}
