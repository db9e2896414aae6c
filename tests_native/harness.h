/* A tiny assertion harness for the native tests (one executable per area).
 *
 *   CHECK(expr)        fails the test when expr is false
 *   CHECK_EQ(a, b)     compares two integers (printed as long long)
 *   CHECK_OK(status)   fails unless status == KDT_OK, printing kdt_last_error()
 *   CHECK_STATUS(s, e) fails unless status s == e
 *   CHECK_ERR_HAS(s)   fails unless kdt_last_error() contains the text s
 *
 * Each failure prints the expression, file:line and kdt_last_error(); the test keeps going
 * and main returns non-zero through HARNESS_EXIT(), which also fails a program that ran no
 * check at all (a test that checks nothing proves nothing). */
#ifndef KDT_TEST_HARNESS_H
#define KDT_TEST_HARNESS_H

#include <stdio.h>
#include <string.h>

#include "kdtree.h"

static int harness_failures = 0;
static int harness_checks = 0;

#define HARNESS_FAIL(fmt, ...)                                                              \
    do {                                                                                    \
        harness_failures++;                                                                 \
        fprintf(stderr, "%s:%d: FAILED: " fmt "\n  last error: %s\n", __FILE__, __LINE__,  \
                __VA_ARGS__, kdt_last_error());                                             \
    } while (0)

#define CHECK(expr)                                                                         \
    do {                                                                                    \
        harness_checks++;                                                                   \
        if (!(expr)) HARNESS_FAIL("CHECK(%s)", #expr);                                      \
    } while (0)

#define CHECK_EQ(a, b)                                                                      \
    do {                                                                                    \
        long long harness_a_ = (long long)(a), harness_b_ = (long long)(b);                 \
        harness_checks++;                                                                   \
        if (harness_a_ != harness_b_)                                                       \
            HARNESS_FAIL("CHECK_EQ(%s, %s): %lld != %lld", #a, #b, harness_a_, harness_b_); \
    } while (0)

#define CHECK_STATUS(s, expected)                                                           \
    do {                                                                                    \
        int harness_s_ = (int)(s), harness_e_ = (int)(expected);                            \
        harness_checks++;                                                                   \
        if (harness_s_ != harness_e_)                                                       \
            HARNESS_FAIL("CHECK_STATUS(%s, %s): got %s, expected %s", #s, #expected,        \
                         kdt_status_string(harness_s_), kdt_status_string(harness_e_));     \
    } while (0)

#define CHECK_OK(s) CHECK_STATUS(s, KDT_OK)

#define CHECK_ERR_HAS(text)                                                                 \
    do {                                                                                    \
        harness_checks++;                                                                   \
        if (strstr(kdt_last_error(), (text)) == NULL)                                       \
            HARNESS_FAIL("last error does not contain \"%s\"", (text));                     \
    } while (0)

#define HARNESS_EXIT()                                                                      \
    do {                                                                                    \
        printf("%d checks, %d failed\n", harness_checks, harness_failures);                \
        if (harness_checks == 0) fprintf(stderr, "FAILED: no checks ran\n");                \
        return harness_failures == 0 && harness_checks > 0 ? 0 : 1;                         \
    } while (0)

#endif /* KDT_TEST_HARNESS_H */
