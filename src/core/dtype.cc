#include <shardline/core/dtype.h>
#include <shardline/core/error.h>

namespace shardline {

std::string_view DTypeName(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return "float32";
    case DType::kFloat16:
        return "float16";
    case DType::kBFloat16:
        return "bfloat16";
    case DType::kFloat64:
        return "float64";
    case DType::kInt64:
        return "int64";
    }
    return "unknown";
}

DType ParseDType(std::string_view name) {
    if (name == "float32" || name == "f32" || name == "fp32") {
        return DType::kFloat32;
    }
    if (name == "float16" || name == "f16" || name == "fp16" || name == "half") {
        return DType::kFloat16;
    }
    if (name == "bfloat16" || name == "bf16") {
        return DType::kBFloat16;
    }
    if (name == "float64" || name == "f64" || name == "fp64" || name == "double") {
        return DType::kFloat64;
    }
    if (name == "int64" || name == "i64") {
        return DType::kInt64;
    }
    SHARDLINE_THROW(DTypeError, "ParseDType",
                    "expected one of float32|float16|bfloat16|float64|int64 (or f32, fp16, bf16, f64, i64), got '{}'",
                    name);
}

} // namespace shardline
