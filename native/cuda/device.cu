// Device queries.
#include <cuda_runtime.h>

extern "C" {
#include "internal.h"
}

extern "C" kdt_status kdt_cuda_device_count(int32_t* count) {
    if (count == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "count is NULL");
    *count = 0;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError(); // clear the sticky-free error state of this thread
        if (err == cudaErrorInsufficientDriver) {
            return kdt_fail(KDT_ERR_NO_DEVICE,
                            "no usable CUDA device: no NVIDIA driver found, or one older than this build's CUDA "
                            "runtime needs (%s)", cudaGetErrorString(err));
        }
        return kdt_fail(KDT_ERR_NO_DEVICE, "no usable CUDA device: %s", cudaGetErrorString(err));
    }
    *count = n;
    if (n == 0) return kdt_fail(KDT_ERR_NO_DEVICE, "no CUDA device");
    return kdt_ok();
}
