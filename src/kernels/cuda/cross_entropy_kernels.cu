// Cross-entropy kernels (see cross_entropy_kernels.h). A group of threads owns a row: a warp when the shard has few
// classes, the whole 256-thread block otherwise. Each thread walks the row with the group's stride, then the group
// reduces in a fixed order (shuffles, then the warps' results in order), so results are deterministic. No fmt/spdlog
// here: launchers return a cudaError_t.

#include <cmath>
#include <type_traits>

#include "cross_entropy_kernels.h"
#include "device_utils.cuh"

namespace shardline::kernels::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kWarp = 32;
/// Up to this many classes a warp owns a row (8 rows per block); above it the block does.
constexpr std::int64_t kWarpRowClasses = 1024;

/// The max that propagates NaN (fmaxf would drop it), as torch's max.
__device__ __forceinline__ float MaxNan(float a, float b) { return (b > a || isnan(b)) ? b : a; }

struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return MaxNan(a, b); }
};
struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

/// Reduces v over the kGroup threads that own a row; every thread of the group gets the result. `smem` holds
/// kBlock / kWarp floats. With kGroup == kBlock every thread of the block must call it.
template <int kGroup, class Op> __device__ __forceinline__ float GroupReduce(float v, Op op, float *smem) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    if constexpr (kGroup == kWarp) {
        return v;
    } else {
        const int warp = static_cast<int>(threadIdx.x) / kWarp;
        __syncthreads(); // the previous row's readers are done with smem
        if (static_cast<int>(threadIdx.x) % kWarp == 0) {
            smem[warp] = v;
        }
        __syncthreads();
        float r = smem[0];
#pragma unroll
        for (int w = 1; w < kGroup / kWarp; ++w) {
            r = op(r, smem[w]);
        }
        return r;
    }
}

/// The row of this thread's group in the grid-stride loop, its lane in the group, and the stride between rows.
template <int kGroup> struct RowCursor {
    static constexpr int kRowsPerBlock = kBlock / kGroup;
    __device__ static std::int64_t First() {
        return static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + static_cast<int>(threadIdx.x) / kGroup;
    }
    __device__ static std::int64_t Stride() { return static_cast<std::int64_t>(gridDim.x) * kRowsPerBlock; }
    __device__ static int Lane() { return static_cast<int>(threadIdx.x) % kGroup; }
};

// The row loops below run the same number of iterations for every thread of a group (rows are per group), and with
// kGroup == kBlock for the whole block, so GroupReduce's barriers are reached uniformly. With warp groups, the rows
// of a block's warps differ but GroupReduce uses no block barrier.

template <class T, int kGroup>
__global__ void __launch_bounds__(kBlock)
    RowMaxKernel(const T *__restrict__ logits, std::int64_t n, std::int64_t c, float *__restrict__ row_max) {
    __shared__ float smem[kBlock / kWarp];
    using Cursor = RowCursor<kGroup>;
    for (std::int64_t i = Cursor::First(); i < n; i += Cursor::Stride()) {
        const T *row = logits + i * c;
        float m = -INFINITY;
        for (std::int64_t j = Cursor::Lane(); j < c; j += kGroup) {
            m = MaxNan(m, ToFloat(row[j]));
        }
        m = GroupReduce<kGroup>(m, MaxOp{}, smem);
        if (Cursor::Lane() == 0) {
            row_max[i] = m;
        }
    }
}

template <class T, int kGroup>
__global__ void __launch_bounds__(kBlock)
    StatsKernel(const T *__restrict__ logits, std::int64_t n, std::int64_t c, const float *__restrict__ row_max,
                const std::int64_t *__restrict__ labels, std::int64_t class_start, float *__restrict__ sum_exp,
                float *__restrict__ target) {
    __shared__ float smem[kBlock / kWarp];
    using Cursor = RowCursor<kGroup>;
    for (std::int64_t i = Cursor::First(); i < n; i += Cursor::Stride()) {
        const T *row = logits + i * c;
        const float m = row_max[i];
        float s = 0.0f;
        for (std::int64_t j = Cursor::Lane(); j < c; j += kGroup) {
            s += expf(ToFloat(row[j]) - m);
        }
        s = GroupReduce<kGroup>(s, SumOp{}, smem);
        if (Cursor::Lane() == 0) {
            const std::int64_t label = labels[i];
            const bool hit = label >= class_start && label - class_start < c;
            sum_exp[i] = s;
            target[i] = hit ? ToFloat(row[label - class_start]) : 0.0f;
        }
    }
}

// No __restrict__: loss may alias an input (each element is read before it is written, by the same thread).
__global__ void LossKernel(const float *row_max, const float *sum_exp, const float *target, float *loss,
                           std::int64_t n) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        loss[i] = logf(sum_exp[i]) + row_max[i] - target[i];
    }
}

// No __restrict__ on logits/dlogits: they may alias (each element is read before it is written, by the same thread).
template <class T, int kGroup>
__global__ void __launch_bounds__(kBlock)
    BackwardKernel(const T *logits, std::int64_t n, std::int64_t c, const float *__restrict__ row_max,
                   const float *__restrict__ sum_exp, const std::int64_t *__restrict__ labels, std::int64_t class_start,
                   const float *__restrict__ dloss, bool dloss_broadcast, float scale, T *dlogits) {
    using Cursor = RowCursor<kGroup>;
    for (std::int64_t i = Cursor::First(); i < n; i += Cursor::Stride()) {
        const float m = row_max[i];
        const float inv_sum = 1.0f / sum_exp[i];
        const float g = scale * dloss[dloss_broadcast ? 0 : i];
        const std::int64_t label = labels[i];
        const std::int64_t t = label >= class_start && label - class_start < c ? label - class_start : -1;
        const T *row = logits + i * c;
        T *drow = dlogits + i * c;
        for (std::int64_t j = Cursor::Lane(); j < c; j += kGroup) {
            const float p = expf(ToFloat(row[j]) - m) * inv_sum;
            drow[j] = FromFloat<T>(g * (j == t ? p - 1.0f : p));
        }
    }
}

template <int kGroup> int RowBlocks(std::int64_t n) {
    constexpr std::int64_t kRowsPerBlock = kBlock / kGroup;
    const std::int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    return static_cast<int>(blocks < 1 ? 1 : (blocks > 4 * kMaxBlocks ? 4 * kMaxBlocks : blocks));
}

/// Calls f(T{}, std::integral_constant<int, kGroup>{}) for the logits' dtype and the row group that suits c.
template <class F> cudaError_t WithRowKernel(DType dtype, std::int64_t c, F &&f) {
    return WithFloatType(dtype, [&](auto tag) {
        if (c <= kWarpRowClasses) {
            return f(tag, std::integral_constant<int, kWarp>{});
        }
        return f(tag, std::integral_constant<int, kBlock>{});
    });
}

} // namespace

cudaError_t LaunchCrossEntropyRowMax(const void *logits, DType dtype, std::int64_t n, std::int64_t c, float *row_max,
                                     cudaStream_t stream) {
    if (n <= 0 || c <= 0) {
        return cudaSuccess;
    }
    return WithRowKernel(dtype, c, [&](auto tag, auto group) {
        using T = decltype(tag);
        constexpr int kGroup = decltype(group)::value;
        RowMaxKernel<T, kGroup>
            <<<RowBlocks<kGroup>(n), kBlock, 0, stream>>>(static_cast<const T *>(logits), n, c, row_max);
        return cudaGetLastError();
    });
}

cudaError_t LaunchCrossEntropyStats(const void *logits, DType dtype, std::int64_t n, std::int64_t c,
                                    const float *row_max, const std::int64_t *labels, std::int64_t class_start,
                                    float *sum_exp, float *target, cudaStream_t stream) {
    if (n <= 0 || c <= 0) {
        return cudaSuccess;
    }
    return WithRowKernel(dtype, c, [&](auto tag, auto group) {
        using T = decltype(tag);
        constexpr int kGroup = decltype(group)::value;
        StatsKernel<T, kGroup><<<RowBlocks<kGroup>(n), kBlock, 0, stream>>>(
            static_cast<const T *>(logits), n, c, row_max, labels, class_start, sum_exp, target);
        return cudaGetLastError();
    });
}

cudaError_t LaunchCrossEntropyLoss(const float *row_max, const float *sum_exp, const float *target, float *loss,
                                   std::int64_t n, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    LossKernel<<<BlocksFor(n), kThreads, 0, stream>>>(row_max, sum_exp, target, loss, n);
    return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyBackward(const void *logits, DType dtype, std::int64_t n, std::int64_t c,
                                       const float *row_max, const float *sum_exp, const std::int64_t *labels,
                                       std::int64_t class_start, const float *dloss, bool dloss_broadcast, float scale,
                                       void *dlogits, cudaStream_t stream) {
    if (n <= 0 || c <= 0) {
        return cudaSuccess;
    }
    return WithRowKernel(dtype, c, [&](auto tag, auto group) {
        using T = decltype(tag);
        constexpr int kGroup = decltype(group)::value;
        BackwardKernel<T, kGroup><<<RowBlocks<kGroup>(n), kBlock, 0, stream>>>(
            static_cast<const T *>(logits), n, c, row_max, sum_exp, labels, class_start, dloss, dloss_broadcast, scale,
            static_cast<T *>(dlogits));
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
