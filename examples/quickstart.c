/* kdtree quickstart: build the draft trees of two requests from a drafter's top-2
 * log-probs (depth L = 3, budget N = 4), then walk each tree along the target's choices.
 * Every buffer is sized by the library's *_bytes queries; every call's status is checked.
 *
 * Build against the in-tree library (after `cmake -S . -B build && cmake --build build`):
 *   cc -I include examples/quickstart.c -L build -lkdtree -Wl,-rpath,$PWD/build -o quickstart
 * or against an installed one with CMake: examples/CMakeLists.txt. */
#include <stdio.h>
#include <stdlib.h>

#include <kdtree.h>

enum { B = 2, L = 3, K = 2, N = 4, V = 100 };

/* Nonzero (after printing the call and the library's detail) when a call failed. */
static int failed(kdt_status status, const char* call) {
    if (status == KDT_OK) return 0;
    fprintf(stderr, "%s: %s: %s\n", call, kdt_status_string((int32_t)status), kdt_last_error());
    return 1;
}

/* A buffer for one kdt_trees array, sized by kdt_trees_field_bytes; NULL on failure. */
static void* alloc_field(int32_t field) {
    size_t bytes = 0;
    if (failed(kdt_trees_field_bytes(B, N, field, &bytes), "kdt_trees_field_bytes")) return NULL;
    void* buffer = malloc(bytes);
    if (buffer == NULL) fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    return buffer;
}

int main(void) {
    /* The drafter's top-K per position, sorted best first: logprobs[b][d][k] is the
     * natural-log probability of token_ids[b][d][k] at depth d + 1 below the root. */
    const float logprobs[B * L * K] = {-0.1f, -2.5f, -0.2f, -2.0f, -0.3f, -1.9f,   /* request 0 */
                                       -0.5f, -0.9f, -1.0f, -1.2f, -0.7f, -3.0f};  /* request 1 */
    const int32_t token_ids[B * L * K] = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61};
    const int32_t root_tokens[B] = {5, 6};       /* the last committed token of each request */
    const int64_t root_positions[B] = {100, 7};  /* and its position */
    kdt_draft draft = {.batch = B, .depth = L, .width = K, .logprobs = logprobs,
                       .token_ids = token_ids, .root_tokens = root_tokens,
                       .root_positions = root_positions, .vocab_size = V, .pad_token = -1};

    /* The trees: [B, N+1] per node (row 0 is the root), the attention mask [B, N+1, N+1].
     * Arrays left NULL (depths, visibility_bits) are not computed. */
    kdt_trees trees = {.batch = B, .budget = N,
                       .num_nodes = alloc_field(KDT_FIELD_NUM_NODES),
                       .tokens = alloc_field(KDT_FIELD_TOKENS),
                       .parents = alloc_field(KDT_FIELD_PARENTS),
                       .logw = alloc_field(KDT_FIELD_LOGW),
                       .positions = alloc_field(KDT_FIELD_POSITIONS),
                       .visibility = alloc_field(KDT_FIELD_VISIBILITY),
                       .first_child = alloc_field(KDT_FIELD_FIRST_CHILD),
                       .next_sibling = alloc_field(KDT_FIELD_NEXT_SIBLING)};
    int32_t* target_tokens = alloc_field(KDT_FIELD_TOKENS); /* [B, N+1], like tokens */
    int32_t accepted_nodes[B * (L + 1)], accept_length[B], bonus_token[B];
    size_t workspace_bytes = 0;
    void* workspace = NULL;
    int rc = 1;

    if (!trees.num_nodes || !trees.tokens || !trees.parents || !trees.logw || !trees.positions ||
        !trees.visibility || !trees.first_child || !trees.next_sibling || !target_tokens)
        goto done;
    if (failed(kdt_trees_build_workspace_bytes(N, L, K, V, &workspace_bytes),
               "kdt_trees_build_workspace_bytes"))
        goto done;
    if ((workspace = malloc(workspace_bytes)) == NULL) {
        fprintf(stderr, "out of memory (%zu bytes)\n", workspace_bytes);
        goto done;
    }
    if (failed(kdt_trees_build_cpu(&draft, &trees, workspace, workspace_bytes), "kdt_trees_build_cpu"))
        goto done;

    /* The target scores every node in one forward (with the mask and positions above);
     * target_tokens[b][i] is its choice for the token after node i. Stand-in: request 0's
     * target agrees with nodes 1 and 2 and then says 99; request 1's says 55 at the root. */
    for (int i = 0; i < B * (N + 1); i++) target_tokens[i] = 0;
    target_tokens[0 * (N + 1) + 0] = 10;
    target_tokens[0 * (N + 1) + 1] = 20;
    target_tokens[0 * (N + 1) + 2] = 99;
    target_tokens[1 * (N + 1) + 0] = 55;
    if (failed(kdt_verify_greedy_cpu(&trees, target_tokens, NULL, 0, NULL, NULL, L + 1, accepted_nodes,
                                     accept_length, bonus_token),
               "kdt_verify_greedy_cpu"))
        goto done;

    printf("libkdtree %s (ABI %d)\n", kdt_version(), (int)kdt_abi_version());
    for (int b = 0; b < B; b++) {
        printf("request %d: %d draft nodes\n", b, (int)trees.num_nodes[b]);
        printf("  node token parent position    logw first_child next_sibling visible\n");
        for (int i = 0; i <= N; i++) {
            int64_t row = (int64_t)b * (N + 1) + i;
            printf("  %4d %5d %6d %8lld %7.4f %11d %12d ", i, (int)trees.tokens[row],
                   (int)trees.parents[row], (long long)trees.positions[row], trees.logw[row],
                   (int)trees.first_child[row], (int)trees.next_sibling[row]);
            for (int j = 0; j <= N; j++) putchar(trees.visibility[row * (N + 1) + j] ? '1' : '0');
            putchar('\n');
        }
        printf("  accepted:");
        for (int a = 1; a <= accept_length[b]; a++) {
            int32_t node = accepted_nodes[b * (L + 1) + a];
            printf("%s node %d (token %d)", a > 1 ? "," : "", (int)node,
                   (int)trees.tokens[(int64_t)b * (N + 1) + node]);
        }
        if (accept_length[b] == 0) printf(" none");
        if (bonus_token[b] >= 0) printf("; bonus token %d\n", (int)bonus_token[b]);
        else printf("; no bonus token\n");
    }
    rc = 0;

done:
    free(trees.num_nodes);
    free(trees.tokens);
    free(trees.parents);
    free(trees.logw);
    free(trees.positions);
    free(trees.visibility);
    free(trees.first_child);
    free(trees.next_sibling);
    free(target_tokens);
    free(workspace);
    return rc;
}
