#include <shardline/autograd/engine.h>
#include <shardline/autograd/function.h>
#include <shardline/core/error.h>

namespace shardline::autograd {

std::vector<Variable> Function::Apply(const std::shared_ptr<Function> &fn, const std::vector<Variable> &inputs) {
    SHARDLINE_CHECK(fn != nullptr, "Function::Apply", "the function is null");
    std::vector<dist::DistTensor> values;
    values.reserve(inputs.size());
    fn->needs_input_grad_.assign(inputs.size(), false);
    bool any = false;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        values.push_back(inputs[i].defined() ? inputs[i].value() : dist::DistTensor());
        const bool needs = GradEnabled() && inputs[i].requires_grad();
        fn->needs_input_grad_[i] = needs;
        any = any || needs;
    }
    std::vector<dist::DistTensor> outputs = fn->Forward(values);
    std::vector<Variable> result;
    result.reserve(outputs.size());
    if (!any) {
        for (auto &o : outputs) {
            result.emplace_back(std::move(o), false);
        }
        return result;
    }
    fn->SetupContext(values, outputs);
    fn->num_inputs_ = static_cast<int>(outputs.size());
    fn->next_edges_.clear();
    fn->grad_layouts_.clear();
    fn->leaves_.clear();
    fn->next_edges_.reserve(inputs.size());
    fn->grad_layouts_.reserve(inputs.size());
    fn->leaves_.reserve(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        const Variable &in = inputs[i];
        if (!fn->needs_input_grad_[i]) {
            fn->next_edges_.emplace_back();
            fn->grad_layouts_.emplace_back();
            fn->leaves_.emplace_back();
            continue;
        }
        fn->next_edges_.push_back(GradientEdge(in));
        if (in.is_leaf()) {
            fn->grad_layouts_.push_back(in.GradLayout());
            fn->leaves_.push_back(in.impl());
        } else {
            // The gradient of a Partial value is Replicate on those dims: every local term gets the same gradient.
            fn->grad_layouts_.push_back(in.value().layout().WithoutPartial());
            fn->leaves_.emplace_back();
        }
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
        Variable v(std::move(outputs[i]), false);
        v.impl()->requires_grad = true;
        v.impl()->grad_fn = fn;
        v.impl()->output_nr = static_cast<int>(i);
        result.push_back(std::move(v));
    }
    return result;
}

std::vector<dist::Grad> Function::Apply(std::vector<dist::Grad> grad_outputs) {
    SHARDLINE_CHECK(!released(), "autograd::Backward",
                    "{}: its saved tensors were freed by an earlier backward through this graph; pass "
                    "retain_graph = true to that backward to backpropagate through the graph again",
                    name());
    std::vector<dist::DistTensor> grads;
    grads.reserve(grad_outputs.size());
    for (auto &g : grad_outputs) {
        grads.push_back(std::move(g.value));
    }
    std::vector<dist::Grad> out = Backward(grads);
    out.resize(next_edges_.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
        if (!needs_input_grad_[i]) {
            out[i] = dist::Grad();
            continue;
        }
        // Each gradient leaves in its grad rule's layout; only here, for an input that needs it, is it moved.
        if (out[i].value.defined() && !out[i].value.is_local()) {
            out[i].value = dist::MoveToLayout(out[i].value, grad_layouts_[i]);
        }
    }
    return out;
}

dist::GradSink Function::GradSinkFor(std::size_t i) const {
    if (i >= leaves_.size() || !needs_input_grad_[i]) {
        return {};
    }
    auto leaf = leaves_[i].lock();
    if (leaf == nullptr || !leaf->main_grad.defined()) {
        return {};
    }
    return {.buffer = &leaf->main_grad, .layout = grad_layouts_[i], .zero_pending = &leaf->main_grad_zero_pending};
}

} // namespace shardline::autograd
