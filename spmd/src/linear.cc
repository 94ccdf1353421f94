// linear: y[..., n] = sum_k x[..., k] * weight[n, k] + bias[n] as the einsum "...k,nk,n->...n".
// Conflicts go to the parameters (weight, then bias, then x): parameters never move, activations do, which is what
// gives Megatron's column / row parallel communication. The bias is an additive term: its gradient is the output
// gradient summed over the batch labels only, and on a Partial output it is added once after the reduction.

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

constexpr int kWeightPriority = 0;
constexpr int kBiasPriority = 1;
constexpr int kInputPriority = 2;

EinsumProblem LinearProblem(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias) {
    detail::CheckSpec(mesh, x, "linear", "x");
    detail::CheckSpec(mesh, weight, "linear", "weight");
    if (x.shape.empty()) {
        throw SpmdError("linear: x must have rank >= 1 ([..., in_features]), got []");
    }
    if (weight.shape.size() != 2) {
        throw SpmdError(
            fmt::format("linear: weight must be [out_features, in_features], got {}", ShapeToString(weight.shape)));
    }
    if (x.shape.back() != weight.shape[1]) {
        throw SpmdError(fmt::format("linear: x.shape[-1] ({}) must equal weight.shape[1] (in_features, {})",
                                    x.shape.back(), weight.shape[1]));
    }
    const std::string batch = detail::BatchLabels(x.shape.size() - 1, "linear");
    EinsumProblem problem;
    problem.op = "linear";
    problem.inputs.push_back(detail::Operand("x", batch + "k", x, kInputPriority));
    problem.inputs.push_back(detail::Operand("weight", "nk", weight, kWeightPriority));
    if (bias) {
        detail::CheckSpec(mesh, *bias, "linear", "bias");
        if (bias->shape.size() != 1 || bias->shape[0] != weight.shape[0]) {
            throw SpmdError(fmt::format("linear: bias must be [out_features] = [{}], got {}", weight.shape[0],
                                        ShapeToString(bias->shape)));
        }
        problem.inputs.push_back(
            detail::Operand("bias", "n", *bias, kBiasPriority, /*linear=*/false, /*additive_term=*/true));
    }
    problem.output = batch + "n";
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

SpmdInfo Finish(SpmdInfo info, bool has_bias) {
    info.bias_after_reduction = has_bias && info.outputs[0].layout.IsPartial();
    return info;
}

} // namespace

SpmdInfo InferLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const RuleOptions &options) {
    const EinsumProblem problem = LinearProblem(mesh, x, weight, bias);
    return Finish(detail::FromForward(InferEinsumForward(mesh, problem, options), problem), bias.has_value());
}

SpmdInfo InferLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const TensorSpec &out, const RuleOptions &options) {
    const EinsumProblem problem = LinearProblem(mesh, x, weight, bias);
    detail::CheckSpec(mesh, out, "linear", "out");
    return Finish(detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem),
                  bias.has_value());
}

SpmdInfo InferLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                         const std::optional<TensorSpec> &bias, const TensorSpec &out_grad,
                         const RuleOptions &options) {
    const EinsumProblem problem = LinearProblem(mesh, x, weight, bias);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem,
                            std::vector<bool>(problem.inputs.size(), true));
}

} // namespace shardline::spmd
