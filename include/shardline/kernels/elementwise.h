#pragma once

// Elementwise kernels and reductions. CPU: float32 and float64. CUDA: float32, float16, bfloat16 (fp32 math).

#include <string_view>
#include <vector>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

enum class GeluApproximation : std::uint8_t {
    kTanh, ///< 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    kErf,  ///< 0.5·x·(1 + erf(x/√2))
};

struct GeluForwardArgs {
    const Tensor& x;
    Tensor& y;
    GeluApproximation approximation = GeluApproximation::kTanh;
};
struct GeluForwardOp {
    static constexpr std::string_view kName = "GeluForward";
    using Fn = void (*)(const GeluForwardArgs&);
};
void GeluForward(const GeluForwardArgs& args);
Tensor GeluForward(const Tensor& x, GeluApproximation approximation = GeluApproximation::kTanh);

struct GeluBackwardArgs {
    const Tensor& dy;
    const Tensor& x; ///< the GELU's input
    Tensor& dx;
    GeluApproximation approximation = GeluApproximation::kTanh;
};
struct GeluBackwardOp {
    static constexpr std::string_view kName = "GeluBackward";
    using Fn = void (*)(const GeluBackwardArgs&);
};
/// dx = dy·gelu'(x).
void GeluBackward(const GeluBackwardArgs& args);
Tensor GeluBackward(const Tensor& dy, const Tensor& x, GeluApproximation approximation = GeluApproximation::kTanh);

struct AddArgs {
    const Tensor& a;
    const Tensor& b; ///< same shape as a
    Tensor& out;     ///< may alias a or b
    double alpha = 1.0;
};
struct AddOp {
    static constexpr std::string_view kName = "Add";
    using Fn = void (*)(const AddArgs&);
};
/// out = a + alpha·b.
void Add(const AddArgs& args);
Tensor Add(const Tensor& a, const Tensor& b, double alpha = 1.0);

struct BiasAddArgs {
    const Tensor& x;    ///< [..., n]
    const Tensor& bias; ///< [n], x's dtype
    Tensor& out;        ///< x's shape and dtype; may alias x
};
struct BiasAddOp {
    static constexpr std::string_view kName = "BiasAdd";
    using Fn = void (*)(const BiasAddArgs&);
};
/// out[..., j] = x[..., j] + bias[j] (the row-parallel bias, added once after the all-reduce).
void BiasAdd(const BiasAddArgs& args);
Tensor BiasAdd(const Tensor& x, const Tensor& bias);

struct ScaleArgs {
    const Tensor& x;
    Tensor& out; ///< may alias x
    double alpha = 1.0;
};
struct ScaleOp {
    static constexpr std::string_view kName = "Scale";
    using Fn = void (*)(const ScaleArgs&);
};
/// out = alpha·x.
void Scale(const ScaleArgs& args);
Tensor Scale(const Tensor& x, double alpha);

struct SumArgs {
    const Tensor& x;
    Tensor& out;           ///< x's shape with the reduced dims removed (or 1 with keepdim); any float dtype
    std::vector<int> dims; ///< dims to reduce (negative counts from the end); empty = all dims
    bool keepdim = false;
};
struct SumOp {
    static constexpr std::string_view kName = "Sum";
    using Fn = void (*)(const SumArgs&);
};
/// out = Σ over dims of x, accumulated in fp32 (fp64 for fp64).
void Sum(const SumArgs& args);
/// What the allocating Sum and SumOutputShape reduce: Sum(x, {.dims = {0}, .keepdim = true}).
struct SumOptions {
    std::vector<int> dims = {}; ///< dims to reduce (negative counts from the end); empty = all dims
    bool keepdim = false;       ///< keep each reduced dim, with size 1
};
/// Σ over options.dims of x into a new tensor.
Tensor Sum(const Tensor& x, SumOptions options = {});
/// The output shape of Sum (dims normalised and validated against x's rank).
Shape SumOutputShape(const Shape& x, const SumOptions& options, std::string_view op);

} // namespace shardline::kernels
