// Core's device kernels: counter-based random fill, constant fill, dtype cast and strided copy. No fmt/spdlog here
// (see CMakeLists.txt): launchers return the launch status and core's host code checks it.

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../philox.h"
#include "core_kernels.h"

namespace shardline::detail::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops: enough blocks to fill any current GPU several times over, few enough that tiny tensors launch
// tiny grids.
constexpr std::int64_t kMaxBlocks = 8192;

int BlocksFor(std::int64_t n) {
    return static_cast<int>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Rounding identical to host_convert.h StoreFromDouble: double → float (nearest even) → half type (nearest even).
template <class T> __device__ __forceinline__ T FromDouble(double v);
template <> __device__ __forceinline__ double FromDouble<double>(double v) { return v; }
template <> __device__ __forceinline__ float FromDouble<float>(double v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ __half FromDouble<__half>(double v) {
    return __float2half_rn(static_cast<float>(v));
}
template <> __device__ __forceinline__ __nv_bfloat16 FromDouble<__nv_bfloat16>(double v) {
    return __float2bfloat16_rn(static_cast<float>(v));
}
// Truncation toward zero, as on the host. A kernel cannot throw: NaN and out-of-range values saturate (NaN gives
// INT64_MIN) where the host raises a DTypeError.
template <> __device__ __forceinline__ std::int64_t FromDouble<std::int64_t>(double v) { return __double2ll_rz(v); }

// Widening load: float64 stays double (so float64 → float32 is one rounding), int64 goes to double (exact for
// |v| <= 2^53), the half types go through float.
__device__ __forceinline__ double Widen(double v) { return v; }
__device__ __forceinline__ double Widen(float v) { return v; }
__device__ __forceinline__ double Widen(__half v) { return __half2float(v); }
__device__ __forceinline__ double Widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double Widen(std::int64_t v) { return static_cast<double>(v); }

__device__ __forceinline__ std::int64_t GlobalThread() {
    return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t GridThreads() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

template <class T> __global__ void FillRandomKernel(T *__restrict__ out, std::int64_t n, const RandomKernelArgs args) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        out[i] = FromDouble<T>(RandomValueAt(args, GlobalIndexOf(args, i)));
    }
}

template <class T> __global__ void FillValueKernel(T *__restrict__ out, std::int64_t n, double value) {
    const T v = FromDouble<T>(value);
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        out[i] = v;
    }
}

template <class S, class D> __global__ void CastKernel(const S *__restrict__ src, D *__restrict__ dst, std::int64_t n) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        dst[i] = FromDouble<D>(Widen(src[i]));
    }
}

// Copies by bit pattern: the element type only sets the width.
template <class W>
__global__ void StridedCopyKernel(const W *__restrict__ src, W *__restrict__ dst, std::int64_t n,
                                  const StridedCopyDesc desc) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        std::int64_t rem = i;
        std::int64_t offset = 0;
        for (int d = desc.rank - 1; d >= 0; --d) {
            offset += (rem % desc.shape[d]) * desc.stride[d];
            rem /= desc.shape[d];
        }
        dst[i] = src[offset];
    }
}

// Calls f(T{}) with the element type of dtype.
template <class F> cudaError_t WithType(DType dtype, F &&f) {
    switch (dtype) {
    case DType::kFloat32:
        return f(float{});
    case DType::kFloat16:
        return f(__half{});
    case DType::kBFloat16:
        return f(__nv_bfloat16{});
    case DType::kFloat64:
        return f(double{});
    case DType::kInt64:
        return f(std::int64_t{});
    }
    return cudaErrorInvalidValue;
}

} // namespace

cudaError_t LaunchFillRandom(void *data, DType dtype, std::int64_t numel, const RandomKernelArgs &args,
                             cudaStream_t stream) {
    if (numel <= 0) {
        return cudaSuccess;
    }
    return WithType(dtype, [&](auto tag) {
        using T = decltype(tag);
        FillRandomKernel<T><<<BlocksFor(numel), kThreads, 0, stream>>>(static_cast<T *>(data), numel, args);
        return cudaGetLastError();
    });
}

cudaError_t LaunchFillValue(void *data, DType dtype, std::int64_t numel, double value, cudaStream_t stream) {
    if (numel <= 0) {
        return cudaSuccess;
    }
    return WithType(dtype, [&](auto tag) {
        using T = decltype(tag);
        FillValueKernel<T><<<BlocksFor(numel), kThreads, 0, stream>>>(static_cast<T *>(data), numel, value);
        return cudaGetLastError();
    });
}

cudaError_t LaunchCast(const void *src, DType src_dtype, void *dst, DType dst_dtype, std::int64_t numel,
                       cudaStream_t stream) {
    if (numel <= 0) {
        return cudaSuccess;
    }
    return WithType(src_dtype, [&](auto src_tag) {
        using S = decltype(src_tag);
        return WithType(dst_dtype, [&](auto dst_tag) {
            using D = decltype(dst_tag);
            CastKernel<S, D>
                <<<BlocksFor(numel), kThreads, 0, stream>>>(static_cast<const S *>(src), static_cast<D *>(dst), numel);
            return cudaGetLastError();
        });
    });
}

cudaError_t LaunchStridedCopy(const void *src, void *dst, std::size_t element_size, const StridedCopyDesc &desc,
                              cudaStream_t stream) {
    if (desc.rank < 0 || desc.rank > kMaxCopyRank) {
        return cudaErrorInvalidValue;
    }
    std::int64_t n = 1;
    for (int d = 0; d < desc.rank; ++d) {
        n *= desc.shape[d];
    }
    if (n <= 0) {
        return cudaSuccess;
    }
    const int blocks = BlocksFor(n);
    switch (element_size) {
    case 1:
        StridedCopyKernel<std::uint8_t><<<blocks, kThreads, 0, stream>>>(static_cast<const std::uint8_t *>(src),
                                                                         static_cast<std::uint8_t *>(dst), n, desc);
        break;
    case 2:
        StridedCopyKernel<std::uint16_t><<<blocks, kThreads, 0, stream>>>(static_cast<const std::uint16_t *>(src),
                                                                          static_cast<std::uint16_t *>(dst), n, desc);
        break;
    case 4:
        StridedCopyKernel<std::uint32_t><<<blocks, kThreads, 0, stream>>>(static_cast<const std::uint32_t *>(src),
                                                                          static_cast<std::uint32_t *>(dst), n, desc);
        break;
    case 8:
        StridedCopyKernel<std::uint64_t><<<blocks, kThreads, 0, stream>>>(static_cast<const std::uint64_t *>(src),
                                                                          static_cast<std::uint64_t *>(dst), n, desc);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

} // namespace shardline::detail::cuda
