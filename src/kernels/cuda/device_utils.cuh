#pragma once

// Device-side helpers shared by the .cu files of src/kernels/cuda: fp32 load/store of the three CUDA dtypes, dtype
// dispatch for launchers, grid-stride indices and the GELU formulas (fp32 math). Included only by nvcc.

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

/// Calls f(T{}) with the element type of a CUDA kernel dtype; float64, int64 and unknown values are invalid.
template <class F> cudaError_t WithFloatType(DType dtype, F &&f) {
    switch (dtype) {
    case DType::kFloat32:
        return f(float{});
    case DType::kFloat16:
        return f(__half{});
    case DType::kBFloat16:
        return f(__nv_bfloat16{});
    case DType::kFloat64:
    case DType::kInt64:
        break;
    }
    return cudaErrorInvalidValue;
}

/// WithFloatType over two dtypes (a kernel's input and output, or data and bias): calls f(A{}, B{}).
template <class F> cudaError_t WithFloatTypes(DType a, DType b, F &&f) {
    return WithFloatType(a, [&](auto a_tag) { return WithFloatType(b, [&](auto b_tag) { return f(a_tag, b_tag); }); });
}

/// kN elements loaded or stored with one instruction (16 bytes for 4 floats or 8 halves); the address must be
/// aligned to the vector's size.
template <class T, int kN> struct alignas(sizeof(T) * kN) AlignedVector {
    T val[kN];
};

/// Whether p may be read as vectors of `bytes` bytes.
inline bool IsAligned(const void *p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

__device__ __forceinline__ std::int64_t GlobalThread() {
    return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t GridThreads() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 8192;

inline int BlocksFor(std::int64_t n) {
    const std::int64_t blocks = (n + kThreads - 1) / kThreads;
    return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// GELU, tanh approximation (what cuBLASLt's GELU epilogues compute) and exact erf form.
inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr float kInvSqrt2 = 0.7071067811865476f;
inline constexpr float kInvSqrt2Pi = 0.3989422804014327f;

__device__ __forceinline__ float GeluTanh(float x) {
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float GeluTanhGrad(float x) {
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
}
__device__ __forceinline__ float GeluErf(float x) { return 0.5f * x * (1.0f + erff(x * kInvSqrt2)); }
__device__ __forceinline__ float GeluErfGrad(float x) {
    return 0.5f * (1.0f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}

} // namespace shardline::kernels::cuda
