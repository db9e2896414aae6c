/* libFuzzer target: kdt_trees_build_cpu and kdt_verify_greedy_cpu against a reference
 * written here straight from /work/shared/spec/ddtree-tree-build.md (docs/spec): a
 * best-first binary heap keyed by (-logw, rank path), scores in the spec's float64
 * operation order, -inf candidates never emitted, padded output. Every output array must be
 * bit-identical, the spec's invariants must hold (parents before children, positions = root
 * + depth, visibility = the node and its ancestors, children in increasing node number),
 * and the greedy walk must match the spec's walk (stop tokens, per-request cap), its
 * accepted path being a path from the root.
 *
 * Input bytes (little-endian; missing bytes read as 0):
 *   0: batch - 1 (mod 2)   1: L (mod 7)   2: K (mod 6)   3: N (mod 25)
 *   4: flags: 1 vocab_size 64 (else 0, unchecked), 2 root tokens, 4 root positions,
 *      8 caller workspace, 16 raw float32 log-probs (else one byte each, quantised so that
 *      ties are common, rows sorted), 32 raw int32 ids (else one byte each, mod 64),
 *      64 max_commit given
 *   5: pad token byte (255: -1)   6: stop token count (mod 3), then one byte each
 *   then per request: root token byte, root position (2 bytes), max_commit byte (mod 8)
 *   then the log-probs, then the ids (B * L * K each), then one target byte per tree row. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree.h"

enum { MAX_B = 2, MAX_L = 6, MAX_K = 5, MAX_N = 24, ROWS = MAX_N + 1, VOCAB = 64 };
#define WORDS ((ROWS + 31) / 32)

struct reader {
    const uint8_t* p;
    size_t n, at;
};

static uint8_t next_byte(struct reader* r) { return r->at < r->n ? r->p[r->at++] : 0; }

static uint32_t next_u32(struct reader* r) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= (uint32_t)next_byte(r) << (8 * i);
    return v;
}

#define FAIL(...)                                                                               \
    do {                                                                                        \
        fprintf(stderr, "fuzz_trees: " __VA_ARGS__);                                            \
        fprintf(stderr, "\n  (last error: %s)\n", kdt_last_error());                            \
        abort();                                                                                \
    } while (0)

/* ---- Reference (spec "Best-first expansion") ----------------------------------------- */

struct cand {
    double logw;
    int depth, rank, parent;
    int path[MAX_L]; /* ranks r1 .. r_depth */
};

/* a pops before b: smaller (-logw, ranks); a proper prefix is smaller than an extension. */
static int before(const struct cand* a, const struct cand* b) {
    const double ka = -a->logw, kb = -b->logw;
    if (ka != kb) return ka < kb;
    for (int i = 0; i < a->depth && i < b->depth; ++i) {
        if (a->path[i] != b->path[i]) return a->path[i] < b->path[i];
    }
    return a->depth < b->depth;
}

struct heap {
    struct cand c[2 * MAX_N + 4];
    int size;
};

static void heap_push(struct heap* h, const struct cand* x) {
    int i = h->size++;
    while (i > 0 && before(x, &h->c[(i - 1) / 2])) {
        h->c[i] = h->c[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->c[i] = *x;
}

static struct cand heap_pop(struct heap* h) {
    struct cand top = h->c[0], last = h->c[--h->size];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, m;
        if (l >= h->size) break;
        m = (l + 1 < h->size && before(&h->c[l + 1], &h->c[l])) ? l + 1 : l;
        if (!before(&h->c[m], &last)) break;
        h->c[i] = h->c[m];
        i = m;
    }
    if (h->size > 0) h->c[i] = last;
    return top;
}

struct ref_tree {
    int32_t num_nodes, tokens[ROWS], depths[ROWS], parents[ROWS], first_child[ROWS],
        next_sibling[ROWS];
    double logw[ROWS];
    int64_t positions[ROWS];
    uint8_t visibility[ROWS * ROWS];
    uint32_t bits[ROWS * WORDS];
};

/* One request: lp/ids are [L][K] (row stride K), N + 1 rows, at most `limit` <= N nodes
 * (the request's own budget), K' = min(K, limit). */
static void ref_build(const float* lp, const int32_t* ids, int L, int K, int N, int limit, int32_t root,
                      int64_t root_pos, int32_t pad, struct ref_tree* t) {
    const int Kp = K < limit ? K : limit;
    struct heap h;
    int n = 0;
    h.size = 0;
    for (int i = 0; i <= N; ++i) {
        t->tokens[i] = i == 0 ? root : pad;
        t->depths[i] = 0;
        t->parents[i] = -1;
        t->logw[i] = i == 0 ? 0.0 : -INFINITY;
        t->first_child[i] = -1;
        t->next_sibling[i] = -1;
    }
    if (L > 0 && Kp > 0) {
        struct cand c0;
        memset(&c0, 0, sizeof c0);
        c0.logw = (double)lp[0];
        c0.depth = 1;
        c0.rank = 0;
        c0.parent = 0;
        c0.path[0] = 0;
        if (c0.logw != -INFINITY) heap_push(&h, &c0);
    }
    while (h.size > 0 && n < limit) {
        const struct cand c = heap_pop(&h);
        const int node = ++n;
        t->tokens[node] = ids[(c.depth - 1) * K + c.rank];
        t->depths[node] = c.depth;
        t->parents[node] = c.parent;
        t->logw[node] = c.logw;
        if (c.rank + 1 < Kp) {
            struct cand s = c;
            const double a = c.logw - (double)lp[(c.depth - 1) * K + c.rank];
            s.logw = a + (double)lp[(c.depth - 1) * K + c.rank + 1];
            s.rank = c.rank + 1;
            s.path[c.depth - 1] = c.rank + 1;
            if (s.logw != -INFINITY) heap_push(&h, &s);
        }
        if (c.depth < L) {
            struct cand ch = c;
            ch.logw = c.logw + (double)lp[c.depth * K];
            ch.depth = c.depth + 1;
            ch.rank = 0;
            ch.parent = node;
            ch.path[c.depth] = 0;
            if (ch.logw != -INFINITY) heap_push(&h, &ch);
        }
    }
    t->num_nodes = n;
    for (int i = 1; i <= n; ++i) { /* children in increasing node number */
        const int p = t->parents[i];
        if (t->first_child[p] < 0) {
            t->first_child[p] = i;
        } else {
            int c = t->first_child[p];
            while (t->next_sibling[c] >= 0) c = t->next_sibling[c];
            t->next_sibling[c] = i;
        }
    }
    memset(t->visibility, 0, sizeof t->visibility);
    memset(t->bits, 0, sizeof t->bits);
    for (int i = 0; i <= N; ++i) {
        t->positions[i] = root_pos + t->depths[i];
        for (int a = i;; a = t->parents[a]) {
            t->visibility[i * (N + 1) + a] = 1;
            t->bits[i * ((N + 1 + 31) / 32) + a / 32] |= 1u << (a % 32);
            if (i > n || a == 0) break;
        }
    }
}

/* Spec "Verification": the walk, then the stop rule and the cap. */
static void ref_verify(const struct ref_tree* t, const int32_t* target, const int32_t* stop,
                       int nstop, int64_t cap, int32_t* path, int32_t* len, int32_t* bonus) {
    int node = 0, k = 0, stopped = 0;
    path[0] = 0;
    for (;;) {
        int next = -1;
        for (int c = 1; c <= t->num_nodes; ++c) {
            if (t->parents[c] == node && t->tokens[c] == target[node]) next = c;
        }
        if (next < 0) break;
        path[++k] = next;
        node = next;
        for (int s = 0; s < nstop; ++s) stopped |= stop[s] == t->tokens[next];
        if (stopped) break;
    }
    *len = k;
    *bonus = stopped ? -1 : target[node];
    if (cap == 0) {
        *len = 0;
        *bonus = -1;
    } else if (k + (stopped ? 0 : 1) > cap) {
        *len = (int32_t)(cap - 1);
        *bonus = target[path[*len]];
    }
}

/* ---- The target ------------------------------------------------------------------------ */

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    struct reader rd = {data, size, 0};
    const int B = 1 + next_byte(&rd) % MAX_B;
    const int L = next_byte(&rd) % (MAX_L + 1);
    const int K = next_byte(&rd) % (MAX_K + 1);
    const int N = next_byte(&rd) % (MAX_N + 1);
    const uint8_t flags = next_byte(&rd);
    const uint8_t pad_byte = next_byte(&rd);
    const int32_t pad = pad_byte == 255 ? -1 : (int32_t)pad_byte;
    const int nstop = next_byte(&rd) % 3;
    const int W = (N + 1 + 31) / 32;
    int32_t stop[2] = {0, 0}, roots[MAX_B], ids[MAX_B * MAX_L * MAX_K];
    int64_t root_pos[MAX_B], caps[MAX_B];
    float lp[MAX_B * MAX_L * MAX_K];
    static struct ref_tree ref[MAX_B];
    int32_t num_nodes[MAX_B], tokens[MAX_B * ROWS], depths[MAX_B * ROWS], parents[MAX_B * ROWS],
        fc[MAX_B * ROWS], ns[MAX_B * ROWS], target[MAX_B * ROWS];
    double logw[MAX_B * ROWS];
    int64_t positions[MAX_B * ROWS];
    static uint8_t vis[MAX_B * ROWS * ROWS];
    uint32_t bits[MAX_B * ROWS * WORDS];
    int expect_value = 0, expect_range = 0;
    int32_t own_n[MAX_B], own_l[MAX_B]; /* per-request budgets and depth limits (flags & 128) */
    kdt_draft draft;
    kdt_trees out;
    kdt_status st;
    void* ws = NULL;
    size_t ws_bytes = 0;

    for (int s = 0; s < nstop; ++s) stop[s] = next_byte(&rd) % VOCAB;
    for (int b = 0; b < B; ++b) {
        roots[b] = next_byte(&rd) % VOCAB;
        root_pos[b] = (int64_t)next_byte(&rd) | ((int64_t)next_byte(&rd) << 8);
        caps[b] = next_byte(&rd) % 8;
    }
    for (int b = 0; b < B; ++b) {
        for (int d = 0; d < L; ++d) {
            float* row = lp + (b * L + d) * K;
            for (int r = 0; r < K; ++r) {
                if (flags & 16) {
                    uint32_t u = next_u32(&rd);
                    memcpy(&row[r], &u, 4);
                } else {
                    const uint8_t q = next_byte(&rd);
                    row[r] = q >= 250 ? -INFINITY : -(float)(q % 50) * 0.375f - (float)(q / 50) * 1e-7f;
                }
            }
            if (!(flags & 16)) { /* sort non-increasing (insertion sort) */
                for (int r = 1; r < K; ++r) {
                    float v = row[r];
                    int j = r;
                    while (j > 0 && row[j - 1] < v) {
                        row[j] = row[j - 1];
                        --j;
                    }
                    row[j] = v;
                }
            }
        }
    }
    for (int i = 0; i < B * L * K; ++i) {
        ids[i] = (flags & 32) ? (int32_t)next_u32(&rd) : (int32_t)(next_byte(&rd) % VOCAB);
    }
    for (int b = 0; b < B; ++b) {
        own_n[b] = (flags & 128) ? next_byte(&rd) % (N + 1) : N;
        own_l[b] = (flags & 128) ? next_byte(&rd) % (L + 1) : L;
    }

    /* What the spec's validation says about each request's used part [L_b][K'_b]. */
    for (int b = 0; b < B; ++b) {
        const int Kpb = K < own_n[b] ? K : own_n[b];
        for (int d = 0; d < own_l[b] && Kpb > 0; ++d) {
            const float* row = lp + (b * L + d) * K;
            const int32_t* id = ids + (b * L + d) * K;
            for (int r = 0; r < Kpb; ++r) {
                if (isnan(row[r]) || row[r] == INFINITY || (r > 0 && row[r] > row[r - 1])) expect_value = 1;
                /* a log-prob above float32 rounding of 0 (32 FLT_EPSILON = 2^-18; kdtree.h) */
                if (r == 0 && row[r] > 0x1p-18f) expect_value = 1;
                if (id[r] < 0 || ((flags & 1) && id[r] >= VOCAB)) expect_range = 1;
                for (int q = 0; q < r; ++q) expect_value |= id[q] == id[r];
            }
        }
    }

    memset(&draft, 0, sizeof draft);
    draft.batch = B;
    draft.depth = L;
    draft.width = K;
    draft.logprobs = lp;
    draft.token_ids = ids;
    draft.root_tokens = (flags & 2) ? roots : NULL;
    draft.root_positions = (flags & 4) ? root_pos : NULL;
    draft.vocab_size = (flags & 1) ? VOCAB : 0;
    draft.pad_token = pad;
    draft.request_budgets = (flags & 128) ? own_n : NULL;
    draft.request_depths = (flags & 128) ? own_l : NULL;
    memset(&out, 0, sizeof out);
    out.batch = B;
    out.budget = N;
    out.num_nodes = num_nodes;
    out.tokens = tokens;
    out.depths = depths;
    out.parents = parents;
    out.logw = logw;
    out.positions = positions;
    out.visibility = vis;
    out.visibility_bits = bits;
    out.first_child = fc;
    out.next_sibling = ns;
    memset(tokens, 0x5A, sizeof tokens); /* garbage the builder must overwrite */
    memset(vis, 0x5A, sizeof vis);
    memset(bits, 0x5A, sizeof bits);
    if (flags & 8) {
        if (kdt_trees_build_workspace_bytes(N, L, K, draft.vocab_size, &ws_bytes) != KDT_OK) {
            FAIL("workspace query failed for N=%d L=%d K=%d", N, L, K);
        }
        ws = malloc(ws_bytes ? ws_bytes : 1);
    }
    st = kdt_trees_build_cpu(&draft, &out, ws, ws_bytes);
    free(ws);
    if (expect_value || expect_range) {
        if (!((expect_value && st == KDT_ERR_VALUE) || (expect_range && st == KDT_ERR_OUT_OF_RANGE))) {
            FAIL("invalid draft (value %d, range %d) gave status %d", expect_value, expect_range, (int)st);
        }
        if (kdt_last_error()[0] == '\0') FAIL("an error without a message");
        return 0;
    }
    if (st != KDT_OK) FAIL("valid draft (B=%d L=%d K=%d N=%d) gave status %d", B, L, K, N, (int)st);

    for (int b = 0; b < B; ++b) {
        const struct ref_tree* t = &ref[b];
        const size_t o = (size_t)b * (N + 1);
        ref_build(lp + b * L * K, ids + b * L * K, own_l[b], K, N, own_n[b], (flags & 2) ? roots[b] : pad,
                  (flags & 4) ? root_pos[b] : 0, pad, &ref[b]);
        if (num_nodes[b] != t->num_nodes) FAIL("request %d: num_nodes %d, reference %d", b, num_nodes[b], t->num_nodes);
#define SAME(arr, field, n)                                                                      \
    if (memcmp(arr + o * (n) / (N + 1), t->field, sizeof(arr[0]) * (n)) != 0)                    \
        FAIL("request %d: %s differs from the reference (B=%d L=%d K=%d N=%d)", b, #field, B, L, K, N)
        SAME(tokens, tokens, N + 1);
        SAME(depths, depths, N + 1);
        SAME(parents, parents, N + 1);
        SAME(logw, logw, N + 1);
        SAME(positions, positions, N + 1);
        SAME(fc, first_child, N + 1);
        SAME(ns, next_sibling, N + 1);
        SAME(vis, visibility, (N + 1) * (N + 1));
        SAME(bits, bits, (N + 1) * W);
#undef SAME
        /* Invariants, independently of the reference's construction. */
        for (int i = 1; i <= t->num_nodes; ++i) {
            const int p = parents[o + i];
            if (p < 0 || p >= i) FAIL("request %d, node %d: parent %d not before it", b, i, p);
            if (depths[o + i] != depths[o + p] + 1 || depths[o + i] > L) FAIL("request %d, node %d: depth", b, i);
            if (positions[o + i] != positions[o] + depths[o + i]) FAIL("request %d, node %d: position", b, i);
            for (int j = 0; j <= N; ++j) {
                int anc = 0;
                for (int a = i; a >= 0; a = a == 0 ? -1 : parents[o + a]) anc |= a == j;
                if (vis[(o + i) * (N + 1) + j] != anc) FAIL("request %d: visibility[%d][%d]", b, i, j);
            }
        }
    }

    /* Greedy verify: targets from the input (mostly a child's token, to walk deep). */
    for (int b = 0; b < B; ++b) {
        for (int i = 0; i <= N; ++i) {
            const uint8_t q = next_byte(&rd);
            int32_t tok = q % VOCAB;
            if (q < 192) {
                int nchild = 0, pick;
                for (int c = fc[b * (N + 1) + i]; c > 0; c = ns[b * (N + 1) + c]) ++nchild;
                if (nchild > 0) {
                    pick = q % nchild;
                    for (int c = fc[b * (N + 1) + i]; c > 0; c = ns[b * (N + 1) + c]) {
                        if (pick-- == 0) tok = tokens[b * (N + 1) + c];
                    }
                }
            }
            target[b * (N + 1) + i] = tok;
        }
    }
    {
        int32_t acc[MAX_B * (MAX_L + 1)], len[MAX_B], bonus[MAX_B];
        int32_t racc[MAX_L + 1], rlen, rbonus;
        const int64_t* cap = (flags & 64) ? caps : NULL;
        st = kdt_verify_greedy_cpu(&out, target, nstop ? stop : NULL, nstop, NULL, cap, L + 1, acc, len, bonus);
        if (st != KDT_OK) FAIL("verify of a built tree gave status %d", (int)st);
        for (int b = 0; b < B; ++b) {
            ref_verify(&ref[b], target + b * (N + 1), stop, nstop, cap ? caps[b] : INT64_MAX, racc, &rlen, &rbonus);
            if (len[b] != rlen || bonus[b] != rbonus) {
                FAIL("request %d: verify length %d bonus %d, reference %d %d", b, len[b], bonus[b], rlen, rbonus);
            }
            for (int j = 0; j <= L; ++j) {
                const int32_t want = j <= rlen ? racc[j] : -1;
                if (acc[b * (L + 1) + j] != want) FAIL("request %d: accepted_nodes[%d]", b, j);
                if (j >= 1 && j <= rlen && parents[b * (N + 1) + want] != racc[j - 1]) {
                    FAIL("request %d: accepted path is not a root path", b);
                }
            }
        }
    }
    return 0;
}
