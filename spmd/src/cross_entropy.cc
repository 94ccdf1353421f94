// cross-entropy over the last (class) dim: loss[...] = logsumexp(logits[..., :]) - logits[..., label[...]], the
// einsum "abv,ab->ab" with v reduced inside the op. The class dim must be Replicate unless vocab_parallel
// (Megatron's vocab-parallel cross-entropy): then it stays sharded, the op all-reduces the row max, the sum of
// exponentials and the target logit over v's mesh dims, and the loss is Replicate there. mean / sum reductions
// give a scalar that is P(sum) over the mesh dims sharding the batch dims. The backward needs no communication.

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

EinsumProblem CrossEntropyProblem(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                                  const CrossEntropyAttrs &attrs) {
    detail::CheckSpec(mesh, logits, "cross_entropy", "logits");
    detail::CheckSpec(mesh, labels, "cross_entropy", "labels");
    if (logits.shape.empty()) {
        throw SpmdError("cross_entropy: logits must have rank >= 1 ([..., classes]), got []");
    }
    const std::vector<int64_t> batch_shape(logits.shape.begin(), logits.shape.end() - 1);
    if (labels.shape != batch_shape) {
        throw SpmdError(fmt::format("cross_entropy: labels.shape {} must equal logits.shape[:-1] {}",
                                    ShapeToString(labels.shape), ShapeToString(batch_shape)));
    }
    const std::string batch = detail::BatchLabels(batch_shape.size(), "cross_entropy");
    EinsumProblem problem;
    problem.op = "cross_entropy";
    std::string logits_labels = batch;
    logits_labels.push_back('v');
    problem.inputs.push_back(detail::Operand("logits", logits_labels, logits, 0, /*linear=*/false));
    problem.inputs.push_back(detail::Operand("labels", batch, labels, 1, /*linear=*/false));
    problem.inputs.back().differentiable = false;
    problem.output = batch;
    problem.partial_policy = PartialPolicy::kResolve;
    if (!attrs.vocab_parallel) {
        problem.unshardable.assign(1, 'v'); // not = "v": g++ 12 -Wrestrict false positive
    }
    return problem;
}

/// The engine reads v's mesh dims as a Partial loss; the op reduces them itself (internal collectives).
SpmdInfo Finish(SpmdInfo info, const EinsumAssignment &assignment, const CrossEntropyAttrs &attrs) {
    TensorSpec &loss = info.outputs[0];
    std::map<int, ReduceOp> partial = loss.layout.Partial();
    auto it = assignment.labels.find('v');
    if (it != assignment.labels.end()) {
        for (int d : it->second) {
            partial.erase(d);
            info.internal.push_back({Collective::kAllReduce, d, ReduceOp::kMax, "row max of logits"});
            info.internal.push_back({Collective::kAllReduce, d, ReduceOp::kSum, "row sum of exp(logits - max)"});
            info.internal.push_back({Collective::kAllReduce, d, ReduceOp::kSum, "target logit"});
        }
    }
    if (attrs.reduction != LossReduction::kNone) {
        for (const auto &dims : loss.layout.DimsMeshDims()) {
            for (int d : dims) {
                partial[d] = ReduceOp::kSum;
            }
        }
        loss = {{}, Layout(std::vector<std::vector<int>>{}, partial)};
    } else {
        loss.layout = Layout(loss.layout.DimsMeshDims(), partial);
    }
    info.output_names = {"loss"};
    return info;
}

} // namespace

SpmdInfo InferCrossEntropyForward(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                                  const CrossEntropyAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = CrossEntropyProblem(mesh, logits, labels, attrs);
    const EinsumResult result = InferEinsumForward(mesh, problem, options);
    return Finish(detail::FromForward(result, problem), result.assignment, attrs);
}

SpmdInfo InferCrossEntropyReverse(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                                  const TensorSpec &loss, const CrossEntropyAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = CrossEntropyProblem(mesh, logits, labels, attrs);
    detail::CheckSpec(mesh, loss, "cross_entropy", "loss");
    Layout out_layout = loss.layout;
    if (attrs.reduction != LossReduction::kNone) {
        if (!loss.shape.empty()) {
            throw SpmdError(fmt::format("cross_entropy: a mean/sum loss is a scalar, got loss.shape {}",
                                        ShapeToString(loss.shape)));
        }
        // A P(sum) scalar loss comes from a sharded batch: give its mesh dims to the first batch dim.
        std::vector<std::vector<int>> dims(problem.output.size());
        for (const auto &[d, op] : loss.layout.Partial()) {
            if (!dims.empty() && op == ReduceOp::kSum) {
                dims[0].push_back(d);
            }
        }
        out_layout = Layout(std::move(dims));
    } else if (loss.shape != labels.shape) {
        throw SpmdError(fmt::format("cross_entropy: loss.shape {} must equal labels.shape {}",
                                    ShapeToString(loss.shape), ShapeToString(labels.shape)));
    } else {
        out_layout = loss.layout.WithoutPartial();
    }
    const EinsumResult result = InferEinsumReverse(mesh, problem, out_layout, options);
    return Finish(detail::FromForward(result, problem), result.assignment, attrs);
}

SpmdInfo InferCrossEntropyGrad(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                               const TensorSpec &loss_grad, const CrossEntropyAttrs &attrs,
                               const RuleOptions &options) {
    const EinsumProblem problem = CrossEntropyProblem(mesh, logits, labels, attrs);
    detail::CheckSpec(mesh, loss_grad, "cross_entropy", "loss_grad");
    TensorSpec batch_grad = loss_grad;
    if (attrs.reduction != LossReduction::kNone) {
        if (!loss_grad.shape.empty()) {
            throw SpmdError(fmt::format("cross_entropy: the gradient of a mean/sum loss is a scalar, got shape {}",
                                        ShapeToString(loss_grad.shape)));
        }
        // d loss / d loss[i] is the same scalar for every row: broadcast it, Replicate.
        batch_grad = {labels.shape, Layout::Replicated(static_cast<int>(labels.shape.size()))};
    }
    const EinsumGradResult grad = InferEinsumGrad(mesh, problem, batch_grad, options);
    SpmdInfo info = detail::FromGrad(grad, problem, {true, false});
    info.input_names.back() = "loss_grad";
    if (attrs.reduction != LossReduction::kNone) {
        info.inputs.back() = {{}, Layout::Replicated(0)};
    }
    return info;
}

} // namespace shardline::spmd
