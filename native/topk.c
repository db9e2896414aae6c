/* Top-k log-probs from float32 logits on the CPU (spec: "Input":
 * lp = top_k(logits) - logsumexp(logits), computed as (logit - max) - log sum exp(x - max)). */
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

/* The row's max m and sum of exp(x - m) (0 when every entry is -inf, m = -inf). */
static void row_stats(const float* x, int64_t vocab, float* max_out, double* sum_out) {
    float m = -INFINITY;
    comp_sum s = {0.0, 0.0};
    for (int64_t c = 0; c < vocab; c++) {
        if (x[c] > m) m = x[c];
    }
    if (m == -INFINITY) {
        *max_out = m;
        *sum_out = 0.0;
        return;
    }
    for (int64_t c = 0; c < vocab; c++) comp_add(&s, exp((double)x[c] - (double)m));
    *max_out = m;
    *sum_out = s.sum + s.carry;
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
        size_t span;
        if (!kdt_mul_size((size_t)(rows - 1), (size_t)row_stride, &span) ||
            !kdt_add_size(span, (size_t)vocab, &span) || !kdt_mul_size((size_t)rows, (size_t)k, &span)) {
            return kdt_fail(KDT_ERR_OVERFLOW, "rows * row_stride overflows");
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
        log_sum = log(log_sum);
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
                              float* out_max, double* out_sumexp) {
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
    if (logits == NULL || out_max == NULL || out_sumexp == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        logits == NULL ? "logits" : out_max == NULL ? "out_max" : "out_sumexp");
    }
    if (k > 0 && (out_logits == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", out_logits == NULL ? "out_logits" : "out_ids");
    }
    {
        size_t span;
        if (!kdt_mul_size((size_t)(rows - 1), (size_t)row_stride, &span) ||
            !kdt_add_size(span, (size_t)shard_vocab, &span) || !kdt_mul_size((size_t)rows, (size_t)k, &span)) {
            return kdt_fail(KDT_ERR_OVERFLOW, "rows * row_stride overflows");
        }
    }
    /* (A shard may hold only -inf logits in a row: the merge checks the whole row.) */
    for (int64_t r = 0; r < rows; r++) {
        const kdt_status st = check_row(logits + (size_t)r * (size_t)row_stride, shard_vocab, r, 0);
        if (st != KDT_OK) return st;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float* x = logits + (size_t)r * (size_t)row_stride;
        row_stats(x, shard_vocab, &out_max[r], &out_sumexp[r]);
        if (k > 0) {
            select_top(x, shard_vocab, k, vocab_offset, out_logits + (size_t)r * (size_t)k,
                       out_ids + (size_t)r * (size_t)k);
        }
    }
    return kdt_ok();
}

/* Checks shard t's row r: its list sorted best first, ids in [0, vocab), no NaN or +inf,
 * no entry above the shard's max, and a sum that the max's own term (1) is part of. */
static kdt_status check_shard_row(const float* v, const int32_t* id, float m, double s, int64_t k, int64_t vocab,
                                  int64_t t, int64_t r) {
    if (isnan(m) || m == INFINITY || !(s >= 0.0) || isinf(s) || (m == -INFINITY) != (s == 0.0) ||
        (m != -INFINITY && s < 1.0)) {
        return kdt_fail(KDT_ERR_VALUE,
                        "shard %lld, row %lld: max %g and sum of exponentials %g are not a shard's (finite max "
                        "with a sum >= 1, or -inf with 0)",
                        (long long)t, (long long)r, (double)m, s);
    }
    for (int64_t c = 0; c < k; c++) {
        if (id[c] < 0 || (int64_t)id[c] >= vocab) {
            return kdt_fail(KDT_ERR_VALUE, "shard %lld, row %lld, entry %lld: id %d is outside [0, %lld)",
                            (long long)t, (long long)r, (long long)c, (int)id[c], (long long)vocab);
        }
        if (isnan(v[c]) || v[c] == INFINITY || v[c] > m) {
            return kdt_fail(KDT_ERR_VALUE, "shard %lld, row %lld, entry %lld: logit %g is NaN, +inf or above the "
                            "shard's max %g", (long long)t, (long long)r, (long long)c, (double)v[c], (double)m);
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

kdt_status kdt_topk_merge_cpu(const float* shard_logits, const int32_t* shard_ids, const float* shard_max,
                              const double* shard_sumexp, int64_t shards, int64_t rows, int64_t k, int64_t vocab,
                              float* out_logprobs, int32_t* out_ids) {
    if (shards < 1 || shards > KDT_TOPK_MAX_SHARDS || rows < 0 || k < 0 || vocab < 1 || vocab > (int64_t)INT32_MAX + 1) {
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
    if (shard_max == NULL || shard_sumexp == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", shard_max == NULL ? "shard_max" : "shard_sumexp");
    }
    if (k > 0 && (shard_logits == NULL || shard_ids == NULL || out_logprobs == NULL || out_ids == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        shard_logits == NULL ? "shard_logits"
                        : shard_ids == NULL  ? "shard_ids"
                        : out_logprobs == NULL ? "out_logprobs"
                                               : "out_ids");
    }
    {
        size_t span;
        if (!kdt_mul_size((size_t)shards, (size_t)rows, &span) || !kdt_mul_size(span, (size_t)k, &span)) {
            return kdt_fail(KDT_ERR_OVERFLOW, "shards * rows * k overflows");
        }
    }
    const size_t per_shard = (size_t)rows * (size_t)k;

    /* Every input is checked before anything is written. */
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (int64_t t = 0; t < shards; t++) {
            const size_t cell = (size_t)t * (size_t)rows + (size_t)r;
            const size_t at = (size_t)t * per_shard + (size_t)r * (size_t)k;
            const kdt_status st = check_shard_row(k > 0 ? shard_logits + at : NULL, k > 0 ? shard_ids + at : NULL,
                                                  shard_max[cell], shard_sumexp[cell], k, vocab, t, r);
            if (st != KDT_OK) return st;
            if (shard_max[cell] > m) m = shard_max[cell];
        }
        if (m == -INFINITY) return kdt_fail(KDT_ERR_VALUE, "row %lld: every logit is -inf", (long long)r);
    }

    for (int64_t r = 0; r < rows; r++) {
        /* The global max and sum of exp(x - max): each shard's sum, rescaled from its own max
         * (exactly 1 for the shard holding the max), added with compensation in shard order. */
        float m = -INFINITY;
        for (int64_t t = 0; t < shards; t++) {
            if (shard_max[(size_t)t * (size_t)rows + (size_t)r] > m) m = shard_max[(size_t)t * (size_t)rows + (size_t)r];
        }
        comp_sum s = {0.0, 0.0};
        for (int64_t t = 0; t < shards; t++) {
            const size_t cell = (size_t)t * (size_t)rows + (size_t)r;
            if (shard_max[cell] == -INFINITY) continue;
            const double scale = shard_max[cell] == m ? 1.0 : exp((double)shard_max[cell] - (double)m);
            comp_add(&s, shard_sumexp[cell] * scale);
        }
        const double log_sum = log(s.sum + s.carry);
        /* The k best of the shards' lists: each is sorted, so a k-way merge of their heads. */
        int32_t pos[KDT_TOPK_MAX_SHARDS];
        for (int64_t t = 0; t < shards; t++) pos[t] = 0;
        float* ov = out_logprobs + (size_t)r * (size_t)k;
        int32_t* oi = out_ids + (size_t)r * (size_t)k;
        for (int64_t c = 0; c < k; c++) {
            int64_t best = -1;
            float bv = 0.f;
            int32_t bi = 0;
            for (int64_t t = 0; t < shards; t++) {
                if (pos[t] >= k) continue;
                const size_t at = (size_t)t * per_shard + (size_t)r * (size_t)k + (size_t)pos[t];
                if (best < 0 || worse(bv, bi, shard_logits[at], shard_ids[at])) {
                    best = t;
                    bv = shard_logits[at];
                    bi = shard_ids[at];
                }
            }
            /* (k <= every shard's list, so one of them has an entry left.) */
            pos[best]++;
            ov[c] = (float)(((double)bv - (double)m) - log_sum);
            oi[c] = bi;
        }
    }
    return kdt_ok();
}
