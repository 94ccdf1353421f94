// The host regime's floor rows (linear_bench.cc): a kernel that does nothing, so that timing its launch gives what one
// runtime launch costs the host on the machine, next to the steps that make several; and the driver's capture query,
// beside the runtime's.

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace shardline::bench {
namespace {

__global__ void EmptyKernel() {}

using DriverQuery = CUresult (*)(CUstream, CUstreamCaptureStatus *);
DriverQuery g_driver_query = nullptr;

int QueryThroughDriver(cudaStream_t stream) {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (g_driver_query(stream, &status) != CUDA_SUCCESS) {
        return -1;
    }
    return status == CU_STREAM_CAPTURE_STATUS_NONE ? 0 : 1;
}

} // namespace

int (*DriverStreamIsCapturing())(cudaStream_t) {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuStreamIsCapturing", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess || fn == nullptr) {
        (void)cudaGetLastError();
        return nullptr;
    }
    g_driver_query = reinterpret_cast<DriverQuery>(fn);
    return &QueryThroughDriver;
}

cudaError_t LaunchEmptyKernel(cudaStream_t stream) {
    EmptyKernel<<<1, 1, 0, stream>>>();
    return cudaGetLastError();
}

} // namespace shardline::bench
