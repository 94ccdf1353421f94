// reductions: sum / mean / max / min / prod over axes as the einsum "abc->ac". A sharded reduced dim makes the output
// Partial with the reduction's op (mean: P(sum), its local kernel divides by the global count so uneven shards are
// exact; prod: P(prod)). keepdim outputs carry the reduced dims as Replicate size-1 dims.

#include <algorithm>
#include <set>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

std::string_view Name(ReductionKind kind) {
    switch (kind) {
    case ReductionKind::kSum:
        return "sum";
    case ReductionKind::kMean:
        return "mean";
    case ReductionKind::kMax:
        return "max";
    case ReductionKind::kMin:
        return "min";
    case ReductionKind::kProd:
        return "prod";
    }
    return "?";
}

struct ReductionSetup {
    EinsumProblem problem;
    std::vector<bool> reduced; // per input dim
};

ReductionSetup Setup(const ProcessMesh &mesh, const TensorSpec &x, const ReductionAttrs &attrs) {
    const std::string op(Name(attrs.kind));
    detail::CheckSpec(mesh, x, op, "x");
    const int rank = static_cast<int>(x.shape.size());
    ReductionSetup setup;
    setup.reduced.assign(rank, attrs.axes.empty());
    std::set<int> seen;
    for (int axis : attrs.axes) {
        const int a = detail::NormalizeAxis(axis, rank, op);
        if (!seen.insert(a).second) {
            throw SpmdError(fmt::format("{}: axis {} is given twice in [{}]", op, a, fmt::join(attrs.axes, ",")));
        }
        setup.reduced[a] = true;
    }
    const std::string labels = detail::BatchLabels(rank, op);
    EinsumProblem &problem = setup.problem;
    problem.op = op;
    problem.inputs.push_back(detail::Operand("x", labels, x, 0));
    for (int i = 0; i < rank; ++i) {
        if (!setup.reduced[i]) {
            problem.output.push_back(labels[i]);
        }
    }
    problem.partial_policy = PartialPolicy::kSingle;
    switch (attrs.kind) {
    case ReductionKind::kSum:
    case ReductionKind::kMean:
        problem.contraction = ReduceOp::kSum;
        problem.single_kept_ops = {ReduceOp::kSum, ReduceOp::kAvg};
        break;
    case ReductionKind::kMax:
        problem.contraction = ReduceOp::kMax;
        problem.single_kept_ops = {ReduceOp::kMax};
        break;
    case ReductionKind::kMin:
        problem.contraction = ReduceOp::kMin;
        problem.single_kept_ops = {ReduceOp::kMin};
        break;
    case ReductionKind::kProd:
        problem.contraction = ReduceOp::kProd;
        problem.single_kept_ops = {ReduceOp::kProd};
        break;
    }
    return setup;
}

/// Inserts Replicate size-1 dims at the reduced axes (keepdim).
TensorSpec KeepDims(const TensorSpec &out, const std::vector<bool> &reduced) {
    TensorSpec kept;
    std::vector<std::vector<int>> dims;
    size_t j = 0;
    for (bool r : reduced) {
        if (r) {
            kept.shape.push_back(1);
            dims.emplace_back();
        } else {
            kept.shape.push_back(out.shape[j]);
            dims.push_back(out.layout.MeshDims(static_cast<int>(j)));
            ++j;
        }
    }
    kept.layout = Layout(std::move(dims), out.layout.Partial());
    return kept;
}

/// Drops the reduced size-1 dims of a keepdim output (their sharding, if any, is dropped: they hold one element).
TensorSpec DropDims(const TensorSpec &out, const std::vector<bool> &reduced) {
    TensorSpec dropped;
    std::vector<std::vector<int>> dims;
    for (size_t i = 0; i < reduced.size(); ++i) {
        if (!reduced[i]) {
            dropped.shape.push_back(out.shape[i]);
            dims.push_back(out.layout.MeshDims(static_cast<int>(i)));
        }
    }
    dropped.layout = Layout(std::move(dims), out.layout.Partial());
    return dropped;
}

TensorSpec CheckOutput(const ProcessMesh &mesh, const ReductionSetup &setup, const TensorSpec &x, const TensorSpec &out,
                       const ReductionAttrs &attrs, std::string_view name) {
    const std::string op(Name(attrs.kind));
    detail::CheckSpec(mesh, out, op, name);
    std::vector<int64_t> expected;
    for (size_t i = 0; i < x.shape.size(); ++i) {
        if (!setup.reduced[i]) {
            expected.push_back(x.shape[i]);
        } else if (attrs.keepdim) {
            expected.push_back(1);
        }
    }
    if (out.shape != expected) {
        throw SpmdError(fmt::format("{}: {}.shape {} must be {} (keepdim={})", op, name, ShapeToString(out.shape),
                                    ShapeToString(expected), attrs.keepdim));
    }
    return attrs.keepdim ? DropDims(out, setup.reduced) : out;
}

SpmdInfo Finish(SpmdInfo info, const ReductionSetup &setup, const ReductionAttrs &attrs) {
    if (attrs.keepdim) {
        info.outputs[0] = KeepDims(info.outputs[0], setup.reduced);
    }
    return info;
}

} // namespace

SpmdInfo InferReductionForward(const ProcessMesh &mesh, const TensorSpec &x, const ReductionAttrs &attrs,
                               const RuleOptions &options) {
    const ReductionSetup setup = Setup(mesh, x, attrs);
    return Finish(detail::FromForward(InferEinsumForward(mesh, setup.problem, options), setup.problem), setup, attrs);
}

SpmdInfo InferReductionReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                               const ReductionAttrs &attrs, const RuleOptions &options) {
    const ReductionSetup setup = Setup(mesh, x, attrs);
    const TensorSpec plain = CheckOutput(mesh, setup, x, out, attrs, "out");
    return Finish(detail::FromForward(InferEinsumReverse(mesh, setup.problem, plain.layout, options), setup.problem),
                  setup, attrs);
}

SpmdInfo InferReductionGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                            const ReductionAttrs &attrs, const RuleOptions &options) {
    const ReductionSetup setup = Setup(mesh, x, attrs);
    const TensorSpec plain = CheckOutput(mesh, setup, x, out_grad, attrs, "out_grad");
    const EinsumGradResult grad = InferEinsumGrad(mesh, setup.problem, plain, options);
    SpmdInfo info = detail::FromGrad(grad, setup.problem, {true});
    if (attrs.keepdim) {
        info.inputs.back() = KeepDims(info.inputs.back(), setup.reduced);
    }
    if (attrs.kind == ReductionKind::kMax || attrs.kind == ReductionKind::kMin || attrs.kind == ReductionKind::kProd) {
        // The gradient flows to the arg-max (max / min), or is dy * out / x (prod): the local kernel reads the
        // global result, so the forward output is needed reduced (Replicate on the reduced mesh dims), sharded like
        // out_grad.
        TensorSpec out = grad.out_grad;
        out.layout = out.layout.WithoutPartial();
        if (attrs.keepdim) {
            out = KeepDims(out, setup.reduced);
        }
        info.input_names.insert(info.input_names.begin() + 1, "out");
        info.inputs.insert(info.inputs.begin() + 1, out);
    }
    return info;
}

} // namespace shardline::spmd
