// The SPMD rules see the MoE token exchange (issue 16): for a real nn::MoEMLP forward and backward on (dp, ep, tp)
// meshes — every ep in {1, 2, 4} and tp in {1, 2} that divides the world — the moe_dispatch / moe_combine rules,
// asked through the runtime's rule cache (dist::LookupRule) with the layer's own layouts, predict exactly the
// collectives the ep group's counter sees: the calls (the counts' all_to_all and the rows' all_to_all_v forward, the
// rows' all_to_all_v twice backward; none at ep = 1), nothing on the other mesh dims' groups from the exchange, and the
// bytes: the counts' exact, the dispatch rows' equal to the rule's dropless bound, every row exchange within it (times
// ep for the side that holds the experts). The layer's input needs no move under the rule, the rule's expert rows are
// what the grouped_linear rule wants with the layer's real fc1 parameters, and the layer itself asks the rule (once per
// input configuration) for the layouts of its exchange. With etp 1 below tp the layer first splits its tokens over tp
// (a free slice) and asks the rules for that slice: the same predictions hold per slice, and the exchange stays on ep.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/dist/ops.h>
#include <shardline/nn/moe.h>
#include <shardline/spmd/rule_cache.h>

#include "moe_test_util.h"

namespace shardline {
namespace {

using namespace moe_test;

constexpr std::int64_t kT = 16;
constexpr std::int64_t kH = 8;
constexpr std::int64_t kF = 8;
constexpr std::int64_t kE = 4;

struct SpmdMoeCase {
    std::int64_t ep = 1;
    std::int64_t tp = 1;
    int topk = 2;
    std::int64_t etp = 0; ///< 0: etp = tp; 1 with tp 2: whole experts, the tokens split over tp
};

/// Expert of copy j of global token t: experts 0-2 only (expert 3 gets no token), as nn_moe_test's given routing.
std::int64_t ExpertOf(std::int64_t t, int j) {
    const std::int64_t first = t % 3;
    return j == 0 ? first : (first + 1 + t % 2) % 3;
}

/// Internal collectives of `rules` on mesh dim `d`, and their bytes.
struct Predicted {
    std::int64_t calls = 0;
    std::int64_t bytes = 0;
    std::int64_t elsewhere = 0; ///< on any other mesh dim (must be none)
};
Predicted PredictedOn(const std::vector<const spmd::CachedRule *> &rules, int d) {
    Predicted p;
    for (const spmd::CachedRule *rule : rules) {
        for (const spmd::InternalCollective &c : rule->info.internal) {
            if (c.mesh_dim == d) {
                ++p.calls;
                p.bytes += c.bytes_per_rank;
            } else {
                ++p.elsewhere;
            }
        }
    }
    return p;
}

void RunCase(const SpmdMoeCase &c) {
    DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
    const int ep_dim = mesh.dim_index("ep");
    const bool split = c.etp == 1 && c.tp > 1;
    const std::string name = fmt::format("ep{}_tp{}_top{}{}", c.ep, c.tp, c.topk, split ? "_etp1" : "");
    nn::MoEMLP layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = c.topk, .etp = c.etp, .activation = false},
                     mesh, WithName(Param(DType::kFloat32), "moe"));
    const DType f32 = DType::kFloat32;
    const Tensor full_x = MakeFull({kT, kH}, "moe.x", Data::kInteger, f32, 5);
    Variable x(DistTensor::Sharded(full_x, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), true);
    // The tokens the layer routes and exchanges: x, or with etp 1 below tp x's slice over tp (tp the minor shard).
    const DistTensor routed_x =
        split ? DistTensor::Sharded(full_x, mesh, {{.dim = 0, .over = {"dp", "ep", "tp"}}}) : x.value();
    const spmd::TensorSpec x_spec = routed_x.spec();

    // The rules, with the layer's layouts, from the runtime's cache.
    const spmd::MoEDispatchAttrs attrs{.num_experts = kE, .topk = c.topk};
    const auto dispatch = dist::LookupRule("test", mesh, {.op = "moe_dispatch", .inputs = {x_spec}, .attrs = attrs});
    const spmd::TensorSpec rows = dispatch->info.outputs[0];
    const auto combine = dist::LookupRule("test", mesh, {.op = "moe_combine", .inputs = {rows}, .attrs = attrs});
    const auto dispatch_grad = dist::LookupRule("test", mesh,
                                                {.op = "moe_dispatch",
                                                 .direction = spmd::RuleDirection::kGrad,
                                                 .inputs = {x_spec},
                                                 .out_grad = rows,
                                                 .attrs = attrs});
    const auto combine_grad = dist::LookupRule("test", mesh,
                                               {.op = "moe_combine",
                                                .direction = spmd::RuleDirection::kGrad,
                                                .inputs = {rows},
                                                .out_grad = combine->info.outputs[0],
                                                .attrs = attrs});
    EXPECT_TRUE(dispatch->input_plans[0].steps.empty()) << name << ": the layer's x is the rule's token layout";
    EXPECT_TRUE(dist::SameLayout(mesh, combine->info.outputs[0].layout, routed_x.layout()))
        << name << ": combine gives the routed tokens' layout back, got " << combine->info.outputs[0].layout.ToString();
    // The experts' rows are what grouped_linear wants with the layer's fc1 (experts over ep, ffn over tp): no move.
    const auto fc1 = dist::LookupRule(
        "test", mesh,
        {.op = "grouped_linear", .inputs = {rows, layer.fc1_weight.value().spec(), layer.fc1_bias.value().spec()}});
    for (const spmd::RedistributePlan &plan : fc1->input_plans) {
        EXPECT_TRUE(plan.steps.empty()) << name << ": grouped_linear moves an input of the experts";
    }

    // This rank's routed tokens and the given routing: chunk (dp, ep[, tp]) of the global tokens.
    const std::int64_t per = routed_x.local().shape()[0];
    const std::int64_t dp_coord = mesh.coordinate()[0];
    const std::int64_t ep_coord = mesh.coordinate()[static_cast<std::size_t>(ep_dim)];
    const std::int64_t tp_coord = mesh.coordinate()[static_cast<std::size_t>(mesh.dim_index("tp"))];
    auto chunk_of = [&](std::int64_t ep_rank) {
        const std::int64_t outer = dp_coord * c.ep + ep_rank;
        return split ? outer * c.tp + tp_coord : outer;
    };
    const std::int64_t chunk = chunk_of(ep_coord);
    std::vector<double> idx, w;
    for (std::int64_t t = chunk * per; t < (chunk + 1) * per; ++t) {
        for (int j = 0; j < c.topk; ++j) {
            idx.push_back(static_cast<double>(ExpertOf(t, j)));
            w.push_back(j == 0 ? 0.5 : 0.25);
        }
    }
    const Tensor indices = Tensor::FromVector(idx, {per, c.topk}, DType::kInt64).To(TestDevice());
    const Variable weights(Tensor::FromVector(w, {per, c.topk}, f32).To(TestDevice()), true);
    // The rows this rank's experts receive: the copies of its ep group's tokens routed to them.
    const std::int64_t local_experts = kE / c.ep;
    std::int64_t received = 0;
    for (std::int64_t peer = 0; peer < c.ep; ++peer) {
        const std::int64_t peer_chunk = chunk_of(peer);
        for (std::int64_t t = peer_chunk * per; t < (peer_chunk + 1) * per; ++t) {
            for (int j = 0; j < c.topk; ++j) {
                received += ExpertOf(t, j) / local_experts == ep_coord ? 1 : 0;
            }
        }
    }
    const std::int64_t sent = per * c.topk; // dropless: every copy leaves
    const std::int64_t row_bytes = kH * 4;

    const Predicted forward = PredictedOn({dispatch.get(), combine.get()}, ep_dim);
    const Predicted backward = PredictedOn({dispatch_grad.get(), combine_grad.get()}, ep_dim);
    EXPECT_EQ(forward.elsewhere + backward.elsewhere, 0) << name;
    ASSERT_EQ(forward.calls, c.ep > 1 ? 3 : 0) << name;
    ASSERT_EQ(backward.calls, c.ep > 1 ? 2 : 0) << name;
    if (c.ep > 1) {
        const std::vector<spmd::InternalCollective> &d = dispatch->info.internal;
        EXPECT_EQ(d[0].bytes_per_rank, (c.ep - 1) * local_experts * 8) << name << ": the counts, exact";
        EXPECT_EQ(d[1].bytes_per_rank, sent * row_bytes) << name << ": dropless, every copy may leave";
    }

    // The layer asks the same rule (its exchange's layouts come from it): once, through the runtime's cache.
    dist::Rules().Clear();
    ResetCounts(mesh);
    const nn::MoEOutput out = layer.ForwardRouted(x, indices, weights);
    const spmd::RuleKey key(spmd::RuleRequest{.op = "moe_dispatch",
                                              .mesh = spmd::ProcessMesh(mesh.shape(), mesh.dim_names()),
                                              .inputs = {x_spec},
                                              .attrs = attrs});
    EXPECT_NE(dist::Rules().Lookup(key), nullptr) << name << ": the layer asked the moe_dispatch rule for its x";
    EXPECT_EQ(dist::Rules().GetStats().size, 1U) << name << ": and no other rule through the runtime's cache";
    const comm::CollectiveCounts f = mesh.group(ep_dim).Counts();
    EXPECT_EQ(f.Calls(CollectiveKind::kAllToAll), forward.calls) << name << ": forward, the rule's internal on ep";
    EXPECT_EQ(f.TotalCalls(), forward.calls) << name << ": forward, nothing else on ep";
    if (c.ep > 1) {
        // The counter counts a call's whole send buffer: the counts' E int64 (the rule leaves out the block a rank
        // keeps), the dispatch's sent rows (the rule's bound, exactly) and the combine's received rows.
        EXPECT_EQ(f.Bytes(CollectiveKind::kAllToAll), kE * 8 + (sent + received) * row_bytes) << name;
        EXPECT_EQ(kE * 8 - local_experts * 8, dispatch->info.internal[0].bytes_per_rank) << name;
        EXPECT_LE(received * row_bytes, c.ep * combine->info.internal[0].bytes_per_rank) << name;
    }
    EXPECT_EQ(mesh.world().Counts().TotalCalls(), 0) << name;

    ResetCounts(mesh);
    const DistTensor dy =
        DistTensor::FromFull(MakeFull({kT, kH}, "moe.dy", Data::kInteger, f32, 5), out.output.value().layout(), mesh);
    out.output.Backward(&dy);
    const comm::CollectiveCounts b = mesh.group(ep_dim).Counts();
    EXPECT_EQ(b.Calls(CollectiveKind::kAllToAll), backward.calls) << name << ": backward, the rule's internal on ep";
    EXPECT_EQ(b.TotalCalls(), backward.calls) << name << ": backward, nothing else on ep";
    if (c.ep > 1) {
        EXPECT_EQ(b.Bytes(CollectiveKind::kAllToAll), (received + sent) * row_bytes) << name;
        EXPECT_EQ(backward.bytes, 2 * sent * row_bytes) << name << ": the rule's two row bounds";
    }
    EXPECT_EQ(mesh.world().Counts().TotalCalls(), 0) << name;
    EXPECT_TRUE(x.grad().defined()) << name;

    // A second call finds the answer in the layer: the runtime's cache is not even looked up.
    const spmd::RuleCache::Stats before = dist::Rules().GetStats();
    const nn::MoEOutput again = layer.ForwardRouted(x, indices, weights);
    const spmd::RuleCache::Stats after = dist::Rules().GetStats();
    EXPECT_EQ(after.hits, before.hits) << name;
    EXPECT_EQ(after.misses, before.misses) << name;
    EXPECT_TRUE(again.output.defined()) << name;
}

TEST(MoESpmdTest, RulesPredictTheExchangeTheCountersSee) {
    for (const auto &[ep, tp] : MeshShapes()) {
        for (int topk : {1, 2}) {
            RunCase({.ep = ep, .tp = tp, .topk = topk});
            if (tp > 1) {
                RunCase({.ep = ep, .tp = tp, .topk = topk, .etp = 1});
            }
        }
    }
}

} // namespace
} // namespace shardline
