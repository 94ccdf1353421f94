// The CUDA side of the grouped ops' loop provider: whether a device-size call may read its sizes on the host.

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>

#include "kernels/grouped_internal.h"

namespace shardline::kernels::detail {

bool ComputeStreamCapturing(Device device) {
    CudaContext& ctx = CudaContext::Get(device.index);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(ctx.stream(), &status));
    return status != cudaStreamCaptureStatusNone;
}

} // namespace shardline::kernels::detail
