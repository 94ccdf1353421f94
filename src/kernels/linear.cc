// Linear ops: argument checks, allocating wrappers and the default kernels, which are compositions over Gemm
// (so they serve every device type, and a provider that supplies only Gemm serves them too).

#include <algorithm>
#include <initializer_list>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

#include "checks.h"
#include "linear_gemm.h"
#include "register.h"

namespace shardline::kernels {
namespace {

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

// The checks below run on every call: they compare without building the expected Shape (a heap allocation), and only
// a failing check formats its message.

/// t has `like`'s shape with the last dim replaced by `last`.
void CheckShapeWithLast(const Tensor& t, const Shape& like, std::int64_t last, std::string_view op,
                        std::string_view name) {
    const Shape& s = t.shape();
    const bool ok = !like.empty() && s.size() == like.size() && s.back() == last &&
                    std::equal(like.begin(), like.end() - 1, s.begin());
    if (!ok) [[unlikely]] {
        CheckShape(t, like.empty() ? like : WithLastDim(like, last), op, name);
    }
}

/// t has exactly the given dims.
void CheckDims(const Tensor& t, std::initializer_list<std::int64_t> dims, std::string_view op, std::string_view name) {
    const Shape& s = t.shape();
    if (s.size() != dims.size() || !std::equal(dims.begin(), dims.end(), s.begin())) [[unlikely]] {
        CheckShape(t, Shape(dims), op, name);
    }
}

/// A residual added by the GEMM (its C): exactly `out`'s shape, dtype and device.
void CheckResidual(const Tensor& residual, std::string_view name, const Tensor& out, std::string_view out_name,
                   std::string_view op) {
    CheckTensor(residual, op, name);
    CheckSameDevice(residual, name, out, out_name, op);
    CheckSameDType(residual, name, out, out_name, op);
    if (residual.shape() != out.shape()) [[unlikely]] {
        CheckShape(residual, out.shape(), op, name);
    }
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
    CheckLike(bias, name, like, "weight", op);
    SHARDLINE_CHECK_AS(ShapeError, bias.rank() == 1 && bias.size(0) == out_features, op,
                       "{} must be [out_features] = [{}], got {}", name, out_features, bias.ToString());
}

// ---------------------------------------------------------------------------------------------------------------------
// Default kernels: compositions over Gemm (GemmParams from linear_gemm.h, shared with the CUDA LinearBackward).

void DefaultLinearForward(const LinearForwardArgs& args) { Gemm(detail::LinearForwardGemm(args)); }

void DefaultLinearBackwardInput(const LinearBackwardInputArgs& args) {
    const bool gelu = args.input_activation == LinearActivation::kGeluTanh;
    Tensor* pre_dbias = args.pre_activation_dbias;
    // The previous layer's bias grad rides in the dgrad GEMM (DGELU_BGRAD) only when it is overwritten in dx's dtype:
    // the epilogue writes a vector of D's type. Where fusing measures slower, the CUDA Gemm runs the DGELU GEMM and the
    // column sum itself (gemm_tuning.h).
    const bool fused_bias = pre_dbias != nullptr && detail::DgradCanFuseBiasGrad(args.dx, *pre_dbias, args.accumulate);
    Gemm(detail::LinearDgradGemm(args.dy, args.weight, args.dx, gelu ? args.pre_activation : nullptr,
                                 fused_bias ? pre_dbias : nullptr, args.dx_residual));
    if (pre_dbias != nullptr && !fused_bias) {
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = args.dx, .dbias = *pre_dbias, .accumulate = args.accumulate});
    }
}

void DefaultLinearBackwardWeight(const LinearBackwardWeightArgs& args) {
    // The bias grad rides in the GEMM (BGRADB) only when it is overwritten: the epilogue cannot accumulate. Where
    // fusing measures slower, the CUDA Gemm runs the plain GEMM and the column sum itself (gemm_tuning.h).
    const bool fused_bias = args.dbias != nullptr && !args.accumulate;
    Gemm(detail::LinearWgradGemm(args.dy, args.x, args.dweight, fused_bias ? args.dbias : nullptr, args.accumulate));
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
    CheckShapeWithLast(args.y, args.x.shape(), out, kOp, "y");
    if (args.bias != nullptr) {
        CheckBias(*args.bias, args.weight, out, kOp, "bias");
    }
    if (args.activation == LinearActivation::kGeluTanh) {
        SHARDLINE_CHECK(args.pre_activation != nullptr, kOp, "activation gelu_tanh needs a pre_activation tensor");
        CheckLike(*args.pre_activation, "pre_activation", args.weight, "weight", kOp);
        CheckShape(*args.pre_activation, args.y.shape(), kOp, "pre_activation");
    }
    if (args.residual != nullptr) {
        SHARDLINE_CHECK(args.activation == LinearActivation::kNone, kOp,
                        "a residual is added to the layer's output: it takes no activation, got gelu_tanh");
        CheckResidual(*args.residual, "residual", args.y, "y", kOp);
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

namespace {

void CheckBackwardInput(const Tensor& dy, const Tensor& weight, const Tensor& dx, std::string_view op) {
    CheckWeight(weight, op);
    CheckTensor(dy, op, "dy");
    CheckTensor(dx, op, "dx");
    CheckSameDevice(dy, "dy", weight, "weight", op);
    CheckSameDevice(dx, "dx", weight, "weight", op);
    CheckSameDType(dy, "dy", weight, "weight", op);
    CheckSameDType(dx, "dx", weight, "weight", op);
    const std::int64_t out = weight.size(0);
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1 && dy.shape().back() == out, op,
                       "dy's last dim must equal out_features {} of weight {}, got dy {}", out, weight.ToString(),
                       dy.ToString());
    CheckShapeWithLast(dx, dy.shape(), weight.size(1), op, "dx");
}

/// The activation a dgrad undoes: pre_activation given exactly with input_activation, of dx's shape, device and dtype;
/// pre_activation_dbias [in] only with an activation, in dx's dtype or float32.
void CheckInputActivation(const Tensor& dx, LinearActivation activation, const Tensor* pre_activation,
                          const Tensor* pre_activation_dbias, std::string_view op) {
    if (activation == LinearActivation::kNone) {
        SHARDLINE_CHECK(pre_activation == nullptr, op,
                        "pre_activation is given but input_activation is none (set input_activation = gelu_tanh)");
        SHARDLINE_CHECK(pre_activation_dbias == nullptr, op,
                        "pre_activation_dbias (the bias grad of the layer before the activation) needs "
                        "input_activation = gelu_tanh");
        return;
    }
    SHARDLINE_CHECK(pre_activation != nullptr, op, "input_activation gelu_tanh needs the pre_activation tensor");
    CheckLike(*pre_activation, "pre_activation", dx, "dx", op);
    CheckShape(*pre_activation, dx.shape(), op, "pre_activation");
    if (pre_activation_dbias != nullptr) {
        const Tensor& db = *pre_activation_dbias;
        CheckTensor(db, op, "pre_activation_dbias");
        CheckSameDevice(db, "pre_activation_dbias", dx, "dx", op);
        SHARDLINE_CHECK_AS(DTypeError, db.dtype() == dx.dtype() || db.dtype() == DType::kFloat32, op,
                           "pre_activation_dbias must have dx's dtype {} or float32, got {}", DTypeName(dx.dtype()),
                           db.ToString());
        CheckDims(db, {dx.shape().back()}, op, "pre_activation_dbias");
    }
}

/// dx_residual: dx's shape, dtype and device, and no input activation (its gradient would apply to the sum).
void CheckDxResidual(const Tensor& dx, LinearActivation activation, const Tensor* dx_residual, std::string_view op) {
    if (dx_residual == nullptr) {
        return;
    }
    SHARDLINE_CHECK(activation == LinearActivation::kNone, op,
                    "dx_residual is added to x's gradient: it takes no input_activation, got gelu_tanh");
    CheckResidual(*dx_residual, "dx_residual", dx, "dx", op);
}

void CheckBackwardWeight(const Tensor& dy, const Tensor& x, const Tensor& dweight, std::string_view op) {
    CheckTensor(dy, op, "dy");
    CheckTensor(x, op, "x");
    CheckTensor(dweight, op, "dweight");
    CheckDeviceDType(x, op, "x");
    CheckSameDevice(dy, "dy", x, "x", op);
    CheckSameDevice(dweight, "dweight", x, "x", op);
    CheckSameDType(dy, "dy", x, "x", op);
    // A float32 dweight for half x is a main grad, overwritten (beta = 0) or accumulated into (beta = 1).
    SHARDLINE_CHECK_AS(DTypeError, dweight.dtype() == x.dtype() || dweight.dtype() == DType::kFloat32, op,
                       "dweight must have x's dtype {} or be a float32 main grad, got {}", DTypeName(x.dtype()),
                       dweight.ToString());
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1 && x.rank() == dy.rank(), op,
                       "dy and x must have the same rank >= 1, got dy {} and x {}", dy.ToString(), x.ToString());
    SHARDLINE_CHECK_AS(ShapeError, std::equal(dy.shape().begin(), dy.shape().end() - 1, x.shape().begin()), op,
                       "dy {} and x {} must agree on the leading (row) dims", dy.ToString(), x.ToString());
    const std::int64_t out = dy.shape().back();
    const std::int64_t in = x.shape().back();
    SHARDLINE_CHECK_AS(ShapeError, out > 0 && in > 0, op, "features must be > 0, got dy {} and x {}", dy.ToString(),
                       x.ToString());
    CheckDims(dweight, {out, in}, op, "dweight");
}

void CheckBackwardBias(const Tensor& dy, const Tensor& dbias, std::string_view op) {
    CheckTensor(dy, op, "dy");
    CheckTensor(dbias, op, "dbias");
    CheckDeviceDType(dy, op, "dy");
    CheckSameDevice(dy, "dy", dbias, "dbias", op);
    SHARDLINE_CHECK_AS(ShapeError, dy.rank() >= 1, op, "dy must have rank >= 1, got {}", dy.ToString());
    SHARDLINE_CHECK_AS(DTypeError, dbias.dtype() == dy.dtype() || dbias.dtype() == DType::kFloat32, op,
                       "dbias must have dy's dtype {} or float32, got {}", DTypeName(dy.dtype()), dbias.ToString());
    CheckDims(dbias, {dy.shape().back()}, op, "dbias");
}

} // namespace

void LinearBackwardInput(const LinearBackwardInputArgs& args) {
    constexpr std::string_view kOp = LinearBackwardInputOp::kName;
    CheckBackwardInput(args.dy, args.weight, args.dx, kOp);
    CheckInputActivation(args.dx, args.input_activation, args.pre_activation, args.pre_activation_dbias, kOp);
    CheckDxResidual(args.dx, args.input_activation, args.dx_residual, kOp);
    if (args.dx.numel() == 0) {
        // No rows: the previous layer's bias grad is a sum over nothing.
        if (args.pre_activation_dbias != nullptr && !args.accumulate) {
            args.pre_activation_dbias->Fill(0.0);
        }
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
    CheckBackwardWeight(args.dy, args.x, args.dweight, kOp);
    if (args.dbias != nullptr) {
        CheckTensor(*args.dbias, kOp, "dbias");
        CheckSameDevice(*args.dbias, "dbias", args.x, "x", kOp);
        SHARDLINE_CHECK_AS(DTypeError, args.dbias->dtype() == args.dweight.dtype(), kOp,
                           "dbias must have dweight's dtype {}, got {}", DTypeName(args.dweight.dtype()),
                           args.dbias->ToString());
        CheckDims(*args.dbias, {args.dy.shape().back()}, kOp, "dbias");
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
    CheckBackwardBias(args.dy, args.dbias, LinearBackwardBiasOp::kName);
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

void LinearBackward(const LinearBackwardArgs& args) {
    constexpr std::string_view kOp = LinearBackwardOp::kName;
    CheckTensor(args.dy, kOp, "dy");
    CheckDeviceDType(args.dy, kOp, "dy");
    if (args.dx != nullptr) {
        SHARDLINE_CHECK(args.weight != nullptr, kOp, "dx needs the weight");
        CheckBackwardInput(args.dy, *args.weight, *args.dx, kOp);
        CheckInputActivation(*args.dx, args.input_activation, args.pre_activation, args.pre_activation_dbias, kOp);
        CheckDxResidual(*args.dx, args.input_activation, args.dx_residual, kOp);
    } else {
        SHARDLINE_CHECK(args.pre_activation_dbias == nullptr, kOp,
                        "pre_activation_dbias is Σ_rows dx: it needs dx (and the weight)");
        SHARDLINE_CHECK(args.dx_residual == nullptr, kOp, "dx_residual is added to dx: it needs dx (and the weight)");
    }
    if (args.dweight != nullptr) {
        SHARDLINE_CHECK(args.x != nullptr, kOp, "dweight needs the input x");
        CheckBackwardWeight(args.dy, *args.x, *args.dweight, kOp);
    }
    if (args.dbias != nullptr) {
        CheckBackwardBias(args.dy, *args.dbias, kOp);
        if (args.dweight != nullptr) {
            SHARDLINE_CHECK_AS(DTypeError, args.dbias->dtype() == args.dweight->dtype(), kOp,
                               "dbias must have dweight's dtype {}, got {}", DTypeName(args.dweight->dtype()),
                               args.dbias->ToString());
        }
    }
    if (args.dx == nullptr && args.dweight == nullptr && args.dbias == nullptr) {
        return;
    }
    if (args.dy.numel() == 0) {
        // No rows: dx is empty; the parameter grads are sums over nothing.
        if (!args.accumulate) {
            for (Tensor* grad : {args.dweight, args.dbias, args.pre_activation_dbias}) {
                if (grad != nullptr) {
                    grad->Fill(0.0);
                }
            }
        }
        return;
    }
    Dispatch<LinearBackwardOp>(args.dy.device().type, args);
}

namespace detail {

GemmParams LinearForwardGemm(const LinearForwardArgs& args) {
    const std::int64_t in = args.weight.size(1);
    const std::int64_t out = args.weight.size(0);
    const std::int64_t rows = Rows(args.x, LinearForwardOp::kName, "x");
    const bool gelu = args.activation == LinearActivation::kGeluTanh;
    // Row-major Y[M,out] = X[M,in]·W[out,in]ᵀ. Column-major, the same bytes read Yᶜ[out,M] = Wᶜᵀ·Xᶜ with
    // Wᶜ = W viewed [in,out] (ld in, transposed to [out,in]) and Xᶜ = X viewed [in,M] (ld in). The bias has one
    // entry per row of Yᶜ (m = out), which is what the cuBLASLt BIAS epilogue adds. A residual [M,out] is laid out as Y
    // (ld out): the GEMM's separate C with beta = 1.
    return GemmParams{.trans_a = true,
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
                      .c_in = args.residual != nullptr ? args.residual->data() : nullptr,
                      .ldc_in = args.residual != nullptr ? out : 0,
                      .beta = args.residual != nullptr ? 1.0 : 0.0,
                      .epilogue = gelu ? GemmEpilogue::kGeluAuxBias
                                       : (args.bias != nullptr ? GemmEpilogue::kBias : GemmEpilogue::kNone),
                      .bias = args.bias != nullptr ? args.bias->data() : nullptr,
                      .bias_type = args.bias != nullptr ? args.bias->dtype() : args.y.dtype(),
                      .aux = gelu ? args.pre_activation->data() : nullptr,
                      .ldaux = gelu ? out : 0,
                      .device = args.y.device()};
}

bool DgradCanFuseBiasGrad(const Tensor& dx, const Tensor& pre_activation_dbias, bool accumulate) {
    return !accumulate && pre_activation_dbias.dtype() == dx.dtype();
}

GemmParams LinearDgradGemm(const Tensor& dy, const Tensor& weight, Tensor& dx, const Tensor* pre_activation,
                           Tensor* fused_pre_dbias, const Tensor* dx_residual) {
    const std::int64_t in = weight.size(1);
    const std::int64_t out = weight.size(0);
    const std::int64_t rows = Rows(dy, LinearBackwardInputOp::kName, "dy");
    // Row-major dX[M,in] = dY[M,out]·W[out,in]. Column-major dXᶜ[in,M] = Wᶜ[in,out]·dYᶜ[out,M]: W viewed [in,out]
    // (ld in) and dY viewed [out,M] (ld out), no transposes. The pre-activation [M,in] is laid out as dX (aux ld in),
    // and DGELU_BGRAD's bias[i] = Σ_j Dᶜ[i, j] sums dX over its rows: the previous layer's bias grad [in]. A
    // dx_residual [M,in] is laid out as dX too (ld in): the GEMM's separate C with beta = 1.
    GemmEpilogue epilogue = GemmEpilogue::kNone;
    if (pre_activation != nullptr) {
        epilogue = fused_pre_dbias != nullptr ? GemmEpilogue::kDGeluBGrad : GemmEpilogue::kDGelu;
    }
    return GemmParams{.m = in,
                      .n = rows,
                      .k = out,
                      .a = weight.data(),
                      .lda = in,
                      .a_type = weight.dtype(),
                      .b = dy.data(),
                      .ldb = out,
                      .b_type = dy.dtype(),
                      .c = dx.data(),
                      .ldc = in,
                      .c_type = dx.dtype(),
                      .c_in = dx_residual != nullptr ? dx_residual->data() : nullptr,
                      .ldc_in = dx_residual != nullptr ? in : 0,
                      .beta = dx_residual != nullptr ? 1.0 : 0.0,
                      .epilogue = epilogue,
                      .bias = epilogue == GemmEpilogue::kDGeluBGrad ? fused_pre_dbias->data() : nullptr,
                      .bias_type = epilogue == GemmEpilogue::kDGeluBGrad ? fused_pre_dbias->dtype() : dx.dtype(),
                      .aux = pre_activation != nullptr ? pre_activation->data() : nullptr,
                      .ldaux = pre_activation != nullptr ? in : 0,
                      .device = dx.device()};
}

GemmParams LinearWgradGemm(const Tensor& dy, const Tensor& x, Tensor& dweight, Tensor* fused_dbias, bool accumulate) {
    const std::int64_t in = x.shape().back();
    const std::int64_t out = dy.shape().back();
    const std::int64_t rows = Rows(dy, LinearBackwardWeightOp::kName, "dy");
    // Row-major dW[out,in] = dY[M,out]ᵀ·X[M,in]. Column-major dWᶜ[in,out] = Xᶜ[in,M]·dYᶜ[out,M]ᵀ: X viewed [in,M]
    // (ld in), dY viewed [out,M] (ld out) and transposed. The reduction runs over k = M, so BGRADB's sum over k of
    // op(B) = dYᵀ gives db[out]. accumulate: beta = 1 into dW (e.g. an fp32 main grad for bf16 operands).
    return GemmParams{.trans_a = false,
                      .trans_b = true,
                      .m = in,
                      .n = out,
                      .k = rows,
                      .a = x.data(),
                      .lda = in,
                      .a_type = x.dtype(),
                      .b = dy.data(),
                      .ldb = out,
                      .b_type = dy.dtype(),
                      .c = dweight.data(),
                      .ldc = in,
                      .c_type = dweight.dtype(),
                      .beta = accumulate ? 1.0 : 0.0,
                      .epilogue = fused_dbias != nullptr ? GemmEpilogue::kBGradB : GemmEpilogue::kNone,
                      .bias = fused_dbias != nullptr ? fused_dbias->data() : nullptr,
                      .bias_type = fused_dbias != nullptr ? fused_dbias->dtype() : dy.dtype(),
                      .device = dweight.device()};
}

void CompositeLinearBackward(const LinearBackwardArgs& args) {
    if (args.dx != nullptr) {
        LinearBackwardInput(LinearBackwardInputArgs{.dy = args.dy,
                                                    .weight = *args.weight,
                                                    .dx = *args.dx,
                                                    .input_activation = args.input_activation,
                                                    .pre_activation = args.pre_activation,
                                                    .pre_activation_dbias = args.pre_activation_dbias,
                                                    .accumulate = args.accumulate,
                                                    .dx_residual = args.dx_residual});
    }
    if (args.dweight != nullptr) {
        LinearBackwardWeight(LinearBackwardWeightArgs{
            .dy = args.dy, .x = *args.x, .dweight = *args.dweight, .dbias = args.dbias, .accumulate = args.accumulate});
    } else if (args.dbias != nullptr) {
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = args.dy, .dbias = *args.dbias, .accumulate = args.accumulate});
    }
}

} // namespace detail

namespace detail {
void RegisterLinearCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<LinearForwardOp>(d, kDefaultProvider, &DefaultLinearForward);
        Register<LinearBackwardInputOp>(d, kDefaultProvider, &DefaultLinearBackwardInput);
        Register<LinearBackwardWeightOp>(d, kDefaultProvider, &DefaultLinearBackwardWeight);
        Register<LinearBackwardOp>(d, kDefaultProvider, &CompositeLinearBackward);
    }
}
} // namespace detail

} // namespace shardline::kernels
