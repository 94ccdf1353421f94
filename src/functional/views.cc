// The functional layer's small public types: TensorView and View, TensorParallelGroup, CheckShardsNotEmpty.

#include <algorithm>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

namespace shardline::functional {

std::int64_t TensorView::numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < ndim && d < kMaxViewDims; ++d) {
        n *= shape[d];
    }
    return n;
}

TensorView View(void *data, std::initializer_list<std::int64_t> shape, DType dtype) {
    SHARDLINE_CHECK_AS(ShapeError, shape.size() <= static_cast<std::size_t>(kMaxViewDims), "functional::View",
                       "a view has at most {} dims, got {} ([{}])", kMaxViewDims, shape.size(), fmt::join(shape, ", "));
    TensorView view{.data = data, .dtype = dtype, .ndim = static_cast<int>(shape.size())};
    int d = 0;
    for (std::int64_t extent : shape) {
        view.shape[d++] = extent;
    }
    return view;
}

TensorView View(const void *data, std::initializer_list<std::int64_t> shape, DType dtype) {
    // Inputs are only read; the one view type keeps the argument structs simple.
    return View(const_cast<void *>(data), shape, dtype);
}

TensorView View(const Tensor &tensor) {
    if (!tensor.defined()) {
        return {};
    }
    SHARDLINE_CHECK(tensor.is_contiguous(), "functional::View", "the tensor must be contiguous, got a strided {}",
                    tensor.ToString());
    SHARDLINE_CHECK_AS(ShapeError, tensor.rank() <= kMaxViewDims, "functional::View",
                       "a view has at most {} dims, got {}", kMaxViewDims, tensor.ToString());
    TensorView view{.data = tensor.data(), .dtype = tensor.dtype(), .ndim = tensor.rank()};
    std::copy(tensor.shape().begin(), tensor.shape().end(), view.shape);
    return view;
}

TensorParallelGroup TensorParallelGroup::Named(comm::DeviceMesh &mesh, std::string_view dim_name) {
    return {.mesh = &mesh, .tp_dim = mesh.dim_index(dim_name)};
}

std::int64_t TensorParallelGroup::size() const {
    SHARDLINE_CHECK(mesh != nullptr, "TensorParallelGroup", "the group needs a mesh, got a null mesh");
    if (tp_dim == kNoTensorParallel) {
        return 1;
    }
    SHARDLINE_CHECK(tp_dim >= 0 && tp_dim < mesh->ndim(), "TensorParallelGroup",
                    "tp_dim ({}) must name a dim of the mesh [{}] (0 to {}) or be kNoTensorParallel (-1)", tp_dim,
                    fmt::join(mesh->shape(), ", "), mesh->ndim() - 1);
    return mesh->shape()[static_cast<std::size_t>(tp_dim)];
}

std::int64_t TensorParallelGroup::rank() const {
    size(); // a null mesh or a bad tp_dim raises here
    return tp_dim == kNoTensorParallel ? 0 : mesh->coordinate()[static_cast<std::size_t>(tp_dim)];
}

std::int64_t TensorParallelGroup::ShardSize(std::int64_t n) const { return spmd::ChunkRange(n, size(), rank()).second; }

std::int64_t TensorParallelGroup::ShardOffset(std::int64_t n) const {
    return spmd::ChunkRange(n, size(), rank()).first;
}

void CheckShardsNotEmpty(std::string_view op, std::string_view name, std::int64_t n, std::int64_t tp) {
    if (n <= 0 || tp <= 0 || spmd::ChunkRange(n, tp, tp - 1).second > 0) {
        return; // sizes that are not positive are reported by the callers' own checks
    }
    std::vector<std::int64_t> parts;
    for (std::int64_t r = 0; r < tp && parts.size() < 8; ++r) {
        parts.push_back(spmd::ChunkRange(n, tp, r).second);
    }
    SHARDLINE_THROW(ShapeError, op,
                    "{} ({}) over tp ({}) gives the ranks {}{} features (torch.chunk: ceil({}/{}) = {} per rank until "
                    "they run out); every rank needs at least one",
                    name, n, tp, fmt::join(parts, ", "), tp > 8 ? ", ..., 0" : "", n, tp, (n + tp - 1) / tp);
}

} // namespace shardline::functional
