/* The verification walk against fixtures/verify_cases.kdtr (expected values from the
 * Python reference), plus hand-worked edge cases and error handling. */
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

static void fixture_cases(void) {
    kdt_kdtr_file* f = fixture_open("verify_cases.kdtr");
    kdt_kdtr_array count_a = fixture_get(f, KDT_DTYPE_INT64, "count");
    int64_t count = *(const int64_t*)count_a.data, passed = 0;
    for (int64_t c = 0; c < count; c++) {
        kdt_kdtr_array num = fixture_get(f, KDT_DTYPE_INT32, "%lld.num_nodes", (long long)c);
        kdt_kdtr_array tok = fixture_get(f, KDT_DTYPE_INT32, "%lld.tokens", (long long)c);
        kdt_kdtr_array fc = fixture_get(f, KDT_DTYPE_INT32, "%lld.first_child", (long long)c);
        kdt_kdtr_array ns = fixture_get(f, KDT_DTYPE_INT32, "%lld.next_sibling", (long long)c);
        kdt_kdtr_array target = fixture_get(f, KDT_DTYPE_INT32, "%lld.target_tokens", (long long)c);
        kdt_kdtr_array stops = fixture_get(f, KDT_DTYPE_INT32, "%lld.stop_tokens", (long long)c);
        kdt_kdtr_array caps = fixture_get(f, KDT_DTYPE_INT64, "%lld.max_commit", (long long)c);
        kdt_kdtr_array e_nodes = fixture_get(f, KDT_DTYPE_INT32, "%lld.expect.accepted_nodes", (long long)c);
        kdt_kdtr_array e_len = fixture_get(f, KDT_DTYPE_INT32, "%lld.expect.accept_length", (long long)c);
        kdt_kdtr_array e_bonus = fixture_get(f, KDT_DTYPE_INT32, "%lld.expect.bonus_token", (long long)c);
        kdt_trees t;
        memset(&t, 0, sizeof t);
        t.batch = num.shape[0];
        t.budget = fixture_i64(f, "%lld.%s", c, "budget");
        t.num_nodes = (int32_t*)num.data;
        t.tokens = (int32_t*)tok.data;
        t.first_child = (int32_t*)fc.data;
        t.next_sibling = (int32_t*)ns.data;
        int64_t cap_cols = e_nodes.shape[1];
        int32_t* nodes = malloc(e_nodes.nbytes);
        int32_t* len = malloc(e_len.nbytes);
        int32_t* bonus = malloc(e_bonus.nbytes);
        memset(nodes, 0x7f, e_nodes.nbytes);
        CHECK_OK(kdt_verify_greedy_cpu(&t, (const int32_t*)target.data,
                                       fixture_numel(&stops) ? (const int32_t*)stops.data : NULL,
                                       fixture_numel(&stops), NULL,
                                       fixture_numel(&caps) ? (const int64_t*)caps.data : NULL, cap_cols,
                                       nodes, len, bonus));
        int ok = memcmp(nodes, e_nodes.data, e_nodes.nbytes) == 0 &&
                 memcmp(len, e_len.data, e_len.nbytes) == 0 &&
                 memcmp(bonus, e_bonus.data, e_bonus.nbytes) == 0;
        if (!ok) {
            fprintf(stderr, "verify case %lld differs from the reference\n", (long long)c);
            harness_failures++;
        }
        passed += ok;
        free(nodes);
        free(len);
        free(bonus);
    }
    printf("verify: %lld of %lld reference cases identical\n", (long long)passed, (long long)count);
    CHECK_EQ(passed, count);
    kdt_kdtr_close(f);
}

/* Root 0 with children 1 (token 10) and 2 (token 20); node 1 has child 3 (token 30). */
static int32_t H_NUM[1] = {3};
static int32_t H_TOK[5] = {5, 10, 20, 30, -1};
static int32_t H_FC[5] = {1, 3, -1, -1, -1};
static int32_t H_NS[5] = {-1, 2, -1, -1, -1};

static kdt_trees hand_tree(void) {
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = 1;
    t.budget = 4;
    t.num_nodes = H_NUM;
    t.tokens = H_TOK;
    t.first_child = H_FC;
    t.next_sibling = H_NS;
    return t;
}

static void hand_cases(void) {
    kdt_trees t = hand_tree();
    int32_t nodes[3], len, bonus;
    /* The root's chosen token gates the first draft node. */
    int32_t miss[5] = {99, 30, 0, 0, 0};
    CHECK_OK(kdt_verify_greedy_cpu(&t, miss, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 0);
    CHECK_EQ(bonus, 99);
    CHECK_EQ(nodes[0], 0);
    CHECK_EQ(nodes[1], -1);
    /* Full path 0 -> 1 -> 3, bonus = target at node 3. */
    int32_t deep[5] = {10, 30, 0, 42, 0};
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 2);
    CHECK_EQ(nodes[1], 1);
    CHECK_EQ(nodes[2], 3);
    CHECK_EQ(bonus, 42);
    /* Stop token 10 accepted: the walk ends there, no bonus. */
    int32_t stop[1] = {10};
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, stop, 1, NULL, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 1);
    CHECK_EQ(bonus, -1);
    /* Caps: 0 commits nothing; 1 only the bonus (= token 10); 2 = node 1 + bonus 30. */
    int64_t cap0 = 0, cap1 = 1, cap2 = 2, cap3 = 3;
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, &cap0, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 0);
    CHECK_EQ(bonus, -1);
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, &cap1, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 0);
    CHECK_EQ(bonus, 10);
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, &cap2, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 1);
    CHECK_EQ(bonus, 30);
    CHECK_EQ(nodes[2], -1);
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, &cap3, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 2);
    CHECK_EQ(bonus, 42);
    /* Path longer than the capacity: an error, outputs untouched. */
    int32_t small[2] = {123, 123};
    len = 77;
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 2, small, &len, &bonus), KDT_ERR_SHAPE);
    CHECK_EQ(small[0], 123);
    CHECK_EQ(len, 77);
}

static void error_cases(void) {
    kdt_trees t = hand_tree();
    int32_t deep[5] = {10, 30, 0, 42, 0};
    int32_t nodes[3], len, bonus;
    int64_t neg = -1;
    CHECK_STATUS(kdt_verify_greedy_cpu(NULL, deep, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, NULL, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("target_tokens");
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 2, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 0, nodes, &len, &bonus), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, &neg, 3, nodes, &len, &bonus), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("request 0");
    /* A negative target token at a visited node. */
    int32_t negt[5] = {10, -4, 0, 0, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, negt, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_VALUE);
    CHECK_ERR_HAS("node 1");
    /* Broken links: a first_child pointing backwards (would cycle), num_nodes past N. */
    int32_t bad_fc[5] = {1, 0, -1, -1, -1};
    t.first_child = bad_fc;
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_VALUE);
    CHECK_ERR_HAS("first_child");
    t = hand_tree();
    int32_t bad_ns[5] = {-1, 1, -1, -1, -1};
    t.next_sibling = bad_ns;
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_VALUE);
    CHECK_ERR_HAS("next_sibling");
    t = hand_tree();
    int32_t big_n[1] = {9};
    t.num_nodes = big_n;
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, NULL, NULL, 3, nodes, &len, &bonus), KDT_ERR_VALUE);
    CHECK_ERR_HAS("num_nodes");
}

/* Multi-token stop sequences on the hand tree (path 0 -> 1 (10) -> 3 (30), bonus 42). */
static void stop_sequence_cases(void) {
    kdt_trees t = hand_tree();
    int32_t deep[5] = {10, 30, 0, 42, 0};
    int32_t nodes[3], len, bonus;
    /* Sequences 7 5 10 (spanning the history: ..., 7, 5) and 10 30. */
    const int32_t tokens[5] = {7, 5, 10, 10, 30};
    const int64_t offsets[3] = {0, 3, 5};
    const int32_t history[3] = {-1, 7, 5};
    kdt_stop_sequences q = {tokens, offsets, 2, history, 3};
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &q, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 1); /* 7 5 10 completes at node 1 */
    CHECK_EQ(bonus, -1);
    q.history = NULL;
    q.history_length = 0;
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &q, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 2); /* 10 30 completes at node 3 */
    CHECK_EQ(bonus, -1);
    q.count = 1; /* only 7 5 10, no history: no stop */
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &q, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(len, 2);
    CHECK_EQ(bonus, 42);
    q.count = 0; /* none */
    CHECK_OK(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &q, NULL, 3, nodes, &len, &bonus));
    CHECK_EQ(bonus, 42);
    /* Malformed descriptions. */
    const int64_t bad_start[2] = {1, 3}, empty[2] = {0, 0}, long_one[2] = {0, KDT_MAX_STOP_LENGTH + 1};
    const int32_t negative[2] = {3, -2};
    const int64_t two[2] = {0, 2};
    kdt_stop_sequences b1 = {tokens, bad_start, 1, NULL, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b1, NULL, 3, nodes, &len, &bonus),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("offsets[0]");
    kdt_stop_sequences b2 = {tokens, empty, 1, NULL, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b2, NULL, 3, nodes, &len, &bonus),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("length 0");
    kdt_stop_sequences b3 = {tokens, long_one, 1, NULL, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b3, NULL, 3, nodes, &len, &bonus),
                 KDT_ERR_INVALID_ARGUMENT);
    kdt_stop_sequences b4 = {negative, two, 1, NULL, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b4, NULL, 3, nodes, &len, &bonus),
                 KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("-2 is negative");
    kdt_stop_sequences b5 = {tokens, offsets, 2, NULL, 4};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b5, NULL, 3, nodes, &len, &bonus), KDT_ERR_NULL_POINTER);
    kdt_stop_sequences b6 = {tokens, offsets, -1, NULL, 0};
    CHECK_STATUS(kdt_verify_greedy_cpu(&t, deep, NULL, 0, &b6, NULL, 3, nodes, &len, &bonus),
                 KDT_ERR_INVALID_ARGUMENT);
}

int main(void) {
    fixture_cases();
    hand_cases();
    error_cases();
    stop_sequence_cases();
    HARNESS_EXIT();
}
