// The test-only settings of native/kdt_testing.h: process-wide, read by the launchers
// with one relaxed atomic load per call.
#include <atomic>

#include "common.cuh"
#include "kdt_testing.h"

namespace {
std::atomic<uint32_t> g_tree_paths{0};
std::atomic<int32_t> g_topk_chunked{0};
std::atomic<int32_t> g_verify_cluster{0};
std::atomic<int32_t> g_attention_warp_tiles{0};
std::atomic<int32_t> g_attention_mma_sync{0};
std::atomic<int32_t> g_attention_sm90{0};
std::atomic<int32_t> g_topk_merge{0};
}  // namespace

uint32_t kdt::testing_tree_paths() { return g_tree_paths.load(std::memory_order_relaxed); }
bool kdt::testing_topk_chunked() { return g_topk_chunked.load(std::memory_order_relaxed) != 0; }
int kdt::testing_verify_cluster() { return g_verify_cluster.load(std::memory_order_relaxed); }
int kdt::testing_attention_warp_tiles() { return g_attention_warp_tiles.load(std::memory_order_relaxed); }
bool kdt::testing_attention_mma_sync() { return g_attention_mma_sync.load(std::memory_order_relaxed) != 0; }
int kdt::testing_attention_sm90() { return g_attention_sm90.load(std::memory_order_relaxed); }
int kdt::testing_topk_merge() { return g_topk_merge.load(std::memory_order_relaxed); }

extern "C" kdt_status kdt_testing_set_tree_paths(uint32_t paths) {
    if ((paths & ~KDT_TESTING_TREES_ALL) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "tree paths 0x%x: unknown bits 0x%x", paths,
                        paths & ~KDT_TESTING_TREES_ALL);
    }
    g_tree_paths.store(paths, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_topk_chunked(int32_t on) {
    g_topk_chunked.store(on != 0 ? 1 : 0, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_verify_cluster(int32_t blocks) {
    if (blocks != 0 && blocks != 1 && blocks != 2 && blocks != 4 && blocks != 8) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "verify cluster %d: expected 0, 1, 2, 4 or 8", (int)blocks);
    }
    g_verify_cluster.store(blocks, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_attention_warp_tiles(int32_t tiles) {
    if (tiles != 0 && tiles != 1 && tiles != 2) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "attention warp tiles %d: expected 0, 1 or 2", (int)tiles);
    }
    g_attention_warp_tiles.store(tiles, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_attention_mma_sync(int32_t on) {
    g_attention_mma_sync.store(on != 0 ? 1 : 0, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_attention_sm90(int32_t variant) {
    if (variant != 0 && variant != 1) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "attention sm90 variant %d: expected 0 or 1", (int)variant);
    }
    g_attention_sm90.store(variant, std::memory_order_relaxed);
    return kdt_ok();
}

extern "C" kdt_status kdt_testing_set_topk_merge(int32_t variant) {
    if (variant < 0 || variant > 5) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "top-k merge variant %d: expected 0 to 5", (int)variant);
    }
    g_topk_merge.store(variant, std::memory_order_relaxed);
    return kdt_ok();
}
