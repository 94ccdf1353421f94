#include <shardline/core/error.h>
#include <shardline/nn/module.h>

namespace shardline::nn {

std::vector<std::pair<std::string, Variable>> Module::NamedParameters() const {
    std::vector<std::pair<std::string, Variable>> out = parameters_;
    for (const auto &[name, child] : children_) {
        for (auto &[pname, p] : child->NamedParameters()) {
            out.emplace_back(name + "." + pname, p);
        }
    }
    return out;
}

std::vector<Variable> Module::Parameters() const {
    std::vector<Variable> out;
    for (auto &[name, p] : NamedParameters()) {
        out.push_back(p);
    }
    return out;
}

void Module::ZeroGrad() {
    for (auto &p : Parameters()) {
        p.ZeroGrad();
    }
}

void Module::Train(bool on) {
    training_ = on;
    for (auto &[name, child] : children_) {
        child->Train(on);
    }
}

Variable Module::RegisterParameter(std::string name, Variable parameter) {
    SHARDLINE_CHECK(parameter.defined() && parameter.is_leaf(), "Module::RegisterParameter",
                    "parameter '{}' must be a defined leaf", name);
    parameter.set_requires_grad(true);
    parameters_.emplace_back(std::move(name), parameter);
    return parameter;
}

Variable Module::RegisterOptionalParameter(std::string name, Variable parameter) {
    return parameter.defined() ? RegisterParameter(std::move(name), std::move(parameter)) : Variable();
}

} // namespace shardline::nn
