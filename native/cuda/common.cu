// Host-side helpers shared by the CUDA entry points.
#include "common.cuh"

namespace kdt {

kdt_status launch_status(const char* what) {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
        // (InsufficientDriver: no driver at all, as on a machine without a GPU, or one older
        // than this build's runtime; kdt_cuda_device_count says which.)
        return kdt_fail(KDT_ERR_NO_DEVICE, "%s: no CUDA GPU or driver found (%s)", what, cudaGetErrorName(err));
    }
    if (err != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s launch failed: %s", what, cudaGetErrorString(err));
    return KDT_OK;
}

kdt_status check_aligned(const void* p, size_t align, const char* name) {
    if (p != NULL && ((uintptr_t)p % align) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s is not aligned to %zu bytes", name, align);
    }
    return KDT_OK;
}

kdt_status check_logits(const kdt_logits* l, const char* name, int64_t expected_batch, int64_t expected_length) {
    if (l == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "%s is NULL", name);
    const size_t esize = float_dtype_size(l->dtype);
    if (esize == 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s->dtype %d is not float32 (%d), float16 (%d) or bfloat16 (%d)",
                        name, (int)l->dtype, KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16, KDT_DTYPE_BFLOAT16);
    }
    if (l->reserved != 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s->reserved must be 0", name);
    if (l->batch < 0 || l->length < 0 || l->vocab < 0 || l->batch_stride < 0 || l->row_stride < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "%s: batch (%lld), length (%lld), vocab (%lld) and strides (%lld, %lld) must be >= 0", name,
                        (long long)l->batch, (long long)l->length, (long long)l->vocab, (long long)l->batch_stride,
                        (long long)l->row_stride);
    }
    if (expected_batch >= 0 && l->batch != expected_batch) {
        return kdt_fail(KDT_ERR_SHAPE, "%s->batch (%lld) != %lld", name, (long long)l->batch,
                        (long long)expected_batch);
    }
    if (expected_length >= 0 && l->length != expected_length) {
        return kdt_fail(KDT_ERR_SHAPE, "%s->length (%lld) != %lld", name, (long long)l->length,
                        (long long)expected_length);
    }
    if (l->batch == 0 || l->length == 0) return KDT_OK;
    if (l->vocab < 1 || l->vocab > INT32_MAX) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s->vocab %lld is outside [1, %d]", name, (long long)l->vocab,
                        INT32_MAX);
    }
    if (l->data == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "%s->data is NULL", name);
    if (((uintptr_t)l->data % esize) != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "%s->data is not aligned to its %zu-byte elements", name, esize);
    }
    // The largest element offset, (B-1)*batch_stride + (L-1)*row_stride + V-1, and its
    // byte offset must fit int64.
    const unsigned __int128 last = (unsigned __int128)(l->batch - 1) * (uint64_t)l->batch_stride +
                                   (unsigned __int128)(l->length - 1) * (uint64_t)l->row_stride +
                                   (uint64_t)(l->vocab - 1);
    if (last * esize > (unsigned __int128)INT64_MAX) {
        return kdt_fail(KDT_ERR_OVERFLOW, "%s: the largest element offset overflows", name);
    }
    return KDT_OK;
}

}  // namespace kdt
