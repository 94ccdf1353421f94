#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh kTp({4});
const ProcessMesh kDpTp({2, 4});

// ids bs[-1,-1], weight vh[0,-1] (vocab parallel) -> bsh[-1,-1,-1] partial{0}
TEST(EmbeddingTest, VocabParallelTableGivesPartialOutput) {
    const SpmdInfo info = InferEmbeddingForward(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[0,-1]"));
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,-1] partial{0}");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{2, 8, 64}));
}

// weight vh[-1,0] -> bsh[-1,-1,0]
TEST(EmbeddingTest, HiddenShardedTableGivesHiddenShardedOutput) {
    EXPECT_EQ(S(InferEmbeddingForward(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[-1,0]")).outputs[0]), "[-1,-1,0]");
}

// dp x tp: ids [0,-1], weight [1,-1] -> [0,-1,-1] partial{1}
TEST(EmbeddingTest, DataParallelIdsAndVocabParallelTable) {
    EXPECT_EQ(S(InferEmbeddingForward(kDpTp, T({2, 8}, "[0,-1]"), T({1000, 64}, "[1,-1]")).outputs[0]),
              "[0,-1,-1] partial{1}");
}

// ids [0,-1] and weight [0,-1] on one mesh dim: the table wins, ids gathered
TEST(EmbeddingTest, TableWinsConflict) {
    const SpmdInfo info = InferEmbeddingForward(kTp, T({4, 8}, "[0,-1]"), T({1000, 64}, "[0,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,-1] partial{0}");
}

// partial ids make no sense: reduced
TEST(EmbeddingTest, PartialIdsAreReduced) {
    EXPECT_EQ(S(InferEmbeddingForward(kTp, T({4}, "[-1] partial{0}"), T({10, 4}, "[-1,-1]")).inputs[0]), "[-1]");
}

TEST(EmbeddingTest, TableMustBeTwoDimensional) {
    EXPECT_THROW(InferEmbeddingForward(kTp, T({4}, "[-1]"), T({10}, "[-1]")), SpmdError);
}

// reverse: bsh partial{0} -> weight vocab sharded
TEST(EmbeddingTest, ReverseFromPartialShardsVocab) {
    const SpmdInfo info = InferEmbeddingReverse(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[-1,-1]"),
                                                T({2, 8, 64}, "[-1,-1,-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
}

// grad: vocab parallel: weight_grad [0,-1]; ids data parallel on dp -> partial{0}
TEST(EmbeddingTest, GradIsVocabShardedAndPartialOverDp) {
    const SpmdInfo info =
        InferEmbeddingGrad(kDpTp, T({2, 8}, "[0,-1]"), T({1000, 64}, "[1,-1]"), T({2, 8, 64}, "[0,-1,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[0,-1,-1]");
    EXPECT_EQ(info.output_names, std::vector<std::string>{"weight_grad"});
    EXPECT_EQ(S(info.Output("weight_grad")), "[1,-1] partial{0}");
}

// ---- embedding_bag: ids [bag, ...], the bag dim summed away
// ----------------------------------------------------------

// ids tb[-1,-1], weight vh[0,-1] (vocab parallel) -> bh[-1,-1] partial{0}
TEST(EmbeddingBagTest, VocabParallelTableGivesPartialOutput) {
    const SpmdInfo info = InferEmbeddingBagForward(kTp, T({32, 8}, "[-1,-1]"), T({1000, 64}, "[0,-1]"));
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{8, 64}));
}

// dp x tp, the char-LM's layout: ids tb[-1,0], weight vh[-1,-1] -> bh[0,-1]
TEST(EmbeddingBagTest, BatchShardedIdsAndReplicatedTable) {
    const SpmdInfo info = InferEmbeddingBagForward(kDpTp, T({32, 8}, "[-1,0]"), T({1000, 64}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// ids sharded on the bag dim: each rank sums its part of every bag -> tb[0,-1] gives bh[-1,-1] partial{0}
TEST(EmbeddingBagTest, BagShardedIdsGivePartialOutput) {
    const SpmdInfo info = InferEmbeddingBagForward(kTp, T({32, 8}, "[0,-1]"), T({1000, 64}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[0,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// weight vh[-1,0] -> bh[-1,0]; more trailing id dims: tab -> abh
TEST(EmbeddingBagTest, HiddenShardedTableAndTrailingIdDims) {
    EXPECT_EQ(S(InferEmbeddingBagForward(kTp, T({4, 2, 8}, "[-1,-1,-1]"), T({1000, 64}, "[-1,0]")).outputs[0]),
              "[-1,-1,0]");
}

TEST(EmbeddingBagTest, IdsNeedABagDimAndTheTableTwoDims) {
    EXPECT_THROW(InferEmbeddingBagForward(kTp, T({}, "[]"), T({10, 4}, "[-1,-1]")), SpmdError);
    EXPECT_THROW(InferEmbeddingBagForward(kTp, T({4, 2}, "[-1,-1]"), T({10}, "[-1]")), SpmdError);
}

// reverse: bh partial{0} -> weight vocab sharded
TEST(EmbeddingBagTest, ReverseFromPartialShardsVocab) {
    const SpmdInfo info = InferEmbeddingBagReverse(kTp, T({32, 8}, "[-1,-1]"), T({1000, 64}, "[-1,-1]"),
                                                   T({8, 64}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[1]), "[0,-1]");
}

// grad: vocab parallel on tp, batch on dp: weight_grad [1,-1] partial{0}; out_grad stays batch sharded
TEST(EmbeddingBagTest, GradIsVocabShardedAndPartialOverDp) {
    const SpmdInfo info =
        InferEmbeddingBagGrad(kDpTp, T({32, 8}, "[-1,0]"), T({1000, 64}, "[1,-1]"), T({8, 64}, "[0,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[0,-1]");
    EXPECT_EQ(info.output_names, std::vector<std::string>{"weight_grad"});
    EXPECT_EQ(S(info.Output("weight_grad")), "[1,-1] partial{0}");
}

// grad with bag-sharded ids: each rank's positions give a partial table gradient
TEST(EmbeddingBagTest, GradOfBagShardedIdsIsPartial) {
    const SpmdInfo info =
        InferEmbeddingBagGrad(kTp, T({32, 8}, "[0,-1]"), T({1000, 64}, "[-1,-1]"), T({8, 64}, "[-1,-1]"));
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,-1] partial{0}");
}

} // namespace
} // namespace shardline::spmd
