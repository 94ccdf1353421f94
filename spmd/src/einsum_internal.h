#pragma once

// Private to spmd/src: the einsum engine's pieces shared by the deterministic merge (einsum.cc) and the cost-based
// enumeration (einsum_cost.cc).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::spmd::detail {

/// Validates `problem` on `mesh` (shapes, labels, layouts) and returns it with canonical layouts.
EinsumProblem Canonicalized(const ProcessMesh &mesh, const EinsumProblem &problem);
/// Operands in merge priority order (highest first).
std::vector<int> PriorityOrder(const EinsumProblem &problem);
/// Whether dim j of input i may be sharded (its label is shardable and the dim is not a size-1 broadcast).
bool Shardable(const EinsumProblem &problem, const std::map<char, int64_t> &sizes, int i, int j);
/// Which input Partials on the unclaimed mesh dim `d` pass to the output; inputs >= num_inputs are ignored.
std::optional<EinsumAssignment::Kept> PartialChoice(const EinsumProblem &problem, int d, size_t num_inputs,
                                                    bool grad_mode);
/// Labels that some operand may shard, in priority order of first appearance.
std::string ShardableLabels(const EinsumProblem &problem, const std::map<char, int64_t> &sizes);
/// Labels of the einsum computing input i's gradient (the other inputs of a product term go to `others`).
std::string GradEinsumLabels(const EinsumProblem &problem, size_t i, std::vector<size_t> *others);
/// The gradient answer of `assignment`; `problem` is canonical.
EinsumGradResult BuildGrad(const ProcessMesh &mesh, const EinsumProblem &problem, const std::vector<int64_t> &out_shape,
                           const Layout &grad_layout, const EinsumAssignment &assignment);

/// The ordered-plan costs of one query, memoised: the candidates of a cost-mode rule or of an enumeration share most
/// of their redistributions (a tensor's required layout depends only on its own labels). Priced with
/// PlanOptions::search off (docs/spmd.md 2.2): a swap search per candidate would multiply the cost of the query.
class PlanCosts {
public:
    PlanCosts(const ProcessMesh &mesh, const PlanOptions &options);
    double operator()(const std::vector<int64_t> &shape, const Layout &src, const Layout &dst);

private:
    const ProcessMesh &mesh_;
    PlanOptions options_;
    std::map<std::vector<int64_t>, double> memo_;
};

/// The local einsum's time: 2 * prod(label sizes) / (the shard count of the assigned labels) / flops_per_us.
double ComputeCost(const ProcessMesh &mesh, const std::map<char, int64_t> &sizes, const EinsumAssignment &assignment,
                   const CostModel &cost);

/// Cost-based forward (and reverse) answer: the cheapest candidate, `deterministic` on ties (einsum_cost.cc).
EinsumResult Enumerate(const ProcessMesh &mesh, const EinsumProblem &problem, const std::map<char, int64_t> &sizes,
                       const EinsumAssignment &deterministic, const RuleOptions &options);
/// Cost-based grad answer over the candidates of `extended` (the problem plus the output gradient as an operand).
EinsumGradResult EnumerateGrad(const ProcessMesh &mesh, const EinsumProblem &problem, const EinsumProblem &extended,
                               const std::map<char, int64_t> &sizes, const std::vector<int64_t> &out_shape,
                               const Layout &grad_layout, const EinsumAssignment &deterministic,
                               const RuleOptions &options);

} // namespace shardline::spmd::detail
