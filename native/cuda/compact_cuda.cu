// KV-cache compaction after verification (kdt_compact_kv_cuda, and kdt_compact_kv_paged_cuda
// through a block table), all layers in one launch.
//
// A thread owns one column slice (16 bytes, or one element when the strides do not allow
// 16-byte vectors) of one (layer, K or V, request, head) and moves that slice along the
// accepted path: row p + a_j -> row p + j for j = 1 .. m (j = 0 is the root, already in
// place). Grid: x covers (layer, K/V, head, slice) of one request, y the requests. Each
// thread first validates its request's path in full (a few cached loads, the same verdict
// in every thread), so a failed request is never partly moved; a contiguous path (a_m == m,
// hence a_j == j for every j) touches no cache memory.
#include "common.cuh"

namespace {

struct CompactParams {
    void* const* k_layers;
    void* const* v_layers;  // or NULL
    int64_t kv;             // 1 (K only) or 2 (K and V)
    int64_t heads, seq, head_dim;
    int64_t batch_stride, head_stride, row_stride;  // elements (0 for an axis of extent <= 1)
    int64_t esize;          // bytes per element
    int64_t slice_elems;    // elements a thread moves per row: 16 / esize, or 1
    int64_t slices;         // slices per row: head_dim / slice_elems
    int64_t items;          // per request: layers * kv * heads * slices
    int64_t batch;
    const int64_t* prefix;  // [B]
    const int32_t* nodes;   // [B, P]
    const int32_t* length;  // [B]
    int64_t path_capacity;  // P
    int32_t* status;        // [B]
    // Paged (block_table != NULL): token t lives in page block_table[b * bt_stride +
    // t / page_size], slot t % page_size; batch_stride is then the page stride, row_stride
    // the slot stride and seq = bt_stride * page_size.
    const int32_t* block_table;
    int64_t bt_stride, page_size, pages;
};

// The request's verdict (read by every thread of the request; the path is small and
// cached). Order: accept_length, the path itself, then the prefix and the rows it reaches.
__device__ inline int32_t check_request(const CompactParams& c, int64_t b, int32_t* m_out) {
    const int32_t m = c.length[b];
    *m_out = 0;
    if (m < 0 || (int64_t)m > c.path_capacity - 1) return KDT_ERR_VALUE;
    const int32_t* path = c.nodes + b * c.path_capacity;
    if (path[0] != 0) return KDT_ERR_VALUE;
    int32_t prev = 0;
    for (int32_t j = 1; j <= m; j++) {
        const int32_t a = path[j];
        if (a <= prev) return KDT_ERR_VALUE;
        prev = a;
    }
    const int64_t p = c.prefix[b];
    if (p < 0 || p >= c.seq - prev) return KDT_ERR_OUT_OF_RANGE;  // p + a_m < S
    if (c.block_table != nullptr) {
        // Every page a move reads or writes is a page of the pool.
        const int32_t* table = c.block_table + b * c.bt_stride;
        for (int32_t j = 1; j <= m; j++) {
            const int32_t src = table[(p + path[j]) / c.page_size], dst = table[(p + j) / c.page_size];
            if (src < 0 || (int64_t)src >= c.pages || dst < 0 || (int64_t)dst >= c.pages) return KDT_ERR_OUT_OF_RANGE;
        }
    }
    *m_out = m;
    return KDT_OK;
}

// Moves one slice along the path, one unit of type U per element group. `row(t)` is the
// slice's address in token p + t.
//
// Why increasing j is safe in place: the path is strictly increasing from a_0 = 0, so
// a_j >= j for every j. Move j reads row p + a_j and writes row p + j. A later move j' > j
// reads row p + a_j' with a_j' > a_j >= j, never the row move j wrote; an earlier move
// j'' < j wrote row p + j'' < p + j <= p + a_j, never the row move j reads. So every read
// sees the row as the verify forward left it, and reading a batch of sources before
// writing the batch's destinations is safe for the same reason. (Decreasing j, or moves
// of one slice spread over threads, could overwrite a source before it is read: path
// [0, 2, 3] moves 2 -> 1 and then 3 -> 2.)
template <typename U, typename Row>
__device__ inline void move_slice(const Row& row, const int32_t* path, int32_t m, int64_t units) {
    if (units == 1) {
        constexpr int kBatch = 4;
        for (int32_t j = 1; j <= m; j += kBatch) {
            U v[kBatch] = {};
            int32_t a[kBatch];
            for (int q = 0; q < kBatch; q++) {
                a[q] = j + q <= m ? path[j + q] : j + q;
                if (a[q] != j + q) v[q] = *reinterpret_cast<const U*>(row(a[q]));
            }
            for (int q = 0; q < kBatch; q++) {
                if (a[q] != j + q) *reinterpret_cast<U*>(row(j + q)) = v[q];
            }
        }
    } else {
        for (int32_t j = 1; j <= m; j++) {
            const int32_t a = path[j];
            if (a == j) continue;
            const U* src = reinterpret_cast<const U*>(row(a));
            U* dst = reinterpret_cast<U*>(row(j));
            for (int64_t u = 0; u < units; u++) dst[u] = src[u];
        }
    }
}

// One slice's moves at the widest access its alignment allows.
template <typename Row>
__device__ inline void move_any(char* base, const Row& row, const CompactParams& c, const int32_t* path, int32_t m) {
    {
        // Copy width: a 16-byte vector when the slice is 16 bytes (the strides allowed it)
        // and the tensor's pointer, known only here in device memory, is 16-byte aligned;
        // elements when the pointer is aligned to them; bytes otherwise (never a
        // misaligned access).
        const uintptr_t addr = (uintptr_t)base;
        if (c.slice_elems * c.esize == 16 && addr % 16 == 0) {
            move_slice<uint4>(row, path, m, 1);
        } else if (addr % (uintptr_t)c.esize != 0) {
            move_slice<uint8_t>(row, path, m, c.slice_elems * c.esize);
        } else if (c.esize == 4) {
            move_slice<uint32_t>(row, path, m, c.slice_elems);
        } else if (c.esize == 2) {
            move_slice<uint16_t>(row, path, m, c.slice_elems);
        } else {
            move_slice<uint8_t>(row, path, m, c.slice_elems);
        }
    }
}

__global__ void compact_kernel(CompactParams c) {
    const int64_t item = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t b = blockIdx.y; b < c.batch; b += gridDim.y) {
        int32_t m = 0;
        const int32_t st = check_request(c, b, &m);
        if (blockIdx.x == 0 && threadIdx.x == 0) c.status[b] = st;
        if (st != KDT_OK || item >= c.items) continue;
        const int32_t* path = c.nodes + b * c.path_capacity;
        if (path[m] == m) continue;  // contiguous (m = 0 included): nothing moves
        const int64_t slice = item % c.slices;
        const int64_t rest = item / c.slices;
        const int64_t h = rest % c.heads;
        const int64_t lk = rest / c.heads;  // layer * kv + (0: K, 1: V)
        const int64_t layer = lk / c.kv;
        char* base = static_cast<char*>(lk % c.kv == 0 ? c.k_layers[layer] : c.v_layers[layer]);
        if (base == nullptr) continue;
        const int64_t p = c.prefix[b];
        if (c.block_table == nullptr) {
            char* row0 =
                base + (b * c.batch_stride + h * c.head_stride + p * c.row_stride + slice * c.slice_elems) * c.esize;
            const int64_t step = c.row_stride * c.esize;
            move_any(base, [=](int64_t t) { return row0 + t * step; }, c, path, m);
        } else {
            char* col = base + (h * c.head_stride + slice * c.slice_elems) * c.esize;
            const int32_t* table = c.block_table + b * c.bt_stride;
            const int64_t ps = c.page_size, pstep = c.batch_stride * c.esize, sstep = c.row_stride * c.esize;
            move_any(
                base, [=](int64_t t) { return col + (int64_t)table[(p + t) / ps] * pstep + ((p + t) % ps) * sstep; }, c,
                path, m);
        }
    }
}

bool misaligned(const void* ptr, size_t alignment) { return ((uintptr_t)ptr % alignment) != 0; }

constexpr int kThreads = 256;

// Also launched when there is nothing to move: request_status is written either way.
kdt_status launch(const CompactParams& c, void* stream) {
    const int64_t blocks = c.items > 0 ? (c.items + kThreads - 1) / kThreads : 1;
    const dim3 grid((unsigned)blocks, (unsigned)(c.batch < 65535 ? c.batch : 65535));
    compact_kernel<<<grid, kThreads, 0, kdt::as_stream(stream)>>>(c);
    const kdt_status st = kdt::launch_status("KV compaction");
    if (st != KDT_OK) return st;
    return kdt_ok();
}

// Bytes per cache element: the float types, and one-byte types (fp8 e4m3 / e5m2 caches,
// described as uint8 or int8: the compaction only moves bytes); 0 for others.
int64_t kv_dtype_size(int32_t dtype) {
    if (dtype == KDT_DTYPE_UINT8 || dtype == KDT_DTYPE_INT8) return 1;
    return (int64_t)kdt::float_dtype_size(dtype);
}

}  // namespace

extern "C" kdt_status kdt_compact_kv_cuda(const kdt_kv_cache* cache, const int64_t* prefix_lengths,
                                          const int32_t* accepted_nodes, const int32_t* accept_length,
                                          int64_t path_capacity, int32_t* request_status, void* stream) {
    if (cache == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "cache is NULL");
    const int64_t esize = kv_dtype_size(cache->dtype);
    if (esize == 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "cache->dtype %d is not float32 (%d), float16 (%d), bfloat16 (%d) or a one-byte type (uint8 "
                        "%d, int8 %d: fp8 caches)",
                        (int)cache->dtype, KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16, KDT_DTYPE_UINT8,
                        KDT_DTYPE_INT8);
    }
    if (cache->reserved != 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->reserved must be 0");
    const int64_t L = cache->num_layers, B = cache->batch, H = cache->heads, S = cache->seq_capacity,
                  D = cache->head_dim;
    if (L < 0 || B < 0 || H < 0 || S < 0 || D < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "cache: num_layers (%lld), batch (%lld), heads (%lld), seq_capacity (%lld) and head_dim "
                        "(%lld) must be >= 0",
                        (long long)L, (long long)B, (long long)H, (long long)S, (long long)D);
    }
    if (cache->batch_stride < 0 || cache->head_stride < 0 || cache->seq_stride < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache strides (%lld, %lld, %lld) must be >= 0",
                        (long long)cache->batch_stride, (long long)cache->head_stride, (long long)cache->seq_stride);
    }
    if (cache->seq_stride < D) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->seq_stride (%lld) < head_dim (%lld)",
                        (long long)cache->seq_stride, (long long)D);
    }
    if (path_capacity < 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "path_capacity %lld must be >= 1", (long long)path_capacity);
    }
    if (L > 0 && cache->k_layers == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "cache->k_layers is NULL");
    if (misaligned(cache->k_layers, sizeof(void*)) || misaligned(cache->v_layers, sizeof(void*))) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->k_layers / v_layers are not aligned to pointers");
    }
    if (B == 0) return kdt_ok();
    if (prefix_lengths == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "prefix_lengths is NULL");
    if (accepted_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accepted_nodes is NULL");
    if (accept_length == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accept_length is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    if (misaligned(prefix_lengths, 8) || misaligned(accepted_nodes, 4) || misaligned(accept_length, 4) ||
        misaligned(request_status, 4)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "prefix_lengths (8 bytes), accepted_nodes, accept_length and request_status (4 bytes) must be "
                        "aligned to their elements");
    }
    size_t path_cells;
    if (!kdt_mul_size((size_t)B, (size_t)path_capacity, &path_cells) || path_cells > (size_t)INT64_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "accepted_nodes size B * path_capacity overflows");
    }
    // An axis of extent <= 1 is never stepped along: its stride does not matter.
    const int64_t bs = B > 1 ? cache->batch_stride : 0;
    const int64_t hs = H > 1 ? cache->head_stride : 0;
    const int64_t ss = S > 1 ? cache->seq_stride : 0;
    if (H > 0 && S > 0 && D > 0) {
        // The largest element offset, (B-1)*bs + (H-1)*hs + (S-1)*ss + D-1, in bytes, fits int64.
        const unsigned __int128 last = (unsigned __int128)(B - 1) * (uint64_t)bs +
                                       (unsigned __int128)(H - 1) * (uint64_t)hs +
                                       (unsigned __int128)(S - 1) * (uint64_t)ss + (uint64_t)(D - 1);
        if (last * (uint64_t)esize > (unsigned __int128)INT64_MAX) {
            return kdt_fail(KDT_ERR_OVERFLOW, "cache: the largest element offset overflows");
        }
    }

    CompactParams c;
    c.k_layers = cache->k_layers;
    c.v_layers = cache->v_layers;
    c.kv = cache->v_layers != NULL ? 2 : 1;
    c.heads = H;
    c.seq = S;
    c.head_dim = D;
    c.batch_stride = bs;
    c.head_stride = hs;
    c.row_stride = ss;
    c.esize = esize;
    const bool vec = (D * esize) % 16 == 0 && (bs * esize) % 16 == 0 && (hs * esize) % 16 == 0 &&
                     (ss * esize) % 16 == 0;
    c.slice_elems = vec ? 16 / esize : 1;
    c.slices = D / c.slice_elems;
    // items = L * kv * H * slices, one thread each, < 2^31 blocks of kThreads.
    const unsigned __int128 items = (unsigned __int128)(uint64_t)L * (uint64_t)c.kv * (uint64_t)H * (uint64_t)c.slices;
    if (items > (unsigned __int128)INT32_MAX * kThreads) {
        return kdt_fail(KDT_ERR_OVERFLOW, "too many (layer, head, slice) items for one launch");
    }
    c.items = (int64_t)items;
    c.batch = B;
    c.prefix = prefix_lengths;
    c.nodes = accepted_nodes;
    c.length = accept_length;
    c.path_capacity = path_capacity;
    c.status = request_status;
    c.block_table = nullptr;
    c.bt_stride = c.page_size = c.pages = 0;
    return launch(c, stream);
}

extern "C" kdt_status kdt_compact_kv_paged_cuda(const kdt_paged_kv_cache* cache, const int64_t* prefix_lengths,
                                                const int32_t* accepted_nodes, const int32_t* accept_length,
                                                int64_t path_capacity, int32_t* request_status, void* stream) {
    if (cache == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "cache is NULL");
    const int64_t esize = kv_dtype_size(cache->dtype);
    if (esize == 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "cache->dtype %d is not float32 (%d), float16 (%d), bfloat16 (%d) or a one-byte type (uint8 "
                        "%d, int8 %d: fp8 caches)",
                        (int)cache->dtype, KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16, KDT_DTYPE_UINT8,
                        KDT_DTYPE_INT8);
    }
    if (cache->reserved != 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->reserved must be 0");
    const int64_t L = cache->num_layers, B = cache->batch, H = cache->heads, D = cache->head_dim,
                  pages = cache->pages, ps = cache->page_size, bts = cache->block_table_stride;
    if (L < 0 || B < 0 || H < 0 || D < 0 || pages < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "cache: num_layers (%lld), batch (%lld), heads (%lld), head_dim (%lld) and pages (%lld) must "
                        "be >= 0",
                        (long long)L, (long long)B, (long long)H, (long long)D, (long long)pages);
    }
    if (ps < 1 || ps > 256) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->page_size %lld is outside [1, 256]", (long long)ps);
    }
    if (bts < 1 || bts > ((int64_t)1 << 40)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->block_table_stride %lld is outside [1, 2^40]",
                        (long long)bts);
    }
    if (cache->page_stride < 0 || cache->head_stride < 0 || cache->token_stride < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache strides (%lld, %lld, %lld) must be >= 0",
                        (long long)cache->page_stride, (long long)cache->head_stride, (long long)cache->token_stride);
    }
    if (cache->token_stride < D) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->token_stride (%lld) < head_dim (%lld)",
                        (long long)cache->token_stride, (long long)D);
    }
    if (path_capacity < 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "path_capacity %lld must be >= 1", (long long)path_capacity);
    }
    if (L > 0 && cache->k_layers == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "cache->k_layers is NULL");
    if (misaligned(cache->k_layers, sizeof(void*)) || misaligned(cache->v_layers, sizeof(void*))) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "cache->k_layers / v_layers are not aligned to pointers");
    }
    if (B == 0) return kdt_ok();
    if (cache->block_table == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "cache->block_table is NULL");
    if (prefix_lengths == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "prefix_lengths is NULL");
    if (accepted_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accepted_nodes is NULL");
    if (accept_length == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "accept_length is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    if (misaligned(prefix_lengths, 8) || misaligned(accepted_nodes, 4) || misaligned(accept_length, 4) ||
        misaligned(request_status, 4) || misaligned(cache->block_table, 4)) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "prefix_lengths (8 bytes), accepted_nodes, accept_length, request_status and block_table (4 "
                        "bytes) must be aligned to their elements");
    }
    size_t cells;
    if (!kdt_mul_size((size_t)B, (size_t)path_capacity, &cells) || cells > (size_t)INT64_MAX ||
        !kdt_mul_size((size_t)B, (size_t)bts, &cells) || cells > (size_t)INT64_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "accepted_nodes (B * path_capacity) or block_table (B * stride) overflows");
    }
    const int64_t pgs = pages > 1 ? cache->page_stride : 0;
    const int64_t hs = H > 1 ? cache->head_stride : 0;
    const int64_t ts = ps > 1 ? cache->token_stride : 0;
    if (H > 0 && D > 0 && pages > 0) {
        const unsigned __int128 last = (unsigned __int128)(pages - 1) * (uint64_t)pgs +
                                       (unsigned __int128)(H - 1) * (uint64_t)hs +
                                       (unsigned __int128)(ps - 1) * (uint64_t)ts + (uint64_t)(D - 1);
        if (last * (uint64_t)esize > (unsigned __int128)INT64_MAX) {
            return kdt_fail(KDT_ERR_OVERFLOW, "cache: the largest element offset overflows");
        }
    }
    CompactParams c;
    c.k_layers = cache->k_layers;
    c.v_layers = cache->v_layers;
    c.kv = cache->v_layers != NULL ? 2 : 1;
    c.heads = H;
    c.seq = bts * ps;
    c.head_dim = D;
    c.batch_stride = pgs;
    c.head_stride = hs;
    c.row_stride = ts;
    c.esize = esize;
    const bool vec = (D * esize) % 16 == 0 && (pgs * esize) % 16 == 0 && (hs * esize) % 16 == 0 &&
                     (ts * esize) % 16 == 0;
    c.slice_elems = vec ? 16 / esize : 1;
    c.slices = D / c.slice_elems;
    const unsigned __int128 items = (unsigned __int128)(uint64_t)L * (uint64_t)c.kv * (uint64_t)H * (uint64_t)c.slices;
    if (items > (unsigned __int128)INT32_MAX * kThreads) {
        return kdt_fail(KDT_ERR_OVERFLOW, "too many (layer, head, slice) items for one launch");
    }
    c.items = (int64_t)items;
    c.batch = B;
    c.prefix = prefix_lengths;
    c.nodes = accepted_nodes;
    c.length = accept_length;
    c.path_capacity = path_capacity;
    c.status = request_status;
    c.block_table = cache->block_table;
    c.bt_stride = bts;
    c.page_size = ps;
    c.pages = pages;
    return launch(c, stream);
}
