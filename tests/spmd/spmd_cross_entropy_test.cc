#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh kTp({4});
const ProcessMesh kDpTp({2, 4});

// logits bv[-1,0] not vocab parallel: v gathered, loss b[-1]
TEST(CrossEntropyTest, ClassDimIsReplicatedByDefault) {
    const SpmdInfo info = InferCrossEntropyForward(kTp, T({8, 1000}, "[-1,0]"), T({8}, "[-1]"), {});
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1]");
    EXPECT_EQ(info.output_names[0], "loss");
}

// vocab parallel: logits [-1,0] stay, three internal all-reduces, loss replicated
TEST(CrossEntropyTest, VocabParallelKeepsClassShardingAndReplicatesLoss) {
    const SpmdInfo info =
        InferCrossEntropyForward(kTp, T({8, 1000}, "[-1,0]"), T({8}, "[-1]"), {.vocab_parallel = true});
    EXPECT_EQ(S(info.inputs[0]), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1]");
    ASSERT_EQ(info.internal.size(), 3u);
    EXPECT_EQ(info.internal[0].reduce_op, ReduceOp::kMax);
    EXPECT_EQ(info.internal[2].what, "target logit");
}

// dp x tp vocab parallel: logits [0,1], labels [0] -> loss [0]
TEST(CrossEntropyTest, DataParallelBatch) {
    const SpmdInfo info =
        InferCrossEntropyForward(kDpTp, T({8, 1000}, "[0,1]"), T({8}, "[-1]"), {.vocab_parallel = true});
    EXPECT_EQ(S(info.inputs[1]), "[0]");
    EXPECT_EQ(S(info.outputs[0]), "[0]");
}

// mean reduction: scalar P(sum) over dp
TEST(CrossEntropyTest, MeanLossIsPartialOverBatchMeshDims) {
    const SpmdInfo info = InferCrossEntropyForward(kDpTp, T({8, 1000}, "[0,1]"), T({8}, "[0]"),
                                                   {.reduction = LossReduction::kMean, .vocab_parallel = true});
    EXPECT_TRUE(info.outputs[0].shape.empty());
    EXPECT_EQ(S(info.outputs[0]), "[] partial{0}");
}

TEST(CrossEntropyTest, LabelShapeMismatchIsAnError) {
    EXPECT_THROW(InferCrossEntropyForward(kTp, T({8, 10}, "[-1,-1]"), T({7}, "[-1]"), {}), SpmdError);
}

// grad: logits grad in the logits layout, no reduction (Megatron's backward has no comm)
TEST(CrossEntropyTest, VocabParallelGradNeedsNoCommunication) {
    const SpmdInfo info =
        InferCrossEntropyGrad(kTp, T({8, 1000}, "[-1,0]"), T({8}, "[-1]"), T({8}, "[-1]"), {.vocab_parallel = true});
    EXPECT_EQ(info.output_names, std::vector<std::string>{"logits_grad"});
    EXPECT_EQ(S(info.Output("logits_grad")), "[-1,0]");
    EXPECT_EQ(S(info.Input("loss_grad")), "[-1]");
}

// grad of a mean loss: scalar replicated loss_grad
TEST(CrossEntropyTest, GradOfMeanLoss) {
    const SpmdInfo info = InferCrossEntropyGrad(kDpTp, T({8, 1000}, "[0,1]"), T({8}, "[0]"), T({}, "[]"),
                                                {.reduction = LossReduction::kMean, .vocab_parallel = true});
    EXPECT_EQ(S(info.Input("loss_grad")), "[]");
    EXPECT_EQ(S(info.Output("logits_grad")), "[0,1]");
}

// reverse: loss [0] -> logits [0,-1]
TEST(CrossEntropyTest, ReverseFromShardedLoss) {
    const SpmdInfo info = InferCrossEntropyReverse(kTp, T({8, 10}, "[-1,-1]"), T({8}, "[-1]"), T({8}, "[0]"), {});
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.inputs[1]), "[0]");
}

} // namespace
} // namespace shardline::spmd
