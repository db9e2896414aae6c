/* Top-k log-probs from float32 logits on the CPU (spec: "Input":
 * lp = top_k(logits) - logsumexp(logits), computed as (logit - max) - log1p(sum of exp(x -
 * max) over all but one entry at the max)), and its vocabulary-sharded form. */
#include <math.h>

#include "internal.h"

/* Heap order on (value, id): a is worse than b when its value is smaller, or equal with a
 * larger id (ties go to the lower id). */
static int worse(float va, int32_t ia, float vb, int32_t ib) {
    return va < vb || (va == vb && ia > ib);
}

static void sift_down(float* v, int32_t* id, int64_t size, int64_t i) {
    float x = v[i];
    int32_t xi = id[i];
    for (;;) {
        int64_t l = 2 * i + 1, m;
        if (l >= size) break;
        m = l;
        if (l + 1 < size && worse(v[l + 1], id[l + 1], v[l], id[l])) m = l + 1;
        if (!worse(v[m], id[m], x, xi)) break;
        v[i] = v[m];
        id[i] = id[m];
        i = m;
    }
    v[i] = x;
    id[i] = xi;
}

/* A row's logits: no NaN, no +inf, and (need_finite) at least one finite entry. */
static kdt_status check_row(const float* x, int64_t vocab, int64_t r, int need_finite) {
    int finite_or_neg = 0;
    for (int64_t c = 0; c < vocab; c++) {
        float v = x[c];
        if (isnan(v)) {
            return kdt_fail(KDT_ERR_VALUE, "row %lld, column %lld: NaN logit", (long long)r, (long long)c);
        }
        if (isinf(v)) {
            if (v > 0) {
                return kdt_fail(KDT_ERR_VALUE, "row %lld, column %lld: +inf logit", (long long)r, (long long)c);
            }
        } else {
            finite_or_neg = 1;
        }
    }
    if (need_finite && !finite_or_neg) {
        return kdt_fail(KDT_ERR_VALUE, "row %lld: every logit is -inf", (long long)r);
    }
    return KDT_OK;
}

/* Neumaier-compensated float64 sum: a million tiny terms next to a 1 still count. */
typedef struct {
    double sum, carry;
} comp_sum;

static void comp_add(comp_sum* a, double term) {
    const double t = a->sum + term;
    a->carry += fabs(a->sum) >= fabs(term) ? (a->sum - t) + term : (term - t) + a->sum;
    a->sum = t;
}

/* The row's max m and the sum of exp(x - m) over every entry but the first at the max
 * (whose term is exactly 1): the log-sum-exp is then m + log1p(rest), and log1p keeps the
 * precision of a sum near 1, where the log-probs are near 0 (m = -inf and rest 0 when every
 * entry is -inf). */
static void row_stats(const float* x, int64_t vocab, float* max_out, double* rest_out) {
    float m = -INFINITY;
    int64_t at = -1;
    comp_sum s = {0.0, 0.0};
    for (int64_t c = 0; c < vocab; c++) {
        if (x[c] > m) {
            m = x[c];
            at = c;
        }
    }
    *max_out = m;
    if (at < 0) {
        *rest_out = 0.0;
        return;
    }
    for (int64_t c = 0; c < vocab; c++) {
        if (c != at) comp_add(&s, exp((double)x[c] - (double)m));
    }
    *rest_out = s.sum + s.carry;
}

/* Element counts -> bytes that fit a pointer difference (so that no address wraps). */
static int span_bytes(size_t elements, size_t size) {
    size_t bytes;
    return kdt_mul_size(elements, size, &bytes) && bytes <= (size_t)PTRDIFF_MAX;
}

/* The k best (value, id) of the row, best first (ties: lower id), ids offset by id0. */
static void select_top(const float* x, int64_t vocab, int64_t k, int64_t id0, float* v, int32_t* id) {
    /* Keep the k best in a heap whose root is the worst kept entry. */
    for (int64_t c = 0; c < k; c++) {
        v[c] = x[c];
        id[c] = (int32_t)(id0 + c);
    }
    for (int64_t i = k / 2; i-- > 0;) sift_down(v, id, k, i);
    for (int64_t c = k; c < vocab; c++) {
        if (worse(v[0], id[0], x[c], (int32_t)(id0 + c))) {
            v[0] = x[c];
            id[0] = (int32_t)(id0 + c);
            sift_down(v, id, k, 0);
        }
    }
    /* Heap sort: the worst goes to the end, leaving the row best-first. */
    for (int64_t size = k; size > 1; size--) {
        float tv = v[0];
        int32_t ti = id[0];
        v[0] = v[size - 1];
        id[0] = id[size - 1];
        v[size - 1] = tv;
        id[size - 1] = ti;
        sift_down(v, id, size - 1, 0);
    }
}

kdt_status kdt_topk_logprobs_cpu(const float* logits, int64_t rows, int64_t vocab,
                                 int64_t row_stride, int64_t k, float* out_logprobs,
                                 int32_t* out_ids) {
    if (rows < 0 || vocab < 0 || k < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "rows (%lld), vocab (%lld) and k (%lld) must be >= 0",
                        (long long)rows, (long long)vocab, (long long)k);
    }
    if (vocab > INT32_MAX) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab %lld exceeds INT32_MAX", (long long)vocab);
    }
    if (k > vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds the vocabulary size (%lld)",
                        (long long)k, (long long)vocab);
    }
    if (rows > 1 && row_stride < vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "row_stride (%lld) is smaller than vocab (%lld)",
                        (long long)row_stride, (long long)vocab);
    }
    if (rows == 0) return kdt_ok();
    if (vocab == 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab is 0: a row needs at least one logit");
    }
    if (logits == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "logits is NULL");
    if (k > 0 && (out_logprobs == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", out_logprobs == NULL ? "out_logprobs" : "out_ids");
    }
    {
        size_t span, out;
        if (!kdt_mul_size((size_t)(rows - 1), (size_t)row_stride, &span) ||
            !kdt_add_size(span, (size_t)vocab, &span) || !span_bytes(span, sizeof(float)) ||
            !kdt_mul_size((size_t)rows, (size_t)k, &out) || !span_bytes(out, sizeof(float))) {
            return kdt_fail(KDT_ERR_OVERFLOW, "rows * row_stride (or rows * k) overflows the address space");
        }
    }

    /* Validate every row before writing anything. */
    for (int64_t r = 0; r < rows; r++) {
        const kdt_status st = check_row(logits + (size_t)r * (size_t)row_stride, vocab, r, 1);
        if (st != KDT_OK) return st;
    }

    for (int64_t r = 0; r < rows; r++) {
        const float* x = logits + (size_t)r * (size_t)row_stride;
        float* v = out_logprobs + (size_t)r * (size_t)k;
        int32_t* id = out_ids + (size_t)r * (size_t)k;
        float m;
        double log_sum;
        row_stats(x, vocab, &m, &log_sum);
        log_sum = log1p(log_sum);
        if (k == 0) continue;
        select_top(x, vocab, k, 0, v, id);
        /* (logit - m) - log sum in float64, rounded once. Never logit - (m + log sum): m +
         * log sum loses log sum when m is large (six equal logits of 6.17e16 would give 0
         * instead of -log 6; at 1e12 float64's ulp is 1.2e-4). The difference of two
         * float32 values is exact in float64, or (exponents 30 or more apart) rounded by
         * 2^-53 relative. */
        for (int64_t c = 0; c < k; c++) v[c] = (float)(((double)v[c] - (double)m) - log_sum);
    }
    return kdt_ok();
}

/* ---- Vocabulary-sharded top-k --------------------------------------------------------- */

kdt_status kdt_topk_shard_cpu(const float* logits, int64_t rows, int64_t shard_vocab, int64_t row_stride,
                              int64_t vocab_offset, int64_t k, float* out_logits, int32_t* out_ids,
                              float* out_max, double* out_sum_rest) {
    if (rows < 0 || shard_vocab < 1 || k < 0 || vocab_offset < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "rows (%lld) and k (%lld) must be >= 0, shard_vocab (%lld) >= 1, vocab_offset (%lld) >= 0",
                        (long long)rows, (long long)k, (long long)shard_vocab, (long long)vocab_offset);
    }
    if (vocab_offset > INT32_MAX - shard_vocab + 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab_offset %lld + shard_vocab %lld exceeds INT32_MAX + 1",
                        (long long)vocab_offset, (long long)shard_vocab);
    }
    if (k > shard_vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds the shard's vocabulary (%lld)", (long long)k,
                        (long long)shard_vocab);
    }
    if (rows > 1 && row_stride < shard_vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "row_stride (%lld) is smaller than shard_vocab (%lld)",
                        (long long)row_stride, (long long)shard_vocab);
    }
    if (rows == 0) return kdt_ok();
    if (logits == NULL || out_max == NULL || out_sum_rest == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        logits == NULL ? "logits" : out_max == NULL ? "out_max" : "out_sum_rest");
    }
    if (k > 0 && (out_logits == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", out_logits == NULL ? "out_logits" : "out_ids");
    }
    {
        size_t span, out;
        if (!kdt_mul_size((size_t)(rows - 1), (size_t)row_stride, &span) ||
            !kdt_add_size(span, (size_t)shard_vocab, &span) || !span_bytes(span, sizeof(float)) ||
            !kdt_mul_size((size_t)rows, (size_t)k, &out) || !span_bytes(out, sizeof(float)) ||
            !span_bytes((size_t)rows, sizeof(double))) {
            return kdt_fail(KDT_ERR_OVERFLOW, "rows * row_stride (or rows * k) overflows the address space");
        }
    }
    /* (A shard may hold only -inf logits in a row: the merge checks the whole row.) */
    for (int64_t r = 0; r < rows; r++) {
        const kdt_status st = check_row(logits + (size_t)r * (size_t)row_stride, shard_vocab, r, 0);
        if (st != KDT_OK) return st;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float* x = logits + (size_t)r * (size_t)row_stride;
        row_stats(x, shard_vocab, &out_max[r], &out_sum_rest[r]);
        if (k > 0) {
            select_top(x, shard_vocab, k, vocab_offset, out_logits + (size_t)r * (size_t)k,
                       out_ids + (size_t)r * (size_t)k);
        }
    }
    return kdt_ok();
}

/* Checks shard t's row r: its list sorted best first, ids in [0, vocab), no NaN or +inf,
 * the first entry at the shard's max, and a rest of the sum that terms of at most 1 each
 * can make (at most vocab - 1 of them; 0 for a shard that is all -inf). */
static kdt_status check_shard_row(const float* v, const int32_t* id, float m, double rest, int64_t k, int64_t vocab,
                                  int64_t t, int64_t r) {
    if (isnan(m) || m == INFINITY || !(rest >= 0.0) || rest > (double)vocab || (m == -INFINITY && rest != 0.0) ||
        (k > 0 && v[0] != m)) {
        return kdt_fail(KDT_ERR_VALUE,
                        "shard %lld, row %lld: max %g and rest of the sum %g are not a shard's (the list's first "
                        "logit %g must be the max; the rest in [0, vocab], 0 when the max is -inf)",
                        (long long)t, (long long)r, (double)m, rest, k > 0 ? (double)v[0] : (double)m);
    }
    for (int64_t c = 0; c < k; c++) {
        if (id[c] < 0 || (int64_t)id[c] >= vocab) {
            return kdt_fail(KDT_ERR_VALUE, "shard %lld, row %lld, entry %lld: id %d is outside [0, %lld)",
                            (long long)t, (long long)r, (long long)c, (int)id[c], (long long)vocab);
        }
        if (isnan(v[c]) || v[c] == INFINITY) {
            return kdt_fail(KDT_ERR_VALUE, "shard %lld, row %lld, entry %lld: logit %g is NaN or +inf", (long long)t,
                            (long long)r, (long long)c, (double)v[c]);
        }
        if (c > 0 && !worse(v[c], id[c], v[c - 1], id[c - 1])) {
            return kdt_fail(KDT_ERR_VALUE,
                            "shard %lld, row %lld, entry %lld: (logit %g, id %d) does not come after (%g, %d): "
                            "a shard's list is sorted best first, ties by lower id",
                            (long long)t, (long long)r, (long long)c, (double)v[c], (int)id[c], (double)v[c - 1],
                            (int)id[c - 1]);
        }
    }
    return KDT_OK;
}

/* The k-way merge of row r's sorted shard lists: the k best (logit, id) in order, written
 * to ov / oi when they are not NULL. Returns the shard of an entry equal to the one before
 * it (the same id listed twice, its id in *dup_id), or -1. */
static int64_t merge_row(const float* lg, const int32_t* ids, int64_t shards, int64_t rows, int64_t k, int64_t r,
                         float* ov, int32_t* oi, int64_t* dup_id) {
    int32_t pos[KDT_TOPK_MAX_SHARDS];
    const size_t per_shard = (size_t)rows * (size_t)k;
    float pv = 0.f;
    int32_t pi = -1;
    for (int64_t t = 0; t < shards; t++) pos[t] = 0;
    for (int64_t c = 0; c < k; c++) {
        int64_t best = -1;
        float bv = 0.f;
        int32_t bi = 0;
        for (int64_t t = 0; t < shards; t++) {
            if (pos[t] >= k) continue;
            const size_t at = (size_t)t * per_shard + (size_t)r * (size_t)k + (size_t)pos[t];
            if (best < 0 || worse(bv, bi, lg[at], ids[at])) {
                best = t;
                bv = lg[at];
                bi = ids[at];
            }
        }
        /* (k <= every shard's list, so one of them has an entry left.) */
        pos[best]++;
        if (c > 0 && bi == pi && bv == pv) {
            *dup_id = bi;
            return best;
        }
        pv = bv;
        pi = bi;
        if (ov != NULL) {
            ov[c] = bv;
            oi[c] = bi;
        }
    }
    return -1;
}

kdt_status kdt_topk_merge_cpu(const float* shard_logits, const int32_t* shard_ids, const float* shard_max,
                              const double* shard_sum_rest, int64_t shards, int64_t rows, int64_t k, int64_t vocab,
                              float* out_logprobs, int32_t* out_ids) {
    if (shards < 1 || shards > KDT_TOPK_MAX_SHARDS || rows < 0 || k < 0 || vocab < 1 ||
        vocab > (int64_t)INT32_MAX + 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "shards (%lld) must be in [1, %d], rows (%lld) and k (%lld) >= 0, vocab (%lld) in "
                        "[1, 2^31]",
                        (long long)shards, KDT_TOPK_MAX_SHARDS, (long long)rows, (long long)k, (long long)vocab);
    }
    if (k > vocab) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "k (%lld) exceeds the vocabulary size (%lld)", (long long)k,
                        (long long)vocab);
    }
    if (rows == 0) return kdt_ok();
    {
        size_t cells, entries;
        if (!kdt_mul_size((size_t)shards, (size_t)rows, &cells) || !span_bytes(cells, sizeof(double)) ||
            !kdt_mul_size(cells, (size_t)k, &entries) || !span_bytes(entries, sizeof(float))) {
            return kdt_fail(KDT_ERR_OVERFLOW, "shards * rows * k overflows the address space");
        }
    }
    if (shard_max == NULL || shard_sum_rest == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", shard_max == NULL ? "shard_max" : "shard_sum_rest");
    }
    if (k > 0 && (shard_logits == NULL || shard_ids == NULL || out_logprobs == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        shard_logits == NULL ? "shard_logits"
                        : shard_ids == NULL  ? "shard_ids"
                        : out_logprobs == NULL ? "out_logprobs"
                                               : "out_ids");
    }
    const size_t per_shard = (size_t)rows * (size_t)k;

    /* Every input is checked before anything is written. */
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (int64_t t = 0; t < shards; t++) {
            const size_t cell = (size_t)t * (size_t)rows + (size_t)r;
            const size_t at = (size_t)t * per_shard + (size_t)r * (size_t)k;
            const kdt_status st = check_shard_row(k > 0 ? shard_logits + at : NULL, k > 0 ? shard_ids + at : NULL,
                                                  shard_max[cell], shard_sum_rest[cell], k, vocab, t, r);
            if (st != KDT_OK) return st;
            if (shard_max[cell] > m) m = shard_max[cell];
        }
        if (m == -INFINITY) return kdt_fail(KDT_ERR_VALUE, "row %lld: every logit is -inf", (long long)r);
        int64_t dup_id = 0;
        const int64_t dup = merge_row(shard_logits, shard_ids, shards, rows, k, r, NULL, NULL, &dup_id);
        if (dup >= 0) {
            return kdt_fail(KDT_ERR_VALUE,
                            "shard %lld, row %lld: id %lld is listed by two shards (the shards' vocabulary "
                            "ranges must be disjoint)",
                            (long long)dup, (long long)r, (long long)dup_id);
        }
    }

    for (int64_t r = 0; r < rows; r++) {
        /* The global max m and the sum of exp(x - m) over every entry but one at m: the
         * first shard at m gives its rest, every other shard its whole sum (1 + rest)
         * rescaled from its own max, added with compensation in shard order. */
        float m = -INFINITY;
        for (int64_t t = 0; t < shards; t++) {
            const float mt = shard_max[(size_t)t * (size_t)rows + (size_t)r];
            if (mt > m) m = mt;
        }
        comp_sum s = {0.0, 0.0};
        int top = 0;
        for (int64_t t = 0; t < shards; t++) {
            const size_t cell = (size_t)t * (size_t)rows + (size_t)r;
            if (shard_max[cell] == -INFINITY) continue;
            if (!top && shard_max[cell] == m) {
                comp_add(&s, shard_sum_rest[cell]);
                top = 1;
                continue;
            }
            const double scale = shard_max[cell] == m ? 1.0 : exp((double)shard_max[cell] - (double)m);
            comp_add(&s, scale);
            comp_add(&s, shard_sum_rest[cell] * scale);
        }
        const double log_sum = log1p(s.sum + s.carry);
        if (k == 0) continue;
        float* ov = out_logprobs + (size_t)r * (size_t)k;
        int32_t* oi = out_ids + (size_t)r * (size_t)k;
        int64_t unused = 0;
        (void)merge_row(shard_logits, shard_ids, shards, rows, k, r, ov, oi, &unused);
        for (int64_t c = 0; c < k; c++) ov[c] = (float)(((double)ov[c] - (double)m) - log_sum);
    }
    return kdt_ok();
}
