// moe_dispatch / moe_combine: expert parallelism's token exchange (the MoE layer's dispatcher between Permute and the
// experts, and back; src/autograd/moe_dispatch.cc runs it). Not an einsum: no element of x meets another, rows only
// change ranks. What the rule states is where the rows live before and after, and the collectives the exchange runs
// inside itself (`internal`):
//
//   dispatch  x [T, H] token rows, sharded over the data-parallel mesh dims (ep among them: the ep ranks hold different
//             tokens) -> out [T*k, H] expert rows, the copies this rank's experts receive, grouped by local expert.
//             The expert mesh dim ep is the major shard of out's rows, as grouped_linear wants its x (its expert dim
//             `e` is sharded on ep: whole experts on their ranks, so their rows must be there too). Forward: an
//             all_to_all of the E per-expert row counts (int64), then an all_to_all_v of the rows; grad: the rows
//             back (one all_to_all_v), dx in x's layout.
//   combine   the inverse, out [T*k, H] -> [T, H] (the dispatch's plan is reused: no counts); one all_to_all_v in
//             forward and one in grad.
//
// With ep of size 1 (or absent from the rows) nothing moves: layouts pass through and `internal` is empty. The row
// bytes depend on the routing; each entry carries the upper bound of a rank's rows (every copy of its tokens sent to
// another rank: T_local * k rows, or E * capacity when that is smaller) times the local hidden size.

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {
namespace {

constexpr int64_t kCountBytes = 8; // the per-expert counts are int64

/// Step 0: the ep mesh dim and the attrs' values, checked.
struct Exchange {
    std::string op;
    int ep = -1;   ///< the ep mesh dim
    int64_t p = 1; ///< its size
    bool moves = false;
    MoEDispatchAttrs attrs;
};

Exchange Verify(const ProcessMesh &mesh, const MoEDispatchAttrs &attrs, bool combine) {
    Exchange e;
    e.op = combine ? "moe_combine" : "moe_dispatch";
    const auto &names = mesh.DimNames();
    const auto it = std::find(names.begin(), names.end(), attrs.ep_dim);
    if (it == names.end()) {
        throw SpmdError(fmt::format("{}: the mesh has no dim named '{}' (ep_dim; its dims are [{}])", e.op,
                                    attrs.ep_dim, fmt::join(names, ", ")));
    }
    e.ep = static_cast<int>(it - names.begin());
    e.p = mesh.DimSize(e.ep);
    if (attrs.num_experts <= 0 || attrs.num_experts % e.p != 0) {
        throw SpmdError(fmt::format("{}: num_experts ({}) must be positive and divisible by the size of mesh dim '{}' "
                                    "({})",
                                    e.op, attrs.num_experts, attrs.ep_dim, e.p));
    }
    if (attrs.topk < 1 || attrs.topk > attrs.num_experts) {
        throw SpmdError(
            fmt::format("{}: topk ({}) must be in [1, num_experts] = [1, {}]", e.op, attrs.topk, attrs.num_experts));
    }
    if (attrs.capacity < -1) {
        throw SpmdError(fmt::format("{}: capacity ({}) must be >= 0, or -1 for dropless", e.op, attrs.capacity));
    }
    e.moves = e.p > 1;
    e.attrs = attrs;
    return e;
}

void CheckRows(const ProcessMesh &mesh, const Exchange &e, const TensorSpec &t, std::string_view name) {
    detail::CheckSpec(mesh, t, e.op, name);
    if (t.shape.size() != 2) {
        throw SpmdError(fmt::format("{}: {} must be [rows, hidden], got {}", e.op, name, ShapeToString(t.shape)));
    }
    const std::vector<int> &hidden = t.layout.MeshDims(1);
    if (e.moves && std::find(hidden.begin(), hidden.end(), e.ep) != hidden.end()) {
        throw SpmdError(fmt::format("{}: {}'s hidden dim must not be sharded on '{}' (mesh dim {}): the exchange "
                                    "moves whole rows over it, got {}",
                                    e.op, name, e.attrs.ep_dim, e.ep, t.layout.ToString()));
    }
}

/// `rows` without ep (unchanged when ep has one rank: then the layouts pass through).
std::vector<int> WithoutEp(std::vector<int> rows, const Exchange &e) {
    if (e.moves) {
        std::erase(rows, e.ep);
    }
    return rows;
}

/// Token rows: the data dims with ep at its mesh-dim position when it is not there yet (a free local slice).
std::vector<int> TokenRows(const std::vector<int> &rows, const Exchange &e) {
    if (!e.moves || std::find(rows.begin(), rows.end(), e.ep) != rows.end()) {
        return rows;
    }
    std::vector<int> out = rows;
    out.insert(std::upper_bound(out.begin(), out.end(), e.ep), e.ep);
    return out;
}

/// Expert rows: ep as the major shard, then the other data dims.
std::vector<int> ExpertRows(const std::vector<int> &rows, const Exchange &e) {
    std::vector<int> out = WithoutEp(rows, e);
    if (e.moves) {
        out.insert(out.begin(), e.ep);
    }
    return out;
}

TensorSpec Spec(std::vector<int64_t> shape, std::vector<int> rows, const std::vector<int> &hidden) {
    return TensorSpec{.shape = std::move(shape),
                      .layout = Layout(std::vector<std::vector<int>>{std::move(rows), hidden})};
}

/// The exchange's collectives: the counts (dispatch forward only) and the rows. `tokens` is the token side [T, H] in
/// its required layout: its max local shape bounds the rows a rank's tokens send or get back.
std::vector<InternalCollective> Internal(const ProcessMesh &mesh, const Exchange &e, const TensorSpec &tokens,
                                         bool counts, std::string what, const RuleOptions &options) {
    std::vector<InternalCollective> internal;
    if (!e.moves) {
        return internal;
    }
    const std::string overflow = fmt::format("{}: the exchange's bytes per rank", e.op);
    if (counts) {
        // The planner's all_to_all convention: (n - 1) blocks of E / n counts leave each rank.
        const int64_t bytes =
            CheckedMul(CheckedMul(e.p - 1, e.attrs.num_experts / e.p, overflow), kCountBytes, overflow);
        internal.push_back({.collective = Collective::kAllToAll,
                            .mesh_dim = e.ep,
                            .what = "per-expert row counts (int64, E per rank)",
                            .bytes_per_rank = bytes,
                            .cost_us = options.plan.cost.Cost(e.ep, e.p - 1, bytes)});
    }
    const std::vector<int64_t> local = MaxLocalShape(mesh, tokens.shape, tokens.layout);
    int64_t rows = CheckedMul(local[0], e.attrs.topk, overflow);
    // E * capacity when smaller (compared without forming a product that could overflow).
    if (e.attrs.capacity == 0) {
        rows = 0;
    } else if (e.attrs.capacity > 0 && e.attrs.num_experts <= rows / e.attrs.capacity) {
        rows = e.attrs.num_experts * e.attrs.capacity;
    }
    const int64_t bytes = CheckedMul(CheckedMul(rows, local[1], overflow), options.plan.element_size, overflow);
    internal.push_back({.collective = Collective::kAllToAllV,
                        .mesh_dim = e.ep,
                        .what = std::move(what),
                        .bytes_per_rank = bytes,
                        .cost_us = options.plan.cost.Cost(e.ep, e.p - 1, bytes)});
    return internal;
}

/// Cost mode: the given inputs' moves to the required layouts plus the internal collectives.
void Price(SpmdInfo &info, const ProcessMesh &mesh, const std::vector<const TensorSpec *> &given,
           const RuleOptions &options) {
    if (options.mode != RuleMode::kCostBased) {
        return;
    }
    double cost = 0.0;
    for (size_t i = 0; i < given.size() && i < info.inputs.size(); ++i) {
        cost += RedistributeCost(mesh, given[i]->shape, given[i]->layout, info.inputs[i].layout, options.plan);
    }
    for (const InternalCollective &c : info.internal) {
        cost += c.cost_us;
    }
    info.cost_us = cost;
}

/// The forward answer from the required input `x` (the token side for dispatch, the expert side for combine).
SpmdInfo Forward(const ProcessMesh &mesh, const Exchange &e, bool combine, const TensorSpec &x,
                 const RuleOptions &options) {
    const int64_t k = e.attrs.topk;
    const std::vector<int> &hidden = x.layout.MeshDims(1);
    SpmdInfo info;
    info.input_names = {"x"};
    info.output_names = {"out"};
    if (!combine) {
        const TensorSpec in = Spec(x.shape, TokenRows(x.layout.MeshDims(0), e), hidden);
        const int64_t rows = CheckedMul(x.shape[0], k, fmt::format("{}: out rows (tokens * topk)", e.op));
        info.inputs = {in};
        info.outputs = {Spec({rows, x.shape[1]}, ExpertRows(in.layout.MeshDims(0), e), hidden)};
        info.internal = Internal(mesh, e, in, true, "token rows to their experts' ranks", options);
        return info;
    }
    if (x.shape[0] % k != 0) {
        throw SpmdError(fmt::format("moe_combine: x's rows ({}) must be tokens * topk (topk {}), got {}", x.shape[0], k,
                                    ShapeToString(x.shape)));
    }
    const TensorSpec in = Spec(x.shape, ExpertRows(x.layout.MeshDims(0), e), hidden);
    info.inputs = {in};
    info.outputs = {Spec({x.shape[0] / k, x.shape[1]}, TokenRows(WithoutEp(in.layout.MeshDims(0), e), e), hidden)};
    info.internal = Internal(mesh, e, info.outputs[0], false, "expert rows back to their tokens' ranks", options);
    return info;
}

SpmdInfo InferForward(const ProcessMesh &mesh, const TensorSpec &x, const MoEDispatchAttrs &attrs,
                      const RuleOptions &options, bool combine) {
    const Exchange e = Verify(mesh, attrs, combine);
    CheckRows(mesh, e, x, "x");
    SpmdInfo info = Forward(mesh, e, combine, x, options);
    Price(info, mesh, {&x}, options);
    return info;
}

SpmdInfo InferReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                      const MoEDispatchAttrs &attrs, const RuleOptions &options, bool combine) {
    const Exchange e = Verify(mesh, attrs, combine);
    CheckRows(mesh, e, x, "x");
    CheckRows(mesh, e, out, "out");
    // The input from the output's rows (the inverse direction's layout), then the forward rule on it.
    const std::vector<int> &rows = out.layout.MeshDims(0);
    const TensorSpec in =
        Spec(x.shape, combine ? ExpertRows(rows, e) : TokenRows(WithoutEp(rows, e), e), out.layout.MeshDims(1));
    SpmdInfo info = Forward(mesh, e, combine, in, options);
    if (info.outputs[0].shape != out.shape) {
        throw SpmdError(fmt::format("{}: out must be {} for x {} (topk {}), got {}", e.op,
                                    ShapeToString(info.outputs[0].shape), ShapeToString(x.shape), e.attrs.topk,
                                    ShapeToString(out.shape)));
    }
    Price(info, mesh, {}, options);
    return info;
}

SpmdInfo InferGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                   const MoEDispatchAttrs &attrs, const RuleOptions &options, bool combine) {
    const Exchange e = Verify(mesh, attrs, combine);
    CheckRows(mesh, e, x, "x");
    CheckRows(mesh, e, out_grad, "out_grad");
    const SpmdInfo forward = Forward(mesh, e, combine, x, options);
    if (out_grad.shape != forward.outputs[0].shape) {
        throw SpmdError(fmt::format("{}: out_grad must have the output's shape {}, got {}", e.op,
                                    ShapeToString(forward.outputs[0].shape), ShapeToString(out_grad.shape)));
    }
    SpmdInfo info;
    info.input_names = {"x", "out_grad"};
    info.inputs = {forward.inputs[0], forward.outputs[0]};
    info.output_names = {"x_grad"};
    info.outputs = {forward.inputs[0]};
    // The gradient goes the other way: dispatch's dx by the combine's exchange and vice versa (no counts: the plan is
    // the forward's).
    const TensorSpec &tokens = combine ? forward.outputs[0] : forward.inputs[0];
    info.internal = Internal(mesh, e, tokens, false,
                             combine ? "output gradient rows to their experts' ranks"
                                     : "output gradient rows back to their tokens' ranks",
                             options);
    Price(info, mesh, {&x, &out_grad}, options);
    return info;
}

} // namespace

SpmdInfo InferMoEDispatchForward(const ProcessMesh &mesh, const TensorSpec &x, const MoEDispatchAttrs &attrs,
                                 const RuleOptions &options) {
    return InferForward(mesh, x, attrs, options, false);
}
SpmdInfo InferMoEDispatchReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                                 const MoEDispatchAttrs &attrs, const RuleOptions &options) {
    return InferReverse(mesh, x, out, attrs, options, false);
}
SpmdInfo InferMoEDispatchGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                              const MoEDispatchAttrs &attrs, const RuleOptions &options) {
    return InferGrad(mesh, x, out_grad, attrs, options, false);
}
SpmdInfo InferMoECombineForward(const ProcessMesh &mesh, const TensorSpec &x, const MoEDispatchAttrs &attrs,
                                const RuleOptions &options) {
    return InferForward(mesh, x, attrs, options, true);
}
SpmdInfo InferMoECombineReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                                const MoEDispatchAttrs &attrs, const RuleOptions &options) {
    return InferReverse(mesh, x, out, attrs, options, true);
}
SpmdInfo InferMoECombineGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                             const MoEDispatchAttrs &attrs, const RuleOptions &options) {
    return InferGrad(mesh, x, out_grad, attrs, options, true);
}

} // namespace shardline::spmd
