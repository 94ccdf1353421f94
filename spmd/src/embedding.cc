// embedding: out[..., h] = weight[ids[...], h] as the einsum "ab,vh->abh" where the vocab label v is contracted
// through the one-hot of ids. A vocab-sharded table therefore gives a P(sum) output (each rank looks up the rows it
// holds, zeros for the others: Megatron's VocabParallelEmbedding); a hidden-sharded table a hidden-sharded output.
// The table wins conflicts (parameters never move). ids are integers: never Partial, no gradient.
// embedding_bag: out[..., h] = Σ_t weight[ids[t, ...], h], the einsum "tab,vh->abh": the bag label t is contracted as
// well, so ids sharded on their bag dim give a P(sum) output too (each rank sums its part of every bag).

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

/// embedding (bag = false) or embedding_bag (bag = true: ids' dim 0 is the bag, summed away).
EinsumProblem EmbeddingProblem(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight, bool bag) {
    const std::string op = bag ? "embedding_bag" : "embedding";
    detail::CheckSpec(mesh, ids, op, "ids");
    detail::CheckSpec(mesh, weight, op, "weight");
    if (weight.shape.size() != 2) {
        throw SpmdError(fmt::format("{}: weight must be [vocab, hidden], got {}", op, ShapeToString(weight.shape)));
    }
    if (bag && ids.shape.empty()) {
        throw SpmdError(
            fmt::format("{}: ids must be [bag, ...] with the bag dim first, got {}", op, ShapeToString(ids.shape)));
    }
    const std::string batch = detail::BatchLabels(ids.shape.size() - (bag ? 1 : 0), op);
    EinsumProblem problem;
    problem.op = op;
    problem.inputs.push_back(detail::Operand("ids", (bag ? "t" : "") + batch, ids, 1, /*linear=*/false));
    problem.inputs.back().differentiable = false;
    problem.inputs.push_back(detail::Operand("weight", "vh", weight, 0));
    problem.output = batch + "h";
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

} // namespace

SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false);
    detail::CheckSpec(mesh, out, problem.op, "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {false, true});
}

SpmdInfo InferEmbeddingBagForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                                  const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/true);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferEmbeddingBagReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                                  const TensorSpec &out, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/true);
    detail::CheckSpec(mesh, out, problem.op, "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferEmbeddingBagGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out_grad, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/true);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {false, true});
}

} // namespace shardline::spmd
