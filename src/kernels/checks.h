#pragma once

// Argument checks shared by the op wrappers. Each throws a shardline::Error subclass naming the op, the argument,
// what was expected and what was found. They run before any kernel (and, in distributed code, before any
// collective). They sit in kernels:: itself (this header is private to src/kernels) so the op files call them
// unqualified.

#include <initializer_list>
#include <string_view>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

namespace shardline::kernels {

/// Defined, contiguous, non-null when non-empty.
inline void CheckTensor(const Tensor& t, std::string_view op, std::string_view name) {
    SHARDLINE_CHECK(t.defined(), op, "{} is an undefined (empty) tensor", name);
    SHARDLINE_CHECK(t.numel() == 0 || t.data() != nullptr, op, "{} {} has a null data pointer", name, t.ToString());
    SHARDLINE_CHECK_AS(ShapeError, t.is_contiguous(), op,
                       "{} must be contiguous (row-major), got {} with strides {}; call Contiguous() first", name,
                       t.ToString(), ShapeToString(t.strides()));
}

/// The float dtypes the kernels of a device support: CPU float32/float64, CUDA float32/float16/bfloat16 (int64 is a
/// storage type: no float kernel takes it).
inline void CheckDeviceDType(const Tensor& t, std::string_view op, std::string_view name) {
    if (t.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, op,
                           "CPU kernels take float32 or float64, got {} {} (half types run on CUDA only)", name,
                           t.ToString());
    } else {
        SHARDLINE_CHECK_AS(DTypeError, IsFloatingPoint(t.dtype()) && t.dtype() != DType::kFloat64, op,
                           "CUDA kernels take float32, float16 or bfloat16, got {} {}", name, t.ToString());
    }
}

/// Token ids and labels: int64.
inline void CheckIndexDType(const Tensor& t, std::string_view op, std::string_view name) {
    SHARDLINE_CHECK_AS(DTypeError, t.dtype() == DType::kInt64, op,
                       "{} must be int64 (token ids / class labels), got {}", name, t.ToString());
}

inline void CheckSameDevice(const Tensor& a, std::string_view a_name, const Tensor& b, std::string_view b_name,
                            std::string_view op) {
    SHARDLINE_CHECK_AS(DeviceError, a.device() == b.device(), op, "{} and {} must be on one device, got {} and {}",
                       a_name, b_name, a.ToString(), b.ToString());
}

inline void CheckSameDType(const Tensor& a, std::string_view a_name, const Tensor& b, std::string_view b_name,
                           std::string_view op) {
    SHARDLINE_CHECK_AS(DTypeError, a.dtype() == b.dtype(), op, "{} and {} must have one dtype, got {} and {}", a_name,
                       b_name, a.ToString(), b.ToString());
}

inline void CheckShape(const Tensor& t, const Shape& expected, std::string_view op, std::string_view name) {
    SHARDLINE_CHECK_AS(ShapeError, t.shape() == expected, op, "{} must have shape {}, got {}", name,
                       ShapeToString(expected), t.ToString());
}

/// Two tensors an op takes together: both valid, `a` in a kernel dtype of its device, `b` on a's device and in its
/// dtype.
inline void CheckOperands(const Tensor& a, std::string_view a_name, const Tensor& b, std::string_view b_name,
                          std::string_view op) {
    CheckTensor(a, op, a_name);
    CheckTensor(b, op, b_name);
    CheckDeviceDType(a, op, a_name);
    CheckSameDevice(a, a_name, b, b_name, op);
    CheckSameDType(a, a_name, b, b_name, op);
}

/// A tensor that goes with `like` (an output, a gradient, a bias): CheckTensor, then like's device and dtype.
inline void CheckLike(const Tensor& t, std::string_view name, const Tensor& like, std::string_view like_name,
                      std::string_view op) {
    CheckTensor(t, op, name);
    CheckSameDevice(t, name, like, like_name, op);
    CheckSameDType(t, name, like, like_name, op);
}

} // namespace shardline::kernels
