#pragma once

// Differentiable ops on Variables. Each is a Function over the dist op of the same name (dist/ops.h): the SPMD rules
// decide the layouts and the communication; the Function decides which backward kernels run (needs_input_grad) and
// saves only what they need.

#include <optional>
#include <vector>

#include <shardline/autograd/function.h>
#include <shardline/dist/ops.h>
#include <shardline/kernels/elementwise.h>

namespace shardline::autograd {

struct LinearOptions {
    /// Redistribute y to this layout (gather_output; a row-parallel output's all-reduce or reduce-scatter).
    std::optional<spmd::Layout> output_layout{};
    /// Leave the bias out (Megatron's skip_bias_add: the caller adds it, e.g. fused into the next op).
    bool skip_bias = false;
};
/// y = x·weightᵀ + bias. Saves x only if the weight needs a grad and the weight only if x does; backward runs
/// LinearBackwardInput only if x needs a grad, LinearBackwardWeight only if the weight does, the bias grad only if
/// the bias does (fused into the weight-grad GEMM when both are needed).
Variable Linear(const Variable& x, const Variable& weight, const Variable& bias = {}, const LinearOptions& options = {});

Variable Gelu(const Variable& x, kernels::GeluApproximation approximation = kernels::GeluApproximation::kTanh);
/// a + alpha·b (same shape).
Variable Add(const Variable& a, const Variable& b, double alpha = 1.0);
/// x + bias broadcast over the rows of x.
Variable BiasAdd(const Variable& x, const Variable& bias);
Variable Scale(const Variable& x, double alpha);
/// Σ over dims (empty: all), which must be a prefix or a suffix of x's dims.
Variable Sum(const Variable& x, const std::vector<int>& dims = {}, bool keepdim = false);
Variable Mean(const Variable& x, const std::vector<int>& dims = {}, bool keepdim = false);
/// torch.matmul with batch broadcasting (rank ≥ 2).
Variable Matmul(const Variable& a, const Variable& b);
/// out[i, j] = x[i]·y[j].
Variable Outer(const Variable& x, const Variable& y);
/// weight[ids] (ids int64, no gradient).
Variable Embedding(const Variable& ids, const Variable& weight);
/// Cross-entropy of logits [..., C] against int64 labels [...] (no gradient for labels).
Variable CrossEntropy(const Variable& logits, const Variable& labels, const dist::CrossEntropyOptions& options = {});
/// The same value in another layout (the planner's collectives); backward moves the gradient back.
Variable Redistribute(const Variable& x, const spmd::Layout& layout);

} // namespace shardline::autograd
