// reshape (row-major): dims are grouped into runs whose products match ([b, s, h] -> [b*s, h] is the runs
// {b, s} -> {b*s} and {h} -> {h}). Within a run only the first dim of size > 1 may stay sharded, and only when it
// and the first output dim of size > 1 of the run are divisible by the shard count: then a rank's torch.chunk shard
// of both sides holds the same elements. Every other sharding in a run is dropped (required Replicate). Partials
// pass through (a reshape is linear and keeps max / min).

#include <algorithm>
#include <numeric>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

struct Group {
    std::vector<int> in;
    std::vector<int> out;
};

std::vector<int64_t> ResolveShape(const std::vector<int64_t> &in, const std::vector<int64_t> &target) {
    const int64_t numel = std::accumulate(in.begin(), in.end(), int64_t{1}, std::multiplies<>());
    std::vector<int64_t> shape = target;
    int infer = -1;
    int64_t known = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] == -1) {
            if (infer >= 0) {
                throw SpmdError(fmt::format("reshape: shape {} may contain at most one -1", ShapeToString(target)));
            }
            infer = static_cast<int>(i);
        } else if (shape[i] < 0) {
            throw SpmdError(fmt::format("reshape: shape {} has a negative dim other than -1", ShapeToString(target)));
        } else {
            known *= shape[i];
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known != 0) {
            throw SpmdError(
                fmt::format("reshape: cannot infer the -1 of {} for x of {} elements", ShapeToString(target), numel));
        }
        shape[infer] = numel / known;
        known *= shape[infer];
    }
    if (known != numel) {
        throw SpmdError(fmt::format("reshape: shape {} has {} elements, x {} has {}", ShapeToString(target), known,
                                    ShapeToString(in), numel));
    }
    return shape;
}

std::vector<Group> Groups(const std::vector<int64_t> &in, const std::vector<int64_t> &out) {
    std::vector<Group> groups;
    size_t i = 0;
    size_t o = 0;
    while (i < in.size() || o < out.size()) {
        Group g;
        int64_t pin = 1;
        int64_t pout = 1;
        if (i < in.size()) {
            pin = in[i];
            g.in.push_back(static_cast<int>(i++));
        }
        if (o < out.size()) {
            pout = out[o];
            g.out.push_back(static_cast<int>(o++));
        }
        while (pin != pout) {
            if (pin < pout && i < in.size()) {
                pin *= in[i];
                g.in.push_back(static_cast<int>(i++));
            } else if (o < out.size()) {
                pout *= out[o];
                g.out.push_back(static_cast<int>(o++));
            } else if (i < in.size()) {
                pin *= in[i];
                g.in.push_back(static_cast<int>(i++));
            } else {
                break; // products differ only through zero-size dims: one group
            }
        }
        groups.push_back(std::move(g));
    }
    return groups;
}

int FirstNonUnit(const std::vector<int> &dims, const std::vector<int64_t> &shape) {
    for (int d : dims) {
        if (shape[d] != 1) {
            return d;
        }
    }
    return -1;
}

/// Maps `from` (on from_shape) through the groups to the other side; `required` gets what `from` keeps.
Layout MapLayout(const ProcessMesh &mesh, const std::vector<Group> &groups, bool forward,
                 const std::vector<int64_t> &from_shape, const std::vector<int64_t> &to_shape, const Layout &from,
                 Layout *required) {
    std::vector<std::vector<int>> to_dims(to_shape.size());
    std::vector<std::vector<int>> kept(from_shape.size());
    for (const Group &g : groups) {
        const std::vector<int> &a = forward ? g.in : g.out;
        const std::vector<int> &b = forward ? g.out : g.in;
        const int major_a = FirstNonUnit(a, from_shape);
        const int major_b = FirstNonUnit(b, to_shape);
        if (major_a < 0 || major_b < 0 || from.MeshDims(major_a).empty()) {
            continue;
        }
        int64_t parts = 1;
        for (int d : from.MeshDims(major_a)) {
            parts *= mesh.DimSize(d);
        }
        if (from_shape[major_a] % parts == 0 && to_shape[major_b] % parts == 0) {
            to_dims[major_b] = from.MeshDims(major_a);
            kept[major_a] = from.MeshDims(major_a);
        }
    }
    *required = Layout(std::move(kept), from.Partial());
    return Layout(std::move(to_dims), from.Partial());
}

SpmdInfo Forward(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int64_t> &out_shape) {
    const Layout from = x.layout.Canonical(mesh);
    Layout required;
    const Layout out = MapLayout(mesh, Groups(x.shape, out_shape), true, x.shape, out_shape, from, &required);
    SpmdInfo info;
    info.input_names = {"x"};
    info.inputs = {{x.shape, required}};
    info.output_names = {"out"};
    info.outputs = {{out_shape, out}};
    return info;
}

} // namespace

SpmdInfo InferReshapeForward(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int64_t> &shape,
                             const RuleOptions &options) {
    (void)options; // one answer: the rule has no choice to price
    detail::CheckSpec(mesh, x, "reshape", "x");
    return Forward(mesh, x, ResolveShape(x.shape, shape));
}

SpmdInfo InferReshapeReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                             const RuleOptions &options) {
    (void)options;
    detail::CheckSpec(mesh, x, "reshape", "x");
    detail::CheckSpec(mesh, out, "reshape", "out");
    const std::vector<int64_t> out_shape = ResolveShape(x.shape, out.shape);
    Layout unused;
    const Layout x_layout =
        MapLayout(mesh, Groups(x.shape, out_shape), false, out_shape, x.shape, out.layout.Canonical(mesh), &unused);
    return Forward(mesh, {x.shape, x_layout}, out_shape);
}

SpmdInfo InferReshapeGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                          const std::vector<int64_t> &shape, const RuleOptions &options) {
    (void)options;
    detail::CheckSpec(mesh, x, "reshape", "x");
    const std::vector<int64_t> out_shape = ResolveShape(x.shape, shape);
    detail::CheckSpec(mesh, out_grad, "reshape", "out_grad");
    if (out_grad.shape != out_shape) {
        throw SpmdError(fmt::format("reshape: out_grad shape {} must equal the output shape {}",
                                    ShapeToString(out_grad.shape), ShapeToString(out_shape)));
    }
    const SpmdInfo forward = Forward(mesh, x, out_shape);
    const Layout &out = forward.outputs[0].layout;
    // The gradient of a Partial output is Replicate there; an out_grad Partial elsewhere passes through (linear).
    std::map<int, ReduceOp> partial;
    const std::vector<int> used = out.UsedMeshDims();
    const Layout grad_layout = out_grad.layout.Canonical(mesh);
    for (const auto &[d, op] : grad_layout.Partial()) {
        if (std::find(used.begin(), used.end(), d) == used.end() && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
            partial[d] = op;
        }
    }
    SpmdInfo info;
    info.input_names = {"x", "out_grad"};
    info.inputs = {forward.inputs[0], {out_shape, Layout(out.DimsMeshDims(), partial)}};
    info.output_names = {"x_grad"};
    info.outputs = {{x.shape, Layout(forward.inputs[0].layout.DimsMeshDims(), partial)}};
    return info;
}

} // namespace shardline::spmd
