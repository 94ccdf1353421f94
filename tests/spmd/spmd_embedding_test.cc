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

} // namespace
} // namespace shardline::spmd
