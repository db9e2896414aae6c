/* Ragged (packed) tree rows on the CPU: kdt_trees_ragged_cpu (kdtree.h). */
#include <string.h>

#include "internal.h"

/* The source field of each requested packed array must be there. */
static kdt_status check_sources(const kdt_trees* t, const kdt_trees_ragged* o) {
    const struct {
        const void* want;
        const void* have;
        const char* name;
    } pairs[] = {{o->tokens, t->tokens, "tokens"},       {o->depths, t->depths, "depths"},
                 {o->parents, t->parents, "parents"},    {o->positions, t->positions, "positions"},
                 {o->visibility_bits, t->visibility_bits, "visibility_bits"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        if (pairs[i].want != NULL && pairs[i].have == NULL) {
            return kdt_fail(KDT_ERR_NULL_POINTER, "trees->%s is NULL but out->%s is requested", pairs[i].name,
                            pairs[i].name);
        }
    }
    return KDT_OK;
}

kdt_status kdt_trees_ragged_cpu(const kdt_trees* trees, kdt_trees_ragged* out) {
    if (trees == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const int64_t B = trees->batch, N = trees->budget, cap = out->capacity;
    if (B < 0 || N < 0 || N > (int64_t)INT32_MAX - 2 || cap < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "trees batch (%lld), budget (%lld) or out->capacity (%lld) out of range",
                        (long long)B, (long long)N, (long long)cap);
    }
    if (out->cu_rows == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out->cu_rows is NULL");
    if (B > 0 && trees->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "trees->num_nodes is NULL");
    kdt_status st = check_sources(trees, out);
    if (st != KDT_OK) return st;
    const size_t rows = (size_t)N + 1u, words = (rows + 31u) / 32u;
    size_t bytes;
    if (!kdt_mul_size((size_t)cap, words * sizeof(uint32_t), &bytes) || !kdt_mul_size((size_t)cap, 8u, &bytes)) {
        return kdt_fail(KDT_ERR_OVERFLOW, "capacity %lld overflows a byte size", (long long)cap);
    }
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int32_t n = trees->num_nodes[b];
        if (n < 0 || n > N) {
            return kdt_fail(KDT_ERR_VALUE, "request %lld: num_nodes %d outside [0, %lld]", (long long)b, (int)n,
                            (long long)N);
        }
        total += (int64_t)n + 1;
    }
    if (total > INT32_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "%lld real rows exceed INT32_MAX (cu_rows is int32)", (long long)total);
    }
    if (total > cap) {
        return kdt_fail(KDT_ERR_BUFFER_TOO_SMALL,
                        "the trees' %lld real rows exceed the capacity %lld (out->capacity; Python: capacity=)",
                        (long long)total, (long long)cap);
    }
    int64_t r = 0;
    out->cu_rows[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = (int64_t)trees->num_nodes[b] + 1;
        const size_t src = (size_t)b * rows;
        for (int64_t i = 0; i < n; i++, r++) {
            if (out->row_request) out->row_request[r] = (int32_t)b;
            if (out->row_node) out->row_node[r] = (int32_t)i;
        }
        r -= n;
        if (out->tokens) memcpy(out->tokens + r, trees->tokens + src, (size_t)n * sizeof(int32_t));
        if (out->depths) memcpy(out->depths + r, trees->depths + src, (size_t)n * sizeof(int32_t));
        if (out->parents) memcpy(out->parents + r, trees->parents + src, (size_t)n * sizeof(int32_t));
        if (out->positions) memcpy(out->positions + r, trees->positions + src, (size_t)n * sizeof(int64_t));
        if (out->visibility_bits) {
            memcpy(out->visibility_bits + (size_t)r * words, trees->visibility_bits + src * words,
                   (size_t)n * words * sizeof(uint32_t));
        }
        r += n;
        out->cu_rows[b + 1] = (int32_t)r;
    }
    /* Filler rows past the real ones. */
    const size_t fill = (size_t)(cap - total);
    for (size_t i = 0; i < fill; i++) {
        const size_t k = (size_t)total + i;
        if (out->row_request) out->row_request[k] = -1;
        if (out->row_node) out->row_node[k] = -1;
        if (out->tokens) out->tokens[k] = -1;
        if (out->parents) out->parents[k] = -1;
        if (out->depths) out->depths[k] = 0;
        if (out->positions) out->positions[k] = 0;
    }
    if (out->visibility_bits && fill > 0) {
        memset(out->visibility_bits + (size_t)total * words, 0, fill * words * sizeof(uint32_t));
    }
    return kdt_ok();
}
