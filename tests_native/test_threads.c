/* The CPU entry points called from 8 threads at once: tree build (visibility masks
 * included), greedy verify, top-k log-probs, KDTR save / open / open_memory, and the
 * thread-local kdt_last_error. Every thread checks every result against answers computed
 * before the threads start (checked there against the spec's invariants, computed here
 * independently) and its own error texts, so a data race shows as a wrong value; the
 * sanitizer session (nox -s sanitize) also runs this test under ThreadSanitizer.
 *
 * The harness counters are not thread-safe: worker threads count their own failures and
 * the main thread checks the totals. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "kdtree.h"

enum { THREADS = 8, ITERS = 40, B = 3, L = 5, K = 4, N = 19, V = 61, ROWS = 6 };
#define W ((N + 1 + 31) / 32)

static char g_dir[256];

/* Inputs shared read-only by all threads. */
static float g_logprobs[B * L * K];
static int32_t g_ids[B * L * K];
static int32_t g_roots[B];
static int64_t g_root_pos[B];
static float g_logits[ROWS * V];

/* Reference answers (main thread, before the workers start). */
struct tree_out {
    int32_t num_nodes[B], tokens[B * (N + 1)], depths[B * (N + 1)], parents[B * (N + 1)];
    double logw[B * (N + 1)];
    int64_t positions[B * (N + 1)];
    uint8_t visibility[B * (N + 1) * (N + 1)];
    uint32_t bits[B * (N + 1) * W];
    int32_t first_child[B * (N + 1)], next_sibling[B * (N + 1)];
};
static struct tree_out g_tree;
static int32_t g_target[B * (N + 1)];
static int32_t g_accepted[B * (L + 1)], g_accept_len[B], g_bonus[B];
static float g_top_lp[ROWS * K];
static int32_t g_top_ids[ROWS * K];

static uint32_t lcg(uint32_t* s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static void make_inputs(void) {
    uint32_t s = 12345;
    for (int b = 0; b < B; ++b) {
        g_roots[b] = 50 + b;
        g_root_pos[b] = 7 * b + 3;
        for (int d = 0; d < L; ++d) {
            float* row = g_logprobs + (b * L + d) * K;
            int32_t* ids = g_ids + (b * L + d) * K;
            float v = -(float)(lcg(&s) % 1000) / 1000.0f;
            for (int r = 0; r < K; ++r) {
                row[r] = v;
                ids[r] = (int32_t)((b * 13 + d * 7 + r * 3) % V); /* distinct within a row */
                v -= (float)(lcg(&s) % 700) / 1000.0f;            /* ties (0) allowed */
            }
        }
    }
    for (int i = 0; i < ROWS * V; ++i) g_logits[i] = (float)((int)(lcg(&s) % 2001) - 1000) / 97.0f;
}

static kdt_trees trees_view(struct tree_out* t) {
    kdt_trees out;
    out.batch = B;
    out.budget = N;
    out.num_nodes = t->num_nodes;
    out.tokens = t->tokens;
    out.depths = t->depths;
    out.parents = t->parents;
    out.logw = t->logw;
    out.positions = t->positions;
    out.visibility = t->visibility;
    out.visibility_bits = t->bits;
    out.first_child = t->first_child;
    out.next_sibling = t->next_sibling;
    return out;
}

static kdt_draft draft_view(void) {
    kdt_draft d;
    memset(&d, 0, sizeof d);
    d.batch = B;
    d.depth = L;
    d.width = K;
    d.logprobs = g_logprobs;
    d.token_ids = g_ids;
    d.root_tokens = g_roots;
    d.root_positions = g_root_pos;
    d.vocab_size = V;
    d.pad_token = -1;
    return d;
}

/* The spec's invariants of a built tree, checked independently of the builder: parents
 * before children, depth = parent's + 1 (<= L), positions = root + depth, visibility row
 * = the node and its ancestors (bytes and bits agree), padding rows as specified. */
static void check_tree_invariants(const struct tree_out* t) {
    for (int b = 0; b < B; ++b) {
        const int n = t->num_nodes[b];
        CHECK(n >= 1 && n <= N);
        for (int i = 0; i <= N; ++i) {
            const int row = b * (N + 1) + i;
            const int p = t->parents[row];
            if (i == 0) {
                CHECK_EQ(p, -1);
                CHECK_EQ(t->depths[row], 0);
                CHECK_EQ(t->tokens[row], g_roots[b]);
            } else if (i <= n) {
                CHECK(p >= 0 && p < i);
                CHECK_EQ(t->depths[row], t->depths[b * (N + 1) + p] + 1);
                CHECK(t->depths[row] <= L);
            } else {
                CHECK_EQ(p, -1);
                CHECK_EQ(t->depths[row], 0);
                CHECK_EQ(t->tokens[row], -1);
            }
            CHECK_EQ(t->positions[row], g_root_pos[b] + t->depths[row]);
            for (int j = 0; j <= N; ++j) {
                int want = (j == i);
                if (i <= n) {
                    for (int a = i; a > 0 && !want; a = t->parents[b * (N + 1) + a]) {
                        if (t->parents[b * (N + 1) + a] == j) want = 1;
                    }
                }
                CHECK_EQ(t->visibility[(size_t)row * (N + 1) + j], want);
                CHECK_EQ((t->bits[(size_t)row * W + j / 32] >> (j % 32)) & 1u, (unsigned)want);
            }
        }
    }
}

/* The target's token at each node: the token of its last child (so the walk goes deep),
 * or an id no child has. */
static void make_target(const struct tree_out* t) {
    for (int b = 0; b < B; ++b) {
        for (int i = 0; i <= N; ++i) {
            int32_t tok = V + i;
            for (int c = t->first_child[b * (N + 1) + i]; c > 0; c = t->next_sibling[b * (N + 1) + c]) {
                tok = t->tokens[b * (N + 1) + c];
            }
            g_target[b * (N + 1) + i] = tok;
        }
    }
}

/* Top-k reference in long double: ids by value then lower id, log-probs within 2 ulp. */
static void check_topk(const float* lp, const int32_t* ids) {
    for (int r = 0; r < ROWS; ++r) {
        const float* x = g_logits + r * V;
        long double m = -INFINITY, sum = 0;
        uint8_t used[V];
        memset(used, 0, sizeof used);
        for (int c = 0; c < V; ++c) m = x[c] > m ? x[c] : m;
        for (int c = 0; c < V; ++c) sum += expl((long double)x[c] - m);
        for (int j = 0; j < K; ++j) {
            int best = -1;
            for (int c = 0; c < V; ++c) {
                if (!used[c] && (best < 0 || x[c] > x[best])) best = c;
            }
            used[best] = 1;
            CHECK_EQ(ids[r * K + j], best);
            {
                const long double want = ((long double)x[best] - m) - logl(sum);
                const float got = lp[r * K + j];
                const long double ulp = (long double)(nextafterf(fabsf(got), INFINITY) - fabsf(got));
                CHECK(fabsl((long double)got - want) <= 2.0L * ulp + 1e-12L);
            }
        }
    }
}

/* Field by field (the struct's padding is not output). */
static int same_tree(const struct tree_out* a, const struct tree_out* b) {
#define SAME(field) (memcmp(a->field, b->field, sizeof a->field) == 0)
    return SAME(num_nodes) && SAME(tokens) && SAME(depths) && SAME(parents) && SAME(logw) &&
           SAME(positions) && SAME(visibility) && SAME(bits) && SAME(first_child) &&
           SAME(next_sibling);
#undef SAME
}

struct worker {
    int id;
    int failures;
    char path[320];
};

#define T_CHECK(w, expr)                                                                        \
    do {                                                                                        \
        if (!(expr)) {                                                                          \
            (w)->failures++;                                                                    \
            fprintf(stderr, "%s:%d: thread %d: FAILED: %s\n  last error: %s\n", __FILE__,      \
                    __LINE__, (w)->id, #expr, kdt_last_error());                                \
        }                                                                                       \
    } while (0)

static void* work(void* arg) {
    struct worker* w = (struct worker*)arg;
    struct tree_out* t = (struct tree_out*)malloc(sizeof *t);
    const kdt_draft draft = draft_view();
    size_t ws_bytes = 0;
    void* ws;
    char want_err[64];
    T_CHECK(w, t != NULL);
    if (t == NULL) return NULL;
    T_CHECK(w, kdt_trees_build_workspace_bytes(N, L, K, V, &ws_bytes) == KDT_OK);
    ws = malloc(ws_bytes ? ws_bytes : 1);
    for (int it = 0; it < ITERS; ++it) {
        kdt_trees out = trees_view(t);
        int32_t acc[B * (L + 1)], len[B], bonus[B];
        float lp[ROWS * K];
        int32_t ids[ROWS * K];
        kdt_kdtr_file* f = NULL;
        kdt_kdtr_array arrays[2], got;
        int64_t shape_t[2] = {B, N + 1}, shape_v[1] = {ROWS * V};
        int64_t count = 0;

        /* Tree build (library workspace on odd iterations, the thread's own on even). */
        memset(t, 0xA5, sizeof *t);
        T_CHECK(w, kdt_trees_build_cpu(&draft, &out, (it & 1) ? NULL : ws, ws_bytes) == KDT_OK);
        T_CHECK(w, strcmp(kdt_last_error(), "") == 0);
        T_CHECK(w, same_tree(t, &g_tree));

        /* Greedy verify on the thread's tree. */
        T_CHECK(w, kdt_verify_greedy_cpu(&out, g_target, NULL, 0, NULL, NULL, L + 1, acc, len, bonus) ==
                       KDT_OK);
        T_CHECK(w, memcmp(acc, g_accepted, sizeof acc) == 0);
        T_CHECK(w, memcmp(len, g_accept_len, sizeof len) == 0);
        T_CHECK(w, memcmp(bonus, g_bonus, sizeof bonus) == 0);

        /* Top-k. */
        T_CHECK(w, kdt_topk_logprobs_cpu(g_logits, ROWS, V, V, K, lp, ids) == KDT_OK);
        T_CHECK(w, memcmp(lp, g_top_lp, sizeof lp) == 0);
        T_CHECK(w, memcmp(ids, g_top_ids, sizeof ids) == 0);

        /* KDTR: the thread's own file, written and read back, and the same from memory. */
        arrays[0].name = "tokens";
        arrays[0].dtype = KDT_DTYPE_INT32;
        arrays[0].ndim = 2;
        arrays[0].shape = shape_t;
        arrays[0].data = t->tokens;
        arrays[0].nbytes = sizeof t->tokens;
        arrays[1].name = "logits";
        arrays[1].dtype = KDT_DTYPE_FLOAT32;
        arrays[1].ndim = 1;
        arrays[1].shape = shape_v;
        arrays[1].data = g_logits;
        arrays[1].nbytes = sizeof g_logits;
        T_CHECK(w, kdt_kdtr_save(w->path, arrays, 2) == KDT_OK);
        T_CHECK(w, kdt_kdtr_open(w->path, &f) == KDT_OK);
        if (f != NULL) {
            T_CHECK(w, kdt_kdtr_count(f, &count) == KDT_OK && count == 2);
            T_CHECK(w, kdt_kdtr_find(f, "tokens", &got) == KDT_OK);
            T_CHECK(w, got.nbytes == sizeof t->tokens && memcmp(got.data, g_tree.tokens, got.nbytes) == 0);
            T_CHECK(w, kdt_kdtr_find(f, "logits", &got) == KDT_OK);
            T_CHECK(w, got.nbytes == sizeof g_logits && memcmp(got.data, g_logits, got.nbytes) == 0);

            /* kdt_last_error is per thread: this thread's text survives the others' calls. */
            snprintf(want_err, sizeof want_err, "index %d outside 0..1", 1000 * (w->id + 1) + it);
            T_CHECK(w, kdt_kdtr_get(f, 1000 * (w->id + 1) + it, &got) == KDT_ERR_OUT_OF_RANGE);
            sched_yield();
            T_CHECK(w, strstr(kdt_last_error(), want_err) != NULL);
            kdt_kdtr_close(f);
        }
        {
            /* A NaN at a thread-specific (request, depth): the error names this thread's. */
            float bad[B * L * K];
            kdt_draft d = draft;
            const int rb = w->id % B, rd = (w->id + it) % L;
            memcpy(bad, g_logprobs, sizeof bad);
            bad[(rb * L + rd) * K] = NAN;
            d.logprobs = bad;
            snprintf(want_err, sizeof want_err, "request %d, depth %d, rank 0: NaN", rb, rd + 1);
            T_CHECK(w, kdt_trees_build_cpu(&d, &out, NULL, 0) == KDT_ERR_VALUE);
            sched_yield();
            T_CHECK(w, strstr(kdt_last_error(), want_err) != NULL);
        }
    }
    free(ws);
    free(t);
    unlink(w->path);
    return NULL;
}

int main(void) {
    const char* tmp = getenv("TMPDIR");
    pthread_t threads[THREADS];
    struct worker workers[THREADS];
    kdt_draft draft;
    kdt_trees out;
    snprintf(g_dir, sizeof g_dir, "%s/kdt_threads_XXXXXX", tmp != NULL && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_dir) == NULL) {
        fprintf(stderr, "cannot create a temporary folder under %s\n", g_dir);
        return 1;
    }
    make_inputs();
    draft = draft_view();
    out = trees_view(&g_tree);
    CHECK_OK(kdt_trees_build_cpu(&draft, &out, NULL, 0));
    check_tree_invariants(&g_tree);
    make_target(&g_tree);
    CHECK_OK(kdt_verify_greedy_cpu(&out, g_target, NULL, 0, NULL, NULL, L + 1, g_accepted, g_accept_len,
                                   g_bonus));
    for (int b = 0; b < B; ++b) {
        /* The target follows each node's last child: the path is that chain, to depth L or a
         * leaf; the bonus is the target's token at its end. */
        int node = 0, j = 0;
        CHECK_EQ(g_accepted[b * (L + 1)], 0);
        for (;;) {
            int last = -1;
            for (int c = g_tree.first_child[b * (N + 1) + node]; c > 0; c = g_tree.next_sibling[b * (N + 1) + c]) {
                last = c;
            }
            if (last < 0) break;
            node = last;
            ++j;
            CHECK_EQ(g_accepted[b * (L + 1) + j], node);
        }
        CHECK_EQ(g_accept_len[b], j);
        CHECK(j >= 1);
        CHECK_EQ(g_bonus[b], V + node);
    }
    CHECK_OK(kdt_topk_logprobs_cpu(g_logits, ROWS, V, V, K, g_top_lp, g_top_ids));
    check_topk(g_top_lp, g_top_ids);

    for (int i = 0; i < THREADS; ++i) {
        workers[i].id = i;
        workers[i].failures = 0;
        snprintf(workers[i].path, sizeof workers[i].path, "%s/t%d.kdtr", g_dir, i);
        CHECK_EQ(pthread_create(&threads[i], NULL, work, &workers[i]), 0);
    }
    for (int i = 0; i < THREADS; ++i) {
        CHECK_EQ(pthread_join(threads[i], NULL), 0);
        CHECK_EQ(workers[i].failures, 0);
    }
    rmdir(g_dir);
    HARNESS_EXIT();
}
