#include "accumulate_grad.h"

#include <utility>

#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>

namespace shardline::autograd::detail {

std::vector<dist::Grad> AccumulateGrad::Apply(std::vector<dist::Grad> grad_outputs) {
    if (!grad_outputs.empty()) {
        Accumulate(std::move(grad_outputs[0]));
    }
    if (auto impl = leaf_.lock(); impl != nullptr && !impl->hooks.empty()) {
        Variable leaf(impl);
        for (auto &hook : impl->hooks) {
            hook(leaf);
        }
    }
    return {};
}

void AccumulateGrad::Accumulate(dist::Grad grad) {
    auto impl = leaf_.lock();
    if (impl == nullptr || !grad.value.defined()) {
        return; // the leaf is gone, or the gradient already went into its main grad
    }
    const dist::DistTensor &g = grad.value;
    if (impl->main_grad.defined()) {
        // main_grad += g (in the buffer's dtype, e.g. fp32 for a bf16 parameter); = g while it stands for zeros.
        Tensor converted;
        if (g.dtype() != impl->main_grad.dtype()) {
            converted = g.local().To(impl->main_grad.dtype());
        }
        const Tensor &addend = converted.defined() ? converted : g.local();
        if (impl->main_grad_zero_pending) {
            impl->main_grad.CopyFrom(addend);
            impl->main_grad_zero_pending = false;
        } else {
            kernels::Add({.a = impl->main_grad, .b = addend, .out = impl->main_grad});
        }
        return;
    }
    if (!impl->grad.defined()) {
        impl->grad = std::move(grad.value);
        return;
    }
    // Out of place: an earlier gradient may share storage with a tensor someone else holds.
    impl->grad = dist::Add(impl->grad, g);
}

} // namespace shardline::autograd::detail
