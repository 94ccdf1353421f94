#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x2({2, 2});

SpmdInfo Fwd(const std::string &op, const std::vector<TensorSpec> &in) { return InferElementwiseForward(k2x2, op, in); }

// ab[0,1] + ab[-1,-1] -> ab[0,1], y sliced
TEST(ElementwiseTest, AddFollowsShardedOperand) {
    const SpmdInfo info = Fwd("add", {T({4, 6}, "[0,1]"), T({4, 6}, "[-1,-1]")});
    EXPECT_EQ(S(info.inputs[1]), "[0,1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// ab[0,-1] + b[1] -> ab[0,1]
TEST(ElementwiseTest, RankBroadcastMergesShardings) {
    const SpmdInfo info = Fwd("add", {T({4, 6}, "[0,-1]"), T({6}, "[1]")});
    EXPECT_EQ(S(info.inputs[0]), "[0,1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// ab[0,-1] * 1b[-1,-1] -> the size-1 dim stays replicated
TEST(ElementwiseTest, SizeOneBroadcastDimStaysReplicated) {
    const SpmdInfo info = Fwd("multiply", {T({4, 6}, "[0,-1]"), T({1, 6}, "[-1,-1]")});
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{4, 6}));
}

// ab[0,-1] + ab[1,-1]: conflict on label a; x wins, y's mesh dim 1 is dropped
TEST(ElementwiseTest, ConflictGoesToFirstOperand) {
    const SpmdInfo info = Fwd("add", {T({4, 6}, "[0,-1]"), T({4, 6}, "[1,-1]")});
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// partial{0} + partial{0} -> partial{0}
TEST(ElementwiseTest, AddOfTwoPartialsStaysPartial) {
    const SpmdInfo info = Fwd("add", {T({4}, "[-1] partial{0}"), T({4}, "[-1] partial{0}")});
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0}");
}

// partial{0} + R -> R partialized, partial{0}
TEST(ElementwiseTest, AddOfPartialAndReplicatePartializes) {
    const SpmdInfo info = Fwd("subtract", {T({4}, "[-1] partial{0}"), T({4}, "[-1]")});
    EXPECT_EQ(S(info.inputs[1]), "[-1] partial{0}");
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0}");
}

// partial{0:sum} + partial{0:max} -> both reduced
TEST(ElementwiseTest, AddOfMixedPartialsReducesBoth) {
    const SpmdInfo info = Fwd("add", {T({4}, "[-1] partial{0}"), T({4}, "[-1] partial{0:max}")});
    EXPECT_EQ(S(info.inputs[0]), "[-1]");
    EXPECT_EQ(S(info.inputs[1]), "[-1]");
}

// partial{0} * R -> partial{0}
TEST(ElementwiseTest, MultiplyIsLinearInOneOperand) {
    const SpmdInfo info = Fwd("multiply", {T({4}, "[-1]"), T({4}, "[-1] partial{0}")});
    EXPECT_EQ(S(info.inputs[0]), "[-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0}");
}

// R / partial{0} -> the denominator is reduced
TEST(ElementwiseTest, DivideIsNotLinearInTheDenominator) {
    const SpmdInfo info = Fwd("divide", {T({4}, "[-1]"), T({4}, "[-1] partial{0}")});
    EXPECT_EQ(S(info.inputs[1]), "[-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1]");
}

// partial{0} / R -> partial{0}
TEST(ElementwiseTest, DivideIsLinearInTheNumerator) {
    EXPECT_EQ(S(Fwd("divide", {T({4}, "[-1] partial{0}"), T({4}, "[-1]")}).outputs[0]), "[-1] partial{0}");
}

// maximum(P, S): the sharding claims mesh dim 0, x is reduce-scattered onto it
TEST(ElementwiseTest, MaximumReducesPartials) {
    const SpmdInfo info = Fwd("maximum", {T({4}, "[-1] partial{0}"), T({4}, "[0]")});
    EXPECT_EQ(S(info.inputs[0]), "[0]");
    EXPECT_EQ(S(info.outputs[0]), "[0]");
    EXPECT_EQ(S(Fwd("maximum", {T({4}, "[-1] partial{1}"), T({4}, "[-1]")}).outputs[0]), "[-1]");
}

// relu(partial{0:max}) -> partial{0:max} (monotone)
TEST(ElementwiseTest, ReluKeepsMaxPartial) {
    EXPECT_EQ(S(Fwd("relu", {T({4}, "[-1] partial{0:max}")}).outputs[0]), "[-1] partial{0:max}");
}

// relu(partial{0:sum}) -> reduced
TEST(ElementwiseTest, ReluReducesSumPartial) {
    EXPECT_EQ(S(Fwd("relu", {T({4}, "[-1] partial{0}")}).inputs[0]), "[-1]");
}

// gelu(partial{0:max}) -> reduced (gelu is not monotone)
TEST(ElementwiseTest, GeluReducesEveryPartial) {
    EXPECT_EQ(S(Fwd("gelu", {T({4}, "[1] partial{0:max}")}).outputs[0]), "[1]");
}

// neg(partial{0}) -> partial{0}
TEST(ElementwiseTest, NegKeepsSumPartial) {
    EXPECT_EQ(S(Fwd("neg", {T({4}, "[1] partial{0}")}).outputs[0]), "[1] partial{0}");
}

// unary keeps the sharding
TEST(ElementwiseTest, UnaryKeepsSharding) {
    EXPECT_EQ(S(Fwd("gelu", {T({4, 8}, "[[1,0],-1]")}).outputs[0]), "[[1,0],-1]");
}

TEST(ElementwiseTest, UnknownOpAndArityAreErrors) {
    EXPECT_THROW(Fwd("frobnicate", {T({4}, "[-1]")}), SpmdError);
    EXPECT_THROW(Fwd("add", {T({4}, "[-1]")}), SpmdError);
    EXPECT_THROW(Fwd("add", {T({4}, "[-1]"), T({5}, "[-1]")}), SpmdError);
}

// reverse: ab[0,1] -> x ab[0,1], y b[1]
TEST(ElementwiseTest, ReverseWithRankBroadcast) {
    const SpmdInfo info =
        InferElementwiseReverse(k2x2, "add", {T({4, 6}, "[-1,-1]"), T({6}, "[-1]")}, T({4, 6}, "[0,1]"));
    EXPECT_EQ(S(info.inputs[0]), "[0,1]");
    EXPECT_EQ(S(info.inputs[1]), "[1]");
}

// reverse: partial{0} from add -> both inputs partial
TEST(ElementwiseTest, ReversePartialOfAddGoesToBoth) {
    const SpmdInfo info =
        InferElementwiseReverse(k2x2, "add", {T({4}, "[-1]"), T({4}, "[-1]")}, T({4}, "[-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[0]), "[-1] partial{0}");
    EXPECT_EQ(S(info.inputs[1]), "[-1] partial{0}");
}

// grad of add with broadcast: db of b[6] vs ab[0,1] -> b[1] partial{0}
TEST(ElementwiseTest, GradOfBroadcastAddIsPartialOverTheBroadcastDim) {
    const SpmdInfo info = InferElementwiseGrad(k2x2, "add", {T({4, 6}, "[0,1]"), T({6}, "[1]")}, T({4, 6}, "[0,1]"));
    EXPECT_EQ(S(info.Output("x_grad")), "[0,1]");
    EXPECT_EQ(S(info.Output("y_grad")), "[1] partial{0}");
}

// grad of multiply with a size-1 dim: y [1,6] -> partial over a's mesh dim
TEST(ElementwiseTest, GradOfSizeOneBroadcastMultiply) {
    const SpmdInfo info =
        InferElementwiseGrad(k2x2, "multiply", {T({4, 6}, "[0,-1]"), T({1, 6}, "[-1,-1]")}, T({4, 6}, "[0,-1]"));
    EXPECT_EQ(S(info.Output("y_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1]");
}

// grad of a unary op
TEST(ElementwiseTest, GradOfUnary) {
    const SpmdInfo info = InferElementwiseGrad(k2x2, "relu", {T({4, 6}, "[0,1]")}, T({4, 6}, "[0,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[0,1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,1]");
}

} // namespace
} // namespace shardline::spmd
