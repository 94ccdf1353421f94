// RuleMode::kCostBased for grad and reverse rules (the forward enumeration is tested in spmd_einsum_test.cc and by
// the property tests, which also run every grad rule in cost mode on odd cases).

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;
using testing::S;
using testing::T;

RuleOptions Cost() {
    RuleOptions options;
    options.mode = RuleMode::kCostBased;
    return options;
}

TEST(CostModeTest, RowParallelGradNeedsNoCommunicationAndKeepsTheDeterministicAnswer) {
    // x[-1,0], W[-1,0], dy[-1,-1] -> dx[-1,0], dW[-1,0]: nothing moves, every alternative communicates
    const ProcessMesh mesh({4});
    const TensorSpec x = T({64, 32}, "[-1,0]");
    const TensorSpec w = T({48, 32}, "[-1,0]");
    const TensorSpec dy = T({64, 48}, "[-1,-1]");
    const SpmdInfo det = InferLinearGrad(mesh, x, w, std::nullopt, dy);
    const SpmdInfo cost = InferLinearGrad(mesh, x, w, std::nullopt, dy, Cost());
    EXPECT_EQ(cost.inputs, det.inputs);
    EXPECT_EQ(cost.outputs, det.outputs);
    EXPECT_EQ(S(cost.Output("x_grad")), "[-1,0]");
    EXPECT_EQ(S(cost.Output("weight_grad")), "[-1,0]");
    EXPECT_GT(cost.cost_us, 0.0);
    EXPECT_LT(cost.cost_us, 1.0); // compute only: no collective (each costs a 64 us call)
    EXPECT_EQ(det.cost_us, 0.0);
}

TEST(CostModeTest, GradPrefersShardingTheBatchOverMovingALargeActivation) {
    // x[0,-1] 8192x32, W[-1,0] 48x32, dy[0,-1]: deterministic gives k to the weight (all_to_all x, gather dy);
    // cost: batch on mesh 0 -> x[0,-1], W R (gather the small weight), dW P(sum) -> reduce_scatter to [-1,0]
    const ProcessMesh mesh({4});
    const TensorSpec x = T({8192, 32}, "[0,-1]");
    const TensorSpec w = T({48, 32}, "[-1,0]");
    const TensorSpec dy = T({8192, 48}, "[0,-1]");
    const SpmdInfo det = InferLinearGrad(mesh, x, w, std::nullopt, dy);
    EXPECT_EQ(S(det.Input("x")), "[-1,0]");
    EXPECT_EQ(S(det.Input("out_grad")), "[-1,-1]");
    const SpmdInfo cost = InferLinearGrad(mesh, x, w, std::nullopt, dy, Cost());
    EXPECT_EQ(S(cost.Input("x")), "[0,-1]");
    EXPECT_EQ(S(cost.Input("weight")), "[-1,-1]");
    EXPECT_EQ(S(cost.Input("out_grad")), "[0,-1]");
    EXPECT_EQ(S(cost.Output("x_grad")), "[0,-1]");
    EXPECT_EQ(S(cost.Output("weight_grad")), "[-1,-1] partial{0}");
    const RedistributePlan back = PlanRedistribute(mesh, {48, 32}, cost.Output("weight_grad").layout, w.layout);
    ASSERT_EQ(back.steps.size(), 1u);
    EXPECT_EQ(back.steps[0].collective, Collective::kReduceScatter);
}

TEST(CostModeTest, GradWithANonDifferentiableInputPricesOnlyTheTableGradient) {
    // embedding ids[0] (no grad), table[0,-1] (vocab-sharded), dy[0,-1]: the ids never get a gradient plan
    const ProcessMesh mesh({2});
    const SpmdInfo cost = InferEmbeddingGrad(mesh, T({16}, "[0]"), T({100, 8}, "[0,-1]"), T({16, 8}, "[0,-1]"), Cost());
    ASSERT_EQ(cost.output_names, std::vector<std::string>{"weight_grad"});
    EXPECT_GT(cost.cost_us, 0.0);
    // whatever it picks, the weight gradient must cover the table's shape
    EXPECT_EQ(cost.Output("weight_grad").shape, (std::vector<int64_t>{100, 8}));
}

TEST(CostModeTest, GradRejectsAnOutputTarget) {
    // output_target is a forward option
    RuleOptions options = Cost();
    options.output_target = L("[0,-1]");
    EXPECT_THROW(
        InferMatmulGrad(ProcessMesh({2}), T({4, 4}, "[0,-1]"), T({4, 4}, "[-1,-1]"), T({4, 4}, "[0,-1]"), {}, options),
        SpmdError);
}

TEST(CostModeTest, ReverseShardsTheComputeWhenComputeIsExpensive) {
    // out[0,-1] wanted, compute priced at 1 flop/us: m[0] is free (no output move); deterministic gives the same
    const ProcessMesh mesh({4});
    RuleOptions options = Cost();
    options.plan.cost.flops_per_us = 1.0;
    const SpmdInfo info =
        InferMatmulReverse(mesh, T({64, 64}, "[-1,-1]"), T({64, 64}, "[-1,-1]"), T({64, 64}, "[0,-1]"), {}, options);
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_NEAR(info.cost_us, 2.0 * 64 * 64 * 64 / 4, 1e-6);
}

TEST(CostModeTest, ReverseOfAReplicatedOutputShardsRowsAndGathersWhenComputeDominates) {
    // out[-1,-1] wanted; deterministic: all R (full compute on every rank); cost at 1 flop/us: m[0] + all_gather
    const ProcessMesh mesh({4});
    const TensorSpec x = T({64, 64}, "[-1,-1]");
    const TensorSpec out = T({64, 64}, "[-1,-1]");
    const SpmdInfo det = InferMatmulReverse(mesh, x, x, out);
    EXPECT_EQ(S(det.inputs[0]), "[-1,-1]");
    RuleOptions options = Cost();
    options.plan.cost.flops_per_us = 1.0;
    const SpmdInfo cost = InferMatmulReverse(mesh, x, x, out, {}, options);
    EXPECT_EQ(S(cost.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(cost.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(cost.outputs[0]), "[0,-1]");
    // default cost: compute is negligible, the deterministic (no collective) answer stays
    const SpmdInfo cheap = InferMatmulReverse(mesh, x, x, out, {}, Cost());
    EXPECT_EQ(cheap.inputs, det.inputs);
    EXPECT_EQ(cheap.outputs, det.outputs);
}

TEST(CostModeTest, ReverseRejectsAnOutputTarget) {
    // the given output is the reverse rule's target
    RuleOptions options = Cost();
    options.output_target = L("[0,-1]");
    EXPECT_THROW(InferMatmulReverse(ProcessMesh({2}), T({4, 4}, "[-1,-1]"), T({4, 4}, "[-1,-1]"), T({4, 4}, "[0,-1]"),
                                    {}, options),
                 SpmdError);
}

TEST(CostModeTest, ReshapeAnswersDeterministicallyInCostMode) {
    // [8,6][0,-1] -> [48]: the documented fallback, identical answers
    const ProcessMesh mesh({2});
    const TensorSpec x = T({8, 6}, "[0,-1]");
    const SpmdInfo det = InferReshapeForward(mesh, x, {48});
    const SpmdInfo cost = InferReshapeForward(mesh, x, {48}, Cost());
    EXPECT_EQ(cost.inputs, det.inputs);
    EXPECT_EQ(cost.outputs, det.outputs);
    EXPECT_EQ(S(cost.outputs[0]), "[0]");
}

} // namespace
} // namespace shardline::spmd
