// Version 2, the kernel that runs whenever a request's arrays fit the device's shared
// memory: the request's used log-probs, the heap, the node tables, scores and links (and
// the parallel expansion's candidates) all live in shared memory. One block per request:
// the block loads and checks the rows (validate.cuh), runs the parallel expansion
// (expand.cuh) or, when that gives up, one thread runs the heap (the CPU builder's
// kdt_expand_tree, native/tree_expand.h), then writes tokens, depths, parents, positions
// and links from the node tables, and the masks (masks.cuh) unless mask_kernel takes them.
#pragma once

#include <stdint.h>

extern "C" {
#include "internal.h"
}
#include "tree_expand.h"

#include "cands.cuh"
#include "expand.cuh"
#include "masks.cuh"
#include "plan.cuh"
#include "validate.cuh"

namespace kdt {
namespace trees {

__global__ void __launch_bounds__(kSmemThreads, 1) build_kernel_smem(BuildParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget, kp = p.eff_width;
    const RequestLimits lim = request_limits(d, N, b);  // the request's own budget and depth
    const size_t rows = (size_t)N + 1;
    const size_t words = (rows + 31) / 32;
    const size_t base = (size_t)b * rows;
    const SmemLayout& lay = p.lay;
    float* lp_s = reinterpret_cast<float*>(smem + lay.lp);
    int32_t* tables = reinterpret_cast<int32_t*>(smem + lay.tables);
    double* logw_s = reinterpret_cast<double*>(smem + lay.logw);
    int32_t* fc_s = reinterpret_cast<int32_t*>(smem + lay.links);
    int32_t* ns_s = fc_s + rows;
    __shared__ int64_t s_n;
    __shared__ int32_t s_root_tok;
    __shared__ int64_t s_root_pos;

    const float* lp = d.logprobs ? d.logprobs + (size_t)b * L * K : nullptr;
    const int32_t* ids = d.token_ids ? d.token_ids + (size_t)b * L * K : nullptr;
    // Any invalid input in the request: the root's position and token (thread 0), the rows
    // (below); one __syncthreads_or after the rows gives every thread the verdict.
    int bad = 0;
    if (threadIdx.x == 0) {
        bad |= lim.bad;
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - lim.depth;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
    }
    bad = load_and_check_rows(p, lim, lp, ids, lp_s, smem, bad);
    const bool any_bad = __syncthreads_or(bad) != 0;

    // The parallel expansion first (valid requests only); -1 sends the request to the heap
    // below. (Its result is the same in every thread; when it succeeds it has ended with a
    // barrier after writing the node tables.)
    int64_t par_n = -1;
    if (!any_bad && p.cap3 > 0 && lim.kp > 0 && lim.depth > 0 && lim.budget > 0) {
        par_n = parallel_expand(cands_at(smem + lay.cands, p.cap3), lp_s, L, kp, lim.budget, N, logw_s, fc_s, ns_s,
                                tables,
                                tables + (p.cap + 1), tables + 2 * (p.cap + 1), p.descent, p.walk != 0,
                                p.counting != 0);
    }
    if (threadIdx.x == 0 && par_n >= 0) {
        const int64_t n = par_n;
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = KDT_OK;
        s_n = n;
        s_root_tok = d.root_tokens ? d.root_tokens[b] : d.pad_token;
        s_root_pos = d.root_positions ? d.root_positions[b] : 0;
    } else if (threadIdx.x == 0) {
        // The heap, on one thread; a bad request gets the CPU builder's verdict and a
        // root-only tree.
        int32_t status = KDT_OK;
        if (any_bad) status = exact_status(d, b, lim);
        const bool ok = status == KDT_OK;
        kdt_expand_scratch s;
        s.heap = reinterpret_cast<kdt_cand*>(smem + lay.heap);
        s.node_rank = tables;
        s.node_par = tables + (p.cap + 1);
        s.node_depth = tables + 2 * (p.cap + 1);
        s.last_child = tables + 3 * (p.cap + 1);
        kdt_expand_out o;
        o.tokens = nullptr;  // written below from the node tables
        o.depths = nullptr;
        o.parents = nullptr;
        o.positions = nullptr;
        o.logw = logw_s;
        o.first_child = fc_s;
        o.next_sibling = ns_s;
        o.visibility = nullptr;
        o.visibility_bits = nullptr;
        o.words = words;
        int64_t root_pos = d.root_positions ? d.root_positions[b] : 0;
        int32_t root_tok = d.root_tokens ? d.root_tokens[b] : d.pad_token;
        if (!ok) {
            if (root_pos < 0 || root_pos > INT64_MAX - lim.depth) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        // lp_s holds -inf past the request's limits, so the call's L and K' expand the
        // request's own tree; its budget bounds the nodes emitted.
        const int64_t n = kdt_expand_tree(lp_s, nullptr, L, kp, ok ? kp : 0, N, lim.budget, p.cap, root_pos,
                                          root_tok, d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
        s_root_tok = root_tok;
        s_root_pos = root_pos;
    }
    __syncthreads();

    // The outputs from the node tables, a thread per row, then the masks.
    const int64_t n = s_n;
    const int32_t* node_rank = tables;
    const int32_t* node_par = tables + (p.cap + 1);
    const int32_t* node_depth = tables + 2 * (p.cap + 1);
    for (size_t i = threadIdx.x; i < rows; i += blockDim.x) {
        const bool node = i >= 1 && (int64_t)i <= n;
        const int32_t depth = node ? node_depth[i] : 0;
        if (p.out.tokens) {
            p.out.tokens[base + i] = i == 0 ? s_root_tok
                                     : node ? ids[(size_t)(depth - 1) * K + (size_t)node_rank[i]]
                                            : d.pad_token;
        }
        if (p.out.depths) p.out.depths[base + i] = depth;
        if (p.out.parents) p.out.parents[base + i] = node ? node_par[i] : -1;
        if (p.out.positions) p.out.positions[base + i] = s_root_pos + depth;
        if (p.out.logw) p.out.logw[base + i] = logw_s[i];
        if (p.out.first_child) p.out.first_child[base + i] = fc_s[i];
        if (p.out.next_sibling) p.out.next_sibling[base + i] = ns_s[i];
    }
    if (p.masks_separate) {
        // The masks are written by mask_kernel, over many blocks: leave it the parents in
        // this request's device workspace.
        int32_t* g_par = workspace_parents(p, b);
        for (int64_t i = threadIdx.x; i <= n; i += blockDim.x) g_par[i] = node_par[i];
    } else if (rows <= kStagedMaskMaxRows) {
        block_write_masks_staged(p, b, n, node_par);
    } else {
        block_write_mask_rows(p, base, rows, words, n, node_par);
    }
}

}  // namespace trees
}  // namespace kdt
