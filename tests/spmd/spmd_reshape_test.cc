#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k4({4});
const ProcessMesh k2x2({2, 2});

// [b=8,s,h][0,-1,-1] -> [b*s, h][0,-1]
TEST(ReshapeTest, MergeKeepsMajorSharding) {
    const SpmdInfo info = InferReshapeForward(k4, T({8, 16, 32}, "[0,-1,-1]"), {128, 32});
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// [8,16,32][-1,0,-1] -> [128,32]: the minor dim of the run cannot stay sharded
TEST(ReshapeTest, MergeDropsMinorSharding) {
    const SpmdInfo info = InferReshapeForward(k4, T({8, 16, 32}, "[-1,0,-1]"), {128, 32});
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1]");
}

// [6,16][0,-1] on 4 ranks: 6 % 4 != 0, the chunks would not line up: dropped
TEST(ReshapeTest, UnevenMajorDimCannotStaySharded) {
    EXPECT_EQ(S(InferReshapeForward(k4, T({6, 16}, "[0,-1]"), {96}).outputs[0]), "[-1]");
}

// split [128,32][0,-1] -> [8,16,32][0,-1,-1]
TEST(ReshapeTest, SplitMovesShardingToMajorPart) {
    EXPECT_EQ(S(InferReshapeForward(k4, T({128, 32}, "[0,-1]"), {8, 16, 32}).outputs[0]), "[0,-1,-1]");
}

// split with -1: [128,32][-1,0] -> [128,4,8]: h=32 split to 4x8, h's sharding goes to 4
TEST(ReshapeTest, InferredDimAndHiddenSplit) {
    const SpmdInfo info = InferReshapeForward(k4, T({128, 32}, "[-1,0]"), {128, -1, 8});
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{128, 4, 8}));
    EXPECT_EQ(S(info.outputs[0]), "[-1,0,-1]");
}

// co-shard [[0,1],-1] over 2x2 on [8,4] -> [32]: 8 % 4 == 0 -> [[0,1]]
TEST(ReshapeTest, CoShardedMajorDim) {
    EXPECT_EQ(S(InferReshapeForward(k2x2, T({8, 4}, "[[0,1],-1]"), {32}).outputs[0]), "[[0,1]]");
}

// unit dims: [1,8][-1,0] -> [8] keeps the sharding
TEST(ReshapeTest, UnitDimsAreSkipped) {
    EXPECT_EQ(S(InferReshapeForward(k4, T({1, 8}, "[-1,0]"), {8}).outputs[0]), "[0]");
}

// partial passes
TEST(ReshapeTest, PartialPasses) {
    EXPECT_EQ(S(InferReshapeForward(k2x2, T({4, 4}, "[0,-1] partial{1}"), {16}).outputs[0]), "[0] partial{1}");
}

TEST(ReshapeTest, ElementCountMismatchIsAnError) {
    EXPECT_THROW(InferReshapeForward(k4, T({4, 4}, "[-1,-1]"), {15}), SpmdError);
    EXPECT_THROW(InferReshapeForward(k4, T({4, 4}, "[-1,-1]"), {-1, -1}), SpmdError);
    EXPECT_THROW(InferReshapeForward(k4, T({4, 4}, "[-1,-1]"), {3, -1}), SpmdError);
}

// reverse: [128,32][0,-1] from [8,16,32] -> x [0,-1,-1]
TEST(ReshapeTest, ReverseMapsBack) {
    const SpmdInfo info = InferReshapeReverse(k4, T({8, 16, 32}, "[-1,-1,-1]"), T({128, 32}, "[0,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[0,-1,-1]");
}

// grad: x_grad has the required x layout
TEST(ReshapeTest, GradFollowsInput) {
    const SpmdInfo info = InferReshapeGrad(k4, T({8, 16, 32}, "[0,-1,-1]"), T({128, 32}, "[0,-1]"), {128, 32});
    EXPECT_EQ(S(info.Input("out_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1,-1]");
}

} // namespace
} // namespace shardline::spmd
