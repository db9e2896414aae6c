/* ABI basics and the tree builder's error handling: status strings, versions, size
 * queries, NULL pointers, bad arguments, the rejections listed in fixtures/bad_cases.kdtr,
 * and "outputs untouched on failure". */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

static void status_and_version(void) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", KDT_VERSION_MAJOR, KDT_VERSION_MINOR, KDT_VERSION_PATCH);
    CHECK(strcmp(kdt_version(), want) == 0);
    CHECK_EQ(kdt_abi_version(), KDT_ABI_VERSION);
    CHECK(strncmp(kdt_status_string(KDT_OK), "KDT_OK", 6) == 0);
    CHECK(strncmp(kdt_status_string(KDT_ERR_VALUE), "KDT_ERR_VALUE", 13) == 0);
    CHECK(strncmp(kdt_status_string(KDT_ERR_INTERNAL), "KDT_ERR_INTERNAL", 16) == 0);
    CHECK(strcmp(kdt_status_string(999), "unknown status") == 0);
    CHECK(strcmp(kdt_status_string(-1), "unknown status") == 0);
    /* Fixed enum values (append-only). */
    CHECK_EQ(KDT_ERR_INVALID_ARGUMENT, 1);
    CHECK_EQ(KDT_ERR_FORMAT, 9);
    CHECK_EQ(KDT_ERR_INTERNAL, 15);
}

static void size_queries(void) {
    size_t bytes = 0;
    int64_t words = 0;
    CHECK_OK(kdt_trees_field_bytes(3, 31, KDT_FIELD_VISIBILITY, &bytes));
    CHECK_EQ(bytes, 3 * 32 * 32);
    CHECK_OK(kdt_trees_field_bytes(3, 31, KDT_FIELD_VISIBILITY_BITS, &bytes));
    CHECK_EQ(bytes, 3 * 32 * 1 * 4);
    CHECK_OK(kdt_trees_field_bytes(3, 32, KDT_FIELD_VISIBILITY_BITS, &bytes));
    CHECK_EQ(bytes, 3 * 33 * 2 * 4);
    CHECK_OK(kdt_trees_field_bytes(2, 9, KDT_FIELD_LOGW, &bytes));
    CHECK_EQ(bytes, 2 * 10 * 8);
    CHECK_OK(kdt_trees_field_bytes(2, 9, KDT_FIELD_NUM_NODES, &bytes));
    CHECK_EQ(bytes, 2 * 4);
    CHECK_OK(kdt_trees_field_bytes(0, 9, KDT_FIELD_TOKENS, &bytes));
    CHECK_EQ(bytes, 0);
    CHECK_OK(kdt_visibility_words(0, &words));
    CHECK_EQ(words, 1);
    CHECK_OK(kdt_visibility_words(31, &words));
    CHECK_EQ(words, 1);
    CHECK_OK(kdt_visibility_words(32, &words));
    CHECK_EQ(words, 2);
    CHECK_STATUS(kdt_trees_field_bytes(INT64_MAX / 2, 1 << 20, KDT_FIELD_VISIBILITY, &bytes), KDT_ERR_OVERFLOW);
    CHECK_STATUS(kdt_trees_field_bytes(-1, 4, KDT_FIELD_TOKENS, &bytes), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_trees_field_bytes(1, -4, KDT_FIELD_TOKENS, &bytes), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_trees_field_bytes(1, 4, 42, &bytes), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_trees_field_bytes(1, 4, KDT_FIELD_TOKENS, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_trees_build_workspace_bytes(-1, 1, 1, 0, &bytes), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_trees_build_workspace_bytes(1, 1, 1, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_trees_build_workspace_bytes(INT64_MAX, 1, 1, 0, &bytes), KDT_ERR_INVALID_ARGUMENT);
}

/* Two requests, L = 2, K = 3 (ids 1..6), budget 4, every output present. */
typedef struct small_case {
    float lp[12];
    int32_t ids[12];
    int32_t num[2], tok[10], dep[10], par[10], fc[10], ns[10];
    double logw[10];
    int64_t pos[10];
    uint8_t vis[50];
    uint32_t bits[10];
    kdt_draft d;
    kdt_trees t;
} small_case;

static void small_init(small_case* s) {
    static const float p[6] = {0.5f, 0.3f, 0.2f, 0.6f, 0.3f, 0.1f};
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 6; i++) {
            s->lp[b * 6 + i] = logf(p[i]);
            s->ids[b * 6 + i] = 1 + i % 3 + 3 * (i / 3);
        }
    memset(&s->d, 0, sizeof s->d);
    s->d.batch = 2;
    s->d.depth = 2;
    s->d.width = 3;
    s->d.logprobs = s->lp;
    s->d.token_ids = s->ids;
    s->d.pad_token = -1;
    memset(&s->t, 0, sizeof s->t);
    s->t.batch = 2;
    s->t.budget = 4;
    s->t.num_nodes = s->num;
    s->t.tokens = s->tok;
    s->t.depths = s->dep;
    s->t.parents = s->par;
    s->t.logw = s->logw;
    s->t.positions = s->pos;
    s->t.visibility = s->vis;
    s->t.visibility_bits = s->bits;
    s->t.first_child = s->fc;
    s->t.next_sibling = s->ns;
    memset(s->num, 0x33, sizeof s->num + sizeof s->tok + sizeof s->dep + sizeof s->par + sizeof s->fc + sizeof s->ns);
    memset(s->logw, 0x33, sizeof s->logw);
    memset(s->pos, 0x33, sizeof s->pos);
    memset(s->vis, 0x33, sizeof s->vis);
    memset(s->bits, 0x33, sizeof s->bits);
}

/* True when no output byte changed from the 0x33 fill. */
static int untouched(const small_case* s) {
    const unsigned char* regions[] = {(const unsigned char*)s->num, (const unsigned char*)s->tok,
                                      (const unsigned char*)s->logw, (const unsigned char*)s->pos,
                                      s->vis, (const unsigned char*)s->bits,
                                      (const unsigned char*)s->fc, (const unsigned char*)s->ns};
    const size_t sizes[] = {sizeof s->num, sizeof s->tok, sizeof s->logw, sizeof s->pos,
                            sizeof s->vis, sizeof s->bits, sizeof s->fc, sizeof s->ns};
    for (size_t r = 0; r < sizeof sizes / sizeof sizes[0]; r++)
        for (size_t i = 0; i < sizes[r]; i++)
            if (regions[r][i] != 0x33) return 0;
    return 1;
}

static void builder_errors(void) {
    small_case s;
    small_init(&s);
    CHECK_OK(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0));
    CHECK_EQ(s.num[0], 4);

    small_init(&s);
    CHECK_STATUS(kdt_trees_build_cpu(NULL, &s.t, NULL, 0), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, NULL, NULL, 0), KDT_ERR_NULL_POINTER);
    s.t.num_nodes = NULL;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("num_nodes");
    small_init(&s);
    s.d.logprobs = NULL;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("logprobs");
    small_init(&s);
    s.d.token_ids = NULL;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("token_ids");
    small_init(&s);
    s.t.budget = -1;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("budget");
    small_init(&s);
    s.d.depth = -2;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_INVALID_ARGUMENT);
    small_init(&s);
    s.d.vocab_size = -5;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_INVALID_ARGUMENT);
    small_init(&s);
    s.t.batch = 3;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_SHAPE);
    CHECK(untouched(&s));
    small_init(&s);
    int64_t bad_pos[2] = {0, -7};
    s.d.root_positions = bad_pos;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_OUT_OF_RANGE);
    CHECK_ERR_HAS("request 1: root position -7");
    CHECK(untouched(&s));
    small_init(&s);
    int32_t bad_root[2] = {3, -2};
    s.d.root_tokens = bad_root;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_OUT_OF_RANGE);
    CHECK_ERR_HAS("request 1: root token -2");
    /* A NaN in request 1 leaves request 0's rows untouched too (validate first). */
    small_init(&s);
    s.lp[6 + 4] = NAN;
    CHECK_STATUS(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0), KDT_ERR_VALUE);
    CHECK_ERR_HAS("request 1, depth 2, rank 1: NaN");
    CHECK(untouched(&s));
}

static void degenerate(void) {
    small_case s;
    /* Budget 0: root only, one row per request. */
    small_init(&s);
    s.t.budget = 0;
    CHECK_OK(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0));
    CHECK_EQ(s.num[0], 0);
    CHECK_EQ(s.num[1], 0);
    CHECK_EQ(s.par[0], -1);
    CHECK_EQ(s.vis[0], 1);
    CHECK_EQ(s.bits[0], 1);
    /* Depth 0: root only, padding rows after it. */
    small_init(&s);
    s.d.depth = 0;
    CHECK_OK(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0));
    CHECK_EQ(s.num[0], 0);
    CHECK_EQ(s.tok[1], -1);
    CHECK_EQ(s.dep[4], 0);
    CHECK(isinf(s.logw[4]) && s.logw[4] < 0);
    CHECK_EQ(s.vis[4 * 5 + 4], 1);
    CHECK_EQ(s.vis[4 * 5 + 0], 0);
    CHECK_EQ(s.bits[4], 1u << 4);
    /* Optional outputs may be NULL; the rest are still written. */
    small_init(&s);
    s.t.visibility = NULL;
    s.t.visibility_bits = NULL;
    s.t.logw = NULL;
    CHECK_OK(kdt_trees_build_cpu(&s.d, &s.t, NULL, 0));
    CHECK_EQ(s.num[1], 4);
    CHECK_EQ(s.vis[0], 0x33);
    /* Batch 0 with NULL inputs is fine. */
    kdt_draft d0;
    memset(&d0, 0, sizeof d0);
    kdt_trees t0;
    memset(&t0, 0, sizeof t0);
    t0.budget = 5;
    CHECK_OK(kdt_trees_build_cpu(&d0, &t0, NULL, 0));
}

static void bad_fixture_cases(void) {
    kdt_kdtr_file* f = fixture_open("bad_cases.kdtr");
    kdt_kdtr_array count_a = fixture_get(f, KDT_DTYPE_INT64, "count");
    int64_t count = *(const int64_t*)count_a.data;
    for (int64_t c = 0; c < count; c++) {
        kdt_kdtr_array where = fixture_get(f, KDT_DTYPE_UINT8, "%lld.where", (long long)c);
        int64_t status = fixture_i64(f, "%lld.%s", c, "status");
        char text[128] = {0};
        memcpy(text, where.data, where.nbytes < 127 ? where.nbytes : 127);
        kdt_draft d = fixture_draft(f, c);
        int32_t num[2] = {-99, -99};
        kdt_trees t;
        memset(&t, 0, sizeof t);
        t.batch = d.batch;
        t.budget = fixture_i64(f, "%lld.%s", c, "budget");
        t.num_nodes = num;
        CHECK_STATUS(kdt_trees_build_cpu(&d, &t, NULL, 0), status);
        CHECK_ERR_HAS(text);
        CHECK(num[0] == -99 && num[1] == -99);
    }
    printf("bad inputs: %lld fixture cases rejected as the reference rejects them\n", (long long)count);
    kdt_kdtr_close(f);
}

int main(void) {
    status_and_version();
    size_queries();
    builder_errors();
    degenerate();
    bad_fixture_cases();
    HARNESS_EXIT();
}
