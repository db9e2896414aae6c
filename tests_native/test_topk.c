/* Top-k log-probs against fixtures/topk_cases.kdtr (expected values from the Python
 * reference: ids exact, log-probs within 1e-6), logits up to float32's largest (expected
 * values from a long double reference here, and by hand), plus error handling. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

static void fixture_cases(void) {
    kdt_kdtr_file* f = fixture_open("topk_cases.kdtr");
    kdt_kdtr_array count_a = fixture_get(f, KDT_DTYPE_INT64, "count");
    int64_t count = *(const int64_t*)count_a.data, passed = 0;
    for (int64_t c = 0; c < count; c++) {
        kdt_kdtr_array x = fixture_get(f, KDT_DTYPE_FLOAT32, "%lld.logits", (long long)c);
        kdt_kdtr_array e_lp = fixture_get(f, KDT_DTYPE_FLOAT32, "%lld.expect.logprobs", (long long)c);
        kdt_kdtr_array e_ids = fixture_get(f, KDT_DTYPE_INT32, "%lld.expect.ids", (long long)c);
        int64_t k = fixture_i64(f, "%lld.%s", c, "k");
        int64_t rows = x.shape[0], vocab = x.shape[1];
        float* lp = malloc(e_lp.nbytes + 4);
        int32_t* ids = malloc(e_ids.nbytes + 4);
        CHECK_OK(kdt_topk_logprobs_cpu((const float*)x.data, rows, vocab, vocab, k, lp, ids));
        int ok = memcmp(ids, e_ids.data, e_ids.nbytes) == 0;
        const float* want = (const float*)e_lp.data;
        for (int64_t i = 0; i < rows * k; i++) {
            if (isinf(want[i]) ? lp[i] != want[i] : fabsf(lp[i] - want[i]) > 1e-6f) ok = 0;
        }
        if (!ok) {
            fprintf(stderr, "topk case %lld (V=%lld, k=%lld) differs from the reference\n",
                    (long long)c, (long long)vocab, (long long)k);
            harness_failures++;
        }
        passed += ok;
        free(lp);
        free(ids);
    }
    printf("topk: %lld of %lld reference cases match\n", (long long)passed, (long long)count);
    CHECK_EQ(passed, count);
    kdt_kdtr_close(f);
}

/* One row's log-probs in long double, (x - max) - log sum exp(x - max), rounded to float
 * (x[i] - max of two float32 values is exact in long double's 64-bit significand, or
 * rounded far below float32's resolution). */
static float ref_logprob(const float* x, int64_t vocab, int64_t i) {
    long double m = -INFINITY, sum = 0.0L;
    for (int64_t c = 0; c < vocab; c++) {
        if (x[c] > m) m = x[c];
    }
    for (int64_t c = 0; c < vocab; c++) sum += expl((long double)x[c] - m);
    return (float)(((long double)x[i] - m) - logl(sum));
}

/* Within 1 float32 ulp of want (equal when want is infinite). */
static int within_ulp(float got, float want) {
    if (isinf(want) || isinf(got)) return got == want;
    return fabsf(got - want) <= fabsf(nextafterf(want, INFINITY) - want);
}

/* Logits up to FLT_MAX: log-probs are (logit - max) - log sum, never logit - (max + log
 * sum), which loses log sum once max is large. */
static void extreme_logits(void) {
    enum { V = 8 };
    const float big = 6.17e16f, t = 1e12f, sp = 65536.0f; /* sp: float32's spacing at 1e12 */
    const float rows[][V] = {
        {big, big, big, big, big, big, -INFINITY, -INFINITY},   /* six equal: -log 6 each */
        {t, t, t, t - sp, t - 2 * sp, -t, 0.0f, -INFINITY},     /* 1e12 ties: -log 3 */
        {t, t - 1.5e-4f * t, t, 1.0f, -1.0f, t, t, t},          /* five 1e12 ties, others far below */
        {FLT_MAX, FLT_MAX, -FLT_MAX, 0.0f, -INFINITY, FLT_MAX / 2, -FLT_MAX, 1.0f},
        {-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX, -INFINITY, -INFINITY, -INFINITY, -INFINITY},
        {-3.4e38f, -3.4e38f, -3.4e38f - 1e31f * 2, -INFINITY, -3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f},
        {3.4e38f, -3.4e38f, 1e38f, -1e38f, 3.4e38f, 0.0f, 1e-38f, -3.4e38f}, /* mixed signs */
        {1e6f, 1e6f + 1.0f, 1e6f - 2.0f, 1e6f + 0.5f, -1e6f, 1e6f, 1e6f - 0.0625f, 1e6f + 3.0f},
    };
    const int nrows = (int)(sizeof rows / sizeof rows[0]);
    float lp[V];
    int32_t ids[V];
    int bad = 0;
    for (int r = 0; r < nrows; r++) {
        CHECK_OK(kdt_topk_logprobs_cpu(rows[r], 1, V, V, V, lp, ids));
        for (int i = 0; i < V; i++) {
            const float want = ref_logprob(rows[r], V, ids[i]);
            if (!within_ulp(lp[i], want)) {
                fprintf(stderr, "extreme row %d, rank %d (id %d, logit %.9g): log-prob %.9g, expected %.9g\n", r, i,
                        ids[i], rows[r][ids[i]], lp[i], want);
                bad++;
            }
        }
    }
    CHECK_EQ(bad, 0);
    /* By hand. */
    CHECK_OK(kdt_topk_logprobs_cpu(rows[0], 1, V, V, 6, lp, ids));
    for (int i = 0; i < 6; i++) {
        CHECK_EQ(ids[i], i);
        CHECK(within_ulp(lp[i], (float)-log(6.0)));
    }
    CHECK_OK(kdt_topk_logprobs_cpu(rows[1], 1, V, V, 3, lp, ids));
    for (int i = 0; i < 3; i++) CHECK(within_ulp(lp[i], (float)-log(3.0)));
    CHECK_OK(kdt_topk_logprobs_cpu(rows[3], 1, V, V, 4, lp, ids));
    CHECK(within_ulp(lp[0], (float)-log(2.0)) && within_ulp(lp[1], (float)-log(2.0)));
    CHECK_EQ(ids[2], 5); /* FLT_MAX / 2 */
    CHECK(lp[2] == -FLT_MAX / 2);  /* -FLT_MAX / 2 - log 2 rounds to -FLT_MAX / 2 */
    CHECK(lp[3] == -FLT_MAX);      /* 1 - FLT_MAX - log 2 */
    CHECK_OK(kdt_topk_logprobs_cpu(rows[4], 1, V, V, 4, lp, ids));
    for (int i = 0; i < 4; i++) CHECK(within_ulp(lp[i], (float)-log(4.0)));
    CHECK_OK(kdt_topk_logprobs_cpu(rows[3], 1, V, V, V, lp, ids));
    CHECK(lp[V - 1] == -INFINITY && lp[V - 2] == -INFINITY); /* -FLT_MAX - FLT_MAX: below float32 */
}

static void strided_and_errors(void) {
    /* Two rows of 3 logits with a row stride of 5 (the gaps hold NaN, never read). */
    float x[10] = {1.0f, 3.0f, 3.0f, NAN, NAN, -INFINITY, 0.0f, 2.0f, NAN, NAN};
    float lp[4] = {9, 9, 9, 9};
    int32_t ids[4] = {9, 9, 9, 9};
    CHECK_OK(kdt_topk_logprobs_cpu(x, 2, 3, 5, 2, lp, ids));
    CHECK_EQ(ids[0], 1); /* tie 3.0 / 3.0: lower id first */
    CHECK_EQ(ids[1], 2);
    CHECK_EQ(ids[2], 2);
    CHECK_EQ(ids[3], 1);
    CHECK(lp[0] == lp[1]);
    CHECK(fabs(lp[2] - (2.0 - log(exp(0.0) + exp(2.0)))) < 1e-6);

    float lp2[2] = {5, 5};
    int32_t ids2[2] = {5, 5};
    float nan_row[3] = {0.0f, NAN, 1.0f};
    CHECK_STATUS(kdt_topk_logprobs_cpu(nan_row, 1, 3, 3, 2, lp2, ids2), KDT_ERR_VALUE);
    CHECK_ERR_HAS("row 0, column 1: NaN");
    CHECK(lp2[0] == 5 && ids2[0] == 5); /* untouched */
    float inf_row[3] = {0.0f, 1.0f, INFINITY};
    CHECK_STATUS(kdt_topk_logprobs_cpu(inf_row, 1, 3, 3, 2, lp2, ids2), KDT_ERR_VALUE);
    CHECK_ERR_HAS("column 2: +inf");
    float dead[3] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK_STATUS(kdt_topk_logprobs_cpu(dead, 1, 3, 3, 2, lp2, ids2), KDT_ERR_VALUE);
    CHECK_ERR_HAS("every logit is -inf");
    CHECK_STATUS(kdt_topk_logprobs_cpu(x, 1, 3, 3, 4, lp2, ids2), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cpu(x, 2, 3, 2, 1, lp2, ids2), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_logprobs_cpu(NULL, 1, 3, 3, 1, lp2, ids2), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_topk_logprobs_cpu(x, 1, 3, 3, 1, NULL, ids2), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_topk_logprobs_cpu(x, -1, 3, 3, 1, lp2, ids2), KDT_ERR_INVALID_ARGUMENT);
}

/* The fixture cases split into T vocabulary shards (uneven, each holding at least k):
 * kdt_topk_shard_cpu on each, kdt_topk_merge_cpu of the stacked summaries; the ids equal
 * kdt_topk_logprobs_cpu's and the log-probs are within one float32 ulp of them. */
static void sharded_cases(void) {
    kdt_kdtr_file* f = fixture_open("topk_cases.kdtr");
    kdt_kdtr_array count_a = fixture_get(f, KDT_DTYPE_INT64, "count");
    const int64_t count = *(const int64_t*)count_a.data;
    int64_t merged = 0;
    for (int64_t c = 0; c < count; c++) {
        kdt_kdtr_array x = fixture_get(f, KDT_DTYPE_FLOAT32, "%lld.logits", (long long)c);
        const int64_t k = fixture_i64(f, "%lld.%s", c, "k");
        const int64_t rows = x.shape[0], vocab = x.shape[1];
        for (int64_t shards = 2; shards <= 4; shards++) {
            if (k < 1 || vocab / shards < k + 1) continue; /* (shards of vocab / shards +- 1 entries) */
            int64_t edges[5];
            for (int64_t t = 0; t <= shards; t++) edges[t] = t == shards ? vocab : t * (vocab / shards) + (t % 2);
            float* slg = malloc((size_t)(shards * rows * k) * sizeof(float));
            int32_t* sid = malloc((size_t)(shards * rows * k) * sizeof(int32_t));
            float* smx = malloc((size_t)(shards * rows) * sizeof(float));
            double* sse = malloc((size_t)(shards * rows) * sizeof(double));
            float* lp = malloc((size_t)(rows * k) * sizeof(float));
            float* want_lp = malloc((size_t)(rows * k) * sizeof(float));
            int32_t* ids = malloc((size_t)(rows * k) * sizeof(int32_t));
            int32_t* want_ids = malloc((size_t)(rows * k) * sizeof(int32_t));
            for (int64_t t = 0; t < shards; t++) {
                CHECK_OK(kdt_topk_shard_cpu((const float*)x.data + edges[t], rows, edges[t + 1] - edges[t], vocab,
                                            edges[t], k, slg + t * rows * k, sid + t * rows * k, smx + t * rows,
                                            sse + t * rows));
            }
            CHECK_OK(kdt_topk_merge_cpu(slg, sid, smx, sse, shards, rows, k, vocab, lp, ids));
            CHECK_OK(kdt_topk_logprobs_cpu((const float*)x.data, rows, vocab, vocab, k, want_lp, want_ids));
            int ok = memcmp(ids, want_ids, (size_t)(rows * k) * sizeof(int32_t)) == 0;
            for (int64_t i = 0; i < rows * k; i++) ok = ok && within_ulp(lp[i], want_lp[i]);
            if (!ok) {
                fprintf(stderr, "topk case %lld, %lld shards: the merge differs from the gathered top-k\n",
                        (long long)c, (long long)shards);
                harness_failures++;
            }
            merged++;
            free(slg);
            free(sid);
            free(smx);
            free(sse);
            free(lp);
            free(want_lp);
            free(ids);
            free(want_ids);
        }
    }
    printf("topk: %lld sharded merges of the reference cases match\n", (long long)merged);
    CHECK(merged > 0);
    kdt_kdtr_close(f);

    /* Errors: an unsorted list names shard, row and entry; outputs stay untouched. */
    float lg[4] = {3.0f, 1.0f, 5.0f, 6.0f};
    int32_t id[4] = {0, 1, 2, 3};
    float mx[2] = {3.0f, 5.0f};
    double se[2] = {1.2, 1.1};
    float out[2] = {9.0f, 9.0f};
    int32_t oid[2] = {9, 9};
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, mx, se, 2, 1, 2, 4, out, oid), KDT_ERR_VALUE);
    CHECK_ERR_HAS("shard 1, row 0, entry 1");
    CHECK(out[0] == 9.0f && oid[0] == 9);
    lg[3] = 2.0f;
    CHECK_OK(kdt_topk_merge_cpu(lg, id, mx, se, 2, 1, 2, 4, out, oid));
    CHECK_EQ(oid[0], 2);
    CHECK_EQ(oid[1], 0);
    /* m = 5; the rest: shard 1's 1.1 plus shard 0's (1 + 1.2) e^-2. */
    CHECK(fabs(out[0] - (0.0 - log(2.1 + 2.2 * exp(-2.0)))) < 1e-6);
    CHECK(fabs(out[1] - (-2.0 - log(2.1 + 2.2 * exp(-2.0)))) < 1e-6);
    /* The same shard twice: one id listed by two shards. */
    float twice[4] = {3.0f, 1.0f, 3.0f, 1.0f};
    int32_t twice_id[4] = {0, 1, 0, 1};
    float twice_mx[2] = {3.0f, 3.0f};
    CHECK_STATUS(kdt_topk_merge_cpu(twice, twice_id, twice_mx, se, 2, 1, 2, 4, out, oid), KDT_ERR_VALUE);
    CHECK_ERR_HAS("id 0 is listed by two shards");
    /* Statistics no shard gives: a max above the list's best, a rest past the vocabulary. */
    mx[0] = 4.0f;
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, mx, se, 2, 1, 2, 4, out, oid), KDT_ERR_VALUE);
    CHECK_ERR_HAS("shard 0, row 0: max 4");
    mx[0] = 3.0f;
    se[1] = 1e308;
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, mx, se, 2, 1, 2, 4, out, oid), KDT_ERR_VALUE);
    se[1] = 1.1;
    /* Extents past the address space are an overflow, not a wild read. */
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, mx, se, 2, INT64_C(1) << 61, 0, 4, NULL, NULL), KDT_ERR_OVERFLOW);
    CHECK_STATUS(kdt_topk_shard_cpu(lg, 2, 4, INT64_C(1) << 61, 0, 2, out, oid, mx, se), KDT_ERR_OVERFLOW);
    CHECK_STATUS(kdt_topk_logprobs_cpu(lg, 2, 4, INT64_C(1) << 62, 2, out, oid), KDT_ERR_OVERFLOW);
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, mx, se, 0, 1, 2, 4, out, oid), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_merge_cpu(lg, id, NULL, se, 2, 1, 2, 4, out, oid), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_topk_shard_cpu(lg, 1, 4, 4, 0, 5, out, oid, mx, se), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_topk_shard_cpu(lg, 1, 4, 4, INT32_MAX, 1, out, oid, mx, se), KDT_ERR_INVALID_ARGUMENT);
}

int main(void) {
    fixture_cases();
    extreme_logits();
    strided_and_errors();
    sharded_cases();
    HARNESS_EXIT();
}
