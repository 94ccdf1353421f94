// The grouped Linear (mixture-of-experts experts) on local Variables: y_e = x_e·W_eᵀ + b_e over the rows of each
// expert. The expert-tensor-parallel forms are the parallel-Linear Function over the functional core with
// options.num_experts (parallel_linear.cc).

#include <array>
#include <memory>
#include <utility>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/kernels/grouped_linear.h>

#include "param_grads.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;

/// The Function of autograd::GroupedLinear. Strided inputs are made contiguous for the kernels (so a transposed view
/// gets its correct gradient, in its own shape); the backward asks GroupedLinearBackward for exactly the gradients
/// needed (the dgrad for x, the wgrad for W, the bias grad for b; on CUDA the parameter grads run beside the dgrad).
/// Saves x only for W's grad and W only for x's. With the input activation (GeluGroupedLinear) the input is the
/// pre-activation Z and the layer runs on x = gelu_tanh(Z): it saves x only for W's grad and Z only for Z's, whose
/// gradient the dgrad's dGELU epilogue gives.
class GroupedLinearFunction final : public Function {
public:
    explicit GroupedLinearFunction(Tensor group_sizes,
                                   kernels::LinearActivation input_activation = kernels::LinearActivation::kNone)
        : group_sizes_(std::move(group_sizes)), input_activation_(input_activation) {}
    std::string name() const override { return activation() ? "GeluGroupedLinearBackward" : "GroupedLinearBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        if (activation()) {
            pre_ = in[0].local().Contiguous();
            x_ = kernels::GeluForward(pre_, kernels::GeluApproximation::kTanh);
        } else {
            x_ = in[0].local().Contiguous();
        }
        weight_ = in[1].local().Contiguous();
        const Tensor bias = in[2].defined() ? in[2].local().Contiguous() : Tensor();
        return {DistTensor::Local(
            kernels::GroupedLinearForward(x_, weight_, bias.defined() ? &bias : nullptr, group_sizes_))};
    }
    void SetupContext(const Inputs &in, const std::vector<DistTensor> &) override {
        if (!needs_input_grad(1)) {
            x_ = Tensor();
        }
        if (!needs_input_grad(0)) {
            pre_ = Tensor();
        }
        if (!needs_input_grad(0)) {
            weight_ = Tensor();
        }
        x_shape_ = in[0].local().shape();
        weight_shape_ = in[1].local().shape();
    }
    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(3);
        if (!g[0].defined()) {
            return grads;
        }
        const Tensor dy = g[0].local().Contiguous();
        const std::array<detail::ParamGradRequest, 2> requests{
            detail::ParamGradRequest{
                .needed = needs_input_grad(1), .sink = GradSinkFor(1), .local_shape = weight_shape_, .layout = {}},
            detail::ParamGradRequest{.needed = needs_input_grad(2),
                                     .sink = GradSinkFor(2),
                                     .local_shape = {weight_shape_[0], weight_shape_[1]},
                                     .layout = {}}};
        const detail::ParamGradRequest &wreq = requests[0];
        const detail::ParamGradRequest &breq = requests[1];
        detail::ParamGradTargets params = detail::PlanParamGrads(nullptr, requests, dy.dtype(), dy.device());
        Tensor &dweight = params.grads[0];
        Tensor &dbias = params.grads[1];
        // One call for the wanted grads: on CUDA the wgrad and bias grad run beside the dgrad (GroupedLinearBackward).
        Tensor dx = needs_input_grad(0) ? Tensor::Empty(x_shape_, dy.dtype(), dy.device()) : Tensor();
        kernels::GroupedLinearBackward(
            {.dy = dy,
             .x = dweight.defined() ? &x_ : nullptr,
             .weight = dx.defined() ? &weight_ : nullptr,
             .group_sizes = group_sizes_,
             .dx = dx.defined() ? &dx : nullptr,
             .dweight = dweight.defined() ? &dweight : nullptr,
             .dbias = dbias.defined() ? &dbias : nullptr,
             .accumulate = params.accumulate,
             .input_activation = dx.defined() ? input_activation_ : kernels::LinearActivation::kNone,
             .pre_activation = dx.defined() && activation() ? &pre_ : nullptr});
        if (dx.defined()) {
            grads[0].value = DistTensor::Local(std::move(dx));
        }
        grads[1] = params.GradOf(0, nullptr, wreq, {});
        grads[2] = params.GradOf(1, nullptr, breq, {});
        return grads;
    }
    void ReleaseSaved() override {
        x_ = Tensor();
        weight_ = Tensor();
        pre_ = Tensor();
    }

private:
    bool activation() const { return input_activation_ != kernels::LinearActivation::kNone; }

    Tensor group_sizes_;
    kernels::LinearActivation input_activation_ = kernels::LinearActivation::kNone;
    Tensor pre_; ///< with the input activation: Z, for its gradient
    Tensor x_;
    Tensor weight_;
    Shape x_shape_;
    Shape weight_shape_;
};

} // namespace

namespace {
Variable ApplyGroupedLinear(const char *kOp, const Variable &x, const Variable &weight, const Variable &bias,
                            const Tensor &group_sizes, kernels::LinearActivation input_activation) {
    for (const Variable *v : {&x, &weight, &bias}) {
        SHARDLINE_CHECK(!v->defined() || v->value().is_local(), kOp,
                        "takes local Variables (ColumnParallelGroupedLinear / RowParallelGroupedLinear run on a "
                        "mesh), got {}",
                        v->value().ToString());
    }
    SHARDLINE_CHECK(x.defined() && weight.defined(), kOp, "x and weight must be defined");
    SHARDLINE_CHECK(group_sizes.defined(), kOp, "the group sizes (int64 [experts]) must be given");
    return Function::Apply(std::make_shared<GroupedLinearFunction>(group_sizes, input_activation), {x, weight, bias})
        .at(0);
}
} // namespace

Variable GroupedLinear(const Variable &x, const Variable &weight, const Variable &bias, const Tensor &group_sizes) {
    return ApplyGroupedLinear("autograd::GroupedLinear", x, weight, bias, group_sizes,
                              kernels::LinearActivation::kNone);
}

Variable GeluGroupedLinear(const Variable &pre_activation, const Variable &weight, const Variable &bias,
                           const Tensor &group_sizes) {
    return ApplyGroupedLinear("autograd::GeluGroupedLinear", pre_activation, weight, bias, group_sizes,
                              kernels::LinearActivation::kGeluTanh);
}

} // namespace shardline::autograd
