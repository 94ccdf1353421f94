#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/mesh.h>

namespace shardline::spmd {

ProcessMesh::ProcessMesh(std::vector<int64_t> shape, std::vector<std::string> dim_names,
                         std::vector<int64_t> process_ids)
    : shape_(std::move(shape)), dim_names_(std::move(dim_names)), process_ids_(std::move(process_ids)) {
    // Sizes first, before anything is allocated from them.
    if (shape_.empty() || shape_.size() > static_cast<size_t>(kMaxMeshDims)) {
        throw SpmdError(fmt::format("ProcessMesh: shape must have 1 to {} dims, got {}", kMaxMeshDims, shape_.size()));
    }
    size_ = 1;
    for (int64_t s : shape_) {
        if (s < 1) {
            throw SpmdError(
                fmt::format("ProcessMesh: every mesh dim size must be >= 1, got shape [{}]", fmt::join(shape_, ",")));
        }
        if (s > kMaxMeshSize / size_) {
            throw SpmdError(fmt::format("ProcessMesh: shape [{}] has more than {} ranks (2^40)", fmt::join(shape_, ","),
                                        kMaxMeshSize));
        }
        size_ *= s;
    }
    if (dim_names_.empty()) {
        for (int i = 0; i < NDim(); ++i) {
            dim_names_.push_back(fmt::format("d{}", i));
        }
    }
    if (static_cast<int>(dim_names_.size()) != NDim()) {
        throw SpmdError(fmt::format("ProcessMesh: dim_names must have one name per mesh dim ({}), got {}", NDim(),
                                    dim_names_.size()));
    }
    if (std::set<std::string>(dim_names_.begin(), dim_names_.end()).size() != dim_names_.size()) {
        throw SpmdError(fmt::format("ProcessMesh: dim_names must be unique, got [{}]", fmt::join(dim_names_, ",")));
    }
    if (process_ids_.empty()) {
        return; // the default 0 .. size-1, never materialised
    }
    if (static_cast<int64_t>(process_ids_.size()) != size_) {
        throw SpmdError(fmt::format("ProcessMesh: process_ids must have {} entries (the product of shape [{}]), got {}",
                                    size_, fmt::join(shape_, ","), process_ids_.size()));
    }
    std::vector<int64_t> sorted = process_ids_;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        throw SpmdError(fmt::format("ProcessMesh: process_ids must be unique, got [{}]", fmt::join(process_ids_, ",")));
    }
    bool identity = true;
    for (int64_t i = 0; i < size_ && identity; ++i) {
        identity = process_ids_[i] == i;
    }
    if (identity) {
        process_ids_.clear(); // one representation of the default, so == compares meshes by value
    }
}

std::vector<int64_t> ProcessMesh::ProcessIds() const {
    if (!process_ids_.empty()) {
        return process_ids_;
    }
    std::vector<int64_t> ids(size_);
    for (int64_t i = 0; i < size_; ++i) {
        ids[i] = i;
    }
    return ids;
}

int64_t ProcessMesh::ProcessIdAt(const std::vector<int64_t> &coord) const {
    const int64_t index = LinearIndex(coord);
    return process_ids_.empty() ? index : process_ids_[index];
}

int64_t ProcessMesh::DimSize(int mesh_dim) const {
    if (mesh_dim < 0 || mesh_dim >= NDim()) {
        throw SpmdError(fmt::format("ProcessMesh: mesh dim {} out of range for a mesh of {} dims", mesh_dim, NDim()));
    }
    return shape_[mesh_dim];
}

int ProcessMesh::DimIndex(const std::string &name) const {
    auto it = std::find(dim_names_.begin(), dim_names_.end(), name);
    if (it == dim_names_.end()) {
        throw SpmdError(fmt::format("ProcessMesh: no mesh dim named '{}' in [{}]", name, fmt::join(dim_names_, ",")));
    }
    return static_cast<int>(it - dim_names_.begin());
}

std::vector<int64_t> ProcessMesh::CoordinateOfIndex(int64_t linear_index) const {
    if (linear_index < 0 || linear_index >= size_) {
        throw SpmdError(fmt::format("ProcessMesh: index {} out of range [0, {})", linear_index, size_));
    }
    std::vector<int64_t> coord(shape_.size());
    for (int d = NDim() - 1; d >= 0; --d) {
        coord[d] = linear_index % shape_[d];
        linear_index /= shape_[d];
    }
    return coord;
}

std::vector<int64_t> ProcessMesh::CoordinateOf(int64_t process_id) const {
    if (process_ids_.empty()) {
        if (process_id < 0 || process_id >= size_) {
            throw SpmdError(fmt::format("ProcessMesh: process {} is not in the mesh {}", process_id, ToString()));
        }
        return CoordinateOfIndex(process_id);
    }
    auto it = std::find(process_ids_.begin(), process_ids_.end(), process_id);
    if (it == process_ids_.end()) {
        throw SpmdError(fmt::format("ProcessMesh: process {} is not in the mesh {}", process_id, ToString()));
    }
    return CoordinateOfIndex(it - process_ids_.begin());
}

int64_t ProcessMesh::LinearIndex(const std::vector<int64_t> &coord) const {
    if (static_cast<int>(coord.size()) != NDim()) {
        throw SpmdError(
            fmt::format("ProcessMesh: coordinate [{}] must have {} entries", fmt::join(coord, ","), NDim()));
    }
    int64_t index = 0;
    for (int d = 0; d < NDim(); ++d) {
        if (coord[d] < 0 || coord[d] >= shape_[d]) {
            throw SpmdError(fmt::format("ProcessMesh: coordinate [{}] out of range for shape [{}]",
                                        fmt::join(coord, ","), fmt::join(shape_, ",")));
        }
        index = index * shape_[d] + coord[d];
    }
    return index;
}

std::vector<int64_t> ProcessMesh::Group(const std::vector<int64_t> &coord, int mesh_dim) const {
    std::vector<int64_t> c = coord;
    std::vector<int64_t> group;
    for (int64_t i = 0; i < DimSize(mesh_dim); ++i) {
        c[mesh_dim] = i;
        group.push_back(ProcessIdAt(c));
    }
    return group;
}

std::string ProcessMesh::ToString() const {
    return fmt::format("ProcessMesh(shape=[{}], dim_names=[{}])", fmt::join(shape_, ","), fmt::join(dim_names_, ","));
}

} // namespace shardline::spmd
