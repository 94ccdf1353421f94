#pragma once

// Private to src/kernels: the GEMMs behind the Linear ops, as GemmParams, shared by the default compositions
// (linear.cc) and the CUDA LinearBackward kernel (cuda/linear_backward.cc), and the composition of LinearBackward
// from the split ops.

#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

namespace shardline::kernels::detail {

/// Y = X·Wᵀ (+ bias / GELU epilogue) of LinearForward.
GemmParams LinearForwardGemm(const LinearForwardArgs& args);
/// dX = dY·W; with a pre-activation (x = gelu_tanh(pre_activation)) dX ⊙= gelu_tanh'(pre_activation) (DGELU), and
/// with `fused_pre_dbias` also fused_pre_dbias = Σ_rows dX (DGELU_BGRAD; see DgradCanFuseBiasGrad). With
/// `dx_residual` (no pre-activation): dX = dY·W + dx_residual, the GEMM's separate C with beta = 1.
GemmParams LinearDgradGemm(const Tensor& dy, const Tensor& weight, Tensor& dx, const Tensor* pre_activation = nullptr,
                           Tensor* fused_pre_dbias = nullptr, const Tensor* dx_residual = nullptr);
/// Whether the previous layer's bias grad may ride in the dgrad GEMM's DGELU_BGRAD epilogue: the epilogue writes (it
/// cannot accumulate) a vector of D's dtype.
bool DgradCanFuseBiasGrad(const Tensor& dx, const Tensor& pre_activation_dbias, bool accumulate);
/// dW (+)= dYᵀ·X; with `fused_dbias`, the BGRADB epilogue also writes db = Σ_rows dY (accumulate must be false).
GemmParams LinearWgradGemm(const Tensor& dy, const Tensor& x, Tensor& dweight, Tensor* fused_dbias, bool accumulate);
/// LinearBackward as the split ops (LinearBackwardInput, LinearBackwardWeight, LinearBackwardBias), each dispatched:
/// the "default" kernel of every device, and what a provider without its own LinearBackward gets.
void CompositeLinearBackward(const LinearBackwardArgs& args);

} // namespace shardline::kernels::detail
