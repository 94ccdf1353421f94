#pragma once

// Linear kernels: W is [out, in], X is [..., in] (flattened to [M, in]), Y = X·Wᵀ + b is [..., out].
// No kernel takes autograd flags: the caller decides which of them to run.

#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

enum class LinearActivation : std::uint8_t {
    kNone,
    kGeluTanh, ///< y = gelu_tanh(x·Wᵀ + b), the pre-activation saved (cuBLASLt GELU_AUX_BIAS)
};

struct LinearForwardArgs {
    const Tensor& x;              ///< [..., in]
    const Tensor& weight;         ///< [out, in]
    const Tensor* bias = nullptr; ///< [out], same dtype as y
    Tensor& y;                    ///< [..., out]
    LinearActivation activation = LinearActivation::kNone;
    Tensor* pre_activation = nullptr; ///< [..., out]; required with kGeluTanh
};
struct LinearForwardOp {
    static constexpr std::string_view kName = "LinearForward";
    using Fn = void (*)(const LinearForwardArgs&);
};
/// y = x·weightᵀ + bias (bias in the GEMM epilogue: one launch on CUDA).
void LinearForward(const LinearForwardArgs& args);
Tensor LinearForward(const Tensor& x, const Tensor& weight, const Tensor* bias = nullptr);

struct LinearBackwardInputArgs {
    const Tensor& dy;     ///< [..., out]
    const Tensor& weight; ///< [out, in]
    Tensor& dx;           ///< [..., in], overwritten
};
struct LinearBackwardInputOp {
    static constexpr std::string_view kName = "LinearBackwardInput";
    using Fn = void (*)(const LinearBackwardInputArgs&);
};
/// dx = dy·weight.
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
/// caller decides which, as with the split ops). On CUDA the bias grad, when it runs as a separate column sum (where
/// fusing it into the wgrad GEMM measures slower, see gemm_tuning.h), runs on a side stream overlapping the GEMMs; the
/// split ops LinearBackwardInput/Weight/Bias remain for callers that schedule the pieces themselves.
struct LinearBackwardArgs {
    const Tensor& dy;               ///< [..., out]
    const Tensor* x = nullptr;      ///< [..., in]; needed for dweight
    const Tensor* weight = nullptr; ///< [out, in]; needed for dx
    Tensor* dx = nullptr;           ///< [..., in], overwritten
    Tensor* dweight = nullptr;      ///< [out, in] (+)=; dtype of dy, or float32 (a main grad) when accumulating
    Tensor* dbias = nullptr;        ///< [out] (+)=; dweight's dtype when both are given
    bool accumulate = false;        ///< dweight and dbias += instead of =
};
struct LinearBackwardOp {
    static constexpr std::string_view kName = "LinearBackward";
    using Fn = void (*)(const LinearBackwardArgs&);
};
/// dx = dy·weight; dweight (+)= dyᵀ·x; dbias (+)= Σ_rows dy — each where given.
void LinearBackward(const LinearBackwardArgs& args);

} // namespace shardline::kernels
