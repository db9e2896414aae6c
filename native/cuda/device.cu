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
            // The runtime says this both without a driver (a machine with no GPU) and with
            // one too old for it; the driver's version (0: none installed) tells them apart.
            int driver = 0, runtime = 0;
            if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
            if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
            cudaGetLastError();
            if (driver == 0) {
                return kdt_fail(KDT_ERR_NO_DEVICE, "no CUDA GPU or driver found (%s)", cudaGetErrorName(err));
            }
            return kdt_fail(KDT_ERR_NO_DEVICE,
                            "no usable CUDA GPU: the NVIDIA driver supports CUDA %d.%d, this build's runtime needs "
                            "%d.%d (%s)",
                            driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10,
                            cudaGetErrorName(err));
        }
        if (err == cudaErrorNoDevice) {
            return kdt_fail(KDT_ERR_NO_DEVICE, "no CUDA GPU found (%s)", cudaGetErrorName(err));
        }
        return kdt_fail(KDT_ERR_NO_DEVICE, "no usable CUDA GPU: %s (%s)", cudaGetErrorString(err),
                        cudaGetErrorName(err));
    }
    *count = n;
    if (n == 0) return kdt_fail(KDT_ERR_NO_DEVICE, "no CUDA GPU found");
    return kdt_ok();
}
