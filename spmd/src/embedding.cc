// embedding: out[..., h] = weight[ids[...], h] as the einsum "ab,vh->abh" where the vocab label v is contracted
// through the one-hot of ids. A vocab-sharded table therefore gives a P(sum) output (each rank looks up the rows it
// holds, zeros for the others: Megatron's VocabParallelEmbedding); a hidden-sharded table a hidden-sharded output.
// The table wins conflicts (parameters never move). ids are integers: never Partial, no gradient.
// embedding_bag: out[..., h] = Σ_t weight[ids[t, ...], h], the einsum "tab,vh->abh": the bag label t is contracted as
// well, so ids sharded on their bag dim give a P(sum) output too (each rank sums its part of every bag).
// sparse (embedding only; a row-sparse weight gradient): the layouts Paddle supports, errors for the others
// (rules.h EmbeddingAttrs).

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

/// embedding (bag = false) or embedding_bag (bag = true: ids' dim 0 is the bag, summed away).
EinsumProblem EmbeddingProblem(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight, bool bag,
                               bool sparse = false) {
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
    if (sparse) {
        // Paddle's rule: a sparse embedding has no row-wise (vocab) parallel form.
        const std::vector<int> vocab = weight.layout.Canonical(mesh).MeshDims(0);
        if (!vocab.empty()) {
            throw SpmdError(fmt::format("embedding: sparse=true does not support a vocab-sharded table (row-wise "
                                        "parallel, as Paddle): weight {} shards the vocab dim on mesh dim(s) [{}]; "
                                        "replicate that dim or use sparse=false",
                                        weight.layout.ToString(), fmt::join(vocab, ",")));
        }
        problem.unshardable = std::string(1, 'v'); // nor may a reverse or cost-mode answer shard it
    }
    return problem;
}

} // namespace

SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const EmbeddingAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false, attrs.sparse);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const EmbeddingAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false, attrs.sparse);
    detail::CheckSpec(mesh, out, problem.op, "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const EmbeddingAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = EmbeddingProblem(mesh, ids, weight, /*bag=*/false, attrs.sparse);
    SpmdInfo info = detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {false, true});
    if (attrs.sparse && options.mode == RuleMode::kCostBased && info.Output("weight_grad").layout.IsPartial()) {
        // The cheapest candidate needs a Partial row-sparse gradient: take the deterministic answer (checked below).
        RuleOptions deterministic = options;
        deterministic.mode = RuleMode::kDeterministic;
        return InferEmbeddingGrad(mesh, ids, weight, out_grad, attrs, deterministic);
    }
    if (attrs.sparse) {
        // A row-sparse gradient is exact only where it needs no reduction: a sum of row-sparse partials is a
        // concatenation of rows and values, which no planner step performs.
        const Layout &grad = info.Output("weight_grad").layout;
        if (grad.IsPartial()) {
            std::vector<int> dims;
            for (const auto &[d, op] : grad.Partial()) {
                dims.push_back(d);
            }
            throw SpmdError(fmt::format("embedding: sparse=true: the row-sparse weight gradient would be Partial over "
                                        "mesh dim(s) [{}] (ids {} and out_grad {} spread the lookups over those "
                                        "ranks), and the planner reduces dense tensors only; replicate the batch "
                                        "dims of ids and out_grad there or use sparse=false",
                                        fmt::join(dims, ","), ids.layout.ToString(), out_grad.layout.ToString()));
        }
    }
    return info;
}

SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const RuleOptions &options) {
    return InferEmbeddingForward(mesh, ids, weight, EmbeddingAttrs{}, options);
}

SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const RuleOptions &options) {
    return InferEmbeddingReverse(mesh, ids, weight, out, EmbeddingAttrs{}, options);
}

SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const RuleOptions &options) {
    return InferEmbeddingGrad(mesh, ids, weight, out_grad, EmbeddingAttrs{}, options);
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
