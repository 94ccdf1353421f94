#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x2({2, 2});

// softmax over b: ab[0,1] -> b must be replicated: ab[0,-1]
TEST(SoftmaxTest, AxisIsReplicated) {
    const SpmdInfo info = InferSoftmaxForward(k2x2, T({4, 8}, "[0,1]"), {.axis = -1});
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_TRUE(info.internal.empty());
}

// vocab parallel: ab[0,1] stays, internal all-reduce max and sum on mesh dim 1
TEST(SoftmaxTest, VocabParallelKeepsAxisShardedWithInternalAllReduces) {
    const SpmdInfo info = InferSoftmaxForward(k2x2, T({4, 8}, "[0,1]"), {.axis = 1, .vocab_parallel = true});
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
    ASSERT_EQ(info.internal.size(), 2u);
    EXPECT_EQ(info.internal[0].mesh_dim, 1);
    EXPECT_EQ(info.internal[0].reduce_op, ReduceOp::kMax);
    EXPECT_EQ(info.internal[1].reduce_op, ReduceOp::kSum);
}

// partial input is reduced
TEST(SoftmaxTest, PartialInputIsReduced) {
    EXPECT_EQ(S(InferSoftmaxForward(k2x2, T({4, 8}, "[0,-1] partial{1}"), {}).inputs[0]), "[0,-1]");
}

// log_softmax over axis 0
TEST(SoftmaxTest, LogSoftmaxOverAxisZero) {
    EXPECT_EQ(S(InferSoftmaxForward(k2x2, T({4, 8}, "[0,1]"), {.axis = 0, .log = true}).outputs[0]), "[-1,1]");
}

TEST(SoftmaxTest, BadAxisIsAnError) {
    EXPECT_THROW(InferSoftmaxForward(k2x2, T({4, 8}, "[0,1]"), {.axis = 2}), SpmdError);
}

// reverse: out [0,1] -> x [0,-1]
TEST(SoftmaxTest, ReverseDropsAxisSharding) {
    EXPECT_EQ(S(InferSoftmaxReverse(k2x2, T({4, 8}, "[-1,-1]"), T({4, 8}, "[0,1]"), {}).inputs[0]), "[0,-1]");
}

// grad: out and out_grad in the forward layout; vocab parallel backward all-reduces sum(dy*y)
TEST(SoftmaxTest, GradVocabParallel) {
    const SpmdInfo info =
        InferSoftmaxGrad(k2x2, T({4, 8}, "[0,1]"), T({4, 8}, "[0,1]"), {.axis = 1, .vocab_parallel = true});
    EXPECT_EQ(info.input_names[0], "out");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,1]");
    ASSERT_EQ(info.internal.size(), 1u);
    EXPECT_EQ(info.internal[0].reduce_op, ReduceOp::kSum);
}

} // namespace
} // namespace shardline::spmd
