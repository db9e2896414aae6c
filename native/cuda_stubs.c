/* The CUDA entry points of a build without CUDA: each says so. */
#include "internal.h"

static kdt_status no_cuda(const char* what) {
    return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: this libkdtree was built without CUDA (KDTREE_CUDA=OFF or no nvcc)",
                    what);
}

kdt_status kdt_cuda_device_count(int32_t* count) {
    if (count != NULL) *count = 0;
    return no_cuda("kdt_cuda_device_count");
}

kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth, int64_t width,
                                                size_t* bytes) {
    (void)batch;
    (void)budget;
    (void)depth;
    (void)width;
    (void)bytes;
    return no_cuda("kdt_trees_build_cuda_workspace_bytes");
}

kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status, void* workspace,
                                size_t workspace_bytes, void* stream) {
    (void)draft;
    (void)out;
    (void)request_status;
    (void)workspace;
    (void)workspace_bytes;
    (void)stream;
    return no_cuda("kdt_trees_build_cuda");
}
