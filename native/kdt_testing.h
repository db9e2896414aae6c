/* Test-only entry points of libkdtree: they force the fallback paths of the CUDA kernels,
 * which the automatic dispatch reaches only for some inputs, so that the tests can run
 * every path on every input. Not part of the API: include/kdtree.h does not declare them,
 * the Python package does not bind them, and they may change with any commit. The
 * shipped library reads no environment variable; these calls are the only way to force a
 * path.
 *
 * Every setting is process-wide: it holds for every later call, from any thread, until it
 * is set again (0 restores the automatic dispatch). Set it while no call that reads it is
 * being made. The outputs are the same on every path; only the speed differs.
 * In a build without CUDA each returns KDT_ERR_UNSUPPORTED. */
#ifndef KDT_TESTING_H
#define KDT_TESTING_H

#include <stddef.h>
#include <string.h>

#include "kdtree.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Paths of kdt_trees_build_cuda (and of the tree half of kdt_trees_build_from_logits_cuda),
 * bits of kdt_testing_set_tree_paths. Dispatch without them: the shared-memory kernel when
 * the request's arrays fit the device's shared memory (else the device-memory heap); in it
 * the threshold descent, then the bisection when the descent gives up (or L > 64), then the
 * heap when the bisection gives up or the order check fails. */
/* The shared-memory heap (one thread), no parallel expansion. */
#define KDT_TESTING_TREES_HEAP 0x01u
/* The bisection of thresholds, without the descent before it. */
#define KDT_TESTING_TREES_BISECT 0x02u
/* The descent's chains resumed one thread per owner at every budget (by default a warp per
 * owner up to N = 512). */
#define KDT_TESTING_TREES_THREAD_CHAINS 0x04u
/* The descent without the walk of first children within a round. */
#define KDT_TESTING_TREES_NO_WALK 0x08u
/* The bitonic sort and the two-round bin thresholds at every size (by default up to 256
 * candidates are ordered, and up to 256 chain heads thresholded, by counting). */
#define KDT_TESTING_TREES_NO_COUNTING 0x10u
/* The device-memory kernel (version 1: validation and heap in global memory). */
#define KDT_TESTING_TREES_GLOBAL_HEAP 0x20u
/* The masks written inside the shared-memory kernel (by default trees from N = 256 get
 * them from a second, wide launch). */
#define KDT_TESTING_TREES_INLINE_MASKS 0x40u
/* kdt_trees_build_from_logits_cuda keeps the duplicate-id check its top-k makes needless. */
#define KDT_TESTING_TREES_CHECK_IDS 0x80u
#define KDT_TESTING_TREES_ALL 0xFFu

/* The KDT_TESTING_TREES_* bit of a path's name ("heap", "bisect", "thread-chains",
 * "no-walk", "no-counting", "global-heap", "inline-masks", "check-ids"), 0 for another name:
 * for the command lines of the test and benchmark programs. */
static inline uint32_t kdt_testing_tree_path_bit(const char* name) {
    static const struct {
        const char* name;
        uint32_t bit;
    } paths[] = {{"heap", KDT_TESTING_TREES_HEAP},
                 {"bisect", KDT_TESTING_TREES_BISECT},
                 {"thread-chains", KDT_TESTING_TREES_THREAD_CHAINS},
                 {"no-walk", KDT_TESTING_TREES_NO_WALK},
                 {"no-counting", KDT_TESTING_TREES_NO_COUNTING},
                 {"global-heap", KDT_TESTING_TREES_GLOBAL_HEAP},
                 {"inline-masks", KDT_TESTING_TREES_INLINE_MASKS},
                 {"check-ids", KDT_TESTING_TREES_CHECK_IDS}};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        if (strcmp(name, paths[i].name) == 0) return paths[i].bit;
    }
    return 0;
}

/* Sets the forced tree paths (an OR of KDT_TESTING_TREES_*; 0: automatic).
 * Returns KDT_ERR_INVALID_ARGUMENT for an unknown bit (nothing set). */
KDT_API kdt_status kdt_testing_set_tree_paths(uint32_t paths);

/* on != 0: kdt_topk_logprobs_cuda takes its chunk kernels at every k (by default only for
 * k > 128). */
KDT_API kdt_status kdt_testing_set_topk_chunked(int32_t on);

/* blocks = 1, 2, 4 or 8: the *_from_logits verify calls use that many blocks per request
 * (more than 1 only on sm_90 and later; elsewhere 1); 0: automatic. Returns
 * KDT_ERR_INVALID_ARGUMENT for another value (nothing set). */
KDT_API kdt_status kdt_testing_set_verify_cluster(int32_t blocks);

/* tiles = 1 or 2: kdt_tree_attention_cuda takes its mma.sync kernel (the one for GPUs
 * without wgmma) and gives each warp that many m16 tiles of query vectors (8 or 4 warps a
 * CTA; head_dim 256 always 1); 0: automatic (2 from 256 query vectors a KV head). Returns
 * KDT_ERR_INVALID_ARGUMENT for another value (nothing set). */
KDT_API kdt_status kdt_testing_set_attention_warp_tiles(int32_t tiles);

/* on != 0: kdt_tree_attention_cuda takes its mma.sync kernel on every device (by default
 * head dims 64 and 128 take the wgmma kernel on sm_90 when the library has sm_90a code). */
KDT_API kdt_status kdt_testing_set_attention_mma_sync(int32_t on);

/* Which wgmma kernel kdt_tree_attention_cuda takes on sm_90 (head dims 64 and 128):
 * 0 (default): the warp-specialized one (a producer warpgroup, two consumer warpgroups
 * taking turns); 1: the one whose two warpgroups load, compute and meet at a CTA-wide
 * barrier every tile. Returns KDT_ERR_INVALID_ARGUMENT for another value (nothing set). */
KDT_API kdt_status kdt_testing_set_attention_sm90(int32_t variant);

/* Which kernel kdt_topk_merge_cuda takes: 0 (default): the merge-path kernel (one block of
 * 1 to 8 warps a row, pairwise merge paths) where two copies of the row's lists fit 48 KB
 * of shared memory, its warps chosen from T and k, else the ranking kernel; 1: the ranking
 * kernel (one block of 256 threads a row, the row's candidates ranked by binary searches in
 * the other lists) always; 2, 3, 4, 5: the merge-path kernel with 1, 2, 4, 8 warps a row
 * (where it fits). All give the same bits. Returns KDT_ERR_INVALID_ARGUMENT for another
 * value (nothing set). */
KDT_API kdt_status kdt_testing_set_topk_merge(int32_t variant);

#ifdef __cplusplus
}
#endif

#endif /* KDT_TESTING_H */
