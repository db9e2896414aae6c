/* The verification walk (spec: ddtree-tree-build.md, "Verification"). */
#include <string.h>

#include "internal.h"

static int is_stop(int32_t token, const int32_t* stop, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        if (stop[i] == token) return 1;
    }
    return 0;
}

/* Checks a kdt_stop_sequences (host arrays) before the walk. */
static kdt_status check_stop_sequences(const kdt_stop_sequences* q) {
    if (q == NULL) return KDT_OK;
    if (q->count < 0 || q->history_length < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "stop_sequences: count (%lld) and history_length (%lld) must be >= 0",
                        (long long)q->count, (long long)q->history_length);
    }
    if (q->count > 0 && (q->offsets == NULL || q->tokens == NULL)) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_sequences->%s is NULL with count %lld",
                        q->offsets == NULL ? "offsets" : "tokens", (long long)q->count);
    }
    if (q->history_length > 0 && q->history == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_sequences->history is NULL with history_length %lld",
                        (long long)q->history_length);
    }
    if (q->count > 0 && q->offsets[0] != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "stop_sequences->offsets[0] is %lld, not 0", (long long)q->offsets[0]);
    }
    for (int64_t i = 0; i < q->count; i++) {
        const int64_t m = q->offsets[i + 1] - q->offsets[i];
        if (m < 1 || m > KDT_MAX_STOP_LENGTH) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "stop sequence %lld has length %lld, outside [1, %d]", (long long)i,
                            (long long)m, KDT_MAX_STOP_LENGTH);
        }
        for (int64_t k = q->offsets[i]; k < q->offsets[i + 1]; k++) {
            if (q->tokens[k] < 0) {
                return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "stop sequence %lld, token %lld: %d is negative", (long long)i,
                                (long long)(k - q->offsets[i]), (int)q->tokens[k]);
            }
        }
    }
    return KDT_OK;
}

/* Whether accepting `want` completes a stop sequence: the stream is the request's history
 * (hist, [H], right-aligned) then the accepted tokens, the last `len` of which (most recent
 * first, at most KDT_MAX_STOP_LENGTH - 1) are in tail. */
static int ends_sequence(const kdt_stop_sequences* q, const int32_t* hist, int32_t want, const int32_t* tail,
                         int64_t len) {
    for (int64_t i = 0; i < q->count; i++) {
        const int64_t hi = q->offsets[i + 1], m = hi - q->offsets[i];
        if (q->tokens[hi - 1] != want) continue;
        int ok = 1;
        for (int64_t k = 1; ok && k < m; k++) {
            int32_t have = -1;
            if (k <= len) {
                have = tail[k - 1];
            } else if (hist != NULL && q->history_length - (k - len) >= 0) {
                have = hist[q->history_length - (k - len)];
            }
            ok = have == q->tokens[hi - 1 - k];
        }
        if (ok) return 1;
    }
    return 0;
}

/* Checks request b's links: num_nodes in range, every link of a real node in range and
 * pointing at a real node, each child list acyclic (bounded by N steps). */
static kdt_status check_tree(const kdt_trees* t, int64_t b) {
    const int64_t N = t->budget;
    const size_t base = (size_t)b * ((size_t)N + 1u);
    const int32_t n = t->num_nodes[b];
    if (n < 0 || n > N) {
        return kdt_fail(KDT_ERR_VALUE, "request %lld: num_nodes %d outside [0, %lld]",
                        (long long)b, (int)n, (long long)N);
    }
    for (int32_t i = 0; i <= n; i++) {
        int32_t fc = t->first_child[base + (size_t)i], ns = t->next_sibling[base + (size_t)i];
        if (fc != -1 && (fc <= i || fc > n)) {
            return kdt_fail(KDT_ERR_VALUE, "request %lld, node %d: first_child %d is not a later node in [1, %d]",
                            (long long)b, (int)i, (int)fc, (int)n);
        }
        if (ns != -1 && (i == 0 || ns <= i || ns > n)) {
            return kdt_fail(KDT_ERR_VALUE, "request %lld, node %d: next_sibling %d is not a later node in [1, %d]",
                            (long long)b, (int)i, (int)ns, (int)n);
        }
    }
    return KDT_OK;
}

kdt_status kdt_verify_greedy_cpu(const kdt_trees* trees, const int32_t* target_tokens,
                                 const int32_t* stop_tokens, int64_t num_stop_tokens,
                                 const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
                                 int64_t path_capacity,
                                 int32_t* accepted_nodes, int32_t* accept_length,
                                 int32_t* bonus_token) {
    int64_t B, N;
    if (trees == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees is NULL");
    B = trees->batch;
    N = trees->budget;
    if (B < 0 || N < 0 || N > (int64_t)INT32_MAX - 2) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "trees batch (%lld) or budget (%lld) out of range",
                        (long long)B, (long long)N);
    }
    if (num_stop_tokens < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "num_stop_tokens %lld is negative",
                        (long long)num_stop_tokens);
    }
    if (path_capacity < 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "path_capacity %lld must be >= 1",
                        (long long)path_capacity);
    }
    {
        const kdt_status sst = check_stop_sequences(stop_sequences);
        if (sst != KDT_OK) return sst;
    }
    const int has_seq = stop_sequences != NULL && stop_sequences->count > 0;
    if (B == 0) return kdt_ok();
    if (trees->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->num_nodes is NULL");
    if (trees->tokens == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->tokens is NULL");
    if (trees->first_child == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->first_child is NULL");
    if (trees->next_sibling == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->next_sibling is NULL");
    if (target_tokens == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "target_tokens is NULL");
    if (num_stop_tokens > 0 && stop_tokens == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "stop_tokens is NULL with num_stop_tokens %lld",
                        (long long)num_stop_tokens);
    }
    if (accepted_nodes == NULL || accept_length == NULL || bonus_token == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL",
                        accepted_nodes == NULL ? "accepted_nodes"
                        : accept_length == NULL ? "accept_length" : "bonus_token");
    }

    /* Pass 1: validate trees, caps and the walks (path lengths) without writing. */
    for (int64_t b = 0; b < B; b++) {
        kdt_status st = check_tree(trees, b);
        if (st != KDT_OK) return st;
        if (max_commit != NULL && max_commit[b] < 0) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "request %lld: max_commit %lld is negative",
                            (long long)b, (long long)max_commit[b]);
        }
    }
    /* The walk runs twice: pass 0 only checks (targets, cycles, path capacity) so that on
     * failure no output is written; pass 1 writes. It is O(depth * width) per request. */
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t b = 0; b < B; b++) {
            const size_t base = (size_t)b * ((size_t)N + 1u);
            const int32_t* tok = trees->tokens + base;
            const int32_t* fc = trees->first_child + base;
            const int32_t* ns = trees->next_sibling + base;
            const int32_t* chosen = target_tokens + base;
            const int32_t n = trees->num_nodes[b];
            const int64_t cap = max_commit != NULL ? max_commit[b] : INT64_MAX;
            int32_t* path = accepted_nodes + (size_t)b * (size_t)path_capacity;
            int64_t len = 0; /* accepted draft nodes */
            int32_t cur = 0, bonus = -1;
            int32_t tail[KDT_MAX_STOP_LENGTH - 1]; /* the last accepted tokens, most recent first */
            const int32_t* hist = has_seq && stop_sequences->history != NULL
                                      ? stop_sequences->history + (size_t)b * (size_t)stop_sequences->history_length
                                      : NULL;
            if (pass == 1) {
                for (int64_t j = 0; j < path_capacity; j++) path[j] = -1;
                path[0] = 0;
            }
            /* Invariant while walking: len + 1 <= cap (room for a bonus after the path). */
            while (cap > 0) {
                int32_t want = chosen[cur], next = -1, steps = 0;
                int stop;
                if (want < 0) {
                    return kdt_fail(KDT_ERR_VALUE, "request %lld, node %d: target token %d is negative",
                                    (long long)b, (int)cur, (int)want);
                }
                for (int32_t c = fc[cur]; c != -1; c = ns[c]) {
                    if (++steps > n) {
                        return kdt_fail(KDT_ERR_VALUE, "request %lld, node %d: child list has a cycle",
                                        (long long)b, (int)cur);
                    }
                    if (tok[c] == want) {
                        next = c;
                        break;
                    }
                }
                if (next < 0) { /* no child matches: the target's token is the bonus */
                    bonus = want;
                    break;
                }
                stop = (num_stop_tokens > 0 && is_stop(want, stop_tokens, num_stop_tokens)) ||
                       (has_seq && ends_sequence(stop_sequences, hist, want, tail, len));
                if (!stop && len + 2 > cap) { /* accepting `next` plus a bonus would pass the cap */
                    bonus = want;
                    break;
                }
                if (len + 2 > path_capacity) {
                    return kdt_fail(KDT_ERR_SHAPE,
                                    "request %lld: accepted path longer than path_capacity - 1 (%lld)",
                                    (long long)b, (long long)(path_capacity - 1));
                }
                if (len >= n) {
                    return kdt_fail(KDT_ERR_VALUE, "request %lld: walk longer than num_nodes (%d): cycle",
                                    (long long)b, (int)n);
                }
                cur = next;
                for (int k = KDT_MAX_STOP_LENGTH - 2; k > 0; k--) tail[k] = tail[k - 1];
                tail[0] = want;
                len++;
                if (pass == 1) path[len] = cur;
                if (stop) break; /* a stop token was accepted: no bonus */
            }
            if (pass == 1) {
                accept_length[b] = (int32_t)len;
                bonus_token[b] = bonus;
            }
        }
    }
    return kdt_ok();
}
