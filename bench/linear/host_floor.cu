// The host regime's floor rows (linear_bench.cc): a kernel that does nothing, so that timing its launch gives what one
// runtime launch costs the host on the machine, next to the steps that make several.

#include <cuda_runtime_api.h>

namespace shardline::bench {
namespace {

__global__ void EmptyKernel() {}

} // namespace

cudaError_t LaunchEmptyKernel(cudaStream_t stream) {
    EmptyKernel<<<1, 1, 0, stream>>>();
    return cudaGetLastError();
}

} // namespace shardline::bench
