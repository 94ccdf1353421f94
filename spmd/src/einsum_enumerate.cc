// The strategy enumeration (EnumerateEinsumStrategies, einsum.h): DTensor's gen_einsum_strategies over the einsum
// engine's labels -- per mesh dim all-Replicate or one label sharded, the product over mesh dims -- each candidate
// priced by the redistributions from the given input layouts and its local compute.

#include <algorithm>

#include <fmt/format.h>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/redistribute.h>

#include "einsum_internal.h"

namespace shardline::spmd {

namespace {

/// The labels offered per mesh dim, in DTensor's order: batch (every operand and the output), contracted (not in
/// the output), the other output labels; each group sorted. Only labels some operand may shard.
std::string OfferedLabels(const EinsumProblem &problem, const std::map<char, int64_t> &sizes) {
    const std::string shardable = detail::ShardableLabels(problem, sizes);
    std::string batch;
    std::string contracted;
    std::string free;
    for (char label : shardable) {
        const bool in_output = problem.output.find(label) != std::string::npos;
        const bool everywhere = std::all_of(problem.inputs.begin(), problem.inputs.end(), [label](const auto &o) {
            return o.labels.find(label) != std::string::npos;
        });
        (in_output ? (everywhere ? batch : free) : contracted).push_back(label);
    }
    std::sort(batch.begin(), batch.end());
    std::sort(contracted.begin(), contracted.end());
    std::sort(free.begin(), free.end());
    return batch + contracted + free;
}

} // namespace

EinsumStrategies EnumerateEinsumStrategies(const ProcessMesh &mesh, const EinsumProblem &raw,
                                           const PlanOptions &options) {
    const EinsumProblem problem = detail::Canonicalized(mesh, raw);
    const auto sizes = EinsumLabelSizes(problem);
    const std::string labels = OfferedLabels(problem, sizes);
    // Choices per mesh dim: 0 = Replicate, k > 0 = shard labels[k - 1]. Counted before anything is priced.
    std::vector<int> choices(mesh.NDim(), 1);
    int64_t count = 1;
    for (int d = 0; d < mesh.NDim(); ++d) {
        if (mesh.DimSize(d) > 1) {
            choices[d] = 1 + static_cast<int>(labels.size());
        }
        count *= choices[d]; // <= 53 per dim and checked every dim: no overflow
        if (count > kMaxCandidates) {
            throw SpmdError(fmt::format("{}: the enumeration has more than {} strategies (per mesh dim of size > 1: "
                                        "Replicate or one of the {} labels '{}'); use fewer mesh dims",
                                        problem.op, kMaxCandidates, labels.size(), labels));
        }
    }
    detail::PlanCosts plans(mesh, options);
    EinsumStrategies result;
    result.strategies.reserve(static_cast<size_t>(count));
    std::vector<int> index(mesh.NDim(), 0);
    for (int64_t c = 0; c < count; ++c) {
        EinsumStrategy s;
        for (int d = 0; d < mesh.NDim(); ++d) { // ascending: co-sharded labels list their mesh dims in order
            if (index[d] > 0) {
                s.assignment.labels[labels[index[d] - 1]].push_back(d);
            }
        }
        const EinsumResult applied = ApplyAssignment(mesh, problem, s.assignment);
        s.inputs = applied.inputs;
        s.output = applied.output;
        for (size_t i = 0; i < problem.inputs.size(); ++i) {
            s.redistribute_us += plans(problem.inputs[i].shape, problem.inputs[i].layout, s.inputs[i].layout);
        }
        s.compute_us = detail::ComputeCost(mesh, sizes, s.assignment, options.cost);
        s.cost_us = s.redistribute_us + s.compute_us;
        if (!result.strategies.empty() && s.cost_us < result.strategies[result.chosen].cost_us - 1e-9) {
            result.chosen = result.strategies.size();
        }
        result.strategies.push_back(std::move(s));
        // itertools.product order: the last mesh dim varies fastest.
        for (int d = mesh.NDim() - 1; d >= 0; --d) {
            if (++index[d] < choices[d]) {
                break;
            }
            index[d] = 0;
        }
    }
    return result;
}

} // namespace shardline::spmd
