/* The exact best-first expansion of one draft tree (spec: ddtree-tree-build.md,
 * "Best-first expansion"), shared by the CPU builder (trees.c) and the CUDA builder
 * (trees_cuda.cu) so that both pop candidates in the same order with the same float64
 * operations. Internal; not part of the ABI. Compile without FMA contraction. */
#ifndef KDT_TREE_EXPAND_H
#define KDT_TREE_EXPAND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#  define KDT_HD __host__ __device__
#else
#  define KDT_HD
#endif

#if defined(__GNUC__) || defined(__clang__) || defined(__CUDACC__)
#  define KDT_EXPECT_FALSE(x) __builtin_expect(!!(x), 0)
#else
#  define KDT_EXPECT_FALSE(x) (x)
#endif

/* A candidate: the child of rank `rank` of emitted node `parent`, with score `logw`
 * (its depth is the parent's plus one). 16 bytes, so heap moves are two words. */
typedef struct kdt_cand {
    double logw;
    int32_t parent;
    int32_t rank;
} kdt_cand;

/* Per-request expansion scratch: heap of at most cap + 2 candidates, node tables of
 * cap + 1 rows (cap = the node capacity, min(N, reachable nodes)). */
typedef struct kdt_expand_scratch {
    kdt_cand* heap;
    int32_t* node_rank;  /* rank of node i within its parent's children */
    int32_t* node_par;   /* parent of node i (-1 for the root) */
    int32_t* node_depth; /* depth of node i (0 for the root) */
    int32_t* last_child; /* last child emitted so far (-1: none), for sibling links */
} kdt_expand_scratch;

/* One request's per-node outputs, each [N + 1] or NULL (not written). */
typedef struct kdt_expand_out {
    int32_t* tokens;
    int32_t* depths;
    int32_t* parents;
    double* logw;
    int64_t* positions;
    int32_t* first_child;
    int32_t* next_sibling;
    /* Optional masks written during the expansion (the CPU builder: the parent's row is
     * still in cache); rows must be cleared beforehand, row 0 and padding rows are left to
     * the caller. NULL: not written here. */
    uint8_t* visibility;       /* [N + 1, N + 1] */
    uint32_t* visibility_bits; /* [N + 1, words] */
    size_t words;
} kdt_expand_out;

/* ---- The heap ---------------------------------------------------------------------- */

/* Rank-path order (spec: keys compare by ranks lexicographically, a proper prefix first).
 * Walks both candidates up the emitted tree to their first difference. */
KDT_HD static inline int path_less(const kdt_cand* a, const kdt_cand* b, const kdt_expand_scratch* s) {
    int32_t pa = a->parent, ra = a->rank, da = s->node_depth[pa] + 1;
    int32_t pb = b->parent, rb = b->rank, db = s->node_depth[pb] + 1;
    const int32_t depth_a = da, depth_b = db;
    while (da > db) {
        ra = s->node_rank[pa];
        pa = s->node_par[pa];
        da--;
    }
    while (db > da) {
        rb = s->node_rank[pb];
        pb = s->node_par[pb];
        db--;
    }
    if (pa == pb && ra == rb) return depth_a < depth_b; /* one path is a prefix */
    while (pa != pb) {
        ra = s->node_rank[pa];
        pa = s->node_par[pa];
        rb = s->node_rank[pb];
        pb = s->node_par[pb];
    }
    return ra < rb;
}

KDT_HD static inline int cand_less(const kdt_cand* a, const kdt_cand* b, const kdt_expand_scratch* s) {
    /* Branch-free on distinct scores; exact score ties (rare but real) take the path walk. */
    int lt = a->logw > b->logw;
    if (KDT_EXPECT_FALSE(a->logw == b->logw)) lt = path_less(a, b, s);
    return lt;
}

KDT_HD static inline void heap_push(kdt_expand_scratch* s, size_t* size, kdt_cand c) {
    size_t i = (*size)++;
    kdt_cand* h = s->heap;
    while (i > 0) {
        size_t up = (i - 1u) / 2u;
        if (!cand_less(&c, &h[up], s)) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = c;
}

/* Fills the hole at the root with `item` and restores the heap of `size` entries. The
 * better child is chosen without a data-dependent branch (`l + (right < left)`); the
 * remaining cost is the load-compare-select latency of each level. */
KDT_HD static inline void heap_sift_root(kdt_expand_scratch* s, size_t size, kdt_cand item) {
    kdt_cand* h = s->heap;
    size_t i = 0, l;
    while ((l = 2u * i + 1u) + 1u < size) {
        size_t best = l + (size_t)cand_less(&h[l + 1u], &h[l], s);
        if (!cand_less(&h[best], &item, s)) break;
        h[i] = h[best];
        i = best;
    }
    if (l + 1u == size && cand_less(&h[l], &item, s)) { /* a last, single child */
        h[i] = h[l];
        i = l;
    }
    h[i] = item;
}

/* Expands one tree: lp/ids are the request's [L, K] rows (only [L, Kp] read, already
 * validated), N the row bound of the outputs, limit <= N the most nodes emitted (the
 * request's budget), cap the node capacity (>= min(limit, reachable nodes)). Rows past
 * the emitted nodes, up to N, are padding. Writes every row 0..N of the non-NULL
 * per-node outputs (root, nodes in pop order, padding), the node rows of the masks when
 * given, and the scratch node tables for rows 0..n; returns n, the number of draft nodes
 * (node_par holds the parents, for callers that write the masks themselves). */
KDT_HD static inline int64_t kdt_expand_tree(const float* lp, const int32_t* ids, int64_t L, int64_t K,
                                             int64_t Kp, int64_t N, int64_t limit, int64_t cap,
                                             int64_t root_pos,
                                             int32_t root_token, int32_t pad, kdt_expand_scratch* s,
                                             const kdt_expand_out* o) {
    int32_t* const tokens = o->tokens;
    int32_t* const depths = o->depths;
    int32_t* const parents = o->parents;
    double* const logw = o->logw;
    int64_t* const positions = o->positions;
    int32_t* const first_child = o->first_child;
    int32_t* const next_sibling = o->next_sibling;
    uint8_t* const vis = o->visibility;
    uint32_t* const bits = o->visibility_bits;
    const size_t rows = (size_t)N + 1u, words = o->words;
    size_t heap_size = 0;
    int64_t n = 0;

    for (int64_t i = 0; i <= cap; i++) s->last_child[i] = -1;
    if (first_child) for (int64_t i = 0; i <= N; i++) first_child[i] = -1;
    if (next_sibling) for (int64_t i = 0; i <= N; i++) next_sibling[i] = -1;
    s->node_rank[0] = 0;
    s->node_par[0] = -1;
    s->node_depth[0] = 0;
    if (tokens) tokens[0] = root_token;
    if (depths) depths[0] = 0;
    if (parents) parents[0] = -1;
    if (logw) logw[0] = 0.0;
    if (positions) positions[0] = root_pos;

    /* The best candidate is held in `top`, outside the heap; the heap holds the rest. Each
     * emitted node yields up to two new candidates (next sibling, first child): the better
     * of them becomes `top` directly when it beats the heap's best (common: a drafter's
     * top-1 child often pops next), which skips a sift through the heap. The pop order is
     * the same as a plain heap's, since keys are totally ordered. */
    int have_top = limit > 0 && L > 0 && Kp > 0 && !isinf(lp[0]);
    kdt_cand top = {have_top ? (double)lp[0] : 0.0, 0, 0};
    while (have_top && n < limit) {
        const kdt_cand c = top;
        const int32_t i = (int32_t)++n;
        const int32_t p = c.parent;
        const int32_t depth = s->node_depth[p] + 1;
        const float* row = lp + (size_t)(depth - 1) * (size_t)K;
        s->node_rank[i] = c.rank;
        s->node_par[i] = p;
        s->node_depth[i] = depth;
        if (tokens) tokens[i] = ids[(size_t)(depth - 1) * (size_t)K + (size_t)c.rank];
        if (depths) depths[i] = depth;
        if (parents) parents[i] = p;
        if (logw) logw[i] = c.logw;
        if (positions) positions[i] = root_pos + depth;
        if (s->last_child[p] < 0) {
            if (first_child) first_child[p] = i;
        } else if (next_sibling) {
            next_sibling[s->last_child[p]] = i;
        }
        s->last_child[p] = i;
        if (vis) { /* row i = row p (nonzero only in columns <= p) plus column i */
            uint8_t* dst = vis + (size_t)i * rows;
            memcpy(dst, vis + (size_t)p * rows, (size_t)p + 1u);
            dst[i] = 1;
        }
        if (bits) {
            uint32_t* dst = bits + (size_t)i * words;
            memcpy(dst, bits + (size_t)p * words, ((size_t)p / 32u + 1u) * sizeof(uint32_t));
            dst[(size_t)i / 32u] |= 1u << ((uint32_t)i % 32u);
        }
        /* Next sibling: subtract first, then add (spec: "Node scores"). */
        int have_sib = 0;
        kdt_cand sib = {0.0, p, c.rank + 1};
        if ((int64_t)c.rank + 1 < Kp) {
            sib.logw = (c.logw - (double)row[c.rank]) + (double)row[c.rank + 1];
            have_sib = !isinf(sib.logw);
        }
        /* First child. */
        int have_child = 0;
        kdt_cand child = {0.0, i, 0};
        if ((int64_t)depth < L) {
            child.logw = c.logw + (double)row[K];
            have_child = !isinf(child.logw);
        }
        /* The next top: the better new candidate, unless the heap's best beats it. */
        kdt_cand best = sib, other = child;
        int have_best = have_sib, have_other = have_child;
        if (have_child && (!have_sib || cand_less(&child, &sib, s))) {
            best = child;
            other = sib;
            have_other = have_sib;
            have_best = 1;
        }
        if (!have_best) {
            have_top = heap_size > 0;
            if (have_top) {
                top = s->heap[0];
                heap_size--;
                if (heap_size > 0) heap_sift_root(s, heap_size, s->heap[heap_size]);
            }
        } else if (heap_size > 0 && cand_less(&s->heap[0], &best, s)) {
            top = s->heap[0];
            heap_sift_root(s, heap_size, best);
        } else {
            top = best;
        }
        if (have_other) heap_push(s, &heap_size, other);
    }
    for (int64_t i = n + 1; i <= N; i++) { /* padding rows */
        if (tokens) tokens[i] = pad;
        if (depths) depths[i] = 0;
        if (parents) parents[i] = -1;
        if (logw) logw[i] = -INFINITY;
        if (positions) positions[i] = root_pos;
    }
    return n;
}

#endif /* KDT_TREE_EXPAND_H */
