/* The inputs and calls of the README's C program (examples/quickstart.c, which ctest runs
 * and compares with its expected output) checked value by value with the test harness: two
 * requests, depth L = 3, top-K = 2, budget N = 4; the trees and the walk are checked
 * against values from the Python reference (kdtree.reference), worked by hand in the
 * comments.
 *
 * Built by hand the README's way (plus the harness's folder):
 *   cc -I include -I tests_native tests_native/test_readme_example.c -L build -lkdtree \
 *      -Wl,-rpath,$PWD/build -o app */
#include <stdio.h>
#include <kdtree.h>

#include "harness.h"

enum { B = 2, L = 3, K = 2, N = 4, V = 100 };

int main(void) {
    /* Request 0: log-probs per depth [-0.1, -2.5], [-0.2, -2.0], [-0.3, -1.9] for tokens
     * 10/11, 20/21, 30/31. Best first: 10 (-0.1), 20 (-0.3), 30 (-0.6), then 21 under 10
     * (-2.1) beats 31 (-2.2) and 11 (-2.5). Request 1: 40 (-0.5), 41 (-0.9), 50 under 40
     * (-1.5), 51 under 40 (-1.7). */
    const float lp[B * L * K] = {-0.1f, -2.5f, -0.2f, -2.0f, -0.3f, -1.9f,
                                 -0.5f, -0.9f, -1.0f, -1.2f, -0.7f, -3.0f};
    const int32_t ids[B * L * K] = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61};
    const int32_t roots[B] = {5, 6};
    const int64_t pos[B] = {100, 7};
    int32_t num_nodes[B], tokens[B * (N + 1)], parents[B * (N + 1)], first_child[B * (N + 1)],
        next_sibling[B * (N + 1)];
    int64_t positions[B * (N + 1)];
    uint8_t mask[B * (N + 1) * (N + 1)];
    /* The target's choice at each node: request 0 takes 10 then 20, then says 99 (not a
     * child of node 2): 2 accepted, bonus 99. Request 1 says 55 at the root: 0, bonus 55. */
    const int32_t target_tokens[B * (N + 1)] = {10, 20, 99, 0, 0, 55, 0, 0, 0, 0};
    int32_t accepted_nodes[B * (L + 1)], accept_length[B], bonus_token[B];

    size_t bytes = 0;
    CHECK_OK(kdt_trees_field_bytes(B, N, KDT_FIELD_TOKENS, &bytes));
    CHECK_EQ(bytes, sizeof tokens);
    CHECK_OK(kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &bytes));
    CHECK_EQ(bytes, sizeof mask);

    /* ---- the calls of examples/quickstart.c ---- */
    /* B requests, L positions, top-K each; budget N. */
    kdt_draft draft = {.batch = B, .depth = L, .width = K, .logprobs = lp, .token_ids = ids,
                       .root_tokens = roots, .root_positions = pos, .vocab_size = V, .pad_token = -1};
    kdt_trees out = {.batch = B, .budget = N, .num_nodes = num_nodes, .tokens = tokens,
                     .parents = parents, .positions = positions, .visibility = mask,
                     .first_child = first_child, .next_sibling = next_sibling};
    /* (sizes: kdt_trees_field_bytes(B, N, KDT_FIELD_..., &bytes); NULL fields are skipped) */
    if (kdt_trees_build_cpu(&draft, &out, NULL, 0) != KDT_OK) {
        fprintf(stderr, "%s\n", kdt_last_error());   /* "request 3, depth 2, rank 5: NaN ..." */
        return 1;
    }
    /* target_tokens[b][i]: the target's choice at node i */
    if (kdt_verify_greedy_cpu(&out, target_tokens, NULL, 0, NULL, NULL, L + 1,
                              accepted_nodes, accept_length, bonus_token) != KDT_OK) {
        fprintf(stderr, "%s\n", kdt_last_error());
        return 1;
    }
    /* ---- end of the calls ---- */

    const int32_t want_tokens[B * (N + 1)] = {5, 10, 20, 30, 21, 6, 40, 41, 50, 51};
    const int32_t want_parents[B * (N + 1)] = {-1, 0, 1, 2, 1, -1, 0, 0, 1, 1};
    const int64_t want_positions[B * (N + 1)] = {100, 101, 102, 103, 102, 7, 8, 8, 9, 9};
    const int32_t want_first_child[B * (N + 1)] = {1, 2, 3, -1, -1, 1, 3, -1, -1, -1};
    const int32_t want_next_sibling[B * (N + 1)] = {-1, -1, 4, -1, -1, -1, 2, -1, 4, -1};
    for (int b = 0; b < B; b++) CHECK_EQ(num_nodes[b], N);
    for (int i = 0; i < B * (N + 1); i++) {
        CHECK_EQ(tokens[i], want_tokens[i]);
        CHECK_EQ(parents[i], want_parents[i]);
        CHECK_EQ(positions[i], want_positions[i]);
        CHECK_EQ(first_child[i], want_first_child[i]);
        CHECK_EQ(next_sibling[i], want_next_sibling[i]);
    }
    /* Visibility: node i sees j when j is i or one of its ancestors. */
    for (int b = 0; b < B; b++) {
        for (int i = 0; i <= N; i++) {
            for (int j = 0; j <= N; j++) {
                int sees = 0;
                for (int a = i; a >= 0; a = want_parents[b * (N + 1) + a]) sees |= a == j;
                CHECK_EQ(mask[(b * (N + 1) + i) * (N + 1) + j], sees);
            }
        }
    }
    const int32_t want_accepted[B * (L + 1)] = {0, 1, 2, -1, 0, -1, -1, -1};
    for (int i = 0; i < B * (L + 1); i++) CHECK_EQ(accepted_nodes[i], want_accepted[i]);
    CHECK_EQ(accept_length[0], 2);
    CHECK_EQ(accept_length[1], 0);
    CHECK_EQ(bonus_token[0], 99);
    CHECK_EQ(bonus_token[1], 55);
    HARNESS_EXIT();
}
