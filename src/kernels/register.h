#pragma once

// Explicit registration of the built-in kernels (no static-initialiser or --whole-archive tricks).
// EnsureBuiltinKernels() calls each of these once.

#include <initializer_list>

#include <shardline/config.h>
#include <shardline/core/device.h>

namespace shardline::kernels::detail {

/// The device types this build has kernels for.
inline constexpr std::initializer_list<DeviceType> kBuiltDeviceTypes =
#if SHARDLINE_HAVE_CUDA
    {DeviceType::kCPU, DeviceType::kCUDA};
#else
    {DeviceType::kCPU};
#endif

/// Linear*, Matmul*, Outer*, GroupedGemm (a loop of Gemm) and GroupedLinear*: device-agnostic compositions over Gemm
/// (src/kernels/{linear,matmul,outer,grouped_gemm,grouped_linear}.cc),
/// registered as "default" for every device type.
void RegisterCompositeKernels();
/// src/kernels/cpu: Gemm (OpenBLAS), LinearBackwardBias, GELU, Add, Scale, Sum, BiasAdd, Embedding*, CrossEntropy*,
/// SgdStep, AdamWStep.
void RegisterCpuKernels();
#if SHARDLINE_HAVE_CUDA
/// src/kernels/cuda: "default" (cuBLASLt Gemm, vectorised bias grad, GELU, Add, Scale, Sum, BiasAdd, Embedding*,
/// CrossEntropy*, SgdStep, AdamWStep) and "legacy" (cublasGemmEx Gemm with separate bias-add / bias-grad / GELU
/// kernels, and a plain bias-grad kernel).
void RegisterCudaKernels();
#endif

} // namespace shardline::kernels::detail
