// linear: y[..., n] = sum_k x[..., k] * weight[n, k] + bias[n] as the einsum "...k,nk,n->...n"; with Paddle's
// fused_gemm_epilogue attributes trans_x ("...km" -> "...mn") and trans_y = false (weight "kn", [in, out]).
// Conflicts go to the parameters (weight, then bias, then x): parameters never move, activations do, which is what
// gives Megatron's column / row parallel communication. The bias is an additive term: its gradient is the output
// gradient summed over the batch labels only, and on a Partial output it is added once after the reduction.

#include <shardline/spmd/rules.h>

#include "problems.h"
#include "rule_util.h"

namespace shardline::spmd {

namespace {

constexpr int kWeightPriority = 0;
constexpr int kBiasPriority = 1;
constexpr int kInputPriority = 2;

} // namespace

EinsumProblem detail::LinearProblem(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                    const std::optional<TensorSpec> &bias, const LinearAttrs &attrs) {
    detail::CheckSpec(mesh, x, "linear", "x");
    detail::CheckSpec(mesh, weight, "linear", "weight");
    if (x.shape.size() < (attrs.trans_x ? 2u : 1u)) {
        throw SpmdError(fmt::format("linear: x must have rank >= {} ({}), got {}", attrs.trans_x ? 2 : 1,
                                    attrs.trans_x ? "[..., in_features, m] with trans_x" : "[..., in_features]",
                                    ShapeToString(x.shape)));
    }
    if (weight.shape.size() != 2) {
        throw SpmdError(fmt::format("linear: weight must be {}, got {}",
                                    attrs.trans_y ? "[out_features, in_features]" : "[in_features, out_features]",
                                    ShapeToString(weight.shape)));
    }
    // Step 1 of Paddle's rule: the einsum notation. x "...k" ("...km" with trans_x), weight "nk" ("kn" without
    // trans_y), bias "n", out "...n" ("...mn").
    const size_t x_in = x.shape.size() - (attrs.trans_x ? 2 : 1);
    const int64_t in_features = x.shape[x_in];
    const int64_t weight_in = weight.shape[attrs.trans_y ? 1 : 0];
    const int64_t out_features = weight.shape[attrs.trans_y ? 0 : 1];
    if (in_features != weight_in) {
        throw SpmdError(fmt::format("linear: x.shape[{}] ({}) must equal weight.shape[{}] (in_features, {}) "
                                    "(trans_x={}, trans_y={})",
                                    attrs.trans_x ? -2 : -1, in_features, attrs.trans_y ? 1 : 0, weight_in,
                                    attrs.trans_x, attrs.trans_y));
    }
    const std::string batch = detail::BatchLabels(x_in, "linear");
    EinsumProblem problem;
    problem.op = "linear";
    problem.inputs.push_back(detail::Operand("x", batch + (attrs.trans_x ? "km" : "k"), x, kInputPriority));
    problem.inputs.push_back(detail::Operand("weight", attrs.trans_y ? "nk" : "kn", weight, kWeightPriority));
    if (bias) {
        detail::CheckSpec(mesh, *bias, "linear", "bias");
        if (bias->shape.size() != 1 || bias->shape[0] != out_features) {
            throw SpmdError(fmt::format("linear: bias must be [out_features] = [{}], got {}", out_features,
                                        ShapeToString(bias->shape)));
        }
        problem.inputs.push_back(
            detail::Operand("bias", "n", *bias, kBiasPriority, /*linear=*/false, /*additive_term=*/true));
    }
    problem.output = batch + (attrs.trans_x ? "mn" : "n");
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

namespace {

SpmdInfo Finish(SpmdInfo info, bool has_bias) {
    info.bias_after_reduction = has_bias && info.outputs[0].layout.IsPartial();
    return info;
}

} // namespace

SpmdInfo InferLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const LinearAttrs &attrs,
                            const RuleOptions &options) {
    const EinsumProblem problem = detail::LinearProblem(mesh, x, weight, bias, attrs);
    return Finish(detail::FromForward(InferEinsumForward(mesh, problem, options), problem), bias.has_value());
}

SpmdInfo InferLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const TensorSpec &out, const LinearAttrs &attrs,
                            const RuleOptions &options) {
    const EinsumProblem problem = detail::LinearProblem(mesh, x, weight, bias, attrs);
    detail::CheckSpec(mesh, out, "linear", "out");
    return Finish(detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem),
                  bias.has_value());
}

SpmdInfo InferLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                         const std::optional<TensorSpec> &bias, const TensorSpec &out_grad, const LinearAttrs &attrs,
                         const RuleOptions &options) {
    const EinsumProblem problem = detail::LinearProblem(mesh, x, weight, bias, attrs);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem,
                            std::vector<bool>(problem.inputs.size(), true));
}

SpmdInfo InferLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const RuleOptions &options) {
    return InferLinearForward(mesh, x, weight, bias, LinearAttrs{}, options);
}

SpmdInfo InferLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const TensorSpec &out, const RuleOptions &options) {
    return InferLinearReverse(mesh, x, weight, bias, out, LinearAttrs{}, options);
}

SpmdInfo InferLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                         const std::optional<TensorSpec> &bias, const TensorSpec &out_grad,
                         const RuleOptions &options) {
    return InferLinearGrad(mesh, x, weight, bias, out_grad, LinearAttrs{}, options);
}

} // namespace shardline::spmd
