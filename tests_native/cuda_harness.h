// Shared by the GPU tests (tests_native/test_*_cuda.cu): fatal checks of CUDA runtime and
// kdtree calls (setup steps, not the assertions under test); when the test defines
// KDT_TEST_SEED before including this header, a seeded xorshift64 generator; when it
// defines KDT_TEST_EXPECT, counted assertions EXPECT / EXPECT_STATUS (`checks`, `failures`);
// set_forced_paths, the command line that forces the library's fallback paths.
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree.h"
#include "../native/kdt_testing.h"

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define KDT_OK_OR_DIE(call)                                                                  \
    do {                                                                                     \
        kdt_status s_ = (call);                                                              \
        if (s_ != KDT_OK) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kdt_last_error()); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

// Forces paths for the whole program through the test entry point (native/kdt_testing.h)
// from its arguments: --paths NAME[,NAME...] (the tree builder's, kdt_testing_tree_path_bit's
// names), --topk-chunked (the top-k's chunk kernels at every k), --verify-cluster N (blocks
// per request of the verify calls from logits). Prints what it set; exits 2 on an argument
// it does not know.
static inline void set_forced_paths(int argc, char** argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--paths") == 0 && i + 1 < argc) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            uint32_t paths = 0;
            for (char* name = strtok(buf, ","); name != NULL; name = strtok(NULL, ",")) {
                const uint32_t bit = kdt_testing_tree_path_bit(name);
                if (bit == 0) {
                    fprintf(stderr, "%s: unknown tree path %s\n", argv[0], name);
                    exit(2);
                }
                paths |= bit;
            }
            KDT_OK_OR_DIE(kdt_testing_set_tree_paths(paths));
            printf("forced tree paths: %s\n", argv[i]);
        } else if (strcmp(argv[i], "--topk-chunked") == 0) {
            KDT_OK_OR_DIE(kdt_testing_set_topk_chunked(1));
            printf("forced: the top-k's chunk kernels at every k\n");
        } else if (strcmp(argv[i], "--verify-cluster") == 0 && i + 1 < argc) {
            const int32_t blocks = (int32_t)atoi(argv[++i]);
            KDT_OK_OR_DIE(kdt_testing_set_verify_cluster(blocks));
            printf("forced: %d blocks per request in the verify calls from logits\n", (int)blocks);
        } else {
            fprintf(stderr, "usage: %s [--paths NAME[,NAME...]] [--topk-chunked] [--verify-cluster 1|2|4|8]\n",
                    argv[0]);
            exit(2);
        }
    }
}

#ifdef KDT_TEST_SEED
static uint64_t rng_state = KDT_TEST_SEED;
static inline uint64_t next_u64() {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
// Uniform integer in [lo, hi].
static inline int64_t uniform(int64_t lo, int64_t hi) { return lo + (int64_t)(next_u64() % (uint64_t)(hi - lo + 1)); }
// Uniform double in [0, 1).
static inline double unit() { return (double)(next_u64() >> 11) / 9007199254740992.0; }
#endif

#ifdef KDT_TEST_EXPECT
static int failures = 0;
static long long checks = 0;

// Counts a check; on failure prints the condition and a formatted detail (first 40 only).
#define EXPECT(cond, ...)                                                           \
    do {                                                                            \
        checks++;                                                                   \
        if (!(cond)) {                                                              \
            if (failures < 40) {                                                    \
                fprintf(stderr, "%s:%d: FAILED (%s): ", __FILE__, __LINE__, #cond); \
                fprintf(stderr, __VA_ARGS__);                                       \
                fprintf(stderr, "\n");                                              \
            }                                                                       \
            failures++;                                                             \
        }                                                                           \
    } while (0)

#define EXPECT_STATUS(call, want)                                                              \
    do {                                                                                       \
        const kdt_status got_ = (call);                                                        \
        EXPECT(got_ == (want), "%s: got %s, expected %s (%s)", #call, kdt_status_string(got_), \
               kdt_status_string(want), kdt_last_error());                                     \
    } while (0)
#endif
