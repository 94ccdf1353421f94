#pragma once

// A differentiable operation (InfiniTrain / torch.autograd.Function style). A Function subclass implements
//   Forward(inputs) -> outputs       the values, from the dist ops (no graph work);
//   SetupContext(inputs, outputs)    saves only what the requested gradients need (needs_input_grad is filled first);
//   Backward(grad_outputs) -> grads  one per input, only where needs_input_grad, in the grad rule's layouts.
// Apply runs them and records the node; the engine then moves each gradient to its input's layout (redistributing
// only for inputs that need one) before passing it on.

#include <memory>
#include <utility>
#include <vector>

#include <shardline/autograd/variable.h>

namespace shardline::autograd {

class Function : public Node {
public:
    /// Runs fn's Forward on the inputs' values (undefined Variables pass as undefined tensors) and, when grad mode is
    /// on and an input requires grad, records fn as the outputs' grad_fn.
    static std::vector<Variable> Apply(const std::shared_ptr<Function>& fn, const std::vector<Variable>& inputs);

    std::vector<dist::Grad> Apply(std::vector<dist::Grad> grad_outputs) final;

protected:
    /// The inputs of one Apply as Forward and SetupContext read them: input i's value, by reference into its Variable
    /// (an undefined Variable reads as an undefined DistTensor), so that calling them copies no value. Valid during
    /// that Apply only: what a backward needs later, SetupContext copies (a Tensor copy shares its storage). Neither
    /// may replace an input Variable's value (SetValue) while it reads the view.
    class Inputs {
    public:
        explicit Inputs(const std::vector<Variable>& variables) : variables_(&variables) {}
        Inputs(std::vector<Variable>&&) = delete; // a view of a temporary vector would dangle
        Inputs(const Inputs&) = delete;
        Inputs& operator=(const Inputs&) = delete;
        std::size_t size() const { return variables_->size(); }
        const dist::DistTensor& operator[](std::size_t i) const {
            const Variable& v = (*variables_)[i];
            return v.defined() ? v.value() : Undefined();
        }

    private:
        static const dist::DistTensor& Undefined();
        const std::vector<Variable>* variables_;
    };

    virtual std::vector<dist::DistTensor> Forward(const Inputs& inputs) = 0;
    virtual void SetupContext(const Inputs& inputs, const std::vector<dist::DistTensor>& outputs) = 0;
    virtual std::vector<dist::Grad> Backward(const std::vector<dist::DistTensor>& grad_outputs) = 0;

    /// A Forward's one output, moved into the vector (`return {out};` would copy it: a braced list is const).
    static std::vector<dist::DistTensor> Output(dist::DistTensor out) {
        std::vector<dist::DistTensor> outputs;
        outputs.reserve(1);
        outputs.push_back(std::move(out));
        return outputs;
    }
    bool needs_input_grad(std::size_t i) const { return i < inputs_.size() && inputs_[i].needs_grad; }
    /// The main-grad buffer of input i when it is a leaf that has one (backward kernels may accumulate into it when
    /// their gradient has the sink's layout); empty otherwise.
    dist::GradSink GradSinkFor(std::size_t i) const;

private:
    /// What the backward needs to know of forward input i (one vector for all inputs; empty when none needs a grad).
    struct InputRecord {
        bool needs_grad = false;
        spmd::Layout grad_layout;         ///< where its gradient must end (filled when it needs one and is on a mesh)
        std::weak_ptr<VariableImpl> leaf; ///< a leaf input (for its main-grad sink)
    };
    std::vector<InputRecord> inputs_;
};

} // namespace shardline::autograd
