#pragma once

#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/spmd/layout.h>

namespace shardline::dist {

/// A tensor distributed over a DeviceMesh: this rank's local shard plus the global shape and the Layout (spmd/)
/// that says how shards map to mesh coordinates. Shards follow torch.chunk (the first shards take ceil(n/p),
/// trailing ones may be short or empty). Partial on a mesh dim means the global value is op over that dim's
/// ranks' locals.
class DistTensor {
public:
    DistTensor() = default;
    /// Wraps a local shard; checks it has the shape the layout gives this rank's coordinate.
    DistTensor(Tensor local, Shape global_shape, spmd::Layout layout, comm::DeviceMesh& mesh);

    /// Every rank passes the same full tensor; each keeps its shard. Partial(sum) mesh dims keep the value at
    /// coordinate 0 and zeros elsewhere; avg/max/min keep the value everywhere.
    static DistTensor FromFull(const Tensor& full, const spmd::Layout& layout, comm::DeviceMesh& mesh);

    /// The same global tensor in layout `dst`, moved by the redistribute planner's steps (spmd::PlanRedistribute)
    /// over the mesh's sub-communicators.
    DistTensor Redistribute(const spmd::Layout& dst) const;
    /// The full tensor on every rank (redistributes to replicated).
    Tensor FullTensor() const;

    const Tensor& local() const { return local_; }
    const Shape& global_shape() const { return global_shape_; }
    const spmd::Layout& layout() const { return layout_; }
    comm::DeviceMesh& mesh() const { return *mesh_; }

private:
    Tensor local_;
    Shape global_shape_;
    spmd::Layout layout_;
    comm::DeviceMesh* mesh_ = nullptr;
};

} // namespace shardline::dist
