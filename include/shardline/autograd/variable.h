#pragma once

// Autograd over DistTensors (DESIGN.md §6). A Variable is a shared handle to a value (a dist::DistTensor, possibly
// local) with requires_grad, grad and grad_fn. Functions (function.h) record the graph; Backward (engine.h) walks it
// in topological order and accumulates gradients into the leaves.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <shardline/dist/dist_tensor.h>
#include <shardline/dist/ops.h>

namespace shardline::autograd {

class Node;
class Variable;

/// Where a gradient goes: input `input_nr` of `node` (a Function, or a leaf's AccumulateGrad).
struct Edge {
    std::shared_ptr<Node> node;
    int input_nr = 0;
    bool valid() const { return node != nullptr; }
};

/// A vertex of the backward graph. Apply takes one gradient per forward output (undefined where none arrived) and
/// returns one per next edge (undefined where that input needs none).
class Node {
public:
    virtual ~Node() = default;
    virtual std::vector<dist::Grad> Apply(std::vector<dist::Grad> grad_outputs) = 0;
    /// Drops what the forward saved (after a backward without retain_graph).
    virtual void ReleaseSaved() {}
    /// ReleaseSaved, remembered: a Function that runs backward again after it raises a clear error (the engine calls
    /// this after a backward without retain_graph).
    void Release() {
        ReleaseSaved();
        released_ = true;
    }
    bool released() const { return released_; }
    virtual std::string name() const = 0;
    /// How many gradients Apply takes (the forward's outputs).
    int num_inputs() const { return num_inputs_; }
    const std::vector<Edge>& next_edges() const { return next_edges_; }

protected:
    std::vector<Edge> next_edges_;
    int num_inputs_ = 1;
    friend class Function;

private:
    bool released_ = false;
};

struct VariableImpl;

/// A value in the autograd graph. Copies share the same variable (like torch.Tensor).
class Variable {
public:
    Variable() = default;
    explicit Variable(dist::DistTensor value, bool requires_grad = false);
    /// A local (undistributed) variable.
    explicit Variable(Tensor value, bool requires_grad = false);

    bool defined() const { return impl_ != nullptr; }
    const dist::DistTensor& value() const;
    /// The local shard (the whole tensor when local).
    const Tensor& local() const { return value().local(); }
    const Shape& shape() const { return value().global_shape(); }
    DType dtype() const { return value().dtype(); }
    Device device() const { return value().device(); }

    bool requires_grad() const;
    /// Leaves only (a Function's output requires grad exactly when one of its inputs does).
    Variable& set_requires_grad(bool requires_grad);
    bool is_leaf() const;
    const std::shared_ptr<Node>& grad_fn() const;
    const std::string& name() const;
    Variable& set_name(std::string name);

    /// The accumulated gradient (undefined until a backward reaches this leaf). Layout: the value's, except on the
    /// deferred-partial mesh dims, where it stays Partial(sum) until a GradSync reduces it. A main grad whose zeroing
    /// is pending (ZeroGrad) is filled with zeros here first.
    const dist::DistTensor& grad() const;
    void set_grad(dist::DistTensor grad);
    /// Drops the gradient, or zeroes a main-grad buffer (keeping it). The zeroing of a main grad is deferred (as
    /// torch's zero_grad(set_to_none=True) drops the tensor): the first backward kernel that writes it overwrites
    /// (beta = 0) instead of accumulating, and reading grad() before that fills the zeros. `defer` false fills now.
    void ZeroGrad(bool defer = true);
    /// Preallocates the gradient as a buffer of `dtype` (float32 for a half-precision parameter: Megatron's main_grad)
    /// that backward kernels accumulate into with beta = 1. `buffer`, when given, is the local storage to use (a view
    /// into a GradSync bucket); it must have the value's local shape and `dtype`.
    void AllocateMainGrad(DType dtype = DType::kFloat32, Tensor buffer = {});
    bool has_main_grad() const;
    /// Mesh dims on which this leaf's gradient may stay Partial(sum) after backward (a GradSync all-reduces them).
    void set_deferred_partial(std::vector<int> mesh_dims);
    const std::vector<int>& deferred_partial() const;
    /// The layout backward leaves this leaf's gradient in.
    spmd::Layout GradLayout() const;
    /// Called after this leaf's gradient is complete for a backward pass (e.g. to launch a bucket's all-reduce).
    void AddPostAccumulateHook(std::function<void(Variable&)> hook);

    /// Backpropagates from this variable. `grad` defaults to ones (for a scalar loss: d loss / d loss).
    void Backward(const dist::DistTensor* grad = nullptr, bool retain_graph = false) const;
    /// The same value, cut from the graph.
    Variable Detach() const;
    /// Replaces the value in place (same global shape), e.g. after an optimizer step; keeps the grad and hooks.
    void SetValue(dist::DistTensor value);

    const std::shared_ptr<VariableImpl>& impl() const { return impl_; }
    explicit Variable(std::shared_ptr<VariableImpl> impl) : impl_(std::move(impl)) {}

private:
    std::shared_ptr<VariableImpl> impl_;
};

/// The state behind a Variable.
struct VariableImpl {
    dist::DistTensor value;
    bool requires_grad = false;
    std::shared_ptr<Node> grad_fn;
    int output_nr = 0; ///< which of grad_fn's forward outputs this is (its gradient's slot in grad_fn's Apply)
    std::shared_ptr<Node> grad_accumulator; ///< leaves that require grad: created on first use
    dist::DistTensor grad;
    Tensor main_grad; ///< defined when AllocateMainGrad was called
    /// main_grad holds no value yet and stands for zeros: its first writer overwrites it (ZeroGrad(defer = true)).
    bool main_grad_zero_pending = false;
    std::vector<int> deferred_partial;
    std::vector<std::function<void(Variable&)>> hooks;
    std::string name;
};

/// The edge a leaf's gradient flows into (its AccumulateGrad node), or the variable's grad_fn.
Edge GradientEdge(const Variable& variable);

} // namespace shardline::autograd
