#pragma once

// Host-side element conversions between dtypes. Half types use cuda_fp16.h / cuda_bf16.h (host-callable) when
// CUDA is built; without CUDA a half dtype on the host is a clear error. int64 goes through double: exact for
// |v| <= 2^53, and a double stored as int64 is truncated toward zero (a NaN, an infinity or a value outside the int64
// range is a DTypeError, never undefined behaviour).

#include <cstdint>

#include <shardline/core/dtype.h>
#include <shardline/core/error.h>

namespace shardline::detail {

/// v truncated toward zero; a DTypeError when v is NaN, infinite or outside [-2^63, 2^63).
inline std::int64_t DoubleToInt64(double v) {
    constexpr double kTwo63 = 9223372036854775808.0; // 2^63, exact in double
    SHARDLINE_CHECK_AS(DTypeError, v >= -kTwo63 && v < kTwo63, "Tensor",
                       "cannot store {} as int64 (expected a finite value in [-2^63, 2^63))", v);
    return static_cast<std::int64_t>(v);
}

/// Element i of `data` (dtype) as double.
inline double LoadAsDouble(const void* data, DType dtype, std::int64_t i) {
    switch (dtype) {
    case DType::kFloat32:
        return static_cast<const float*>(data)[i];
    case DType::kFloat64:
        return static_cast<const double*>(data)[i];
    case DType::kInt64:
        return static_cast<double>(static_cast<const std::int64_t*>(data)[i]);
#if SHARDLINE_HAVE_CUDA
    case DType::kFloat16:
        return __half2float(static_cast<const __half*>(data)[i]);
    case DType::kBFloat16:
        return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
#else
    default:
        SHARDLINE_THROW(DTypeError, "Tensor", "{} needs a build with CUDA (SHARDLINE_WITH_CUDA) for host conversion",
                        DTypeName(dtype));
#endif
    }
    return 0.0;
}

/// Stores v into element i, rounding double → float → dtype (round to nearest even), as the CUDA kernels do.
inline void StoreFromDouble(void* data, DType dtype, std::int64_t i, double v) {
    switch (dtype) {
    case DType::kFloat32:
        static_cast<float*>(data)[i] = static_cast<float>(v);
        return;
    case DType::kFloat64:
        static_cast<double*>(data)[i] = v;
        return;
    case DType::kInt64:
        static_cast<std::int64_t*>(data)[i] = DoubleToInt64(v);
        return;
#if SHARDLINE_HAVE_CUDA
    case DType::kFloat16:
        static_cast<__half*>(data)[i] = __float2half_rn(static_cast<float>(v));
        return;
    case DType::kBFloat16:
        static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(static_cast<float>(v));
        return;
#else
    default:
        SHARDLINE_THROW(DTypeError, "Tensor", "{} needs a build with CUDA (SHARDLINE_WITH_CUDA) for host conversion",
                        DTypeName(dtype));
#endif
    }
}

} // namespace shardline::detail
