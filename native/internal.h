/* Internal helpers shared by the libkdtree sources. Not part of the ABI. */
#ifndef KDT_INTERNAL_H
#define KDT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kdtree.h"

/* Records a formatted message as this thread's last error and returns `status`. */
kdt_status kdt_fail(kdt_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Clears this thread's last error; returns KDT_OK. */
kdt_status kdt_ok(void);

#if defined(__GNUC__) || defined(__clang__)
#  define KDT_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#  define KDT_UNLIKELY(x) (x)
#endif

/* a * b into *out; returns 0 on overflow of size_t. */
static inline int kdt_mul_size(size_t a, size_t b, size_t* out) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* a + b into *out; returns 0 on overflow of size_t. */
static inline int kdt_add_size(size_t a, size_t b, size_t* out) {
    if (b > SIZE_MAX - a) return 0;
    *out = a + b;
    return 1;
}

#endif /* KDT_INTERNAL_H */
