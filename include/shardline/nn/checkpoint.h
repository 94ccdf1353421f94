#pragma once

// A training checkpoint's tensors and scalars from a model's parameters and its optimizer, for ckpt::Save / Load
// (ckpt/checkpoint.h). Every tensor aliases the live one, so a load restores parameters, moments and fp32 master
// weights in place, and the optimizer's next step uses them.

#include <vector>

#include <nlohmann/json.hpp>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/nn/optim.h>

namespace shardline::nn {

/// Each parameter under its name, then each optimizer state tensor as "optimizer.<param name>.<state name>"
/// (exp_avg, exp_avg_sq, momentum_buffer, master) in its parameter's layout. `optimizer` may be nullptr.
ckpt::TensorList TrainingTensors(const std::vector<Variable>& parameters, Optimizer* optimizer);

/// The optimizer's scalars: {"steps", "lr", "param_steps": [per parameter]}.
nlohmann::json OptimizerScalars(Optimizer& optimizer);
/// Restores what OptimizerScalars wrote; throws Error naming the field that is missing or does not fit.
void LoadOptimizerScalars(Optimizer& optimizer, const nlohmann::json& scalars);

} // namespace shardline::nn
