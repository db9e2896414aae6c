/* libFuzzer target: the KDTR reader (kdt_kdtr_open_memory, kdt_kdtr_count / get / find,
 * docs/kdtr-format.md). Any input must be accepted or rejected with KDT_ERR_FORMAT or
 * KDT_ERR_UNSUPPORTED and a message; an accepted file must satisfy the format's rules as
 * seen through the API (names valid and unique and found by kdt_kdtr_find, nbytes =
 * itemsize * shape product, data 64-byte aligned and readable). fuzz/kdtr_diff.py then runs
 * every corpus and crash file through both this reader and the Python one and compares
 * them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree.h"

#define FAIL(...)                                                                               \
    do {                                                                                        \
        fprintf(stderr, "fuzz_kdtr: " __VA_ARGS__);                                             \
        fprintf(stderr, "\n  (last error: %s)\n", kdt_last_error());                            \
        abort();                                                                                \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    kdt_kdtr_file* f = NULL;
    int64_t count = -1;
    volatile unsigned sink = 0;
    const kdt_status st = kdt_kdtr_open_memory(data, size, &f);
    if (st != KDT_OK) {
        if (st != KDT_ERR_FORMAT && st != KDT_ERR_UNSUPPORTED) FAIL("status %d", (int)st);
        if (f != NULL) FAIL("a failed open returned a file");
        if (kdt_last_error()[0] == '\0') FAIL("an error without a message");
        return 0;
    }
    if (kdt_kdtr_count(f, &count) != KDT_OK || count < 0) FAIL("count");
    for (int64_t i = 0; i < count; ++i) {
        kdt_kdtr_array a, b;
        size_t item = 0;
        uint64_t product = 1;
        int zero = 0;
        if (kdt_kdtr_get(f, i, &a) != KDT_OK) FAIL("get %lld", (long long)i);
        if (a.name == NULL || a.name[0] == '\0' || strlen(a.name) > 65535) FAIL("array %lld: name", (long long)i);
        if (kdt_dtype_size(a.dtype, &item) != KDT_OK) FAIL("array %lld: dtype %d", (long long)i, (int)a.dtype);
        if (a.ndim < 0 || a.ndim > KDT_KDTR_MAX_NDIM || (a.ndim > 0 && a.shape == NULL)) FAIL("ndim");
        for (int32_t d = 0; d < a.ndim; ++d) {
            if (a.shape[d] < 0) FAIL("array %lld: negative extent", (long long)i);
            if (a.shape[d] == 0) zero = 1;
            else product *= (uint64_t)a.shape[d];
        }
        product *= item;
        if (a.nbytes != (zero ? 0 : product)) FAIL("array %lld: nbytes %llu", (long long)i, (unsigned long long)a.nbytes);
        if (((uintptr_t)a.data % 64) != 0) FAIL("array %lld: data not 64-byte aligned", (long long)i);
        for (uint64_t j = 0; j < a.nbytes; ++j) sink += ((const unsigned char*)a.data)[j];
        if (kdt_kdtr_find(f, a.name, &b) != KDT_OK || b.data != a.data) {
            FAIL("array %lld ('%s') not found by name", (long long)i, a.name);
        }
    }
    {
        kdt_kdtr_array a;
        if (kdt_kdtr_get(f, count, &a) != KDT_ERR_OUT_OF_RANGE) FAIL("get past the end");
    }
    kdt_kdtr_close(f);
    (void)sink;
    return 0;
}
