#pragma once

// Linear kernels: W is [out, in], X is [..., in] (flattened to [M, in]), Y = X·Wᵀ + b is [..., out].
// No kernel takes autograd flags: the caller decides which of them to run.

#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

/// An activation fused into a Linear's GEMMs. Forward (LinearForwardArgs::activation): applied to the output. Backward
/// (input_activation): the activation that made this layer's input, x = act(pre_activation), whose gradient the dgrad
/// GEMM applies, so that dx is the pre-activation's gradient (Megatron's ParallelMLP: fc1 → GELU → fc2, the GELU in
/// fc1's epilogue and its gradient in fc2's dgrad epilogue).
enum class LinearActivation : std::uint8_t {
    kNone,
    kGeluTanh, ///< forward y = gelu_tanh(x·Wᵀ + b), the pre-activation saved (cuBLASLt GELU_AUX_BIAS);
               ///< backward dx = (dy·W) ⊙ gelu_tanh'(pre_activation) (cuBLASLt DGELU / DGELU_BGRAD)
};

struct LinearForwardArgs {
    const Tensor& x;              ///< [..., in]
    const Tensor& weight;         ///< [out, in]
    const Tensor* bias = nullptr; ///< [out], same dtype as y
    Tensor& y;                    ///< [..., out]
    LinearActivation activation = LinearActivation::kNone;
    Tensor* pre_activation = nullptr; ///< [..., out]; required with kGeluTanh
    /// [..., out] (y's shape, dtype and device): y = x·Wᵀ + b + residual, the residual connection of a block whose
    /// output this layer makes, added by the GEMM (its C, beta = 1: no separate add kernel). Only read; it may be y
    /// itself (then y += x·Wᵀ + b). Not with an activation.
    const Tensor* residual = nullptr;
};
struct LinearForwardOp {
    static constexpr std::string_view kName = "LinearForward";
    using Fn = void (*)(const LinearForwardArgs&);
};
/// y = x·weightᵀ + bias (+ residual) (bias and residual in the GEMM: one launch on CUDA).
void LinearForward(const LinearForwardArgs& args);
Tensor LinearForward(const Tensor& x, const Tensor& weight, const Tensor* bias = nullptr);

struct LinearBackwardInputArgs {
    const Tensor& dy;     ///< [..., out]
    const Tensor& weight; ///< [out, in]
    Tensor& dx;           ///< [..., in], overwritten
    /// kGeluTanh: x was gelu_tanh(pre_activation); dx becomes the pre-activation's gradient (dy·W) ⊙ gelu_tanh'(pre).
    LinearActivation input_activation = LinearActivation::kNone;
    const Tensor* pre_activation = nullptr; ///< [..., in], dx's dtype; required with input_activation
    /// [in] (+)= Σ_rows dx: the bias grad of the layer that made pre_activation (needs input_activation); dx's dtype,
    /// or float32 (a main grad). Fused in the dgrad GEMM (DGELU_BGRAD) where that measures faster and it is
    /// overwritten.
    Tensor* pre_activation_dbias = nullptr;
    bool accumulate = false; ///< pre_activation_dbias += instead of =
    /// [..., in] (dx's shape, dtype and device): dx = dy·W + dx_residual, the gradient that reaches x by another path
    /// (a residual connection's pass-through, y = x + f(x)), added by the dgrad GEMM (its C, beta = 1). Only read; it
    /// may be dx itself. Not with input_activation.
    const Tensor* dx_residual = nullptr;
};
struct LinearBackwardInputOp {
    static constexpr std::string_view kName = "LinearBackwardInput";
    using Fn = void (*)(const LinearBackwardInputArgs&);
};
/// dx = dy·weight (+ dx_residual); with input_activation dx = (dy·weight) ⊙ gelu_tanh'(pre_activation), and optionally
/// pre_activation_dbias (+)= Σ_rows dx.
void LinearBackwardInput(const LinearBackwardInputArgs& args);
Tensor LinearBackwardInput(const Tensor& dy, const Tensor& weight);

struct LinearBackwardWeightArgs {
    const Tensor& dy;        ///< [..., out]
    const Tensor& x;         ///< [..., in]
    Tensor& dweight;         ///< [out, in]; dtype of x, or float32 (a main grad) when accumulating
    Tensor* dbias = nullptr; ///< [out]: also compute the bias grad (fused in the GEMM where supported)
    bool accumulate = false; ///< dweight (and dbias) += instead of =
};
struct LinearBackwardWeightOp {
    static constexpr std::string_view kName = "LinearBackwardWeight";
    using Fn = void (*)(const LinearBackwardWeightArgs&);
};
/// dweight (+)= dyᵀ·x; optionally dbias (+)= Σ_rows dy.
void LinearBackwardWeight(const LinearBackwardWeightArgs& args);
Tensor LinearBackwardWeight(const Tensor& dy, const Tensor& x);

struct LinearBackwardBiasArgs {
    const Tensor& dy; ///< [..., out]
    Tensor& dbias;    ///< [out]
    bool accumulate = false;
};
struct LinearBackwardBiasOp {
    static constexpr std::string_view kName = "LinearBackwardBias";
    using Fn = void (*)(const LinearBackwardBiasArgs&);
};
/// dbias (+)= Σ_rows dy, accumulated in fp32 (fp64 for fp64).
void LinearBackwardBias(const LinearBackwardBiasArgs& args);
Tensor LinearBackwardBias(const Tensor& dy);

/// The grads a caller needs, computed together: each output that is given is computed, the others are not (the
/// caller decides which, as with the split ops). On CUDA a bias grad run as a separate column sum (where fusing it in
/// the wgrad GEMM measures slower, gemm_tuning.h) of 2^15+ elements, or in a capture, runs on a side stream beside the
/// GEMMs; so does the previous layer's (pre_activation_dbias) when apart from the dgrad GEMM, beside the wgrad GEMM.
/// The split ops LinearBackwardInput/Weight/Bias remain for callers that schedule the pieces themselves.
struct LinearBackwardArgs {
    const Tensor& dy;               ///< [..., out]
    const Tensor* x = nullptr;      ///< [..., in]; needed for dweight
    const Tensor* weight = nullptr; ///< [out, in]; needed for dx
    Tensor* dx = nullptr;           ///< [..., in], overwritten
    Tensor* dweight = nullptr;      ///< [out, in] (+)=; dtype of dy, or float32 (a main grad) when accumulating
    Tensor* dbias = nullptr;        ///< [out] (+)=; dweight's dtype when both are given
    bool accumulate = false;        ///< dweight, dbias and pre_activation_dbias += instead of =
    /// As LinearBackwardInputArgs: x = input_activation(pre_activation), dx is the pre-activation's gradient, and
    /// pre_activation_dbias (+)= Σ_rows dx is the previous layer's bias grad (needs dx).
    LinearActivation input_activation = LinearActivation::kNone;
    const Tensor* pre_activation = nullptr; ///< [..., in]; required with input_activation and dx
    Tensor* pre_activation_dbias = nullptr; ///< [in]; dx's dtype, or float32 (a main grad)
    const Tensor* dx_residual = nullptr;    ///< as LinearBackwardInputArgs: dx = dy·W + dx_residual (needs dx)
};
struct LinearBackwardOp {
    static constexpr std::string_view kName = "LinearBackward";
    using Fn = void (*)(const LinearBackwardArgs&);
};
/// dx = dy·weight (⊙ gelu_tanh'(pre_activation) with input_activation; + dx_residual); dweight (+)= dyᵀ·x;
/// dbias (+)= Σ_rows dy;
/// pre_activation_dbias (+)= Σ_rows dx — each where given.
void LinearBackward(const LinearBackwardArgs& args);

} // namespace shardline::kernels
