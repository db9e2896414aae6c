/* Reading the fixtures written by tools/make_fixtures.py (KDTR files; expected values come
 * from the Python reference, never from the code under test). */
#ifndef KDT_TEST_FIXTURE_H
#define KDT_TEST_FIXTURE_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kdtree.h"

/* Opens fixtures/<name>; exits the test with a message if it cannot. */
static inline kdt_kdtr_file* fixture_open(const char* name) {
    char path[1024];
    kdt_kdtr_file* f = NULL;
    snprintf(path, sizeof path, "%s/%s", KDT_FIXTURES_DIR, name);
    if (kdt_kdtr_open(path, &f) != KDT_OK) {
        fprintf(stderr, "cannot open fixture %s: %s\n", path, kdt_last_error());
        exit(1);
    }
    return f;
}

/* The array named by the printf-style format, which must exist with this dtype. */
static inline kdt_kdtr_array fixture_get(const kdt_kdtr_file* f, int32_t dtype, const char* fmt, ...) {
    char name[256];
    kdt_kdtr_array a;
    va_list args;
    va_start(args, fmt);
    vsnprintf(name, sizeof name, fmt, args);
    va_end(args);
    if (kdt_kdtr_find(f, name, &a) != KDT_OK) {
        fprintf(stderr, "fixture array %s: %s\n", name, kdt_last_error());
        exit(1);
    }
    if (a.dtype != dtype) {
        fprintf(stderr, "fixture array %s: dtype %d, expected %d\n", name, a.dtype, dtype);
        exit(1);
    }
    return a;
}

/* A 0-d int64 scalar. */
static inline int64_t fixture_i64(const kdt_kdtr_file* f, const char* fmt, int64_t c, const char* field) {
    char name[256];
    snprintf(name, sizeof name, fmt, (long long)c, field);
    kdt_kdtr_array a = fixture_get(f, KDT_DTYPE_INT64, "%s", name);
    return *(const int64_t*)a.data;
}

/* Number of elements of an array. */
static inline int64_t fixture_numel(const kdt_kdtr_array* a) {
    int64_t n = 1;
    for (int32_t i = 0; i < a->ndim; i++) n *= a->shape[i];
    return n;
}

/* The tree-builder input of case c: logprobs, token_ids and vocab_size, plus root_tokens,
 * root_positions and pad_token when the case has them (zero-size or absent: NULL / -1). */
static inline kdt_draft fixture_draft(const kdt_kdtr_file* f, int64_t c) {
    char name[256];
    kdt_kdtr_array a;
    kdt_draft d;
    memset(&d, 0, sizeof d);
    kdt_kdtr_array lp = fixture_get(f, KDT_DTYPE_FLOAT32, "%lld.logprobs", (long long)c);
    kdt_kdtr_array ids = fixture_get(f, KDT_DTYPE_INT32, "%lld.token_ids", (long long)c);
    d.batch = lp.shape[0];
    d.depth = lp.shape[1];
    d.width = lp.shape[2];
    d.logprobs = (const float*)lp.data;
    d.token_ids = (const int32_t*)ids.data;
    d.vocab_size = fixture_i64(f, "%lld.%s", c, "vocab_size");
    d.pad_token = -1;
    snprintf(name, sizeof name, "%lld.root_tokens", (long long)c);
    if (kdt_kdtr_find(f, name, &a) == KDT_OK && fixture_numel(&a) > 0) d.root_tokens = (const int32_t*)a.data;
    snprintf(name, sizeof name, "%lld.root_positions", (long long)c);
    if (kdt_kdtr_find(f, name, &a) == KDT_OK && fixture_numel(&a) > 0) d.root_positions = (const int64_t*)a.data;
    snprintf(name, sizeof name, "%lld.pad_token", (long long)c);
    if (kdt_kdtr_find(f, name, &a) == KDT_OK) d.pad_token = (int32_t)*(const int64_t*)a.data;
    return d;
}

#endif /* KDT_TEST_FIXTURE_H */
