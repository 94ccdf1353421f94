#include <shardline/core/context.h>

#include "cuda_backend.h"

namespace shardline {

void Synchronize(Device device) {
#if SHARDLINE_HAVE_CUDA
    if (device.is_cuda()) {
        detail::CudaSynchronize(device.index);
    }
#endif
}

DeviceMemoryStats GetDeviceMemoryStats(Device device) {
    DeviceMemoryStats stats;
#if SHARDLINE_HAVE_CUDA
    if (device.is_cuda()) {
        detail::CudaPoolCounters(device.index, &stats.allocated, &stats.peak_allocated, &stats.reserved,
                                 &stats.peak_reserved);
    }
#endif
    return stats;
}

void ResetPeakDeviceMemory(Device device) {
#if SHARDLINE_HAVE_CUDA
    if (device.is_cuda()) {
        detail::CudaResetPoolPeaks(device.index);
    }
#endif
    (void)device;
}

} // namespace shardline
