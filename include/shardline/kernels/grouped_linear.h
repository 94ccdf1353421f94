#pragma once

// Grouped Linear kernels for mixture-of-experts: E experts, W is [E, out, in], bias [E, out]; the rows of x [T, in]
// are grouped by expert: group e owns rows [offset_e, offset_e + sizes[e]) with offset_e = sizes[0] + … + sizes[e-1]
// and Σ sizes = T. `group_sizes` is an int64 [E] tensor on the host or on x's device. Groups with no rows are normal
// (routing produces them): they launch nothing, their dweight/dbias are zero (untouched when accumulating).
// No kernel takes autograd flags: the caller decides which of them to run.

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>
#include <shardline/kernels/linear.h>

namespace shardline::kernels {

struct GroupedLinearForwardArgs {
    const Tensor& x;              ///< [T, in]
    const Tensor& weight;         ///< [E, out, in]
    const Tensor* bias = nullptr; ///< [E, out], y's dtype
    const Tensor& group_sizes;    ///< [E] int64, host or x's device
    Tensor& y;                    ///< [T, out]
};
struct GroupedLinearForwardOp {
    static constexpr std::string_view kName = "GroupedLinearForward";
    using Fn = void (*)(const GroupedLinearForwardArgs&);
};
/// y_e = x_e·W_eᵀ + b_e for every group e.
void GroupedLinearForward(const GroupedLinearForwardArgs& args);
Tensor GroupedLinearForward(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& group_sizes);

struct GroupedLinearBackwardInputArgs {
    const Tensor& dy;          ///< [T, out]
    const Tensor& weight;      ///< [E, out, in]
    const Tensor& group_sizes; ///< [E] int64
    Tensor& dx;                ///< [T, in], overwritten
    /// kGeluTanh: x was gelu_tanh(pre_activation) (an expert MLP's fc1 → GELU → this layer); dx becomes the
    /// pre-activation's gradient (dy_e·W_e) ⊙ gelu_tanh'(pre_activation_e), in the grouped GEMM's epilogue
    /// (GroupedGemmParams's kDGelu).
    LinearActivation input_activation = LinearActivation::kNone;
    const Tensor* pre_activation = nullptr; ///< [T, in], dx's dtype and device; required with input_activation
};
struct GroupedLinearBackwardInputOp {
    static constexpr std::string_view kName = "GroupedLinearBackwardInput";
    using Fn = void (*)(const GroupedLinearBackwardInputArgs&);
};
/// dx_e = dy_e·W_e (⊙ gelu_tanh'(pre_activation_e) with input_activation).
void GroupedLinearBackwardInput(const GroupedLinearBackwardInputArgs& args);

struct GroupedLinearBackwardWeightArgs {
    const Tensor& dy;          ///< [T, out]
    const Tensor& x;           ///< [T, in]
    const Tensor& group_sizes; ///< [E] int64
    Tensor& dweight;           ///< [E, out, in]; x's dtype, or float32 (a main grad) when accumulating
    Tensor* dbias = nullptr;   ///< [E, out]: also the bias grad, dweight's dtype
    bool accumulate = false;   ///< dweight (and dbias) += instead of =
};
struct GroupedLinearBackwardWeightOp {
    static constexpr std::string_view kName = "GroupedLinearBackwardWeight";
    using Fn = void (*)(const GroupedLinearBackwardWeightArgs&);
};
/// dW_e (+)= dy_eᵀ·x_e; optionally db_e (+)= Σ_rows dy_e.
void GroupedLinearBackwardWeight(const GroupedLinearBackwardWeightArgs& args);

struct GroupedLinearBackwardBiasArgs {
    const Tensor& dy;          ///< [T, out]
    const Tensor& group_sizes; ///< [E] int64
    Tensor& dbias;             ///< [E, out]; dy's dtype or float32
    bool accumulate = false;
};
struct GroupedLinearBackwardBiasOp {
    static constexpr std::string_view kName = "GroupedLinearBackwardBias";
    using Fn = void (*)(const GroupedLinearBackwardBiasArgs&);
};
/// db_e (+)= Σ_rows dy_e, accumulated in fp32 (fp64 for fp64).
void GroupedLinearBackwardBias(const GroupedLinearBackwardBiasArgs& args);

/// The backward of a grouped Linear in one call, for exactly the gradients given (nullptr: not wanted), as
/// LinearBackward is for Linear: dx_e = dy_e·W_e, dW_e (+)= dy_eᵀ·x_e, db_e (+)= Σ_rows dy_e. dbias may be dy's dtype
/// or float32 whatever dweight's is. Each result equals the split op's (GroupedLinearBackwardInput / Weight / Bias).
/// The CUDA default provider runs the wgrad and bias grad on the device's side stream beside the dgrad when both dx and
/// a parameter grad are wanted (GetGroupedConcurrentBackward); the caller still sees one stream.
struct GroupedLinearBackwardArgs {
    const Tensor& dy;               ///< [T, out]
    const Tensor* x = nullptr;      ///< [T, in]; needed for dweight
    const Tensor* weight = nullptr; ///< [E, out, in]; needed for dx
    const Tensor& group_sizes;      ///< [E] int64, host or dy's device
    Tensor* dx = nullptr;           ///< [T, in], overwritten
    Tensor* dweight = nullptr;      ///< [E, out, in]; x's dtype, or float32 (a main grad) when accumulating
    Tensor* dbias = nullptr;        ///< [E, out]; dy's dtype or float32
    bool accumulate = false;        ///< dweight and dbias += instead of =
    /// As GroupedLinearBackwardInputArgs's: dx becomes the pre-activation's gradient (needs dx).
    LinearActivation input_activation = LinearActivation::kNone;
    const Tensor* pre_activation = nullptr; ///< [T, in]; required with input_activation
};
struct GroupedLinearBackwardOp {
    static constexpr std::string_view kName = "GroupedLinearBackward";
    using Fn = void (*)(const GroupedLinearBackwardArgs&);
};
/// dx_e = dy_e·W_e; dW_e (+)= dy_eᵀ·x_e; db_e (+)= Σ_rows dy_e — those of dx, dweight, dbias that are given. Every
/// argument is checked before any kernel runs.
void GroupedLinearBackward(const GroupedLinearBackwardArgs& args);

/// Whether the CUDA default provider of GroupedLinearBackward runs the wgrad (and the bias grad) on the device's side
/// stream, forked from the compute stream after everything queued so far and joined back before the call returns,
/// while the dgrad runs on the compute stream: the tail of one persistent grouped kernel then overlaps the other. The
/// results are bitwise the same either way. It applies where the two would not otherwise wait on the host or time
/// candidates: the wgrad takes the CUTLASS path and neither GEMM's shape class is still to be tuned (a first call runs
/// one after the other and tunes). Start: SHARDLINE_GROUPED_CONCURRENT_BWD (1, the default; 0 off).
bool GetGroupedConcurrentBackward();
void SetGroupedConcurrentBackward(bool on);
/// How many GroupedLinearBackward calls since the start ran their parameter grads beside the dgrad (tests and benches
/// check which path ran).
std::uint64_t GroupedConcurrentBackwardRuns();

struct GroupedBiasAddArgs {
    const Tensor& y;           ///< [T, out], updated in place
    const Tensor& bias;        ///< [E, out], y's dtype
    const Tensor& group_sizes; ///< [E] int64, host or y's device
};
struct GroupedBiasAddOp {
    static constexpr std::string_view kName = "GroupedBiasAdd";
    using Fn = void (*)(const GroupedBiasAddArgs&);
};
/// y_e += b_e on every group's rows: the bias a row-parallel grouped layer adds once, after the reduction. The CUDA
/// default provider adds it in one launch that reads the sizes on the device (host sizes uploaded first), so with
/// device sizes no host code waits and a CUDA graph captures it; the CPU default is one BiasAdd per group.
void GroupedBiasAdd(const Tensor& y, const Tensor& bias, const Tensor& group_sizes);

} // namespace shardline::kernels
