// The candidate arrays of the parallel expansion (versions 3 and 4), in shared memory
// after build_kernel_smem's layout: P_T, the nodes admitted at a score threshold T, with
// their scores, tree links and generators, and the arrays the sort permutes.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace kdt {
namespace trees {

struct Cands {
    double* logw;
    int32_t* parent;  // P_T index of the parent, -1 for the root
    int32_t* rank;
    int32_t* depth;
    int32_t* gen;     // P_T index of the generator (previous sibling or parent), -1: the root
    int32_t* fc;      // first child, -1
    int32_t* ns;      // next sibling, -1
    int32_t* order;   // [pow2 >= cap] sort order
    int32_t* pos;     // position of each candidate in the order
    int32_t cap;      // power of two
    double* lp0;      // [L] the rank-0 log-prob of each depth as a double (version 4's walk)
};

// Whether candidate a comes before b in the heap's order among equal scores: by rank
// path, lexicographically, a proper prefix first.
__device__ inline bool cand_path_before(const Cands& c, int32_t a, int32_t b) {
    int32_t pa = c.parent[a], ra = c.rank[a], da = c.depth[a];
    int32_t pb = c.parent[b], rb = c.rank[b], db = c.depth[b];
    const int32_t depth_a = da, depth_b = db;
    while (da > db) { ra = c.rank[pa]; pa = c.parent[pa]; da--; }
    while (db > da) { rb = c.rank[pb]; pb = c.parent[pb]; db--; }
    if (pa == pb && ra == rb) return depth_a < depth_b;
    while (pa != pb) { ra = c.rank[pa]; pa = c.parent[pa]; rb = c.rank[pb]; pb = c.parent[pb]; }
    return ra < rb;
}

// Writes candidate `slot`: score w, parent (-1: the root), rank among its siblings, depth,
// next sibling (-1: none yet) and generator (the candidate whose pop pushes it in the
// heap: the previous sibling, else the parent), with no child and an empty chain of its
// own (next rank 0, last child none).
__device__ inline void new_cand(const Cands& c, int32_t slot, double w, int32_t parent, int32_t rank, int32_t depth,
                                int32_t ns, int32_t gen) {
    c.logw[slot] = w;
    c.parent[slot] = parent;
    c.rank[slot] = rank;
    c.depth[slot] = depth;
    c.fc[slot] = -1;
    c.ns[slot] = ns;
    c.gen[slot] = gen;
    c.order[slot] = 0;
    c.pos[slot] = -1;
}

// The candidate arrays of cap3 (a power of two) candidates at `base` (cands_bytes(cap3)).
__device__ inline Cands cands_at(unsigned char* base, int32_t cap3) {
    Cands c;
    c.logw = reinterpret_cast<double*>(base);
    int32_t* ints = reinterpret_cast<int32_t*>(base + (size_t)cap3 * 8);
    c.parent = ints;
    c.rank = ints + cap3;
    c.depth = ints + 2 * cap3;
    c.gen = ints + 3 * cap3;
    c.fc = ints + 4 * cap3;
    c.ns = ints + 5 * cap3;
    c.order = ints + 6 * cap3;
    c.pos = ints + 7 * cap3;
    c.cap = cap3;
    c.lp0 = nullptr;  // set by parallel_expand
    return c;
}

}  // namespace trees
}  // namespace kdt
