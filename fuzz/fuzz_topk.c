/* libFuzzer target: kdt_topk_logprobs_cpu against a long double reference: the k largest
 * logits of each row, sorted descending with ties by lower id (ids and order exact), and
 * log-probs (logit - m) - log(sum exp(logit - m)) with m the row maximum, within
 * KDT_FUZZ_TOPK_ULPS (default 2) float32 ulps of the reference plus 4 float64 epsilons
 * times (1 + log sum) (the float64 log of a sum near 1 is only that exact in absolute
 * terms, so a log-prob near 0 may be several float32 ulps off); a -inf logit gives -inf.
 * Rows with a NaN or +inf logit, or only -inf, must be rejected with KDT_ERR_VALUE.
 *
 * Input bytes (missing bytes read as 0):
 *   0: rows - 1 (mod 4)   1-2: vocab - 1 (u16, mod 300)   3: k (mod vocab + 1)
 *   4: row_stride - vocab (mod 3)   5: flags: 1 raw float32 logits (else one byte each,
 *      quantised so that ties are common; 255 is -inf), 2 logits scaled by 2^100
 *   then the logits, row after row (row_stride entries each; the gap is filled too). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree.h"

enum { MAX_ROWS = 4, MAX_VOCAB = 300, MAX_STRIDE = MAX_VOCAB + 2 };

#define FAIL(...)                                                                               \
    do {                                                                                        \
        fprintf(stderr, "fuzz_topk: " __VA_ARGS__);                                             \
        fprintf(stderr, "\n  (last error: %s)\n", kdt_last_error());                            \
        abort();                                                                                \
    } while (0)

static long double g_ulps = -1;
static const float* g_row; /* the row qsort orders */

/* Descending value, then ascending id (the row has no NaN). */
static int by_value_then_id(const void* a, const void* b) {
    const int i = *(const int*)a, j = *(const int*)b;
    if (g_row[i] != g_row[j]) return g_row[i] > g_row[j] ? -1 : 1;
    return (i > j) - (i < j);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    size_t at = 0;
#define BYTE() (at < size ? data[at++] : 0)
    const int rows = 1 + BYTE() % MAX_ROWS;
    int vocab, k, stride, flags;
    static float logits[MAX_ROWS * MAX_STRIDE];
    float lp[MAX_ROWS * MAX_VOCAB];
    int32_t ids[MAX_ROWS * MAX_VOCAB];
    int invalid = 0;
    kdt_status st;
    if (g_ulps < 0) {
        const char* env = getenv("KDT_FUZZ_TOPK_ULPS");
        g_ulps = env != NULL ? strtold(env, NULL) : 2.0L;
    }
    vocab = BYTE();
    vocab |= BYTE() << 8;
    vocab = 1 + vocab % MAX_VOCAB;
    k = BYTE() % (vocab + 1);
    stride = vocab + BYTE() % 3;
    flags = BYTE();
    for (int i = 0; i < rows * stride; ++i) {
        if (flags & 1) {
            uint32_t u = 0;
            for (int j = 0; j < 4; ++j) u |= (uint32_t)BYTE() << (8 * j);
            memcpy(&logits[i], &u, 4);
        } else {
            const uint8_t q = BYTE();
            logits[i] = q == 255 ? -INFINITY : (float)((int)(q % 64) - 32) * 0.5f;
            if (flags & 2) logits[i] = ldexpf(logits[i], 100);
        }
    }
#undef BYTE
    for (int r = 0; r < rows; ++r) {
        int finite = 0;
        for (int c = 0; c < vocab; ++c) {
            const float x = logits[r * stride + c];
            if (isnan(x) || x == INFINITY) invalid = 1;
            if (x > -INFINITY) finite = 1;
        }
        if (!finite) invalid = 1;
    }
    memset(lp, 0, sizeof lp);
    st = kdt_topk_logprobs_cpu(logits, rows, vocab, stride, k, lp, ids);
    if (invalid) {
        if (st != KDT_ERR_VALUE) FAIL("a NaN / +inf / all -inf row gave status %d", (int)st);
        return 0;
    }
    if (st != KDT_OK) FAIL("valid rows (rows %d, vocab %d, k %d) gave status %d", rows, vocab, k, (int)st);
    for (int r = 0; r < rows; ++r) {
        const float* x = logits + r * stride;
        long double m = -INFINITY, sum = 0, lse;
        static int order[MAX_VOCAB];
        for (int c = 0; c < vocab; ++c) m = x[c] > m ? x[c] : m;
        for (int c = 0; c < vocab; ++c) sum += expl((long double)x[c] - m);
        lse = logl(sum);
        g_row = x;
        for (int c = 0; c < vocab; ++c) order[c] = c;
        qsort(order, (size_t)vocab, sizeof order[0], by_value_then_id);
        for (int j = 0; j < k; ++j) {
            const int best = order[j];
            if (ids[r * k + j] != best) {
                FAIL("row %d, entry %d: id %d, reference %d (logit %.9g vs %.9g)", r, j, ids[r * k + j],
                     best, (double)x[ids[r * k + j] >= 0 && ids[r * k + j] < vocab ? ids[r * k + j] : best],
                     (double)x[best]);
            }
            {
                const float got = lp[r * k + j];
                if (x[best] == -INFINITY) {
                    if (got != -INFINITY) FAIL("row %d, entry %d: -inf logit gave %.9g", r, j, (double)got);
                } else {
                    const long double want = ((long double)x[best] - m) - lse;
                    const float wf = (float)want;
                    if (isinf(wf)) { /* below -FLT_MAX: float32 rounds it to -inf */
                        if (!(got <= -FLT_MAX)) FAIL("row %d, entry %d: log-prob %.9g, reference %.9Lg (overflows float32)",
                                            r, j, (double)got, want);
                        continue;
                    }
                    const long double ulp = (long double)(nextafterf(fabsf(wf), INFINITY) - fabsf(wf));
                    const long double tol = g_ulps * ulp + 4.0L * DBL_EPSILON * (1.0L + lse);
                    if (!(fabsl((long double)got - want) <= tol)) {
                        FAIL("row %d, entry %d (id %d, logit %.9g, max %.9Lg): log-prob %.9g, reference %.12Lg "
                             "(%.1Lf ulps)", r, j, best, (double)x[best], m, (double)got, want,
                             fabsl((long double)got - want) / ulp);
                    }
                }
            }
        }
    }
    return 0;
}
