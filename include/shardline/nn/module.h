#pragma once

// Modules: named parameters (leaf Variables with their layouts), child modules, train/eval.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <shardline/autograd/variable.h>

namespace shardline::nn {

using autograd::Variable;

class Module {
public:
    virtual ~Module() = default;

    /// Parameters of this module and its children, named by path ("fc1.weight"), in registration order.
    std::vector<std::pair<std::string, Variable>> NamedParameters() const;
    std::vector<Variable> Parameters() const;
    /// Drops (or zeroes main-grad buffers of) every parameter's gradient.
    void ZeroGrad();
    void Train(bool on = true);
    void Eval() { Train(false); }
    bool training() const { return training_; }

protected:
    /// Registers a parameter (a leaf that requires grad) under `name`; returns it.
    Variable RegisterParameter(std::string name, Variable parameter);
    /// The same for a parameter that may be absent (a layer without a bias): an undefined one is not registered.
    Variable RegisterOptionalParameter(std::string name, Variable parameter);
    template <class M> std::shared_ptr<M> RegisterModule(std::string name, std::shared_ptr<M> module) {
        children_.emplace_back(std::move(name), module);
        return module;
    }

private:
    std::vector<std::pair<std::string, Variable>> parameters_;
    std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
    bool training_ = true;
};

} // namespace shardline::nn
