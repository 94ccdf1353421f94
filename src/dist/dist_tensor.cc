#include <map>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>

#include "block_copy.h"
#include "dist_internal.h"

namespace shardline::dist {

DistTensor::DistTensor(Tensor local, Shape global_shape, spmd::Layout layout, comm::DeviceMesh &mesh)
    : local_(std::move(local)), global_shape_(std::move(global_shape)), layout_(std::move(layout)), mesh_(&mesh) {
    constexpr const char *kOp = "DistTensor";
    SHARDLINE_CHECK(local_.defined(), kOp, "the local shard is undefined (global shape {}, layout {})",
                    ShapeToString(global_shape_), layout_.ToString());
    SHARDLINE_CHECK_AS(ShapeError, local_.is_contiguous(), kOp, "the local shard must be contiguous, got {}",
                       local_.ToString());
    const spmd::ProcessMesh pm = detail::ToProcessMesh(mesh);
    const spmd::LocalShard shard =
        SHARDLINE_DIST_SPMD(kOp, spmd::ComputeLocalShard(pm, global_shape_, layout_, mesh.coordinate()));
    SHARDLINE_CHECK_AS(ShapeError, shard.shape == local_.shape(), kOp,
                       "layout {} of global shape {} on mesh [{}] gives coordinate [{}] a local shape {}, got {}",
                       layout_.ToString(), ShapeToString(global_shape_), fmt::join(mesh.shape(), ", "),
                       fmt::join(mesh.coordinate(), ", "), ShapeToString(shard.shape), local_.ToString());
}

DistTensor DistTensor::FromFull(const Tensor &full, const spmd::Layout &layout, comm::DeviceMesh &mesh) {
    constexpr const char *kOp = "DistTensor::FromFull";
    SHARDLINE_CHECK(full.defined(), kOp, "the full tensor is undefined (layout {})", layout.ToString());
    const spmd::ProcessMesh pm = detail::ToProcessMesh(mesh);
    const spmd::LocalShard shard =
        SHARDLINE_DIST_SPMD(kOp, spmd::ComputeLocalShard(pm, full.shape(), layout, mesh.coordinate()));
    // One narrow per sharded dim; the first copy also detaches the shard from the caller's tensor.
    Tensor local = full.Contiguous();
    bool copied = false;
    for (int t = 0; t < full.rank(); ++t) {
        if (shard.shape[t] != local.size(t)) {
            local = detail::NarrowCopy(local, t, shard.offset[t], shard.shape[t]);
            copied = true;
        }
    }
    if (!copied) {
        local = local.Clone();
    }
    // Partial: the global value is op over the mesh dim's locals. For sum only coordinate 0 keeps the value; for
    // avg/max/min every coordinate keeps it (op over equal values is the value).
    for (const auto &[mesh_dim, op] : layout.Partial()) {
        if (op == spmd::ReduceOp::kSum && mesh.coordinate()[static_cast<std::size_t>(mesh_dim)] != 0) {
            local.Fill(0.0);
        }
    }
    return DistTensor(std::move(local), full.shape(), layout, mesh);
}

spmd::Layout ShardedLayout(const comm::DeviceMesh &mesh, int rank, const std::vector<ShardOn> &shards) {
    constexpr const char *kOp = "dist::ShardedLayout";
    std::vector<std::vector<int>> dims(static_cast<std::size_t>(rank));
    for (const ShardOn &s : shards) {
        const int dim = s.dim < 0 ? s.dim + rank : s.dim;
        SHARDLINE_CHECK(dim >= 0 && dim < rank, kOp, "dim {} is out of range for a tensor of rank {}", s.dim, rank);
        for (const std::string &name : s.over) {
            dims[static_cast<std::size_t>(dim)].push_back(mesh.dim_index(name));
        }
    }
    return SHARDLINE_DIST_SPMD(kOp, spmd::Layout(std::move(dims)));
}

DistTensor DistTensor::Replicated(const Tensor &full, comm::DeviceMesh &mesh) {
    return FromFull(full, spmd::Layout::Replicated(full.rank()), mesh);
}

DistTensor DistTensor::Sharded(const Tensor &full, comm::DeviceMesh &mesh, const std::vector<ShardOn> &shards) {
    return FromFull(full, ShardedLayout(mesh, full.rank(), shards), mesh);
}

DistTensor DistTensor::FromLocalShard(Tensor local, comm::DeviceMesh &mesh, const std::vector<ShardOn> &shards) {
    SHARDLINE_CHECK(local.defined(), "DistTensor::FromLocalShard", "the local shard is undefined");
    spmd::Layout layout = ShardedLayout(mesh, local.rank(), shards);
    Shape global = local.shape();
    for (int t = 0; t < local.rank(); ++t) {
        for (int d : layout.MeshDims(t)) {
            global[static_cast<std::size_t>(t)] *= mesh.shape()[static_cast<std::size_t>(d)];
        }
    }
    return DistTensor(std::move(local), std::move(global), std::move(layout), mesh);
}

Tensor DistTensor::FullTensor() const {
    SHARDLINE_CHECK(local_.defined(), "DistTensor::FullTensor", "called on a default-constructed DistTensor");
    if (mesh_ == nullptr) {
        return local_;
    }
    return Redistribute(detail::ReplicatedLayoutOfRank(local_.rank())).local();
}

namespace detail {

const spmd::Layout &ReplicatedLayoutOfRank(int rank) {
    constexpr int kTabled = 16;
    // Leaked, so that a DistTensor read from a static destructor still finds them.
    static const std::vector<spmd::Layout> *const kTable = [] {
        auto *table = new std::vector<spmd::Layout>();
        table->reserve(kTabled);
        for (int r = 0; r < kTabled; ++r) {
            table->push_back(spmd::Layout::Replicated(r));
        }
        return table;
    }();
    if (rank >= 0 && rank < kTabled) {
        return (*kTable)[static_cast<std::size_t>(rank)];
    }
    SHARDLINE_CHECK(rank >= 0, "DistTensor::layout", "a tensor rank must be >= 0, got {}", rank);
    // Higher ranks are rare: a node-based map keeps each layout at a stable address (both leaked, as above).
    static auto *const kMutex = new std::mutex();
    static auto *const kMore = new std::map<int, spmd::Layout>();
    const std::lock_guard<std::mutex> lock(*kMutex);
    auto it = kMore->find(rank);
    if (it == kMore->end()) {
        it = kMore->emplace(rank, spmd::Layout::Replicated(rank)).first;
    }
    return it->second;
}

} // namespace detail

DistTensor DistTensor::Local(Tensor tensor) {
    SHARDLINE_CHECK(tensor.defined(), "DistTensor::Local", "the tensor is undefined");
    DistTensor t;
    t.local_ = std::move(tensor);
    return t;
}

DistTensor DistTensor::FromTrustedShard(Tensor local, Shape global_shape, spmd::Layout layout, comm::DeviceMesh *mesh) {
    if (mesh == nullptr) {
        SHARDLINE_CHECK(global_shape == local.shape() && layout.IsReplicated() && layout.TensorRank() == local.rank(),
                        "DistTensor::FromTrustedShard",
                        "a local tensor (no mesh) has its own shape and a replicated layout of its rank: local {}, "
                        "got global shape {} and layout {}",
                        local.ToString(), ShapeToString(global_shape), layout.ToString());
        DistTensor t;
        t.local_ = std::move(local);
        return t;
    }
    DistTensor t;
    t.local_ = std::move(local);
    t.global_shape_ = std::move(global_shape);
    t.layout_ = std::move(layout);
    t.mesh_ = mesh;
    return t;
}

DistTensor DistTensor::WithLocal(Tensor local) const {
    SHARDLINE_CHECK_AS(ShapeError, local.shape() == local_.shape(), "DistTensor::WithLocal",
                       "the new local shard must have the shape {} of the old one, got {}",
                       ShapeToString(local_.shape()), local.ToString());
    if (mesh_ == nullptr) {
        DistTensor t;
        t.local_ = std::move(local);
        return t;
    }
    return FromTrustedShard(std::move(local), global_shape_, layout_, mesh_);
}

comm::DeviceMesh &DistTensor::mesh() const {
    SHARDLINE_CHECK(mesh_ != nullptr, "DistTensor::mesh", "this tensor is local (no mesh): {}", ToString());
    return *mesh_;
}

std::string DistTensor::ToString() const {
    if (!local_.defined()) {
        return "DistTensor(undefined)";
    }
    if (mesh_ == nullptr) {
        return fmt::format("DistTensor(local {})", local_.ToString());
    }
    return fmt::format("DistTensor{} {} on mesh [{}] (local {})", ShapeToString(global_shape_), layout_.ToString(),
                       fmt::join(mesh_->shape(), ", "), local_.ToString());
}

} // namespace shardline::dist
