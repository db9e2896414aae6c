// The CUDA draft-tree builder, version 1: exact, one thread block per request.
//
// Each block validates its request in parallel (values, id ranges, duplicate ids through
// a hash set in global workspace), then one thread runs the same best-first expansion as
// the CPU builder (native/tree_expand.h, compiled for the device with -fmad=false), then
// the whole block writes the two masks row by row. Bit-identical to the CPU builder by
// construction; the single-thread expansion is the part a later version parallelises.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "internal.h"
}
#include "tree_expand.h"
#include "common.cuh"

namespace {

// Phase timing for tools/profile_trees_cuda.cu, which compiles this file with
// KDT_TREES_PROFILE defined; the library itself has no probes.
#ifdef KDT_TREES_PROFILE
__device__ long long kdt_prof[4096][8];
// 1: skip the duplicate-id hash, 2: skip the global loads (synthetic rows), 4: first threshold
// at N/2 at every budget, 8: the bitonic network at every size, 16: the bin-round thresholds
__device__ int kdt_prof_knob;
#define KDT_KNOB(bit) (kdt_prof_knob & (bit))
#define KDT_PROBE(phase) \
    do { if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof[blockIdx.x][phase] = clock64(); } while (0)
__device__ long long kdt_prof_v3[4096][4];  // passes, enumeration cycles, sort + check cycles, |P_T|
__device__ long long kdt_prof_sort[4096][4];  // clock marks: sort start, after the k <= 64 phase, sorted, checked
__device__ long long kdt_prof_tie[4096][4];   // counting sort: after the count, after the path keys, -, tied
#define KDT_V3_PROF(stmt) stmt
__device__ long long kdt_prof_v4[4096][8];  // clock marks of version 4's phases, [7]: rounds
__device__ inline void kdt_prof_v4_mark(int i) {
    if (threadIdx.x == 0 && blockIdx.x < 4096 && i < 7) kdt_prof_v4[blockIdx.x][i] = clock64();
}
#define KDT_V4_PROF(...) __VA_ARGS__
// Version 4's first pass: clock marks after the root's chain (with its first-child walk),
// then after each round (up to 7), and per round the owners, the chains resumed and the
// most resumed by one warp.
__device__ long long kdt_prof_round[4096][8];
__device__ int kdt_prof_rstat[4096][8][3];
__device__ inline void kdt_prof_round_mark(int pass, int i) {
    if (pass == 0 && threadIdx.x == 0 && blockIdx.x < 4096 && i < 8) {
        kdt_prof_round[blockIdx.x][i] = clock64();
    }
}
#else
#define KDT_V4_PROF(...)
#define KDT_V3_PROF(stmt)
#define KDT_PROBE(phase) do { } while (0)
#define KDT_KNOB(bit) 0
#endif

constexpr int kThreads = 256;
// build_kernel_smem's block: 512 threads measured faster than 256 at every budget on an
// H200 (N = 256: 88 -> 77 us, N = 1024: 282 -> 238 us; its validation, thresholds and
// sort are instruction-bound with one block per SM).
constexpr int kSmemThreads = 512;
static_assert((kSmemThreads & (kSmemThreads - 1)) == 0, "the validation plan takes a power-of-two block");
constexpr int kMaxDevices = 64;
std::atomic<int> g_smem_max[kMaxDevices];  // cudaDevAttrMaxSharedMemoryPerBlockOptin, 0: unknown
std::atomic<int> g_smem_set[kMaxDevices];  // dynamic shared memory build_kernel_smem may use

// The test switches (KDTREE_CUDA_TREES_*), read once per process: getenv on every launch
// cost a measurable part of a small build's host time.
struct TreeSwitches {
    bool heap, parallel, bisect, dfs, v1, inline_masks, thread_chains, no_walk, no_counting;
};
const TreeSwitches& tree_switches() {
    static const TreeSwitches s = {
        kdt::env_switch("KDTREE_CUDA_TREES_HEAP"),   kdt::env_switch("KDTREE_CUDA_TREES_PARALLEL"),
        kdt::env_switch("KDTREE_CUDA_TREES_BISECT"), kdt::env_switch("KDTREE_CUDA_TREES_DFS"),
        kdt::env_switch("KDTREE_CUDA_TREES_V1"),     kdt::env_switch("KDTREE_CUDA_TREES_INLINE_MASKS"),
        kdt::env_switch("KDTREE_CUDA_TREES_THREAD_CHAINS"), kdt::env_switch("KDTREE_CUDA_TREES_NO_WALK"),
        kdt::env_switch("KDTREE_CUDA_TREES_NO_COUNTING")};
    return s;
}
constexpr int64_t kMaxBudget = (int64_t)INT32_MAX - 2;
// From this budget the shared-memory kernel leaves the masks to a second, wide launch.
constexpr int64_t kSeparateMasksMinBudget = 256;
// Trees of up to this many rows have their masks staged in shared memory (5 words a row).
constexpr size_t kStagedMaskMaxRows = 160;
constexpr size_t kStagedMaskMaxWords = (kStagedMaskMaxRows + 31) / 32;
// From this budget the parallel expansion (versions 4 and 3) runs, the heap being its
// fallback; below it (budget 0) the heap. Every budget: one thread's heap was 2-2.5x
// slower than the block's parallel expansion even at N = 2 (H200, B = 64, the round's
// top-k, graph: N = 2 / 8 / 15 34.1 / 40.2 / 45.0 us against 16.1 / 18.0 / 22.2; the
// heap's ~3,300 inlined instructions run once, by one warp, fetched cold).
constexpr int64_t kParallelMinBudget = 1;
// Up to this budget version 4 resumes a round's chains one warp per owner; above it one
// thread per owner (H200: N = 64 37.1 vs 39.9 us, N = 256 63.2 vs 63.9, N = 1024 200.1 vs
// 189.8, where rounds hold hundreds of owners).
constexpr int64_t kWarpChainsMaxBudget = 512;

// Shared-memory layout of build_kernel_smem for one request (byte offsets).
struct SmemLayout {
    size_t lp, heap, tables, logw, links, hash, cands, total;
};

// build_kernel_smem's validation plan (see there), from the host.
struct ValidationPlan {
    size_t tab_offset;   // shared-memory byte offset of the rows' hash sets of ids
    uint32_t group;      // rows checked at a time (their hash sets fit at once)
    int32_t slot_bits;   // log2 of the hash slots per row
    int32_t tpr_bits;    // log2 of the threads per row: min(ceil_log2(K'), log2(block))
    int32_t rpt_bits;    // log2 of the rank slots per thread and row: ceil_log2(K') - tpr_bits, >= 0
    int32_t rows_par_bits;  // log2 of the rows taken at a time: log2(block) - tpr_bits
};

struct BuildParams {
    kdt_draft draft;  // device pointers inside
    kdt_trees out;    // device pointers inside
    int32_t* status;  // [B]
    char* workspace;  // B * per_request bytes
    size_t per_request;
    int64_t eff_width;  // K' = min(K, N)
    int64_t cap;        // node capacity
    int64_t hash_slots; // power of two >= 2 K' (0 when K' == 0)
    int32_t cap3;       // version 3's candidate capacity (power of two), 0: heap only
    int32_t masks_separate; // 1: build_kernel_smem leaves the masks to mask_kernel
    int32_t descent;        // 1: version 4's threshold descent (chains by warps) before version 3's bisection
                            // (2: depth first, 3: chains by threads)
    int32_t walk;           // 1: version 4 walks first children at once (walk_first_children)
    int32_t counting;       // 1: small candidate sets sorted, and small thresholds selected, by counting
    int32_t ids_distinct;   // 1: the caller guarantees distinct ids per row (no duplicate-id check)
    // build_kernel_smem's layout and validation plan, from the host (computed by each
    // thread they were ~1,900 warp instructions a block at N = 64, H200 ncu).
    SmemLayout lay;
    ValidationPlan val;
    // The staged bool mask's word walk (budget + 1 = rows >= 4): floor(2^32 / rows) + 1 (k /
    // rows = umulhi(k, magic) for k < 2^32 / rows), and the row and column steps of
    // 4 x kSmemThreads bytes.
    uint32_t mask_magic, mask_di, mask_dj;
};

__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
// The smallest b with 2^b >= x (0 for x <= 1).
inline int ceil_log2(uint64_t x) {
    int b = 0;
    while (b < 63 && (uint64_t{1} << b) < x) b++;
    return b;
}

// Node capacity: min(N, K' + K'^2 + ... + K'^L), as in trees.c.
int64_t node_capacity(int64_t budget, int64_t depth, int64_t eff_width) {
    int64_t total = 0, level = 1;
    for (int64_t d = 0; d < depth && total < budget; d++) {
        if (eff_width == 0) break;
        level = level > budget / eff_width ? budget : level * eff_width;
        total = total > budget - level ? budget : total + level;
    }
    return total < budget ? total : budget;
}

int64_t hash_slots_for(int64_t eff_width) {
    if (eff_width <= 0) return 0;
    int64_t slots = 1;
    while (slots < 2 * eff_width) slots *= 2;
    return slots;
}

// Layout of one request's workspace: heap [cap + 2], node tables 4 x [cap + 1], hash set.
struct Layout {
    size_t heap, tables, hash, total;
};

__host__ __device__ bool layout_for(int64_t cap, int64_t hash_slots, Layout* l) {
    const double approx = (double)(cap + 2) * 16.0 + (double)(cap + 1) * 16.0 + (double)hash_slots * 4.0;
    if (approx > 1e18) return false;
    l->heap = 0;
    l->tables = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    l->hash = l->tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    l->total = align_up(l->hash + (size_t)hash_slots * sizeof(int32_t), 256);
    return true;
}

__device__ inline uint64_t mix_id(int32_t id) {
    uint64_t z = (uint64_t)(uint32_t)id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The CPU builder's verdict for one request, computed sequentially (the error path only):
// root position, root token, then row by row: values (NaN, +inf, order) before ids
// (range, repeats of an earlier id), each in rank order.
__device__ int32_t exact_status(const kdt_draft& d, int64_t b, int64_t kp) {
    const int64_t L = d.depth, K = d.width;
    if (d.root_positions) {
        const int64_t rp = d.root_positions[b];
        if (rp < 0 || rp > INT64_MAX - L) return KDT_ERR_OUT_OF_RANGE;
    }
    if (d.root_tokens) {
        const int32_t rt = d.root_tokens[b];
        if (rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size)) return KDT_ERR_OUT_OF_RANGE;
    }
    for (int64_t r0 = 0; r0 < L; r0++) {
        const float* lp = d.logprobs + ((size_t)b * L + r0) * K;
        const int32_t* ids = d.token_ids + ((size_t)b * L + r0) * K;
        for (int64_t r = 0; r < kp; r++) {
            const float v = lp[r];
            if (isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp[r - 1])) return KDT_ERR_VALUE;
        }
        for (int64_t r = 0; r < kp; r++) {
            const int32_t id = ids[r];
            if (id < 0 || (d.vocab_size > 0 && id >= d.vocab_size)) return KDT_ERR_OUT_OF_RANGE;
            for (int64_t q = 0; q < r; q++) {
                if (ids[q] == id) return KDT_ERR_VALUE;
            }
        }
    }
    return KDT_OK;
}

// ---- Pieces shared by the kernels -----------------------------------------------------------

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Writes row i's visibility (bytes) and visibility_bits (words), one warp per row: the
// lanes clear the row, then lane 0 sets the row's own column and its ancestors' (node
// rows) or just the diagonal (padding rows, i > n). Used by both kernels.
__device__ void warp_write_mask_row(int64_t i, int64_t n, int64_t rows, const int32_t* node_par, uint8_t* vrow,
                                    uint32_t* brow) {
    const int lane = threadIdx.x & 31;
    const int64_t words = (rows + 31) / 32;
    if (vrow) {
        // Cleared in 16-byte stores between an unaligned head and tail (byte stores were
        // ~2x the bandwidth floor of a large tree's mask on an H200).
        const int64_t head = min(rows, (int64_t)((16 - ((uintptr_t)vrow & 15)) & 15));
        const int64_t body = (rows - head) / 16;
        if (lane < head) vrow[lane] = 0;
        uint4* v4 = reinterpret_cast<uint4*>(vrow + head);
        for (int64_t k = lane; k < body; k += 32) v4[k] = make_uint4(0u, 0u, 0u, 0u);
        for (int64_t j = head + body * 16 + lane; j < rows; j += 32) vrow[j] = 0;
    }
    if (brow) for (int64_t j = lane; j < words; j += 32) brow[j] = 0u;
    __syncwarp();
    if (lane == 0) {
        for (int64_t a = i; a >= 0; a = i <= n ? node_par[a] : -1) {
            if (vrow) vrow[a] = 1;
            if (brow) brow[a / 32] |= 1u << (a % 32);
        }
    }
    __syncwarp();
}

__global__ void __launch_bounds__(kThreads) build_kernel(BuildParams p) {
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget, kp = p.eff_width;
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
    if (threadIdx.x == 0) {
        int bad = 0;
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - L;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
        s_bad = bad;
    }
    __syncthreads();
    const float* lp = d.logprobs ? d.logprobs + (size_t)b * L * K : nullptr;
    const int32_t* ids = d.token_ids ? d.token_ids + (size_t)b * L * K : nullptr;
    int bad = 0;
    for (int64_t idx = threadIdx.x; idx < L * kp; idx += blockDim.x) {
        const int64_t row = idx / kp, r = idx % kp;
        const float v = lp[row * K + r];
        const int32_t id = ids[row * K + r];
        bad |= isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp[row * K + r - 1]);
        bad |= id < 0 || (d.vocab_size > 0 && id >= d.vocab_size);
    }
    if (bad) atomicOr(&s_bad, 1);
    // Duplicate ids, row by row, with a hash set of ids (-1: empty).
    const uint64_t mask = (uint64_t)p.hash_slots - 1;
    int shift = 64;
    for (int64_t h = p.hash_slots; h > 1; h >>= 1) shift--;
    for (int64_t row = 0; row < L && kp > 0; row++) {
        for (int64_t i = threadIdx.x; i < p.hash_slots; i += blockDim.x) hash[i] = -1;
        __syncthreads();
        int dup = 0;
        for (int64_t r = threadIdx.x; r < kp; r += blockDim.x) {
            const int32_t id = ids[row * K + r];
            if (id < 0) continue; // reported as a range error
            uint64_t slot = shift >= 64 ? 0 : (mix_id(id) >> shift) & mask;
            for (;;) {
                const int32_t prev = atomicCAS(&hash[slot], -1, id);
                if (prev == -1) break;
                if (prev == id) {
                    dup = 1;
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
        if (dup) atomicOr(&s_bad, 1);
        __syncthreads();
    }
    __syncthreads();

    // 2. The expansion, on one thread (a failed request becomes a root-only tree).
    if (threadIdx.x == 0) {
        int32_t status = KDT_OK;
        if (s_bad) status = exact_status(d, b, kp);
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
            if (root_pos < 0 || root_pos > INT64_MAX - L) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        const int64_t n = kdt_expand_tree(lp, ids, L, K, ok ? kp : 0, N, p.cap, root_pos, root_tok,
                                          d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
    }
    __syncthreads();

    // 3. Masks: one warp per row (warp_write_mask_row).
    const int64_t n = s_n;
    const int32_t* node_par = tables + (p.cap + 1);
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (size_t i = warp; i < rows; i += warps) {
        uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
        uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
        warp_write_mask_row((int64_t)i, n, (int64_t)rows, node_par, vrow, brow);
    }
}


// ---- Version 3: an exact parallel expansion --------------------------------------------
//
// Every candidate's score is fixed by its path (a sibling from the previous sibling, a
// first child from its parent), so the tree can be found without a heap: take a score
// threshold T and enumerate P_T, the nodes whose whole generator chain scores >= T (a
// prefix-closed set, one thread per parent running its chain of children); choose T by
// bisection so that N <= |P_T| <= cap (or P_T is every finite node); sort P_T by the heap's
// key (-logw, rank path). If in that order every node comes after its generator (its
// previous sibling, or its parent for a first child), the heap pops exactly the first N
// of it: at each step the next node is in the heap's frontier, and any frontier node with
// a smaller key would be in P_T and earlier. Scores are computed by the same operations as
// the heap's, so the result is bit-identical. When the check fails (a rounding step made a
// child score above its parent) or no threshold fits, the caller falls back to the heap.

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

// One parent's chain of children (parent -1: the root's, at row 0) with scores >= T: the
// chain is scored twice (once to count it, once to write it) so that it takes one atomic
// add for all its slots, which are consecutive.
__device__ inline void enumerate_chain(const Cands& c, const float* lp_s, int64_t kp, int32_t parent, int32_t d,
                                       double T, int* count, int* pruned, int* root_fc) {
    const float* row = lp_s + (int64_t)d * kp;
    const double first = parent < 0 ? (double)row[0] : c.logw[parent] + (double)row[0];
    // The chain's scores depend on each other (spec order: subtract, then add, rounded at
    // each step), so they are computed one after another; the row values are fetched
    // eight at a time ahead of that dependency chain.
    double w = first;
    int32_t len = 0;
    bool prune = false, stop = false;
    for (int32_t r0 = 0; r0 < kp && !stop; r0 += 8) {
        float v[9];
#pragma unroll
        for (int j = 0; j < 9; j++) v[j] = r0 + j < kp ? row[r0 + j] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {  // w: the score of rank r0 + j
            if (r0 + j >= kp || isinf(w)) {  // -inf: never emitted; the rest of the row is -inf too
                stop = true;
                break;
            }
            if (w < T) {
                prune = stop = true;
                break;
            }
            len++;
            w = (w - (double)v[j]) + (double)v[j + 1];  // spec: subtract first, then add
        }
    }
    if (prune) atomicOr(pruned, 1);
    if (len == 0) return;
    const int slot0 = atomicAdd(count, len);
    if (slot0 + len > c.cap) return;  // overflow: this threshold is too low
    w = first;
    for (int32_t r0 = 0; r0 < len; r0 += 8) {
        float v[9];
#pragma unroll
        for (int j = 0; j < 9; j++) v[j] = r0 + j < kp ? row[r0 + j] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int32_t r = r0 + j;
            if (r >= len) break;
            const int32_t slot = slot0 + r;
            new_cand(c, slot, w, parent, r, d + 1, r + 1 < len ? slot + 1 : -1, r > 0 ? slot - 1 : parent);
            w = (w - (double)v[j]) + (double)v[j + 1];
        }
    }
    if (parent >= 0) c.fc[parent] = slot0;
    else *root_fc = slot0;
}

// Enumerates P_T level by level; returns |P_T| (> c.cap on overflow). Block-wide.
__device__ int enumerate_pt(const Cands& c, const float* lp_s, int64_t L, int64_t kp, double T, int* s_count,
                            int* s_pruned, int* s_root_fc) {
    __syncthreads();
    if (threadIdx.x == 0) {
        *s_count = 0;
        *s_pruned = 0;
        *s_root_fc = -1;
        enumerate_chain(c, lp_s, kp, -1, 0, T, s_count, s_pruned, s_root_fc);
    }
    __syncthreads();
    // Every thread reads the shared count between two barriers (no thread adds to it
    // there), so all of them take the same branch at the loop test.
    int count_now = *s_count;
    int lo = 0, hi = min(count_now, c.cap);
    __syncthreads();
    for (int32_t d = 1; d < L && lo < hi && count_now <= c.cap; d++) {
        for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
            enumerate_chain(c, lp_s, kp, i, d, T, s_count, s_pruned, s_root_fc);
        }
        __syncthreads();
        count_now = *s_count;
        lo = hi;
        hi = min(count_now, c.cap);
        __syncthreads();
    }
    const int total = *s_count;
    __syncthreads();
    return total;
}

// ---- Version 4: threshold descent ---------------------------------------------------------
//
// Version 3 re-enumerates P_T from scratch for every threshold it tries. Version 4 only
// lowers the threshold and resumes: every candidate (and the root) owns the chain of its
// children, kept as (next rank, last emitted child) in c.order / c.pos until the sort
// needs them, so a pass at a lower T continues each chain where the last pass stopped
// and P_T grows in place. A pass runs in rounds: round 0 resumes every owner's chain,
// round k the chains of the candidates round k - 1 emitted (one depth deeper each round).
// The first T comes from a model (the spine, the top-1 path, and its children: the
// (N/2)-th best of spine[d] + lp[d][r]); the next ones from the frontier, the heads of
// the chains: with m = N - |P_T| more nodes wanted, T = the m-th best head (every head
// >= T then enters, so the next pass ends with >= N nodes), or the lowest head when there
// are fewer than m. The result is the same P_T version 3 would enumerate at the last T,
// so the sort and the generator-order check that follow are shared. A pass that overflows
// the candidate arrays is rolled back (each chain cut back to the candidates of the last
// pass that fit) and retried halfway up; too many passes hand over to version 3.

constexpr int kDescentMaxPasses = 8;
// Owners listed at a time in a round: the list and its two counts fill `bins` (512 words).
constexpr int kGoListMax = 510;
constexpr int64_t kDescentPreciseFirstMin = 512;  // from this budget the first threshold takes two rounds
// Up to this budget the first threshold aims at 3N/4 spine children, not N/2: one pass
// where N/2 took 1.1-2.4 on average (tools/emulate_descent.py, the benchmarks' drafters at
// N = 64), for a P_T of ~2-2.7 N, which the counting sort (<= 256) mostly still takes. H200,
// B = 64: N = 64 25.2 -> 22.2 us; at N = 128 the larger P_T went to the bitonic network,
// 32.9 -> 40.5 us, and at 256 its P_Ts of ~800 would too.
constexpr int64_t kFirstWideTargetMax = 96;
constexpr int64_t kDescentMaxDepth = 64;  // the spine's scores live in a static array

// An order-preserving map of doubles (NaN excluded) to unsigned 64-bit integers.
__device__ inline unsigned long long double_key(double x) {
    const unsigned long long u = (unsigned long long)__double_as_longlong(x);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
__device__ inline double key_double(unsigned long long k) {
    return __longlong_as_double((long long)((k >> 63) ? (k & 0x7FFFFFFFFFFFFFFFull) : ~k));
}

// Counts digit (< 256; 0x100: none) into bins, one shared atomic per warp and digit.
// Every lane of the warp must call it.
__device__ inline void warp_count_digit(unsigned digit, unsigned* bins) {
    const unsigned same = __match_any_sync(kFullMask, digit);
    if (digit < 0x100u && (__ffs(same) - 1) == (int)(threadIdx.x & 31)) atomicAdd(&bins[digit], __popc(same));
}

// Warp 0: the first bin (from bin 0) at which the running count of bins[0..255] reaches
// *k; stores it in *bin and the count still wanted inside it in *k.
__device__ inline void warp_find_bin(const unsigned* bins, int* k, int* bin) {
    const int lane = threadIdx.x;
    unsigned own[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        own[j] = bins[8 * lane + j];
        sum += own[j];
    }
    unsigned incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += t;
    }
    const unsigned before = incl - sum, want = (unsigned)*k;
    __syncwarp();
    if (before < want && want <= incl) {
        unsigned acc = before;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (acc + own[j] >= want) {
                *bin = 8 * lane + j;
                *k = (int)(want - acc);
                break;
            }
            acc += own[j];
        }
    }
}

// Up to this many candidates (and blockDim.x), parallel_expand orders them by counting.
constexpr int kCountSortMax = 256;
// Up to this many candidates whose score equals an earlier-listed one's (a group of g equal
// scores counts g - 1), the counting sort orders each group by walking rank paths; beyond
// it by 128-bit path keys where they fit, else the bitonic network sorts the set.
constexpr int kCountSortMaxTies = 4;
// Up to this many values (and blockDim.x), block_threshold selects exactly by counting.
constexpr int kCountSelectMax = 256;

// A threshold T with at least min(k, F) of value(i), i in [0, count), >= T, where F is
// the number of finite values (k >= 1); -inf when F = 0. T is one of the values and at
// most the k-th largest, usually just below it: two rounds of 256 bins, the second inside
// the first's chosen bin, then the smallest value of the chosen sub-bin. The bins are
// monotone in the value, so every value counted before the chosen sub-bin is >= T.
// Block-wide; bins: 512 words.
template <class Value>
__device__ double block_threshold(const Value& value, int count, int k, unsigned* bins, bool counting) {
    __shared__ unsigned long long s_lo, s_hi, s_min;
    __shared__ int s_k, s_bin_a, s_bin_b, s_finite;
    if (counting && count <= kCountSelectMax && count <= (int)blockDim.x && !KDT_KNOB(16)) {
        // Few values (a pass's chain heads at N <= 256): the exact k-th largest, min(k, F),
        // by counting: the value v with #(> v) < k <= #(>= v), one thread per value, the
        // values staged in the bins' 2 KB (H200: the two bin rounds cost ~3 us for 65).
        double* vals = reinterpret_cast<double*>(bins);
        const int i = (int)threadIdx.x;
        double v = -INFINITY;
        if (i < count) {
            v = value(i);
            vals[i] = v;  // finite or -inf (a sum of <= 64 finite floats cannot overflow a double)
        }
        if (i == 0) {
            s_finite = 0;
            s_min = 0;  // the largest key chosen; 0: none
        }
        __syncthreads();
        const bool finite = !isinf(v);
        const unsigned f = __ballot_sync(kFullMask, finite);
        if ((threadIdx.x & 31) == 0 && f) atomicAdd(&s_finite, __popc(f));
        __syncthreads();
        const int want = min(k, s_finite);
        if (finite) {
            int gt = 0, ge = 0;
#pragma unroll 8
            for (int j = 0; j < count; j++) {
                const double u = vals[j];
                gt += u > v;
                ge += u >= v;
            }
            if (gt < want && want <= ge) atomicMax(&s_min, double_key(v));  // all such v are equal
        }
        __syncthreads();
        const unsigned long long key = s_min;
        __syncthreads();  // the bins are free again
        return key == 0 ? -INFINITY : key_double(key);
    }
    if (threadIdx.x == 0) {
        s_lo = ~0ull;
        s_hi = 0;
        s_min = ~0ull;
        s_finite = 0;
        s_bin_a = 255;
        s_bin_b = 255;
    }
    for (int i = threadIdx.x; i < 512; i += blockDim.x) bins[i] = 0;
    unsigned long long lo = ~0ull, hi = 0;
    int finite = 0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const double v = value(i);
        if (isinf(v)) continue;
        finite++;
        const unsigned long long key = double_key(v);
        lo = key < lo ? key : lo;
        hi = key > hi ? key : hi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long l2 = __shfl_xor_sync(kFullMask, lo, o), h2 = __shfl_xor_sync(kFullMask, hi, o);
        lo = l2 < lo ? l2 : lo;
        hi = h2 > hi ? h2 : hi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) finite += __shfl_xor_sync(kFullMask, finite, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && hi >= lo) {
        atomicMin(&s_lo, lo);
        atomicMax(&s_hi, hi);
        atomicAdd(&s_finite, finite);
    }
    __syncthreads();
    if (s_hi < s_lo) return -INFINITY;  // no finite value
    const double top = key_double(s_hi), bottom = key_double(s_lo);
    if (top == bottom || k >= s_finite) return bottom;
    if (threadIdx.x == 0) s_k = k;  // read by warp 0 after the next barrier
    const double scale_a = 256.0 / (top - bottom);
    for (int base = 0; base < count; base += blockDim.x) {
        const int i = base + (int)threadIdx.x;
        unsigned digit = 0x100u;
        if (i < count) {
            const double v = value(i);
            if (!isinf(v)) digit = (unsigned)min(255, (int)((top - v) * scale_a));
        }
        warp_count_digit(digit, bins);
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_find_bin(bins, &s_k, &s_bin_a);
    __syncthreads();
    const int bin_a = s_bin_a;
    const double top_b = top - (double)bin_a / scale_a, scale_b = 256.0 * scale_a;
    for (int base = 0; base < count; base += blockDim.x) {
        const int i = base + (int)threadIdx.x;
        unsigned digit = 0x100u;
        if (i < count) {
            const double v = value(i);
            if (!isinf(v) && min(255, (int)((top - v) * scale_a)) == bin_a) {
                digit = (unsigned)min(255, max(0, (int)((top_b - v) * scale_b)));
            }
        }
        warp_count_digit(digit, bins + 256);
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_find_bin(bins + 256, &s_k, &s_bin_b);
    __syncthreads();
    const int bin_b = s_bin_b;
    unsigned long long m = ~0ull;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const double v = value(i);
        if (!isinf(v) && min(255, (int)((top - v) * scale_a)) == bin_a &&
            min(255, max(0, (int)((top_b - v) * scale_b))) == bin_b) {
            const unsigned long long key = double_key(v);
            m = key < m ? key : m;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long m2 = __shfl_xor_sync(kFullMask, m, o);
        m = m2 < m ? m2 : m;
    }
    if ((threadIdx.x & 31) == 0 && m != ~0ull) atomicMin(&s_min, m);
    __syncthreads();
    return key_double(s_min);
}

// The score of the next candidate of owner o's chain of children (o = -1: the root's),
// or -inf when the chain is exhausted (no rank left, depth L, a -inf log-prob).
__device__ inline double chain_head(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o,
                                    const int32_t* root_next, const int32_t* root_last) {
    // The root's chain state is read only for the root: thread 0 writes it in round 0
    // while the other threads work on their own owners.
    const int32_t d = o < 0 ? 0 : c.depth[o];
    const int32_t r = o < 0 ? *root_next : c.order[o];
    const int32_t last = o < 0 ? *root_last : c.pos[o];
    if (d >= L || r >= kp) return -INFINITY;
    const float* row = lp_s + (int64_t)d * kp;
    if (last < 0) return o < 0 ? (double)row[0] : c.logw[o] + (double)row[0];
    return (c.logw[last] - (double)row[r - 1]) + (double)row[r];  // spec: subtract first, then add
}

// Emits, from `node` (a candidate with no child yet), its first child, that child's first
// child, and so on while the scores stay >= T (a first child scores its parent's score +
// lp[d][0], the spec's rule), each taking one slot and becoming its parent's chain so far
// (next rank 1). One thread. The nodes it adds are owners in the next round, which
// resume their chains at rank 1 (and find a head below T or -inf where the walk stopped),
// so P_T is unchanged; what changes is that a path of first children costs no round per
// depth: a round's run that starts at rank 0 walks its first node's first children at
// once (a spine of 16 took 16 rounds; the rounds were ~0.6-1.5 us each on an H200).
__device__ void walk_first_children(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t node, double T,
                                    int* count, int* overflow) {
    for (;;) {
        const int32_t dn = c.depth[node];
        if (dn >= L) return;
        const double w = c.logw[node] + (double)lp_s[(int64_t)dn * kp];
        if (isinf(w) || !(w >= T)) return;  // the node's own round sees this head
        const int slot = atomicAdd(count, 1);
        if (slot + 1 > c.cap) {
            *overflow = 1;
            return;
        }
        new_cand(c, slot, w, node, 0, dn + 1, -1, node);
        c.fc[node] = slot;
        c.order[node] = 1;
        c.pos[node] = slot;
        node = slot;
    }
}

// n > 0 consecutive candidate slots for the calling warp (every lane calls it with the same
// n): lane 0 takes them with one atomic; returns the first on every lane, or -1 with
// *overflow set when they do not fit (the pass is then rolled back).
__device__ inline int warp_take_slots(int* count, int n, int cap, int* overflow) {
    int slot0 = 0;
    if ((threadIdx.x & 31) == 0) slot0 = atomicAdd(count, n);
    slot0 = __shfl_sync(kFullMask, slot0, 0);
    if (slot0 + n > cap) {
        if ((threadIdx.x & 31) == 0) *overflow = 1;
        return -1;
    }
    return slot0;
}

// walk_first_children by a whole warp (every lane calls it with the same node): lane k
// scores the walk's k-th step, ((w + lp[d][0]) + lp[d + 1][0]) + ... + lp[d + k][0], the
// same additions in the same order as the one-thread walk, so the same doubles; the walk
// takes the steps before the first one not admitted (not finite, or < T), as the
// one-thread walk stops there.
// They take their slots with one atomic and are written one lane each: the same nodes,
// fields and links as walk_first_children, with no dependent atomic per step (the
// one-thread walk cost ~0.1 us a step on an H200). On overflow nothing is written (the
// pass is rolled back). At most 32 steps: a longer path goes on in the next round, where
// the last node's run starts at rank 0 and walks again.
__device__ void walk_first_children_warp(const Cands& c, int64_t L, int32_t node,
                                         double T, int* count, int* overflow) {
    const int lane = threadIdx.x & 31;
    const int32_t d0 = c.depth[node];
    const int steps = (int)min((int64_t)32, L - d0);
    if (steps <= 0) return;
    const double* col = c.lp0 + d0;  // lp[d][0] for d = d0, d0 + 1, ...
    double w = c.logw[node];
    // Four steps at a time. Lanes up to a chunk's last step then hold their final scores,
    // and the walk ends at its first refused step: once one is refused, later steps are not
    // needed (all 16 steps of every walk were ~3,500 warp instructions a block at N = 64,
    // H200 ncu; most walks end in their first chunk).
    for (int j0 = 0; j0 < steps; j0 += 4) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = j0 + u;
            if (j < steps) {
                const double v = col[j];
                if (j <= lane) w = w + v;
            }
        }
        const bool refused_here = lane <= min(j0 + 3, steps - 1) && !(!isinf(w) && w >= T);
        if (__any_sync(kFullMask, refused_here)) break;
    }
    // (Lanes past the chunk where the loop stopped hold partial sums, but lie after the
    // first refused step: they are not taken.)
    const bool admitted = lane < steps && !isinf(w) && w >= T;
    const unsigned refused = __ballot_sync(kFullMask, !admitted);
    const int n = refused ? __ffs(refused) - 1 : 32;
    if (n == 0) return;
    const int slot0 = warp_take_slots(count, n, c.cap, overflow);
    if (slot0 < 0) return;
    if (lane < n) {
        const int32_t slot = slot0 + lane;
        const int32_t parent = lane == 0 ? node : slot - 1;
        new_cand(c, slot, w, parent, 0, d0 + 1 + lane, -1, parent);
        if (lane + 1 < n) {  // this step has a child in the walk, its chain so far
            c.fc[slot] = slot + 1;
            c.order[slot] = 1;
            c.pos[slot] = slot + 1;
        }
        if (lane == 0) {
            c.fc[node] = slot;
            c.order[node] = 1;
            c.pos[node] = slot;
        }
    }
}

// Resumes owner o's chain of children at threshold T: emits the next candidates while
// their scores are >= T (one atomic per eight, whose slots are consecutive), links them
// after the chain's last child and makes each of them an owner with an empty chain. Then
// goes on down the run's first node's chain, and so on (depth first), so that a path of
// first children (the spine) takes one round, not one round per depth; the rest of each
// run waits for the next round. A chain walked again in a later round of the same pass
// starts below T and emits nothing.
__device__ inline void resume_chain(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o, double T,
                                    int* count, int* pruned, int* overflow, int32_t* root_next, int32_t* root_last,
                                    int* root_fc, bool depth_first, bool walk) {
    for (;;) {
        const double head = chain_head(c, lp_s, L, kp, o, root_next, root_last);
        if (isinf(head)) return;
        if (head < T) {
            *pruned = 1;
            return;
        }
        const int32_t d = o < 0 ? 0 : c.depth[o];
        const int32_t r0 = o < 0 ? *root_next : c.order[o];
        const float* row = lp_s + (int64_t)d * kp;
        int32_t prev = o < 0 ? *root_last : c.pos[o];  // the chain's last child so far
        int32_t first_new = -1, r = r0;
        double w = head;
        bool more = true;
        // Up to eight candidates are scored (in the spec's order, one after another) into
        // registers, then take their slots with one atomic and are written; repeat.
        while (more) {
            double ws[8];
            int nb = 0;
            float v[9];  // the row's values for this batch, loaded before the dependent scoring
#pragma unroll
            for (int j = 0; j < 9; j++) v[j] = r + j < kp ? row[r + j] : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (!more) break;
                if (r + j >= kp || isinf(w)) {  // no rank left; -inf: never emitted, nor the rest
                    more = false;
                    break;
                }
                if (w < T) {
                    *pruned = 1;
                    more = false;
                    break;
                }
                ws[j] = w;
                nb = j + 1;
                if (r + j + 1 < kp) w = (w - (double)v[j]) + (double)v[j + 1];  // subtract, then add
            }
            if (nb == 0) break;
            const int slot0 = atomicAdd(count, nb);
            if (slot0 + nb > c.cap) {
                *overflow = 1;
                return;
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j >= nb) break;
                const int32_t slot = slot0 + j;
                new_cand(c, slot, ws[j], o, r + j, d + 1, j + 1 < nb ? slot + 1 : -1,
                         j > 0 ? slot - 1 : (prev >= 0 ? prev : o));
            }
            if (prev >= 0) c.ns[prev] = slot0;
            else if (o >= 0) c.fc[o] = slot0;
            else *root_fc = slot0;
            if (first_new < 0) first_new = slot0;
            prev = slot0 + nb - 1;
            r += nb;
            if (r >= kp) more = false;
        }
        if (o >= 0) {
            c.order[o] = r;
            c.pos[o] = prev;
        } else {
            *root_next = r;
            *root_last = prev;
        }
        if (first_new < 0) return;
        if (!depth_first) {
            if (walk && r0 == 0 && o >= 0) walk_first_children(c, lp_s, L, kp, first_new, T, count, overflow);
            return;
        }
        o = first_new;  // depth first: the run's best node's children next
    }
}

// resume_chain for one owner o >= 0 by a whole warp (every lane calls it with the same o),
// breadth first: the run it emits waits for the next round. The chain's scores follow the
// spec's recurrence w' = (w - lp[r]) + lp[r + 1], i.e. w_r = fl(x_r + lp[r]) with
// x_{r+1} = fl(w_r - lp[r]). Where x_{r+1} == x_r bit for bit (usual: a parent's score and
// a float log-prob sum exactly in a double), every score of the run is fl(x + lp[r]),
// which the 32 lanes compute for 32 ranks at once; each lane checks that identity for its
// rank, and the run is cut after the first lane where it fails (its score is still
// right), then resumes from the x that lane computed. So the candidates are exactly
// resume_chain's, one lane per candidate instead of one thread per chain.
// (When pos[o] >= 0, the last child's score and lp[d][order[o] - 1] are finite: it was
// emitted.)
__device__ void resume_chain_warp(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int32_t o, double T,
                                  int* count, int* pruned, int* overflow, bool walk) {
    const int lane = threadIdx.x & 31;
    const int32_t d = c.depth[o];
    int32_t r = c.order[o];     // the chain's next rank
    int32_t prev = c.pos[o];    // its last child so far, -1: none
    if (d >= L || r >= kp) return;
    const bool first_run = r == 0;
    int32_t walk_from = -1;     // the rank-0 child emitted here, if any
    const float* row = lp_s + (int64_t)d * kp;
    double x = prev < 0 ? c.logw[o] : c.logw[prev] - (double)row[r - 1];  // spec: subtract first, then add
    for (;;) {
        const int32_t rk = r + lane;
        const bool in = rk < kp;
        const double v = in ? (double)row[rk] : 0.0;
        const double w = x + v;
        const double x_next = w - v;
        const bool same_x = in && __double_as_longlong(x_next) == __double_as_longlong(x);
        const bool admitted = in && !isinf(w) && w >= T;
        const unsigned x_changes = __ballot_sync(kFullMask, !same_x);
        const unsigned refused = __ballot_sync(kFullMask, !admitted);
        const int valid = x_changes ? __ffs(x_changes) - 1 : 31;  // lanes <= valid hold true scores
        const int stop = refused ? __ffs(refused) - 1 : 32;      // the first rank not admitted
        const int m = stop <= valid ? stop : valid + 1;          // lanes [0, m) are emitted now
        if (m > 0) {
            // Too many for the arrays: this threshold is too low. order[o] / pos[o] are left
            // as they were, and any link made by an earlier step of this call is cut by the
            // pass's rollback.
            const int slot0 = warp_take_slots(count, m, c.cap, overflow);
            if (slot0 < 0) return;
            if (lane < m) {
                const int32_t slot = slot0 + lane;
                new_cand(c, slot, w, o, rk, d + 1, lane + 1 < m ? slot + 1 : -1,
                         lane > 0 ? slot - 1 : (prev >= 0 ? prev : o));
            }
            __syncwarp();  // the last step's final lane wrote ns[prev] = -1: lane 0 links after it
            if (lane == 0) {
                if (prev >= 0) c.ns[prev] = slot0;
                else c.fc[o] = slot0;
            }
            if (first_run && r == 0) walk_from = slot0;
            prev = slot0 + m - 1;
            r += m;
        }
        if (stop <= valid) {
            // Stopped at rank r (lane `stop`): pruned when it exists with a finite score
            // (below T); no rank left or -inf (and the rest -inf) is not pruning.
            const bool prunes = in && !isinf(w) && !(w >= T);
            if (__shfl_sync(kFullMask, prunes, stop) && lane == 0) *pruned = 1;
            break;
        }
        x = __shfl_sync(kFullMask, x_next, valid);  // every lane up to `valid` was emitted
    }
    __syncwarp();  // every lane has read the chain's state (above) before lane 0 moves it on
    if (lane == 0) {
        c.order[o] = r;
        c.pos[o] = prev;
    }
    if (walk && walk_from >= 0) {  // (warp-uniform: from the broadcast slot)
        __syncwarp();  // walk_from's fields, written by lane 0, are read by every lane
        walk_first_children_warp(c, L, walk_from, T, count, overflow);
    }
}

// The root's chain of children, resumed at T by the whole block. Its scores need no
// sequential pass: the spec's recurrence (w - lp[r - 1]) + lp[r] starting from w = lp[0]
// gives every rank its own log-prob exactly (x - x = +0 and +0 + y = y), except that a
// -0.0 becomes +0.0 after rank 0. The row descends, so the ranks admitted are a prefix of
// what is left: thread 0 finds its length by bisection and takes the slots, then every
// thread writes some. Same candidates, links and flags as resume_chain(-1) would leave
// (round 0 of a pass spent ~10-20 us on the root's ~600 siblings at N = 1024 on one
// thread). Block-wide; L >= 1.
__device__ inline double root_child_score(const float* row0, int32_t r) {
    const double v = (double)row0[r];
    return r > 0 && v == 0.0 ? 0.0 : v;
}
__device__ void root_chain_block(const Cands& c, const float* lp_s, int64_t L, int64_t kp, double T, int* count,
                                 int* pruned, int* overflow, int32_t* root_next, int32_t* root_last, int* root_fc,
                                 bool walk) {
    __shared__ int s_n, s_slot0, s_prev, s_r0;
    if (threadIdx.x == 0) {
        const int32_t r0 = *root_next;
        // Admitted: finite and >= T; a prefix of [r0, kp) since the row descends.
        int32_t lo = r0, hi = (int32_t)kp;  // the first rank not admitted is in [lo, hi]
        while (lo < hi) {
            const int32_t mid = lo + (hi - lo) / 2;
            const double w = root_child_score(lp_s, mid);
            if (!isinf(w) && w >= T) lo = mid + 1;
            else hi = mid;
        }
        const int n = lo - r0;
        if (lo < kp && !isinf(root_child_score(lp_s, lo))) *pruned = 1;  // a finite head below T
        s_n = 0;
        if (n > 0) {
            const int slot0 = atomicAdd(count, n);
            if (slot0 + n > c.cap) {
                *overflow = 1;  // the chain's state is left as it was (as resume_chain does)
            } else {
                const int32_t prev = *root_last;
                if (prev >= 0) c.ns[prev] = slot0;
                else *root_fc = slot0;
                *root_next = r0 + n;
                *root_last = slot0 + n - 1;
                s_n = n;
                s_slot0 = slot0;
                s_prev = prev;
                s_r0 = r0;
            }
        }
    }
    __syncthreads();
    const int n = s_n, slot0 = s_slot0, prev = s_prev, r0 = s_r0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int32_t slot = slot0 + j;
        new_cand(c, slot, root_child_score(lp_s, r0 + j), -1, r0 + j, 1, j + 1 < n ? slot + 1 : -1,
                 j > 0 ? slot - 1 : prev);
    }
    __syncthreads();
    if (walk && r0 == 0 && n > 0) {  // the spine below the root's first child
        if (threadIdx.x < 32) walk_first_children_warp(c, L, slot0, T, count, overflow);
        __syncthreads();
    }
}

// Version 4 (above). Returns |P_T| >= 0 with the candidates, links and *root_fc filled,
// or -1 for version 3. Block-wide; kp > 0, L > 0, N > 0, lp_s[0] finite; c.lp0 is
// `spine`'s array (it holds the walks' rank-0 column once the first threshold is chosen).
__device__ int descend_threshold(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N, int* s_count,
                                 int* s_root_fc, unsigned* bins, double* spine, int* passes, bool depth_first,
                                 bool warp_chains, bool walk_switch, bool counting) {
    KDT_V4_PROF(int rounds = 0; int stamp = 1; kdt_prof_v4_mark(0);)
    KDT_V4_PROF(__shared__ int s_prof_go[32];)
    __shared__ int s_pruned, s_overflow;
    __shared__ int32_t s_root_next, s_root_last;
    // The first threshold: about the (N/2)-th best spine child, spine[d] + lp[d][r] over
    // the first `width` ranks of each row (an estimate: any threshold gives the exact tree;
    // the passes below correct it), the (3N/4)-th up to kFirstWideTargetMax,
    // from one round of 256 bins between the best value lp[0][0] and the lowest finite one.
    const int64_t half = N / 2 > 1 ? N / 2 : 1;
    const int width = (int)(kp < half ? kp : half);
    const int items = (int)L * width;
    const int64_t target = N <= kFirstWideTargetMax && !KDT_KNOB(4) ? (3 * N / 4 > 1 ? 3 * N / 4 : 1) : half;
    __shared__ double s_low;
    __shared__ int s_want, s_bin;
    if (threadIdx.x == 0) {
        *s_count = 0;
        *s_root_fc = -1;
        s_root_next = 0;
        s_root_last = -1;
        double w = 0.0, low = (double)lp_s[0];  // spine[d]: the score of the top-1 path's node at depth d
        for (int64_t d = 0; d < L; d++) {
            spine[d] = w;
            const double v = w + (double)lp_s[d * kp + width - 1];
            if (!isinf(v) && v < low) low = v;
            w = w + (double)lp_s[d * kp];
        }
        s_low = low;
        s_want = (int)(target < items ? target : items);
        s_bin = -1;
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
    __syncthreads();
    const double top = (double)lp_s[0], low = s_low;
    double T = low;
    if (N >= kDescentPreciseFirstMin) {
        // Large trees: the two-round threshold (one of the values, just under the target
        // count): a coarse bin's overshoot overflows the candidates there (H200: N = 1024
        // 274 us this way, 441 us with the single round; perf-notes).
        T = block_threshold(
            [&](int i) {
                const int d = i / width, r = i - d * width;
                return spine[d] + (double)lp_s[(int64_t)d * kp + r];
            },
            items, (int)(half < items ? half : items), bins, counting);
    } else if (low < top) {
        const double scale = 256.0 / (top - low);
        for (int base = 0; base < items; base += blockDim.x) {
            const int i = base + (int)threadIdx.x;
            unsigned digit = 0x100u;
            if (i < items) {
                const int d = i / width, r = i - d * width;
                const double v = spine[d] + (double)lp_s[(int64_t)d * kp + r];
                if (!isinf(v)) digit = (unsigned)min(255, max(0, (int)((top - v) * scale)));
            }
            warp_count_digit(digit, bins);
        }
        __syncthreads();
        if (threadIdx.x < 32) warp_find_bin(bins, &s_want, &s_bin);
        __syncthreads();
        // The chosen bin's lower edge. (Its upper edge, a little under the target count,
        // cost N = 64 a third pass on an H200: 47 -> 70 us; perf-notes.)
        if (s_bin >= 0) T = top - (double)(s_bin + 1) / scale;
    }
    if (!(T > -INFINITY)) T = -DBL_MAX;
    // The spine's scores are dead (their last reads are behind a barrier above): the same
    // array now holds lp[d][0] as doubles for the first-child walks, which start after the
    // barrier at the top of the first pass. (No static shared memory of its own: more
    // moves budgets near the shared-memory limit to slower paths.)
    for (int i = threadIdx.x; i < L; i += blockDim.x) c.lp0[i] = (double)lp_s[(int64_t)i * kp];
    KDT_V4_PROF(kdt_prof_v4_mark(stamp++);)
    int kept = 0;               // candidates after the last pass that fit (and ended below N)
    double t_kept = top;        // its threshold (before any pass: lp[0][0], which admits few)
    bool have_over = false;     // a pass overflowed: at t_over, with more than c_over candidates
    double t_over = 0.0, c_over = 0.0;
    const int spread = (int)(threadIdx.x % 32) * (int)(blockDim.x / 32) + (int)(threadIdx.x / 32);  // thread 0: 0
    const bool warp_rounds = warp_chains && !depth_first;  // the root's chain is then root_chain_block's
    const bool walk = walk_switch && !depth_first;  // first children walked at once (walk_first_children)
    for (int pass = 0; pass < kDescentMaxPasses; pass++) {
        *passes = pass + 1;
        // The rounds' lists of owners to resume: their lengths by chunk parity, after the
        // list in `bins` (which the thresholds between the passes overwrite).
        unsigned* const s_ngo = bins + kGoListMax;
        if (threadIdx.x == 0) {
            s_pruned = 0;
            s_overflow = 0;
            s_ngo[0] = 0;
            s_ngo[1] = 0;
        }
        int go_parity = 0;  // which of s_ngo the next chunk of owners counts its list in
        __syncthreads();
        int lo = -1;
        if (!depth_first) {
            root_chain_block(c, lp_s, L, kp, T, s_count, &s_pruned, &s_overflow, &s_root_next, &s_root_last, s_root_fc,
                             walk);
            lo = 0;  // the root's chain is done
        }
        KDT_V4_PROF(int round_mark = 0; kdt_prof_round_mark(pass, round_mark++);)
        int hi = s_overflow ? lo : min(*s_count, c.cap);  // round 0: every candidate (and the root)
        __syncthreads();  // everyone has read the count before round 0 adds to it
        while (lo < hi) {
            if (warp_rounds) {
                // One warp per owner whose chain head is >= T, one lane per candidate
                // (resume_chain_warp). The heads are read one owner per thread (most owners
                // of a round are leaves of P_T, whose head is below T or -inf), the owners to
                // resume are listed in `bins` (free during the rounds), and the list is dealt
                // to the warps in turn: a round's k resumptions take ceil(k / 16) in its
                // slowest warp. (Owners dealt by index, owner k to warp k % 16, left one warp
                // 3 of a round's 15 on the synthetic drafter at N = 64, H200: ~1.3 us each.)
                const int nw = (int)(blockDim.x / 32), lane = (int)(threadIdx.x & 31);
                const int warp = (int)(threadIdx.x / 32), chunk = min((int)blockDim.x, kGoListMax);
                KDT_V4_PROF(if (lane == 0) s_prof_go[warp] = 0;)
                for (int base = lo; base < hi; base += chunk) {
                    const int i = base + (int)threadIdx.x;
                    bool go = false;
                    if ((int)threadIdx.x < chunk && i < hi) {
                        const double head = chain_head(c, lp_s, L, kp, i, &s_root_next, &s_root_last);
                        if (!isinf(head)) {
                            if (head >= T) go = true;
                            else s_pruned = 1;
                        }
                    }
                    const unsigned m = __ballot_sync(kFullMask, go);
                    int at = 0;
                    if (lane == 0 && m) at = (int)atomicAdd(&s_ngo[go_parity], (unsigned)__popc(m));
                    at = __shfl_sync(kFullMask, at, 0) + __popc(m & ((1u << lane) - 1u));
                    if (go) bins[at] = (unsigned)i;
                    __syncthreads();
                    const int n = (int)s_ngo[go_parity];
                    // The other count was last read before the barrier between the chunks
                    // (or the rounds) before this one, and is next added to after the next.
                    if (threadIdx.x == 0) s_ngo[go_parity ^ 1] = 0;
                    go_parity ^= 1;
                    for (int g = warp; g < n; g += nw) {
                        KDT_V4_PROF(if (lane == 0) s_prof_go[warp]++;)
                        resume_chain_warp(c, lp_s, L, kp, (int32_t)bins[g], T, s_count, &s_pruned,
                                          &s_overflow, walk);
                    }
                    // The list is read before the next chunk writes it.
                    if (base + chunk < hi) __syncthreads();
                }
            } else {
                // One thread per owner. Consecutive owners go to different warps (owner k to
                // warp k % 16): a warp runs its lanes' diverging chain walks one after
                // another, so a round of a few owners packed into one warp took as long as
                // their sum (H200 profile).
                for (int i = lo + spread; i < hi; i += blockDim.x) {
                    resume_chain(c, lp_s, L, kp, i, T, s_count, &s_pruned, &s_overflow, &s_root_next, &s_root_last,
                                 s_root_fc, depth_first, walk);
                }
            }
            KDT_V4_PROF(if (threadIdx.x == 0) rounds++;)
            __syncthreads();
            KDT_V4_PROF(if (pass == 0 && threadIdx.x == 0 && blockIdx.x < 4096 && round_mark < 8 &&
                            warp_rounds) {
                int tot = 0, most = 0;
                for (int w = 0; w < (int)(blockDim.x / 32); w++) {
                    tot += s_prof_go[w];
                    most = max(most, s_prof_go[w]);
                }
                kdt_prof_rstat[blockIdx.x][round_mark][0] = hi - lo;
                kdt_prof_rstat[blockIdx.x][round_mark][1] = tot;
                kdt_prof_rstat[blockIdx.x][round_mark][2] = most;
            })
            KDT_V4_PROF(kdt_prof_round_mark(pass, round_mark++);)
            lo = hi;
            hi = min(*s_count, c.cap);
            if (s_overflow) break;
            __syncthreads();  // everyone has read the count before the next round adds to it
        }
        const int M = *s_count;
        KDT_V4_PROF(kdt_prof_v4_mark(stamp++); if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_v4[blockIdx.x][7] = rounds;)
        if (s_overflow) {
            // T was too low for the candidate arrays: drop this pass's candidates (every
            // chain is cut back to its children below `kept`, which come first in its
            // list) and try halfway between the last threshold that fit and T.
            for (int o = (int)threadIdx.x - 1; o < kept; o += blockDim.x) {
                int32_t first = o < 0 ? *s_root_fc : c.fc[o];
                if (first >= kept) first = -1;
                int32_t last = -1;
                for (int32_t a = first; a >= 0 && a < kept; a = c.ns[a]) last = a;
                if (last >= 0) c.ns[last] = -1;
                const int32_t next = last >= 0 ? c.rank[last] + 1 : 0;
                if (o < 0) {
                    *s_root_fc = first;
                    s_root_next = next;
                    s_root_last = last;
                } else {
                    c.fc[o] = first;
                    c.order[o] = next;
                    c.pos[o] = last;
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) *s_count = kept;
            if (!have_over || T > t_over) {
                have_over = true;
                t_over = T;
                c_over = (double)M;
            }
            const double mid = 0.5 * (t_kept + T);
            if (!(mid > T && mid < t_kept)) return -1;  // cannot separate them: version 3
            T = mid;
            continue;
        }
        if (M >= N || !s_pruned) return M;
        kept = M;
        t_kept = T;
        // The next threshold from the chain heads (the heap's frontier).
        auto head = [&](int i) { return chain_head(c, lp_s, L, kp, i - 1, &s_root_next, &s_root_last); };
        T = block_threshold(head, M + 1, (int)(N - M), bins, counting);
        if (isinf(T)) return -1;  // (cannot happen: a pruned chain has a finite head; version 3 if it does)
        if (have_over && !(T > t_over)) {
            // Never at or below a threshold that already overflowed: interpolate log(count)
            // between the last pass that fit and it, towards 1.2 N (tools/emulate_descent.py,
            // policy C: 3-4 passes instead of up to 8 on bf16 logits at N = 1024).
            const double lo_c = kept > 1 ? (double)kept : 1.0;
            double f = (log(1.2 * (double)N) - log(lo_c)) / (log(c_over) - log(lo_c));
            f = fmin(fmax(f, 0.1), 0.9);
            T = t_kept + (t_over - t_kept) * f;
            if (!(T > t_over && T < t_kept)) return -1;
        }
        KDT_V4_PROF(kdt_prof_v4_mark(stamp++);)
        __syncthreads();
    }
    return -1;
}

// Version 3's threshold search: bisection (with log-count interpolation) until
// N <= |P_T| <= cap or P_T holds every finite node. Returns |P_T|, or -1 for the heap.
__device__ int bisect_threshold(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N, int* s_count,
                                int* s_pruned, int* s_root_fc, int* prof_passes) {
    (void)prof_passes;  // counted only in the profiling build
    const double top = (double)lp_s[0];
    // Bracket: t_high gives too few nodes, t_low too many (more than cap). The next
    // threshold interpolates log(count) linearly in T towards 1.5 N (counts grow about
    // exponentially as T falls), kept inside the bracket; plain halving when that stalls.
    double t_high = top + 1.0, t_low = -INFINITY, T = top - 4.0;
    double c_high = 0.0, c_low = 0.0;  // counts seen at the bracket ends (c_low: a lower bound)
    const double target = 1.5 * (double)N;
    int found = 0;
    for (int iter = 0; iter < 60; iter++) {
        KDT_V3_PROF((*prof_passes)++;)
        const int cnt = enumerate_pt(c, lp_s, L, kp, T, s_count, s_pruned, s_root_fc);
        const int pruned = *s_pruned;
        if (cnt > c.cap) {
            t_low = T;
            c_low = (double)cnt;
        } else if (cnt < N && pruned) {
            t_high = T;
            c_high = (double)cnt;
        } else {
            found = 1;
            break;
        }
        if (isinf(t_low)) {
            T = top - 2.0 * (top - T) - 1.0;  // widen downwards until too many
            continue;
        }
        const double gap = t_high - t_low;
        double next = 0.5 * (t_low + t_high);
        if (c_high >= 1.0 && c_low > c_high && iter % 3 != 2) {  // every third step halves
            next = t_high - gap * (log(target) - log(c_high)) / (log(c_low) - log(c_high));
            next = fmin(fmax(next, t_low + 0.05 * gap), t_high - 0.05 * gap);
        }
        if (!(next > t_low && next < t_high)) break;  // cannot separate: fall back
        T = next;
    }
    return found ? *s_count : -1;
}

// Heap order of two sort entries (score, candidate index; index -1: padding, last).
// Branch-free but for exact ties of two candidates (rare), which compare their rank paths:
// the branchy form cost ~400 cycles per bitonic stage on an H200.
__device__ inline bool sort_entry_before(const Cands& c, double wa, int32_t oa, double wb, int32_t ob) {
    const bool eq = wa == wb;  // also -0.0 == +0.0, as the heap compares
    bool before = wa > wb || (eq && oa >= 0 && ob < 0);
    if (eq && oa >= 0 && ob >= 0) before = cand_path_before(c, oa, ob);
    return before;
}

// The bitonic stages (k, j) for k = k_lo .. k_hi and j = min(k / 2, 32) .. 1 over the
// sort arrays c.logw / c.order [P] (P a multiple of 64): each warp takes 64-entry
// segments, a lane holds entries lane and lane + 32 of a segment, and partners at
// distance j < 32 are exchanged by shuffles. Same comparisons as the block-wide stages.
__device__ void warp_bitonic_stages(const Cands& c, int P, int k_lo, int k_hi) {
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    for (int seg = threadIdx.x / 32; seg < P / 64; seg += warps) {
        const int base = seg * 64;
        double w[2] = {c.logw[base + lane], c.logw[base + lane + 32]};
        int32_t o[2] = {c.order[base + lane], c.order[base + lane + 32]};
        for (int k = k_lo; k <= k_hi; k <<= 1) {
            for (int j = min(k >> 1, 32); j > 0; j >>= 1) {
                if (j == 32) {  // the pair is the lane's own two entries
                    const bool up = ((base + lane) & k) == 0;
                    if (up == sort_entry_before(c, w[1], o[1], w[0], o[0])) {
                        const double tw = w[0];
                        const int32_t to = o[0];
                        w[0] = w[1];
                        o[0] = o[1];
                        w[1] = tw;
                        o[1] = to;
                    }
                    continue;
                }
                const bool lower = (lane & j) == 0;
                double pw[2];
                int32_t po[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    pw[h] = __shfl_xor_sync(kFullMask, w[h], j);
                    po[h] = __shfl_xor_sync(kFullMask, o[h], j);
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int i = base + lane + 32 * h;
                    const bool up = (i & k) == 0;  // the same for both entries of the pair
                    // The pair's higher-index entry before its lower one? (operands selected,
                    // not branched on, so both halves of the warp run one comparison)
                    const double hw = lower ? pw[h] : w[h], lw = lower ? w[h] : pw[h];
                    const int32_t ho = lower ? po[h] : o[h], lo = lower ? o[h] : po[h];
                    if (up == sort_entry_before(c, hw, ho, lw, lo)) {
                        w[h] = pw[h];
                        o[h] = po[h];
                    }
                }
            }
        }
        c.logw[base + lane] = w[0];
        c.logw[base + lane + 32] = w[1];
        c.order[base + lane] = o[0];
        c.order[base + lane + 32] = o[1];
    }
}

// Returns n >= 0 with the node tables, scores and links filled (as kdt_expand_tree would),
// or -1 when the caller must run the heap. Block-wide; kp > 0, L > 0, N > 0.
__device__ int64_t parallel_expand(const Cands& c, const float* lp_s, int64_t L, int64_t kp, int64_t N,
                                   double* logw_s, int32_t* fc_s, int32_t* ns_s, int32_t* node_rank,
                                   int32_t* node_par, int32_t* node_depth, int descent, bool walk,
                                   bool counting) {
    __shared__ int s_count, s_pruned, s_root_fc, s_fail;
    __shared__ __align__(16) unsigned s_bins[512];  // also 256 doubles (block_threshold)
    __shared__ double s_spine[kDescentMaxDepth];
    const double top = (double)lp_s[0];
    if (isinf(top)) return -1;  // (the heap handles the empty tree)
    KDT_V3_PROF(long long prof_t0 = clock64();)
    int prof_passes_any = 0;  // version 3's passes, or 1000 + version 4's
    int M = -1;
    if (descent && L <= kDescentMaxDepth) {
        int passes = 0;
        Cands cw = c;
        cw.lp0 = s_spine;  // the spine's array, after the first threshold (descend_threshold)
        M = descend_threshold(cw, lp_s, L, kp, N, &s_count, &s_root_fc, s_bins, s_spine, &passes, descent == 2,
                              descent == 1, walk, counting);
        if (M >= 0) prof_passes_any = 1000 + passes;
    }
    if (M < 0) M = bisect_threshold(c, lp_s, L, kp, N, &s_count, &s_pruned, &s_root_fc, &prof_passes_any);
    if (M < 0) return -1;
    KDT_V3_PROF(const long long prof_t1 = clock64();)
    const int64_t n = M < N ? M : N;
    // The candidates sorted by the heap's key: by counting up to kCountSortMax (below), else
    // by a bitonic network on (score, index) pairs held side by side (c.logw is permuted
    // along with c.order; no candidate table is read except the rank paths of exactly equal
    // scores). Padding (index -1, score -inf) goes last. (Session 5's counting, a scalar
    // loop with a branchy comparison, was slower than the network from 64 candidates up;
    // perf-notes.)
    // Stages whose pairs lie inside one 64-candidate segment (j <= 32) run in registers,
    // one warp per segment, with no block barrier between them: all of k <= 64 in one
    // phase, then for each larger k the stages j >= 64 one by one and j <= 32 as one phase.
    bool sorted = false;
    if (counting && M <= kCountSortMax && M <= (int)blockDim.x && !KDT_KNOB(8)) {
        // Up to 256 candidates: each one's position is the number of candidates before it
        // (scores compared eight at a time from 16-byte loads, no branch), then every
        // candidate is written at its position. Candidates with an exactly equal score
        // then scan again, comparing rank paths with each equal one: by walking the paths
        // up to kCountSortMaxTies ties (below), beyond that by 128-bit path keys made
        // once per candidate when L x bits(K') <= 128, else the bitonic network below runs
        // instead (the same order): the rank-path walks diverge across lanes (H200: a flat
        // drafter's many equal log-probs made N = 64 38.5 -> 45.3 us). (The network is latency-bound
        // at these sizes: one warp's 21 dependent stages took 3.2 us for 64 candidates;
        // counting 423 took 7.7 us against its 8.8, and ~2x that with a tie, so larger sets
        // keep the network.)
        __shared__ int s_ties;
        // Candidates of equal score hold positions gt .. ge - 1 of the order (the same gt and
        // ge for each of them): every candidate lists itself from its gt on (s_member, s_fill
        // counting the members placed by group start), so a group's size is s_fill[gt] and
        // each tied candidate compares its rank path with its group's only. (A scan of all M candidates, one shared-memory round trip each, was ~2.8 us
        // of the round's build on an H200.)
        // Both live in s_bins (no static shared memory of their own: 2 KB more moved some
        // budgets near the shared-memory limit to slower paths). s_bins is free here: its
        // last use (descend_threshold's thresholds and owner lists) is followed by a
        // barrier before descend_threshold returns; bisect_threshold does not use it.
        static_assert(2 * kCountSortMax <= 512, "s_fill and s_member fit in s_bins");
        int* const s_fill = reinterpret_cast<int*>(s_bins);
        int* const s_member = s_fill + kCountSortMax;
        const int i = (int)threadIdx.x;
        if (threadIdx.x == 0) s_ties = 0;
        if (i < M) s_fill[i] = 0;
        KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_sort[blockIdx.x][0] = clock64();)
        __syncthreads();
        const double2* w2 = reinterpret_cast<const double2*>(c.logw);
        const int M8 = M & ~7;  // whole groups of eight; the rest one by one
        double wi = 0.0;
        int at = 0;
        bool joined = false;  // not the first of its group to list itself
        int gt = 0;
        if (i < M) {
            wi = c.logw[i];  // finite: every candidate was admitted at a finite T
            for (int j = 0; j < M8 / 2; j += 4) {
                double2 q[4];
#pragma unroll
                for (int u = 0; u < 4; u++) q[u] = w2[j + u];
#pragma unroll
                for (int u = 0; u < 4; u++) gt += (q[u].x > wi) + (q[u].y > wi);
            }
            for (int j = M8; j < M; j++) gt += c.logw[j] > wi;
            at = gt;
            // Every candidate lists itself in its group (one member for most); the group's
            // size, read after the barrier, replaces a second count of the scores >= its
            // own (~1,900 warp instructions a block at N = 64, H200 ncu).
            const int k = atomicAdd(&s_fill[gt], 1);
            s_member[gt + k] = i;
            joined = k > 0;
        }
        const unsigned joined_lanes = __ballot_sync(kFullMask, joined);
        if ((threadIdx.x & 31) == 0 && joined_lanes) atomicAdd(&s_ties, __popc(joined_lanes));
        __syncthreads();
        const int ge = i < M ? gt + s_fill[gt] : 0;
        const bool tied = ge - gt > 1;
        KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) {
            kdt_prof_tie[blockIdx.x][0] = clock64();
            kdt_prof_tie[blockIdx.x][3] = s_ties;
        })
        // Rank paths as 128-bit keys when they fit: field t (from the top, b bits) holds the
        // rank at depth t plus one, zeros past the path's depth, so the keys order the paths
        // as the heap does (lexicographically, a proper prefix first).
        const int kb = 32 - __clz((unsigned)kp);  // bits of the largest rank + 1
        const bool path_keys = s_ties > kCountSortMaxTies && (int64_t)kb * L <= 128;
        if (s_ties <= kCountSortMaxTies || path_keys) {
            uint64_t khi = 0, klo = 0;
            if (path_keys) {
                __shared__ uint64_t s_khi[kCountSortMax], s_klo[kCountSortMax];
                if (tied) {
                    for (int32_t cur = i, d = c.depth[i]; cur >= 0; cur = c.parent[cur], d--) {
                        const int lo_bit = 128 - d * kb;  // the field of depth d: [lo_bit, lo_bit + kb)
                        const uint64_t f = (uint64_t)(c.rank[cur] + 1);
                        if (lo_bit >= 64) {
                            khi |= f << (lo_bit - 64);
                        } else {
                            klo |= f << lo_bit;
                            if (lo_bit + kb > 64) khi |= f >> (64 - lo_bit);
                        }
                    }
                    s_khi[i] = khi;
                    s_klo[i] = klo;
                }
                __syncthreads();
                KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_tie[blockIdx.x][1] = clock64();)
                if (tied) {  // the heap's order among equal scores, by the keys
                    for (int q = gt; q < ge; q++) {
                        const int j = s_member[q];
                        const uint64_t hj = s_khi[j], lj = s_klo[j];
                        at += (hj < khi) | ((hj == khi) & (lj < klo));
                    }
                }
            } else if (tied) {  // the heap's order among equal scores, by walking the paths
                for (int q = gt; q < ge; q++) {
                    const int j = s_member[q];
                    if (j != i && cand_path_before(c, j, i)) at++;
                }
            }
            KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_sort[blockIdx.x][1] = clock64();)
            __syncthreads();
            if (i < M) {
                c.logw[at] = wi;
                c.order[at] = i;
            }
            __syncthreads();
            sorted = true;
        }
    }
    if (!sorted) {
        int P = 1;
        while (P < M) P <<= 1;
        const bool warp_stages = c.cap >= 64;  // c.order and c.logw hold >= 64 entries
        if (warp_stages && P < 64) P = 64;
        for (int i = threadIdx.x; i < P; i += blockDim.x) {
            c.order[i] = i < M ? i : -1;
            if (i >= M) c.logw[i] = -INFINITY;
        }
        __syncthreads();
        int k_first = 2;
        if (warp_stages) {
            KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_sort[blockIdx.x][0] = clock64();)
            warp_bitonic_stages(c, P, 2, 64);
            __syncthreads();
            KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_sort[blockIdx.x][1] = clock64();)
            k_first = 128;
        }
        const int half = P >> 1;
        for (int k = k_first; k <= P; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                if (warp_stages && j <= 32) {
                    warp_bitonic_stages(c, P, k, k);
                    __syncthreads();
                    break;
                }
                // Four disjoint pairs per thread: all loaded before any is compared.
                for (int q0 = threadIdx.x; q0 < half; q0 += 4 * blockDim.x) {
                    int ii[4];
                    double wi[4], wl[4];
                    int32_t ai[4], al[4];
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int q = q0 + u * (int)blockDim.x;
                        ii[u] = q < half ? (((q & ~(j - 1)) << 1) | (q & (j - 1))) : -1;  // the pair (i, i ^ j)
                        if (ii[u] >= 0) {
                            wi[u] = c.logw[ii[u]];
                            wl[u] = c.logw[ii[u] + j];
                            ai[u] = c.order[ii[u]];
                            al[u] = c.order[ii[u] + j];
                        }
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        if (ii[u] < 0) continue;
                        const int i = ii[u], l = i + j;
                        const bool l_first = sort_entry_before(c, wl[u], al[u], wi[u], ai[u]);  // l before i?
                        const bool up = (i & k) == 0;  // this run ascends in heap order
                        if (up == l_first) {
                            c.logw[i] = wl[u];
                            c.logw[l] = wi[u];
                            c.order[i] = al[u];
                            c.order[l] = ai[u];
                        }
                    }
                }
                __syncthreads();
            }
        }
    }
    if (threadIdx.x == 0) s_fail = 0;
    KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) kdt_prof_sort[blockIdx.x][2] = clock64();)
    for (int k = threadIdx.x; k < M; k += blockDim.x) c.pos[c.order[k]] = k;
    __syncthreads();
    // Every selected node after its generator: then this order is the heap's.
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int32_t g = c.gen[c.order[k]];
        if (g >= 0 && c.pos[g] >= k) atomicOr(&s_fail, 1);
    }
    __syncthreads();
    KDT_V3_PROF(if (threadIdx.x == 0 && blockIdx.x < 4096) {
        kdt_prof_v3[blockIdx.x][0] = prof_passes_any;
        kdt_prof_v3[blockIdx.x][1] = prof_t1 - prof_t0;
        kdt_prof_v3[blockIdx.x][2] = clock64() - prof_t1;
        kdt_prof_v3[blockIdx.x][3] = M;
        kdt_prof_sort[blockIdx.x][3] = clock64();
    })
    if (s_fail) return -1;
    const int root_fc = s_root_fc;
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
        if (i == 0) {
            logw_s[0] = 0.0;
            fc_s[0] = (root_fc >= 0 && c.pos[root_fc] < n) ? c.pos[root_fc] + 1 : -1;
            ns_s[0] = -1;
            node_rank[0] = 0;
            node_par[0] = -1;
            node_depth[0] = 0;
        } else if (i <= n) {
            const int32_t a = c.order[i - 1];
            logw_s[i] = c.logw[i - 1];  // sorted along with c.order
            node_rank[i] = c.rank[a];
            node_depth[i] = c.depth[a];
            node_par[i] = c.parent[a] < 0 ? 0 : c.pos[c.parent[a]] + 1;
            fc_s[i] = (c.fc[a] >= 0 && c.pos[c.fc[a]] < n) ? c.pos[c.fc[a]] + 1 : -1;
            ns_s[i] = (c.ns[a] >= 0 && c.pos[c.ns[a]] < n) ? c.pos[c.ns[a]] + 1 : -1;
        } else {
            logw_s[i] = -INFINITY;
            fc_s[i] = -1;
            ns_s[i] = -1;
        }
    }
    __syncthreads();
    return n;
}

// build_kernel_smem's shared-memory layout for one request (passed in BuildParams::lay).
inline SmemLayout smem_layout(int64_t L, int64_t kp, int64_t N, int64_t cap, int64_t hash_slots) {
    SmemLayout s;
    s.heap = 0;
    s.logw = align_up((size_t)(cap + 2) * sizeof(kdt_cand), 16);
    s.tables = s.logw + align_up((size_t)(N + 1) * sizeof(double), 16);
    s.links = s.tables + align_up((size_t)(cap + 1) * 4 * sizeof(int32_t), 16);
    s.hash = s.links + align_up((size_t)(N + 1) * 2 * sizeof(int32_t), 16);
    s.lp = s.hash + align_up((size_t)hash_slots * sizeof(int32_t), 16);
    s.cands = s.lp + align_up((size_t)(L * kp) * sizeof(float), 16);
    s.total = s.cands;  // + cands_bytes(cap3) when version 3 runs
    return s;
}

// Bytes of the version-3 candidate arrays for `cap3` (a power of two) candidates.
__host__ __device__ inline size_t cands_bytes(int64_t cap3) { return (size_t)cap3 * (8 + 8 * 4); }

// build_kernel_smem's validation plan for `threads` (a power of two) threads. The rows' hash
// sets of ids go in the idle candidate arrays when those are larger than one row's set,
// else in the layout's own set; as many rows are checked at a time as have sets there.
ValidationPlan validation_plan(const SmemLayout& lay, int64_t L, int64_t kp, int64_t hash_slots, int32_t cap3,
                               int threads) {
    ValidationPlan v;
    const size_t slots = (size_t)hash_slots;
    const size_t cand_bytes = cap3 > 0 ? cands_bytes(cap3) : 0;
    const bool in_cands = cand_bytes > slots * 4;
    v.tab_offset = in_cands ? lay.cands : lay.hash;
    const size_t tab_slots = (in_cands ? cand_bytes : slots * 4) / 4;
    v.group = slots > 0 ? (uint32_t)std::min((int64_t)(tab_slots / slots), L) : 1u;
    v.slot_bits = ceil_log2(slots);  // slots: a power of two
    const int block_bits = ceil_log2((uint64_t)threads);
    v.tpr_bits = std::min(ceil_log2((uint64_t)kp), block_bits);
    v.rpt_bits = std::max(0, ceil_log2((uint64_t)kp) - v.tpr_bits);
    v.rows_par_bits = block_bits - v.tpr_bits;
    return v;
}

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

// Version 2: the request's used log-probs, the heap, the node tables, scores and links all
// live in shared memory, so the one thread that runs the expansion never waits on device
// memory; tokens, depths, parents, positions and the masks are then written by the whole
// block from the node tables.
__global__ void __launch_bounds__(kSmemThreads, 1) build_kernel_smem(BuildParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    KDT_PROBE(0);
    const int64_t b = blockIdx.x;
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, N = p.out.budget, kp = p.eff_width;
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
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - L;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
    }
    KDT_PROBE(4);
    // Load the used part [L, K'] (row stride K' in shared memory) and check it. The rows go
    // in groups of G, each row of a group with its own hash set of ids (-1: empty) for
    // repeated ids: G = every row when the idle candidate arrays hold them, else as many
    // as fit. Threads are laid out without divisions: a row takes tpr threads (a power of
    // two >= K', at most the block), rows_par rows at a time, and a thread takes ranks
    // rs, rs + tpr, ... of its rows. Each thread loads eight entries (value, id and, where
    // no neighbouring lane has it, the previous rank's value) before checking any. The
    // probes of the hash sets run under a warp vote: lanes left to loop on their own never
    // reconverged, and the warp ran them one by one (H200 profile, N = 1024: 1-2 active
    // threads per instruction, the validation 125 us).
    {
        const uint32_t ukp = (uint32_t)kp, slots = (uint32_t)p.hash_slots;
        // The plan (hash sets, group size, thread layout) from the host: computed by every
        // thread it was ~1,000 warp instructions a block at N = 64 (H200 ncu), ahead of the
        // first loads.
        const ValidationPlan& vp = p.val;
        int32_t* tab = reinterpret_cast<int32_t*>(smem + vp.tab_offset);
        const uint32_t group = vp.group;
        const int slot_bits = vp.slot_bits, tpr_bits = vp.tpr_bits, rpt_bits = vp.rpt_bits;
        const uint32_t tpr = 1u << tpr_bits;
        const uint32_t rr = threadIdx.x >> tpr_bits, rs = threadIdx.x & (tpr - 1), lane = threadIdx.x % 32;
        const bool prev_by_shuffle = lane > 0 && rs > 0;  // lane - 1 holds rank r - 1 of the same row
        for (uint32_t g0 = 0; g0 < (uint32_t)L && kp > 0; g0 += group) {
            const uint32_t g1 = min((uint32_t)L, g0 + group);
            // The group's hash sets are cleared after its first entries' loads are issued
            // (in check_entries), so the barrier overlaps their latency.
            auto clear_sets = [&]() {
                const uint32_t n = (g1 - g0) * slots, n4 = n / 4;
                int4* tab4 = reinterpret_cast<int4*>(tab);  // 16-byte aligned (the layout)
                for (uint32_t i = threadIdx.x; i < n4; i += blockDim.x) tab4[i] = make_int4(-1, -1, -1, -1);
                for (uint32_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) tab[i] = -1;
                __syncthreads();
            };
            const uint32_t items = ((g1 - g0 + (1u << vp.rows_par_bits) - 1) >> vp.rows_par_bits) << rpt_bits;
            // U entries at a time, U = 2, 4 or 8 by `items` (U = 8 throughout ran four times
            // the instructions needed at N = 64, where every thread has two entries: ~6,000
            // warp instructions a block, H200 ncu).
            auto check_entries = [&](auto unroll) {
                constexpr int U = decltype(unroll)::value;
                for (uint32_t t0 = 0; t0 < items; t0 += U) {
                    float v[U], before[U];
                    int32_t id[U];
                    uint32_t row[U], rank[U];
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const uint32_t t = t0 + (uint32_t)u;
                        row[u] = g0 + rr + ((t >> rpt_bits) << vp.rows_par_bits);
                        rank[u] = rs + ((t & ((1u << rpt_bits) - 1)) << tpr_bits);
                        const bool ok = t < items && row[u] < g1 && rank[u] < ukp;
                        if (!ok) row[u] = UINT32_MAX;
                        const size_t src = ok ? (size_t)row[u] * (size_t)K + rank[u] : 0;
                        if (KDT_KNOB(2)) {
                            v[u] = -1.0f - 1e-3f * (float)rank[u];
                            before[u] = -1.0f - 1e-3f * (float)(rank[u] - 1);
                            id[u] = ok ? (int32_t)rank[u] * 37 : -1;
                            continue;
                        }
                        v[u] = ok ? lp[src] : 0.0f;
                        id[u] = ok ? ids[src] : -1;
                        before[u] = ok && rank[u] > 0 && !prev_by_shuffle ? lp[src - 1] : 0.0f;
                    }
                    if (t0 == 0 && !p.ids_distinct) clear_sets();  // (uniform: items is)
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const float up = __shfl_up_sync(kFullMask, v[u], 1);
                        const bool ok = row[u] != UINT32_MAX;
                        if (ok) {
                            const float prev = prev_by_shuffle ? up : before[u];
                            lp_s[row[u] * ukp + rank[u]] = v[u];
                            bad |= isnan(v[u]) || (isinf(v[u]) && v[u] > 0) || (rank[u] > 0 && v[u] > prev);
                            bad |= id[u] < 0 || (d.vocab_size > 0 && id[u] >= d.vocab_size);
                        }
                        // A negative id is a range error, reported by exact_status.
                        bool pending = ok && id[u] >= 0 && !KDT_KNOB(1) && !p.ids_distinct;
                        int32_t* set = tab + (size_t)(ok ? row[u] - g0 : 0) * slots;
                        uint32_t slot =
                            slot_bits > 0 ? ((uint32_t)id[u] * 2654435769u) >> (32 - slot_bits) : 0u;
                        while (__any_sync(kFullMask, pending)) {
                            if (pending) {
                                const int32_t prev_id = atomicCAS(&set[slot], -1, id[u]);
                                if (prev_id == -1 || prev_id == id[u]) {
                                    bad |= prev_id == id[u];
                                    pending = false;
                                } else {
                                    slot = (slot + 1) & (slots - 1);
                                }
                            }
                        }
                    }
                }
            };
            if (items <= 2) check_entries(std::integral_constant<int, 2>());
            else if (items <= 4) check_entries(std::integral_constant<int, 4>());
            else check_entries(std::integral_constant<int, 8>());
            if (!p.ids_distinct) __syncthreads();  // the sets are cleared again for the next group
            if (g0 == 0) KDT_PROBE(5);
        }
    }
    const bool any_bad = __syncthreads_or(bad) != 0;

    // The parallel expansion first (valid requests only); -1 sends the request to the heap
    // below. (Its result is the same in every thread; when it succeeds it has ended with a
    // barrier after writing the node tables.)
    KDT_PROBE(1);
    int64_t par_n = -1;
    if (!any_bad && p.cap3 > 0 && kp > 0 && L > 0 && N > 0) {
        par_n = parallel_expand(cands_at(smem + lay.cands, p.cap3), lp_s, L, kp, N, logw_s, fc_s, ns_s, tables,
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
        int32_t status = KDT_OK;
        if (any_bad) status = exact_status(d, b, kp);
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
            if (root_pos < 0 || root_pos > INT64_MAX - L) root_pos = 0;
            if (root_tok < 0 || (d.vocab_size > 0 && root_tok >= d.vocab_size)) root_tok = d.pad_token;
        }
        const int64_t n = kdt_expand_tree(lp_s, nullptr, L, kp, ok ? kp : 0, N, p.cap, root_pos, root_tok,
                                          d.pad_token, &s, &o);
        p.out.num_nodes[b] = (int32_t)n;
        p.status[b] = status;
        s_n = n;
        s_root_tok = root_tok;
        s_root_pos = root_pos;
    }
    __syncthreads();

    KDT_PROBE(2);
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
        // this request's device workspace (the node-table slot of version 1's layout).
        Layout glay;
        layout_for(p.cap, p.hash_slots, &glay);
        int32_t* g_par = reinterpret_cast<int32_t*>(p.workspace + (size_t)b * p.per_request + glay.tables) + (p.cap + 1);
        for (int64_t i = threadIdx.x; i <= n; i += blockDim.x) g_par[i] = node_par[i];
    } else if (rows <= kStagedMaskMaxRows) {
        // Small trees: row i's bits are built in shared memory by thread i (its own bit and
        // its ancestors'; a padding row only its own), then both masks are written by the
        // whole block, coalesced.
        __shared__ uint32_t s_bits[kStagedMaskMaxRows * kStagedMaskMaxWords];
        for (size_t k = threadIdx.x; k < rows * words; k += blockDim.x) s_bits[k] = 0u;
        __syncthreads();
        for (size_t i = threadIdx.x; i < rows; i += blockDim.x) {
            uint32_t* row = s_bits + i * words;
            for (int64_t a = (int64_t)i; a >= 0; a = (int64_t)i <= n ? node_par[a] : -1) row[a >> 5] |= 1u << (a & 31);
        }
        __syncthreads();
        if (p.out.visibility_bits) {
            uint32_t* dst = p.out.visibility_bits + base * words;
            for (size_t k = threadIdx.x; k < rows * words; k += blockDim.x) dst[k] = s_bits[k];
        }
        if (p.out.visibility) {
            // Four bytes a store between an unaligned head and tail. Each thread keeps the
            // (row, column) of its word's first byte and steps it by a fixed amount: a
            // division per word, and four bit extractions, were most of this phase's
            // instructions (H200 ncu, N = 64).
            uint8_t* dst = p.out.visibility + base * rows;
            const uint32_t urows = (uint32_t)rows, total = urows * urows;
            const uint32_t head = min(total, (uint32_t)((4u - ((uintptr_t)dst & 3u)) & 3u));
            const uint32_t nw = (total - head) / 4u;
            auto bit = [&](uint32_t i, uint32_t j) { return (s_bits[i * words + (j >> 5)] >> (j & 31)) & 1u; };
            if (threadIdx.x < head) dst[threadIdx.x] = (uint8_t)bit(threadIdx.x / urows, threadIdx.x % urows);
            uint32_t* dw = reinterpret_cast<uint32_t*>(dst + head);
            if (urows >= 4u) {
                // The word's four bytes are columns j .. j + 3 of row i, the last 4 - rem of
                // them (rem = rows - j < 4) columns 0 .. of row i + 1: four mask bits taken
                // at once (a funnel shift across the row's words; bits past a row's end
                // are 0), spread one to a byte by a multiply.
                const uint32_t last = (uint32_t)(rows * words) - 1u;  // s_bits' last word in use
                const uint32_t di = p.mask_di, dj = p.mask_dj;  // the step: 4 x blockDim.x bytes
                const uint32_t k0 = head + 4u * threadIdx.x;      // < 2^32 / rows
                uint32_t i = __umulhi(k0, p.mask_magic), j = k0 - i * urows;
                for (uint32_t w = threadIdx.x; w < nw; w += blockDim.x) {
                    const uint32_t at = i * (uint32_t)words + (j >> 5);
                    const uint32_t lo = s_bits[at], hi = s_bits[min(at + 1u, last)];
                    const uint32_t rem = urows - j;  // columns left in row i, >= 1
                    uint32_t nib = __funnelshift_r(lo, hi, j) & 0xFu;
                    if (rem < 4u) {
                        const uint32_t next = s_bits[min((i + 1u) * (uint32_t)words, last)];
                        nib = (nib & ((1u << rem) - 1u)) | ((next << rem) & 0xFu);
                    }
                    dw[w] = (nib * 0x00204081u) & 0x01010101u;
                    j += dj;
                    i += di;
                    if (j >= urows) {
                        j -= urows;
                        i++;
                    }
                }
            } else {
                for (uint32_t w = threadIdx.x; w < nw; w += blockDim.x) {
                    const uint32_t k = head + 4u * w;
                    uint32_t i = k / urows, j = k - i * urows, v = 0u;
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        v |= bit(i, j) << (8 * q);
                        if (++j == urows) {
                            j = 0;
                            i++;
                        }
                    }
                    dw[w] = v;
                }
            }
            for (uint32_t k = head + 4u * nw + threadIdx.x; k < total; k += blockDim.x) {
                dst[k] = (uint8_t)bit(k / urows, k % urows);
            }
        }
    } else {
        const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
        for (size_t i = warp; i < rows; i += warps) {
            uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
            uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
            warp_write_mask_row((int64_t)i, n, (int64_t)rows, node_par, vrow, brow);
        }
    }
    KDT_PROBE(3);
}

// The masks of large trees, after build_kernel_smem: one warp per row over a grid of
// (row blocks, requests), so every SM writes (one block per request reaches ~0.6 TB/s on
// a 1 MB bool mask). Reads num_nodes and the parents build_kernel_smem left in the
// workspace.
constexpr int kMaskRowsPerBlock = kThreads / 32;
__global__ void __launch_bounds__(kThreads) mask_kernel(BuildParams p) {
    const int64_t b = blockIdx.y;
    const size_t rows = (size_t)p.out.budget + 1;
    const size_t words = (rows + 31) / 32;
    const size_t i = (size_t)blockIdx.x * kMaskRowsPerBlock + threadIdx.x / 32;
    if (i >= rows) return;  // whole warps leave together
    Layout glay;
    layout_for(p.cap, p.hash_slots, &glay);
    const int32_t* g_par =
        reinterpret_cast<const int32_t*>(p.workspace + (size_t)b * p.per_request + glay.tables) + (p.cap + 1);
    const int64_t n = p.out.num_nodes[b];
    const size_t base = (size_t)b * rows;
    uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
    uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
    warp_write_mask_row((int64_t)i, n, (int64_t)rows, g_par, vrow, brow);
}

}  // namespace


extern "C" kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth,
                                                           int64_t width, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    if (batch < 0 || budget < 0 || depth < 0 || width < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch (%lld), budget (%lld), depth (%lld) and width (%lld) must be >= 0",
                        (long long)batch, (long long)budget, (long long)depth, (long long)width);
    }
    if (budget > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld exceeds the maximum %lld", (long long)budget,
                        (long long)kMaxBudget);
    }
    const int64_t kp = width < budget ? width : budget;
    Layout l;
    if (!layout_for(node_capacity(budget, depth, kp), hash_slots_for(kp), &l) ||
        !kdt_mul_size(l.total, (size_t)batch, bytes)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace for batch %lld, budget %lld overflows", (long long)batch,
                        (long long)budget);
    }
    return kdt_ok();
}

extern "C" kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status,
                                           void* workspace, size_t workspace_bytes, void* stream) {
    return kdt::build_trees_cuda(draft, out, request_status, workspace, workspace_bytes, stream, false);
}

kdt_status kdt::build_trees_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status, void* workspace,
                                 size_t workspace_bytes, void* stream, bool ids_distinct) {
    if (draft == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "draft is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const int64_t B = draft->batch, L = draft->depth, K = draft->width, N = out->budget;
    if (B < 0 || L < 0 || K < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "draft batch (%lld), depth (%lld) and width (%lld) must be >= 0",
                        (long long)B, (long long)L, (long long)K);
    }
    if (N < 0 || N > kMaxBudget) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %lld]", (long long)N,
                        (long long)kMaxBudget);
    }
    if (L > INT32_MAX - 1) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "depth %lld exceeds %d", (long long)L, INT32_MAX - 1);
    if (draft->vocab_size < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab_size %lld is negative", (long long)draft->vocab_size);
    }
    if (out->batch != B) {
        return kdt_fail(KDT_ERR_SHAPE, "out->batch (%lld) != draft->batch (%lld)", (long long)out->batch, (long long)B);
    }
    if (B > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld exceeds %d", (long long)B, INT32_MAX);
    if (B == 0) return kdt_ok();
    if (out->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out->num_nodes is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    size_t cells;
    if (!kdt_mul_size((size_t)B, (size_t)L, &cells) || !kdt_mul_size(cells, (size_t)K, &cells)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "draft size B*L*K overflows");
    }
    if (cells > 0 && (draft->logprobs == NULL || draft->token_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "draft->%s is NULL", draft->logprobs == NULL ? "logprobs" : "token_ids");
    }
    if (out->visibility != NULL) {
        size_t vb;
        kdt_status st = kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &vb);
        if (st != KDT_OK) return st;
    }
    {
        const struct {
            const void* ptr;
            size_t align;
            const char* name;
        } aligned[] = {{draft->logprobs, 4, "draft->logprobs"}, {draft->token_ids, 4, "draft->token_ids"},
                       {draft->root_tokens, 4, "draft->root_tokens"}, {draft->root_positions, 8, "draft->root_positions"},
                       {out->num_nodes, 4, "out->num_nodes"}, {out->tokens, 4, "out->tokens"},
                       {out->depths, 4, "out->depths"}, {out->parents, 4, "out->parents"},
                       {out->logw, 8, "out->logw"}, {out->positions, 8, "out->positions"},
                       {out->visibility_bits, 4, "out->visibility_bits"}, {out->first_child, 4, "out->first_child"},
                       {out->next_sibling, 4, "out->next_sibling"}, {request_status, 4, "request_status"}};
        for (const auto& a : aligned) {
            const kdt_status st = kdt::check_aligned(a.ptr, a.align, a.name);
            if (st != KDT_OK) return st;
        }
    }
    size_t need;
    kdt_status st = kdt_trees_build_cuda_workspace_bytes(B, N, L, K, &need);
    if (st != KDT_OK) return st;
    if (workspace == NULL || workspace_bytes < need) {
        return kdt_fail(workspace == NULL ? KDT_ERR_NULL_POINTER : KDT_ERR_BUFFER_TOO_SMALL,
                        "workspace has %zu bytes, %zu needed", workspace == NULL ? (size_t)0 : workspace_bytes, need);
    }
    if (((uintptr_t)workspace & 255u) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
    }
    BuildParams p;
    p.masks_separate = 0;
    p.descent = 0;
    p.walk = 0;
    p.counting = 0;
    p.ids_distinct = ids_distinct ? 1 : 0;
    p.draft = *draft;
    p.out = *out;
    p.status = request_status;
    p.workspace = static_cast<char*>(workspace);
    p.per_request = need / (size_t)B;
    p.eff_width = K < N ? K : N;
    p.cap = node_capacity(N, L, p.eff_width);
    p.hash_slots = hash_slots_for(p.eff_width);
    // Version 2 (everything the expansion touches in shared memory) when it fits the
    // device's per-block limit; version 1 (global memory) otherwise.
    const SmemLayout sl = smem_layout(L, p.eff_width, N, p.cap, p.hash_slots);
    p.lay = sl;
    // The device's per-block shared-memory limit and the kernel's raised limit are cached
    // per device: those runtime calls cost tens of microseconds, more than small builds.
    int dev = 0, smem_max = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        return kdt_fail(KDT_ERR_NO_DEVICE, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
    const int slot = dev >= 0 && dev < kMaxDevices ? dev : 0;
    smem_max = g_smem_max[slot].load(std::memory_order_relaxed);
    if (smem_max == 0) {
        // The dynamic shared memory build_kernel_smem can get: the device's opt-in limit
        // less the kernel's static shared memory.
        cudaFuncAttributes attr;
        err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, build_kernel_smem);
        if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "device query failed: %s", cudaGetErrorString(err));
        smem_max -= (int)attr.sharedSizeBytes;
        g_smem_max[slot].store(smem_max, std::memory_order_relaxed);
    }
    const size_t smem_static = 0;  // already taken off smem_max
    // Version 3's candidates: a power of two >= 2N that fits beside version 2's arrays.
    p.cap3 = 0;
    // Candidates: a power of two >= 4N where it fits (fewer overflows of version 4's
    // passes), else >= 2N.
    const TreeSwitches& sw = tree_switches();
    if (!sw.heap && (N >= kParallelMinBudget || sw.parallel)) {
        for (int64_t want = 4 * N; want >= 2 * N && p.cap3 == 0; want -= 2 * N) {
            int64_t cap3 = 1;
            while (cap3 < want) cap3 <<= 1;
            if (cap3 <= (1 << 20) && sl.total + cands_bytes(cap3) + smem_static <= (size_t)smem_max) {
                p.cap3 = (int32_t)cap3;
            }
        }
    }
    // 1: version 4 then 3; 2: version 4 depth first (KDTREE_CUDA_TREES_DFS=1); 0: version 3.
    p.descent = sw.bisect ? 0 : sw.dfs ? 2 : sw.thread_chains || N > kWarpChainsMaxBudget ? 3 : 1;
    p.walk = sw.no_walk ? 0 : 1;
    p.counting = sw.no_counting ? 0 : 1;
    const size_t smem_bytes = sl.total + (p.cap3 > 0 ? cands_bytes(p.cap3) : 0);
    if (smem_bytes + smem_static <= (size_t)smem_max && !sw.v1) {
        if ((int)smem_bytes > g_smem_set[slot].load(std::memory_order_relaxed)) {
            // Raise the kernel's limit once to the device maximum (idempotent, so racing
            // threads are harmless).
            err = cudaFuncSetAttribute(build_kernel_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
            if (err != cudaSuccess) {
                return kdt_fail(KDT_ERR_CUDA, "shared memory request failed: %s", cudaGetErrorString(err));
            }
            g_smem_set[slot].store(smem_max, std::memory_order_relaxed);
        }
        // Large trees: the masks in a second, wide launch (measured on an H200: perf-notes).
        const bool any_mask = out->visibility != NULL || out->visibility_bits != NULL;
        p.masks_separate = any_mask && N >= kSeparateMasksMinBudget && B <= 65535 &&
                           !sw.inline_masks;
        p.val = validation_plan(sl, L, p.eff_width, p.hash_slots, p.cap3, kSmemThreads);
        p.mask_magic = p.mask_di = p.mask_dj = 0;
        if (N + 1 >= 4 && N + 1 <= (int64_t)kStagedMaskMaxRows) {
            const uint32_t rows = (uint32_t)(N + 1), step = 4u * (uint32_t)kSmemThreads;
            p.mask_magic = (uint32_t)((uint64_t{1} << 32) / rows) + 1u;
            p.mask_di = step / rows;
            p.mask_dj = step - p.mask_di * rows;
        }
        build_kernel_smem<<<(unsigned)B, kSmemThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(p);
        if (p.masks_separate) {
            err = cudaGetLastError();
            if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "tree build launch failed: %s", cudaGetErrorString(err));
            const dim3 grid((unsigned)((N + 1 + kMaskRowsPerBlock - 1) / kMaskRowsPerBlock), (unsigned)B);
            mask_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
        }
    } else {
        build_kernel<<<(unsigned)B, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "tree build launch failed: %s", cudaGetErrorString(err));
    return kdt_ok();
}
