#include <fmt/format.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/variable.h>
#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>

#include "accumulate_grad.h"
#include "engine_internal.h"

namespace shardline::autograd {
namespace {

VariableImpl &Checked(const std::shared_ptr<VariableImpl> &impl, std::string_view op) {
    SHARDLINE_CHECK(impl != nullptr, op, "called on an undefined Variable");
    return *impl;
}

} // namespace

Variable::Variable(dist::DistTensor value, bool requires_grad) : impl_(std::make_shared<VariableImpl>()) {
    SHARDLINE_CHECK(value.defined(), "Variable", "the value is undefined");
    impl_->value = std::move(value);
    impl_->requires_grad = requires_grad;
}

Variable::Variable(Tensor value, bool requires_grad)
    : Variable(dist::DistTensor::Local(std::move(value)), requires_grad) {}

const dist::DistTensor &Variable::value() const { return Checked(impl_, "Variable::value").value; }
bool Variable::requires_grad() const { return impl_ != nullptr && impl_->requires_grad; }

Variable &Variable::set_requires_grad(bool requires_grad) {
    VariableImpl &impl = Checked(impl_, "Variable::set_requires_grad");
    SHARDLINE_CHECK(impl.grad_fn == nullptr, "Variable::set_requires_grad",
                    "only leaves can change requires_grad; '{}' is the output of {}", impl.name, impl.grad_fn->name());
    impl.requires_grad = requires_grad;
    return *this;
}

bool Variable::is_leaf() const { return Checked(impl_, "Variable::is_leaf").grad_fn == nullptr; }
const std::shared_ptr<Node> &Variable::grad_fn() const { return Checked(impl_, "Variable::grad_fn").grad_fn; }
const std::string &Variable::name() const { return Checked(impl_, "Variable::name").name; }

Variable &Variable::set_name(std::string name) {
    Checked(impl_, "Variable::set_name").name = std::move(name);
    return *this;
}

const dist::DistTensor &Variable::grad() const {
    VariableImpl &impl = Checked(impl_, "Variable::grad");
    if (impl.main_grad_zero_pending) {
        impl.main_grad.Fill(0.0);
        impl.main_grad_zero_pending = false;
    }
    return impl.grad;
}

void Variable::set_grad(dist::DistTensor grad) {
    VariableImpl &impl = Checked(impl_, "Variable::set_grad");
    if (grad.defined()) {
        SHARDLINE_CHECK_AS(ShapeError, grad.global_shape() == impl.value.global_shape(), "Variable::set_grad",
                           "the gradient of '{}' must have the value's global shape {}, got {}", impl.name,
                           ShapeToString(impl.value.global_shape()), grad.ToString());
    }
    impl.grad = std::move(grad);
}

void Variable::ZeroGrad(bool defer) {
    VariableImpl &impl = Checked(impl_, "Variable::ZeroGrad");
    if (impl.main_grad.defined()) {
        if (defer) {
            impl.main_grad_zero_pending = true;
        } else {
            impl.main_grad.Fill(0.0);
            impl.main_grad_zero_pending = false;
        }
        // The grad is the main-grad buffer in the grad layout; re-wrapped only when it is not that already (a first
        // ZeroGrad, a set_grad since, a new deferred Partial).
        spmd::Layout layout = GradLayout();
        const dist::DistTensor &g = impl.grad;
        if (!(g.defined() && g.local().data() == impl.main_grad.data() && g.local().shape() == impl.main_grad.shape() &&
              g.dtype() == impl.main_grad.dtype() && g.mesh_ptr() == impl.value.mesh_ptr() && g.layout() == layout &&
              g.global_shape() == impl.value.global_shape())) {
            impl.grad = dist::DistTensor::FromTrustedShard(impl.main_grad, impl.value.global_shape(), std::move(layout),
                                                           impl.value.mesh_ptr());
        }
        return;
    }
    impl.grad = dist::DistTensor();
}

void Variable::AllocateMainGrad(DType dtype, Tensor buffer) {
    VariableImpl &impl = Checked(impl_, "Variable::AllocateMainGrad");
    const Tensor &local = impl.value.local();
    if (buffer.defined()) {
        SHARDLINE_CHECK_AS(ShapeError,
                           buffer.shape() == local.shape() && buffer.dtype() == dtype &&
                               buffer.device() == local.device() && buffer.is_contiguous(),
                           "Variable::AllocateMainGrad", "the buffer of '{}' must be contiguous {} {} on {}, got {}",
                           impl.name, ShapeToString(local.shape()), DTypeName(dtype), ToString(local.device()),
                           buffer.ToString());
        impl.main_grad = std::move(buffer);
    } else {
        impl.main_grad = Tensor::Empty(local.shape(), dtype, local.device());
    }
    ZeroGrad();
}

bool Variable::has_main_grad() const { return Checked(impl_, "Variable::has_main_grad").main_grad.defined(); }

void Variable::set_deferred_partial(std::vector<int> mesh_dims) {
    VariableImpl &impl = Checked(impl_, "Variable::set_deferred_partial");
    for (int d : mesh_dims) {
        SHARDLINE_CHECK(!impl.value.is_local() && d >= 0 && d < impl.value.mesh().ndim(),
                        "Variable::set_deferred_partial", "mesh dim {} is not a dim of the mesh of '{}' ({})", d,
                        impl.name, impl.value.ToString());
    }
    impl.deferred_partial = std::move(mesh_dims);
    if (impl.main_grad.defined()) {
        ZeroGrad();
    }
}

const std::vector<int> &Variable::deferred_partial() const {
    return Checked(impl_, "Variable::deferred_partial").deferred_partial;
}

spmd::Layout Variable::GradLayout() const {
    const VariableImpl &impl = Checked(impl_, "Variable::GradLayout");
    if (impl.deferred_partial.empty()) {
        // The common case (no GradSync): the value's layout without Partial, copied once.
        const spmd::Layout &layout = impl.value.layout();
        return layout.IsPartial() ? layout.WithoutPartial() : layout;
    }
    std::map<int, spmd::ReduceOp> partial;
    for (int d : impl.deferred_partial) {
        // A mesh dim that shards the value cannot also hold a Partial (and needs no reduction).
        if (impl.value.layout().TensorDimOf(d) < 0) {
            partial[d] = spmd::ReduceOp::kSum;
        }
    }
    return impl.value.layout().WithoutPartial().WithPartial(std::move(partial));
}

void Variable::AddPostAccumulateHook(std::function<void(Variable &)> hook) {
    Checked(impl_, "Variable::AddPostAccumulateHook").hooks.push_back(std::move(hook));
}

void Variable::Backward(const dist::DistTensor *grad, bool retain_graph) const {
    detail::RunBackward(this, &grad, 1, retain_graph); // no vectors of copies for the one root
}

Variable Variable::Detach() const {
    const VariableImpl &impl = Checked(impl_, "Variable::Detach");
    Variable out(impl.value, false);
    out.impl_->name = impl.name;
    return out;
}

void Variable::SetValue(dist::DistTensor value) {
    VariableImpl &impl = Checked(impl_, "Variable::SetValue");
    SHARDLINE_CHECK_AS(ShapeError, value.global_shape() == impl.value.global_shape(), "Variable::SetValue",
                       "'{}' must keep its global shape {}, got {}", impl.name,
                       ShapeToString(impl.value.global_shape()), value.ToString());
    impl.value = std::move(value);
}

Edge GradientEdge(const Variable &variable) {
    const auto &impl = variable.impl();
    if (impl == nullptr || !impl->requires_grad) {
        return {};
    }
    if (impl->grad_fn != nullptr) {
        return {impl->grad_fn, impl->output_nr};
    }
    if (impl->grad_accumulator == nullptr) {
        impl->grad_accumulator = std::make_shared<detail::AccumulateGrad>(impl);
    }
    return {impl->grad_accumulator, 0};
}

} // namespace shardline::autograd
