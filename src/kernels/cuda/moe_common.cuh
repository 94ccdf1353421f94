#pragma once

// Device helpers the mixture-of-experts kernels share (moe_router_kernels.cu, moe_kernels.cu). Included only by nvcc.

#include <cstddef>
#include <cstdint>

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

/// The experts' counts in a block-stride loop over n items: expert_of(i) gives item i's expert, or -1 for none (it may
/// do other per-item work). Counted in a shared-memory histogram per block and flushed with one atomic per expert and
/// block when experts <= kHistogramBins (one global atomic per item on a few count words is the slow form: 15 µs for
/// deepseek-64e's 49k copies on an H100, 2.2 with the histogram); directly in global memory otherwise. Integer sums:
/// order-independent. Launch with at most kHistogramBlocks blocks, so that the flushes stay few.
inline constexpr int kHistogramBins = 1024;
inline constexpr int kHistogramBlocks = 64;

template <class ExpertOf>
__device__ __forceinline__ void CountExperts(std::int64_t n, int experts, unsigned long long *__restrict__ counts,
                                             ExpertOf expert_of) {
    __shared__ unsigned int histogram[kHistogramBins];
    const bool shared = experts <= kHistogramBins;
    if (shared) {
        for (int e = static_cast<int>(threadIdx.x); e < experts; e += static_cast<int>(blockDim.x)) {
            histogram[e] = 0;
        }
        __syncthreads();
    }
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int e = expert_of(i);
        if (e >= 0) {
            if (shared) {
                atomicAdd(histogram + e, 1u);
            } else {
                atomicAdd(counts + e, 1ull);
            }
        }
    }
    if (shared) {
        __syncthreads();
        for (int e = static_cast<int>(threadIdx.x); e < experts; e += static_cast<int>(blockDim.x)) {
            if (histogram[e] != 0) {
                atomicAdd(counts + e, static_cast<unsigned long long>(histogram[e]));
            }
        }
    }
}

} // namespace shardline::kernels::cuda::moe
