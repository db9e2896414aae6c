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
    /* An empty batch needs nothing and launches nothing. */
    d.batch = 0;
    t.batch = 0;
    CHECK_OK(kdt_trees_build_cuda(&d, &t, NULL, NULL, 0, NULL));
    HARNESS_EXIT();
}
