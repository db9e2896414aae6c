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
        const float* x = logits + (size_t)r * (size_t)row_stride;
        int finite_or_neg = 0;
        for (int64_t c = 0; c < vocab; c++) {
            float v = x[c];
            if (isnan(v)) {
                return kdt_fail(KDT_ERR_VALUE, "row %lld, column %lld: NaN logit", (long long)r, (long long)c);
            }
            if (isinf(v)) {
                if (v > 0) {
                    return kdt_fail(KDT_ERR_VALUE, "row %lld, column %lld: +inf logit", (long long)r,
                                    (long long)c);
                }
            } else {
                finite_or_neg = 1;
            }
        }
        if (!finite_or_neg) {
            return kdt_fail(KDT_ERR_VALUE, "row %lld: every logit is -inf", (long long)r);
        }
    }

    for (int64_t r = 0; r < rows; r++) {
        const float* x = logits + (size_t)r * (size_t)row_stride;
        float* v = out_logprobs + (size_t)r * (size_t)k;
        int32_t* id = out_ids + (size_t)r * (size_t)k;
        float m = -INFINITY;
        double sum = 0.0, carry = 0.0, log_sum;
        for (int64_t c = 0; c < vocab; c++) {
            if (x[c] > m) m = x[c];
        }
        /* Neumaier-compensated sum: a million tiny terms next to a 1 still count. */
        for (int64_t c = 0; c < vocab; c++) {
            const double term = exp((double)x[c] - (double)m);
            const double t = sum + term;
            carry += fabs(sum) >= term ? (sum - t) + term : (term - t) + sum;
            sum = t;
        }
        log_sum = log(sum + carry);
        if (k == 0) continue;
        /* Keep the k best in a heap whose root is the worst kept entry. */
        for (int64_t c = 0; c < k; c++) {
            v[c] = x[c];
            id[c] = (int32_t)c;
        }
        for (int64_t i = k / 2; i-- > 0;) sift_down(v, id, k, i);
        for (int64_t c = k; c < vocab; c++) {
            if (worse(v[0], id[0], x[c], (int32_t)c)) {
                v[0] = x[c];
                id[0] = (int32_t)c;
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
        /* (logit - m) - log sum in float64, rounded once. Never logit - (m + log sum): m +
         * log sum loses log sum when m is large (six equal logits of 6.17e16 would give 0
         * instead of -log 6; at 1e12 float64's ulp is 1.2e-4). The difference of two
         * float32 values is exact in float64, or (exponents 30 or more apart) rounded by
         * 2^-53 relative. */
        for (int64_t c = 0; c < k; c++) v[c] = (float)(((double)v[c] - (double)m) - log_sum);
    }
    return kdt_ok();
}
