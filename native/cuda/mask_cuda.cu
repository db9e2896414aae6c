// Tree attention masks for the target's verify forward (kdt_tree_attention_mask_cuda).
//
// Dense kinds: one launch. A block owns request b (blockIdx.y, strided) and a chunk of R
// consecutive rows (blockIdx.x); it validates the request (prefix, num_nodes, every real
// node's parent) with one coalesced pass over the parents, keeping them in shared memory
// when they fit, then each warp writes whole rows: lane 0 walks the row's ancestors into a
// per-warp bitmap of the N + 1 tree columns (and writes the row's position), then the 32
// lanes write the row in 16-byte vectors (head and tail elements one by one), each vector
// built from 32 visibility bits: prefix columns, the bitmap shifted into place, nothing
// past the tree. Every byte of the row is written, so a buffer reused after another call
// holds no trace of it.
//
// KDT_MASK_FLASHINFER: two launches. A single block sums the segment sizes, checks them
// against mask_bytes and INT32_MAX, and writes mask_indptr (all zeros on overflow); then
// the same row kernel writes request b's bit-packed segment. Segments start at arbitrary
// bytes and rows at arbitrary bits, so the kernel writes aligned 32-bit words of memory,
// each owned by the row holding its first segment bit (the segment's first and last words,
// which share memory with the neighbouring segments, byte by byte); a word's bits past its
// row come from the first 32 columns of the next rows, which depend only on the prefix and
// on each row's ancestors below 32, precomputed per block (s_low). A request whose
// indptr span differs from its segment size is the overflow signal: status
// KDT_ERR_BUFFER_TOO_SMALL, nothing written.
//
// All offsets are 64-bit. Nothing synchronises with the host or allocates; the host-side
// work is argument checks and the launches, so the call can be captured in a CUDA graph.
#include <algorithm>
#include <atomic>

#include "common.cuh"

namespace {

// Beyond this budget one warp's tree bitmap no longer fits the default 48 KB of shared
// memory (a dense mask at this budget is already >= 8.6 GB per request).
constexpr int64_t kMaxMaskBudget = (int64_t(1) << 18) - 1;
constexpr size_t kSmemLimit = 48 * 1024;
// FlashInfer segments: a segment of more than 2^34 bits (2 GiB) cannot fit int32 offsets;
// kSegSaturated stands for any such size (sums of B of them stay far below 2^64).
constexpr int64_t kSegLimitBits = int64_t(1) << 34;
constexpr int64_t kSegSaturated = int64_t(1) << 31;

struct MaskParams {
    const int32_t* num_nodes;  // [B]
    const int32_t* parents;    // [B, T]
    const int64_t* prefix;     // [B]
    char* mask;
    const int32_t* indptr;     // [B + 1] (FlashInfer)
    int64_t* positions;        // [B, T] or NULL
    int32_t* status;           // [B]
    int64_t batch;
    int64_t rows;              // T = N + 1
    int64_t columns;           // C (dense)
    int64_t row_bytes;         // dense: bytes per row
    int64_t row_elems;         // dense: elements per row (C, or ceil(C / 32) words)
    int64_t rows_per_block;    // R
    int64_t tree_words;        // ceil(T / 32): one warp's bitmap
    int32_t parents_in_smem;   // 1: the first T words of shared memory hold the parents
};

// Bytes of request b's FlashInfer segment: ceil(T * (p + T) / 8) with p clamped at 0 (a
// failed request keeps a segment: all zero bits), or kSegSaturated when over 2^34 bits.
__host__ __device__ inline int64_t segment_bytes(int64_t prefix, int64_t rows) {
    const int64_t p = prefix < 0 ? 0 : prefix;
    if (p > kSegLimitBits) return kSegSaturated;
    const int64_t row_bits = p + rows;
    if (row_bits > kSegLimitBits / rows) return kSegSaturated;
    return (rows * row_bits + 7) / 8;
}

__device__ inline uint32_t low_mask(int64_t bits) { return bits >= 32 ? ~0u : ((1u << bits) - 1u); }

// One row of request b: which columns are visible.
struct RowVis {
    int64_t prefix;      // p (>= 0 when ok)
    int64_t rows;        // T
    const uint32_t* bm;  // the row's tree columns: bit t of word t / 32 = column p + t
    int64_t words;       // words of bm
    bool ok;             // the request is valid (else nothing is visible)
    bool real;           // i <= num_nodes: the prefix is visible
};

// Visibility of columns c .. c + 31 of the row (bit k = column c + k), c >= 0. Columns
// past the tree read as hidden: the bitmap's bits from T on are zero.
__device__ inline uint32_t vis_bits32(const RowVis& r, int64_t c) {
    if (!r.ok) return 0u;
    uint32_t v = 0u;
    if (r.real && c < r.prefix) v = low_mask(r.prefix - c);
    const int64_t t0 = c - r.prefix;  // tree index of bit 0
    if (t0 > -32 && t0 < r.rows) {
        if (t0 >= 0) {
            const int64_t w = t0 >> 5;
            const int s = (int)(t0 & 31);
            const uint32_t lo = r.bm[w];
            if (s == 0) {
                v |= lo;
            } else {
                const uint32_t hi = w + 1 < r.words ? r.bm[w + 1] : 0u;
                v |= (lo >> s) | (hi << (32 - s));
            }
        } else {
            v |= r.bm[0] << (int)(-t0);
        }
    }
    return v;
}

// Element encodings of the dense kinds (values as raw bits).
template <int Kind> struct DenseKind;
template <> struct DenseKind<KDT_MASK_BOOL> {
    static constexpr int kSize = 1;
};
template <> struct DenseKind<KDT_MASK_BITS> {
    static constexpr int kSize = 4;  // one word: 32 columns
};
template <> struct DenseKind<KDT_MASK_ADDITIVE_F32> {
    static constexpr int kSize = 4;
    static constexpr uint32_t kHidden = 0xFF7FFFFFu;  // -FLT_MAX
};
template <> struct DenseKind<KDT_MASK_ADDITIVE_F16> {
    static constexpr int kSize = 2;
    static constexpr uint32_t kHidden = 0xFBFFu;  // -65504
};
template <> struct DenseKind<KDT_MASK_ADDITIVE_BF16> {
    static constexpr int kSize = 2;
    static constexpr uint32_t kHidden = 0xFF7Fu;  // -3.3895e38, bfloat16's lowest
};

// Element e of a dense row, stored at `at`.
template <int Kind> __device__ inline void store_elem(const RowVis& r, int64_t e, char* at) {
    if constexpr (Kind == KDT_MASK_BITS) {
        *reinterpret_cast<uint32_t*>(at) = vis_bits32(r, e * 32);
    } else {
        const bool visible = (vis_bits32(r, e) & 1u) != 0;
        if constexpr (Kind == KDT_MASK_BOOL) {
            *reinterpret_cast<uint8_t*>(at) = visible ? 1 : 0;
        } else if constexpr (DenseKind<Kind>::kSize == 4) {
            *reinterpret_cast<uint32_t*>(at) = visible ? 0u : DenseKind<Kind>::kHidden;
        } else {
            *reinterpret_cast<uint16_t*>(at) = (uint16_t)(visible ? 0u : DenseKind<Kind>::kHidden);
        }
    }
}

// The 16 bytes of elements e0 .. e0 + 16 / size - 1, stored at the 16-byte aligned `at`.
template <int Kind> __device__ inline void store_vec(const RowVis& r, int64_t e0, char* at) {
    uint4 out;
    uint32_t w[4];
    if constexpr (Kind == KDT_MASK_BITS) {
        for (int q = 0; q < 4; q++) w[q] = vis_bits32(r, (e0 + q) * 32);
    } else {
        const uint32_t bits = vis_bits32(r, e0);
        if constexpr (Kind == KDT_MASK_BOOL) {
            // Nibble q -> bytes 4q .. 4q + 3 (0 or 1): the four shifted copies of the nibble
            // (by 0, 7, 14, 21) do not overlap, so the product has no carries.
            for (int q = 0; q < 4; q++) w[q] = (((bits >> (4 * q)) & 0xFu) * 0x00204081u) & 0x01010101u;
        } else if constexpr (DenseKind<Kind>::kSize == 4) {
            for (int q = 0; q < 4; q++) w[q] = ((bits >> q) & 1u) ? 0u : DenseKind<Kind>::kHidden;
        } else {
            for (int q = 0; q < 4; q++) {
                const uint32_t lo = ((bits >> (2 * q)) & 1u) ? 0u : DenseKind<Kind>::kHidden;
                const uint32_t hi = ((bits >> (2 * q + 1)) & 1u) ? 0u : DenseKind<Kind>::kHidden;
                w[q] = lo | (hi << 16);
            }
        }
    }
    out.x = w[0];
    out.y = w[1];
    out.z = w[2];
    out.w = w[3];
    *reinterpret_cast<uint4*>(at) = out;
}

// One dense row by one warp: head elements up to a 16-byte boundary, 16-byte vectors,
// tail elements. Consecutive lanes take consecutive vectors (coalesced).
template <int Kind> __device__ inline void write_dense_row(const RowVis& r, char* row, int64_t elems, int lane) {
    constexpr int64_t kSize = DenseKind<Kind>::kSize;
    constexpr int64_t kPerVec = 16 / kSize;
    const int64_t misalign = (int64_t)((uintptr_t)row & 15u);  // a multiple of kSize
    int64_t head = misalign == 0 ? 0 : (16 - misalign) / kSize;
    if (head > elems) head = elems;
    const int64_t vecs = (elems - head) / kPerVec;
    const int64_t tail = head + vecs * kPerVec;
    if (lane < head) store_elem<Kind>(r, lane, row + lane * kSize);
    for (int64_t v = lane; v < vecs; v += 32) {
        const int64_t e0 = head + v * kPerVec;
        store_vec<Kind>(r, e0, row + e0 * kSize);
    }
    for (int64_t e = tail + lane; e < elems; e += 32) store_elem<Kind>(r, e, row + e * kSize);
}

// Columns 0 .. 31 of row x of a valid request (FlashInfer): the prefix, then the row's
// tree columns below 32 (low = its ancestors-or-self below 32, or its own bit for a
// padding row).
__device__ inline uint32_t row_head_bits(int64_t prefix, bool real, uint32_t low) {
    uint32_t v = 0u;
    if (real && prefix > 0) v = low_mask(prefix);
    if (prefix < 32) v |= low << (int)prefix;
    return v;
}

// One row of a FlashInfer segment by one warp. The segment is bytes [s0, s0 + seg) of
// `mask`; its flat bit f = i * row_bits + c is bit f % 8 of segment byte f / 8. Memory
// words are counted from the aligned word holding byte s0 (`g` bytes before it are the
// previous segment's): word k holds segment bits [32k - 8g, 32k - 8g + 32) and is written
// by the row holding its first segment bit.
__device__ inline void write_flashinfer_row(const RowVis& r, int64_t i, int32_t num_nodes, char* mask, int64_t s0,
                                            int64_t seg, const uint32_t* s_low, int64_t low_base, int lane) {
    const int64_t T = r.rows, row_bits = r.prefix + T;
    uint8_t* seg_base = reinterpret_cast<uint8_t*>(mask) + s0;
    const int64_t g = (int64_t)((uintptr_t)seg_base & 3u);
    uint32_t* frame = reinterpret_cast<uint32_t*>(seg_base - g);
    const int64_t words = (g + seg + 3) / 4;
    // First word owned by row x: the first k with 32k - 8g >= x * row_bits (row 0 also owns
    // word 0, whose first segment bit is bit 0).
    const int64_t k_lo = i == 0 ? 0 : (i * row_bits + 8 * g + 31) / 32;
    const int64_t k_hi = i + 1 == T ? words : ((i + 1) * row_bits + 8 * g + 31) / 32;
    for (int64_t k = k_lo + lane; k < k_hi; k += 32) {
        int64_t c = 32 * k - 8 * g - i * row_bits;  // column of the word's bit 0 in row i
        int64_t got = 0;
        if (c < 0) {  // word 0: its first g bytes are the previous segment's
            got = -c;
            c = 0;
        }
        int64_t take = row_bits - c < 32 - got ? row_bits - c : 32 - got;
        uint32_t v = (vis_bits32(r, c) & low_mask(take)) << (int)got;
        got += take;
        for (int64_t x = i + 1; got < 32 && x < T; x++) {
            take = row_bits < 32 - got ? row_bits : 32 - got;
            const uint32_t head = r.ok ? row_head_bits(r.prefix, x <= num_nodes, s_low[x - low_base]) : 0u;
            v |= (head & low_mask(take)) << (int)got;
            got += take;
        }
        const int64_t first_byte = 4 * k - g;  // segment byte of the word's byte 0
        if (first_byte >= 0 && first_byte + 4 <= seg) {
            frame[k] = v;
        } else {
            for (int q = 0; q < 4; q++) {
                const int64_t j = first_byte + q;
                if (j >= 0 && j < seg) seg_base[j] = (uint8_t)(v >> (8 * q));
            }
        }
    }
}

// Ancestors-or-self of real node x below 32 (the walk ends at the root).
__device__ inline uint32_t low_ancestors(int64_t x, const int32_t* par) {
    uint32_t v = 0u;
    for (int64_t a = x;; a = par[a]) {
        if (a < 32) v |= 1u << a;
        if (a == 0) break;
    }
    return v;
}

// Blocks of up to 256 threads that fit one SM at once: the register cap this sets (48 a
// thread) keeps a whole grid in one wave where the host sizes it so (below). Reading the
// parents ahead of num_nodes took the kernel from 38-40 to 47-56 registers uncapped; at 53
// only 4 blocks fit, and B = 64, N = 64's 576 blocks ran as 1.09 waves on an H200 (ncu).
constexpr int kMaskMinBlocksPerSm = 5;
constexpr int kMaxDevices = 64;
std::atomic<int> g_sm_count[kMaxDevices];  // multiprocessors per device, 0: unknown

template <int Kind> __global__ void __launch_bounds__(256, kMaskMinBlocksPerSm) mask_kernel(MaskParams p) {
    extern __shared__ uint32_t smem[];
    constexpr bool kFlash = Kind == KDT_MASK_FLASHINFER;
    const int64_t T = p.rows, N = T - 1;
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5), warps = (int)(blockDim.x >> 5);
    const int64_t par_words = p.parents_in_smem ? T : 0;
    int32_t* s_par = reinterpret_cast<int32_t*>(smem);
    uint32_t* bm = smem + par_words + (int64_t)warp * p.tree_words;
    uint32_t* s_low = smem + par_words + (int64_t)warps * p.tree_words;  // FlashInfer: [R + 32]
    const int64_t row0 = (int64_t)blockIdx.x * p.rows_per_block;
    const int64_t row1 = row0 + p.rows_per_block < T ? row0 + p.rows_per_block : T;

    for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
        // Every thread reads the same scalars, so the verdict below is block-uniform.
        const int64_t prefix = p.prefix[b];
        const int32_t n = p.num_nodes[b];
        const int32_t* gpar = p.parents + b * T;
        int32_t st = KDT_OK;
        if (prefix < 0 || (!kFlash && prefix > p.columns - T)) {
            st = KDT_ERR_OUT_OF_RANGE;
        } else if (n < 0 || n > N) {
            st = KDT_ERR_VALUE;
        }
        // Every parent row is read, not only the first n: the loads then do not wait for
        // num_nodes (one global round trip less before the rows are written). Entries
        // past n are never used.
        int bad = 0;
        for (int64_t i = 1 + threadIdx.x; i < T; i += blockDim.x) {
            const int32_t a = gpar[i];
            if (p.parents_in_smem) s_par[i] = a;
            bad |= i <= n && (a < 0 || a >= i);
        }
        bad = __syncthreads_or(bad);  // also publishes s_par
        if (st == KDT_OK && bad) st = KDT_ERR_VALUE;
        int64_t s0 = 0, seg = 0;
        if constexpr (kFlash) {
            s0 = p.indptr[b];
            seg = segment_bytes(prefix, T);
            if ((int64_t)p.indptr[b + 1] - s0 != seg) st = KDT_ERR_BUFFER_TOO_SMALL;  // the overflow signal
        }
        if (blockIdx.x == 0 && threadIdx.x == 0) p.status[b] = st;
        const bool ok = st == KDT_OK;
        const int32_t* par = p.parents_in_smem ? s_par : gpar;
        const int64_t clamped_prefix = prefix < 0 ? 0 : prefix;

        if constexpr (kFlash) {
            // Columns 0..31 of the rows that words of this block's rows spill into.
            const int64_t x_end = row1 + 32 < T ? row1 + 32 : T;
            for (int64_t x = row0 + threadIdx.x; x < x_end; x += blockDim.x) {
                uint32_t low = 0u;
                if (ok) low = x <= n ? low_ancestors(x, par) : (x < 32 ? 1u << x : 0u);
                s_low[x - row0] = low;
            }
            __syncthreads();
        }

        for (int64_t i = row0 + warp; i < row1; i += warps) {
            for (int64_t w = lane; w < p.tree_words; w += 32) bm[w] = 0u;
            __syncwarp();
            const bool real = i <= n;
            if (lane == 0) {
                int64_t depth = 0;
                if (ok) {
                    if (real) {
                        // Parents were checked to lie in [0, a), so the walk ends at the root.
                        for (int64_t a = i;; a = par[a], depth++) {
                            bm[a >> 5] |= 1u << (a & 31);
                            if (a == 0) break;
                        }
                    } else {
                        bm[i >> 5] |= 1u << (i & 31);
                    }
                }
                if (p.positions) p.positions[b * T + i] = ok ? prefix + depth : clamped_prefix;
            }
            __syncwarp();
            RowVis r;
            r.prefix = clamped_prefix;  // (a failed request's FlashInfer segment keeps p >= 0)
            r.rows = T;
            r.bm = bm;
            r.words = p.tree_words;
            r.ok = ok;
            r.real = real;
            if constexpr (kFlash) {
                if (st != KDT_ERR_BUFFER_TOO_SMALL) {  // a failed request's segment: all zero bits
                    write_flashinfer_row(r, i, n, p.mask, s0, seg, s_low, row0, lane);
                }
            } else {
                write_dense_row<Kind>(r, p.mask + (b * T + i) * p.row_bytes, p.row_elems, lane);
            }
            __syncwarp();
        }
        __syncthreads();  // s_par and s_low are rewritten for the next request
    }
}

// Block-wide sum of one uint64 per thread; every thread gets the total. blockDim.x is a
// multiple of 32; `s_warp` has one slot per warp.
__device__ inline uint64_t block_sum(uint64_t v, uint64_t* s_warp) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5), warps = (int)(blockDim.x >> 5);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    __syncthreads();
    if (lane == 0) s_warp[warp] = v;
    __syncthreads();
    uint64_t total = 0;
    for (int w = 0; w < warps; w++) total += s_warp[w];
    return total;
}

// Exclusive prefix sum of one uint64 per thread; *chunk_total gets the block's total.
__device__ inline uint64_t block_exclusive_scan(uint64_t v, uint64_t* s_warp, uint64_t* chunk_total) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5), warps = (int)(blockDim.x >> 5);
    uint64_t inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const uint64_t y = __shfl_up_sync(0xFFFFFFFFu, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) s_warp[warp] = inc;
    __syncthreads();
    uint64_t before = 0, total = 0;
    for (int w = 0; w < warps; w++) {
        if (w < warp) before += s_warp[w];
        total += s_warp[w];
    }
    *chunk_total = total;
    return before + inc - v;
}

// FlashInfer's mask_indptr: one block, requests in order. All zeros when the segments
// exceed `capacity` (min(mask_bytes, INT32_MAX)); the row kernel reads that as overflow.
__global__ void flashinfer_indptr_kernel(const int64_t* prefix, int64_t batch, int64_t rows, uint64_t capacity,
                                         int32_t* indptr) {
    __shared__ uint64_t s_warp[32];
    uint64_t sum = 0;
    for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) sum += (uint64_t)segment_bytes(prefix[b], rows);
    const uint64_t total = block_sum(sum, s_warp);
    const bool over = total > capacity;
    uint64_t carry = 0;
    for (int64_t base = 0; base < batch; base += blockDim.x) {
        const int64_t b = base + threadIdx.x;
        const uint64_t v = b < batch ? (uint64_t)segment_bytes(prefix[b], rows) : 0u;
        uint64_t chunk = 0;
        const uint64_t before = block_exclusive_scan(v, s_warp, &chunk);
        if (b < batch) indptr[b] = over ? 0 : (int32_t)(carry + before);
        carry += chunk;
    }
    if (threadIdx.x == 0) indptr[batch] = over ? 0 : (int32_t)total;
}

bool misaligned(const void* ptr, size_t alignment) { return ((uintptr_t)ptr % alignment) != 0; }

template <int Kind> void launch_rows(const MaskParams& p, dim3 grid, int threads, size_t smem, cudaStream_t s) {
    mask_kernel<Kind><<<grid, threads, smem, s>>>(p);
}

}  // namespace

extern "C" kdt_status kdt_tree_attention_mask_cuda(const kdt_trees* trees, const int64_t* prefix_lengths, int32_t kind,
                                                   int64_t columns, void* mask, size_t mask_bytes, int32_t* mask_indptr,
                                                   int64_t* positions, int32_t* request_status, void* stream) {
    if (trees == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees is NULL");
    if (kind < KDT_MASK_BOOL || kind > KDT_MASK_FLASHINFER) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "kind %d is not a kdt_mask_kind (0..5)", (int)kind);
    }
    const int64_t B = trees->batch, N = trees->budget;
    if (B < 0 || N < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "trees->batch (%lld) and trees->budget (%lld) must be >= 0",
                        (long long)B, (long long)N);
    }
    if (N > kMaxMaskBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld exceeds the mask kernel's maximum %lld", (long long)N,
                        (long long)kMaxMaskBudget);
    }
    if (B > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld exceeds %d", (long long)B, INT32_MAX);
    const bool flash = kind == KDT_MASK_FLASHINFER;
    const int64_t T = N + 1;
    if (columns < 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "columns %lld is negative", (long long)columns);
    if (flash) {
        if (columns != 0) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "columns must be 0 for KDT_MASK_FLASHINFER (got %lld)",
                            (long long)columns);
        }
        if (mask_indptr == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "mask_indptr is NULL (KDT_MASK_FLASHINFER)");
        if (misaligned(mask_indptr, 4)) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "mask_indptr is not 4-byte aligned");
    } else {
        if (columns < T) {
            return kdt_fail(KDT_ERR_SHAPE, "columns (%lld) < budget + 1 (%lld)", (long long)columns, (long long)T);
        }
        if (mask_indptr != NULL) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "mask_indptr must be NULL for the dense kind %d", (int)kind);
        }
    }
    cudaStream_t s = kdt::as_stream(stream);
    if (B == 0) {
        if (flash) {  // mask_indptr = [0]
            flashinfer_indptr_kernel<<<1, 32, 0, s>>>(prefix_lengths, 0, T, 0, mask_indptr);
            return kdt::launch_status("mask_indptr");
        }
        return kdt_ok();
    }
    if (trees->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->num_nodes is NULL");
    if (trees->parents == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->parents is NULL");
    if (prefix_lengths == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "prefix_lengths is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    if (mask == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "mask is NULL");
    if (misaligned(trees->num_nodes, 4) || misaligned(trees->parents, 4) || misaligned(prefix_lengths, 8) ||
        misaligned(request_status, 4) || misaligned(positions, 8)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "num_nodes, parents, request_status (4 bytes), prefix_lengths and positions (8 bytes) must "
                        "be aligned to their elements");
    }
    size_t rows_total;
    if (!kdt_mul_size((size_t)B, (size_t)T, &rows_total)) return kdt_fail(KDT_ERR_OVERFLOW, "B * (N + 1) overflows");

    MaskParams p;
    p.num_nodes = trees->num_nodes;
    p.parents = trees->parents;
    p.prefix = prefix_lengths;
    p.mask = static_cast<char*>(mask);
    p.indptr = mask_indptr;
    p.positions = positions;
    p.status = request_status;
    p.batch = B;
    p.rows = T;
    p.columns = columns;
    p.row_bytes = 0;
    p.row_elems = 0;
    p.tree_words = (T + 31) / 32;

    int64_t row_bytes_est;  // for the rows-per-block choice
    if (!flash) {
        size_t elem = 1;
        int64_t elems = columns;
        switch (kind) {
            case KDT_MASK_BITS: elem = 4; elems = (columns + 31) / 32; break;
            case KDT_MASK_ADDITIVE_F32: elem = 4; break;
            case KDT_MASK_ADDITIVE_F16:
            case KDT_MASK_ADDITIVE_BF16: elem = 2; break;
            default: break;
        }
        size_t row_bytes, need;
        if (!kdt_mul_size((size_t)elems, elem, &row_bytes) || !kdt_mul_size(row_bytes, rows_total, &need) ||
            need > (size_t)INT64_MAX) {
            return kdt_fail(KDT_ERR_OVERFLOW, "the mask size B * (N + 1) * row bytes overflows");
        }
        if (mask_bytes < need) {
            return kdt_fail(KDT_ERR_BUFFER_TOO_SMALL, "mask has %zu bytes, %zu needed (B %lld, N + 1 %lld, C %lld)",
                            mask_bytes, need, (long long)B, (long long)T, (long long)columns);
        }
        if (misaligned(mask, elem)) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "mask is not aligned to its %zu-byte elements", elem);
        }
        p.row_bytes = (int64_t)row_bytes;
        p.row_elems = elems;
        row_bytes_est = (int64_t)row_bytes;
    } else {
        row_bytes_est = (T + 7) / 8;  // the shortest row (prefix 0)
    }

    // Warps per block: 8, fewer when their tree bitmaps would crowd shared memory.
    const size_t bitmap_bytes = (size_t)p.tree_words * 4;
    const size_t low_max = flash ? (size_t)(1024 + 32) * 4 : 0;
    int warps = 8;
    while (warps > 1 && (size_t)warps * bitmap_bytes + low_max > kSmemLimit - 4096) warps /= 2;
    // Rows per warp: enough that a block writes >= 16 bytes per parent it validates, few
    // enough that there are >= 256 blocks when the batch allows; at most 1024 rows a block.
    int64_t k = row_bytes_est >= 16 * T ? 1 : (16 * T + warps * row_bytes_est - 1) / (warps * row_bytes_est);
    const int64_t k_fill = (B * T) / (256 * (int64_t)warps);
    if (k > k_fill) k = k_fill;
    // ... and few enough blocks that the grid fits the device at once (one wave): a second
    // wave of a few blocks costs as much as the first.
    // (Shared memory can allow fewer blocks a SM: up to 48 KB a block here, rarely over the
    // ~45 KB at which 5 no longer fit; such grids may still take two waves.)
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) {
        const int slot = dev >= 0 && dev < kMaxDevices ? dev : 0;
        sms = g_sm_count[slot].load(std::memory_order_relaxed);
        if (sms == 0) {
            if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0) {
                g_sm_count[slot].store(sms, std::memory_order_relaxed);
            } else {
                sms = 0;
                cudaGetLastError();  // only this query's error: the sizing is then left out
            }
        }
    } else {
        cudaGetLastError();  // the launch below reports a missing device
    }
    if (sms > 0) {
        // Blocks a SM: 5 of 256 threads (the register cap), more of fewer threads, at most
        // 32 (the per-SM block limit of sm_80 .. sm_120).
        const int per_sm = std::min(kMaskMinBlocksPerSm * (256 / (32 * warps)), 32);
        const int64_t slots = (int64_t)sms * per_sm;
        const int64_t chunks_max = slots / B > 1 ? slots / B : 1;
        const int64_t k_wave = (T + chunks_max * warps - 1) / (chunks_max * warps);
        if (k < k_wave) k = k_wave;
    }
    const int64_t k_all = (T + warps - 1) / warps;
    if (k > k_all) k = k_all;
    if (k > 1024 / warps) k = 1024 / warps;
    if (k < 1) k = 1;
    p.rows_per_block = k * warps;
    const size_t low_bytes = flash ? (size_t)(p.rows_per_block + 32) * 4 : 0;
    size_t smem = (size_t)warps * bitmap_bytes + low_bytes;
    p.parents_in_smem = smem + (size_t)T * 4 <= kSmemLimit;
    if (p.parents_in_smem) smem += (size_t)T * 4;
    const int64_t chunks = (T + p.rows_per_block - 1) / p.rows_per_block;
    if (chunks > INT32_MAX) return kdt_fail(KDT_ERR_OVERFLOW, "too many row chunks (%lld)", (long long)chunks);
    const dim3 grid((unsigned)chunks, (unsigned)(B < 65535 ? B : 65535));
    const int threads = 32 * warps;

    if (flash) {
        const uint64_t cap = mask_bytes < (size_t)INT32_MAX ? (uint64_t)mask_bytes : (uint64_t)INT32_MAX;
        flashinfer_indptr_kernel<<<1, 1024, 0, s>>>(prefix_lengths, B, T, cap, mask_indptr);
        const kdt_status st = kdt::launch_status("mask_indptr");
        if (st != KDT_OK) return st;
    }
    switch (kind) {
        case KDT_MASK_BOOL: launch_rows<KDT_MASK_BOOL>(p, grid, threads, smem, s); break;
        case KDT_MASK_BITS: launch_rows<KDT_MASK_BITS>(p, grid, threads, smem, s); break;
        case KDT_MASK_ADDITIVE_F32: launch_rows<KDT_MASK_ADDITIVE_F32>(p, grid, threads, smem, s); break;
        case KDT_MASK_ADDITIVE_F16: launch_rows<KDT_MASK_ADDITIVE_F16>(p, grid, threads, smem, s); break;
        case KDT_MASK_ADDITIVE_BF16: launch_rows<KDT_MASK_ADDITIVE_BF16>(p, grid, threads, smem, s); break;
        default: launch_rows<KDT_MASK_FLASHINFER>(p, grid, threads, smem, s); break;
    }
    const kdt_status st = kdt::launch_status("tree attention mask");
    if (st != KDT_OK) return st;
    return kdt_ok();
}
