#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardline::spmd {

/// An N-d grid of processes. Ranks are laid out row-major: the last mesh dim is the fastest, so on a dp x tp
/// mesh rank = dp_coord * TP + tp_coord (Megatron, torch init_device_mesh). A mesh with the default process ids
/// stores none: building and querying it costs O(NDim()), whatever Size() is (limits.h bounds both).
class ProcessMesh {
public:
    ProcessMesh() = default;
    /// `dim_names` defaults to "d0", "d1", ...; `process_ids` defaults to 0 .. size-1. Throws SpmdError for more than
    /// kMaxMeshDims dims, a dim < 1, more than kMaxMeshSize ranks, or names / ids that do not fit.
    explicit ProcessMesh(std::vector<int64_t> shape, std::vector<std::string> dim_names = {},
                         std::vector<int64_t> process_ids = {});

    int NDim() const { return static_cast<int>(shape_.size()); }
    int64_t Size() const { return size_; }
    int64_t DimSize(int mesh_dim) const;
    const std::vector<int64_t> &Shape() const { return shape_; }
    const std::vector<std::string> &DimNames() const { return dim_names_; }
    /// True when the process ids are 0 .. Size()-1 (given or defaulted).
    bool HasDefaultProcessIds() const { return process_ids_.empty(); }
    /// The process id of every position, row-major: allocates Size() entries (see HasDefaultProcessIds).
    std::vector<int64_t> ProcessIds() const;

    /// Index of the mesh dim called `name`; throws SpmdError when there is none.
    int DimIndex(const std::string &name) const;
    /// Coordinate of the process `process_id`; throws when it is not in the mesh.
    std::vector<int64_t> CoordinateOf(int64_t process_id) const;
    /// Row-major linear index of `coord` (the position in ProcessIds()).
    int64_t LinearIndex(const std::vector<int64_t> &coord) const;
    std::vector<int64_t> CoordinateOfIndex(int64_t linear_index) const;
    int64_t ProcessIdAt(const std::vector<int64_t> &coord) const;
    /// The process ids that share every coordinate of `coord` except `mesh_dim`, in order along `mesh_dim`:
    /// the group of a collective over that mesh dim (DimSize(mesh_dim) entries).
    std::vector<int64_t> Group(const std::vector<int64_t> &coord, int mesh_dim) const;

    std::string ToString() const;
    bool operator==(const ProcessMesh &other) const = default;

private:
    std::vector<int64_t> shape_;
    std::vector<std::string> dim_names_;
    std::vector<int64_t> process_ids_; ///< empty: the default 0 .. size-1
    int64_t size_ = 0;
};

} // namespace shardline::spmd
