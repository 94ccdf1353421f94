#pragma once

// Private to src/autograd: what the autograd Functions over the functional core (parallel_linear.cc: one column or row
// layer; parallel_mlp.cc: column → GELU → row) decide before they run — the checks of the input and the parameters
// (before any collective) and the layouts of the layer's input, output and parameter gradients.
//
// Layouts: the layer computes on x moved to its input layout (PlaceTp); mesh dims other than tp (e.g. dp) may shard
// x's leading dims and are independent replicas of the layer for the functional core. So y keeps those shards, dx
// comes back in x's layout, and dweight/dbias are Partial(sum) over them (each rank summed its own rows) until a
// GradSync or the engine reduces them.

#include <string_view>
#include <type_traits>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/spmd/layout.h>

namespace shardline::autograd::detail {

template <class Options>
inline constexpr bool kIsColumn = std::is_same_v<Options, functional::ColumnParallelLinearOptions>;

/// The layouts of one layer call, decided before the Function runs.
struct LayerLayouts {
    spmd::Layout x;      ///< the input as the layer computes on it (and dx)
    spmd::Layout y;      ///< the output (and dy)
    spmd::Layout weight; ///< dweight: the weight's layout with the rows' Partials
    spmd::Layout bias;   ///< dbias
};

/// x is defined, on the group's mesh, and [s, ..., in_features].
void CheckLayerInput(std::string_view op, const Variable &x, const comm::DeviceMesh &mesh, std::int64_t in_features);

/// A grouped layer's expert-parallel mesh dim: the one mesh dim other than tp that shards its weight's experts dim
/// (dim 0), or -1 (a Linear, or a grouped layer whose ranks hold all its experts). With one, the layer's
/// options.num_experts are this rank's experts: the parameters are [num_experts·P, ...] sharded on dim 0 over it.
int ExpertParallelDim(const Variable &weight, int tp_dim, std::int64_t num_experts);

/// The layer's weight (and, when options.adds_bias(), its bias) on the mesh, of their global shapes, in the layouts
/// the layer keeps them in (column: both sharded on dim 0 over tp; row: the weight on dim 1, the bias replicated; a
/// grouped layer's experts dim in front, sharded over `ep_dim` when it is >= 0).
void CheckLayerParameters(std::string_view op, const Variable &weight, const Variable &bias,
                          const functional::ColumnParallelLinearOptions &options, comm::DeviceMesh &mesh, int tp_dim,
                          int ep_dim = -1);
void CheckLayerParameters(std::string_view op, const Variable &weight, const Variable &bias,
                          const functional::RowParallelLinearOptions &options, comm::DeviceMesh &mesh, int tp_dim,
                          int ep_dim = -1);

/// The layer's input layout for an input in `x` (column + sequence parallel: tp on dim 0; row + input_is_parallel: tp
/// on the features; else replicated over tp), or `x` itself when it places every element alike on the mesh (so that
/// dx returns in exactly x's layout).
spmd::Layout LayerInputLayout(comm::DeviceMesh &mesh, const spmd::Layout &x,
                              const functional::ColumnParallelLinearOptions &options, int tp_dim);
spmd::Layout LayerInputLayout(comm::DeviceMesh &mesh, const spmd::Layout &x,
                              const functional::RowParallelLinearOptions &options, int tp_dim);

/// The layouts of a layer whose input, of global shape `x_global`, is in `input` (its LayerInputLayout); checks that
/// sequence parallelism splits the rows evenly (on every rank alike, before any collective).
LayerLayouts LayerLayoutsFor(std::string_view op, const Shape &x_global, const spmd::Layout &input,
                             const functional::ColumnParallelLinearOptions &options, const comm::DeviceMesh &mesh,
                             int tp_dim, int ep_dim = -1);
LayerLayouts LayerLayoutsFor(std::string_view op, const Shape &x_global, const spmd::Layout &input,
                             const functional::RowParallelLinearOptions &options, const comm::DeviceMesh &mesh,
                             int tp_dim, int ep_dim = -1);

/// The local shape of the layer's output for a local input of shape `x_local` (the functional core's y): column
/// without gather_output, this rank's torch.chunk part of out_features (tp.ShardSize; uneven allowed).
Shape LayerOutputShape(const Shape &x_local, const functional::ColumnParallelLinearOptions &options,
                       const functional::TensorParallelGroup &tp);
Shape LayerOutputShape(const Shape &x_local, const functional::RowParallelLinearOptions &options,
                       const functional::TensorParallelGroup &tp);

} // namespace shardline::autograd::detail
