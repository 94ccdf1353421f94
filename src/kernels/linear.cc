// Linear ops: argument checks, allocating wrappers and the default kernels, which are compositions over Gemm
// (so they serve every device type, and a provider that supplies only Gemm serves them too).

#include <shardline/kernels/linear.h>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>

#include "checks.h"
#include "register.h"

namespace shardline::kernels {
namespace {

using detail::CheckDeviceDType;
using detail::CheckSameDevice;
using detail::CheckSameDType;
using detail::CheckShape;
using detail::CheckTensor;

/// [..., features] → (rows, features). A rank-0 tensor is rejected.
std::int64_t Rows(const Tensor& t, std::string_view op, std::string_view name) {
    SHARDLINE_CHECK_AS(ShapeError, t.rank() >= 1, op, "{} must have rank >= 1, got {}", name, t.ToString());
    const std::int64_t last = t.shape().back();
    return last == 0 ? 0 : t.numel() / last;
}

Shape WithLastDim(Shape shape, std::int64_t last) {
    shape.back() = last;
    return shape;
}

void CheckWeight(const Tensor& weight, std::string_view op) {
    CheckTensor(weight, op, "weight");
    CheckDeviceDType(weight, op, "weight");
    SHARDLINE_CHECK_AS(ShapeError, weight.rank() == 2, op, "weight must be [out_features, in_features], got {}",
                       weight.ToString());
    SHARDLINE_CHECK_AS(ShapeError, weight.size(0) > 0 && weight.size(1) > 0, op,
                       "weight must have out_features > 0 and in_features > 0, got {}", weight.ToString());
}

void CheckBias(const Tensor& bias, const Tensor& like, std::int64_t out_features, std::string_view op,
               std::string_view name) {
    CheckTensor(bias, op, name);
    CheckSameDevice(bias, name, like, "weight", op);
    CheckSameDType(bias, name, like, "weight", op);
    SHARDLINE_CHECK_AS(ShapeError, bias.rank() == 1 && bias.size(0) == out_features, op,
                       "{} must be [out_features] = [{}], got {}", name, out_features, bias.ToString());
}

// ---------------------------------------------------------------------------------------------------------------------
// Default kernels

void DefaultLinearForward(const LinearForwardArgs& args) {
    const std::int64_t in = args.weight.size(1);
    const std::int64_t out = args.weight.size(0);
    const std::int64_t rows = Rows(args.x, LinearForwardOp::kName, "x");
    const bool gelu = args.activation == LinearActivation::kGeluTanh;
    // Row-major Y[M,out] = X[M,in]·W[out,in]ᵀ. Column-major, the same bytes read Yᶜ[out,M] = Wᶜᵀ·Xᶜ with
    // Wᶜ = W viewed [in,out] (ld in, transposed to [out,in]) and Xᶜ = X viewed [in,M] (ld in). The bias has one
    // entry per row of Yᶜ (m = out), which is what the cuBLASLt BIAS epilogue adds.
    Gemm(GemmParams{.trans_a = true,
                    .trans_b = false,
                    .m = out,
                    .n = rows,
                    .k = in,
                    .a = args.weight.data(),
                    .lda = in,
                    .a_type = args.weight.dtype(),
                    .b = args.x.data(),
                    .ldb = in,
                    .b_type = args.x.dtype(),
                    .c = args.y.data(),
                    .ldc = out,
                    .c_type = args.y.dtype(),
                    .epilogue = gelu ? GemmEpilogue::kGeluAuxBias
                                     : (args.bias != nullptr ? GemmEpilogue::kBias : GemmEpilogue::kNone),
                    .bias = args.bias != nullptr ? args.bias->data() : nullptr,
                    .bias_type = args.bias != nullptr ? args.bias->dtype() : args.y.dtype(),
                    .aux = gelu ? args.pre_activation->data() : nullptr,
                    .ldaux = gelu ? out : 0,
                    .device = args.y.device()});
}

void DefaultLinearBackwardInput(const LinearBackwardInputArgs& args) {
    const std::int64_t in = args.weight.size(1);
    const std::int64_t out = args.weight.size(0);
    const std::int64_t rows = Rows(args.dy, LinearBackwardInputOp::kName, "dy");
    // Row-major dX[M,in] = dY[M,out]·W[out,in]. Column-major dXᶜ[in,M] = Wᶜ[in,out]·dYᶜ[out,M]: W viewed [in,out]
    // (ld in) and dY viewed [out,M] (ld out), no transposes.
    Gemm(GemmParams{.m = in,
                    .n = rows,
                    .k = out,
                    .a = args.weight.data(),
                    .lda = in,
                    .a_type = args.weight.dtype(),
                    .b = args.dy.data(),
                    .ldb = out,
                    .b_type = args.dy.dtype(),
                    .c = args.dx.data(),
                    .ldc = in,
                    .c_type = args.dx.dtype(),
                    .device = args.dx.device()});
}

void DefaultLinearBackwardWeight(const LinearBackwardWeightArgs& args) {
    const std::int64_t in = args.x.shape().back();
    const std::int64_t out = args.dy.shape().back();
    const std::int64_t rows = Rows(args.dy, LinearBackwardWeightOp::kName, "dy");
    // The bias grad rides in the GEMM (BGRADB) only when it is overwritten: the epilogue cannot accumulate.
    const bool fused_bias = args.dbias != nullptr && !args.accumulate;
    // Row-major dW[out,in] = dY[M,out]ᵀ·X[M,in]. Column-major dWᶜ[in,out] = Xᶜ[in,M]·dYᶜ[out,M]ᵀ: X viewed [in,M]
    // (ld in), dY viewed [out,M] (ld out) and transposed. The reduction runs over k = M, so BGRADB's sum over k of
    // op(B) = dYᵀ gives db[out]. accumulate: beta = 1 into dW (e.g. an fp32 main grad for bf16 operands).
    Gemm(GemmParams{.trans_a = false,
                    .trans_b = true,
                    .m = in,
                    .n = out,
                    .k = rows,
                    .a = args.x.data(),
                    .lda = in,
                    .a_type = args.x.dtype(),
                    .b = args.dy.data(),
                    .ldb = out,
                    .b_type = args.dy.dtype(),
                    .c = args.dweight.data(),
                    .ldc = in,
                    .c_type = args.dweight.dtype(),
                    .beta = args.accumulate ? 1.0 : 0.0,
                    .epilogue = fused_bias ? GemmEpilogue::kBGradB : GemmEpilogue::kNone,
                    .bias = fused_bias ? args.dbias->data() : nullptr,
                    .bias_type = fused_bias ? args.dbias->dtype() : args.dy.dtype(),
                    .device = args.dweight.device()});
    if (args.dbias != nullptr && !fused_bias) {
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = args.dy, .dbias = *args.dbias, .accumulate = true});
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Public entry points: checks, then dispatch.

void LinearForward(const LinearForwardArgs& args) {
    constexpr std::string_view kOp = LinearForwardOp::kName;
    CheckWeight(args.weight, kOp);
    CheckTensor(args.x, kOp, "x");
    CheckTensor(args.y, kOp, "y");
    CheckSameDevice(args.x, "x", args.weight, "weight", kOp);
    CheckSameDevice(args.y, "y", args.weight, "weight", kOp);
    CheckSameDType(args.x, "x", args.weight, "weight", kOp);
    CheckSameDType(args.y, "y", args.weight, "weight", kOp);
    const std::int64_t in = args.weight.size(1);
    const std::int64_t out = args.weight.size(0);
    SHARDLINE_CHECK_AS(ShapeError, args.x.rank() >= 1 && args.x.shape().back() == in, kOp,
                       "x's last dim must equal in_features {} of weight {}, got x {}", in, args.weight.ToString(),
                       args.x.ToString());
    CheckShape(args.y, WithLastDim(args.x.shape(), out), kOp, "y");
    if (args.bias != nullptr) {
        CheckBias(*args.bias, args.weight, out, kOp, "bias");
    }
    if (args.activation == LinearActivation::kGeluTanh) {
        SHARDLINE_CHECK(args.pre_activation != nullptr, kOp, "activation gelu_tanh needs a pre_activation tensor");
        CheckTensor(*args.pre_activation, kOp, "pre_activation");
        CheckSameDevice(*args.pre_activation, "pre_activation", args.weight, "weight", kOp);
        CheckSameDType(*args.pre_activation, "pre_activation", args.weight, "weight", kOp);
        CheckShape(*args.pre_activation, args.y.shape(), kOp, "pre_activation");
    }
    if (args.y.numel() == 0) {
        return;
    }
    Dispatch<LinearForwardOp>(args.y.device().type, args);
}

Tensor LinearForward(const Tensor& x, const Tensor& weight, const Tensor* bias) {
    CheckWeight(weight, LinearForwardOp::kName);
    CheckTensor(x, LinearForwardOp::kName, "x");
    SHARDLINE_CHECK_AS(ShapeError, x.rank() >= 1, LinearForwardOp::kName, "x must have rank >= 1, got {}",
                       x.ToString());
    Tensor y = Tensor::Empty(WithLastDim(x.shape(), weight.size(0)), weight.dtype(), weight.device());
    LinearForward(LinearForwardArgs{.x = x, .weight = weight, .bias = bias, .y = y});
    return y;
}

void LinearBackwardInput(const LinearBackwardInputArgs& args) {
    constexpr std::string_view kOp = LinearBackwardInputOp::kName;
    CheckWeight(args.weight, kOp);
    CheckTensor(args.dy, kOp, "dy");
    CheckTensor(args.dx, kOp, "dx");
    CheckSameDevice(args.dy, "dy", args.weight, "weight", kOp);
    CheckSameDevice(args.dx, "dx", args.weight, "weight", kOp);
    CheckSameDType(args.dy, "dy", args.weight, "weight", kOp);
    CheckSameDType(args.dx, "dx", args.weight, "weight", kOp);
    const std::int64_t out = args.weight.size(0);
    SHARDLINE_CHECK_AS(ShapeError, args.dy.rank() >= 1 && args.dy.shape().back() == out, kOp,
                       "dy's last dim must equal out_features {} of weight {}, got dy {}", out,
                       args.weight.ToString(), args.dy.ToString());
    CheckShape(args.dx, WithLastDim(args.dy.shape(), args.weight.size(1)), kOp, "dx");
    if (args.dx.numel() == 0) {
        return;
    }
    Dispatch<LinearBackwardInputOp>(args.dx.device().type, args);
}

Tensor LinearBackwardInput(const Tensor& dy, const Tensor& weight) {
    CheckWeight(weight, LinearBackwardInputOp::kName);
    CheckTensor(dy, LinearBackwardInputOp::kName, "dy");
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1, LinearBackwardInputOp::kName, "dy must have rank >= 1, got {}",
                       dy.ToString());
    Tensor dx = Tensor::Empty(WithLastDim(dy.shape(), weight.size(1)), weight.dtype(), weight.device());
    LinearBackwardInput(LinearBackwardInputArgs{.dy = dy, .weight = weight, .dx = dx});
    return dx;
}

void LinearBackwardWeight(const LinearBackwardWeightArgs& args) {
    constexpr std::string_view kOp = LinearBackwardWeightOp::kName;
    CheckTensor(args.dy, kOp, "dy");
    CheckTensor(args.x, kOp, "x");
    CheckTensor(args.dweight, kOp, "dweight");
    CheckDeviceDType(args.x, kOp, "x");
    CheckSameDevice(args.dy, "dy", args.x, "x", kOp);
    CheckSameDevice(args.dweight, "dweight", args.x, "x", kOp);
    CheckSameDType(args.dy, "dy", args.x, "x", kOp);
    SHARDLINE_CHECK_AS(DTypeError,
                       args.dweight.dtype() == args.x.dtype() ||
                           (args.accumulate && args.dweight.dtype() == DType::kFloat32),
                       kOp, "dweight must have x's dtype {} (or be a float32 main grad with accumulate), got {}",
                       DTypeName(args.x.dtype()), args.dweight.ToString());
    SHARDLINE_CHECK_AS(ShapeError, args.dy.rank() >= 1 && args.x.rank() == args.dy.rank(), kOp,
                       "dy and x must have the same rank >= 1, got dy {} and x {}", args.dy.ToString(),
                       args.x.ToString());
    const Shape dy_lead(args.dy.shape().begin(), args.dy.shape().end() - 1);
    const Shape x_lead(args.x.shape().begin(), args.x.shape().end() - 1);
    SHARDLINE_CHECK_AS(ShapeError, dy_lead == x_lead, kOp, "dy {} and x {} must agree on the leading (row) dims",
                       args.dy.ToString(), args.x.ToString());
    const std::int64_t out = args.dy.shape().back();
    const std::int64_t in = args.x.shape().back();
    SHARDLINE_CHECK_AS(ShapeError, out > 0 && in > 0, kOp, "features must be > 0, got dy {} and x {}",
                       args.dy.ToString(), args.x.ToString());
    CheckShape(args.dweight, Shape{out, in}, kOp, "dweight");
    if (args.dbias != nullptr) {
        CheckTensor(*args.dbias, kOp, "dbias");
        CheckSameDevice(*args.dbias, "dbias", args.x, "x", kOp);
        SHARDLINE_CHECK_AS(DTypeError, args.dbias->dtype() == args.dweight.dtype(), kOp,
                           "dbias must have dweight's dtype {}, got {}", DTypeName(args.dweight.dtype()),
                           args.dbias->ToString());
        CheckShape(*args.dbias, Shape{out}, kOp, "dbias");
    }
    if (args.dy.numel() == 0) {
        if (!args.accumulate) {
            args.dweight.Fill(0.0);
            if (args.dbias != nullptr) {
                args.dbias->Fill(0.0);
            }
        }
        return;
    }
    Dispatch<LinearBackwardWeightOp>(args.dweight.device().type, args);
}

Tensor LinearBackwardWeight(const Tensor& dy, const Tensor& x) {
    CheckTensor(dy, LinearBackwardWeightOp::kName, "dy");
    CheckTensor(x, LinearBackwardWeightOp::kName, "x");
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1 && x.rank() >= 1, LinearBackwardWeightOp::kName,
                       "dy and x must have rank >= 1, got dy {} and x {}", dy.ToString(), x.ToString());
    Tensor dw = Tensor::Empty(Shape{dy.shape().back(), x.shape().back()}, x.dtype(), x.device());
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw});
    return dw;
}

void LinearBackwardBias(const LinearBackwardBiasArgs& args) {
    constexpr std::string_view kOp = LinearBackwardBiasOp::kName;
    CheckTensor(args.dy, kOp, "dy");
    CheckTensor(args.dbias, kOp, "dbias");
    CheckDeviceDType(args.dy, kOp, "dy");
    CheckSameDevice(args.dy, "dy", args.dbias, "dbias", kOp);
    SHARDLINE_CHECK_AS(ShapeError, args.dy.rank() >= 1, kOp, "dy must have rank >= 1, got {}", args.dy.ToString());
    SHARDLINE_CHECK_AS(DTypeError, args.dbias.dtype() == args.dy.dtype() || args.dbias.dtype() == DType::kFloat32,
                       kOp, "dbias must have dy's dtype {} or float32, got {}", DTypeName(args.dy.dtype()),
                       args.dbias.ToString());
    CheckShape(args.dbias, Shape{args.dy.shape().back()}, kOp, "dbias");
    if (args.dbias.numel() == 0) {
        return;
    }
    Dispatch<LinearBackwardBiasOp>(args.dbias.device().type, args);
}

Tensor LinearBackwardBias(const Tensor& dy) {
    CheckTensor(dy, LinearBackwardBiasOp::kName, "dy");
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1, LinearBackwardBiasOp::kName, "dy must have rank >= 1, got {}",
                       dy.ToString());
    Tensor db = Tensor::Empty(Shape{dy.shape().back()}, dy.dtype(), dy.device());
    LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db});
    return db;
}

namespace detail {
void RegisterLinearCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<LinearForwardOp>(d, kDefaultProvider, &DefaultLinearForward);
        Register<LinearBackwardInputOp>(d, kDefaultProvider, &DefaultLinearBackwardInput);
        Register<LinearBackwardWeightOp>(d, kDefaultProvider, &DefaultLinearBackwardWeight);
    }
}
} // namespace detail

} // namespace shardline::kernels
