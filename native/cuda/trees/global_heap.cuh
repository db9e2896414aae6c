// Version 1, the fallback when a request's arrays do not fit the device's shared memory
// (or forced by KDT_TESTING_TREES_GLOBAL_HEAP): one thread block per request validates it
// in parallel through device memory (validate_global), then one thread runs the same
// best-first expansion as the CPU builder (native/tree_expand.h, compiled for the device
// with -fmad=false) with its heap and node tables in the workspace, then the whole block
// writes the two masks row by row. Bit-identical to the CPU builder by construction.
#pragma once

#include <stdint.h>

extern "C" {
#include "internal.h"
}
#include "tree_expand.h"

#include "masks.cuh"
#include "plan.cuh"
#include "validate.cuh"

namespace kdt {
namespace trees {

__global__ void __launch_bounds__(kThreads) build_kernel(BuildParams p) {
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget;
    const RequestLimits lim = request_limits(d, N, b);  // the request's own budget and depth
    const size_t rows = (size_t)N + 1;
    const size_t words = (rows + 31) / 32;
    const size_t base = (size_t)b * rows;
    char* ws = p.workspace + (size_t)b * p.per_request;
    Layout lay;
    layout_for(p.cap, p.hash_slots, &lay);
    int32_t* tables = reinterpret_cast<int32_t*>(ws + lay.tables);
    int32_t* hash = reinterpret_cast<int32_t*>(ws + lay.hash);
    __shared__ int s_bad;
    __shared__ int64_t s_n;

    // 1. Validation in parallel: any problem sends the request to exact_status.
    const float* lp = d.logprobs ? d.logprobs + (size_t)b * L * K : nullptr;
    const int32_t* ids = d.token_ids ? d.token_ids + (size_t)b * L * K : nullptr;
    const bool any_bad = validate_global(p, b, lim, lp, ids, hash, &s_bad);

    // 2. The expansion, on one thread (a failed request becomes a root-only tree).
    if (threadIdx.x == 0) {
        int32_t status = KDT_OK;
        if (any_bad) status = exact_status(d, b, lim);
        const bool ok = status == KDT_OK;
        kdt_expand_scratch s;
        s.heap = reinterpret_cast<kdt_cand*>(ws + lay.heap);
        s.node_rank = tables;
        s.node_par = tables + (p.cap + 1);
        s.node_depth = tables + 2 * (p.cap + 1);
        s.last_child = tables + 3 * (p.cap + 1);
        kdt_expand_out o;
        o.tokens = p.out.tokens ? p.out.tokens + base : nullptr;
        o.depths = p.out.depths ? p.out.depths + base : nullptr;
        o.parents = p.out.parents ? p.out.parents + base : nullptr;
        o.logw = p.out.logw ? p.out.logw + base : nullptr;
        o.positions = p.out.positions ? p.out.positions + base : nullptr;
        o.first_child = p.out.first_child ? p.out.first_child + base : nullptr;
        o.next_sibling = p.out.next_sibling ? p.out.next_sibling + base : nullptr;
        o.visibility = nullptr;  // written below by the whole block
        o.visibility_bits = nullptr;
        o.words = words;
        int64_t root_pos = d.root_positions ? d.root_positions[b] : 0;
        int32_t root_tok = d.root_tokens ? d.root_tokens[b] : d.pad_token;
        if (!ok) {
            if (root_pos < 0 || root_pos > INT64_MAX - lim.depth) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        const int64_t n = kdt_expand_tree(lp, ids, lim.depth, K, ok ? lim.kp : 0, N, lim.budget, p.cap,
                                          root_pos, root_tok, d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
    }
    __syncthreads();

    // 3. Masks: one warp per row.
    block_write_mask_rows(p, base, rows, words, s_n, tables + (p.cap + 1));
}

}  // namespace trees
}  // namespace kdt
