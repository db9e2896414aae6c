/* The CUDA entry points' host-side contract, checked on every machine (no GPU needed):
 * device counting, and the argument checks kdt_trees_build_cuda makes before it touches
 * the device. In a build without CUDA every entry point returns KDT_ERR_UNSUPPORTED. */
#include <stdint.h>
#include <string.h>

#include "harness.h"

int main(void) {
    int32_t count = -1;
    kdt_status st = kdt_cuda_device_count(&count);
    CHECK(st == KDT_OK || st == KDT_ERR_NO_DEVICE || st == KDT_ERR_UNSUPPORTED);
    if (st == KDT_OK) {
        CHECK(count > 0);
    } else {
        CHECK_EQ(count, 0);
        CHECK(strlen(kdt_last_error()) > 0); /* says why */
    }
    CHECK_STATUS(kdt_cuda_device_count(NULL), st == KDT_ERR_UNSUPPORTED ? KDT_ERR_UNSUPPORTED : KDT_ERR_NULL_POINTER);

    kdt_draft d;
    kdt_trees t;
    memset(&d, 0, sizeof d);
    memset(&t, 0, sizeof t);
    float lp[6] = {-0.1f, -1.0f, -2.0f, -0.2f, -1.5f, -3.0f};
    int32_t ids[6] = {1, 2, 3, 4, 5, 6};
    int32_t num[1], status[1];
    d.batch = 1;
    d.depth = 2;
    d.width = 3;
    d.logprobs = lp; /* never dereferenced: every call below fails its host-side checks */
    d.token_ids = ids;
    d.pad_token = -1;
    t.batch = 1;
    t.budget = 4;
    t.num_nodes = num;
    size_t ws = 0;
    if (st == KDT_ERR_UNSUPPORTED) {
        CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_UNSUPPORTED);
        CHECK_ERR_HAS("without CUDA");
        CHECK_STATUS(kdt_trees_build_cuda_workspace_bytes(1, 4, 2, 3, &ws), KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_topk_logprobs_cuda_workspace_bytes(1, 10, 2, &ws), KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_topk_logprobs_cuda(NULL, 1, NULL, NULL, NULL, NULL, 0, NULL), KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda_workspace_bytes(1, 4, 2, 10, 3, &ws), KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(NULL, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_tree_attention_mask_cuda(&t, NULL, 0, 8, NULL, 0, NULL, NULL, status, NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_verify_greedy_cuda(&t, NULL, NULL, 0, NULL, NULL, 3, NULL, NULL, NULL, status, NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_verify_greedy_from_logits_cuda(&t, NULL, NULL, 0, NULL, NULL, 3, NULL, NULL, NULL, NULL, status,
                                                        NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_verify_sample_from_logits_cuda(&t, NULL, 1.0f, 1, 2, NULL, 0, NULL, NULL, 3, NULL, NULL, NULL, NULL,
                                                        status, NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_verify_sample_batch_cuda(&t, NULL, NULL, NULL, 0, NULL, NULL, 3, NULL, NULL, NULL, NULL, status,
                                                  NULL),
                     KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_compact_kv_cuda(NULL, NULL, NULL, NULL, 3, status, NULL), KDT_ERR_UNSUPPORTED);
        CHECK_STATUS(kdt_topk_shard_stats_cuda(NULL, NULL, NULL, NULL), KDT_ERR_UNSUPPORTED);
        CHECK_ERR_HAS("without CUDA");
        HARNESS_EXIT();
    }
    CHECK_OK(kdt_trees_build_cuda_workspace_bytes(1, 4, 2, 3, &ws));
    CHECK(ws > 0 && ws % 256 == 0);
    size_t ws2 = 0;
    CHECK_OK(kdt_trees_build_cuda_workspace_bytes(3, 4, 2, 3, &ws2));
    CHECK_EQ(ws2, 3 * ws); /* per request */
    CHECK_STATUS(kdt_trees_build_cuda_workspace_bytes(-1, 4, 2, 3, &ws2), KDT_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(kdt_trees_build_cuda_workspace_bytes(1, 4, 2, 3, NULL), KDT_ERR_NULL_POINTER);

    CHECK_STATUS(kdt_trees_build_cuda(NULL, &t, status, NULL, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_trees_build_cuda(&d, NULL, status, NULL, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, NULL, NULL, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("request_status");
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("workspace");
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, (void*)(uintptr_t)4096, ws - 1, NULL), KDT_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, (void*)(uintptr_t)4100, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
    CHECK_ERR_HAS("aligned");
    t.batch = 2;
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_SHAPE);
    t.batch = 1;
    t.budget = -1;
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_INVALID_ARGUMENT);
    t.budget = 4;
    d.vocab_size = -3;
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_INVALID_ARGUMENT);
    d.vocab_size = 0;
    d.logprobs = NULL;
    CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, NULL, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_ERR_HAS("logprobs");
    /* Trees from logits: the host-side checks (no device memory is touched). */
    {
        uint16_t fake_logits[64];
        kdt_logits lg;
        memset(&lg, 0, sizeof lg);
        lg.data = fake_logits;
        lg.dtype = KDT_DTYPE_BFLOAT16;
        lg.batch = 1;
        lg.length = 2;
        lg.vocab = 10;
        lg.batch_stride = 20;
        lg.row_stride = 10;
        size_t need = 0;
        CHECK_OK(kdt_trees_build_from_logits_cuda_workspace_bytes(1, 4, 2, 10, 3, &need));
        CHECK(need > 0 && need % 256 == 0);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda_workspace_bytes(1, 4, 2, 10, 11, &need), KDT_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda_workspace_bytes(1, 4, 2, 2000, 1025, &need),
                     KDT_ERR_INVALID_ARGUMENT);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda_workspace_bytes(1, 4, 2, 10, 3, NULL), KDT_ERR_NULL_POINTER);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(NULL, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_NULL_POINTER);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, NULL, status, NULL, 0, NULL),
                     KDT_ERR_NULL_POINTER);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_NULL_POINTER);
        CHECK_ERR_HAS("workspace");
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, (void*)(uintptr_t)4096,
                                                      need - 1, NULL),
                     KDT_ERR_BUFFER_TOO_SMALL);
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 11, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        CHECK_ERR_HAS("width");
        /* A shard's row statistics: the host-side checks. */
        {
            float smax[2];
            double srest[2];
            CHECK_STATUS(kdt_topk_shard_stats_cuda(NULL, smax, srest, NULL), KDT_ERR_NULL_POINTER);
            CHECK_STATUS(kdt_topk_shard_stats_cuda(&lg, NULL, srest, NULL), KDT_ERR_NULL_POINTER);
            CHECK_ERR_HAS("out_max");
            CHECK_STATUS(kdt_topk_shard_stats_cuda(&lg, smax, NULL, NULL), KDT_ERR_NULL_POINTER);
            CHECK_ERR_HAS("out_rest");
            CHECK_STATUS(kdt_topk_shard_stats_cuda(&lg, smax, (double*)((char*)srest + 4), NULL),
                         KDT_ERR_INVALID_ARGUMENT);
            CHECK_ERR_HAS("out_rest");
            CHECK_ERR_HAS("aligned");
            lg.length = 0; /* no rows: nothing to do, nothing checked past the description */
            CHECK_OK(kdt_topk_shard_stats_cuda(&lg, NULL, NULL, NULL));
            lg.length = 2;
            lg.dtype = KDT_DTYPE_INT32;
            CHECK_STATUS(kdt_topk_shard_stats_cuda(&lg, smax, srest, NULL), KDT_ERR_INVALID_ARGUMENT);
            CHECK_ERR_HAS("dtype");
            lg.dtype = KDT_DTYPE_BFLOAT16;
        }
        lg.dtype = KDT_DTYPE_INT32;
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        CHECK_ERR_HAS("dtype");
        lg.dtype = KDT_DTYPE_FLOAT16;
        lg.reserved = 1;
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        lg.reserved = 0;
        lg.data = (const char*)fake_logits + 1; /* misaligned */
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        CHECK_ERR_HAS("aligned");
        lg.data = fake_logits;
        lg.row_stride = -1;
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        lg.row_stride = INT64_MAX / 2;
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, NULL, 0, NULL),
                     KDT_ERR_OVERFLOW);
        lg.row_stride = 10;
        /* Tree-side arguments are checked before anything is launched. */
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, NULL, (void*)(uintptr_t)4096, need,
                                                      NULL),
                     KDT_ERR_NULL_POINTER);
        CHECK_ERR_HAS("request_status");
        t.logw = (double*)(uintptr_t)4100; /* misaligned float64 output */
        CHECK_STATUS(kdt_trees_build_from_logits_cuda(&lg, 3, NULL, NULL, NULL, NULL, -1, &t, status, (void*)(uintptr_t)4096, need,
                                                      NULL),
                     KDT_ERR_INVALID_ARGUMENT);
        CHECK_ERR_HAS("out->logw");
        d.logprobs = lp;
        CHECK_STATUS(kdt_trees_build_cuda(&d, &t, status, (void*)(uintptr_t)4096, ws, NULL), KDT_ERR_INVALID_ARGUMENT);
        CHECK_ERR_HAS("aligned");
        d.logprobs = NULL;
        t.logw = NULL;
        /* An empty batch is a no-op, as the workspace query (0 bytes) promises. */
        kdt_logits empty;
        memset(&empty, 0, sizeof empty);
        empty.dtype = KDT_DTYPE_FLOAT32;
        empty.length = 3;
        kdt_trees none;
        memset(&none, 0, sizeof none);
        none.budget = 5;
        CHECK_OK(kdt_trees_build_from_logits_cuda_workspace_bytes(0, 5, 3, 0, 0, &need));
        CHECK_EQ(need, 0);
        CHECK_OK(kdt_trees_build_from_logits_cuda(&empty, 0, NULL, NULL, NULL, NULL, -1, &none, NULL, NULL, 0, NULL));
    }
    /* An empty batch needs nothing and launches nothing. */
    d.batch = 0;
    t.batch = 0;
    CHECK_OK(kdt_trees_build_cuda(&d, &t, NULL, NULL, 0, NULL));
    HARNESS_EXIT();
}
