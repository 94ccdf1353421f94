#pragma once

#include <memory>
#include <string>
#include <vector>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::dist {

class DistTensor;
class StepRunnerState;

namespace detail {
/// The replicated layout of a rank-`rank` tensor, one shared object per rank (never destroyed): the layout a local
/// DistTensor reports.
const spmd::Layout& ReplicatedLayoutOfRank(int rank);
} // namespace detail

/// A redistribution whose last collective is still in flight (DistTensor::RedistributeAsync), so that independent
/// work can run meanwhile. Wait() finishes it: waits for the collective (NCCL: orders the compute stream after it,
/// without a host wait; MPI: until it completed), unpacks what arrived and returns the moved tensor. Dropping it
/// unwaited abandons the result; the communicator keeps the collective's buffers alive until it ends.
class PendingRedistribute {
public:
    PendingRedistribute();
    ~PendingRedistribute();
    PendingRedistribute(PendingRedistribute&&) noexcept;
    PendingRedistribute& operator=(PendingRedistribute&&) noexcept;

    /// False for a default-constructed or already waited one.
    bool valid() const { return state_ != nullptr; }
    /// The moved tensor. Throws Error when !valid(), CommError when the collective failed.
    DistTensor Wait();

private:
    friend class DistTensor;
    std::unique_ptr<StepRunnerState> state_;
};

/// A tensor dim split over mesh dims given by name, major first: {.dim = 1, .over = {"dp"}}. A negative dim counts
/// from the end ({.dim = -1, .over = {"tp"}}: the features).
struct ShardOn {
    int dim = 0;
    std::vector<std::string> over;
};

/// The layout of a rank-`rank` tensor split as `shards` on `mesh` and replicated over every other mesh dim, without
/// spelling spmd::Layout: ShardedLayout(mesh, 3, {{.dim = 0, .over = {"tp"}}, {.dim = 1, .over = {"dp"}}}). Throws
/// Error naming an unknown mesh dim, a tensor dim out of range, or a mesh dim used twice.
spmd::Layout ShardedLayout(const comm::DeviceMesh& mesh, int rank, const std::vector<ShardOn>& shards);

/// A tensor distributed over a DeviceMesh: this rank's local shard plus the global shape and the Layout (spmd/)
/// that says how shards map to mesh coordinates. Shards follow torch.chunk (the first shards take ceil(n/p),
/// trailing ones may be short or empty). Partial on a mesh dim means the global value is op over that dim's
/// ranks' locals.
///
/// A DistTensor may also be *local* (no mesh): a plain tensor that every op treats as one process's whole value, with
/// a replicated layout. Ops take both, so one code path serves single-process and distributed programs.
class DistTensor {
public:
    DistTensor() = default;
    /// Wraps a local shard; checks it has the shape the layout gives this rank's coordinate.
    DistTensor(Tensor local, Shape global_shape, spmd::Layout layout, comm::DeviceMesh& mesh);
    /// A local (undistributed) tensor.
    static DistTensor Local(Tensor tensor);

    /// Every rank passes the same full tensor and keeps all of it (replicated over every mesh dim).
    static DistTensor Replicated(const Tensor& full, comm::DeviceMesh& mesh);
    /// Every rank passes the same full tensor and keeps its shard: Sharded(x, mesh, {{.dim = 0, .over = {"tp"}}}).
    static DistTensor Sharded(const Tensor& full, comm::DeviceMesh& mesh, const std::vector<ShardOn>& shards);
    /// Each rank passes only its own shard (e.g. its data-parallel slice of a batch): the global shape is the local
    /// one times the number of shards of each split dim, so every rank must pass the same local shape (an even split).
    static DistTensor FromLocalShard(Tensor local, comm::DeviceMesh& mesh, const std::vector<ShardOn>& shards);

    /// Every rank passes the same full tensor; each keeps its shard. Partial(sum) mesh dims keep the value at
    /// coordinate 0 and zeros elsewhere; avg/max/min keep the value everywhere.
    static DistTensor FromFull(const Tensor& full, const spmd::Layout& layout, comm::DeviceMesh& mesh);

    /// The same global tensor in layout `dst`, moved by the redistribute planner's steps (spmd::PlanRedistribute)
    /// over the mesh's sub-communicators. For a local tensor `dst` must be replicated (the value is returned).
    DistTensor Redistribute(const spmd::Layout& dst) const;
    /// The same with a plan made earlier by spmd::PlanRedistribute (e.g. cached with a rule) from this layout to
    /// `dst`; the plan is not re-validated.
    DistTensor Redistribute(const spmd::Layout& dst, const spmd::RedistributePlan& plan) const;
    /// The same, returning once the plan's last collective is issued: the steps before it run as Redistribute runs
    /// them, and PendingRedistribute::Wait finishes the last one. The same collectives, in the same order, with the
    /// same bytes as Redistribute; an empty plan (or one without collectives) is finished at once.
    /// `consume_local`: the plan may overwrite this tensor's local shard, for a local that is a buffer of the caller's
    /// own (a kernel's output): an all-reduce then runs in place on it instead of on a copy, and the result shares it.
    PendingRedistribute RedistributeAsync(const spmd::Layout& dst, const spmd::RedistributePlan& plan,
                                          bool consume_local = false) const;
    /// This tensor's value with another local shard of the same shape (e.g. a kernel's output in the same layout).
    DistTensor WithLocal(Tensor local) const;
    /// The full tensor on every rank (redistributes to replicated).
    Tensor FullTensor() const;

    bool defined() const { return local_.defined(); }
    /// True for a tensor without a mesh (DistTensor::Local).
    bool is_local() const { return mesh_ == nullptr; }
    const Tensor& local() const { return local_; }
    /// A local tensor's global shape is its local one, and its layout the replicated one of its rank: it stores
    /// neither, so that making and copying one costs no more than the Tensor.
    const Shape& global_shape() const { return mesh_ != nullptr ? global_shape_ : local_.shape(); }
    const spmd::Layout& layout() const {
        return mesh_ != nullptr ? layout_ : detail::ReplicatedLayoutOfRank(local_.rank());
    }
    /// The mesh; throws Error for a local tensor.
    comm::DeviceMesh& mesh() const;
    comm::DeviceMesh* mesh_ptr() const { return mesh_; }
    /// Global shape and layout, as the spmd rules take them.
    spmd::TensorSpec spec() const { return {global_shape(), layout()}; }
    DType dtype() const { return local_.dtype(); }
    Device device() const { return local_.device(); }
    /// "DistTensor[8, 4] [0,-1] on mesh [2] float32 cpu (local [4, 4])".
    std::string ToString() const;

    /// Builds a DistTensor without the shape check, for ops whose rules gave the layout of a shard they computed.
    /// With no mesh it makes a local tensor: the shape and layout must then be the local tensor's own shape and the
    /// replicated layout of its rank (Error otherwise: a local value has no other), and are not stored.
    static DistTensor FromTrustedShard(Tensor local, Shape global_shape, spmd::Layout layout, comm::DeviceMesh* mesh);

private:
    Tensor local_;
    Shape global_shape_;  ///< empty for a local tensor (global_shape() is the local one)
    spmd::Layout layout_; ///< empty for a local tensor (layout() is the replicated one)
    comm::DeviceMesh* mesh_ = nullptr;
};

} // namespace shardline::dist
