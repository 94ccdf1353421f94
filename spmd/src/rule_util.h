#pragma once

// Private helpers shared by the per-op rule files.

#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd::detail {

/// Labels for up to 10 leading (batch) dims; the rules use other letters for their named dims.
inline constexpr std::string_view kBatchLabels = "abcdefghij";

inline std::string BatchLabels(size_t count, std::string_view op) {
    if (count > kBatchLabels.size()) {
        throw SpmdError(fmt::format("{}: at most {} batch dims are supported, got {}", op, kBatchLabels.size(), count));
    }
    return std::string(kBatchLabels.substr(0, count));
}

/// Normalises a possibly negative axis; throws naming the op.
inline int NormalizeAxis(int axis, int rank, std::string_view op) {
    const int normalized = axis < 0 ? axis + rank : axis;
    if (normalized < 0 || normalized >= rank) {
        throw SpmdError(fmt::format("{}: axis {} out of range for a tensor of rank {}", op, axis, rank));
    }
    return normalized;
}

inline void CheckSpec(const ProcessMesh &mesh, const TensorSpec &spec, std::string_view op, std::string_view name) {
    for (int64_t s : spec.shape) {
        if (s < 0) {
            throw SpmdError(fmt::format("{}: {}.shape {} has a negative dim", op, name, ShapeToString(spec.shape)));
        }
    }
    CheckShape(spec.shape, fmt::format("{}: {}.shape", op, name));
    spec.layout.Validate(mesh, static_cast<int>(spec.shape.size()), fmt::format("{}: {}", op, name));
}

inline SpmdInfo FromForward(const EinsumResult &result, const EinsumProblem &problem, std::string output_name = "out") {
    SpmdInfo info;
    for (const EinsumOperand &operand : problem.inputs) {
        info.input_names.push_back(operand.name);
    }
    info.inputs = result.inputs;
    info.output_names = {std::move(output_name)};
    info.outputs = {result.output};
    info.cost_us = result.cost_us;
    return info;
}

/// Grad answer: required forward inputs, required out_grad, grads of the inputs flagged differentiable.
inline SpmdInfo FromGrad(const EinsumGradResult &result, const EinsumProblem &problem,
                         const std::vector<bool> &differentiable) {
    SpmdInfo info;
    for (const EinsumOperand &operand : problem.inputs) {
        info.input_names.push_back(operand.name);
    }
    info.inputs = result.inputs;
    info.cost_us = result.cost_us;
    info.input_names.push_back("out_grad");
    info.inputs.push_back(result.out_grad);
    for (size_t i = 0; i < problem.inputs.size(); ++i) {
        if (differentiable[i]) {
            info.output_names.push_back(problem.inputs[i].name + "_grad");
            info.outputs.push_back(result.input_grads[i]);
        }
    }
    return info;
}

inline EinsumOperand Operand(std::string name, std::string labels, const TensorSpec &spec, int priority,
                             bool linear = true, bool additive_term = false) {
    return {.name = std::move(name),
            .labels = std::move(labels),
            .shape = spec.shape,
            .layout = spec.layout,
            .priority = priority,
            .linear = linear,
            .additive_term = additive_term};
}

} // namespace shardline::spmd::detail
