#include <fmt/format.h>

#include <shardline/core/error.h>
#include <shardline/nn/checkpoint.h>

namespace shardline::nn {

ckpt::TensorList TrainingTensors(const std::vector<Variable> &parameters, Optimizer *optimizer) {
    ckpt::TensorList tensors;
    for (const Variable &p : parameters) {
        tensors.emplace_back(p.name(), p.value());
    }
    if (optimizer != nullptr) {
        for (Optimizer::ParamState &state : optimizer->State()) {
            for (auto &[name, tensor] : state.tensors) {
                tensors.emplace_back(fmt::format("optimizer.{}.{}", state.param.name(), name),
                                     state.param.value().WithLocal(tensor));
            }
        }
    }
    return tensors;
}

nlohmann::json OptimizerScalars(Optimizer &optimizer) {
    nlohmann::json steps = nlohmann::json::array();
    for (const Optimizer::ParamState &state : optimizer.State()) {
        steps.push_back(state.step);
    }
    return {{"steps", optimizer.steps()}, {"lr", optimizer.lr()}, {"param_steps", steps}};
}

void LoadOptimizerScalars(Optimizer &optimizer, const nlohmann::json &scalars) {
    SHARDLINE_CHECK(scalars.is_object() && scalars.contains("steps") && scalars.contains("param_steps") &&
                        scalars.contains("lr"),
                    "nn::LoadOptimizerScalars", "an object with \"steps\", \"lr\" and \"param_steps\" expected, got {}",
                    scalars.dump());
    try {
        optimizer.LoadSteps(scalars.at("param_steps").get<std::vector<std::int64_t>>(),
                            scalars.at("steps").get<std::int64_t>());
        optimizer.set_lr(scalars.at("lr").get<double>());
    } catch (const nlohmann::json::exception &e) {
        SHARDLINE_THROW(Error, "nn::LoadOptimizerScalars", "malformed optimizer scalars {}: {}", scalars.dump(),
                        e.what());
    }
}

} // namespace shardline::nn
