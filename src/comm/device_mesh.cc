#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>

namespace shardline::comm {
namespace {

std::int64_t Product(const std::vector<std::int64_t> &shape) {
    std::int64_t p = 1;
    for (std::int64_t s : shape) {
        p *= s;
    }
    return p;
}

} // namespace

DeviceMesh::DeviceMesh(Communicator &world, std::vector<std::int64_t> shape, std::vector<std::string> dim_names)
    : world_(world), shape_(std::move(shape)), dim_names_(std::move(dim_names)) {
    // Every check here is local and identical on all ranks, so a bad mesh fails everywhere before any collective.
    SHARDLINE_CHECK(!shape_.empty(), "DeviceMesh", "shape must have at least one dim, got [] (world size {})",
                    world_.size());
    SHARDLINE_CHECK(std::all_of(shape_.begin(), shape_.end(), [](std::int64_t s) { return s >= 1; }), "DeviceMesh",
                    "every mesh dim must be >= 1, got shape [{}]", fmt::join(shape_, ", "));
    SHARDLINE_CHECK(Product(shape_) == world_.size(), "DeviceMesh",
                    "the product of mesh shape [{}] ({}) must equal the world size ({}) of '{}'",
                    fmt::join(shape_, ", "), Product(shape_), world_.size(), world_.name());
    if (dim_names_.empty()) {
        for (int d = 0; d < ndim(); ++d) {
            dim_names_.push_back(fmt::format("d{}", d));
        }
    }
    SHARDLINE_CHECK(static_cast<int>(dim_names_.size()) == ndim(), "DeviceMesh",
                    "expected one dim name per mesh dim ({} for shape [{}]), got {} names [{}]", ndim(),
                    fmt::join(shape_, ", "), dim_names_.size(), fmt::join(dim_names_, ", "));
    SHARDLINE_CHECK(std::set<std::string>(dim_names_.begin(), dim_names_.end()).size() == dim_names_.size(),
                    "DeviceMesh", "dim names must be unique, got [{}]", fmt::join(dim_names_, ", "));

    // Row-major, last dim fastest: rank = Σ coordinate[d] · stride[d].
    coordinate_.assign(shape_.size(), 0);
    std::int64_t rest = world_.rank();
    for (int d = ndim() - 1; d >= 0; --d) {
        coordinate_[d] = rest % shape_[d];
        rest /= shape_[d];
    }
    groups_.resize(shape_.size());
}

int DeviceMesh::dim_index(std::string_view name) const {
    auto it = std::find(dim_names_.begin(), dim_names_.end(), name);
    SHARDLINE_CHECK(it != dim_names_.end(), "DeviceMesh::dim_index", "no mesh dim named '{}', the dims are [{}]", name,
                    fmt::join(dim_names_, ", "));
    return static_cast<int>(it - dim_names_.begin());
}

int DeviceMesh::RankAt(const std::vector<std::int64_t> &coordinate) const {
    SHARDLINE_CHECK(coordinate.size() == shape_.size(), "DeviceMesh::RankAt",
                    "coordinate [{}] must have {} entries for mesh shape [{}]", fmt::join(coordinate, ", "), ndim(),
                    fmt::join(shape_, ", "));
    std::int64_t rank = 0;
    for (int d = 0; d < ndim(); ++d) {
        SHARDLINE_CHECK(coordinate[d] >= 0 && coordinate[d] < shape_[d], "DeviceMesh::RankAt",
                        "coordinate [{}] is outside mesh shape [{}]", fmt::join(coordinate, ", "),
                        fmt::join(shape_, ", "));
        rank = rank * shape_[d] + coordinate[d];
    }
    return static_cast<int>(rank);
}

Communicator &DeviceMesh::group(int mesh_dim) {
    SHARDLINE_CHECK(mesh_dim >= 0 && mesh_dim < ndim(), "DeviceMesh::group",
                    "mesh dim {} out of range for mesh shape [{}]", mesh_dim, fmt::join(shape_, ", "));
    auto &group = groups_[static_cast<std::size_t>(mesh_dim)];
    if (!group) {
        // The group is the ranks that share every other coordinate: color = the row-major index of those other
        // coordinates, key = the coordinate along mesh_dim (so the group rank equals it).
        std::int64_t color = 0;
        for (int d = 0; d < ndim(); ++d) {
            if (d != mesh_dim) {
                color = color * shape_[d] + coordinate_[d];
            }
        }
        std::vector<int> members;
        std::vector<std::int64_t> c = coordinate_;
        for (std::int64_t i = 0; i < shape_[mesh_dim]; ++i) {
            c[mesh_dim] = i;
            members.push_back(RankAt(c));
        }
        std::string name =
            fmt::format("mesh dim {} '{}' {{{}}}", mesh_dim, dim_names_[mesh_dim], fmt::join(members, ","));
        std::unique_ptr<Communicator> split =
            world_.Split(static_cast<int>(color), static_cast<int>(coordinate_[mesh_dim]), std::move(name));
        SHARDLINE_CHECK(split != nullptr && split->size() == shape_[mesh_dim] && split->rank() == coordinate_[mesh_dim],
                        "DeviceMesh::group", "split of mesh dim {} must give size {} and rank {}, got size {} rank {}",
                        mesh_dim, shape_[mesh_dim], coordinate_[mesh_dim], split ? split->size() : -1,
                        split ? split->rank() : -1);
        group = std::move(split);
    }
    return *group;
}

} // namespace shardline::comm
