// Megatron's ParallelMLP as one autograd Function over the functional core: fc1 (column parallel) with the bias and
// GELU in its GEMM epilogue, fc2 (row parallel, input_is_parallel) whose dgrad GEMM applies GELU's gradient and gives
// fc1's bias grad. Forward and backward are two functional calls each (functional::ColumnParallelLinearForward with
// `activation`, RowParallelLinearBackward with `input_activation`); the collectives are those of column → row.
//
// Saved for the backward, each only when a requested gradient needs it: x (or, sequence parallel, the gathered x) for
// fc1's dweight, the pre-activation for everything below fc2 (dx, fc1's dweight and dbias), the activation h for fc2's
// dweight, fc1's weight for dx and fc2's weight for everything below fc2. There is no GELU node and no separate GELU
// tensor beyond h.
//
// ParallelMLPWithResidual is the same Function returning x + MLP(x): fc2's forward takes x as its residual (the GEMM's
// C with beta = 1 at tp 1, functional::RowParallelLinearForwardArgs::residual), and fc1's backward takes the output
// gradient as dx_residual, so x's gradient (the pass-through dy plus the MLP's) comes out of one dgrad GEMM. Nothing
// more is saved: the pass-through gradient is dy itself.

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
using kernels::LinearActivation;

// Inputs of the Function.
constexpr std::size_t kX = 0;
constexpr std::size_t kW1 = 1;
constexpr std::size_t kB1 = 2;
constexpr std::size_t kW2 = 3;
constexpr std::size_t kB2 = 4;

class ParallelMLPFunction final : public Function {
public:
    ParallelMLPFunction(const ColumnParallelLinearOptions &fc1, const RowParallelLinearOptions &fc2,
                        const TensorParallelGroup &tp, detail::LayerLayouts l1, detail::LayerLayouts l2, bool residual)
        : fc1_(fc1), fc2_(fc2), tp_(tp), l1_(std::move(l1)), l2_(std::move(l2)), residual_(residual) {}
    std::string name() const override { return "ParallelMLPBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        const Tensor &x = in[kX].local();
        const std::int64_t tp = tp_.size();
        const Shape h_shape = detail::LayerOutputShape(x.shape(), fc1_, tp_);
        Tensor pre = Tensor::Empty(h_shape, x.dtype(), x.device());
        Tensor h = Tensor::Empty(h_shape, x.dtype(), x.device());
        // Sequence parallel: the all-gathered input is kept for fc1's dweight instead of being gathered again.
        if (fc1_.sequence_parallel && tp > 1 && needs_input_grad(kW1)) {
            Shape total = x.shape();
            total.front() *= tp;
            x_total_ = Tensor::Empty(total, x.dtype(), x.device());
        }
        const Tensor b1 = in[kB1].defined() ? in[kB1].local() : Tensor();
        functional::ColumnParallelLinearForward(fc1_,
                                                {.x = View(x),
                                                 .weight = View(in[kW1].local()),
                                                 .bias = View(b1),
                                                 .y = View(h),
                                                 .x_total = View(x_total_),
                                                 .activation = LinearActivation::kGeluTanh,
                                                 .pre_activation = View(pre)},
                                                tp_);
        Tensor y = Tensor::Empty(detail::LayerOutputShape(h_shape, fc2_, tp_), x.dtype(), x.device());
        const Tensor b2 = in[kB2].defined() ? in[kB2].local() : Tensor();
        // With the residual, y = x + fc2(h): x (in y's layout, checked) is fc2's residual.
        functional::RowParallelLinearForward(fc2_,
                                             {.x = View(h),
                                              .weight = View(in[kW2].local()),
                                              .bias = View(b2),
                                              .y = View(y),
                                              .residual = residual_ ? View(x) : functional::TensorView{}},
                                             tp_);
        // Only what the requested gradients need (needs_input_grad is known here: nothing is kept for inference).
        if (BelowFc2Needed()) {
            pre_ = std::move(pre);
        }
        if (needs_input_grad(kW2)) {
            h_ = std::move(h);
        }
        h_shape_ = h_shape;
        Shape y_global = in[kX].global_shape();
        y_global.back() = fc2_.out_features;
        return Output(DistTensor::FromTrustedShard(std::move(y), std::move(y_global), l2_.y, in[kX].mesh_ptr()));
    }

    void SetupContext(const Inputs &in, const std::vector<DistTensor> &) override {
        if (needs_input_grad(kW1) && !x_total_.defined()) {
            x_ = in[kX].local();
        }
        if (needs_input_grad(kX)) {
            w1_ = in[kW1].local();
        }
        if (BelowFc2Needed()) {
            w2_ = in[kW2].local();
        }
        mesh_ = in[kX].mesh_ptr();
        x_global_ = in[kX].global_shape();
        x_local_shape_ = in[kX].local().shape();
        w1_global_ = in[kW1].global_shape();
        w1_local_shape_ = in[kW1].local().shape();
        w2_global_ = in[kW2].global_shape();
        w2_local_shape_ = in[kW2].local().shape();
    }

    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(5);
        if (!g[0].defined()) {
            return grads;
        }
        const Tensor &dy = g[0].local();
        auto request = [this](std::size_t input, Shape local_shape, const spmd::Layout &layout) {
            return detail::ParamGradRequest{.needed = needs_input_grad(input),
                                            .sink = GradSinkFor(input),
                                            .local_shape = std::move(local_shape),
                                            .layout = layout};
        };
        const std::array<detail::ParamGradRequest, 4> requests = {
            request(kW1, w1_local_shape_, l1_.weight), request(kB1, {w1_local_shape_.front()}, l1_.bias),
            request(kW2, w2_local_shape_, l2_.weight), request(kB2, {fc2_.out_features}, l2_.bias)};
        detail::ParamGradTargets params = detail::PlanParamGrads(mesh_, requests, dy.dtype(), dy.device());
        const functional::GradMode mode =
            params.accumulate ? functional::GradMode::kAccumulate : functional::GradMode::kOverwrite;

        // fc2: dweight, dbias, and (for anything below it) the pre-activation's gradient with fc1's bias grad.
        Tensor dpre;
        if (BelowFc2Needed()) {
            dpre = Tensor::Empty(h_shape_, dy.dtype(), dy.device());
        }
        functional::RowParallelLinearBackward(fc2_,
                                              {.dy = View(dy),
                                               .x = View(h_),
                                               .weight = View(w2_),
                                               .dx = View(dpre),
                                               .dweight = View(params.grads[2]),
                                               .dbias = View(params.grads[3]),
                                               .param_grads = mode,
                                               .input_activation = LinearActivation::kGeluTanh,
                                               .pre_activation = View(pre_),
                                               .pre_activation_dbias = View(params.grads[1])},
                                              tp_);
        // fc1: dx and dweight (its dbias came out of fc2's dgrad).
        Tensor dx;
        if (needs_input_grad(kX)) {
            dx = Tensor::Empty(x_local_shape_, dy.dtype(), dy.device());
        }
        if (needs_input_grad(kX) || needs_input_grad(kW1)) {
            functional::ColumnParallelLinearBackward(
                fc1_,
                {.dy = View(dpre),
                 .x = View(x_),
                 .x_total = View(x_total_),
                 .weight = View(w1_),
                 .dx = View(dx),
                 .dweight = View(params.grads[0]),
                 .param_grads = mode,
                 // x's pass-through gradient, added by the dgrad GEMM
                 .dx_residual = residual_ && needs_input_grad(kX) ? View(dy) : functional::TensorView{}},
                tp_);
        }
        if (needs_input_grad(kX)) {
            grads[kX].value = DistTensor::FromTrustedShard(std::move(dx), x_global_, l1_.x, mesh_);
        }
        grads[kW1] = params.GradOf(0, mesh_, requests[0], w1_global_);
        grads[kB1] = params.GradOf(1, mesh_, requests[1], {fc1_.out_features});
        grads[kW2] = params.GradOf(2, mesh_, requests[2], w2_global_);
        grads[kB2] = params.GradOf(3, mesh_, requests[3], {fc2_.out_features});
        return grads;
    }

    void ReleaseSaved() override {
        x_ = Tensor();
        x_total_ = Tensor();
        pre_ = Tensor();
        h_ = Tensor();
        w1_ = Tensor();
        w2_ = Tensor();
    }

private:
    /// Whether a gradient below fc2 is wanted: x's, or fc1's weight or bias; they all start from the pre-activation's.
    bool BelowFc2Needed() const { return needs_input_grad(kX) || needs_input_grad(kW1) || needs_input_grad(kB1); }

    ColumnParallelLinearOptions fc1_; ///< bias = whether fc1 adds one; skip_bias_add already applied
    RowParallelLinearOptions fc2_;    ///< the same for fc2
    TensorParallelGroup tp_;
    detail::LayerLayouts l1_; ///< fc1: x (and dx), h, dW1, db1
    detail::LayerLayouts l2_; ///< fc2: h, y (and dy), dW2, db2
    bool residual_ = false;   ///< y = x + MLP(x)
    Tensor x_, x_total_, pre_, h_, w1_, w2_;
    comm::DeviceMesh *mesh_ = nullptr;
    Shape h_shape_;
    Shape x_global_, x_local_shape_;
    Shape w1_global_, w1_local_shape_;
    Shape w2_global_, w2_local_shape_;
};

Variable ApplyParallelMLP(std::string_view kOp, const Variable &x, const Variable &fc1_weight, const Variable &fc1_bias,
                          const Variable &fc2_weight, const Variable &fc2_bias, const ColumnParallelLinearOptions &fc1,
                          const RowParallelLinearOptions &fc2, const TensorParallelGroup &tp, bool residual) {
    tp.size(); // a null mesh or a bad tp_dim raises here
    comm::DeviceMesh &mesh = *tp.mesh;
    const int t = tp.tp_dim;
    SHARDLINE_CHECK(!fc1.gather_output, kOp,
                    "fc1 applies GELU to its output features split over tp: gather_output must be false");
    SHARDLINE_CHECK(!(fc1.bias && fc1.skip_bias_add), kOp,
                    "fc1's bias goes inside GELU (gelu(x·W1ᵀ + b1)): skip_bias_add must be false when fc1 has a bias");
    SHARDLINE_CHECK(fc2.input_is_parallel, kOp,
                    "fc2 takes fc1's output split on the features: input_is_parallel must be true");
    SHARDLINE_CHECK(fc1.sequence_parallel == fc2.sequence_parallel, kOp,
                    "fc1 and fc2 must agree on sequence_parallel, got {} and {}", fc1.sequence_parallel,
                    fc2.sequence_parallel);
    SHARDLINE_CHECK_AS(ShapeError, fc1.out_features == fc2.in_features, kOp,
                       "fc1's out_features ({}) must be fc2's in_features ({})", fc1.out_features, fc2.in_features);
    detail::CheckLayerInput(kOp, x, mesh, fc1.in_features);
    detail::CheckLayerParameters(kOp, fc1_weight, fc1_bias, fc1, mesh, t);
    detail::CheckLayerParameters(kOp, fc2_weight, fc2_bias, fc2, mesh, t);
    functional::CheckShardsNotEmpty(kOp, "the ffn size fc1.out_features", fc1.out_features, tp.size());

    const spmd::Layout input_layout = detail::LayerInputLayout(mesh, x.value().layout(), fc1, t);
    detail::LayerLayouts l1 = detail::LayerLayoutsFor(kOp, x.shape(), input_layout, fc1, mesh, t);
    Shape h_global = x.shape();
    h_global.back() = fc1.out_features;
    detail::LayerLayouts l2 = detail::LayerLayoutsFor(kOp, h_global, l1.y, fc2, mesh, t);
    // The residual x is added to fc2's output and dy is x's pass-through gradient: both need x's local shard in y's
    // layout (the block keeps the hidden size; fc1's input and fc2's output are both replicated over tp, or both split
    // on the sequence under sequence parallelism).
    SHARDLINE_CHECK_AS(ShapeError, !residual || fc2.out_features == fc1.in_features, kOp,
                       "x + MLP(x) needs fc2's out_features ({}) to be fc1's in_features ({})", fc2.out_features,
                       fc1.in_features);
    SHARDLINE_CHECK(!residual || l1.x == l2.y, kOp, "x + MLP(x) needs the output in the input's layout: x {} and y {}",
                    l1.x.ToString(), l2.y.ToString());
    const Variable input = input_layout == x.value().layout() ? x : Redistribute(x, input_layout);

    ColumnParallelLinearOptions call1 = fc1;
    call1.bias = fc1.adds_bias();
    call1.skip_bias_add = false;
    RowParallelLinearOptions call2 = fc2;
    call2.bias = fc2.adds_bias();
    call2.skip_bias_add = false;
    auto fn = std::make_shared<ParallelMLPFunction>(call1, call2, tp, std::move(l1), std::move(l2), residual);
    return Function::Apply(fn, {input, fc1_weight, call1.bias ? fc1_bias : Variable(), fc2_weight,
                                call2.bias ? fc2_bias : Variable()})
        .at(0);
}

} // namespace

Variable ParallelMLP(const Variable &x, const Variable &fc1_weight, const Variable &fc1_bias,
                     const Variable &fc2_weight, const Variable &fc2_bias, const ColumnParallelLinearOptions &fc1,
                     const RowParallelLinearOptions &fc2, const TensorParallelGroup &tp) {
    return ApplyParallelMLP("autograd::ParallelMLP", x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1, fc2, tp,
                            /*residual=*/false);
}

Variable ParallelMLPWithResidual(const Variable &x, const Variable &fc1_weight, const Variable &fc1_bias,
                                 const Variable &fc2_weight, const Variable &fc2_bias,
                                 const ColumnParallelLinearOptions &fc1, const RowParallelLinearOptions &fc2,
                                 const TensorParallelGroup &tp) {
    return ApplyParallelMLP("autograd::ParallelMLPWithResidual", x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1,
                            fc2, tp, /*residual=*/true);
}

} // namespace shardline::autograd
