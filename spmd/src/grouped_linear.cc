// grouped_linear (mixture-of-experts experts): y[t, n] = Σ_k x[t, k]·weight[e(t), n, k] + bias[e(t), n], where the rows
// t of x are grouped by expert e(t). x [T, in] "tk", weight [E, out, in] "enk", bias [E, out] "en", y [T, out] "tn".
// The expert label e is its own: it is not a contracted label (sharding it makes nothing Partial) but expert
// parallelism — the mesh dims that shard weight's expert dim place whole experts, so the rows routed to those experts
// live on their ranks: x's rows, y's rows and the gradients' rows are sharded on those mesh dims too (as the major
// shards; the token exchange that puts them there is step 10's all-to-all), and the parameter gradients stay sharded
// on e, not Partial. Within one expert the op is linear's "tk,nk,n->tn": sharding out makes it column parallel,
// sharding in makes y Partial with the bias added once after the reduction. So the rule is the linear rule on the
// expert's slice with the expert mesh dims taken out, which are then put back on e and on the rows.

#include <algorithm>
#include <utility>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {
namespace {

constexpr std::string_view kOp = "grouped_linear";

/// The layout without the given mesh dims (on any tensor dim, and as Partials).
Layout Without(const Layout &layout, const std::vector<int> &mesh_dims) {
    std::vector<std::vector<int>> dims = layout.DimsMeshDims();
    for (auto &d : dims) {
        std::erase_if(d, [&](int m) { return std::find(mesh_dims.begin(), mesh_dims.end(), m) != mesh_dims.end(); });
    }
    std::map<int, ReduceOp> partial = layout.Partial();
    for (int m : mesh_dims) {
        partial.erase(m);
    }
    return Layout(std::move(dims), std::move(partial));
}

/// The expert's slice of a per-expert parameter: its layout without dim 0 (and without the expert mesh dims).
TensorSpec Slice(const TensorSpec &param, const std::vector<int> &experts) {
    const Layout l = Without(param.layout, experts);
    std::vector<std::vector<int>> dims(l.DimsMeshDims().begin() + 1, l.DimsMeshDims().end());
    return TensorSpec{.shape = std::vector<int64_t>(param.shape.begin() + 1, param.shape.end()),
                      .layout = Layout(std::move(dims), l.Partial())};
}

/// A per-expert parameter (or its gradient) from its slice: the expert dim in front, sharded on `experts`.
TensorSpec WithExperts(const TensorSpec &slice, int64_t num_experts, const std::vector<int> &experts) {
    std::vector<std::vector<int>> dims = slice.layout.DimsMeshDims();
    dims.insert(dims.begin(), experts);
    std::vector<int64_t> shape = slice.shape;
    shape.insert(shape.begin(), num_experts);
    return TensorSpec{.shape = std::move(shape), .layout = Layout(std::move(dims), slice.layout.Partial())};
}

/// Rows (dim 0 of x, y and their gradients) on the expert mesh dims as the major shards.
TensorSpec WithExpertRows(const TensorSpec &rows, const std::vector<int> &experts) {
    std::vector<std::vector<int>> dims = rows.layout.DimsMeshDims();
    dims.front().insert(dims.front().begin(), experts.begin(), experts.end());
    return TensorSpec{.shape = rows.shape, .layout = Layout(std::move(dims), rows.layout.Partial())};
}

/// Step 0: the shapes, and the expert mesh dims (those of weight's expert dim: parameters never move).
struct Problem {
    std::vector<int> experts;
    int64_t num_experts = 0;
    TensorSpec x;
    TensorSpec weight;
    std::optional<TensorSpec> bias;
};

Problem Verify(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
               const std::optional<TensorSpec> &bias) {
    detail::CheckSpec(mesh, x, kOp, "x");
    detail::CheckSpec(mesh, weight, kOp, "weight");
    if (x.shape.size() != 2) {
        throw SpmdError(fmt::format("grouped_linear: x must be [tokens, in_features] (rows grouped by expert), got {}",
                                    ShapeToString(x.shape)));
    }
    if (weight.shape.size() != 3 || weight.shape[2] != x.shape[1]) {
        throw SpmdError(fmt::format("grouped_linear: weight must be [experts, out_features, in_features] with "
                                    "in_features = x.shape[1] ({}), got {}",
                                    x.shape[1], ShapeToString(weight.shape)));
    }
    Problem p;
    p.experts = weight.layout.MeshDims(0);
    p.num_experts = weight.shape[0];
    p.x = TensorSpec{.shape = x.shape, .layout = Without(x.layout, p.experts)};
    p.weight = Slice(weight, p.experts);
    if (bias) {
        detail::CheckSpec(mesh, *bias, kOp, "bias");
        if (bias->shape != std::vector<int64_t>{weight.shape[0], weight.shape[1]}) {
            throw SpmdError(fmt::format("grouped_linear: bias must be [experts, out_features] = [{}, {}], got {}",
                                        weight.shape[0], weight.shape[1], ShapeToString(bias->shape)));
        }
        p.bias = Slice(*bias, p.experts);
    }
    return p;
}

/// The linear answer on the slices, with the experts put back: x, y (and dx, dy) rows on the expert mesh dims,
/// weight and bias (and their gradients) sharded on e.
SpmdInfo PutExpertsBack(SpmdInfo info, const Problem &p) {
    for (std::vector<TensorSpec> *specs : {&info.inputs, &info.outputs}) {
        const std::vector<std::string> &names = specs == &info.inputs ? info.input_names : info.output_names;
        for (size_t i = 0; i < specs->size(); ++i) {
            const std::string &name = names[i];
            TensorSpec &s = (*specs)[i];
            if (name.rfind("weight", 0) == 0 || name.rfind("bias", 0) == 0) {
                s = WithExperts(s, p.num_experts, p.experts);
            } else {
                s = WithExpertRows(s, p.experts);
            }
        }
    }
    return info;
}

} // namespace

SpmdInfo InferGroupedLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                   const std::optional<TensorSpec> &bias, const RuleOptions &options) {
    const Problem p = Verify(mesh, x, weight, bias);
    return PutExpertsBack(InferLinearForward(mesh, p.x, p.weight, p.bias, LinearAttrs{}, options), p);
}

SpmdInfo InferGroupedLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                   const std::optional<TensorSpec> &bias, const TensorSpec &out,
                                   const RuleOptions &options) {
    const Problem p = Verify(mesh, x, weight, bias);
    detail::CheckSpec(mesh, out, kOp, "out");
    const TensorSpec out_slice{.shape = out.shape, .layout = Without(out.layout, p.experts)};
    return PutExpertsBack(InferLinearReverse(mesh, p.x, p.weight, p.bias, out_slice, LinearAttrs{}, options), p);
}

SpmdInfo InferGroupedLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                const std::optional<TensorSpec> &bias, const TensorSpec &out_grad,
                                const RuleOptions &options) {
    const Problem p = Verify(mesh, x, weight, bias);
    detail::CheckSpec(mesh, out_grad, kOp, "out_grad");
    const TensorSpec dy_slice{.shape = out_grad.shape, .layout = Without(out_grad.layout, p.experts)};
    return PutExpertsBack(InferLinearGrad(mesh, p.x, p.weight, p.bias, dy_slice, LinearAttrs{}, options), p);
}

} // namespace shardline::spmd
