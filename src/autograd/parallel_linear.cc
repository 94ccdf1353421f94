// The parallel Linear layers as autograd Functions over the functional core: the Function's Forward and Backward call
// functional::{Column,Row}ParallelLinear{Forward,Backward} on this rank's shards, which move the tensors by the linear
// rule's plans, run the split kernels and issue the collectives (DESIGN.md §6). What is decided here is autograd's
// part only: which gradients are needed (needs_input_grad), what to save for them, where the parameter gradients go
// (a main grad or a new tensor, param_grads.h), and the layouts the Variables carry.
//
// Layouts: the layer computes on x moved to its input layout (PlaceTp); mesh dims other than tp (e.g. dp) may
// shard x's leading dims and are independent replicas of the layer for the functional core. So y keeps those shards,
// dx comes back in x's layout, and dweight/dbias are Partial(sum) over them (each rank summed its own rows) until a
// GradSync or the engine reduces them.

#include <string_view>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>

#include "param_grads.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using functional::View;

/// `layout` without Partials, with tp taken off every dim and every mesh dim off the feature (last) dim, then tp
/// placed as the minor shard of dim 0 and/or on the feature dim. The layer's input layout (column + sequence parallel:
/// tp on dim 0; row + input_is_parallel: tp on the features) and its output layout (row + sequence parallel: tp on dim
/// 0; column without gather_output: tp on the features) are both this of x's layout: the leading dims keep their
/// shards over the other mesh dims (e.g. dp).
spmd::Layout PlaceTp(const spmd::Layout &x, int tp_dim, bool tp_on_seq, bool tp_on_features) {
    std::vector<std::vector<int>> dims = x.DimsMeshDims();
    for (auto &d : dims) {
        std::erase(d, tp_dim);
    }
    dims.back().clear();
    if (tp_on_seq) {
        dims.front().push_back(tp_dim);
    }
    if (tp_on_features) {
        dims.back().push_back(tp_dim);
    }
    return spmd::Layout(std::move(dims));
}

/// A parameter gradient's layout: the parameter's, Partial(sum) over every mesh dim other than tp that shards the
/// input's rows.
spmd::Layout ParamGradLayout(const spmd::Layout &param, const spmd::Layout &input, int tp_dim) {
    std::map<int, spmd::ReduceOp> partial;
    for (int t = 0; t + 1 < input.TensorRank(); ++t) {
        for (int d : input.MeshDims(t)) {
            if (d != tp_dim) {
                partial[d] = spmd::ReduceOp::kSum;
            }
        }
    }
    return param.WithPartial(std::move(partial));
}

template <class Options> constexpr bool kIsColumn = std::is_same_v<Options, ColumnParallelLinearOptions>;

/// The layouts of one layer call, decided before the Function runs.
struct LayerLayouts {
    spmd::Layout x;      ///< the input as the layer computes on it (and dx)
    spmd::Layout y;      ///< the output (and dy)
    spmd::Layout weight; ///< dweight: the weight's layout with the rows' Partials
    spmd::Layout bias;   ///< dbias
};

template <class Options> class ParallelLinearFunction final : public Function {
public:
    ParallelLinearFunction(const Options &options, const TensorParallelGroup &tp, LayerLayouts layouts)
        : options_(options), tp_(tp), layouts_(std::move(layouts)) {}
    std::string name() const override {
        return kIsColumn<Options> ? "ColumnParallelLinearBackward" : "RowParallelLinearBackward";
    }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor> &in) override {
        const Tensor &x = in[0].local();
        const std::int64_t tp = tp_.size();
        Shape y_shape = x.shape();
        y_shape.back() = options_.out_features;
        if constexpr (kIsColumn<Options>) {
            if (options_.sequence_parallel) {
                y_shape.front() *= tp;
            }
            if (!options_.gather_output) {
                y_shape.back() /= tp;
            }
        } else if (options_.sequence_parallel) {
            y_shape.front() /= tp;
        }
        Tensor y = Tensor::Empty(y_shape, x.dtype(), x.device());
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
                                                     .x_total = View(x_total_)},
                                                    tp_);
        } else {
            functional::RowParallelLinearForward(
                options_, {.x = View(x), .weight = View(in[1].local()), .bias = View(bias), .y = View(y)}, tp_);
        }
        Shape y_global = in[0].global_shape();
        y_global.back() = options_.out_features;
        return {DistTensor::FromTrustedShard(std::move(y), std::move(y_global), layouts_.y, in[0].mesh_ptr())};
    }

    void SetupContext(const std::vector<DistTensor> &in, const std::vector<DistTensor> &) override {
        // Only what the requested gradients need: x (or the gathered x) for dW, W for dX.
        if (needs_input_grad(1) && !x_total_.defined()) {
            x_ = in[0].local();
        }
        if (needs_input_grad(0)) {
            weight_ = in[1].local();
        }
        mesh_ = in[0].mesh_ptr();
        x_global_ = in[0].global_shape();
        x_local_shape_ = in[0].local().shape();
        weight_global_ = in[1].global_shape();
        weight_local_shape_ = in[1].local().shape();
        bias_global_ = {options_.out_features};
        bias_local_shape_ = {weight_local_shape_.front()};
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
        const detail::ParamGradRequest wreq = request(1, weight_local_shape_, layouts_.weight);
        const detail::ParamGradRequest breq = request(2, bias_local_shape_, layouts_.bias);
        const detail::ParamGradTargets params = detail::PlanParamGrads(mesh_, wreq, breq, dy.dtype(), dy.device());
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
                                                      .dweight = View(params.dweight),
                                                      .dbias = View(params.dbias),
                                                      .param_grads = mode},
                                                     tp_);
        } else {
            functional::RowParallelLinearBackward(options_,
                                                  {.dy = View(dy),
                                                   .x = View(x_),
                                                   .weight = View(weight_),
                                                   .dx = View(dx),
                                                   .dweight = View(params.dweight),
                                                   .dbias = View(params.dbias),
                                                   .param_grads = mode},
                                                  tp_);
        }
        if (needs_input_grad(0)) {
            grads[0].value = DistTensor::FromTrustedShard(std::move(dx), x_global_, layouts_.x, mesh_);
        }
        grads[1] = params.WeightGrad(mesh_, wreq, weight_global_);
        grads[2] = params.BiasGrad(mesh_, breq, bias_global_);
        return grads;
    }

    void ReleaseSaved() override {
        x_ = Tensor();
        x_total_ = Tensor();
        weight_ = Tensor();
    }

private:
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
};

/// A parameter must be on the layer's mesh, of its global shape, in the layout the layer keeps it in.
void CheckParameter(std::string_view op, std::string_view what, const Variable &p, comm::DeviceMesh &mesh,
                    const Shape &shape, const spmd::Layout &layout) {
    SHARDLINE_CHECK(p.defined(), op, "{} is undefined", what);
    const DistTensor &v = p.value();
    SHARDLINE_CHECK(!v.is_local() && &v.mesh() == &mesh, op, "{} must be on the tensor-parallel group's mesh, got {}",
                    what, v.ToString());
    SHARDLINE_CHECK_AS(ShapeError, v.global_shape() == shape, op, "{} must be {}, got {}", what, ShapeToString(shape),
                       v.ToString());
    SHARDLINE_CHECK(dist::SameLayout(mesh, v.layout(), layout), op, "{} must have layout {} on the mesh, got {}", what,
                    layout.ToString(), v.ToString());
}

/// Sequence parallelism splits dim 0 over tp within every chunk the other mesh dims make of it; the ranks' shapes
/// agree only when every chunk divides evenly. Checked on every rank alike, before any collective.
void CheckEvenRows(std::string_view op, const Shape &x_global, const spmd::Layout &rows_layout,
                   const comm::DeviceMesh &mesh) {
    std::int64_t parts = 1;
    for (int d : rows_layout.MeshDims(0)) {
        parts *= mesh.shape()[static_cast<std::size_t>(d)];
    }
    SHARDLINE_CHECK_AS(ShapeError, x_global.front() % parts == 0, op,
                       "sequence_parallel: the sequence length x.shape[0] ({}) must be divisible by the {} ranks that "
                       "shard it (mesh dims [{}] of mesh [{}])",
                       x_global.front(), parts, fmt::join(rows_layout.MeshDims(0), ", "),
                       fmt::join(mesh.shape(), ", "));
}

template <class Options>
Variable ApplyParallelLinear(std::string_view op, const Variable &x, const Variable &weight, const Variable &bias,
                             const Options &options, const TensorParallelGroup &tp) {
    tp.size(); // a null mesh or a bad tp_dim raises here
    comm::DeviceMesh &mesh = *tp.mesh;
    const int t = tp.tp_dim;
    constexpr bool kColumn = kIsColumn<Options>;
    const bool sp = options.sequence_parallel;

    SHARDLINE_CHECK(x.defined(), op, "x is undefined");
    SHARDLINE_CHECK(!x.value().is_local() && &x.value().mesh() == &mesh, op,
                    "x must be on the tensor-parallel group's mesh, got {}", x.value().ToString());
    SHARDLINE_CHECK_AS(ShapeError, x.shape().size() >= 2 && x.shape().back() == options.in_features, op,
                       "x must be [s, ..., in_features] = [s, ..., {}], got {}", options.in_features,
                       x.value().ToString());
    const spmd::Layout weight_layout = kColumn ? spmd::Layout(std::vector<std::vector<int>>{{t}, {}})
                                               : spmd::Layout(std::vector<std::vector<int>>{{}, {t}});
    const spmd::Layout bias_layout =
        kColumn ? spmd::Layout(std::vector<std::vector<int>>{{t}}) : spmd::Layout::Replicated(1);
    CheckParameter(op, "weight", weight, mesh, {options.out_features, options.in_features}, weight_layout);
    if (options.adds_bias()) {
        CheckParameter(op, "bias", bias, mesh, {options.out_features}, bias_layout);
    }

    bool tp_on_features = false;
    if constexpr (!kColumn) {
        tp_on_features = options.input_is_parallel;
    }
    LayerLayouts layouts;
    layouts.x = PlaceTp(x.value().layout(), t, kColumn && sp, tp_on_features);
    Variable input = x;
    if (dist::SameLayout(mesh, x.value().layout(), layouts.x)) {
        layouts.x = x.value().layout(); // dx returns in exactly x's layout
    } else {
        input = Redistribute(x, layouts.x);
    }
    bool gathered = false;
    if constexpr (kColumn) {
        gathered = options.gather_output;
    }
    layouts.y = PlaceTp(layouts.x, t, !kColumn && sp, kColumn && !gathered);
    if (sp) {
        CheckEvenRows(op, x.shape(), kColumn ? layouts.x : layouts.y, mesh);
    }
    layouts.weight = ParamGradLayout(weight_layout, layouts.x, t);
    layouts.bias = ParamGradLayout(bias_layout, layouts.x, t);

    Options call = options;
    call.bias = options.adds_bias();
    call.skip_bias_add = false;
    auto fn = std::make_shared<ParallelLinearFunction<Options>>(call, tp, std::move(layouts));
    return Function::Apply(fn, {input, weight, options.adds_bias() ? bias : Variable()}).at(0);
}

} // namespace

Variable ColumnParallelLinear(const Variable &x, const Variable &weight, const Variable &bias,
                              const ColumnParallelLinearOptions &options, const TensorParallelGroup &tp) {
    return ApplyParallelLinear("autograd::ColumnParallelLinear", x, weight, bias, options, tp);
}

Variable RowParallelLinear(const Variable &x, const Variable &weight, const Variable &bias,
                           const RowParallelLinearOptions &options, const TensorParallelGroup &tp) {
    return ApplyParallelLinear("autograd::RowParallelLinear", x, weight, bias, options, tp);
}

} // namespace shardline::autograd
