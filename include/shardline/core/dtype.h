#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <shardline/config.h>

#if SHARDLINE_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace shardline {

/// Element types. float64 exists for references and CPU kernels; half types run on CUDA only. int64 is a storage
/// type (token ids, labels): tensors of it can be made, copied, viewed, filled and cast, but the float kernels reject
/// it; the ops that read ids (EmbeddingForward/Backward, the CrossEntropy stages) take it where they say so.
enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16, kFloat64, kInt64 };

/// Bytes per element.
constexpr std::size_t ElementSize(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
        return 2;
    case DType::kFloat64:
    case DType::kInt64:
        return 8;
    }
    return 0;
}

constexpr bool IsHalf(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

/// float32, float16, bfloat16, float64: every dtype but int64.
constexpr bool IsFloatingPoint(DType dtype) { return dtype != DType::kInt64; }

/// "float32", "float16", "bfloat16", "float64", "int64".
std::string_view DTypeName(DType dtype);

/// Parses the names above and the short forms "f32", "fp32", "f16", "fp16", "bf16", "f64", "fp64", "i64".
/// Throws shardline::Error on anything else.
DType ParseDType(std::string_view name);

/// The C++ type that holds a dtype's elements, where one exists in this build.
template <class T> struct DTypeOf;
template <> struct DTypeOf<float> {
    static constexpr DType kValue = DType::kFloat32;
};
template <> struct DTypeOf<double> {
    static constexpr DType kValue = DType::kFloat64;
};
template <> struct DTypeOf<std::int64_t> {
    static constexpr DType kValue = DType::kInt64;
};
#if SHARDLINE_HAVE_CUDA
template <> struct DTypeOf<__half> {
    static constexpr DType kValue = DType::kFloat16;
};
template <> struct DTypeOf<__nv_bfloat16> {
    static constexpr DType kValue = DType::kBFloat16;
};
#endif

} // namespace shardline
