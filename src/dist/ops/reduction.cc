// Sum / mean over dims, and their backward (the output gradient broadcast back over the reduced dims).

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/dist/ops.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/outer.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

/// Reduced dims, normalised and sorted; all dims when `dims` is empty.
std::vector<int> Normalise(const std::vector<int> &dims, int rank, std::string_view op) {
    std::vector<int> out;
    if (dims.empty()) {
        out.resize(static_cast<std::size_t>(rank));
        std::iota(out.begin(), out.end(), 0);
        return out;
    }
    for (int d : dims) {
        const int n = d < 0 ? d + rank : d;
        SHARDLINE_CHECK_AS(ShapeError, n >= 0 && n < rank, op, "dim {} is out of range for rank {}", d, rank);
        out.push_back(n);
    }
    std::sort(out.begin(), out.end());
    SHARDLINE_CHECK_AS(ShapeError, std::adjacent_find(out.begin(), out.end()) == out.end(), op,
                       "dims [{}] must not repeat", fmt::join(dims, ", "));
    return out;
}

bool IsPrefix(const std::vector<int> &dims) {
    for (std::size_t i = 0; i < dims.size(); ++i) {
        if (dims[i] != static_cast<int>(i)) {
            return false;
        }
    }
    return true;
}

bool IsSuffix(const std::vector<int> &dims, int rank) {
    for (std::size_t i = 0; i < dims.size(); ++i) {
        if (dims[dims.size() - 1 - i] != rank - 1 - static_cast<int>(i)) {
            return false;
        }
    }
    return true;
}

std::int64_t Count(const Shape &shape, const std::vector<int> &dims) {
    std::int64_t n = 1;
    for (int d : dims) {
        n *= shape[static_cast<std::size_t>(d)];
    }
    return n;
}

spmd::RuleRequest Request(spmd::TensorSpec x, const std::vector<int> &dims, bool keepdim, bool mean) {
    spmd::ReductionAttrs attrs{
        .kind = mean ? spmd::ReductionKind::kMean : spmd::ReductionKind::kSum, .axes = dims, .keepdim = keepdim};
    return spmd::RuleRequest{.op = mean ? "mean" : "sum", .inputs = {std::move(x)}, .attrs = attrs};
}

/// dx (x_local's shape) = dout_local broadcast over the reduced dims (a prefix or a suffix of x's dims).
Tensor Broadcast(const Tensor &dout, const Shape &x_shape, const std::vector<int> &dims) {
    const int rank = static_cast<int>(x_shape.size());
    const std::int64_t reduced = Count(x_shape, dims);
    const std::int64_t kept = reduced == 0 ? 0 : Numel(x_shape) / reduced;
    Tensor g = dout.View({kept});
    if (IsPrefix(dims)) {
        // dx[r, k] = dout[k] for every reduced index r: a bias add onto zeros.
        Tensor zeros = Tensor::Zeros({reduced, kept}, dout.dtype(), dout.device());
        Tensor dx = Tensor::Empty({reduced, kept}, dout.dtype(), dout.device());
        kernels::BiasAdd({.x = zeros, .bias = g, .out = dx});
        return dx.View(x_shape);
    }
    // Suffix: dx[k, r] = dout[k]·1, an outer product with ones.
    (void)rank;
    Tensor ones = Tensor::Full({reduced}, 1.0, dout.dtype(), dout.device());
    return kernels::OuterForward(g, ones).View(x_shape);
}

} // namespace

DistTensor Sum(const DistTensor &x, const SumOptions &options) {
    const std::vector<int> &dims = options.dims;
    const bool keepdim = options.keepdim;
    const bool mean = options.mean;
    const char *kOp = mean ? "dist::Mean" : "dist::Sum";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x});
    const std::vector<int> norm = Normalise(dims, static_cast<int>(x.global_shape().size()), kOp);
    const double scale =
        mean ? 1.0 / static_cast<double>(std::max<std::int64_t>(1, Count(x.global_shape(), norm))) : 1.0;
    auto run = [&](const Tensor &xl) {
        Tensor s = kernels::Sum(xl, {.dims = norm, .keepdim = keepdim});
        return mean ? kernels::Scale(s, scale) : s;
    };
    if (mesh == nullptr) {
        return DistTensor::Local(run(x.local()));
    }
    const auto rule = LookupRule(kOp, *mesh, Request(x.spec(), norm, keepdim, mean));
    const DistTensor xu = detail::Prepare(x, rule->info.inputs[0], rule->input_plans[0]);
    // A sharded reduced dim leaves a Partial(sum); the mean divides every partial by the global count.
    return detail::Shard(run(xu.local()), rule->info.outputs[0], mesh);
}

DistTensor SumBackward(const DistTensor &dout, const spmd::TensorSpec &x, const SumOptions &options) {
    const std::vector<int> &dims = options.dims;
    const bool keepdim = options.keepdim;
    const bool mean = options.mean;
    const char *kOp = mean ? "dist::MeanBackward" : "dist::SumBackward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout});
    const int rank = static_cast<int>(x.shape.size());
    const std::vector<int> norm = Normalise(dims, rank, kOp);
    SHARDLINE_CHECK_AS(ShapeError, IsPrefix(norm) || IsSuffix(norm, rank), kOp,
                       "the backward broadcasts over a prefix or a suffix of the dims, got dims [{}] of rank {}",
                       fmt::join(norm, ", "), rank);
    const double scale = mean ? 1.0 / static_cast<double>(std::max<std::int64_t>(1, Count(x.shape, norm))) : 1.0;
    auto run = [&](const Tensor &g, const Shape &x_local) {
        Tensor dx = Broadcast(g.Contiguous(), x_local, norm);
        return mean ? kernels::Scale(dx, scale) : dx;
    };
    if (mesh == nullptr) {
        return DistTensor::Local(run(dout.local(), x.shape));
    }
    spmd::RuleRequest request = Request(x, norm, keepdim, mean);
    request.direction = spmd::RuleDirection::kGrad;
    request.out_grad = dout.spec();
    const auto rule = LookupRule(kOp, *mesh, std::move(request));
    const spmd::SpmdInfo &info = rule->info;
    const std::size_t g = info.inputs.size() - 1;
    const DistTensor du = detail::Prepare(dout, info.inputs[g], rule->input_plans[g]);
    const spmd::TensorSpec &xg = info.outputs[0];
    const spmd::LocalShard shard = spmd::ComputeLocalShard(spmd::ProcessMesh(mesh->shape(), mesh->dim_names()),
                                                           xg.shape, xg.layout, mesh->coordinate());
    return detail::Shard(run(du.local(), shard.shape), xg, mesh);
}

} // namespace shardline::dist
