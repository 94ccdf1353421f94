// transpose: out.shape[i] = x.shape[perm[i]], the einsum "abc->cab"; shardings and every Partial move with it.

#include <set>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

EinsumProblem TransposeProblem(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int> &perm) {
    detail::CheckSpec(mesh, x, "transpose", "x");
    const int rank = static_cast<int>(x.shape.size());
    if (static_cast<int>(perm.size()) != rank) {
        throw SpmdError(fmt::format("transpose: perm [{}] must have one entry per dim of x {}", fmt::join(perm, ","),
                                    ShapeToString(x.shape)));
    }
    std::set<int> seen;
    const std::string labels = detail::BatchLabels(rank, "transpose");
    EinsumProblem problem;
    problem.op = "transpose";
    problem.inputs.push_back(detail::Operand("x", labels, x, 0));
    for (int p : perm) {
        const int a = detail::NormalizeAxis(p, rank, "transpose");
        if (!seen.insert(a).second) {
            throw SpmdError(
                fmt::format("transpose: perm [{}] must be a permutation of 0..{}", fmt::join(perm, ","), rank - 1));
        }
        problem.output.push_back(labels[a]);
    }
    problem.partial_policy = PartialPolicy::kSingle;
    problem.single_kept_ops = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd};
    return problem;
}

} // namespace

SpmdInfo InferTransposeForward(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int> &perm,
                               const RuleOptions &options) {
    const EinsumProblem problem = TransposeProblem(mesh, x, perm);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferTransposeReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                               const std::vector<int> &perm, const RuleOptions &options) {
    const EinsumProblem problem = TransposeProblem(mesh, x, perm);
    detail::CheckSpec(mesh, out, "transpose", "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferTransposeGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                            const std::vector<int> &perm, const RuleOptions &options) {
    const EinsumProblem problem = TransposeProblem(mesh, x, perm);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {true});
}

} // namespace shardline::spmd
