/* Top-k log-probs against fixtures/topk_cases.kdtr (expected values from the Python
 * reference: ids exact, log-probs within 1e-6), plus error handling. */
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

int main(void) {
    fixture_cases();
    strided_and_errors();
    HARNESS_EXIT();
}
