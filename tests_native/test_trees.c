/* The CPU tree builder against fixtures/trees_cases.kdtr (expected values from the Python
 * reference): every field of every case, into fresh buffers and into buffers holding
 * garbage or an earlier, larger tree; caller workspace vs. library workspace. Plus rows
 * that are not log-probs (an entry > 0 beyond float32 rounding) rejected with the place. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

typedef struct field_spec {
    const char* name;
    int32_t dtype;
    int32_t id;
} field_spec;

static const field_spec FIELDS[] = {
    {"num_nodes", KDT_DTYPE_INT32, KDT_FIELD_NUM_NODES},
    {"tokens", KDT_DTYPE_INT32, KDT_FIELD_TOKENS},
    {"depths", KDT_DTYPE_INT32, KDT_FIELD_DEPTHS},
    {"parents", KDT_DTYPE_INT32, KDT_FIELD_PARENTS},
    {"logw", KDT_DTYPE_FLOAT64, KDT_FIELD_LOGW},
    {"positions", KDT_DTYPE_INT64, KDT_FIELD_POSITIONS},
    {"visibility", KDT_DTYPE_BOOL, KDT_FIELD_VISIBILITY},
    {"visibility_bits", KDT_DTYPE_UINT32, KDT_FIELD_VISIBILITY_BITS},
    {"first_child", KDT_DTYPE_INT32, KDT_FIELD_FIRST_CHILD},
    {"next_sibling", KDT_DTYPE_INT32, KDT_FIELD_NEXT_SIBLING},
};
#define NFIELDS (sizeof FIELDS / sizeof FIELDS[0])

static void* field_ptr(kdt_trees* t, int32_t id) {
    switch (id) {
        case KDT_FIELD_NUM_NODES: return t->num_nodes;
        case KDT_FIELD_TOKENS: return t->tokens;
        case KDT_FIELD_DEPTHS: return t->depths;
        case KDT_FIELD_PARENTS: return t->parents;
        case KDT_FIELD_LOGW: return t->logw;
        case KDT_FIELD_POSITIONS: return t->positions;
        case KDT_FIELD_VISIBILITY: return t->visibility;
        case KDT_FIELD_VISIBILITY_BITS: return t->visibility_bits;
        case KDT_FIELD_FIRST_CHILD: return t->first_child;
        default: return t->next_sibling;
    }
}

/* Allocates every field for (batch, budget), filled with `fill`. */
static kdt_trees alloc_trees(int64_t batch, int64_t budget, int fill) {
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = batch;
    t.budget = budget;
    void** slots[] = {(void**)&t.num_nodes, (void**)&t.tokens, (void**)&t.depths,
                      (void**)&t.parents, (void**)&t.logw, (void**)&t.positions,
                      (void**)&t.visibility, (void**)&t.visibility_bits,
                      (void**)&t.first_child, (void**)&t.next_sibling};
    for (size_t i = 0; i < NFIELDS; i++) {
        size_t bytes = 0;
        CHECK_OK(kdt_trees_field_bytes(batch, budget, FIELDS[i].id, &bytes));
        *slots[i] = malloc(bytes ? bytes : 1);
        memset(*slots[i], fill, bytes);
    }
    return t;
}

static void free_trees(kdt_trees* t) {
    for (size_t i = 0; i < NFIELDS; i++) free(field_ptr(t, FIELDS[i].id));
}

/* Compares every field of `t` with the case's expected arrays, byte for byte. */
static int compare_case(const kdt_kdtr_file* f, int64_t c, kdt_trees* t, const char* how) {
    int ok = 1;
    for (size_t i = 0; i < NFIELDS; i++) {
        kdt_kdtr_array e = fixture_get(f, FIELDS[i].dtype, "%lld.expect.%s", (long long)c, FIELDS[i].name);
        size_t bytes = 0;
        CHECK_OK(kdt_trees_field_bytes(t->batch, t->budget, FIELDS[i].id, &bytes));
        CHECK_EQ(bytes, e.nbytes);
        if (bytes != e.nbytes || memcmp(field_ptr(t, FIELDS[i].id), e.data, bytes) != 0) {
            fprintf(stderr, "case %lld (%s): field %s differs from the reference\n", (long long)c, how,
                    FIELDS[i].name);
            harness_failures++;
            ok = 0;
        }
    }
    return ok;
}

/* Fills `big` (batch 3, budget 64) with full 64-node trees (15 x 64 synthetic draft). */
static void build_full_tree(kdt_trees* big) {
    enum { L = 15, K = 64, B = 3 };
    static float lp[B * L * K];
    static int32_t ids[B * L * K];
    for (int b = 0; b < B; b++)
        for (int d = 0; d < L; d++)
            for (int r = 0; r < K; r++) {
                lp[(b * L + d) * K + r] = -0.01f * (float)((r + 1) * (d + 1 + b));
                ids[(b * L + d) * K + r] = 1000 + r;
            }
    kdt_draft d;
    memset(&d, 0, sizeof d);
    d.batch = B;
    d.depth = L;
    d.width = K;
    d.logprobs = lp;
    d.token_ids = ids;
    d.pad_token = 77;
    CHECK_OK(kdt_trees_build_cpu(&d, big, NULL, 0));
    CHECK_EQ(big->num_nodes[0], 64);
}

/* Log-probs > 0 (beyond float32 rounding: 32 FLT_EPSILON) are probabilities or raw
 * logits, rejected with request, depth and rank; 0, tiny rounding above 0, -inf padding and
 * unused ranks (>= K' = min(K, N)) are accepted. */
static void logprob_sign(void) {
    enum { B = 2, L = 2, K = 3 };
    float lp[B * L * K];
    int32_t ids[B * L * K];
    for (int i = 0; i < B * L * K; i++) {
        lp[i] = -0.5f - (float)(i % K);
        ids[i] = i % K;
    }
    kdt_draft d;
    memset(&d, 0, sizeof d);
    d.batch = B;
    d.depth = L;
    d.width = K;
    d.logprobs = lp;
    d.token_ids = ids;
    d.pad_token = -1;
    kdt_trees t = alloc_trees(B, 4, 0xa5);
    CHECK_OK(kdt_trees_build_cpu(&d, &t, NULL, 0));

    /* Probabilities passed as log-probs, at request 1, depth 2. */
    const float probs[K] = {0.6f, 0.3f, 0.1f};
    memcpy(lp + (1 * L + 1) * K, probs, sizeof probs);
    CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 1, depth 2, rank 0: log-probability 0.6");
    /* Raw logits, at request 0, depth 1. */
    const float logits[K] = {3.25f, 1.0f, -0.5f};
    memcpy(lp, logits, sizeof logits);
    CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 0, depth 1, rank 0: log-probability 3.25 > 0");

    /* Valid again: exactly 0 (probability 1), float32 rounding above 0, -inf padding. */
    const float edge[K] = {0.0f, -INFINITY, -INFINITY};
    const float rounding[K] = {(float)(31.0 * FLT_EPSILON), -3.0f, -INFINITY};
    memcpy(lp, edge, sizeof edge);
    memcpy(lp + (1 * L + 1) * K, rounding, sizeof rounding);
    CHECK_OK(kdt_trees_build_cpu(&d, &t, NULL, 0));
    /* Just past the slack. */
    lp[(1 * L + 1) * K] = (float)(33.0 * FLT_EPSILON);
    CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 1, depth 2, rank 0");
    lp[(1 * L + 1) * K] = -1.0f;
    /* A NaN is still reported as NaN (checked first). */
    lp[K + 1] = NAN;
    lp[(1 * L + 1) * K] = 0.5f;
    CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 0, depth 2, rank 1: NaN log-probability");
    free_trees(&t);

    /* Budget 1: K' = 1 and rank 0 is the whole used part. An all -inf row (a dead depth). */
    float lp1[K] = {-INFINITY, -INFINITY, -INFINITY};
    int32_t ids1[K] = {0, 1, 2};
    kdt_draft d1 = d;
    d1.batch = 1;
    d1.depth = 1;
    d1.logprobs = lp1;
    d1.token_ids = ids1;
    kdt_trees t1 = alloc_trees(1, 1, 0xa5);
    CHECK_OK(kdt_trees_build_cpu(&d1, &t1, NULL, 0));
    CHECK_EQ(t1.num_nodes[0], 0);
    lp1[0] = 1.0f;
    CHECK_STATUS(kdt_trees_build_cpu(&d1, &t1, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 0, depth 1, rank 0: log-probability 1 > 0");
    free_trees(&t1);
}

/* Per-request budgets and depth limits: request b of the batch must equal request b
 * built alone with its own budget N_b and depth L_b (whose own build the fixtures check),
 * in its first N_b + 1 rows, and hold padding rows after them. */
static void request_limits(kdt_draft d, int64_t budget) {
    const int64_t B = d.batch, rows = budget + 1, words = (rows + 31) / 32;
    int32_t* nb = malloc((size_t)(B ? B : 1) * sizeof(int32_t));
    int32_t* lb = malloc((size_t)(B ? B : 1) * sizeof(int32_t));
    for (int64_t b = 0; b < B; b++) {
        nb[b] = (int32_t)((budget * (b + 1) * 5 / 7) % (budget + 1));
        lb[b] = (int32_t)((d.depth + b) % (d.depth + 1));
    }
    d.request_budgets = nb;
    d.request_depths = lb;
    kdt_trees t = alloc_trees(B, budget, 0xa5);
    CHECK_OK(kdt_trees_build_cpu(&d, &t, NULL, 0));
    for (int64_t b = 0; b < B; b++) {
        const int64_t own = nb[b], orows = own + 1;
        const size_t cells = (size_t)b * (size_t)d.depth * (size_t)d.width;
        kdt_draft one = d;
        one.batch = 1;
        one.depth = lb[b];
        one.logprobs = d.logprobs ? d.logprobs + cells : NULL;
        one.token_ids = d.token_ids ? d.token_ids + cells : NULL;
        one.root_tokens = d.root_tokens ? d.root_tokens + b : NULL;
        one.root_positions = d.root_positions ? d.root_positions + b : NULL;
        one.request_budgets = NULL;
        one.request_depths = NULL;
        /* The rows of `one` are [L_b, K] with stride K: a request's first L_b rows of the
         * [L, K] block are contiguous, so the pointer arithmetic above is exact. */
        kdt_trees a = alloc_trees(1, own, 0x3c);
        CHECK_OK(kdt_trees_build_cpu(&one, &a, NULL, 0));
        CHECK_EQ(t.num_nodes[b], a.num_nodes[0]);
        const size_t r = (size_t)b * (size_t)rows;
        CHECK(memcmp(t.tokens + r, a.tokens, (size_t)orows * 4) == 0);
        CHECK(memcmp(t.depths + r, a.depths, (size_t)orows * 4) == 0);
        CHECK(memcmp(t.parents + r, a.parents, (size_t)orows * 4) == 0);
        CHECK(memcmp(t.logw + r, a.logw, (size_t)orows * 8) == 0);
        CHECK(memcmp(t.positions + r, a.positions, (size_t)orows * 8) == 0);
        CHECK(memcmp(t.first_child + r, a.first_child, (size_t)orows * 4) == 0);
        CHECK(memcmp(t.next_sibling + r, a.next_sibling, (size_t)orows * 4) == 0);
        for (int64_t i = 0; i < rows; i++) {
            for (int64_t j = 0; j < rows; j++) {
                const uint8_t want = i < orows ? (j < orows ? a.visibility[i * orows + j] : 0) : (uint8_t)(i == j);
                CHECK_EQ(t.visibility[(r + (size_t)i) * (size_t)rows + (size_t)j], want);
                const uint32_t word = t.visibility_bits[(r + (size_t)i) * (size_t)words + (size_t)j / 32];
                CHECK_EQ((word >> (j % 32)) & 1u, (uint32_t)want);
            }
            if (i >= orows) {
                CHECK_EQ(t.tokens[r + (size_t)i], d.pad_token);
                CHECK_EQ(t.parents[r + (size_t)i], -1);
                CHECK(isinf(t.logw[r + (size_t)i]) && t.logw[r + (size_t)i] < 0);
            }
        }
        free_trees(&a);
    }
    /* A limit past the call's is the request's error. */
    if (B > 0) {
        nb[B - 1] = (int32_t)budget + 1;
        CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_OUT_OF_RANGE);
        CHECK_ERR_HAS("(request_budgets)");
        nb[B - 1] = 0;
        lb[0] = (int32_t)d.depth + 1;
        CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), KDT_ERR_OUT_OF_RANGE);
        CHECK_ERR_HAS("request 0: depth");
    }
    free_trees(&t);
    free(nb);
    free(lb);
}

int main(void) {
    kdt_kdtr_file* f = fixture_open("trees_cases.kdtr");
    kdt_kdtr_array count_a = fixture_get(f, KDT_DTYPE_INT64, "count");
    int64_t count = *(const int64_t*)count_a.data, passed = 0;
    /* A large tree built first, so its buffers can be reused for every smaller case. */
    kdt_trees big = alloc_trees(3, 64, 0x5a);

    for (int64_t c = 0; c < count; c++) {
        kdt_draft d = fixture_draft(f, c);
        int64_t budget = fixture_i64(f, "%lld.%s", c, "budget");

        /* 1. Fresh buffers full of garbage, library-allocated workspace. */
        kdt_trees t = alloc_trees(d.batch, budget, 0xa5);
        CHECK_OK(kdt_trees_build_cpu(&d, &t, NULL, 0));
        int ok = compare_case(f, c, &t, "fresh buffers");

        /* 2. The same buffers again (now holding this tree), caller workspace. */
        size_t ws_bytes = 0;
        CHECK_OK(kdt_trees_build_workspace_bytes(budget, d.depth, d.width, d.vocab_size, &ws_bytes));
        void* ws = malloc(ws_bytes ? ws_bytes : 1);
        memset(ws, 0xee, ws_bytes);
        CHECK_OK(kdt_trees_build_cpu(&d, &t, ws, ws_bytes));
        ok &= compare_case(f, c, &t, "caller workspace");
        if (ws_bytes > 0) {
            CHECK_STATUS(kdt_trees_build_cpu(&d, &t, ws, ws_bytes - 1), KDT_ERR_BUFFER_TOO_SMALL);
        }
        free(ws);
        free_trees(&t);

        /* 3. Buffers that just held a full 64-node tree: this case's (smaller) layout in
         * the same memory must show no trace of it. */
        if (d.batch <= 3 && budget <= 64) {
            kdt_trees reuse = big;
            build_full_tree(&big);
            reuse.batch = d.batch;
            reuse.budget = budget;
            CHECK_OK(kdt_trees_build_cpu(&d, &reuse, NULL, 0));
            ok &= compare_case(f, c, &reuse, "reused buffers of a larger tree");
        }
        passed += ok;
        request_limits(d, budget);
    }
    logprob_sign();
    printf("trees: %lld of %lld reference cases identical in every field\n", (long long)passed,
           (long long)count);
    CHECK_EQ(passed, count);
    free_trees(&big);
    kdt_kdtr_close(f);
    HARNESS_EXIT();
}
