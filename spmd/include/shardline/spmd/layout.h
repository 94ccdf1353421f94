#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/spmd/mesh.h>

namespace shardline::spmd {

/// How a Partial tensor's local values combine into the global value. Partials on several mesh dims of one tensor
/// must commute (PartialsCommute): sum with avg, or one of max, min, prod alone.
enum class ReduceOp { kSum, kAvg, kMax, kMin, kProd };

std::string_view ToString(ReduceOp op);
/// Parses "sum", "avg" (or "mean"), "max", "min", "prod"; throws SpmdError naming the text otherwise.
ReduceOp ParseReduceOp(std::string_view text);
/// True when reducing a mesh dim with `a` and another with `b` gives the same value in either order: both sum / avg
/// (linear), or the same op. Sum and max, max and min, sum and prod ... do not commute, so a tensor Partial in two
/// of them has no single value.
bool PartialsCommute(ReduceOp a, ReduceOp b);

/// The state of a tensor on one mesh dim: Replicate, Shard(tensor_dim) or Partial(op).
struct Placement {
    enum class Kind { kReplicate, kShard, kPartial };
    Kind kind = Kind::kReplicate;
    int tensor_dim = -1;                 ///< Shard only.
    int order = -1;                      ///< Shard only: position among the mesh dims sharding tensor_dim (major = 0);
                                         ///< -1 means the default order (ascending mesh dims).
    ReduceOp reduce_op = ReduceOp::kSum; ///< Partial only.

    static Placement Replicate() { return {}; }
    static Placement Shard(int tensor_dim, int order = -1) { return {Kind::kShard, tensor_dim, order, ReduceOp::kSum}; }
    static Placement Partial(ReduceOp op = ReduceOp::kSum) { return {Kind::kPartial, -1, -1, op}; }

    /// "R", "S(0)", "S(0)[1]" (explicit co-shard order), "P(sum)", "P(max)", "P(prod)".
    std::string ToString() const;
    static Placement Parse(std::string_view text);
    bool operator==(const Placement &other) const = default;
};

/// The layout of a tensor on a mesh, in one canonical form: for each tensor dim the ordered list of mesh dims
/// that shard it (major -> minor; more than one is co-sharding), and the mesh dims on which the tensor is Partial
/// with their reduce op. Every mesh dim appears at most once. Mesh dims not mentioned are Replicate.
class Layout {
public:
    Layout() = default;
    /// Throws SpmdError when a mesh dim is negative or used twice (sharding or partial).
    explicit Layout(std::vector<std::vector<int>> dim_mesh_dims, std::map<int, ReduceOp> partial = {});

    static Layout Replicated(int tensor_rank);
    /// Paddle dims_mapping: entry i is the mesh dim sharding tensor dim i, or -1.
    static Layout FromDimsMapping(const std::vector<int> &dims_mapping, std::map<int, ReduceOp> partial = {});
    /// Exact inverse of ToPlacements: one placement per mesh dim.
    static Layout FromPlacements(const std::vector<Placement> &placements, int tensor_rank);
    /// Parses the text form written by ToString, e.g. "[1,-1]", "[[0,1],-1] partial{2}", "[-1] partial{0:max}".
    static Layout Parse(std::string_view text);

    int TensorRank() const { return static_cast<int>(dims_.size()); }
    /// Mesh dims sharding `tensor_dim`, major first.
    const std::vector<int> &MeshDims(int tensor_dim) const { return dims_.at(tensor_dim); }
    const std::vector<std::vector<int>> &DimsMeshDims() const { return dims_; }
    const std::map<int, ReduceOp> &Partial() const { return partial_; }
    bool IsPartial() const { return !partial_.empty(); }
    bool IsPartialOn(int mesh_dim) const { return partial_.count(mesh_dim) != 0; }
    /// True when no tensor dim is sharded and nothing is Partial.
    bool IsReplicated() const;
    /// The tensor dim that `mesh_dim` shards, or -1.
    int TensorDimOf(int mesh_dim) const;
    /// Every mesh dim this layout mentions (sharding or partial), ascending.
    std::vector<int> UsedMeshDims() const;

    /// dims_mapping with one mesh dim per tensor dim (-1 for none); throws when a dim is co-sharded.
    std::vector<int> DimsMapping() const;
    bool HasCoShard() const;
    std::vector<Placement> ToPlacements(int mesh_ndim) const;

    /// Throws SpmdError naming `what` when the layout does not fit the mesh (mesh dim out of range) or the
    /// tensor (rank mismatch), or when its Partial reduce ops do not commute (it then has no single value).
    void Validate(const ProcessMesh &mesh, int tensor_rank, std::string_view what = "layout") const;
    /// Drops size-1 mesh dims (they shard nothing and their partial sums have one term).
    Layout Canonical(const ProcessMesh &mesh) const;

    Layout WithPartial(std::map<int, ReduceOp> partial) const { return Layout(dims_, std::move(partial)); }
    Layout WithoutPartial() const { return Layout(dims_, {}); }

    /// "[1,-1]", "[[0,1],-1]", "[-1,-1] partial{0}", "[0] partial{1:max}".
    std::string ToString() const;
    bool operator==(const Layout &other) const = default;

private:
    std::vector<std::vector<int>> dims_;
    std::map<int, ReduceOp> partial_;
};

/// One shard of a tensor: its shape and the global index of its first element.
struct LocalShard {
    std::vector<int64_t> shape;
    std::vector<int64_t> offset;
    bool operator==(const LocalShard &other) const = default;
};

/// Chunk `index` of a dim of size `size` split in `parts` (torch.chunk): the first chunks take ceil(size/parts),
/// trailing chunks may be short or empty. Returns {offset, length}.
std::pair<int64_t, int64_t> ChunkRange(int64_t size, int64_t parts, int64_t index);

/// Shape and global offset of the shard held at mesh coordinate `coord`. Co-sharded dims are chunked by the
/// major mesh dim first, then each chunk by the next (nested torch.chunk, as DTensor).
LocalShard ComputeLocalShard(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &layout,
                             const std::vector<int64_t> &coord);
/// The same for the process `process_id`.
LocalShard ComputeLocalShardOfProcess(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape,
                                      const Layout &layout, int64_t process_id);
/// The largest local shape over all coordinates (the shard at coordinate 0 in every dim).
std::vector<int64_t> MaxLocalShape(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape,
                                   const Layout &layout);

std::string ShapeToString(const std::vector<int64_t> &shape);

/// A global shape with its layout: what every rule takes and returns.
struct TensorSpec {
    std::vector<int64_t> shape;
    Layout layout;
    bool operator==(const TensorSpec &other) const = default;
};

} // namespace shardline::spmd
