// matmul rules. Notation: x labels, y labels -> out labels with [dims_mapping] partial{mesh dims}.

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x3({2, 3});
const ProcessMesh k4({4});

SpmdInfo Fwd(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, MatmulAttrs attrs = {}) {
    return InferMatmulForward(mesh, x, y, attrs);
}

// mk[1,0], kn[0,-1] -> mn[1,-1] partial{0}
TEST(MatmulTest, ShardedContractionGivesPartial) {
    const SpmdInfo info = Fwd(k2x3, T({64, 32}, "[1,0]"), T({32, 16}, "[0,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[1,0]");
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[1,-1] partial{0}");
}

// mk[0,-1], kn[-1,1] -> mn[0,1]
TEST(MatmulTest, FreeDimsOnDifferentMeshDims) {
    EXPECT_EQ(S(Fwd(k2x3, T({64, 32}, "[0,-1]"), T({32, 16}, "[-1,1]")).outputs[0]), "[0,1]");
}

// mk[0,-1], kn[-1,0] -> x wins mesh dim 0: mn[0,-1], y required [-1,-1]
TEST(MatmulTest, ConflictOnOneMeshDimGoesToFirstOperand) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[0,-1]"), T({32, 16}, "[-1,0]"));
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// mk[-1,0], kn[-1,-1] -> y sliced on k: kn[0,-1], mn[-1,-1] partial{0}
TEST(MatmulTest, ContractedShardingPropagatesToOtherOperand) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,0]"), T({32, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// mk[-1,-1], kn[0,-1] -> x sliced on k
TEST(MatmulTest, SecondOperandShardsUnclaimedContraction) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1]"), T({32, 16}, "[0,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// mk[[0,1],-1], kn[-1,-1] -> mn[[0,1],-1]
TEST(MatmulTest, CoShardedRowsStayCoSharded) {
    EXPECT_EQ(S(Fwd(k2x3, T({64, 32}, "[[0,1],-1]"), T({32, 16}, "[-1,-1]")).outputs[0]), "[[0,1],-1]");
}

// mk[[1,0],-1] keeps the order major->minor
TEST(MatmulTest, CoShardOrderIsKept) {
    EXPECT_EQ(S(Fwd(k2x3, T({64, 32}, "[[1,0],-1]"), T({32, 16}, "[-1,-1]")).outputs[0]), "[[1,0],-1]");
}

// mk[-1,[0,1]], kn[[0,1],-1] -> mn partial{0,1}
TEST(MatmulTest, CoShardedContractionIsPartialOnBoth) {
    EXPECT_EQ(S(Fwd(k2x3, T({64, 32}, "[-1,[0,1]]"), T({32, 16}, "[[0,1],-1]")).outputs[0]), "[-1,-1] partial{0,1}");
}

// km[0,-1] (trans_x), kn[-1,-1] -> x's k is sharded: partial{0}
TEST(MatmulTest, TransXSwapsLabels) {
    const SpmdInfo info = Fwd(k4, T({32, 64}, "[0,-1]"), T({32, 16}, "[-1,-1]"), {.trans_x = true});
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{64, 16}));
}

// mk[-1,-1], nk[0,-1] (trans_y) -> mn[-1,0]
TEST(MatmulTest, TransYSwapsLabels) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1]"), T({16, 32}, "[0,-1]"), {.trans_y = true});
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
}

// bmk[0,-1,-1], bkn[-1,-1,-1] -> bmn[0,-1,-1], y sliced on b
TEST(MatmulTest, BatchDimShardsBothOperands) {
    const SpmdInfo info = Fwd(k4, T({8, 64, 32}, "[0,-1,-1]"), T({8, 32, 16}, "[-1,-1,-1]"));
    EXPECT_EQ(S(info.inputs[1]), "[0,-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1,-1]");
}

// bmk[0,-1,-1] with a 2-D y kn: y broadcasts over b
TEST(MatmulTest, RankBroadcastBatch) {
    const SpmdInfo info = Fwd(k4, T({8, 64, 32}, "[0,-1,-1]"), T({32, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1,-1]");
}

// x [1,m,k] broadcasts against y [8,k,n] sharded on b: x's size-1 b is never sharded
TEST(MatmulTest, SizeOneBatchDimIsNeverSharded) {
    const SpmdInfo info = Fwd(k4, T({1, 64, 32}, "[-1,-1,-1]"), T({8, 32, 16}, "[0,-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1,-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{8, 64, 16}));
}

// x [1,m,k] with a layout sharding its size-1 dim: required replicated there
TEST(MatmulTest, ShardedSizeOneDimIsDropped) {
    const SpmdInfo info = Fwd(k4, T({1, 64, 32}, "[0,-1,-1]"), T({8, 32, 16}, "[-1,-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,-1]");
}

// 1-D x: k[0], kn[-1,-1] -> n[-1] partial{0}
TEST(MatmulTest, VectorTimesMatrix) {
    const SpmdInfo info = Fwd(k4, T({32}, "[0]"), T({32, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0}");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{16}));
}

// mk[0,-1], k[-1] -> m[0]
TEST(MatmulTest, MatrixTimesVector) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[0,-1]"), T({32}, "[-1]"));
    EXPECT_EQ(S(info.outputs[0]), "[0]");
}

// mk partial{0}, kn[-1,-1] -> mn partial{0}: linear in x
TEST(MatmulTest, PartialOperandPassesThrough) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1] partial{0}"), T({32, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// mk partial{0}, kn partial{0}: only x stays Partial, y is reduced
TEST(MatmulTest, TwoPartialOperandsOnOneMeshDimReduceTheSecond) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1] partial{0}"), T({32, 16}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
}

// mk partial{0:max}: max does not distribute over a product: reduced
TEST(MatmulTest, MaxPartialIsReduced) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1] partial{0:max}"), T({32, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1]");
}

// mk partial{0}, kn[0,-1]: the sharding wins mesh dim 0; x is reduce-scattered onto k
TEST(MatmulTest, ShardingWinsOverPartial) {
    const SpmdInfo info = Fwd(k4, T({64, 32}, "[-1,-1] partial{0}"), T({32, 16}, "[0,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// mk partial{0:avg} -> mn partial{0:avg}
TEST(MatmulTest, AvgPartialPassesThrough) {
    EXPECT_EQ(S(Fwd(k4, T({64, 32}, "[-1,-1] partial{0:avg}"), T({32, 16}, "[-1,-1]")).outputs[0]),
              "[-1,-1] partial{0:avg}");
}

// uneven sizes are fine: m=7 on 4 ranks
TEST(MatmulTest, UnevenShardsAreAllowed) {
    const SpmdInfo info = Fwd(k4, T({7, 5}, "[0,-1]"), T({5, 3}, "[-1,-1]"));
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_EQ(MaxLocalShape(k4, info.outputs[0].shape, info.outputs[0].layout), (std::vector<int64_t>{2, 3}));
}

// size-1 mesh dims canonicalize away
TEST(MatmulTest, SizeOneMeshDimIsReplicate) {
    const ProcessMesh mesh({1, 4});
    EXPECT_EQ(S(Fwd(mesh, T({64, 32}, "[0,1]"), T({32, 16}, "[1,-1]")).outputs[0]), "[-1,-1] partial{1}");
}

// 3-D mesh: bmk[0,1,2], bkn[0,2,-1] -> bmn[0,1,-1] partial{2}
TEST(MatmulTest, ThreeDimMesh) {
    const ProcessMesh mesh({2, 2, 2});
    EXPECT_EQ(S(Fwd(mesh, T({4, 8, 8}, "[0,1,2]"), T({4, 8, 8}, "[0,2,-1]")).outputs[0]), "[0,1,-1] partial{2}");
}

// errors
TEST(MatmulTest, ContractedSizeMismatchIsAnError) {
    try {
        Fwd(k4, T({64, 32}, "[-1,-1]"), T({16, 16}, "[-1,-1]"));
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("matmul: the contracted dim of x [64,32] (32) must equal that of y"),
                  std::string::npos)
            << e.what();
    }
}

TEST(MatmulTest, BatchMismatchIsAnError) {
    EXPECT_THROW(Fwd(k4, T({3, 4, 4}, "[-1,-1,-1]"), T({5, 4, 4}, "[-1,-1,-1]")), SpmdError);
}

TEST(MatmulTest, MeshDimOutOfRangeIsAnError) {
    EXPECT_THROW(Fwd(k4, T({4, 4}, "[1,-1]"), T({4, 4}, "[-1,-1]")), SpmdError);
}

TEST(MatmulTest, ScalarOperandIsAnError) { EXPECT_THROW(Fwd(k4, T({}, "[]"), T({4, 4}, "[-1,-1]")), SpmdError); }

// reverse: mn[0,1] -> mk[0,-1], kn[-1,1]
TEST(MatmulTest, ReverseFromShardedOutput) {
    const SpmdInfo info =
        InferMatmulReverse(k2x3, T({64, 32}, "[-1,-1]"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[0,1]"));
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.inputs[1]), "[-1,1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// reverse: mn[1,-1] partial{0} -> mk[1,0], kn[0,-1]
TEST(MatmulTest, ReverseFromPartialShardsContraction) {
    const SpmdInfo info =
        InferMatmulReverse(k2x3, T({64, 32}, "[-1,-1]"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[1,-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[0]), "[1,0]");
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
}

// reverse: mn partial{0:max} -> nothing produces a max: inputs replicated, output replicated
TEST(MatmulTest, ReverseFromMaxPartialGivesReplicate) {
    const SpmdInfo info =
        InferMatmulReverse(k4, T({64, 32}, "[-1,-1]"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[-1,-1] partial{0:max}"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1]");
}

// reverse ignores the given input layouts
TEST(MatmulTest, ReverseIgnoresInputLayouts) {
    const SpmdInfo info = InferMatmulReverse(k4, T({64, 32}, "[0,-1]"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[-1,0]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.inputs[1]), "[-1,0]");
}

// grad: mk[0,-1], kn[-1,-1], dy mn[0,-1] -> dx[0,-1], dy_y kn partial{0}
TEST(MatmulTest, GradOfRowShardedX) {
    const SpmdInfo info = InferMatmulGrad(k4, T({64, 32}, "[0,-1]"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[0,-1]"));
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("y_grad")), "[-1,-1] partial{0}");
}

// grad: mk[-1,0], kn[0,-1], dy mn[-1,-1] -> dx[-1,0], dy[0,-1] (partial forward output: grad replicated)
TEST(MatmulTest, GradOfContractionShardingNeedsNoReduction) {
    const SpmdInfo info = InferMatmulGrad(k4, T({64, 32}, "[-1,0]"), T({32, 16}, "[0,-1]"), T({64, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[-1,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,0]");
    EXPECT_EQ(S(info.Output("y_grad")), "[0,-1]");
}

// grad: mk[-1,-1], kn[-1,0], dy[-1,0] -> dx partial{0}, dy[-1,0]
TEST(MatmulTest, GradOfColumnShardedY) {
    const SpmdInfo info = InferMatmulGrad(k4, T({64, 32}, "[-1,-1]"), T({32, 16}, "[-1,0]"), T({64, 16}, "[-1,0]"));
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("y_grad")), "[-1,0]");
}

// grad with batch broadcast: x [1,m,k] vs y [8,k,n] on b: dx is Partial over b's mesh dim
TEST(MatmulTest, GradOfBroadcastBatchIsPartial) {
    const SpmdInfo info =
        InferMatmulGrad(k4, T({1, 8, 4}, "[-1,-1,-1]"), T({8, 4, 2}, "[0,-1,-1]"), T({8, 8, 2}, "[0,-1,-1]"));
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("y_grad")), "[0,-1,-1]");
}

// grad with x kept Partial: dx replicated, dy Partial
TEST(MatmulTest, GradOfPartialOperand) {
    const SpmdInfo info =
        InferMatmulGrad(k4, T({64, 32}, "[-1,-1] partial{0}"), T({32, 16}, "[-1,-1]"), T({64, 16}, "[-1,-1]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1]");
    EXPECT_EQ(S(info.Output("y_grad")), "[-1,-1] partial{0}");
}

// grad: out_grad shape mismatch is an error
TEST(MatmulTest, GradShapeMismatchIsAnError) {
    EXPECT_THROW(InferMatmulGrad(k4, T({64, 32}, "[-1,-1]"), T({32, 16}, "[-1,-1]"), T({64, 15}, "[-1,-1]")),
                 SpmdError);
}

// cost mode: x [4096, 32] S(m), w [32, 8] S(n) on 4 ranks: keeping x's rows is cheaper than gathering x
TEST(MatmulTest, CostModePicksCheapestStrategy) {
    RuleOptions options;
    options.mode = RuleMode::kCostBased;
    const SpmdInfo info = InferMatmulForward(k4, T({4096, 32}, "[0,-1]"), T({32, 8}, "[-1,0]"), {}, options);
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_GT(info.cost_us, 0.0);
    // deterministic mode gives the same here (x is first)
    EXPECT_EQ(S(Fwd(k4, T({4096, 32}, "[0,-1]"), T({32, 8}, "[-1,0]")).outputs[0]), "[0,-1]");
}

// cost mode: y [32, 4096] S(n) is big, x [8, 32] S(m) small: gathering x beats gathering y
TEST(MatmulTest, CostModeDisagreesWithDeterministicWhenCheaper) {
    RuleOptions options;
    options.mode = RuleMode::kCostBased;
    const auto x = T({8, 32}, "[0,-1]");
    const auto y = T({32, 4096}, "[-1,0]");
    EXPECT_EQ(S(Fwd(k4, x, y).outputs[0]), "[0,-1]");
    const SpmdInfo info = InferMatmulForward(k4, x, y, {}, options);
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
}

// cost mode with an output target [-1,0]: slicing y on n (free) lands the output there; deterministic keeps R
TEST(MatmulTest, CostModeHonoursOutputTarget) {
    RuleOptions options;
    options.mode = RuleMode::kCostBased;
    options.output_target = testing::L("[-1,0]");
    const auto x = T({64, 64}, "[-1,-1]");
    const auto y = T({64, 64}, "[-1,-1]");
    EXPECT_EQ(S(Fwd(k4, x, y).outputs[0]), "[-1,-1]");
    const SpmdInfo info = InferMatmulForward(k4, x, y, {}, options);
    EXPECT_EQ(S(info.inputs[1]), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
    EXPECT_DOUBLE_EQ(info.cost_us, 2.0 * 64 * 64 * 64 / 4 / options.plan.cost.flops_per_us); // compute only
}

} // namespace
} // namespace shardline::spmd
