// The cost-based mode of the einsum engine (RuleMode::kCostBased): every candidate assignment of labels to mesh dims
// priced by compute and the redistributions it needs; the deterministic merge's answer (einsum.cc) wins ties.

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/redistribute.h>

#include "einsum_internal.h"

namespace shardline::spmd::detail {
namespace {

double CandidateCost(const ProcessMesh &mesh, const EinsumProblem &problem, const std::map<char, int64_t> &sizes,
                     const EinsumAssignment &assignment, const RuleOptions &options, PlanCosts &plans,
                     EinsumResult *result) {
    *result = ApplyAssignment(mesh, problem, assignment);
    double cost = ComputeCost(mesh, sizes, assignment, options.plan.cost);
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        cost += plans(problem.inputs[i].shape, problem.inputs[i].layout, result->inputs[i].layout);
    }
    if (options.output_target) {
        cost += plans(result->output.shape, result->output.layout, *options.output_target);
    }
    return cost;
}

/// Walks every candidate assignment of the cost-based mode: per mesh dim of size > 1, nothing (its Partials are
/// resolved), keep the input Partials (when the policy allows) or shard one shardable label. `price` returns a
/// candidate's cost; the first candidate (the deterministic answer, priced by the caller) wins ties.
template <typename Price>
EinsumAssignment EnumerateAssignments(const ProcessMesh &mesh, const EinsumProblem &problem,
                                      const std::map<char, int64_t> &sizes, size_t num_policy_inputs, bool grad_mode,
                                      const EinsumAssignment &deterministic, double deterministic_cost, Price price,
                                      double *best_cost) {
    const std::string labels = ShardableLabels(problem, sizes);
    // Options per mesh dim: -2 = nothing (Partials resolved), -1 = keep the input Partials, k >= 0 = shard labels[k].
    std::vector<std::vector<int>> choices(mesh.NDim());
    std::vector<std::optional<EinsumAssignment::Kept>> keeps(mesh.NDim());
    int64_t count = 1;
    for (int d = 0; d < mesh.NDim(); ++d) {
        choices[d].push_back(-2);
        if (mesh.DimSize(d) == 1) {
            continue;
        }
        keeps[d] = PartialChoice(problem, d, num_policy_inputs, grad_mode);
        if (keeps[d]) {
            choices[d].push_back(-1);
        }
        for (int k = 0; k < static_cast<int>(labels.size()); ++k) {
            choices[d].push_back(k);
        }
        // Bounded before anything is priced: at most 53 choices per dim, so the product cannot overflow here.
        count *= static_cast<int64_t>(choices[d].size());
        if (count > kMaxCandidates) {
            throw SpmdError(
                fmt::format("{}: the cost mode would price more than {} candidates (per mesh dim of size > 1: "
                            "nothing, keep the Partials or one of the {} shardable labels '{}'); use the "
                            "deterministic mode",
                            problem.op, kMaxCandidates, labels.size(), labels));
        }
    }
    // Co-shard order of a label: as the highest-priority operand that lists the mesh dim orders it, else ascending.
    auto order_key = [&](char label, int d) {
        for (int i : PriorityOrder(problem)) {
            const auto pos = problem.inputs[i].labels.find(label);
            if (pos == std::string::npos) {
                continue;
            }
            const auto &dims = problem.inputs[i].layout.MeshDims(static_cast<int>(pos));
            auto it = std::find(dims.begin(), dims.end(), d);
            if (it != dims.end()) {
                return static_cast<int>(it - dims.begin());
            }
        }
        return 1000 + d;
    };

    EinsumAssignment best = deterministic;
    *best_cost = deterministic_cost;
    std::vector<size_t> index(mesh.NDim(), 0);
    while (true) {
        EinsumAssignment candidate;
        for (int d = 0; d < mesh.NDim(); ++d) {
            const int c = choices[d][index[d]];
            if (c == -1) {
                candidate.kept_partial[d] = *keeps[d];
            } else if (c >= 0) {
                candidate.labels[labels[c]].push_back(d);
            }
        }
        for (auto &[label, dims] : candidate.labels) {
            std::stable_sort(dims.begin(), dims.end(),
                             [&, l = label](int a, int b) { return order_key(l, a) < order_key(l, b); });
        }
        const double cost = price(candidate);
        if (cost < *best_cost - 1e-9) {
            best = std::move(candidate);
            *best_cost = cost;
        }
        int d = 0;
        for (; d < mesh.NDim(); ++d) {
            if (++index[d] < choices[d].size()) {
                break;
            }
            index[d] = 0;
        }
        if (d == mesh.NDim()) {
            break;
        }
    }
    return best;
}

/// Cost of a gradient answer: moving the saved inputs and the output gradient to the required layouts, the
/// gradient einsums of the differentiable inputs, and bringing every such gradient back to its input's layout
/// (without Partials: the gradient of a Partial value is Replicate there) -- the op's whole backward communication.
double GradCost(const ProcessMesh &mesh, const EinsumProblem &problem, const std::map<char, int64_t> &sizes,
                const Layout &grad_layout, const EinsumGradResult &grad, const RuleOptions &options, PlanCosts &plans) {
    double cost = plans(grad.out_grad.shape, grad_layout, grad.out_grad.layout);
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        const EinsumOperand &operand = problem.inputs[i];
        cost += plans(operand.shape, operand.layout, grad.inputs[i].layout);
        if (!operand.differentiable) {
            continue;
        }
        cost += plans(operand.shape, grad.input_grads[i].layout, operand.layout.WithoutPartial());
        const std::string grad_labels = GradEinsumLabels(problem, i, nullptr);
        double flops = 2.0;
        double parts = 1.0;
        for (const auto &[label, size] : sizes) {
            if (grad_labels.find(label) == std::string::npos) {
                continue;
            }
            flops *= static_cast<double>(std::max<int64_t>(size, 1));
            auto it = grad.assignment.labels.find(label);
            if (it != grad.assignment.labels.end()) {
                for (int d : it->second) {
                    parts *= static_cast<double>(mesh.DimSize(d));
                }
            }
        }
        cost += flops / parts / options.plan.cost.flops_per_us;
    }
    return cost;
}

/// Appends a layout to a memo key: rank, then per tensor dim its mesh dims, then the Partials.
void PutLayout(std::vector<int64_t> &key, const Layout &layout) {
    key.push_back(layout.TensorRank());
    for (const auto &dims : layout.DimsMeshDims()) {
        key.push_back(static_cast<int64_t>(dims.size()));
        key.insert(key.end(), dims.begin(), dims.end());
    }
    key.push_back(static_cast<int64_t>(layout.Partial().size()));
    for (const auto &[d, op] : layout.Partial()) {
        key.push_back(d);
        key.push_back(static_cast<int64_t>(op));
    }
}

} // namespace

PlanCosts::PlanCosts(const ProcessMesh &mesh, const PlanOptions &options) : mesh_(mesh), options_(options) {
    options_.search = false;
}

double PlanCosts::operator()(const std::vector<int64_t> &shape, const Layout &src, const Layout &dst) {
    std::vector<int64_t> key = shape;
    key.push_back(-1);
    PutLayout(key, src);
    PutLayout(key, dst);
    auto it = memo_.find(key);
    if (it != memo_.end()) {
        return it->second;
    }
    const double cost = RedistributeCost(mesh_, shape, src, dst, options_);
    memo_.emplace(std::move(key), cost);
    return cost;
}

double ComputeCost(const ProcessMesh &mesh, const std::map<char, int64_t> &sizes, const EinsumAssignment &assignment,
                   const CostModel &cost) {
    double flops = 2.0;
    for (const auto &[label, size] : sizes) {
        flops *= static_cast<double>(std::max<int64_t>(size, 1));
    }
    double parts = 1.0;
    for (const auto &[label, dims] : assignment.labels) {
        for (int d : dims) {
            parts *= static_cast<double>(mesh.DimSize(d));
        }
    }
    return flops / parts / cost.flops_per_us;
}

/// Forward (and reverse) enumeration: input redistributions + compute (+ output -> output_target).
EinsumResult Enumerate(const ProcessMesh &mesh, const EinsumProblem &problem, const std::map<char, int64_t> &sizes,
                       const EinsumAssignment &deterministic, const RuleOptions &options) {
    if (options.output_target) {
        options.output_target->Validate(mesh, static_cast<int>(problem.output.size()),
                                        fmt::format("{}: output_target", problem.op));
    }
    PlanCosts plans(mesh, options.plan);
    auto price = [&](const EinsumAssignment &candidate) {
        EinsumResult result;
        return CandidateCost(mesh, problem, sizes, candidate, options, plans, &result);
    };
    double cost = 0.0;
    const EinsumAssignment best = EnumerateAssignments(mesh, problem, sizes, problem.inputs.size(), /*grad_mode=*/false,
                                                       deterministic, price(deterministic), price, &cost);
    EinsumResult result = ApplyAssignment(mesh, problem, best);
    result.cost_us = cost;
    return result;
}

EinsumGradResult EnumerateGrad(const ProcessMesh &mesh, const EinsumProblem &problem, const EinsumProblem &extended,
                               const std::map<char, int64_t> &sizes, const std::vector<int64_t> &out_shape,
                               const Layout &grad_layout, const EinsumAssignment &deterministic,
                               const RuleOptions &options) {
    // The same candidates as the forward (the output gradient may shard labels too); Partials kept only sum-like.
    PlanCosts plans(mesh, options.plan);
    auto price = [&](const EinsumAssignment &candidate) {
        return GradCost(mesh, problem, sizes, grad_layout, BuildGrad(mesh, problem, out_shape, grad_layout, candidate),
                        options, plans);
    };
    double cost = 0.0;
    const EinsumAssignment best =
        EnumerateAssignments(mesh, extended, sizes, problem.inputs.size(),
                             /*grad_mode=*/true, deterministic, price(deterministic), price, &cost);
    EinsumGradResult result = BuildGrad(mesh, problem, out_shape, grad_layout, best);
    result.cost_us = cost;
    return result;
}

} // namespace shardline::spmd::detail
