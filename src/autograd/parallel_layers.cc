#include "parallel_layers.h"

#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>

namespace shardline::autograd::detail {
namespace {

using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;

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
    if (tp_dim < 0) {
        return spmd::Layout(std::move(dims)); // no tensor parallelism: nothing to place
    }
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

/// A parameter must be on the layer's mesh, of its global shape, in the layout the layer keeps it in.
void CheckParameter(std::string_view op, std::string_view what, const Variable &p, comm::DeviceMesh &mesh,
                    const Shape &shape, const spmd::Layout &layout) {
    SHARDLINE_CHECK(p.defined(), op, "{} is undefined", what);
    const dist::DistTensor &v = p.value();
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

spmd::Layout InputLayout(comm::DeviceMesh &mesh, const spmd::Layout &x, int tp_dim, bool tp_on_seq,
                         bool tp_on_features) {
    const spmd::Layout placed = PlaceTp(x, tp_dim, tp_on_seq, tp_on_features);
    return dist::SameLayout(mesh, x, placed) ? x : placed;
}

/// The layouts of a layer whose input is in `input`: its output with tp on dim 0 and/or the features, the parameter
/// gradients Partial over the rows' other mesh dims.
LayerLayouts Layouts(const spmd::Layout &input, int tp_dim, bool y_tp_on_seq, bool y_tp_on_features,
                     const spmd::Layout &weight, const spmd::Layout &bias) {
    return LayerLayouts{.x = input,
                        .y = PlaceTp(input, tp_dim, y_tp_on_seq, y_tp_on_features),
                        .weight = ParamGradLayout(weight, input, tp_dim),
                        .bias = ParamGradLayout(bias, input, tp_dim)};
}

/// A grouped layer's (num_experts > 0) parameters have a leading experts dim. Either no mesh dim shards it (every rank
/// holds the layer's experts), or expert parallelism shards it over mesh dim `ep` (>= 0): each rank holds and computes
/// its num_experts of the num_experts·P experts, whole.
std::vector<std::vector<int>> ExpertDims(std::vector<std::vector<int>> dims, std::int64_t experts, int ep) {
    if (experts > 0) {
        dims.insert(dims.begin(), ep >= 0 ? std::vector<int>{ep} : std::vector<int>{});
    }
    return dims;
}
Shape ExpertShape(Shape shape, std::int64_t experts, const comm::DeviceMesh &mesh, int ep) {
    if (experts > 0) {
        shape.insert(shape.begin(), ep >= 0 ? experts * mesh.shape()[static_cast<std::size_t>(ep)] : experts);
    }
    return shape;
}

/// The mesh dims that split a layer's features: tp, or none without tensor parallelism (tp_dim < 0).
std::vector<int> TpDims(int t) { return t >= 0 ? std::vector<int>{t} : std::vector<int>{}; }

spmd::Layout ColumnWeightLayout(int t, std::int64_t experts, int ep) {
    return spmd::Layout(ExpertDims({TpDims(t), {}}, experts, ep));
}
spmd::Layout ColumnBiasLayout(int t, std::int64_t experts, int ep) {
    return spmd::Layout(ExpertDims({TpDims(t)}, experts, ep));
}
spmd::Layout RowWeightLayout(int t, std::int64_t experts, int ep) {
    return spmd::Layout(ExpertDims({{}, TpDims(t)}, experts, ep));
}
spmd::Layout RowBiasLayout(std::int64_t experts, int ep) {
    return experts > 0 ? spmd::Layout(ExpertDims({{}}, experts, ep)) : spmd::Layout::Replicated(1);
}

} // namespace

void CheckLayerInput(std::string_view op, const Variable &x, const comm::DeviceMesh &mesh, std::int64_t in_features) {
    SHARDLINE_CHECK(x.defined(), op, "x is undefined");
    SHARDLINE_CHECK(!x.value().is_local() && &x.value().mesh() == &mesh, op,
                    "x must be on the tensor-parallel group's mesh, got {}", x.value().ToString());
    SHARDLINE_CHECK_AS(ShapeError, x.shape().size() >= 2 && x.shape().back() == in_features, op,
                       "x must be [s, ..., in_features] = [s, ..., {}], got {}", in_features, x.value().ToString());
}

int ExpertParallelDim(const Variable &weight, int tp_dim, std::int64_t num_experts) {
    if (num_experts <= 0 || !weight.defined() || weight.value().is_local() ||
        weight.value().layout().TensorRank() < 1) {
        return -1;
    }
    const std::vector<int> &dims = weight.value().layout().MeshDims(0);
    return dims.size() == 1 && dims.front() != tp_dim ? dims.front() : -1;
}

void CheckLayerParameters(std::string_view op, const Variable &weight, const Variable &bias,
                          const ColumnParallelLinearOptions &options, comm::DeviceMesh &mesh, int tp_dim, int ep_dim) {
    const std::int64_t e = options.num_experts;
    CheckParameter(op, "weight", weight, mesh,
                   ExpertShape(Shape{options.out_features, options.in_features}, e, mesh, ep_dim),
                   ColumnWeightLayout(tp_dim, e, ep_dim));
    if (options.adds_bias()) {
        CheckParameter(op, "bias", bias, mesh, ExpertShape(Shape{options.out_features}, e, mesh, ep_dim),
                       ColumnBiasLayout(tp_dim, e, ep_dim));
    }
}

void CheckLayerParameters(std::string_view op, const Variable &weight, const Variable &bias,
                          const RowParallelLinearOptions &options, comm::DeviceMesh &mesh, int tp_dim, int ep_dim) {
    const std::int64_t e = options.num_experts;
    CheckParameter(op, "weight", weight, mesh,
                   ExpertShape(Shape{options.out_features, options.in_features}, e, mesh, ep_dim),
                   RowWeightLayout(tp_dim, e, ep_dim));
    if (options.adds_bias()) {
        CheckParameter(op, "bias", bias, mesh, ExpertShape(Shape{options.out_features}, e, mesh, ep_dim),
                       RowBiasLayout(e, ep_dim));
    }
}

spmd::Layout LayerInputLayout(comm::DeviceMesh &mesh, const spmd::Layout &x, const ColumnParallelLinearOptions &options,
                              int tp_dim) {
    return InputLayout(mesh, x, tp_dim, options.sequence_parallel, false);
}

spmd::Layout LayerInputLayout(comm::DeviceMesh &mesh, const spmd::Layout &x, const RowParallelLinearOptions &options,
                              int tp_dim) {
    return InputLayout(mesh, x, tp_dim, false, options.input_is_parallel);
}

LayerLayouts LayerLayoutsFor(std::string_view op, const Shape &x_global, const spmd::Layout &input,
                             const ColumnParallelLinearOptions &options, const comm::DeviceMesh &mesh, int tp_dim,
                             int ep_dim) {
    if (options.sequence_parallel) {
        CheckEvenRows(op, x_global, input, mesh);
    }
    return Layouts(input, tp_dim, false, !options.gather_output,
                   ColumnWeightLayout(tp_dim, options.num_experts, ep_dim),
                   ColumnBiasLayout(tp_dim, options.num_experts, ep_dim));
}

LayerLayouts LayerLayoutsFor(std::string_view op, const Shape &x_global, const spmd::Layout &input,
                             const RowParallelLinearOptions &options, const comm::DeviceMesh &mesh, int tp_dim,
                             int ep_dim) {
    LayerLayouts layouts =
        Layouts(input, tp_dim, options.sequence_parallel, false, RowWeightLayout(tp_dim, options.num_experts, ep_dim),
                RowBiasLayout(options.num_experts, ep_dim));
    if (options.sequence_parallel) {
        CheckEvenRows(op, x_global, layouts.y, mesh);
    }
    return layouts;
}

Shape LayerOutputShape(const Shape &x_local, const ColumnParallelLinearOptions &options,
                       const functional::TensorParallelGroup &tp) {
    Shape y = x_local;
    y.back() = options.gather_output ? options.out_features : tp.ShardSize(options.out_features);
    if (options.sequence_parallel) {
        y.front() *= tp.size();
    }
    return y;
}

Shape LayerOutputShape(const Shape &x_local, const RowParallelLinearOptions &options,
                       const functional::TensorParallelGroup &tp) {
    Shape y = x_local;
    y.back() = options.out_features;
    if (options.sequence_parallel) {
        y.front() /= tp.size();
    }
    return y;
}

} // namespace shardline::autograd::detail
