#include <shardline/autograd/engine.h>
#include <shardline/autograd/function.h>
#include <shardline/core/error.h>

namespace shardline::autograd {

std::vector<Variable> Function::Apply(const std::shared_ptr<Function> &fn, const std::vector<Variable> &inputs) {
    SHARDLINE_CHECK(fn != nullptr, "Function::Apply", "the function is null");
    const Inputs values(inputs);
    bool any = false;
    for (const Variable &in : inputs) {
        any = any || in.requires_grad();
    }
    any = any && GradEnabled();
    fn->inputs_.clear();
    if (any) {
        // needs_input_grad is filled before Forward (and SetupContext) run.
        fn->inputs_.resize(inputs.size());
        for (std::size_t i = 0; i < inputs.size(); ++i) {
            fn->inputs_[i].needs_grad = inputs[i].requires_grad();
        }
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
    fn->next_edges_.reserve(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        const Variable &in = inputs[i];
        InputRecord &record = fn->inputs_[i];
        if (!record.needs_grad) {
            fn->next_edges_.emplace_back();
            continue;
        }
        fn->next_edges_.push_back(GradientEdge(in));
        const bool leaf = in.is_leaf();
        if (leaf) {
            record.leaf = in.impl();
        }
        // A local value's gradient is local: it is never moved, and a sink without a mesh takes it whatever its
        // layout (GradSink::BufferFor), so its layout is not kept. The gradient of a Partial value is Replicate on
        // those dims: every local term gets the same gradient.
        const dist::DistTensor &value = in.value();
        if (!value.is_local()) {
            record.grad_layout = leaf ? in.GradLayout() : value.layout().WithoutPartial();
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
                    "{}: it was released, with anything it saved, by an earlier backward through this graph; pass "
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
        if (!needs_input_grad(i)) {
            out[i] = dist::Grad();
            continue;
        }
        // Each gradient leaves in its grad rule's layout; only here, for an input that needs it, is it moved.
        if (out[i].value.defined() && !out[i].value.is_local()) {
            out[i].value = dist::MoveToLayout(out[i].value, inputs_[i].grad_layout);
        }
    }
    return out;
}

const dist::DistTensor &Function::Inputs::Undefined() {
    // Never destroyed: an Apply from a static destructor may still read it.
    static const auto *const undefined = new dist::DistTensor();
    return *undefined;
}

dist::GradSink Function::GradSinkFor(std::size_t i) const {
    if (!needs_input_grad(i)) {
        return {};
    }
    auto leaf = inputs_[i].leaf.lock();
    if (leaf == nullptr || !leaf->main_grad.defined()) {
        return {};
    }
    return {
        .buffer = &leaf->main_grad, .layout = inputs_[i].grad_layout, .zero_pending = &leaf->main_grad_zero_pending};
}

} // namespace shardline::autograd
