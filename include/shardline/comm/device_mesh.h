#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/comm/communicator.h>

namespace shardline::comm {

/// An N-d mesh over the world's ranks, row-major with the last dim fastest: on a dp×tp mesh rank = dp·TP + tp
/// (Megatron, torch init_device_mesh). One sub-communicator per mesh dim — the ranks that share every other
/// coordinate — created on first use by a collective Split of the world, so every rank must ask for mesh dims in
/// the same order (SPMD code does).
class DeviceMesh {
public:
    /// Throws Error when the product of `shape` differs from world.size(), or names are not one per dim and unique.
    DeviceMesh(Communicator& world, std::vector<std::int64_t> shape, std::vector<std::string> dim_names = {});

    const std::vector<std::int64_t>& shape() const { return shape_; }
    int ndim() const { return static_cast<int>(shape_.size()); }
    const std::vector<std::string>& dim_names() const { return dim_names_; }
    /// Index of a named dim; throws Error naming the known dims when absent.
    int dim_index(std::string_view name) const;
    /// This rank's coordinate.
    const std::vector<std::int64_t>& coordinate() const { return coordinate_; }
    /// The world rank at a coordinate.
    int RankAt(const std::vector<std::int64_t>& coordinate) const;

    Communicator& world() { return world_; }
    /// The group of `mesh_dim` containing this rank (its rank there is coordinate()[mesh_dim]).
    Communicator& group(int mesh_dim);
    Communicator& group(std::string_view dim_name) { return group(dim_index(dim_name)); }

private:
    Communicator& world_;
    std::vector<std::int64_t> shape_;
    std::vector<std::string> dim_names_;
    std::vector<std::int64_t> coordinate_;
    std::vector<std::unique_ptr<Communicator>> groups_;
};

} // namespace shardline::comm
