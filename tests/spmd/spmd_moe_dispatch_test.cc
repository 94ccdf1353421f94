// moe_dispatch / moe_combine rules (expert parallelism's token exchange): token rows sharded over the data-parallel
// mesh dims -> expert rows with ep as the major row shard (grouped_linear's x), and back; the exchange's collectives
// are `internal`. Notation: x[t,h] -> out[t*k,h]; mesh [dp=2, ep=2, tp=2] (mesh dims 0, 1, 2); E = 4 experts, topk 2.

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh kMesh({2, 2, 2}, {"dp", "ep", "tp"});
constexpr int64_t kTokens = 16;
constexpr int64_t kHidden = 8;
const MoEDispatchAttrs kAttrs{.num_experts = 4, .topk = 2};

/// The counts all-to-all on ep: (2 - 1) blocks of E / 2 = 2 int64 counts leave each rank.
void ExpectCounts(const InternalCollective &c) {
    EXPECT_EQ(c.collective, Collective::kAllToAll);
    EXPECT_EQ(c.mesh_dim, 1);
    EXPECT_EQ(c.bytes_per_rank, 16);
    EXPECT_NEAR(c.cost_us, 63.9 + 1.78 + 16 / 341.6e3, 1e-9);
}

/// The rows' all_to_all_v on ep with `bytes` per rank (the dropless bound).
void ExpectRows(const InternalCollective &c, int64_t bytes, const std::string &what_prefix) {
    EXPECT_EQ(c.collective, Collective::kAllToAllV);
    EXPECT_EQ(ToString(c.collective), "all_to_all_v");
    EXPECT_EQ(c.mesh_dim, 1);
    EXPECT_EQ(c.bytes_per_rank, bytes);
    EXPECT_NEAR(c.cost_us, 63.9 + 1.78 + static_cast<double>(bytes) / 341.6e3, 1e-9);
    EXPECT_EQ(c.what.rfind(what_prefix, 0), 0u) << c.what;
}

// x[[0,1],-1] -> out[[1,0],-1]; internal: all_to_all counts (16 B), all_to_all_v rows (4 tokens * 2 * 8 * 4 B = 256 B)
TEST(MoEDispatchTest, DispatchPutsEpMajorOnTheRowsAndExchangesCountsThenRows) {
    const SpmdInfo info = InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[[0,1],-1]"), kAttrs);
    EXPECT_EQ(S(info.Input("x")), "[[0,1],-1]");
    EXPECT_EQ(info.output_names, std::vector<std::string>{"out"});
    EXPECT_EQ(S(info.outputs[0]), "[[1,0],-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{kTokens * 2, kHidden}));
    ASSERT_EQ(info.internal.size(), 2u);
    ExpectCounts(info.internal[0]);
    ExpectRows(info.internal[1], 4 * 2 * kHidden * 4, "token rows");
    EXPECT_FALSE(info.bias_after_reduction);
}

// x[[0,1],2] -> out[[1,0],2]: hidden stays sharded on tp; the rows carry 4 of the 8 features (128 B)
TEST(MoEDispatchTest, HiddenShardedOnTpStaysSharded) {
    const SpmdInfo info = InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[[0,1],2]"), kAttrs);
    EXPECT_EQ(S(info.Input("x")), "[[0,1],2]");
    EXPECT_EQ(S(info.outputs[0]), "[[1,0],2]");
    ASSERT_EQ(info.internal.size(), 2u);
    ExpectRows(info.internal[1], 4 * 2 * 4 * 4, "token rows");
}

// x[0,-1] (replicated over ep) -> x required [[0,1],-1] by a free local slice; out[[1,0],-1]
TEST(MoEDispatchTest, TokensReplicatedOverEpAreSlicedForFree) {
    const RuleRequest request{
        .op = "moe_dispatch", .mesh = kMesh, .inputs = {T({kTokens, kHidden}, "[0,-1]")}, .attrs = kAttrs};
    const CachedRule rule = InferRuleWithPlans(request);
    EXPECT_EQ(S(rule.info.Input("x")), "[[0,1],-1]");
    EXPECT_EQ(S(rule.info.outputs[0]), "[[1,0],-1]");
    ASSERT_EQ(rule.input_plans.size(), 1u);
    ASSERT_EQ(rule.input_plans[0].steps.size(), 1u);
    EXPECT_EQ(rule.input_plans[0].steps[0].collective, Collective::kLocalSlice);
    EXPECT_EQ(rule.input_plans[0].steps[0].mesh_dim, 1);
}

// x[[0,1],-1] partial{2} -> x required [[0,1],-1]: the exchange moves values, so a Partial input is reduced first
TEST(MoEDispatchTest, PartialInputIsReducedFirst) {
    const RuleRequest request{.op = "moe_dispatch",
                              .mesh = kMesh,
                              .inputs = {T({kTokens, kHidden}, "[[0,1],-1] partial{2}")},
                              .attrs = kAttrs};
    const CachedRule rule = InferRuleWithPlans(request);
    EXPECT_EQ(S(rule.info.Input("x")), "[[0,1],-1]");
    ASSERT_EQ(rule.input_plans[0].steps.size(), 1u);
    EXPECT_EQ(rule.input_plans[0].steps[0].collective, Collective::kAllReduce);
    EXPECT_EQ(rule.input_plans[0].steps[0].mesh_dim, 2);
}

// grad: x[[0,1],-1], out_grad[-1,-1] -> out_grad required [[1,0],-1], x_grad [[0,1],-1]; internal: the rows back only
TEST(MoEDispatchTest, GradSendsTheRowsBackWithoutCounts) {
    const SpmdInfo info =
        InferMoEDispatchGrad(kMesh, T({kTokens, kHidden}, "[[0,1],-1]"), T({kTokens * 2, kHidden}, "[-1,-1]"), kAttrs);
    EXPECT_EQ(info.input_names, (std::vector<std::string>{"x", "out_grad"}));
    EXPECT_EQ(S(info.Input("out_grad")), "[[1,0],-1]");
    EXPECT_EQ(info.output_names, std::vector<std::string>{"x_grad"});
    EXPECT_EQ(S(info.Output("x_grad")), "[[0,1],-1]");
    EXPECT_FALSE(info.Output("x_grad").layout.IsPartial());
    ASSERT_EQ(info.internal.size(), 1u);
    ExpectRows(info.internal[0], 256, "output gradient rows back");
}

// reverse: out[[1,0],2] -> x[[0,1],2]
TEST(MoEDispatchTest, ReverseTakesTheTokenLayoutFromTheExpertRows) {
    const SpmdInfo info = InferMoEDispatchReverse(kMesh, T({kTokens, kHidden}, "[-1,-1]"),
                                                  T({kTokens * 2, kHidden}, "[[1,0],2]"), kAttrs);
    EXPECT_EQ(S(info.Input("x")), "[[0,1],2]");
    EXPECT_EQ(S(info.outputs[0]), "[[1,0],2]");
    EXPECT_EQ(info.internal.size(), 2u);
}

// combine: x[[1,0],-1] [32,8] -> out[[0,1],-1] [16,8]; internal: one all_to_all_v (256 B)
TEST(MoEDispatchTest, CombineBringsTheRowsBackToTheTokenLayout) {
    const SpmdInfo info = InferMoECombineForward(kMesh, T({kTokens * 2, kHidden}, "[[1,0],-1]"), kAttrs);
    EXPECT_EQ(S(info.Input("x")), "[[1,0],-1]");
    EXPECT_EQ(S(info.outputs[0]), "[[0,1],-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{kTokens, kHidden}));
    ASSERT_EQ(info.internal.size(), 1u);
    ExpectRows(info.internal[0], 256, "expert rows back");
}

// combine grad: out_grad[[0,1],-1] -> x_grad[[1,0],-1]; internal: one all_to_all_v to the experts' ranks
TEST(MoEDispatchTest, CombineGradSendsTheGradientToTheExperts) {
    const SpmdInfo info = InferMoECombineGrad(kMesh, T({kTokens * 2, kHidden}, "[[1,0],-1]"),
                                              T({kTokens, kHidden}, "[[0,1],-1]"), kAttrs);
    EXPECT_EQ(S(info.Input("out_grad")), "[[0,1],-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[[1,0],-1]");
    ASSERT_EQ(info.internal.size(), 1u);
    ExpectRows(info.internal[0], 256, "output gradient rows to their experts");
}

// dispatch then combine is the identity on the layout; the dispatch's output is grouped_linear's x as it is
TEST(MoEDispatchTest, DispatchFeedsGroupedLinearAndCombineInvertsIt) {
    const TensorSpec x = T({kTokens, kHidden}, "[[0,1],-1]");
    const SpmdInfo dispatch = InferMoEDispatchForward(kMesh, x, kAttrs);
    const SpmdInfo combine = InferMoECombineForward(kMesh, dispatch.outputs[0], kAttrs);
    EXPECT_EQ(S(combine.Input("x")), S(dispatch.outputs[0]));
    EXPECT_EQ(S(combine.outputs[0]), S(x));
    // Experts over ep, fc1 column parallel over tp: x's rows need no move.
    const SpmdInfo fc1 =
        InferGroupedLinearForward(kMesh, dispatch.outputs[0], T({4, 12, kHidden}, "[1,2,-1]"), T({4, 12}, "[1,2]"));
    EXPECT_EQ(S(fc1.Input("x")), S(dispatch.outputs[0]));
    EXPECT_EQ(S(fc1.outputs[0]), "[[1,0],2]");
}

// ep = 1 (a mesh dim of one rank): nothing is exchanged, the layouts pass through
TEST(MoEDispatchTest, EpOfOneRankExchangesNothing) {
    const ProcessMesh mesh({4, 1, 2}, {"dp", "ep", "tp"});
    for (const char *x : {"[0,-1]", "[[0,1],-1]", "[0,2]"}) {
        const SpmdInfo d = InferMoEDispatchForward(mesh, T({kTokens, kHidden}, x), kAttrs);
        EXPECT_EQ(S(d.Input("x")), x);
        EXPECT_EQ(S(d.outputs[0]), x);
        EXPECT_TRUE(d.internal.empty()) << x;
        const SpmdInfo g = InferMoEDispatchGrad(mesh, T({kTokens, kHidden}, x), T({kTokens * 2, kHidden}, x), kAttrs);
        EXPECT_TRUE(g.internal.empty()) << x;
        const SpmdInfo c = InferMoECombineForward(mesh, T({kTokens * 2, kHidden}, x), kAttrs);
        EXPECT_EQ(S(c.outputs[0]), x);
        EXPECT_TRUE(c.internal.empty()) << x;
    }
    const SpmdInfo alone = InferMoEDispatchForward(ProcessMesh({1}, {"ep"}), T({kTokens, kHidden}, "[-1,-1]"), kAttrs);
    EXPECT_TRUE(alone.internal.empty());
}

// capacity 1 (per expert per source rank): the rows are bounded by E * 1 = 4 instead of 4 tokens * 2 = 8
TEST(MoEDispatchTest, CapacityTightensTheRowBound) {
    MoEDispatchAttrs attrs = kAttrs;
    attrs.capacity = 1;
    const SpmdInfo info = InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[[0,1],-1]"), attrs);
    ASSERT_EQ(info.internal.size(), 2u);
    ExpectRows(info.internal[1], 4 * kHidden * 4, "token rows");
    RuleOptions bf16;
    bf16.plan.element_size = 2;
    const SpmdInfo half = InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[[0,1],-1]"), kAttrs, bf16);
    EXPECT_EQ(half.internal[1].bytes_per_rank, 128);
    EXPECT_EQ(half.internal[0].bytes_per_rank, 16) << "the counts stay int64";
}

// cost mode: the op's price is its exchange (the input already in place)
TEST(MoEDispatchTest, CostModePricesTheExchange) {
    RuleOptions cost;
    cost.mode = RuleMode::kCostBased;
    const SpmdInfo info = InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[[0,1],-1]"), kAttrs, cost);
    EXPECT_DOUBLE_EQ(info.cost_us, info.internal[0].cost_us + info.internal[1].cost_us);
    EXPECT_GT(info.cost_us, 2 * 63.9);
}

// ep_dim names another mesh dim; the rule cache tells meshes of one shape apart by where that name is
TEST(MoEDispatchTest, EpDimIsFoundByNameAndKeyedByIndex) {
    MoEDispatchAttrs attrs = kAttrs;
    attrs.ep_dim = "expert";
    const ProcessMesh a({2, 2}, {"expert", "data"});
    const ProcessMesh b({2, 2}, {"data", "expert"});
    const SpmdInfo on_a = InferMoEDispatchForward(a, T({kTokens, kHidden}, "[[0,1],-1]"), attrs);
    const SpmdInfo on_b = InferMoEDispatchForward(b, T({kTokens, kHidden}, "[[0,1],-1]"), attrs);
    EXPECT_EQ(S(on_a.outputs[0]), "[[0,1],-1]");
    EXPECT_EQ(S(on_b.outputs[0]), "[[1,0],-1]");
    const RuleKey ka(
        RuleRequest{.op = "moe_dispatch", .mesh = a, .inputs = {T({kTokens, kHidden}, "[0,-1]")}, .attrs = attrs});
    const RuleKey kb(
        RuleRequest{.op = "moe_dispatch", .mesh = b, .inputs = {T({kTokens, kHidden}, "[0,-1]")}, .attrs = attrs});
    EXPECT_FALSE(ka == kb);
    RuleCache cache;
    EXPECT_EQ(S(cache.GetOrInfer(ka)->info.outputs[0]), "[0,-1]") << "rows on 'expert' (mesh dim 0) already";
    EXPECT_EQ(S(cache.GetOrInfer(kb)->info.outputs[0]), "[[1,0],-1]");
}

void ExpectError(const std::function<void()> &fn, const std::string &expected) {
    try {
        fn();
        ADD_FAILURE() << "no error; expected: " << expected;
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
}

TEST(MoEDispatchTest, MeshWithoutTheEpDimIsAnError) {
    ExpectError(
        [] { InferMoEDispatchForward(ProcessMesh({2, 2}, {"dp", "tp"}), T({kTokens, kHidden}, "[0,-1]"), kAttrs); },
        "moe_dispatch: the mesh has no dim named 'ep' (ep_dim; its dims are [dp, tp])");
}

TEST(MoEDispatchTest, ExpertsNotDivisibleByEpIsAnError) {
    MoEDispatchAttrs attrs = kAttrs;
    attrs.num_experts = 6;
    ExpectError([&] { InferMoECombineForward(ProcessMesh({4}, {"ep"}), T({32, kHidden}, "[0,-1]"), attrs); },
                "moe_combine: num_experts (6) must be positive and divisible by the size of mesh dim 'ep' (4)");
}

TEST(MoEDispatchTest, HiddenShardedOnEpIsAnError) {
    ExpectError([] { InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[0,1]"), kAttrs); },
                "moe_dispatch: x's hidden dim must not be sharded on 'ep' (mesh dim 1)");
}

TEST(MoEDispatchTest, TopkOutOfRangeAndUnevenCombineRowsAreErrors) {
    MoEDispatchAttrs attrs = kAttrs;
    attrs.topk = 5;
    ExpectError([&] { InferMoEDispatchForward(kMesh, T({kTokens, kHidden}, "[0,-1]"), attrs); },
                "moe_dispatch: topk (5) must be in [1, num_experts] = [1, 4]");
    ExpectError([] { InferMoECombineForward(kMesh, T({kTokens + 1, kHidden}, "[1,-1]"), kAttrs); },
                "moe_combine: x's rows (17) must be tokens * topk (topk 2)");
    ExpectError(
        [] { InferMoEDispatchGrad(kMesh, T({kTokens, kHidden}, "[0,-1]"), T({kTokens, kHidden}, "[0,-1]"), kAttrs); },
        "moe_dispatch: out_grad must have the output's shape [32,8], got [16,8]");
}

TEST(MoEDispatchTest, InferRuleNeedsTheNumberOfExperts) {
    ExpectError([] { InferRule({.op = "moe_dispatch", .mesh = kMesh, .inputs = {T({kTokens, kHidden}, "[0,-1]")}}); },
                "moe_dispatch: num_experts (0) must be positive");
    ExpectError(
        [] {
            InferRule({.op = "moe_combine",
                       .mesh = kMesh,
                       .inputs = {T({kTokens, kHidden}, "[0,-1]")},
                       .attrs = LinearAttrs{}});
        },
        "moe_combine: attrs hold LinearAttrs");
}

} // namespace
} // namespace shardline::spmd
