#pragma once

#include <memory>
#include <string>
#include <vector>

#include <shardline/autograd/variable.h>

namespace shardline::autograd::detail {

/// The node a leaf's gradient flows into: adds it to the leaf's grad (or its main-grad buffer), then runs the leaf's
/// post-accumulate hooks.
class AccumulateGrad final : public Node {
public:
    explicit AccumulateGrad(const std::shared_ptr<VariableImpl>& leaf) : leaf_(leaf) {}
    std::vector<dist::Grad> Apply(std::vector<dist::Grad> grad_outputs) override;
    /// Adds a gradient that arrived (Function::Apply delivers it already in the leaf's GradLayout()).
    /// Taken by value: a leaf without a gradient yet keeps the arriving one without copying it.
    void Accumulate(dist::Grad grad);
    std::string name() const override { return "AccumulateGrad"; }

private:
    std::weak_ptr<VariableImpl> leaf_;
};

} // namespace shardline::autograd::detail
