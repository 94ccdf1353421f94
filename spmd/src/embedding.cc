// embedding: out[..., h] = weight[ids[...], h] as the einsum "ab,vh->abh" where the vocab label v is contracted
// through the one-hot of ids. A vocab-sharded table therefore gives a P(sum) output (each rank looks up the rows it
// holds, zeros for the others: Megatron's VocabParallelEmbedding); a hidden-sharded table a hidden-sharded output.
// The table wins conflicts (parameters never move). ids are integers: never Partial, no gradient.

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

EinsumProblem EmbeddingProblem(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight) {
    detail::CheckSpec(mesh, ids, "embedding", "ids");
    detail::CheckSpec(mesh, weight, "embedding", "weight");
    if (weight.shape.size() != 2) {
        throw SpmdError(fmt::format("embedding: weight must be [vocab, hidden], got {}", ShapeToString(weight.shape)));
    }
    const std::string batch = detail::BatchLabels(ids.shape.size(), "embedding");
    EinsumProblem problem;
    problem.op = "embedding";
    problem.inputs.push_back(detail::Operand("ids", batch, ids, 1, /*linear=*/false));
    problem.inputs.back().differentiable = false;
    problem.inputs.push_back(detail::Operand("weight", "vh", weight, 0));
    problem.output = batch + "h";
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

} // namespace

SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight);
    detail::CheckSpec(mesh, out, "embedding", "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {false, true});
}

} // namespace shardline::spmd
