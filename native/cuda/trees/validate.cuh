// Validation of a request's draft rows, as the CPU builder checks them: values (NaN, +inf,
// ascending order) before ids (range, repeats), each in rank order. The kernels first
// check in parallel and only learn whether anything is wrong; exact_status then finds the
// CPU builder's verdict for a bad request, sequentially (the error path only).
#pragma once

#include <type_traits>

#include <math.h>
#include <stdint.h>

#include "plan.cuh"

namespace kdt {
namespace trees {

__device__ inline uint64_t mix_id(int32_t id) {
    uint64_t z = (uint64_t)(uint32_t)id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The CPU builder's verdict for one request, computed sequentially (the error path only):
// root position, root token, then row by row: values (NaN, +inf, order) before ids
// (range, repeats of an earlier id), each in rank order.
// The CPU builder's bound on a log-prob (native/trees.c, KDT_LOGPROB_SLACK = 32 FLT_EPSILON
// = 2^-18, exact in float): a larger entry is a probability or a raw logit, KDT_ERR_VALUE.
// On a row sorted non-increasing only rank 0 can exceed it, so the fast checks test every
// entry against it (it also covers +inf) and the verdict is the CPU's.
constexpr float kLogprobSlack = 3.814697265625e-06f;

// Request b's own limits (kdt_draft's request_budgets and request_depths): its budget N_b,
// depth limit L_b and used width K'_b = min(K, N_b), clamped to the call's (N, L); `bad`
// when a given limit is outside its range (exact_status reports it first, as the CPU
// builder does).
struct RequestLimits {
    int64_t budget, depth, kp;
    bool bad;
};

__device__ __forceinline__ RequestLimits request_limits(const kdt_draft& d, int64_t N, int64_t b) {
    RequestLimits r;
    const int64_t nb = d.request_budgets ? (int64_t)d.request_budgets[b] : N;
    const int64_t lb = d.request_depths ? (int64_t)d.request_depths[b] : d.depth;
    r.bad = nb < 0 || nb > N || lb < 0 || lb > d.depth;
    r.budget = nb < 0 ? 0 : (nb > N ? N : nb);
    r.depth = lb < 0 ? 0 : (lb > d.depth ? d.depth : lb);
    r.kp = d.width < r.budget ? d.width : r.budget;
    return r;
}

__device__ int32_t exact_status(const kdt_draft& d, int64_t b, const RequestLimits& lim) {
    const int64_t L = d.depth, K = d.width, Lb = lim.depth, kp = lim.kp;
    if (lim.bad) return KDT_ERR_OUT_OF_RANGE;
    if (d.root_positions) {
        const int64_t rp = d.root_positions[b];
        if (rp < 0 || rp > INT64_MAX - Lb) return KDT_ERR_OUT_OF_RANGE;
    }
    if (d.root_tokens) {
        const int32_t rt = d.root_tokens[b];
        if (rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size)) return KDT_ERR_OUT_OF_RANGE;
    }
    for (int64_t r0 = 0; r0 < Lb; r0++) {
        const float* lp = d.logprobs + ((size_t)b * L + r0) * K;
        const int32_t* ids = d.token_ids + ((size_t)b * L + r0) * K;
        for (int64_t r = 0; r < kp; r++) {
            const float v = lp[r];
            if (isnan(v) || (isinf(v) && v > 0) || (r > 0 && v > lp[r - 1]) || (r == 0 && v > kLogprobSlack)) {
                return KDT_ERR_VALUE;
            }
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

// Version 1's validation, block-wide, through device memory: whether request b has any
// invalid input (its limits, root position or token, a row's values or ids in its used
// part [L_b, K'_b], a repeated id in a row, found with a hash set of ids in the workspace,
// `hash` [hash_slots], -1: empty). Returns the verdict in every thread (s_bad, with a
// barrier after it).
__device__ __forceinline__ bool validate_global(const BuildParams& p, int64_t b, const RequestLimits& lim,
                                                const float* lp, const int32_t* ids, int32_t* hash, int* s_bad) {
    const kdt_draft& d = p.draft;
    const int64_t L = lim.depth, K = d.width, kp = lim.kp;
    if (threadIdx.x == 0) {
        int bad = lim.bad;
        if (d.root_positions) {
            const int64_t rp = d.root_positions[b];
            bad |= rp < 0 || rp > INT64_MAX - L;
        }
        if (d.root_tokens) {
            const int32_t rt = d.root_tokens[b];
            bad |= rt < 0 || (d.vocab_size > 0 && rt >= d.vocab_size);
        }
        *s_bad = bad;
    }
    __syncthreads();
    int bad = 0;
    for (int64_t idx = threadIdx.x; idx < L * kp; idx += blockDim.x) {
        const int64_t row = idx / kp, r = idx % kp;
        const float v = lp[row * K + r];
        const int32_t id = ids[row * K + r];
        bad |= isnan(v) || v > kLogprobSlack || (r > 0 && v > lp[row * K + r - 1]);
        bad |= id < 0 || (d.vocab_size > 0 && id >= d.vocab_size);
    }
    if (bad) atomicOr(s_bad, 1);
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
        if (dup) atomicOr(s_bad, 1);
        __syncthreads();
    }
    __syncthreads();
    return *s_bad != 0;
}

// build_kernel_smem's validation: loads the call's used part [L, K'] of request b's rows
// into lp_s (row stride K') and checks the request's own used part [L_b, K'_b]; entries
// outside it are stored as -inf, which the expansions never emit, so the tree is the one
// of the request's own limits. Returns `bad` (the caller's verdict on the root, in thread
// 0) or'ed with this thread's findings, not yet reduced over the block.
__device__ __forceinline__ int load_and_check_rows(const BuildParams& p, const RequestLimits& lim, const float* lp,
                                                   const int32_t* ids, float* lp_s, unsigned char* smem, int bad) {
    const kdt_draft& d = p.draft;
    const int64_t L = d.depth, K = d.width, kp = p.eff_width;
    const uint32_t own_rows = (uint32_t)lim.depth, own_kp = (uint32_t)lim.kp;
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
                        // Past the request's own limits: -inf in lp_s, not read or checked.
                        if (ok && (row[u] >= own_rows || rank[u] >= own_kp)) {
                            lp_s[row[u] * ukp + rank[u]] = -INFINITY;
                            row[u] = UINT32_MAX;
                        }
                        const bool own = row[u] != UINT32_MAX;
                        const size_t src = own ? (size_t)row[u] * (size_t)K + rank[u] : 0;
                        v[u] = own ? lp[src] : 0.0f;
                        id[u] = own ? ids[src] : -1;
                        before[u] = own && rank[u] > 0 && !prev_by_shuffle ? lp[src - 1] : 0.0f;
                    }
                    if (t0 == 0 && !p.ids_distinct) clear_sets();  // (uniform: items is)
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const float up = __shfl_up_sync(kFullMask, v[u], 1);
                        const bool ok = row[u] != UINT32_MAX;
                        if (ok) {
                            const float prev = prev_by_shuffle ? up : before[u];
                            lp_s[row[u] * ukp + rank[u]] = v[u];
                            bad |= isnan(v[u]) || v[u] > kLogprobSlack || (rank[u] > 0 && v[u] > prev);
                            bad |= id[u] < 0 || (d.vocab_size > 0 && id[u] >= d.vocab_size);
                        }
                        // A negative id is a range error, reported by exact_status.
                        bool pending = ok && id[u] >= 0 && !p.ids_distinct;
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
        }
    }
    return bad;
}

}  // namespace trees
}  // namespace kdt
