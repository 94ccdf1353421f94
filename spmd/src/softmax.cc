// softmax / log_softmax along an axis: elementwise in every other dim ("abc->abc"); the axis must be Replicate,
// unless vocab_parallel, where it stays sharded and the op all-reduces the row max and the sum of exponentials
// over the axis's mesh dims (forward) and the row sum of dy * y (backward). Partial inputs are reduced first.

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

EinsumProblem SoftmaxProblem(const ProcessMesh &mesh, const TensorSpec &x, const SoftmaxAttrs &attrs, int *axis) {
    const char *op = attrs.log ? "log_softmax" : "softmax";
    detail::CheckSpec(mesh, x, op, "x");
    if (x.shape.empty()) {
        throw SpmdError(fmt::format("{}: x must have rank >= 1, got []", op));
    }
    *axis = detail::NormalizeAxis(attrs.axis, static_cast<int>(x.shape.size()), op);
    const std::string labels = detail::BatchLabels(x.shape.size(), op);
    EinsumProblem problem;
    problem.op = op;
    problem.inputs.push_back(detail::Operand("x", labels, x, 0, /*linear=*/false));
    problem.output = labels;
    problem.partial_policy = PartialPolicy::kResolve;
    if (!attrs.vocab_parallel) {
        problem.unshardable = std::string(1, labels[*axis]);
    }
    return problem;
}

std::vector<InternalCollective> Internal(const Layout &layout, int axis, bool backward) {
    std::vector<InternalCollective> internal;
    for (int d : layout.MeshDims(axis)) {
        if (backward) {
            internal.push_back({Collective::kAllReduce, d, ReduceOp::kSum, "row sum of dy * y"});
        } else {
            internal.push_back({Collective::kAllReduce, d, ReduceOp::kMax, "row max"});
            internal.push_back({Collective::kAllReduce, d, ReduceOp::kSum, "row sum of exp(x - max)"});
        }
    }
    return internal;
}

} // namespace

SpmdInfo InferSoftmaxForward(const ProcessMesh &mesh, const TensorSpec &x, const SoftmaxAttrs &attrs,
                             const RuleOptions &options) {
    int axis = 0;
    const EinsumProblem problem = SoftmaxProblem(mesh, x, attrs, &axis);
    SpmdInfo info = detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
    info.internal = Internal(info.outputs[0].layout, axis, /*backward=*/false);
    return info;
}

SpmdInfo InferSoftmaxReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                             const SoftmaxAttrs &attrs, const RuleOptions &options) {
    int axis = 0;
    const EinsumProblem problem = SoftmaxProblem(mesh, x, attrs, &axis);
    detail::CheckSpec(mesh, out, problem.op, "out");
    SpmdInfo info = detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
    info.internal = Internal(info.outputs[0].layout, axis, /*backward=*/false);
    return info;
}

SpmdInfo InferSoftmaxGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                          const SoftmaxAttrs &attrs, const RuleOptions &options) {
    int axis = 0;
    const EinsumProblem problem = SoftmaxProblem(mesh, x, attrs, &axis);
    SpmdInfo info = detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {true});
    // The backward reads the forward output y (same layout as x), not x.
    info.input_names[0] = "out";
    info.internal = Internal(info.inputs[0].layout, axis, /*backward=*/true);
    return info;
}

} // namespace shardline::spmd
