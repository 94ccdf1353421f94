// The grouped ops' kernels that read the group sizes on the device (grouped_kernels.h). Each block first turns the
// sizes into its groups' row ranges itself, so no host code sees a size and a CUDA graph replays them with new sizes.

#include <algorithm>

#include "device_utils.cuh"
#include "grouped_kernels.h"

namespace shardline::kernels::cuda {
namespace {

constexpr int kGroupedThreads = 256;

/// Group e's clamped row range [first, last): the sizes read on the device, negative as 0, clipped to `rows`.
__device__ __forceinline__ void GroupRows(const std::int64_t *sizes, int e, std::int64_t rows, std::int64_t &first,
                                          std::int64_t &last) {
    std::int64_t offset = 0;
    for (int i = 0; i < e; ++i) {
        offset += max(sizes[i], std::int64_t{0});
    }
    first = min(offset, rows);
    last = min(offset + max(sizes[e], std::int64_t{0}), rows);
}

/// blockIdx.y = group; the block's threads stride over the group's rows × cols elements.
template <class T, class B>
__global__ void __launch_bounds__(kGroupedThreads)
    GroupedBiasAddKernel(T *y, std::int64_t rows, std::int64_t cols, std::int64_t ld, const B *bias,
                         std::int64_t bias_group_stride, const std::int64_t *sizes) {
    const int e = static_cast<int>(blockIdx.y);
    __shared__ std::int64_t range[2];
    if (threadIdx.x == 0) {
        GroupRows(sizes, e, rows, range[0], range[1]);
    }
    __syncthreads();
    const std::int64_t first = range[0];
    const std::int64_t elements = (range[1] - first) * cols;
    const B *b = bias + e * bias_group_stride;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kGroupedThreads + threadIdx.x; i < elements;
         i += static_cast<std::int64_t>(gridDim.x) * kGroupedThreads) {
        const std::int64_t r = first + i / cols;
        const std::int64_t j = i % cols;
        T &v = y[r * ld + j];
        v = FromFloat<T>(ToFloat(v) + ToFloat(b[j]));
    }
}

/// blockIdx.y = group, one thread per column: Σ over the group's rows in order (deterministic).
template <class T, class O>
__global__ void __launch_bounds__(kGroupedThreads)
    GroupedColumnSumKernel(const T *dy, std::int64_t rows, std::int64_t cols, const std::int64_t *sizes, O *dbias,
                           bool accumulate) {
    const int e = static_cast<int>(blockIdx.y);
    __shared__ std::int64_t range[2];
    if (threadIdx.x == 0) {
        GroupRows(sizes, e, rows, range[0], range[1]);
    }
    __syncthreads();
    const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kGroupedThreads + threadIdx.x;
    if (j >= cols) {
        return;
    }
    float sum = 0.0f;
    for (std::int64_t r = range[0]; r < range[1]; ++r) {
        sum += ToFloat(dy[r * cols + j]);
    }
    O &out = dbias[e * cols + j];
    out = FromFloat<O>(accumulate ? ToFloat(out) + sum : sum);
}

} // namespace

cudaError_t LaunchGroupedBiasAdd(void *y, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                 const void *bias, DType bias_dtype, std::int64_t bias_group_stride,
                                 const std::int64_t *sizes, int groups, cudaStream_t stream) {
    if (groups <= 0 || groups > 65535 || rows <= 0 || cols <= 0) {
        return groups > 65535 ? cudaErrorInvalidValue : cudaSuccess;
    }
    // Blocks per group for an even split of the rows; a group that is larger strides.
    const std::int64_t per_group = (rows / groups + 1) * cols;
    const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>((per_group + kGroupedThreads - 1) / kGroupedThreads,
                                                                 std::int64_t{1024})),
                    static_cast<unsigned>(groups));
    return WithFloatTypes(dtype, bias_dtype, [&](auto t, auto b) {
        using T = decltype(t);
        using B = decltype(b);
        GroupedBiasAddKernel<T, B><<<grid, kGroupedThreads, 0, stream>>>(
            static_cast<T *>(y), rows, cols, ld, static_cast<const B *>(bias), bias_group_stride, sizes);
        return cudaGetLastError();
    });
}

cudaError_t LaunchGroupedColumnSum(const void *dy, DType dtype, std::int64_t rows, std::int64_t cols,
                                   const std::int64_t *sizes, int groups, void *dbias, DType out_dtype, bool accumulate,
                                   cudaStream_t stream) {
    if (groups <= 0 || groups > 65535 || cols <= 0) {
        return groups > 65535 ? cudaErrorInvalidValue : cudaSuccess;
    }
    const dim3 grid(static_cast<unsigned>((cols + kGroupedThreads - 1) / kGroupedThreads),
                    static_cast<unsigned>(groups));
    return WithFloatTypes(dtype, out_dtype, [&](auto t, auto o) {
        using T = decltype(t);
        using O = decltype(o);
        GroupedColumnSumKernel<T, O><<<grid, kGroupedThreads, 0, stream>>>(static_cast<const T *>(dy), rows, cols,
                                                                           sizes, static_cast<O *>(dbias), accumulate);
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
