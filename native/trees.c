/* The batched CPU draft-tree builder (spec: ddtree-tree-build.md, "Best-first expansion").
 *
 * For each request: validate the used part [L, K'] of the drafter's top-K, then pop
 * candidates from a binary heap keyed by (-logw, rank path) until N nodes are emitted or
 * the heap is empty. Rank paths are never stored: two candidates with equal scores are
 * ordered by walking both up the emitted tree (O(depth), only on exact score ties). */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "internal.h"
#include "tree_expand.h"

/* Largest budget: node indices are int32 and N + 2 heap slots must fit. */
#define KDT_MAX_BUDGET ((int64_t)INT32_MAX - 2)

/* Per-request scratch carved out of the workspace. */
typedef struct kdt_scratch {
    kdt_expand_scratch x; /* heap [cap + 2] and node tables [cap + 1] (tree_expand.h) */
    uint64_t* hash;      /* [hash_size] duplicate-id set: (stamp << 32) | id */
    size_t hash_size;    /* power of two >= 4 K', or 0 */
    unsigned hash_shift; /* 64 - log2(hash_size): the slot is the top bits of a mixed id */
    uint32_t stamp;      /* marks the entries of the current row; 0 = empty */
    uint8_t* idmap;      /* [vocab] the stamp of the row that last held each id, or NULL */
    size_t idmap_bytes;
    uint8_t map_stamp;   /* this row's stamp in idmap (1..255; 0 = never) */
} kdt_scratch;

/* Duplicate ids are found with a map of one byte per vocabulary id, holding the stamp of
 * the row that last saw the id (cleared once per call and every 255 rows), when a
 * vocabulary is given and the map is small next to the entries checked; else with a hash
 * set. Both give the same answer; the map costs about a third per entry. */
static size_t idmap_bytes_for(int64_t depth, int64_t eff_width, int64_t vocab) {
    if (vocab <= 0 || vocab > ((int64_t)1 << 26) || depth <= 0 || eff_width <= 0) return 0;
    if ((double)vocab > 64.0 * (double)depth * (double)eff_width) return 0;
    return (size_t)vocab;
}

static size_t align8(size_t x) { return (x + 7u) & ~(size_t)7u; }

/* Power of two >= 4 * width (0 when width == 0), or 0 with *ok = 0 on overflow. */
static size_t hash_slots(int64_t width, int* ok) {
    size_t need, slots = 1;
    *ok = 1;
    if (width <= 0) return 0;
    if (!kdt_mul_size((size_t)width, 4u, &need)) {
        *ok = 0;
        return 0;
    }
    while (slots < need) {
        if (slots > SIZE_MAX / 2) {
            *ok = 0;
            return 0;
        }
        slots *= 2;
    }
    return slots;
}

/* The most nodes a tree can hold: min(N, K' + K'^2 + ... + K'^L), so that a huge budget
 * with a narrow or shallow draft does not size the scratch by N. */
static int64_t node_capacity(int64_t budget, int64_t depth, int64_t eff_width) {
    int64_t total = 0, level = 1;
    for (int64_t d = 0; d < depth && total < budget; d++) {
        if (eff_width == 0) break;
        level = level > budget / eff_width ? budget : level * eff_width; /* saturates */
        total = total > budget - level ? budget : total + level;
    }
    return total < budget ? total : budget;
}

/* Bytes of the scratch for budget N, depth L, effective width K' and vocabulary. */
static kdt_status scratch_bytes(int64_t budget, int64_t depth, int64_t eff_width, int64_t vocab,
                                size_t* bytes) {
    size_t rows = (size_t)node_capacity(budget, depth, eff_width) + 1u, heap_bytes, ints, hash_bytes,
           total;
    int ok;
    size_t slots = hash_slots(eff_width, &ok);
    if (!ok || !kdt_mul_size(rows + 1u, sizeof(kdt_cand), &heap_bytes) ||
        !kdt_mul_size(rows, 4u * sizeof(int32_t), &ints) ||
        !kdt_mul_size(slots, sizeof(uint64_t), &hash_bytes)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace size for budget %lld overflows",
                        (long long)budget);
    }
    total = align8(heap_bytes);
    if (!kdt_add_size(total, align8(ints), &total) || !kdt_add_size(total, hash_bytes, &total) ||
        !kdt_add_size(total, idmap_bytes_for(depth, eff_width, vocab), &total) ||
        !kdt_add_size(total, 8u, &total)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace size for budget %lld overflows",
                        (long long)budget);
    }
    *bytes = total;
    return KDT_OK;
}

static void scratch_carve(void* base, int64_t budget, int64_t depth, int64_t eff_width, int64_t vocab,
                          kdt_scratch* s) {
    size_t rows = (size_t)node_capacity(budget, depth, eff_width) + 1u;
    int ok;
    uintptr_t p = ((uintptr_t)base + 7u) & ~(uintptr_t)7u;
    s->x.heap = (kdt_cand*)p;
    p += align8((rows + 1u) * sizeof(kdt_cand));
    s->x.node_rank = (int32_t*)p;
    s->x.node_par = s->x.node_rank + rows;
    s->x.node_depth = s->x.node_par + rows;
    s->x.last_child = s->x.node_depth + rows;
    p += align8(rows * 4u * sizeof(int32_t));
    s->hash = (uint64_t*)p;
    s->hash_size = hash_slots(eff_width, &ok);
    s->hash_shift = 64u;
    for (size_t h = s->hash_size; h > 1u; h >>= 1) s->hash_shift--;
    s->stamp = 0;
    if (s->hash_size > 0) memset(s->hash, 0, s->hash_size * sizeof(uint64_t));
    s->idmap_bytes = idmap_bytes_for(depth, eff_width, vocab);
    s->idmap = s->idmap_bytes > 0 ? (uint8_t*)(s->hash + s->hash_size) : NULL;
    s->map_stamp = 0;
    if (s->idmap) memset(s->idmap, 0, s->idmap_bytes);
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

kdt_status kdt_trees_build_workspace_bytes(int64_t budget, int64_t depth, int64_t width,
                                           int64_t vocab_size, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    if (budget < 0 || depth < 0 || width < 0 || vocab_size < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "budget (%lld), depth (%lld), width (%lld) and vocab_size (%lld) must be >= 0",
                        (long long)budget, (long long)depth, (long long)width, (long long)vocab_size);
    }
    if (budget > KDT_MAX_BUDGET) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld exceeds the maximum %lld",
                        (long long)budget, (long long)KDT_MAX_BUDGET);
    }
    kdt_status st = scratch_bytes(budget, depth, min64(width, budget), vocab_size, bytes);
    return st == KDT_OK ? kdt_ok() : st;
}

kdt_status kdt_visibility_words(int64_t budget, int64_t* words) {
    if (words == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "words is NULL");
    if (budget < 0 || budget > KDT_MAX_BUDGET) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %lld]",
                        (long long)budget, (long long)KDT_MAX_BUDGET);
    }
    *words = (budget + 1 + 31) / 32;
    return kdt_ok();
}

kdt_status kdt_trees_field_bytes(int64_t batch, int64_t budget, int32_t field, size_t* bytes) {
    size_t rows, cells, elem, count;
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    if (batch < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld is negative", (long long)batch);
    }
    if (budget < 0 || budget > KDT_MAX_BUDGET) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %lld]",
                        (long long)budget, (long long)KDT_MAX_BUDGET);
    }
    rows = (size_t)budget + 1u;
    switch (field) {
        case KDT_FIELD_NUM_NODES: cells = 1; elem = 4; break;
        case KDT_FIELD_TOKENS:
        case KDT_FIELD_DEPTHS:
        case KDT_FIELD_PARENTS:
        case KDT_FIELD_FIRST_CHILD:
        case KDT_FIELD_NEXT_SIBLING: cells = rows; elem = 4; break;
        case KDT_FIELD_LOGW:
        case KDT_FIELD_POSITIONS: cells = rows; elem = 8; break;
        case KDT_FIELD_VISIBILITY:
            if (!kdt_mul_size(rows, rows, &cells)) goto overflow;
            elem = 1;
            break;
        case KDT_FIELD_VISIBILITY_BITS:
            if (!kdt_mul_size(rows, (rows + 31u) / 32u, &cells)) goto overflow;
            elem = 4;
            break;
        default:
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "unknown kdt_trees_field %d", (int)field);
    }
    if (!kdt_mul_size((size_t)batch, cells, &count) || !kdt_mul_size(count, elem, bytes)) {
        goto overflow;
    }
    return kdt_ok();
overflow:
    return kdt_fail(KDT_ERR_OVERFLOW, "field %d for batch %lld, budget %lld overflows size_t",
                    (int)field, (long long)batch, (long long)budget);
}

/* ---- Validation -------------------------------------------------------------------- */

/* Checks one row's used part: values (no NaN / +inf, non-increasing, none > 0) then ids
 * (range, duplicates). Depth is reported 1-based (row d is depth d + 1). */
static kdt_status id_range_error(int32_t id, int64_t vocab, int64_t b, int64_t d, int64_t r) {
    if (vocab > 0) {
        return kdt_fail(KDT_ERR_OUT_OF_RANGE,
                        "request %lld, depth %lld, rank %lld: token id %d outside [0, %lld)",
                        (long long)b, (long long)(d + 1), (long long)r, (int)id, (long long)vocab);
    }
    return kdt_fail(KDT_ERR_OUT_OF_RANGE, "request %lld, depth %lld, rank %lld: negative token id %d",
                    (long long)b, (long long)(d + 1), (long long)r, (int)id);
}

static kdt_status duplicate_error(int32_t id, int64_t b, int64_t d, int64_t r) {
    return kdt_fail(KDT_ERR_VALUE, "request %lld, depth %lld, rank %lld: duplicate token id %d in row",
                    (long long)b, (long long)(d + 1), (long long)r, (int)id);
}

/* splitmix64's finaliser: every id bit moves the slot (the top bits are used). */
static inline uint64_t mix_id(int32_t id) {
    uint64_t z = (uint64_t)(uint32_t)id + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int cmp_u64(const void* a, const void* b) {
    uint64_t x = *(const uint64_t*)a, y = *(const uint64_t*)b;
    return (x > y) - (x < y);
}

/* The row's id checks by sorting (id, rank) pairs in the hash table's memory (4 K' slots):
 * the same verdict as the hash (the first rank, in rank order, whose id is out of range or
 * repeats an earlier one). The table is cleared afterwards. */
static kdt_status check_row_by_sort(const int32_t* ids, int64_t eff_width, int64_t vocab, int64_t b,
                                    int64_t d, kdt_scratch* s) {
    uint64_t* pairs = s->hash;
    int64_t first_bad = eff_width;
    for (int64_t r = 0; r < eff_width; r++) {
        int32_t id = ids[r];
        if (id < 0 || (vocab > 0 && (int64_t)id >= vocab)) {
            first_bad = r;
            break;
        }
        pairs[r] = ((uint64_t)(uint32_t)id << 32) | (uint64_t)r;
    }
    qsort(pairs, (size_t)first_bad, sizeof(uint64_t), cmp_u64);
    int64_t first_dup = eff_width;
    for (int64_t i = 1; i < first_bad; i++) {
        if ((pairs[i] >> 32) == (pairs[i - 1] >> 32)) {
            int64_t r = (int64_t)(uint32_t)pairs[i]; /* a later occurrence of this id */
            if (r < first_dup) first_dup = r;
        }
    }
    memset(s->hash, 0, s->hash_size * sizeof(uint64_t));
    s->stamp = 0;
    if (first_dup < first_bad) return duplicate_error(ids[first_dup], b, d, first_dup);
    if (first_bad < eff_width) return id_range_error(ids[first_bad], vocab, b, d, first_bad);
    return KDT_OK;
}

/* Log-probs, not probabilities or raw logits (kdtree.h, kdt_trees_build_cpu): no entry
 * above KDT_LOGPROB_SLACK. A true log-prob is <= 0; float32 rounding of a probability near
 * 1 can leave it a few epsilons above (the GPU top-k's bound is 2e-6 * (1 + |lp|)), so 32
 * epsilons (3.8e-6) are allowed. Probabilities given as log-probs (a row's largest is
 * >= 1 / vocab > 0) or raw logits (the largest is > 0 unless every logit is negative) trip
 * it. Called on a row sorted non-increasing with no NaN, so lp[0] is its largest. */
#define KDT_LOGPROB_SLACK (32.0 * FLT_EPSILON)
static kdt_status check_row_logprob_sign(const float* lp, int64_t b, int64_t d) {
    if ((double)lp[0] > KDT_LOGPROB_SLACK) {
        return kdt_fail(KDT_ERR_VALUE,
                        "request %lld, depth %lld, rank 0: log-probability %.9g > 0 (a probability or a raw "
                        "logit, not a log-probability?)",
                        (long long)b, (long long)(d + 1), (double)lp[0]);
    }
    return KDT_OK;
}

static kdt_status validate_row(const float* lp, const int32_t* ids, int64_t eff_width,
                               int64_t vocab, int64_t b, int64_t d, kdt_scratch* s) {
    /* Fast path: one branch-free pass (vectorisable) decides whether the row is clean; the
     * slow loop below only runs to name the first bad entry. NaN fails every comparison. */
    int bad = !(lp[0] < INFINITY);
    int64_t r = 1;
#if defined(__SSE2__)
    {
        const __m128 inf = _mm_set1_ps(INFINITY);
        __m128 acc = _mm_setzero_ps();
        for (; r + 4 <= eff_width; r += 4) {
            __m128 cur = _mm_loadu_ps(lp + r), prev = _mm_loadu_ps(lp + r - 1);
            /* cmpnle/cmpnlt are true for NaN: unsorted, NaN or +inf all set a lane. */
            acc = _mm_or_ps(acc, _mm_or_ps(_mm_cmpnle_ps(cur, prev), _mm_cmpnlt_ps(cur, inf)));
        }
        bad |= _mm_movemask_ps(acc) != 0;
    }
#endif
    for (; r < eff_width; r++) bad |= !(lp[r] <= lp[r - 1]) | !(lp[r] < INFINITY);
    if (bad) {
        for (r = 0; r < eff_width; r++) {
            float v = lp[r];
            if (isnan(v)) {
                return kdt_fail(KDT_ERR_VALUE, "request %lld, depth %lld, rank %lld: NaN log-probability",
                                (long long)b, (long long)(d + 1), (long long)r);
            }
            if (isinf(v) && v > 0) {
                return kdt_fail(KDT_ERR_VALUE, "request %lld, depth %lld, rank %lld: +inf log-probability",
                                (long long)b, (long long)(d + 1), (long long)r);
            }
            if (r > 0 && v > lp[r - 1]) {
                return kdt_fail(KDT_ERR_VALUE,
                                "request %lld, depth %lld, rank %lld: log-probabilities not sorted "
                                "non-increasing (%.9g after %.9g)",
                                (long long)b, (long long)(d + 1), (long long)r, (double)v,
                                (double)lp[r - 1]);
            }
        }
    }
    {
        const kdt_status sst = check_row_logprob_sign(lp, b, d);
        if (sst != KDT_OK) return sst;
    }
    if (s->idmap) {
        if (++s->map_stamp == 0) {
            memset(s->idmap, 0, s->idmap_bytes);
            s->map_stamp = 1;
        }
        const uint8_t stamp = s->map_stamp;
        uint8_t* const seen = s->idmap;
        for (r = 0; r < eff_width; r++) {
            const int32_t id = ids[r];
            if ((uint32_t)id >= (uint64_t)vocab) return id_range_error(id, vocab, b, d, r);
            if (seen[id] == stamp) return duplicate_error(id, b, d, r);
            seen[id] = stamp;
        }
        return KDT_OK;
    }
    /* Duplicate ids: open addressing on a mixed id; entries of earlier rows carry older
     * stamps, so the table is never cleared between rows. Probing is bounded: ids crafted
     * to collide switch the row to a sort (O(K' log K') whatever the ids). */
    if (++s->stamp == 0) {
        memset(s->hash, 0, s->hash_size * sizeof(uint64_t));
        s->stamp = 1;
    }
    const uint64_t tag = (uint64_t)s->stamp << 32;
    const uint64_t stamp = s->stamp;
    uint64_t* const hash = s->hash;
    const size_t mask = s->hash_size - 1u;
    const unsigned shift = s->hash_shift;
    int64_t probes_left = 16 * eff_width + 64;
    for (r = 0; r < eff_width; r++) {
        int32_t id = ids[r];
        if (id < 0 || (vocab > 0 && (int64_t)id >= vocab)) return id_range_error(id, vocab, b, d, r);
        const uint64_t entry = tag | (uint32_t)id;
        size_t slot = shift >= 64u ? 0u : (size_t)(mix_id(id) >> shift) & mask;
        while ((hash[slot] >> 32) == stamp) {
            if (hash[slot] == entry) return duplicate_error(id, b, d, r);
            slot = (slot + 1u) & mask;
            if (--probes_left < 0) return check_row_by_sort(ids, eff_width, vocab, b, d, s);
        }
        hash[slot] = entry;
    }
    return KDT_OK;
}

/* ---- Building ---------------------------------------------------------------------- */

/* Request b's budget and depth limit (the call's when not given per request). */
static int64_t request_budget(const kdt_draft* draft, const kdt_trees* out, int64_t b) {
    return draft->request_budgets ? (int64_t)draft->request_budgets[b] : out->budget;
}

static int64_t request_depth(const kdt_draft* draft, int64_t b) {
    return draft->request_depths ? (int64_t)draft->request_depths[b] : draft->depth;
}

/* Builds request b into row block b of `out` (all rows rewritten). */
static void build_one(const kdt_draft* draft, kdt_trees* out, int64_t b, kdt_scratch* s) {
    const int64_t K = draft->width, N = out->budget;
    const int64_t Nb = request_budget(draft, out, b), Lb = request_depth(draft, b);
    const int64_t Kp = min64(K, Nb);
    const int64_t L = draft->depth;
    const size_t rows = (size_t)N + 1u;
    const size_t words = (rows + 31u) / 32u;
    const size_t base = (size_t)b * rows;
    const size_t cells = (size_t)b * (size_t)L * (size_t)K;
    uint8_t* vis = out->visibility ? out->visibility + base * rows : NULL;
    uint32_t* bits = out->visibility_bits ? out->visibility_bits + base * words : NULL;
    /* Masks: cleared in one pass; the expansion writes node i's row (its parent's nonzero
     * prefix plus column i); the root and padding rows hold their diagonal only. */
    if (vis) {
        memset(vis, 0, rows * rows);
        vis[0] = 1;
    }
    if (bits) {
        memset(bits, 0, rows * words * sizeof(uint32_t));
        bits[0] = 1u;
    }
    kdt_expand_out o = {
        out->tokens ? out->tokens + base : NULL,       out->depths ? out->depths + base : NULL,
        out->parents ? out->parents + base : NULL,     out->logw ? out->logw + base : NULL,
        out->positions ? out->positions + base : NULL, out->first_child ? out->first_child + base : NULL,
        out->next_sibling ? out->next_sibling + base : NULL, vis, bits, words};
    const int64_t n = kdt_expand_tree(
        draft->logprobs ? draft->logprobs + cells : NULL, draft->token_ids ? draft->token_ids + cells : NULL,
        Lb, K, Kp, N, Nb, node_capacity(Nb, Lb, Kp), draft->root_positions ? draft->root_positions[b] : 0,
        draft->root_tokens ? draft->root_tokens[b] : draft->pad_token, draft->pad_token, &s->x, &o);
    out->num_nodes[b] = (int32_t)n;
    if (vis) {
        for (size_t i = (size_t)n + 1u; i < rows; i++) vis[i * rows + i] = 1;
    }
    if (bits) {
        for (size_t i = (size_t)n + 1u; i < rows; i++) bits[i * words + i / 32u] = 1u << (i % 32u);
    }
}

kdt_status kdt_trees_build_cpu(const kdt_draft* draft, kdt_trees* out, void* workspace,
                               size_t workspace_bytes) {
    kdt_status st;
    size_t need;
    void* owned = NULL;
    kdt_scratch s;
    int64_t B, L, K, N, Kp;

    if (draft == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "draft is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    B = draft->batch;
    L = draft->depth;
    K = draft->width;
    N = out->budget;
    if (B < 0 || L < 0 || K < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "draft batch (%lld), depth (%lld) and width (%lld) must be >= 0",
                        (long long)B, (long long)L, (long long)K);
    }
    if (N < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is negative", (long long)N);
    }
    if (N > KDT_MAX_BUDGET) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld exceeds the maximum %lld",
                        (long long)N, (long long)KDT_MAX_BUDGET);
    }
    if (L > INT32_MAX - 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "depth %lld exceeds %d", (long long)L,
                        INT32_MAX - 1);
    }
    if (draft->vocab_size < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "vocab_size %lld is negative (0 means unchecked)",
                        (long long)draft->vocab_size);
    }
    if (out->batch != B) {
        return kdt_fail(KDT_ERR_SHAPE, "out->batch (%lld) != draft->batch (%lld)",
                        (long long)out->batch, (long long)B);
    }
    if (out->num_nodes == NULL && B > 0) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "out->num_nodes is NULL");
    }
    {
        size_t cells;
        if (!kdt_mul_size((size_t)B, (size_t)L, &cells) || !kdt_mul_size(cells, (size_t)K, &cells)) {
            return kdt_fail(KDT_ERR_OVERFLOW, "draft size B*L*K overflows");
        }
        if (cells > 0 && (draft->logprobs == NULL || draft->token_ids == NULL)) {
            return kdt_fail(KDT_ERR_NULL_POINTER, "draft->%s is NULL",
                            draft->logprobs == NULL ? "logprobs" : "token_ids");
        }
    }
    /* Every non-NULL output must be addressable: check the largest one's size. */
    if (out->visibility != NULL) {
        st = kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &need);
        if (st != KDT_OK) return st;
    }
    Kp = min64(K, N);

    /* Validate everything before writing anything. */
    st = scratch_bytes(N, L, Kp, draft->vocab_size, &need);
    if (st != KDT_OK) return st;
    if (workspace == NULL) {
        owned = malloc(need);
        if (owned == NULL) {
            return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "could not allocate %zu bytes of workspace", need);
        }
        workspace = owned;
    } else if (workspace_bytes < need) {
        return kdt_fail(KDT_ERR_BUFFER_TOO_SMALL, "workspace has %zu bytes, %zu needed",
                        workspace_bytes, need);
    }
    scratch_carve(workspace, N, L, Kp, draft->vocab_size, &s);

    for (int64_t b = 0; b < B; b++) {
        const int64_t Nb = request_budget(draft, out, b), Lb = request_depth(draft, b);
        if (Nb < 0 || Nb > N) {
            st = kdt_fail(KDT_ERR_OUT_OF_RANGE, "request %lld: budget %lld outside [0, %lld] (request_budgets)",
                          (long long)b, (long long)Nb, (long long)N);
            goto done;
        }
        if (Lb < 0 || Lb > L) {
            st = kdt_fail(KDT_ERR_OUT_OF_RANGE, "request %lld: depth %lld outside [0, %lld] (request_depths)",
                          (long long)b, (long long)Lb, (long long)L);
            goto done;
        }
        if (draft->root_positions) {
            int64_t rp = draft->root_positions[b];
            if (rp < 0 || rp > INT64_MAX - Lb) {
                st = kdt_fail(KDT_ERR_OUT_OF_RANGE,
                              "request %lld: root position %lld outside [0, INT64_MAX - depth]",
                              (long long)b, (long long)rp);
                goto done;
            }
        }
        if (draft->root_tokens) {
            int32_t rt = draft->root_tokens[b];
            if (rt < 0 || (draft->vocab_size > 0 && rt >= draft->vocab_size)) {
                st = kdt_fail(KDT_ERR_OUT_OF_RANGE, "request %lld: root token %d outside [0, %lld)",
                              (long long)b, (int)rt,
                              (long long)(draft->vocab_size > 0 ? draft->vocab_size : INT32_MAX));
                goto done;
            }
        }
        const int64_t Kpb = min64(K, Nb);
        for (int64_t d = 0; d < Lb && Kpb > 0; d++) {
            size_t off = ((size_t)b * (size_t)L + (size_t)d) * (size_t)K;
            st = validate_row(draft->logprobs + off, draft->token_ids + off, Kpb, draft->vocab_size,
                              b, d, &s);
            if (st != KDT_OK) goto done;
        }
    }
    for (int64_t b = 0; b < B; b++) build_one(draft, out, b, &s);
    st = kdt_ok();
done:
    free(owned);
    return st;
}
