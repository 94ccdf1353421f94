#pragma once

// Device helpers the mixture-of-experts kernels share (moe_router_kernels.cu, moe_kernels.cu). Included only by nvcc.

#include <cstddef>

#include <cuda_runtime_api.h>

namespace shardline::kernels::cuda::moe {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr std::size_t kAlignment = 256;

inline std::size_t AlignUp(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

/// Butterfly sum: every lane ends with the same value (each step adds the same two operands on both partners), in
/// an order fixed by the lane layout, so reruns give the same bits.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        v += __shfl_xor_sync(kFullMask, v, m);
    }
    return v;
}

} // namespace shardline::kernels::cuda::moe
