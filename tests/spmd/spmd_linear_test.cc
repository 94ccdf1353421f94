// linear rules, and DESIGN.md §6: the Megatron column / row parallel communication table asserted row by row
// through the rules plus the redistribute planner (mesh [tp=4], or [dp=2, tp=4]).
// Notation: x[...] w[...] b[...] -> y[...]; labels: x "mk", weight "nk", bias "n", y "mn".

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;
using testing::S;
using testing::T;

const ProcessMesh kTp({4}, {"tp"});
const ProcessMesh kDpTp({2, 4}, {"dp", "tp"});
constexpr int64_t kSeq = 64; // tokens (batch * sequence)
constexpr int64_t kIn = 32;
constexpr int64_t kOut = 48;

std::vector<Collective> Collectives(const RedistributePlan &plan) {
    std::vector<Collective> out;
    for (const auto &s : plan.steps) {
        out.push_back(s.collective);
    }
    return out;
}

// ---- forward -------------------------------------------------------------------------------------------------------

// x[-1,-1], w[0,-1], b[0] -> y[-1,0]  (column parallel)
TEST(LinearTest, ColumnParallelForwardShardsOutputOnOutFeatures) {
    const SpmdInfo info =
        InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[0,-1]");
    EXPECT_EQ(S(info.Input("bias")), "[0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{kSeq, kOut}));
    EXPECT_FALSE(info.bias_after_reduction);
}

// x[-1,0], w[-1,0], b[-1] -> y[-1,-1] partial{0}, bias after the reduction  (row parallel)
TEST(LinearTest, RowParallelForwardGivesPartialOutputAndBiasAfterReduction) {
    const SpmdInfo info =
        InferLinearForward(kTp, T({kSeq, kIn}, "[-1,0]"), T({kOut, kIn}, "[-1,0]"), T({kOut}, "[-1]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_TRUE(info.bias_after_reduction);
}

// x[-1,0], w[-1,0] -> y[-1,-1] partial{0}; no bias: nothing to add
TEST(LinearTest, RowParallelWithoutBiasHasNoBiasAfterReduction) {
    const SpmdInfo info = InferLinearForward(kTp, T({kSeq, kIn}, "[-1,0]"), T({kOut, kIn}, "[-1,0]"), std::nullopt);
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_FALSE(info.bias_after_reduction);
    EXPECT_EQ(info.inputs.size(), 2u);
}

// x[0,-1] (sequence parallel), w[0,-1] -> x required [-1,-1] (weight wins tp), y[-1,0]
TEST(LinearTest, WeightWinsConflictSoSequenceParallelInputIsGathered) {
    const SpmdInfo info = InferLinearForward(kTp, T({kSeq, kIn}, "[0,-1]"), T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
}

// x[0,-1], w[-1,-1] -> y[0,-1]  (data parallel: the activation's batch sharding is kept)
TEST(LinearTest, ReplicatedWeightKeepsBatchSharding) {
    const SpmdInfo info = InferLinearForward(kTp, T({kSeq, kIn}, "[0,-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt);
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// x[-1,-1,-1] (3-D x [b,s,in]), w[0,-1] -> y[-1,-1,0]
TEST(LinearTest, BatchedInputKeepsLeadingDims) {
    const SpmdInfo info =
        InferLinearForward(kTp, T({2, 32, kIn}, "[-1,-1,-1]"), T({kOut, kIn}, "[0,-1]"), std::nullopt);
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,0]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{2, 32, kOut}));
}

// dp x tp: x[0,-1], w[1,-1], b[1] -> y[0,1]
TEST(LinearTest, DataTimesTensorParallelForward) {
    const SpmdInfo info =
        InferLinearForward(kDpTp, T({kSeq, kIn}, "[0,-1]"), T({kOut, kIn}, "[1,-1]"), T({kOut}, "[1]"));
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// x[-1,-1] partial{0}, w[-1,-1] -> y[-1,-1] partial{0}: linear in x, the Partial passes, bias after
TEST(LinearTest, PartialInputPassesToOutput) {
    const SpmdInfo info =
        InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1] partial{0}"), T({kOut, kIn}, "[-1,-1]"), T({kOut}, "[-1]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_TRUE(info.bias_after_reduction);
}

// b[-1] partial{0}: a Partial bias is reduced first (the bias is not a linear operand)
TEST(LinearTest, PartialBiasIsResolved) {
    const SpmdInfo info =
        InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), T({kOut}, "[-1] partial{0}"));
    EXPECT_EQ(S(info.Input("bias")), "[-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1]");
}

// w[-1,0] but x[-1,-1]: x is sliced (free) to [-1,0]; y partial{0}
TEST(LinearTest, RowParallelWeightSlicesReplicatedInput) {
    const SpmdInfo info = InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,0]"), std::nullopt);
    EXPECT_EQ(S(info.Input("x")), "[-1,0]");
    const RedistributePlan plan = PlanRedistribute(kTp, {kSeq, kIn}, L("[-1,-1]"), info.Input("x").layout);
    EXPECT_EQ(Collectives(plan), std::vector<Collective>{Collective::kLocalSlice});
    EXPECT_EQ(plan.bytes_per_rank, 0);
}

// reverse: y[-1,0] -> x[-1,-1], w[0,-1], b[0]
TEST(LinearTest, ReverseFromColumnShardedOutput) {
    const SpmdInfo info = InferLinearReverse(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"),
                                             T({kOut}, "[-1]"), T({kSeq, kOut}, "[-1,0]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[0,-1]");
    EXPECT_EQ(S(info.Input("bias")), "[0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
}

// reverse: y[-1,-1] partial{0} -> x[-1,0], w[-1,0] (the contracted in_features)
TEST(LinearTest, ReverseFromPartialOutputShardsInFeatures) {
    const SpmdInfo info = InferLinearReverse(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt,
                                             T({kSeq, kOut}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.Input("x")), "[-1,0]");
    EXPECT_EQ(S(info.Input("weight")), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// errors: in_features mismatch, bias size, weight rank
TEST(LinearTest, MismatchedInFeaturesIsAnErrorNamingBothSizes) {
    try {
        InferLinearForward(kTp, T({kSeq, 31}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt);
        FAIL() << "expected SpmdError";
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("x.shape[-1] (31) must equal weight.shape[1] (in_features, 32)"),
                  std::string::npos)
            << e.what();
    }
}

TEST(LinearTest, WrongBiasShapeIsAnError) {
    EXPECT_THROW(InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), T({kIn}, "[-1]")),
                 SpmdError);
}

TEST(LinearTest, WeightMustBeTwoDimensional) {
    EXPECT_THROW(InferLinearForward(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kIn}, "[-1]"), std::nullopt), SpmdError);
}

TEST(LinearTest, LayoutWithWrongRankIsAnError) {
    EXPECT_THROW(InferLinearForward(kTp, T({kSeq, kIn}, "[-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt), SpmdError);
}

// ---- grad ----------------------------------------------------------------------------------------------------------

// column parallel grad: x[-1,-1], w[0,-1], b[0], dy[-1,0] -> dx[-1,-1] partial{0}, dw[0,-1], db[0]
TEST(LinearTest, ColumnParallelGradLayouts) {
    const SpmdInfo info = InferLinearGrad(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"),
                                          T({kSeq, kOut}, "[-1,0]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[-1,0]");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("weight_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("bias_grad")), "[0]");
}

// row parallel grad: x[-1,0], w[-1,0], b[-1], dy[-1,-1] -> dx[-1,0], dw[-1,0], db[-1]
TEST(LinearTest, RowParallelGradLayoutsNeedNoReduction) {
    const SpmdInfo info = InferLinearGrad(kTp, T({kSeq, kIn}, "[-1,0]"), T({kOut, kIn}, "[-1,0]"), T({kOut}, "[-1]"),
                                          T({kSeq, kOut}, "[-1,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[-1,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,0]");
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,0]");
    EXPECT_EQ(S(info.Output("bias_grad")), "[-1]"); // not Partial although in_features is sharded
}

// dp x tp: x[0,-1], w[1,-1], b[1], dy[0,1] -> dw[1,-1] partial{0}, db[1] partial{0}, dx[0,-1] partial{1}
TEST(LinearTest, DataParallelWeightGradIsPartialOverDp) {
    const SpmdInfo info = InferLinearGrad(kDpTp, T({kSeq, kIn}, "[0,-1]"), T({kOut, kIn}, "[1,-1]"), T({kOut}, "[1]"),
                                          T({kSeq, kOut}, "[0,1]"));
    EXPECT_EQ(S(info.Output("weight_grad")), "[1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("bias_grad")), "[1] partial{0}");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1] partial{1}");
}

// dy[0,-1] on a replicated layer: the output gradient may shard a label no input claims -> dx[0,-1], dw partial{0}
TEST(LinearTest, OutputGradShardsUnclaimedBatchLabel) {
    const SpmdInfo info = InferLinearGrad(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt,
                                          T({kSeq, kOut}, "[0,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Input("x")), "[0,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,-1] partial{0}");
}

// dy[-1,-1] partial{0} on a replicated layer: the Partial passes to every grad
TEST(LinearTest, PartialOutputGradPassesToAllGrads) {
    const SpmdInfo info = InferLinearGrad(kTp, T({kSeq, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), T({kOut}, "[-1]"),
                                          T({kSeq, kOut}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.Input("out_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("bias_grad")), "[-1] partial{0}");
}

// ---- DESIGN.md §6: the Megatron table, rule + planner --------------------------------------------------------------

// Row 1. ColumnParallelLinear, input replicated: forward none; backward all-reduce dX only (to the input's layout).
TEST(MegatronTableTest, ColumnParallelReplicatedInput) {
    const auto x = T({kSeq, kIn}, "[-1,-1]");
    const SpmdInfo fwd = InferLinearForward(kTp, x, T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"));
    EXPECT_EQ(PlanRedistribute(kTp, x.shape, x.layout, fwd.Input("x").layout).steps.size(), 0u);
    const SpmdInfo grad = InferLinearGrad(kTp, x, T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"), fwd.outputs[0]);
    EXPECT_EQ(
        PlanRedistribute(kTp, fwd.outputs[0].shape, fwd.outputs[0].layout, grad.Input("out_grad").layout).steps.size(),
        0u);
    const RedistributePlan dx = PlanRedistribute(kTp, x.shape, grad.Output("x_grad").layout, x.layout);
    ASSERT_EQ(Collectives(dx), std::vector<Collective>{Collective::kAllReduce});
    EXPECT_EQ(dx.steps[0].mesh_dim, 0);
    // ring all-reduce of 64x32 fp32 over 4 ranks: 2 * 3 * (8192 / 4) bytes
    EXPECT_EQ(dx.steps[0].bytes_per_rank, 2 * 3 * (kSeq * kIn * 4 / 4));
    // weight and bias grads arrive in the parameters' own layouts: no communication.
    EXPECT_EQ(grad.Output("weight_grad").layout, L("[0,-1]"));
    EXPECT_EQ(grad.Output("bias_grad").layout, L("[0]"));
}

// Row 2. ColumnParallelLinear, sequence parallel: all-gather the input; backward reduce-scatter dX.
TEST(MegatronTableTest, ColumnParallelSequenceParallel) {
    const auto x = T({kSeq, kIn}, "[0,-1]");
    const auto w = T({kOut, kIn}, "[0,-1]");
    const SpmdInfo fwd = InferLinearForward(kTp, x, w, T({kOut}, "[0]"));
    const RedistributePlan gather = PlanRedistribute(kTp, x.shape, x.layout, fwd.Input("x").layout);
    ASSERT_EQ(Collectives(gather), std::vector<Collective>{Collective::kAllGather});
    EXPECT_EQ(gather.steps[0].tensor_dim, 0);
    EXPECT_EQ(gather.steps[0].bytes_per_rank, 3 * (kSeq / 4) * kIn * 4);
    EXPECT_EQ(S(fwd.outputs[0]), "[-1,0]");
    const SpmdInfo grad = InferLinearGrad(kTp, x, w, T({kOut}, "[0]"), fwd.outputs[0]);
    const RedistributePlan dx = PlanRedistribute(kTp, x.shape, grad.Output("x_grad").layout, x.layout);
    ASSERT_EQ(Collectives(dx), std::vector<Collective>{Collective::kReduceScatter});
    EXPECT_EQ(dx.steps[0].tensor_dim, 0);
    EXPECT_EQ(dx.steps[0].bytes_per_rank, 3 * (kSeq / 4) * kIn * 4);
}

// Row 3. ColumnParallelLinear, gather_output: + all-gather of Y; backward + a free slice of dY.
TEST(MegatronTableTest, ColumnParallelGatherOutput) {
    const auto x = T({kSeq, kIn}, "[-1,-1]");
    const SpmdInfo fwd = InferLinearForward(kTp, x, T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"));
    const RedistributePlan gather = PlanRedistribute(kTp, {kSeq, kOut}, fwd.outputs[0].layout, L("[-1,-1]"));
    ASSERT_EQ(Collectives(gather), std::vector<Collective>{Collective::kAllGather});
    EXPECT_EQ(gather.steps[0].tensor_dim, 1);
    // dY arrives replicated (the gathered output's gradient)
    const SpmdInfo grad =
        InferLinearGrad(kTp, x, T({kOut, kIn}, "[0,-1]"), T({kOut}, "[0]"), T({kSeq, kOut}, "[-1,-1]"));
    EXPECT_EQ(S(grad.Input("out_grad")), "[-1,0]");
    const RedistributePlan slice = PlanRedistribute(kTp, {kSeq, kOut}, L("[-1,-1]"), grad.Input("out_grad").layout);
    ASSERT_EQ(Collectives(slice), std::vector<Collective>{Collective::kLocalSlice});
    EXPECT_EQ(slice.cost_us, 0.0);
    const RedistributePlan dx = PlanRedistribute(kTp, x.shape, grad.Output("x_grad").layout, x.layout);
    EXPECT_EQ(Collectives(dx), std::vector<Collective>{Collective::kAllReduce});
}

// Row 4. RowParallelLinear, input_is_parallel: all-reduce Y then + bias once; backward none.
TEST(MegatronTableTest, RowParallelInputIsParallel) {
    const auto x = T({kSeq, kIn}, "[-1,0]");
    const auto w = T({kOut, kIn}, "[-1,0]");
    const auto b = T({kOut}, "[-1]");
    const SpmdInfo fwd = InferLinearForward(kTp, x, w, b);
    EXPECT_TRUE(fwd.bias_after_reduction);
    const RedistributePlan reduce = PlanRedistribute(kTp, {kSeq, kOut}, fwd.outputs[0].layout, L("[-1,-1]"));
    ASSERT_EQ(Collectives(reduce), std::vector<Collective>{Collective::kAllReduce});
    const SpmdInfo grad = InferLinearGrad(kTp, x, w, b, T({kSeq, kOut}, "[-1,-1]"));
    EXPECT_EQ(PlanRedistribute(kTp, {kSeq, kOut}, L("[-1,-1]"), grad.Input("out_grad").layout).steps.size(), 0u);
    EXPECT_EQ(PlanRedistribute(kTp, x.shape, grad.Output("x_grad").layout, x.layout).steps.size(), 0u);
    EXPECT_EQ(PlanRedistribute(kTp, w.shape, grad.Output("weight_grad").layout, w.layout).steps.size(), 0u);
    EXPECT_EQ(PlanRedistribute(kTp, b.shape, grad.Output("bias_grad").layout, b.layout).steps.size(), 0u);
}

// Row 5. RowParallelLinear, sequence parallel: reduce-scatter Y on seq, then + bias; backward all-gather dY.
TEST(MegatronTableTest, RowParallelSequenceParallel) {
    const auto x = T({kSeq, kIn}, "[-1,0]");
    const auto w = T({kOut, kIn}, "[-1,0]");
    const auto b = T({kOut}, "[-1]");
    const SpmdInfo fwd = InferLinearForward(kTp, x, w, b);
    const RedistributePlan rs = PlanRedistribute(kTp, {kSeq, kOut}, fwd.outputs[0].layout, L("[0,-1]"));
    ASSERT_EQ(Collectives(rs), std::vector<Collective>{Collective::kReduceScatter});
    EXPECT_EQ(rs.steps[0].tensor_dim, 0);
    EXPECT_EQ(rs.steps[0].bytes_per_rank, 3 * (kSeq / 4) * kOut * 4);
    // backward: dY arrives sharded on seq; the rule wants it replicated (tp is claimed by in_features)
    const SpmdInfo grad = InferLinearGrad(kTp, x, w, b, T({kSeq, kOut}, "[0,-1]"));
    EXPECT_EQ(S(grad.Input("out_grad")), "[-1,-1]");
    const RedistributePlan ag = PlanRedistribute(kTp, {kSeq, kOut}, L("[0,-1]"), grad.Input("out_grad").layout);
    ASSERT_EQ(Collectives(ag), std::vector<Collective>{Collective::kAllGather});
    EXPECT_EQ(PlanRedistribute(kTp, x.shape, grad.Output("x_grad").layout, x.layout).steps.size(), 0u);
}

// Row 6. Any parameter on dp x tp: all-reduce of its grad over dp (only dp).
TEST(MegatronTableTest, ParameterGradsAllReduceOverDpOnly) {
    const auto x = T({kSeq, kIn}, "[0,-1]");
    const auto w = T({kOut, kIn}, "[1,-1]");
    const auto b = T({kOut}, "[1]");
    const SpmdInfo fwd = InferLinearForward(kDpTp, x, w, b);
    const SpmdInfo grad = InferLinearGrad(kDpTp, x, w, b, fwd.outputs[0]);
    const RedistributePlan dw = PlanRedistribute(kDpTp, w.shape, grad.Output("weight_grad").layout, w.layout);
    ASSERT_EQ(Collectives(dw), std::vector<Collective>{Collective::kAllReduce});
    EXPECT_EQ(dw.steps[0].mesh_dim, 0);
    // local dW is [48/4, 32] fp32 = 1536 bytes; ring over dp=2: 2 * 1 * 768
    EXPECT_EQ(dw.steps[0].bytes_per_rank, 2 * 1 * (kOut / 4 * kIn * 4 / 2));
    const RedistributePlan db = PlanRedistribute(kDpTp, b.shape, grad.Output("bias_grad").layout, b.layout);
    ASSERT_EQ(Collectives(db), std::vector<Collective>{Collective::kAllReduce});
    EXPECT_EQ(db.steps[0].mesh_dim, 0);
    // and the row-parallel weight on the same mesh
    const auto w2 = T({kOut, kIn}, "[-1,1]");
    const SpmdInfo fwd2 = InferLinearForward(kDpTp, T({kSeq, kIn}, "[0,1]"), w2, T({kOut}, "[-1]"));
    const SpmdInfo grad2 =
        InferLinearGrad(kDpTp, T({kSeq, kIn}, "[0,1]"), w2, T({kOut}, "[-1]"), {fwd2.outputs[0].shape, L("[0,-1]")});
    const RedistributePlan dw2 = PlanRedistribute(kDpTp, w2.shape, grad2.Output("weight_grad").layout, w2.layout);
    ASSERT_EQ(Collectives(dw2), std::vector<Collective>{Collective::kAllReduce});
    EXPECT_EQ(dw2.steps[0].mesh_dim, 0);
}

} // namespace
} // namespace shardline::spmd
