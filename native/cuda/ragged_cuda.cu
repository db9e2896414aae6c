// Ragged (packed) tree rows on the GPU: kdt_trees_ragged_cuda (kdtree.h). One block per
// request: the block sums the rows of the requests before it (and of all, for the
// capacity check), writes cu_rows[b] and its request's rows; the last block also writes
// cu_rows[B] and the filler rows. A request whose num_nodes is out of range is packed as
// its root row alone (KDT_ERR_VALUE); real rows past the capacity leave cu_rows all zeros
// and every request KDT_ERR_BUFFER_TOO_SMALL.
#include <cuda_runtime.h>

#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;

struct RaggedParams {
    kdt_trees trees;         // device arrays
    kdt_trees_ragged out;    // device arrays
    int32_t* status;         // [B]
    int64_t batch, rows, words;
};

// Rows request b packs: num_nodes + 1, or its root alone when num_nodes is out of range.
__device__ __forceinline__ int64_t packed_rows(const kdt_trees& t, int64_t b, int64_t N) {
    const int32_t n = t.num_nodes[b];
    return n >= 0 && n <= N ? (int64_t)n + 1 : 1;
}

__device__ __forceinline__ int64_t block_sum(int64_t v, int64_t* s_warp) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    __syncthreads();
    if (lane == 0) s_warp[warp] = v;
    __syncthreads();
    int64_t total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += s_warp[w];
    return total;
}

__global__ void __launch_bounds__(kThreads) ragged_kernel(RaggedParams p) {
    __shared__ int64_t s_warp[kThreads / 32];
    const int64_t b = blockIdx.x, B = p.batch, N = p.rows - 1, W = p.words;
    const kdt_trees& t = p.trees;
    const kdt_trees_ragged& o = p.out;
    int64_t before = 0, all = 0;
    for (int64_t r = threadIdx.x; r < B; r += blockDim.x) {
        const int64_t n = packed_rows(t, r, N);
        all += n;
        before += r < b ? n : 0;
    }
    before = block_sum(before, s_warp);
    all = block_sum(all, s_warp);
    const int32_t n_nodes = t.num_nodes[b];
    const bool ok_nodes = n_nodes >= 0 && n_nodes <= N;
    if (all > o.capacity) {  // every block sees it: cu_rows all zeros, nothing else written
        if (threadIdx.x == 0) {
            o.cu_rows[b] = 0;
            if (b == B - 1) o.cu_rows[B] = 0;
            p.status[b] = KDT_ERR_BUFFER_TOO_SMALL;
        }
        return;
    }
    const int64_t n = packed_rows(t, b, N);
    if (threadIdx.x == 0) {
        o.cu_rows[b] = (int32_t)before;
        if (b == B - 1) o.cu_rows[B] = (int32_t)all;
        p.status[b] = ok_nodes ? KDT_OK : KDT_ERR_VALUE;
    }
    const size_t src = (size_t)b * (size_t)p.rows;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const size_t d = (size_t)(before + i);
        if (o.row_request) o.row_request[d] = (int32_t)b;
        if (o.row_node) o.row_node[d] = (int32_t)i;
        if (o.tokens) o.tokens[d] = t.tokens[src + i];
        if (o.depths) o.depths[d] = t.depths[src + i];
        if (o.parents) o.parents[d] = t.parents[src + i];
        if (o.positions) o.positions[d] = t.positions[src + i];
    }
    if (o.visibility_bits) {
        for (int64_t k = threadIdx.x; k < n * W; k += blockDim.x) {
            o.visibility_bits[(size_t)before * W + k] = t.visibility_bits[src * W + k];
        }
    }
    if (b == B - 1) {  // filler rows
        for (int64_t d = all + threadIdx.x; d < o.capacity; d += blockDim.x) {
            if (o.row_request) o.row_request[d] = -1;
            if (o.row_node) o.row_node[d] = -1;
            if (o.tokens) o.tokens[d] = -1;
            if (o.parents) o.parents[d] = -1;
            if (o.depths) o.depths[d] = 0;
            if (o.positions) o.positions[d] = 0;
        }
        if (o.visibility_bits) {
            for (int64_t k = all * W + threadIdx.x; k < o.capacity * W; k += blockDim.x) o.visibility_bits[k] = 0u;
        }
    }
}

// cu_rows = [0] for an empty batch.
__global__ void empty_cu_rows_kernel(int32_t* cu_rows) { cu_rows[0] = 0; }

}  // namespace

extern "C" kdt_status kdt_trees_ragged_cuda(const kdt_trees* trees, kdt_trees_ragged* out, int32_t* request_status,
                                            void* stream) {
    if (trees == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const int64_t B = trees->batch, N = trees->budget, cap = out->capacity;
    if (B < 0 || N < 0 || N > (int64_t)INT32_MAX - 2 || cap < 0 || cap > INT32_MAX || B > INT32_MAX) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "trees batch (%lld), budget (%lld) or out->capacity (%lld) out of range", (long long)B,
                        (long long)N, (long long)cap);
    }
    if (out->cu_rows == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out->cu_rows is NULL");
    const struct {
        const void* want;
        const void* have;
        const char* name;
    } pairs[] = {{out->tokens, trees->tokens, "tokens"},
                 {out->depths, trees->depths, "depths"},
                 {out->parents, trees->parents, "parents"},
                 {out->positions, trees->positions, "positions"},
                 {out->visibility_bits, trees->visibility_bits, "visibility_bits"}};
    for (const auto& pr : pairs) {
        if (pr.want != NULL && pr.have == NULL) {
            return kdt_fail(KDT_ERR_NULL_POINTER, "trees->%s is NULL but out->%s is requested", pr.name, pr.name);
        }
    }
    const int64_t rows = N + 1, words = (rows + 31) / 32;
    size_t bytes;
    if (!kdt_mul_size((size_t)cap, (size_t)words * 4u, &bytes) || !kdt_mul_size((size_t)B, (size_t)rows, &bytes) ||
        !kdt_mul_size(bytes, (size_t)words * 4u, &bytes)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "the ragged arrays' byte sizes overflow");
    }
    const struct {
        const void* ptr;
        size_t align;
        const char* name;
    } aligned[] = {{out->cu_rows, 4, "out->cu_rows"},         {out->row_request, 4, "out->row_request"},
                   {out->row_node, 4, "out->row_node"},       {out->tokens, 4, "out->tokens"},
                   {out->depths, 4, "out->depths"},           {out->parents, 4, "out->parents"},
                   {out->positions, 8, "out->positions"},     {out->visibility_bits, 4, "out->visibility_bits"},
                   {trees->num_nodes, 4, "trees->num_nodes"}, {trees->tokens, 4, "trees->tokens"},
                   {trees->depths, 4, "trees->depths"},       {trees->parents, 4, "trees->parents"},
                   {trees->positions, 8, "trees->positions"}, {trees->visibility_bits, 4, "trees->visibility_bits"},
                   {request_status, 4, "request_status"}};
    for (const auto& a : aligned) {
        const kdt_status st = kdt::check_aligned(a.ptr, a.align, a.name);
        if (st != KDT_OK) return st;
    }
    cudaStream_t s = kdt::as_stream(stream);
    if (B == 0) {
        empty_cu_rows_kernel<<<1, 1, 0, s>>>(out->cu_rows);
        return kdt::launch_status("ragged cu_rows");
    }
    if (trees->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->num_nodes is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    RaggedParams p;
    p.trees = *trees;
    p.out = *out;
    p.status = request_status;
    p.batch = B;
    p.rows = rows;
    p.words = words;
    ragged_kernel<<<(unsigned)B, kThreads, 0, s>>>(p);
    return kdt::launch_status("ragged tree rows");
}
