// The vocabulary-sharded top-k's merge on the GPU: kdt_topk_merge_cuda (kdtree.h), the
// device twin of kdt_topk_merge_cpu (native/topk.c). Two kernels give the same bits: the
// merge-path kernel below (the default where a row's lists fit its shared memory) and the
// ranking kernel, one block per row:
//   1. checks every shard's list and statistics as the CPU does (a failed row: NaN
//      log-probs, ids 0 .. k-1, KDT_ERR_VALUE);
//   2. ranks every candidate (from a copy of the row's lists in shared memory where they fit
//      in kStageBytes; an entry worse than a bound taken from the lists' heads cannot be in
//      the top k and is skipped): an entry at position i of shard t is preceded, in the merged
//      order (logit descending, ties lower id), by its i predecessors in its own list and,
//      in every other list, by the entries that come before it, counted by binary search;
//      an entry whose rank is below k is written there. The same (logit, id) in two lists
//      (the CPU's duplicate) gives two entries one rank; it is an error where the CPU's
//      merge would meet it, both copies within the first k;
//   3. thread 0 combines the log-sum-exp in float64 in shard order with the CPU's
//      compensated sum; every output is (logit - m) - log1p(rest), rounded once.
// exp and log1p are CUDA's float64 functions (within 1-2 ulp of the C library's), so a
// log-prob is within one float32 ulp of the CPU merge's; ids and order are the same.
#include <cuda_runtime.h>

#include <algorithm>

#include <math.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kStageBytes = 48 * 1024;  // a row's lists copied to shared memory up to this size

struct MergeParams {
    const float* logits;  // [T, rows, k]
    const int32_t* ids;   // [T, rows, k]
    const float* max;     // [T, rows]
    const double* rest;   // [T, rows]
    int64_t shards, rows, k, vocab;
    bool staged;          // the row's T x k logits and ids copied to shared memory first
    float* out_lp;        // [rows, k]
    int32_t* out_ids;     // [rows, k]
    int32_t* status;      // [rows]
};

__device__ __forceinline__ bool worse(float va, int32_t ia, float vb, int32_t ib) {
    return va < vb || (va == vb && ia > ib);
}

// Entries of the sorted list (v, id)[0..k) that come before (x, xi): the first position
// whose entry is not better than it. *equal: that entry is (x, xi) itself.
__device__ __forceinline__ int better_count(const float* v, const int32_t* id, int k, float x, int32_t xi,
                                            bool* equal) {
    int lo = 0, hi = k;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (worse(x, xi, v[mid], id[mid])) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    *equal = lo < k && v[lo] == x && id[lo] == xi;
    return lo;
}

struct CompSum {
    double sum, carry;
};

__device__ __forceinline__ void comp_add(CompSum* a, double term) {
    const double t = a->sum + term;
    a->carry += fabs(a->sum) >= fabs(term) ? (a->sum - t) + term : (term - t) + a->sum;
    a->sum = t;
}

__global__ void __launch_bounds__(kThreads) merge_kernel(MergeParams p) {
    __shared__ int s_bad;
    __shared__ double s_log_sum;
    __shared__ float s_max;
    __shared__ float s_wv[kThreads / 32], s_wm[kThreads / 32];
    __shared__ int32_t s_wi[kThreads / 32];
    __shared__ float s_bound_v;
    __shared__ int32_t s_bound_i;
    extern __shared__ __align__(8) unsigned char s_lists[];  // staged: [T x k] logits, then [T x k] ids
    const int64_t r = blockIdx.x;
    const int T = (int)p.shards, k = (int)p.k;  // T x k <= 2^20
    const int64_t R = p.rows;
    const size_t per_shard = (size_t)R * (size_t)k;
    const size_t row_at = (size_t)r * (size_t)k;
    float* sv = reinterpret_cast<float*>(s_lists);
    int32_t* si = reinterpret_cast<int32_t*>(sv + T * k);
    if (threadIdx.x == 0) s_bad = 0;
    if (p.staged) {
        for (int e = threadIdx.x; e < T * k; e += blockDim.x) {
            const int t = e / k, c = e - t * k;
            sv[e] = p.logits[(size_t)t * per_shard + row_at + c];
            si[e] = p.ids[(size_t)t * per_shard + row_at + c];
        }
    }
    __syncthreads();
    // shard u's list of this row
    auto list_v = [&](int u) { return p.staged ? sv + u * k : p.logits + (size_t)u * per_shard + row_at; };
    auto list_i = [&](int u) { return p.staged ? si + u * k : p.ids + (size_t)u * per_shard + row_at; };
    // 1. The checks (check_shard_row), the row's max, and a bound: the worst of the shards'
    //    entries at position q = ceil(k / T) - 1. Each shard has q + 1 entries at least as
    //    good as its own, T (q + 1) >= k in all, so an entry worse than the bound has k
    //    better ones: it is not ranked.
    const int q = (k + T - 1) / T - 1;
    int bad = 0;
    float mx = -INFINITY, bv = INFINITY;
    int32_t bi = -1;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        const size_t cell = (size_t)t * (size_t)R + (size_t)r;
        const float mt = p.max[cell];
        const double rest = p.rest[cell];
        bad |= isnan(mt) || mt == INFINITY || !(rest >= 0.0) || rest > (double)p.vocab ||
               (mt == -INFINITY && rest != 0.0) || (k > 0 && list_v(t)[0] != mt);
        mx = fmaxf(mx, mt);
        if (k > 0) {
            const float x = list_v(t)[q];
            const int32_t xi = list_i(t)[q];
            if (bi < 0 || worse(x, xi, bv, bi)) bv = x, bi = xi;
        }
    }
    for (int e = threadIdx.x; e < T * k; e += blockDim.x) {
        const int t = e / k, c = e - t * k;
        const float* v = list_v(t);
        const int32_t* id = list_i(t);
        const float x = v[c];
        const int32_t xi = id[c];
        bad |= xi < 0 || (int64_t)xi >= p.vocab || isnan(x) || x == INFINITY;
        if (c > 0) bad |= !worse(x, xi, v[c - 1], id[c - 1]);
    }
    // (NaNs are flagged above; the max and bound of a bad row are not used)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (oi >= 0 && (bi < 0 || worse(ov, oi, bv, bi))) bv = ov, bi = oi;
    }
    if (bad) atomicOr(&s_bad, 1);
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        s_wv[warp] = bv;
        s_wi[warp] = bi;
        s_wm[warp] = mx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = -INFINITY, v = INFINITY;
        int32_t i = -1;
        for (int w = 0; w < (int)(blockDim.x / 32); w++) {
            mm = fmaxf(mm, s_wm[w]);
            if (s_wi[w] >= 0 && (i < 0 || worse(s_wv[w], s_wi[w], v, i))) v = s_wv[w], i = s_wi[w];
        }
        s_max = mm;
        s_bound_v = v;
        s_bound_i = i;
        if (mm == -INFINITY) s_bad = 1;  // every logit is -inf
    }
    __syncthreads();
    const bool row_bad = s_bad != 0;
    const float bound_v = s_bound_v;
    const int32_t bound_i = s_bound_i;
    // 2. Ranks (valid rows only: the lists are sorted there).
    if (!row_bad) {
        for (int e = threadIdx.x; e < T * k; e += blockDim.x) {
            const int t = e / k, i = e - t * k;
            const float x = list_v(t)[i];
            const int32_t xi = list_i(t)[i];
            if (worse(x, xi, bound_v, bound_i)) continue;
            int rank = i;
            bool twin = false;
            for (int u = 0; u < T && rank < k; u++) {
                if (u == t) continue;
                bool equal = false;
                rank += better_count(list_v(u), list_i(u), k, x, xi, &equal);
                twin |= equal;
            }
            if (rank >= k) continue;
            if (twin) {
                // Two copies take merged positions rank and rank + 1 (the CPU meets the
                // second at rank + 1 < k); the copy of the lower shard writes.
                if (rank + 1 < k) atomicOr(&s_bad, 1);
                bool first = true;
                for (int u = 0; u < t; u++) {
                    bool equal = false;
                    (void)better_count(list_v(u), list_i(u), k, x, xi, &equal);
                    first &= !equal;
                }
                if (!first) continue;
            }
            p.out_lp[row_at + rank] = x;  // the logit for now
            p.out_ids[row_at + rank] = xi;
        }
    }
    __syncthreads();
    // 3. The log-sum-exp, as the CPU combines it.
    if (threadIdx.x == 0 && s_bad == 0) {
        const float m = s_max;
        CompSum s = {0.0, 0.0};
        bool top = false;
        for (int64_t t = 0; t < T; t++) {
            const size_t cell = (size_t)t * (size_t)R + (size_t)r;
            const float mt = p.max[cell];
            if (mt == -INFINITY) continue;
            if (!top && mt == m) {
                comp_add(&s, p.rest[cell]);
                top = true;
                continue;
            }
            const double scale = mt == m ? 1.0 : exp((double)mt - (double)m);
            comp_add(&s, scale);
            comp_add(&s, p.rest[cell] * scale);
        }
        s_log_sum = log1p(s.sum + s.carry);
    }
    __syncthreads();
    const bool failed = s_bad != 0;
    if (threadIdx.x == 0) p.status[r] = failed ? KDT_ERR_VALUE : KDT_OK;
    float* ov = p.out_lp + (size_t)r * (size_t)k;
    int32_t* oi = p.out_ids + (size_t)r * (size_t)k;
    const double m = (double)s_max, log_sum = s_log_sum;
    for (int64_t c = threadIdx.x; c < k; c += blockDim.x) {
        if (failed) {
            ov[c] = NAN;
            oi[c] = (int32_t)c;
        } else {
            ov[c] = (float)(((double)ov[c] - m) - log_sum);
        }
    }
}

// The merge-path kernel: one row a block of W = blockDim.x / 32 warps (1 to 8), every loop
// strided over the block's threads. The block copies its row's T lists to shared memory,
// checks them as merge_kernel does, then merges them pairwise (T lists, ceil(T / 2), ... 1),
// each merge cut at k entries: output position pos of the merge of lists A and B is found by
// a binary search of the merge path (how many of A's entries come among the first pos; A
// first on ties), one thread a position of any merge of the level, a block barrier between
// levels. Two copies of one (logit, id) in different lists end adjacent; both within the
// first k is the CPU's duplicate error. Warp 0's lanes compute the shards' exp terms of the
// log-sum-exp in parallel and add them in shard order with merge_kernel's compensated sum,
// so the outputs are merge_kernel's bit for bit. With one warp a row (T = 8, k = 64) a lane
// ran 14 binary searches one after another; with four, 4.
constexpr int kPathMaxWarps = 8;
constexpr int64_t kPathStageBytes = 48 * 1024;  // two copies of a row's lists: 2 x T x k x 8 bytes

__global__ void __launch_bounds__(32 * kPathMaxWarps) merge_paths_kernel(MergeParams p) {
    extern __shared__ __align__(8) unsigned char s_row[];  // two buffers of [T x k] logits, ids
    __shared__ float s_wmax[kPathMaxWarps];
    __shared__ double s_log_sum;
    const unsigned full = 0xffffffffu;
    const int tid = (int)threadIdx.x, nth = (int)blockDim.x, lane = tid & 31, warp = tid >> 5;
    const int64_t r = blockIdx.x;
    const int T = (int)p.shards, k = (int)p.k, n = T * k;
    const int64_t R = p.rows;
    const size_t per_shard = (size_t)R * (size_t)k;
    const size_t row_at = (size_t)r * (size_t)k;
    float* sv = reinterpret_cast<float*>(s_row);
    int32_t* si = reinterpret_cast<int32_t*>(sv + n);
    float* dv = reinterpret_cast<float*>(si + n);
    int32_t* di = reinterpret_cast<int32_t*>(dv + n);
    // The copy: kCopyDepth loads of each array in flight a thread (a loop of one load at a
    // time waits a memory latency per entry).
    constexpr int kCopyDepth = 8;
    for (int e0 = 0; e0 < n; e0 += nth * kCopyDepth) {
        float v[kCopyDepth];
        int32_t id[kCopyDepth];
#pragma unroll
        for (int u = 0; u < kCopyDepth; u++) {
            const int e = e0 + u * nth + tid;
            if (e < n) {
                const int t = e / k, c = e - t * k;
                const size_t at = (size_t)t * per_shard + row_at + (size_t)c;
                v[u] = __ldg(p.logits + at);
                id[u] = __ldg(p.ids + at);
            }
        }
#pragma unroll
        for (int u = 0; u < kCopyDepth; u++) {
            const int e = e0 + u * nth + tid;
            if (e < n) {
                sv[e] = v[u];
                si[e] = id[u];
            }
        }
    }
    __syncthreads();
    // 1. The checks of merge_kernel (check_shard_row) and the row's max.
    bool bad = false;
    float mx = -INFINITY;
    for (int t = tid; t < T; t += nth) {
        const size_t cell = (size_t)t * (size_t)R + (size_t)r;
        const float mt = p.max[cell];
        const double rest = p.rest[cell];
        bad |= isnan(mt) || mt == INFINITY || !(rest >= 0.0) || rest > (double)p.vocab ||
               (mt == -INFINITY && rest != 0.0) || (k > 0 && sv[t * k] != mt);
        mx = fmaxf(mx, mt);
    }
    for (int e = tid; e < n; e += nth) {
        const int c = e % k;
        const float x = sv[e];
        const int32_t xi = si[e];
        bad |= xi < 0 || (int64_t)xi >= p.vocab || isnan(x) || x == INFINITY;
        if (c > 0) bad |= !worse(x, xi, sv[e - 1], si[e - 1]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(full, mx, off));
    if (lane == 0) s_wmax[warp] = mx;
    const bool any_bad = __syncthreads_or(bad) != 0;
    mx = s_wmax[0];
    for (int u = 1; u < nth / 32; u++) mx = fmaxf(mx, s_wmax[u]);
    bool row_bad = any_bad || mx == -INFINITY;  // (every logit -inf: no distribution); the block's
                                                 // one value, so the barriers below are uniform
    // 2. The pairwise merges, each cut at k.
    if (!row_bad) {
        int lists = T;
        while (lists > 1) {
            const int pairs = lists / 2;
            for (int task = tid; task < pairs * k; task += nth) {
                const int j = task / k, pos = task - j * k;
                const float* av = sv + 2 * j * k;
                const int32_t* ai = si + 2 * j * k;
                const float* bv = av + k;
                const int32_t* bi = ai + k;
                int lo = 0, hi = pos;  // A's entries among the first pos outputs
                while (lo < hi) {
                    const int mid = (lo + hi) >> 1;
                    if (!worse(av[mid], ai[mid], bv[pos - 1 - mid], bi[pos - 1 - mid])) {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                const int jb = pos - lo;
                const bool take_a = !worse(av[lo], ai[lo], bv[jb], bi[jb]);
                dv[task] = take_a ? av[lo] : bv[jb];
                di[task] = take_a ? ai[lo] : bi[jb];
            }
            if (lists & 1) {
                for (int c = tid; c < k; c += nth) {
                    dv[pairs * k + c] = sv[(lists - 1) * k + c];
                    di[pairs * k + c] = si[(lists - 1) * k + c];
                }
            }
            __syncthreads();
            float* tv = sv;
            sv = dv;
            dv = tv;
            int32_t* ti = si;
            si = di;
            di = ti;
            lists = pairs + (lists & 1);
        }
        // two copies of one entry within the first k: the CPU's duplicate
        bool twin = false;
        for (int c = 1 + tid; c < k; c += nth) twin |= sv[c] == sv[c - 1] && si[c] == si[c - 1];
        row_bad = __syncthreads_or(twin) != 0;
    }
    // 3. The log-sum-exp, as merge_kernel's thread 0 combines it (warp 0).
    if (!row_bad && warp == 0) {
        const float m = mx;
        CompSum s = {0.0, 0.0};
        bool top = false;
        for (int base = 0; base < T; base += 32) {
            const int t = base + lane;
            float mt = -INFINITY;
            double rest = 0.0, scale = 0.0;
            if (t < T) {
                const size_t cell = (size_t)t * (size_t)R + (size_t)r;
                mt = p.max[cell];
                rest = p.rest[cell];
                scale = mt == m ? 1.0 : exp((double)mt - (double)m);
            }
            const int count = T - base < 32 ? T - base : 32;
            for (int j = 0; j < count; j++) {
                const float mj = __shfl_sync(full, mt, j);
                const double rj = __shfl_sync(full, rest, j);
                const double sj = __shfl_sync(full, scale, j);
                if (mj == -INFINITY) continue;
                if (!top && mj == m) {
                    comp_add(&s, rj);
                    top = true;
                    continue;
                }
                comp_add(&s, sj);
                comp_add(&s, rj * sj);
            }
        }
        if (lane == 0) s_log_sum = log1p(s.sum + s.carry);
    }
    __syncthreads();
    if (tid == 0) p.status[r] = row_bad ? KDT_ERR_VALUE : KDT_OK;
    float* ov = p.out_lp + row_at;
    int32_t* oi = p.out_ids + row_at;
    const double m = (double)mx, log_sum = row_bad ? 0.0 : s_log_sum;
    for (int c = tid; c < k; c += nth) {
        if (row_bad) {
            ov[c] = NAN;
            oi[c] = (int32_t)c;
        } else {
            ov[c] = (float)(((double)sv[c] - m) - log_sum);
            oi[c] = si[c];
        }
    }
}

// kdt_topk_shard_stats_cuda: one block a row, two passes over the row. The first finds the
// max and its first column (ties: the lower column, -0 equal to +0) and whether the row
// holds a NaN or a +inf; the second sums exp(x - max) in float64 over every other column,
// each thread in column order, then the warps' sums in warp order.
constexpr int kStatsThreads = 256;
constexpr int kStatsDepth = 8;  // loads in flight a thread

struct StatsParams {
    const char* data;
    int64_t batch_stride, row_stride, length, rows, vocab;
    size_t esize;
    float* out_max;
    double* out_rest;
};

// A thread's kStatsDepth columns j0, j0 + kStatsThreads, ... of a row, all loads issued
// before any is used (-inf past the row's end).
template <int D>
__device__ __forceinline__ void load_columns(const void* row, int j0, int V, float (&x)[kStatsDepth]) {
#pragma unroll
    for (int u = 0; u < kStatsDepth; u++) {
        const int j = j0 + u * kStatsThreads;
        x[u] = j < V ? kdt::load_logit<D>(row, j) : -INFINITY;
    }
}

template <int D>
__global__ void __launch_bounds__(kStatsThreads) shard_stats_kernel(StatsParams p) {
    constexpr int kW = kStatsThreads / 32;
    __shared__ float s_m[kW];
    __shared__ int32_t s_at[kW];
    __shared__ int s_bad[kW];
    __shared__ double s_sum[kW];
    const unsigned full = 0xffffffffu;
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
    const int V = (int)p.vocab;  // <= INT32_MAX (check_logits)
    for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const int64_t b = r / p.length, l = r - b * p.length;
        const void* row = p.data + (size_t)(b * p.batch_stride + l * p.row_stride) * p.esize;
        float m = -INFINITY;
        int32_t at = INT32_MAX;
        bool bad = false;
        // kStatsDepth loads in flight a thread; columns in increasing order within a thread
        for (int j0 = (int)threadIdx.x; j0 < V; j0 += kStatsThreads * kStatsDepth) {
            float x[kStatsDepth];
            load_columns<D>(row, j0, V, x);
#pragma unroll
            for (int u = 0; u < kStatsDepth; u++) {
                const int j = j0 + u * kStatsThreads;
                if (j >= V) break;
                bad |= isnan(x[u]) || x[u] == INFINITY;
                if (x[u] > m || (x[u] == m && at == INT32_MAX)) {  // (a row's first -inf counts as its max's column)
                    m = x[u];
                    at = j;
                }
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float om = __shfl_xor_sync(full, m, off);
            const int32_t oa = __shfl_xor_sync(full, at, off);
            if (om > m || (om == m && oa < at)) {
                m = om;
                at = oa;
            }
        }
        const bool warp_bad = __any_sync(full, bad);
        if (lane == 0) {
            s_m[warp] = m;
            s_at[warp] = at;
            s_bad[warp] = warp_bad ? 1 : 0;
        }
        __syncthreads();
        m = s_m[0];
        at = s_at[0];
        bad = s_bad[0] != 0;
        for (int w = 1; w < kW; w++) {
            if (s_m[w] > m || (s_m[w] == m && s_at[w] < at)) {
                m = s_m[w];
                at = s_at[w];
            }
            bad |= s_bad[w] != 0;
        }
        double sum = 0.0;
        if (!bad && m != -INFINITY) {
            const double md = (double)m;
            for (int j0 = (int)threadIdx.x; j0 < V; j0 += kStatsThreads * kStatsDepth) {
                float x[kStatsDepth];
                load_columns<D>(row, j0, V, x);
#pragma unroll
                for (int u = 0; u < kStatsDepth; u++) {
                    const int j = j0 + u * kStatsThreads;
                    if (j < V && j != at) sum += exp((double)x[u] - md);
                }
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(full, sum, off);
        if (lane == 0) s_sum[warp] = sum;
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int w = 0; w < kW; w++) total += s_sum[w];
            p.out_max[r] = bad ? NAN : m;
            p.out_rest[r] = bad ? (double)NAN : total;
        }
        __syncthreads();  // the next row reuses the shared arrays
    }
}

}  // namespace

extern "C" kdt_status kdt_topk_shard_stats_cuda(const kdt_logits* logits, float* out_max, double* out_rest,
                                                void* stream) {
    kdt_status st = kdt::check_logits(logits, "logits", -1, -1);
    if (st != KDT_OK) return st;
    const int64_t B = logits->batch, L = logits->length;
    if (B == 0 || L == 0) return kdt_ok();
    if (B > INT64_MAX / L) return kdt_fail(KDT_ERR_OVERFLOW, "logits: batch * length overflows");
    if (out_max == NULL || out_rest == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", out_max == NULL ? "out_max" : "out_rest");
    }
    st = kdt::check_aligned(out_max, 4, "out_max");
    if (st != KDT_OK) return st;
    st = kdt::check_aligned(out_rest, 8, "out_rest");
    if (st != KDT_OK) return st;
    StatsParams p;
    p.data = static_cast<const char*>(logits->data);
    p.batch_stride = logits->batch_stride;
    p.row_stride = logits->row_stride;
    p.length = L;
    p.rows = B * L;
    p.vocab = logits->vocab;
    p.esize = kdt::float_dtype_size(logits->dtype);
    p.out_max = out_max;
    p.out_rest = out_rest;
    const unsigned grid = (unsigned)(p.rows < (int64_t)INT32_MAX ? p.rows : (int64_t)INT32_MAX);
    cudaStream_t s = kdt::as_stream(stream);
    switch (logits->dtype) {
        case KDT_DTYPE_FLOAT32: shard_stats_kernel<KDT_DTYPE_FLOAT32><<<grid, kStatsThreads, 0, s>>>(p); break;
        case KDT_DTYPE_FLOAT16: shard_stats_kernel<KDT_DTYPE_FLOAT16><<<grid, kStatsThreads, 0, s>>>(p); break;
        default: shard_stats_kernel<KDT_DTYPE_BFLOAT16><<<grid, kStatsThreads, 0, s>>>(p); break;
    }
    return kdt::launch_status("shard statistics");
}

extern "C" kdt_status kdt_topk_merge_cuda(const float* shard_logits, const int32_t* shard_ids, const float* shard_max,
                                          const double* shard_sum_rest, int64_t shards, int64_t rows, int64_t k,
                                          int64_t vocab, float* out_logprobs, int32_t* out_ids, int32_t* row_status,
                                          void* stream) {
    if (shards < 1 || shards > KDT_TOPK_MAX_SHARDS || rows < 0 || k < 0 || vocab < 1 ||
        vocab > (int64_t)INT32_MAX + 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "shards (%lld) must be in [1, %d], rows (%lld) and k (%lld) >= 0, vocab (%lld) in [1, 2^31]",
                        (long long)shards, KDT_TOPK_MAX_SHARDS, (long long)rows, (long long)k, (long long)vocab);
    }
    if (k > vocab || k > 1024) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) must be at most min(vocab %lld, 1024)", (long long)k,
                        (long long)vocab);
    }
    if (rows > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "rows %lld exceeds %d", (long long)rows, INT32_MAX);
    if (rows == 0) return kdt_ok();
    {
        const unsigned __int128 entries = (unsigned __int128)(uint64_t)shards * (uint64_t)rows * (uint64_t)(k + 1);
        if (entries * 8u > (unsigned __int128)INT64_MAX) {
            return kdt_fail(KDT_ERR_OVERFLOW, "shards * rows * k overflows");
        }
    }
    if (shard_max == NULL || shard_sum_rest == NULL || row_status == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        shard_max == NULL ? "shard_max" : shard_sum_rest == NULL ? "shard_sum_rest" : "row_status");
    }
    if (k > 0 && (shard_logits == NULL || shard_ids == NULL || out_logprobs == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        shard_logits == NULL   ? "shard_logits"
                        : shard_ids == NULL    ? "shard_ids"
                        : out_logprobs == NULL ? "out_logprobs"
                                               : "out_ids");
    }
    const struct {
        const void* ptr;
        size_t align;
        const char* name;
    } aligned[] = {{shard_logits, 4, "shard_logits"}, {shard_ids, 4, "shard_ids"},   {shard_max, 4, "shard_max"},
                   {shard_sum_rest, 8, "shard_sum_rest"}, {out_logprobs, 4, "out_logprobs"}, {out_ids, 4, "out_ids"},
                   {row_status, 4, "row_status"}};
    for (const auto& a : aligned) {
        const kdt_status st = kdt::check_aligned(a.ptr, a.align, a.name);
        if (st != KDT_OK) return st;
    }
    MergeParams p;
    p.logits = shard_logits;
    p.ids = shard_ids;
    p.max = shard_max;
    p.rest = shard_sum_rest;
    p.shards = shards;
    p.rows = rows;
    p.k = k;
    p.vocab = vocab;
    p.out_lp = out_logprobs;
    p.out_ids = out_ids;
    p.status = row_status;
    const int64_t list_bytes = shards * k * 8;
    p.staged = list_bytes <= kStageBytes;
    const int variant = kdt::testing_topk_merge();
    if (variant != 1 && 2 * list_bytes <= kPathStageBytes) {
        // the merge path's warps: 64 positions of the first level a warp (T = 8, k = 64: 4),
        // or as many as the test-only switch names (2, 3, 4, 5: 1, 2, 4, 8 warps)
        int warps = (int)std::min<int64_t>(kPathMaxWarps, std::max<int64_t>(1, (shards / 2 * k + 63) / 64));
        if (variant >= 2) warps = 1 << (variant - 2);
        merge_paths_kernel<<<(unsigned)rows, 32 * warps, (size_t)(2 * list_bytes), kdt::as_stream(stream)>>>(p);
        return kdt::launch_status("sharded top-k merge (merge paths)");
    }
    merge_kernel<<<(unsigned)rows, kThreads, p.staged ? (size_t)list_bytes : 0, kdt::as_stream(stream)>>>(p);
    return kdt::launch_status("sharded top-k merge");
}
