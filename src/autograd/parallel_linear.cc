// The parallel Linear layers as autograd Functions over the functional core: the Function's Forward and Backward call
// functional::{Column,Row}ParallelLinear{Forward,Backward} on this rank's shards, which move the tensors by the linear
// rule's plans, run the split kernels and issue the collectives (DESIGN.md §6). What is decided here is autograd's
// part only: which gradients are needed (needs_input_grad), what to save for them, where the parameter gradients go
// (a main grad or a new tensor, param_grads.h), and the layouts the Variables carry (parallel_layers.h).

#include <array>
#include <memory>
#include <string_view>
#include <utility>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>

#include "parallel_layers.h"
#include "param_grads.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using functional::View;

using detail::kIsColumn;
using detail::LayerLayouts;

template <class Options> class ParallelLinearFunction final : public Function {
public:
    /// group_sizes: a grouped layer's (options.num_experts > 0), int64 [E] on the host or the mesh's device.
    /// input_activation (row grouped layers only): the Function's input is the pre-activation Z, the layer runs on
    /// gelu_tanh(Z) (the GELU kernel in the forward) and its dgrad yields Z's gradient (the dGELU in the epilogue).
    ParallelLinearFunction(const Options &options, const TensorParallelGroup &tp, LayerLayouts layouts,
                           Tensor group_sizes,
                           kernels::LinearActivation input_activation = kernels::LinearActivation::kNone)
        : options_(options), tp_(tp), layouts_(std::move(layouts)), group_sizes_(std::move(group_sizes)),
          input_activation_(input_activation) {}
    std::string name() const override {
        if (input_activation_ != kernels::LinearActivation::kNone) {
            return "GeluRowParallelGroupedLinearBackward";
        }
        if (options_.num_experts > 0) {
            return kIsColumn<Options> ? "ColumnParallelGroupedLinearBackward" : "RowParallelGroupedLinearBackward";
        }
        return kIsColumn<Options> ? "ColumnParallelLinearBackward" : "RowParallelLinearBackward";
    }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        const Tensor &x = in[0].local();
        const std::int64_t tp = tp_.size();
        Tensor y = Tensor::Empty(detail::LayerOutputShape(x.shape(), options_, tp_), x.dtype(), x.device());
        const Tensor bias = in[2].defined() ? in[2].local() : Tensor();
        if constexpr (kIsColumn<Options>) {
            // Sequence parallel: the all-gathered input is kept for dweight instead of being gathered again.
            if (options_.sequence_parallel && tp > 1 && needs_input_grad(1)) {
                Shape total = x.shape();
                total.front() *= tp;
                x_total_ = Tensor::Empty(total, x.dtype(), x.device());
            }
            functional::ColumnParallelLinearForward(options_,
                                                    {.x = View(x),
                                                     .weight = View(in[1].local()),
                                                     .bias = View(bias),
                                                     .y = View(y),
                                                     .x_total = View(x_total_),
                                                     .group_sizes = SizesView(),
                                                     .group_sizes_on_device = SizesOnDevice()},
                                                    tp_);
        } else {
            // With an input activation x is the pre-activation Z and the layer's input is h = gelu_tanh(Z), saved
            // each only for the gradient that needs it: h for dW, Z for dZ (the dgrad's dGELU epilogue reads it).
            const bool activated = input_activation_ != kernels::LinearActivation::kNone;
            Tensor h = activated ? kernels::GeluForward(x, kernels::GeluApproximation::kTanh) : x;
            functional::RowParallelLinearForward(options_,
                                                 {.x = View(h),
                                                  .weight = View(in[1].local()),
                                                  .bias = View(bias),
                                                  .y = View(y),
                                                  .group_sizes = SizesView(),
                                                  .group_sizes_on_device = SizesOnDevice()},
                                                 tp_);
            if (activated && needs_input_grad(1)) {
                x_ = std::move(h);
            }
            if (activated && needs_input_grad(0)) {
                pre_ = x;
            }
        }
        Shape y_global = in[0].global_shape();
        y_global.back() = options_.out_features;
        return Output(DistTensor::FromTrustedShard(std::move(y), std::move(y_global), layouts_.y, in[0].mesh_ptr()));
    }

    void SetupContext(const Inputs &in, const std::vector<DistTensor> &) override {
        // Only what the requested gradients need: x (or the gathered x) for dW, W for dX.
        if (needs_input_grad(1) && !x_total_.defined() && input_activation_ == kernels::LinearActivation::kNone) {
            x_ = in[0].local(); // (with an input activation the forward kept h)
        }
        if (needs_input_grad(0)) {
            weight_ = in[1].local();
        }
        mesh_ = in[0].mesh_ptr();
        x_global_ = in[0].global_shape();
        x_local_shape_ = in[0].local().shape();
        weight_global_ = in[1].global_shape();
        weight_local_shape_ = in[1].local().shape();
        if (options_.num_experts > 0) {
            bias_global_ = {weight_global_[0], options_.out_features}; // all experts, under expert parallelism too
            bias_local_shape_ = {weight_local_shape_[0], weight_local_shape_[1]};
        } else {
            bias_global_ = {options_.out_features};
            bias_local_shape_ = {weight_local_shape_.front()};
        }
    }

    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(3);
        if (!g[0].defined()) {
            return grads;
        }
        const Tensor &dy = g[0].local();
        auto request = [this](std::size_t input, const Shape &local_shape, const spmd::Layout &layout) {
            return detail::ParamGradRequest{.needed = needs_input_grad(input),
                                            .sink = GradSinkFor(input),
                                            .local_shape = local_shape,
                                            .layout = layout};
        };
        const std::array<detail::ParamGradRequest, 2> requests{request(1, weight_local_shape_, layouts_.weight),
                                                               request(2, bias_local_shape_, layouts_.bias)};
        const detail::ParamGradRequest &wreq = requests[0];
        const detail::ParamGradRequest &breq = requests[1];
        detail::ParamGradTargets params = detail::PlanParamGrads(mesh_, requests, dy.dtype(), dy.device());
        const Tensor &dweight = params.grads[0];
        const Tensor &dbias = params.grads[1];
        Tensor dx;
        if (needs_input_grad(0)) {
            dx = Tensor::Empty(x_local_shape_, dy.dtype(), dy.device());
        }
        const functional::GradMode mode =
            params.accumulate ? functional::GradMode::kAccumulate : functional::GradMode::kOverwrite;
        if constexpr (kIsColumn<Options>) {
            functional::ColumnParallelLinearBackward(options_,
                                                     {.dy = View(dy),
                                                      .x = View(x_),
                                                      .x_total = View(x_total_),
                                                      .weight = View(weight_),
                                                      .dx = View(dx),
                                                      .dweight = View(dweight),
                                                      .dbias = View(dbias),
                                                      .param_grads = mode,
                                                      .group_sizes = SizesView(),
                                                      .group_sizes_on_device = SizesOnDevice()},
                                                     tp_);
        } else {
            const bool activation = input_activation_ != kernels::LinearActivation::kNone;
            functional::RowParallelLinearBackward(
                options_,
                {.dy = View(dy),
                 .x = View(x_),
                 .weight = View(weight_),
                 .dx = View(dx),
                 .dweight = View(dweight),
                 .dbias = View(dbias),
                 .param_grads = mode,
                 .input_activation = activation && dx.defined() ? input_activation_ : kernels::LinearActivation::kNone,
                 .pre_activation = activation && dx.defined() ? View(pre_) : functional::TensorView{},
                 .group_sizes = SizesView(),
                 .group_sizes_on_device = SizesOnDevice()},
                tp_);
        }
        if (needs_input_grad(0)) {
            grads[0].value = DistTensor::FromTrustedShard(std::move(dx), x_global_, layouts_.x, mesh_);
        }
        grads[1] = params.GradOf(0, mesh_, wreq, weight_global_);
        grads[2] = params.GradOf(1, mesh_, breq, bias_global_);
        return grads;
    }

    void ReleaseSaved() override {
        x_ = Tensor();
        x_total_ = Tensor();
        weight_ = Tensor();
        pre_ = Tensor();
    }

private:
    functional::TensorView SizesView() const { return View(group_sizes_); }
    bool SizesOnDevice() const { return group_sizes_.defined() && !group_sizes_.device().is_cpu(); }

    Options options_; ///< bias = whether this call adds one; skip_bias_add already applied
    TensorParallelGroup tp_;
    LayerLayouts layouts_;
    Tensor x_;
    Tensor x_total_;
    Tensor weight_;
    comm::DeviceMesh *mesh_ = nullptr;
    Shape x_global_, x_local_shape_;
    Shape weight_global_, weight_local_shape_;
    Shape bias_global_, bias_local_shape_;
    Tensor group_sizes_; ///< undefined for a Linear
    kernels::LinearActivation input_activation_ = kernels::LinearActivation::kNone;
    Tensor pre_; ///< with input_activation: Z, for its gradient
};

template <class Options>
Variable ApplyParallelLinear(std::string_view op, const Variable &x, const Variable &weight, const Variable &bias,
                             const Options &options, const TensorParallelGroup &tp, const Tensor &group_sizes = {},
                             kernels::LinearActivation input_activation = kernels::LinearActivation::kNone) {
    tp.size(); // a null mesh or a bad tp_dim raises here
    comm::DeviceMesh &mesh = *tp.mesh;
    const int t = tp.tp_dim;
    detail::CheckLayerInput(op, x, mesh, options.in_features);
    if (options.num_experts > 0) {
        SHARDLINE_CHECK(group_sizes.defined(), op, "a grouped layer (num_experts {}) needs the group sizes",
                        options.num_experts);
        SHARDLINE_CHECK_AS(ShapeError, x.shape().size() == 2, op,
                           "a grouped layer takes x [tokens, in_features] with its rows grouped by expert, got {}",
                           x.value().ToString());
    }
    // Expert parallelism: the weight's experts dim sharded over a mesh dim (ep); the layer computes this rank's
    // experts.
    const int ep = detail::ExpertParallelDim(weight, t, options.num_experts);
    detail::CheckLayerParameters(op, weight, bias, options, mesh, t, ep);
    // Uneven sizes are split as torch.chunk; a rank without features is refused here, before x is redistributed.
    if constexpr (kIsColumn<Options>) {
        functional::CheckShardsNotEmpty(op, "out_features", options.out_features, tp.size());
    } else {
        functional::CheckShardsNotEmpty(op, "in_features", options.in_features, tp.size());
    }
    const spmd::Layout input_layout = detail::LayerInputLayout(mesh, x.value().layout(), options, t);
    LayerLayouts layouts = detail::LayerLayoutsFor(op, x.shape(), input_layout, options, mesh, t, ep);
    const Variable input = input_layout == x.value().layout() ? x : Redistribute(x, input_layout);

    Options call = options;
    call.bias = options.adds_bias();
    call.skip_bias_add = false;
    auto fn =
        std::make_shared<ParallelLinearFunction<Options>>(call, tp, std::move(layouts), group_sizes, input_activation);
    return Function::Apply(fn, {input, weight, options.adds_bias() ? bias : Variable()}).at(0);
}

} // namespace

Variable ColumnParallelLinear(const Variable &x, const Variable &weight, const Variable &bias,
                              const ColumnParallelLinearOptions &options, const TensorParallelGroup &tp) {
    SHARDLINE_CHECK(options.num_experts == 0, "autograd::ColumnParallelLinear",
                    "options.num_experts is {}: call ColumnParallelGroupedLinear with the group sizes",
                    options.num_experts);
    return ApplyParallelLinear("autograd::ColumnParallelLinear", x, weight, bias, options, tp);
}

Variable RowParallelLinear(const Variable &x, const Variable &weight, const Variable &bias,
                           const RowParallelLinearOptions &options, const TensorParallelGroup &tp) {
    SHARDLINE_CHECK(options.num_experts == 0, "autograd::RowParallelLinear",
                    "options.num_experts is {}: call RowParallelGroupedLinear with the group sizes",
                    options.num_experts);
    return ApplyParallelLinear("autograd::RowParallelLinear", x, weight, bias, options, tp);
}

Variable ColumnParallelGroupedLinear(const Variable &x, const Variable &weight, const Variable &bias,
                                     const Tensor &group_sizes, const ColumnParallelLinearOptions &options,
                                     const TensorParallelGroup &tp) {
    SHARDLINE_CHECK(options.num_experts > 0, "autograd::ColumnParallelGroupedLinear",
                    "options.num_experts must be > 0 (the experts), got {}", options.num_experts);
    return ApplyParallelLinear("autograd::ColumnParallelGroupedLinear", x, weight, bias, options, tp, group_sizes);
}

Variable RowParallelGroupedLinear(const Variable &x, const Variable &weight, const Variable &bias,
                                  const Tensor &group_sizes, const RowParallelLinearOptions &options,
                                  const TensorParallelGroup &tp) {
    SHARDLINE_CHECK(options.num_experts > 0, "autograd::RowParallelGroupedLinear",
                    "options.num_experts must be > 0 (the experts), got {}", options.num_experts);
    return ApplyParallelLinear("autograd::RowParallelGroupedLinear", x, weight, bias, options, tp, group_sizes);
}

Variable GeluRowParallelGroupedLinear(const Variable &pre_activation, const Variable &weight, const Variable &bias,
                                      const Tensor &group_sizes, const functional::RowParallelLinearOptions &options,
                                      const functional::TensorParallelGroup &tp) {
    constexpr std::string_view kOp = "autograd::GeluRowParallelGroupedLinear";
    SHARDLINE_CHECK(options.num_experts > 0, kOp, "options.num_experts must be > 0 (the experts), got {}",
                    options.num_experts);
    SHARDLINE_CHECK(options.input_is_parallel, kOp,
                    "the GELU's input is the column grouped layer's output split on the features: input_is_parallel "
                    "must be true");
    return ApplyParallelLinear(kOp, pre_activation, weight, bias, options, tp, group_sizes,
                               kernels::LinearActivation::kGeluTanh);
}

} // namespace shardline::autograd
