// DistTensor::Redistribute: executes spmd::PlanRedistribute's steps, in order, on the mesh dims' communicators.
//
// The communicators move flat buffers (rank r's block follows rank r-1's); each step packs this rank's blocks along
// a tensor dim into that order and unpacks what arrives. Block shapes and offsets come from spmd::ComputeLocalShard
// of the step's before/after layouts at the group members' coordinates, so uneven (torch.chunk) and empty shards,
// and nested co-shards, follow the planner's semantics exactly.

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/spmd/redistribute.h>

#include "block_copy.h"
#include "dist_internal.h"

namespace shardline::dist {
namespace {

using spmd::Collective;
using spmd::LocalShard;
using spmd::RedistributeStep;

bool AllEqual(const std::vector<std::int64_t> &v) {
    return std::adjacent_find(v.begin(), v.end(), std::not_equal_to<>()) == v.end();
}

class StepRunner {
public:
    /// `owned`: the local may be overwritten (an all-reduce runs in place on it, not on a copy).
    StepRunner(comm::DeviceMesh &mesh, const spmd::ProcessMesh &pm, const Shape &global_shape, Tensor local,
               bool owned = false)
        : mesh_(mesh), pm_(pm), global_shape_(global_shape), local_(std::move(local)), owned_(owned) {}

    void Run(const RedistributeStep &step) {
        switch (step.collective) {
        case Collective::kAllReduce:
            AllReduce(step);
            return;
        case Collective::kAllGather:
            AllGather(step);
            return;
        case Collective::kReduceScatter:
            ReduceScatter(step);
            return;
        case Collective::kAllToAll:
            AllToAll(step);
            return;
        case Collective::kLocalSlice:
            LocalSlice(step);
            return;
        case Collective::kLocalPartialize:
            LocalPartialize(step);
            return;
        case Collective::kAllToAllV:
            break; // an op's internal collective (the MoE exchange), never a planner step
        }
        SHARDLINE_CHECK(false, "DistTensor::Redistribute", "a plan step must be a planner collective, got {}",
                        spmd::ToString(step.collective));
    }

    Tensor Take() { return Owned(); }

    /// Leave the next collective in flight instead of waiting for it (RedistributeAsync's last step): its handle and
    /// what must follow it (unpacking the received blocks) are kept for Finish.
    void DeferNextCollective() { defer_ = true; }
    /// Waits for the deferred collective, if any, and runs what follows it.
    void Finish() {
        if (deferred_work_) {
            comm::WorkHandle work = std::move(deferred_work_);
            work->Wait();
            if (deferred_then_) {
                std::function<void()> then = std::move(deferred_then_);
                then();
            }
        }
    }

private:
    /// `work`, then `then()`: at once, or deferred to Finish. The synchronous path builds no std::function.
    template <class Then> void Await(comm::WorkHandle work, Then &&then) {
        if (defer_) {
            defer_ = false;
            deferred_work_ = std::move(work);
            deferred_then_ = std::forward<Then>(then);
            return;
        }
        work->Wait();
        then();
    }

    /// The shard of `layout` held by the group member `member` of the step's mesh dim (this rank's other coords).
    LocalShard ShardOf(const spmd::Layout &layout, int mesh_dim, std::int64_t member) const {
        std::vector<std::int64_t> coord = mesh_.coordinate();
        coord[static_cast<std::size_t>(mesh_dim)] = member;
        return spmd::ComputeLocalShard(pm_, global_shape_, layout, coord);
    }
    LocalShard MyShard(const spmd::Layout &layout) const {
        return spmd::ComputeLocalShard(pm_, global_shape_, layout, mesh_.coordinate());
    }
    std::int64_t GroupSize(int mesh_dim) const { return mesh_.shape()[static_cast<std::size_t>(mesh_dim)]; }
    std::int64_t Me(int mesh_dim) const { return mesh_.coordinate()[static_cast<std::size_t>(mesh_dim)]; }

    /// The local tensor, copied once if it still shares storage with the source DistTensor (which is const).
    Tensor &Owned() {
        if (!owned_) {
            local_ = local_.Clone();
            owned_ = true;
        }
        return local_;
    }
    void Replace(Tensor t) {
        local_ = std::move(t);
        owned_ = true;
    }

    void AllReduce(const RedistributeStep &step) {
        Tensor &t = Owned();
        Await(mesh_.group(step.mesh_dim).AllReduce(t, detail::ToCommOp(step.reduce_op)), [] {});
    }

    // S -> R on tensor dim t: block j (member j's shard) lands at its offset inside the gathered shard.
    void AllGather(const RedistributeStep &step) {
        const int d = step.mesh_dim;
        const int t = step.tensor_dim;
        const std::int64_t n = GroupSize(d);
        const LocalShard after = MyShard(step.after);
        std::vector<LocalShard> blocks;
        std::vector<std::int64_t> counts;
        for (std::int64_t j = 0; j < n; ++j) {
            blocks.push_back(ShardOf(step.before, d, j));
            counts.push_back(Numel(blocks.back().shape));
        }
        std::int64_t total = 0;
        for (std::int64_t c : counts) {
            total += c;
        }
        Tensor flat = Tensor::Empty({total}, local_.dtype(), local_.device());
        comm::Communicator &group = mesh_.group(d);
        comm::WorkHandle work =
            AllEqual(counts) ? group.AllGather(local_, flat) : group.AllGatherV(local_, flat, counts);
        Await(std::move(work),
              [this, t, n, flat, after = std::move(after), blocks = std::move(blocks), counts = std::move(counts)] {
                  if (detail::OuterSize(after.shape, t) == 1) {
                      // The blocks are consecutive ranges of dim t already.
                      Replace(flat.View(after.shape));
                      return;
                  }
                  Tensor out = Tensor::Empty(after.shape, local_.dtype(), local_.device());
                  std::int64_t at = 0;
                  for (std::int64_t j = 0; j < n; ++j) {
                      const LocalShard &b = blocks[static_cast<std::size_t>(j)];
                      Tensor block = FlatBlock(flat, at, b.shape);
                      detail::CopyDimBlock(block, t, 0, out, b.offset[t] - after.offset[t], b.shape[t]);
                      at += counts[static_cast<std::size_t>(j)];
                  }
                  Replace(std::move(out));
              });
    }

    // P -> S on tensor dim t: block j of this rank's (partial) local is member j's part; pack them in member order.
    void ReduceScatter(const RedistributeStep &step) {
        const int d = step.mesh_dim;
        const int t = step.tensor_dim;
        const std::int64_t n = GroupSize(d);
        const LocalShard before = MyShard(step.before);
        const LocalShard after = MyShard(step.after);
        std::vector<std::int64_t> counts;
        Tensor packed;
        const bool contiguous_blocks = detail::OuterSize(before.shape, t) == 1;
        if (contiguous_blocks) {
            packed = local_;
        } else {
            packed = Tensor::Empty(local_.shape(), local_.dtype(), local_.device());
        }
        std::int64_t at = 0;
        for (std::int64_t j = 0; j < n; ++j) {
            const LocalShard b = ShardOf(step.after, d, j);
            counts.push_back(Numel(b.shape));
            if (!contiguous_blocks) {
                Tensor dst = FlatBlock(packed, at, b.shape);
                detail::CopyDimBlock(local_, t, b.offset[t] - before.offset[t], dst, 0, b.shape[t]);
            }
            at += counts.back();
        }
        Tensor out = Tensor::Empty(after.shape, local_.dtype(), local_.device());
        comm::Communicator &group = mesh_.group(d);
        const comm::ReduceOp op = detail::ToCommOp(step.reduce_op);
        comm::WorkHandle work =
            AllEqual(counts) ? group.ReduceScatter(packed, out, op) : group.ReduceScatterV(packed, out, counts, op);
        Await(std::move(work), [this, out] { Replace(out); });
    }

    // S(t) -> S(t2) on mesh dim d: send member j the part of this local that j's new shard covers along t2; receive
    // from member j the part of j's old shard that this rank's new shard covers, and place it at j's offset along t.
    void AllToAll(const RedistributeStep &step) {
        const int d = step.mesh_dim;
        const int t = step.tensor_dim;
        const int t2 = step.to_tensor_dim;
        const std::int64_t n = GroupSize(d);
        const LocalShard before = MyShard(step.before);
        const LocalShard after = MyShard(step.after);

        std::vector<std::int64_t> send_counts;
        std::vector<LocalShard> send_blocks;
        for (std::int64_t j = 0; j < n; ++j) {
            send_blocks.push_back(ShardOf(step.after, d, j));
            Shape shape = local_.shape();
            shape[static_cast<std::size_t>(t2)] = send_blocks.back().shape[t2];
            send_counts.push_back(Numel(shape));
        }
        Tensor send;
        if (detail::OuterSize(local_.shape(), t2) == 1) {
            send = local_;
        } else {
            send = Tensor::Empty(local_.shape(), local_.dtype(), local_.device());
            std::int64_t at = 0;
            for (std::int64_t j = 0; j < n; ++j) {
                const LocalShard &b = send_blocks[static_cast<std::size_t>(j)];
                Shape shape = local_.shape();
                shape[static_cast<std::size_t>(t2)] = b.shape[t2];
                Tensor dst = FlatBlock(send, at, shape);
                detail::CopyDimBlock(local_, t2, b.offset[t2] - before.offset[t2], dst, 0, b.shape[t2]);
                at += send_counts[static_cast<std::size_t>(j)];
            }
        }

        std::vector<std::int64_t> recv_counts;
        std::vector<Shape> recv_shapes;
        std::vector<std::int64_t> recv_offsets;
        std::int64_t total = 0;
        for (std::int64_t j = 0; j < n; ++j) {
            const LocalShard b = ShardOf(step.before, d, j);
            Shape shape = b.shape;
            shape[static_cast<std::size_t>(t2)] = after.shape[t2];
            recv_counts.push_back(Numel(shape));
            recv_shapes.push_back(std::move(shape));
            recv_offsets.push_back(b.offset[t] - after.offset[t]);
            total += recv_counts.back();
        }
        Tensor recv = Tensor::Empty({total}, local_.dtype(), local_.device());
        comm::Communicator &group = mesh_.group(d);
        // The even form needs every member to choose it, so decide on the block sizes between every pair of members
        // (what each rank computes alike), not on this rank's own counts: a rank with an empty shard sends and
        // receives only empty blocks while its peers exchange uneven ones.
        comm::WorkHandle work =
            EvenAllToAll(step) ? group.AllToAll(send, recv) : group.AllToAllV(send, send_counts, recv, recv_counts);
        Await(std::move(work), [this, t, n, recv, after = std::move(after), recv_shapes = std::move(recv_shapes),
                                recv_offsets = std::move(recv_offsets), recv_counts = std::move(recv_counts)] {
            if (detail::OuterSize(after.shape, t) == 1) {
                Replace(recv.View(after.shape));
                return;
            }
            Tensor out = Tensor::Empty(after.shape, local_.dtype(), local_.device());
            std::int64_t at = 0;
            for (std::int64_t j = 0; j < n; ++j) {
                const Shape &shape = recv_shapes[static_cast<std::size_t>(j)];
                Tensor block = FlatBlock(recv, at, shape);
                detail::CopyDimBlock(block, t, 0, out, recv_offsets[static_cast<std::size_t>(j)], shape[t]);
                at += recv_counts[static_cast<std::size_t>(j)];
            }
            Replace(std::move(out));
        });
    }

    /// True when the block that any member sends to any member has one size (the same answer on every rank).
    bool EvenAllToAll(const RedistributeStep &step) const {
        const int d = step.mesh_dim;
        const int t2 = step.to_tensor_dim;
        const std::int64_t n = GroupSize(d);
        std::vector<std::int64_t> sizes;
        for (std::int64_t i = 0; i < n; ++i) {
            const LocalShard from = ShardOf(step.before, d, i);
            for (std::int64_t j = 0; j < n; ++j) {
                Shape block = from.shape;
                block[static_cast<std::size_t>(t2)] = ShardOf(step.after, d, j).shape[t2];
                sizes.push_back(Numel(block));
            }
        }
        return AllEqual(sizes);
    }

    // R -> S: keep this rank's chunk (no communication).
    void LocalSlice(const RedistributeStep &step) {
        const int t = step.tensor_dim;
        const LocalShard before = MyShard(step.before);
        const LocalShard after = MyShard(step.after);
        Replace(detail::NarrowCopy(local_, t, after.offset[t] - before.offset[t], after.shape[t]));
    }

    // R -> P: sum keeps the value at coordinate 0 only (zeros elsewhere), prod likewise (ones elsewhere); avg/max/min
    // keep it everywhere.
    void LocalPartialize(const RedistributeStep &step) {
        if (Me(step.mesh_dim) == 0) {
            return;
        }
        if (step.reduce_op == spmd::ReduceOp::kSum) {
            Replace(Tensor::Zeros(local_.shape(), local_.dtype(), local_.device()));
        } else if (step.reduce_op == spmd::ReduceOp::kProd) {
            Replace(Tensor::Full(local_.shape(), 1.0, local_.dtype(), local_.device()));
        }
    }

    /// A contiguous view of `count(shape)` elements of a flat-or-contiguous buffer starting at element `at`.
    static Tensor FlatBlock(const Tensor &buffer, std::int64_t at, const Shape &shape) {
        const std::int64_t count = Numel(shape);
        if (count == 0) {
            return Tensor::Empty(shape, buffer.dtype(), buffer.device());
        }
        void *data = static_cast<char *>(buffer.data()) + at * static_cast<std::int64_t>(ElementSize(buffer.dtype()));
        return Tensor::FromBlob(data, shape, buffer.dtype(), buffer.device());
    }

    comm::DeviceMesh &mesh_;
    const spmd::ProcessMesh &pm_;
    const Shape &global_shape_;
    Tensor local_;
    bool owned_ = false;
    bool defer_ = false;
    comm::WorkHandle deferred_work_;
    std::function<void()> deferred_then_;
};

/// What every Redistribute overload checks first: a defined tensor, and for a local one a replicated target of its
/// rank (the only layout a local value has).
void CheckTarget(const Tensor &local, const comm::DeviceMesh *mesh, const spmd::Layout &dst) {
    constexpr const char *kOp = "DistTensor::Redistribute";
    SHARDLINE_CHECK(local.defined(), kOp, "called on a default-constructed DistTensor (dst {})", dst.ToString());
    SHARDLINE_CHECK(mesh != nullptr || (dst.IsReplicated() && dst.TensorRank() == local.rank()), kOp,
                    "a local tensor {} can only be 'redistributed' to a replicated layout of rank {}, got {}",
                    local.ToString(), local.rank(), dst.ToString());
}

} // namespace

DistTensor DistTensor::Redistribute(const spmd::Layout &dst) const {
    constexpr const char *kOp = "DistTensor::Redistribute";
    CheckTarget(local_, mesh_, dst);
    if (mesh_ == nullptr) {
        return *this;
    }
    const spmd::ProcessMesh pm = detail::ToProcessMesh(*mesh_);
    spmd::PlanOptions options;
    options.element_size = static_cast<std::int64_t>(ElementSize(local_.dtype()));
    // Planning validates both layouts against the mesh and the shape; it is local, so a mismatch fails on every rank
    // before any collective.
    const spmd::RedistributePlan plan =
        SHARDLINE_DIST_SPMD(kOp, spmd::PlanRedistribute(pm, global_shape_, layout_, dst, options));
    return Redistribute(dst, plan);
}

namespace {

/// The checks shared by Redistribute and RedistributeAsync; false for an empty plan (nothing to run).
bool CheckRunnable(const Tensor &local, comm::DeviceMesh *mesh, const spmd::Layout &src, const spmd::Layout &dst,
                   const Shape &global_shape, const spmd::RedistributePlan &plan) {
    constexpr const char *kOp = "DistTensor::Redistribute";
    CheckTarget(local, mesh, dst);
    if (plan.steps.empty()) {
        return false;
    }
    SHARDLINE_CHECK(mesh != nullptr, kOp, "a local tensor {} cannot run a plan of {} steps to {}", local.ToString(),
                    plan.steps.size(), dst.ToString());
    if (plan.NumCollectives() > 0) {
        const DeviceType want = mesh->world().device_type();
        SHARDLINE_CHECK_AS(
            DeviceError, local.device().type == want, kOp,
            "{} -> {} of global shape {} needs collectives over '{}' ({}), which move {} tensors, got {}",
            src.ToString(), dst.ToString(), ShapeToString(global_shape), mesh->world().name(), mesh->world().backend(),
            DeviceTypeName(want), local.ToString());
    }
    return true;
}

} // namespace

DistTensor DistTensor::Redistribute(const spmd::Layout &dst, const spmd::RedistributePlan &plan) const {
    if (!CheckRunnable(local_, mesh_, layout(), dst, global_shape(), plan)) {
        return FromTrustedShard(local_, global_shape(), dst, mesh_);
    }
    const spmd::ProcessMesh pm = detail::ToProcessMesh(*mesh_);
    StepRunner runner(*mesh_, pm, global_shape_, local_);
    for (const spmd::RedistributeStep &step : plan.steps) {
        runner.Run(step);
    }
    return FromTrustedShard(runner.Take(), global_shape_, dst, mesh_);
}

/// A RedistributeAsync in flight: the runner and what it refers to, at a stable address until Wait.
class StepRunnerState {
public:
    StepRunnerState(comm::DeviceMesh *mesh, Shape global_shape, spmd::Layout dst, Tensor local, bool consume_local)
        : mesh_(mesh), pm_(mesh != nullptr ? detail::ToProcessMesh(*mesh) : spmd::ProcessMesh()),
          global_shape_(std::move(global_shape)), dst_(std::move(dst)), done_(std::move(local)),
          consume_local_(consume_local) {}

    void Run(const spmd::RedistributePlan &plan) {
        runner_.emplace(*mesh_, pm_, global_shape_, std::move(done_), consume_local_);
        // Only a plan that ends with a collective leaves it in flight: a local step after it would need its result.
        const std::size_t last = plan.steps.size() - 1;
        for (std::size_t i = 0; i < plan.steps.size(); ++i) {
            const spmd::RedistributeStep &step = plan.steps[i];
            if (i == last && step.collective != spmd::Collective::kLocalSlice &&
                step.collective != spmd::Collective::kLocalPartialize) {
                runner_->DeferNextCollective();
            }
            runner_->Run(step);
        }
    }

    DistTensor Finish() {
        if (runner_) {
            runner_->Finish();
            done_ = runner_->Take();
            runner_.reset();
        }
        return DistTensor::FromTrustedShard(std::move(done_), global_shape_, dst_, mesh_);
    }

private:
    comm::DeviceMesh *mesh_;
    spmd::ProcessMesh pm_;
    Shape global_shape_;
    spmd::Layout dst_;
    Tensor done_;
    bool consume_local_ = false;
    std::optional<StepRunner> runner_;
};

PendingRedistribute::PendingRedistribute() = default;
PendingRedistribute::~PendingRedistribute() = default;
PendingRedistribute::PendingRedistribute(PendingRedistribute &&) noexcept = default;
PendingRedistribute &PendingRedistribute::operator=(PendingRedistribute &&) noexcept = default;

DistTensor PendingRedistribute::Wait() {
    SHARDLINE_CHECK(state_ != nullptr, "PendingRedistribute::Wait", "nothing in flight (already waited, or empty)");
    const std::unique_ptr<StepRunnerState> state = std::move(state_);
    return state->Finish();
}

PendingRedistribute DistTensor::RedistributeAsync(const spmd::Layout &dst, const spmd::RedistributePlan &plan,
                                                  bool consume_local) const {
    PendingRedistribute pending;
    const bool run = CheckRunnable(local_, mesh_, layout(), dst, global_shape(), plan);
    pending.state_ = std::make_unique<StepRunnerState>(mesh_, global_shape(), dst, local_, consume_local);
    if (run) {
        pending.state_->Run(plan);
    }
    return pending;
}

} // namespace shardline::dist
