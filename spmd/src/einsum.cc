#include <algorithm>
#include <climits>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

// The einsum engine: the deterministic merge (docs/spmd.md rules 1-4), the answers it builds and the public Infer
// functions. The cost-based enumeration of the same candidates is in einsum_cost.cc.

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>

#include "einsum_internal.h"

namespace shardline::spmd {
namespace detail {

bool IsSumLike(ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAvg; }

void ValidateProblem(const ProcessMesh &mesh, const EinsumProblem &problem) {
    for (const EinsumOperand &operand : problem.inputs) {
        const std::string what = fmt::format("{}: {}", problem.op, operand.name);
        if (operand.labels.size() != operand.shape.size()) {
            throw SpmdError(fmt::format("{}: einsum labels '{}' have {} dims, but the shape {} has {}", what,
                                        operand.labels, operand.labels.size(), ShapeToString(operand.shape),
                                        operand.shape.size()));
        }
        if (std::set<char>(operand.labels.begin(), operand.labels.end()).size() != operand.labels.size()) {
            throw SpmdError(fmt::format("{}: einsum labels '{}' repeat a label (diagonals are not supported)", what,
                                        operand.labels));
        }
        for (int64_t s : operand.shape) {
            if (s < 0) {
                throw SpmdError(fmt::format("{}: shape {} has a negative dim", what, ShapeToString(operand.shape)));
            }
        }
        CheckShape(operand.shape, what);
        operand.layout.Validate(mesh, static_cast<int>(operand.shape.size()), what);
    }
    for (char label : problem.output) {
        const bool found = std::any_of(problem.inputs.begin(), problem.inputs.end(), [label](const EinsumOperand &o) {
            return o.labels.find(label) != std::string::npos;
        });
        if (!found) {
            throw SpmdError(fmt::format("{}: output label '{}' appears in no input", problem.op, label));
        }
    }
    if (std::set<char>(problem.output.begin(), problem.output.end()).size() != problem.output.size()) {
        throw SpmdError(fmt::format("{}: output labels '{}' repeat a label", problem.op, problem.output));
    }
}

std::vector<int> PriorityOrder(const EinsumProblem &problem) {
    std::vector<int> order(problem.inputs.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return problem.inputs[a].priority < problem.inputs[b].priority; });
    return order;
}

bool Shardable(const EinsumProblem &problem, const std::map<char, int64_t> &sizes, int i, int j) {
    const char label = problem.inputs[i].labels[j];
    if (problem.unshardable.find(label) != std::string::npos) {
        return false;
    }
    const int64_t size = sizes.at(label);
    return size > 1 && problem.inputs[i].shape[j] == size;
}

/// Which input Partials on the unclaimed mesh dim `d` pass to the output; inputs >= num_inputs are ignored.
std::optional<EinsumAssignment::Kept> PartialChoice(const EinsumProblem &problem, int d, size_t num_inputs,
                                                    bool grad_mode) {
    std::vector<int> partial_inputs;
    for (size_t i = 0; i < num_inputs; ++i) {
        if (problem.inputs[i].layout.IsPartialOn(d)) {
            partial_inputs.push_back(static_cast<int>(i));
        }
    }
    if (partial_inputs.empty()) {
        return std::nullopt;
    }
    EinsumAssignment::Kept kept;
    kept.inputs.assign(num_inputs, false);
    switch (problem.partial_policy) {
    case PartialPolicy::kResolve:
        return std::nullopt;
    case PartialPolicy::kMultilinear:
        if (problem.multiplicative && !grad_mode && partial_inputs.size() == num_inputs &&
            std::all_of(partial_inputs.begin(), partial_inputs.end(),
                        [&](int i) { return problem.inputs[i].layout.Partial().at(d) == ReduceOp::kProd; })) {
            kept.op = ReduceOp::kProd;
            kept.inputs.assign(num_inputs, true);
            return kept;
        }
        for (int i : PriorityOrder(problem)) {
            if (static_cast<size_t>(i) >= num_inputs || !problem.inputs[i].layout.IsPartialOn(d)) {
                continue;
            }
            const ReduceOp op = problem.inputs[i].layout.Partial().at(d);
            if (problem.inputs[i].linear && IsSumLike(op)) {
                kept.op = op;
                kept.inputs[i] = true;
                return kept;
            }
        }
        return std::nullopt;
    case PartialPolicy::kAdditive: {
        const ReduceOp op = problem.inputs[partial_inputs[0]].layout.Partial().at(d);
        for (int i : partial_inputs) {
            if (problem.inputs[i].layout.Partial().at(d) != op) {
                return std::nullopt;
            }
        }
        if (!IsSumLike(op)) {
            return std::nullopt;
        }
        kept.op = op;
        kept.inputs.assign(num_inputs, true);
        return kept;
    }
    case PartialPolicy::kSingle: {
        if (partial_inputs[0] != 0) {
            return std::nullopt;
        }
        const ReduceOp op = problem.inputs[0].layout.Partial().at(d);
        const auto &ops = problem.single_kept_ops;
        if (std::find(ops.begin(), ops.end(), op) == ops.end() || (grad_mode && !IsSumLike(op))) {
            return std::nullopt;
        }
        kept.op = op;
        kept.inputs[0] = true;
        return kept;
    }
    }
    return std::nullopt;
}

/// The deterministic policy: operands in priority order; the first operand that shards a label (on a dim that is
/// not a size-1 broadcast) gives it its mesh dims, minus those an earlier label claimed. Then unclaimed mesh dims
/// may keep input Partials (PartialChoice).
EinsumAssignment Merge(const ProcessMesh &mesh, const EinsumProblem &problem, const std::map<char, int64_t> &sizes,
                       size_t num_policy_inputs, bool grad_mode) {
    EinsumAssignment assignment;
    std::set<int> claimed;
    for (int i : PriorityOrder(problem)) {
        const EinsumOperand &operand = problem.inputs[i];
        for (int j = 0; j < static_cast<int>(operand.labels.size()); ++j) {
            const char label = operand.labels[j];
            if (!Shardable(problem, sizes, i, j) || assignment.labels.count(label) != 0) {
                continue;
            }
            std::vector<int> dims;
            for (int d : operand.layout.MeshDims(j)) {
                if (claimed.count(d) == 0) {
                    dims.push_back(d);
                }
            }
            if (!dims.empty()) {
                claimed.insert(dims.begin(), dims.end());
                assignment.labels[label] = std::move(dims);
            }
        }
    }
    for (int d = 0; d < mesh.NDim(); ++d) {
        if (claimed.count(d) != 0) {
            continue;
        }
        if (auto kept = PartialChoice(problem, d, num_policy_inputs, grad_mode)) {
            assignment.kept_partial[d] = *kept;
        }
    }
    return assignment;
}

std::vector<int> LabelDims(const EinsumAssignment &assignment, char label) {
    auto it = assignment.labels.find(label);
    return it == assignment.labels.end() ? std::vector<int>{} : it->second;
}

EinsumProblem Canonicalized(const ProcessMesh &mesh, const EinsumProblem &problem) {
    ValidateProblem(mesh, problem);
    EinsumProblem canonical = problem;
    for (EinsumOperand &operand : canonical.inputs) {
        operand.layout = operand.layout.Canonical(mesh);
    }
    return canonical;
}

/// Labels that some operand may shard, in priority order of first appearance.
std::string ShardableLabels(const EinsumProblem &problem, const std::map<char, int64_t> &sizes) {
    std::string labels;
    for (int i : PriorityOrder(problem)) {
        for (int j = 0; j < static_cast<int>(problem.inputs[i].labels.size()); ++j) {
            const char label = problem.inputs[i].labels[j];
            if (Shardable(problem, sizes, i, j) && labels.find(label) == std::string::npos) {
                labels.push_back(label);
            }
        }
    }
    return labels;
}

/// Labels of the einsum computing input i's gradient: the output gradient and, for a product term, the other
/// inputs (whose indices go to `others`). A bias or an `add` operand is an additive term: the output gradient only.
std::string GradEinsumLabels(const EinsumProblem &problem, size_t i, std::vector<size_t> *others) {
    const bool product_term = !problem.inputs[i].additive_term && problem.partial_policy != PartialPolicy::kAdditive;
    std::string labels = problem.output;
    if (product_term) {
        for (size_t j = 0; j < problem.inputs.size(); ++j) {
            if (j != i) {
                labels += problem.inputs[j].labels;
                if (others != nullptr) {
                    others->push_back(j);
                }
            }
        }
    }
    return labels;
}

/// The gradient answer of `assignment` (rule 4 of docs/spmd.md); `problem` is canonical.
EinsumGradResult BuildGrad(const ProcessMesh &mesh, const EinsumProblem &problem, const std::vector<int64_t> &out_shape,
                           const Layout &grad_layout, const EinsumAssignment &assignment) {
    std::set<int> claimed;
    for (const auto &[label, dims] : assignment.labels) {
        claimed.insert(dims.begin(), dims.end());
    }
    std::map<int, ReduceOp> grad_partial;
    for (const auto &[d, op] : grad_layout.Partial()) {
        if (claimed.count(d) == 0 && assignment.kept_partial.count(d) == 0 && IsSumLike(op)) {
            grad_partial[d] = op;
        }
    }
    const auto sizes = EinsumLabelSizes(problem);
    const EinsumResult forward = ApplyAssignment(mesh, problem, assignment);
    EinsumGradResult result;
    result.assignment = assignment;
    result.inputs = forward.inputs;
    result.out_grad = {out_shape, Layout(forward.output.layout.WithoutPartial().DimsMeshDims(), grad_partial)};

    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        const EinsumOperand &operand = problem.inputs[i];
        std::vector<size_t> others;
        const std::string grad_labels = GradEinsumLabels(problem, i, &others);
        std::string own;
        for (int j = 0; j < static_cast<int>(operand.labels.size()); ++j) {
            if (Shardable(problem, sizes, static_cast<int>(i), j)) {
                own.push_back(operand.labels[j]);
            }
        }
        std::map<int, ReduceOp> partial = grad_partial;
        for (const auto &[label, dims] : assignment.labels) {
            if (grad_labels.find(label) != std::string::npos && own.find(label) == std::string::npos) {
                for (int d : dims) {
                    partial[d] = ReduceOp::kSum;
                }
            }
        }
        if (problem.partial_policy == PartialPolicy::kMultilinear) {
            for (const auto &[d, kept] : assignment.kept_partial) {
                for (size_t j : others) {
                    if (kept.inputs[j]) {
                        partial[d] = kept.op;
                    }
                }
            }
        }
        result.input_grads.push_back({operand.shape, Layout(forward.inputs[i].layout.DimsMeshDims(), partial)});
    }
    return result;
}

} // namespace detail

using namespace detail;

std::map<char, int64_t> EinsumLabelSizes(const EinsumProblem &problem) {
    std::map<char, int64_t> sizes;
    std::map<char, std::string> where;
    for (const EinsumOperand &operand : problem.inputs) {
        for (size_t j = 0; j < operand.labels.size() && j < operand.shape.size(); ++j) {
            const char label = operand.labels[j];
            const int64_t size = operand.shape[j];
            auto it = sizes.find(label);
            if (it == sizes.end() || it->second == 1) {
                sizes[label] = size;
                where[label] = operand.name;
            } else if (size != 1 && size != it->second) {
                throw SpmdError(fmt::format("{}: dim '{}' has size {} in {} but {} in {} (sizes must match or be 1)",
                                            problem.op, label, it->second, where[label], size, operand.name));
            }
        }
    }
    return sizes;
}

EinsumResult ApplyAssignment(const ProcessMesh &mesh, const EinsumProblem &problem,
                             const EinsumAssignment &assignment) {
    const auto sizes = EinsumLabelSizes(problem);
    EinsumResult result;
    result.assignment = assignment;
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        const EinsumOperand &operand = problem.inputs[i];
        std::vector<std::vector<int>> dims(operand.labels.size());
        for (int j = 0; j < static_cast<int>(operand.labels.size()); ++j) {
            if (Shardable(problem, sizes, static_cast<int>(i), j)) {
                dims[j] = LabelDims(assignment, operand.labels[j]);
            }
        }
        std::map<int, ReduceOp> partial;
        for (const auto &[d, kept] : assignment.kept_partial) {
            if (i < kept.inputs.size() && kept.inputs[i]) {
                partial[d] = kept.op;
            }
        }
        result.inputs.push_back({operand.shape, Layout(std::move(dims), std::move(partial))});
    }
    std::vector<std::vector<int>> out_dims;
    std::vector<int64_t> out_shape;
    for (char label : problem.output) {
        out_dims.push_back(LabelDims(assignment, label));
        out_shape.push_back(sizes.at(label));
    }
    std::map<int, ReduceOp> out_partial;
    for (const auto &[label, dims] : assignment.labels) {
        if (problem.output.find(label) == std::string::npos) {
            for (int d : dims) {
                out_partial[d] = problem.contraction;
            }
        }
    }
    for (const auto &[d, kept] : assignment.kept_partial) {
        out_partial[d] = kept.op;
    }
    result.output = {out_shape, Layout(std::move(out_dims), std::move(out_partial))};
    (void)mesh;
    return result;
}

EinsumResult InferEinsumForward(const ProcessMesh &mesh, const EinsumProblem &raw, const RuleOptions &options) {
    const EinsumProblem problem = Canonicalized(mesh, raw);
    const auto sizes = EinsumLabelSizes(problem);
    const EinsumAssignment deterministic = Merge(mesh, problem, sizes, problem.inputs.size(), /*grad_mode=*/false);
    if (options.mode == RuleMode::kCostBased) {
        return Enumerate(mesh, problem, sizes, deterministic, options);
    }
    return ApplyAssignment(mesh, problem, deterministic);
}

EinsumResult InferEinsumReverse(const ProcessMesh &mesh, const EinsumProblem &raw, const Layout &output_layout,
                                const RuleOptions &options) {
    EinsumProblem problem = raw;
    for (EinsumOperand &operand : problem.inputs) {
        operand.layout = Layout::Replicated(static_cast<int>(operand.shape.size()));
    }
    problem = Canonicalized(mesh, problem);
    output_layout.Validate(mesh, static_cast<int>(problem.output.size()), fmt::format("{}: output", problem.op));
    const Layout output = output_layout.Canonical(mesh);
    const auto sizes = EinsumLabelSizes(problem);

    std::vector<std::vector<std::vector<int>>> dims(problem.inputs.size());
    std::vector<std::map<int, ReduceOp>> partial(problem.inputs.size());
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        const EinsumOperand &operand = problem.inputs[i];
        dims[i].resize(operand.labels.size());
        for (int j = 0; j < static_cast<int>(operand.labels.size()); ++j) {
            const auto pos = problem.output.find(operand.labels[j]);
            if (pos != std::string::npos && Shardable(problem, sizes, static_cast<int>(i), j)) {
                dims[i][j] = output.MeshDims(static_cast<int>(pos));
            }
        }
    }
    // A Partial output comes from a sharded contracted label (the first one) or from a kept input Partial.
    std::string contracted;
    for (char label : ShardableLabels(problem, sizes)) {
        if (problem.output.find(label) == std::string::npos) {
            contracted.push_back(label);
        }
    }
    for (const auto &[d, op] : output.Partial()) {
        if (op == problem.contraction && !contracted.empty()) {
            for (size_t i = 0; i < problem.inputs.size(); ++i) {
                const auto pos = problem.inputs[i].labels.find(contracted[0]);
                if (pos != std::string::npos && Shardable(problem, sizes, static_cast<int>(i), static_cast<int>(pos))) {
                    dims[i][pos].push_back(d);
                }
            }
            continue;
        }
        switch (problem.partial_policy) {
        case PartialPolicy::kMultilinear:
            if (op == ReduceOp::kProd && problem.multiplicative) {
                for (auto &p : partial) {
                    p[d] = op;
                }
            } else if (IsSumLike(op)) {
                for (int i : PriorityOrder(problem)) {
                    if (problem.inputs[i].linear) {
                        partial[i][d] = op;
                        break;
                    }
                }
            }
            break;
        case PartialPolicy::kAdditive:
            if (IsSumLike(op)) {
                for (auto &p : partial) {
                    p[d] = op;
                }
            }
            break;
        case PartialPolicy::kSingle: {
            const auto &ops = problem.single_kept_ops;
            if (std::find(ops.begin(), ops.end(), op) != ops.end()) {
                partial[0][d] = op;
            }
            break;
        }
        case PartialPolicy::kResolve:
            break;
        }
    }
    const EinsumProblem replicated = problem;
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        problem.inputs[i].layout = Layout(dims[i], partial[i]);
    }
    if (options.mode != RuleMode::kCostBased) {
        return InferEinsumForward(mesh, problem, options);
    }
    if (options.output_target) {
        throw SpmdError(fmt::format("{}: output_target is a forward option; a reverse rule's target is its given "
                                    "output",
                                    problem.op));
    }
    // Nothing is given on the inputs (every candidate slices them from Replicate for free): price the compute and
    // moving the candidate's output to the given output. Ties keep the deterministic reverse answer.
    const EinsumAssignment deterministic =
        Merge(mesh, Canonicalized(mesh, problem), sizes, problem.inputs.size(), /*grad_mode=*/false);
    RuleOptions priced = options;
    priced.output_target = output;
    return Enumerate(mesh, replicated, sizes, deterministic, priced);
}

EinsumGradResult InferEinsumGrad(const ProcessMesh &mesh, const EinsumProblem &raw, const TensorSpec &out_grad,
                                 const RuleOptions &options) {
    const EinsumProblem problem = Canonicalized(mesh, raw);
    const auto sizes = EinsumLabelSizes(problem);
    std::vector<int64_t> out_shape;
    for (char label : problem.output) {
        out_shape.push_back(sizes.at(label));
    }
    if (out_grad.shape != out_shape) {
        throw SpmdError(fmt::format("{}: out_grad shape {} must equal the output shape {}", problem.op,
                                    ShapeToString(out_grad.shape), ShapeToString(out_shape)));
    }
    out_grad.layout.Validate(mesh, static_cast<int>(out_shape.size()), fmt::format("{}: out_grad", problem.op));
    const Layout grad_layout = out_grad.layout.Canonical(mesh);

    // The output gradient joins the merge with the lowest priority: it may shard labels no input claims.
    EinsumProblem extended = problem;
    extended.inputs.push_back({.name = "out_grad",
                               .labels = problem.output,
                               .shape = out_shape,
                               .layout = grad_layout,
                               .priority = INT_MAX,
                               .linear = true,
                               .additive_term = false});
    const EinsumAssignment deterministic = Merge(mesh, extended, sizes, problem.inputs.size(), /*grad_mode=*/true);
    if (options.mode != RuleMode::kCostBased) {
        return BuildGrad(mesh, problem, out_shape, grad_layout, deterministic);
    }
    if (options.output_target) {
        throw SpmdError(fmt::format("{}: output_target is a forward option; a grad rule prices bringing each "
                                    "gradient back to its input's layout",
                                    problem.op));
    }
    return EnumerateGrad(mesh, problem, extended, sizes, out_shape, grad_layout, deterministic, options);
}

} // namespace shardline::spmd
