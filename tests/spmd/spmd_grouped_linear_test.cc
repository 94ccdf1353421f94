// grouped_linear rules (mixture-of-experts experts): the expert dim of weight is its own label. Sharding out is column
// parallel, sharding in makes the output Partial with the bias after the reduction, sharding the experts is expert
// parallelism (rows follow their experts' ranks, parameter grads stay sharded on the experts, never Partial).
// Notation: x[t,k] w[e,n,k] b[e,n] -> y[t,n]; meshes [tp=4], [ep=2, tp=2], [dp=2, tp=2].

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh kTp({4}, {"tp"});
const ProcessMesh kEpTp({2, 2}, {"ep", "tp"});
const ProcessMesh kDpTp({2, 2}, {"dp", "tp"});
constexpr int64_t kTokens = 64;
constexpr int64_t kExperts = 8;
constexpr int64_t kIn = 32;
constexpr int64_t kOut = 48;

// x[-1,-1], w[-1,0,-1], b[-1,0] -> y[-1,0]  (expert column parallel)
TEST(GroupedLinearTest, ColumnParallelExpertsShardTheOutputFeatures) {
    const SpmdInfo info = InferGroupedLinearForward(
        kTp, T({kTokens, kIn}, "[-1,-1]"), T({kExperts, kOut, kIn}, "[-1,0,-1]"), T({kExperts, kOut}, "[-1,0]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[-1,0,-1]");
    EXPECT_EQ(S(info.Input("bias")), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{kTokens, kOut}));
    EXPECT_EQ(info.Input("weight").shape, (std::vector<int64_t>{kExperts, kOut, kIn}));
    EXPECT_FALSE(info.bias_after_reduction);
}

// x[-1,0], w[-1,-1,0], b[-1,-1] -> y[-1,-1] partial{0}, bias after the reduction  (expert row parallel)
TEST(GroupedLinearTest, RowParallelExpertsGivePartialOutputWithBiasAfterReduction) {
    const SpmdInfo info = InferGroupedLinearForward(
        kTp, T({kTokens, kIn}, "[-1,0]"), T({kExperts, kOut, kIn}, "[-1,-1,0]"), T({kExperts, kOut}, "[-1,-1]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_TRUE(info.bias_after_reduction);
}

// x[-1,-1], w[0,-1,-1] -> x required [0,-1], y[0,-1]; not Partial  (expert parallel: rows follow their experts)
TEST(GroupedLinearTest, ShardedExpertsAreExpertParallelNotPartial) {
    const SpmdInfo info = InferGroupedLinearForward(kTp, T({kTokens, kIn}, "[-1,-1]"),
                                                    T({kExperts, kOut, kIn}, "[0,-1,-1]"), std::nullopt);
    EXPECT_EQ(S(info.Input("x")), "[0,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[0,-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
    EXPECT_FALSE(info.outputs[0].layout.IsPartial());
}

// ep x tp: x[0,-1], w[0,1,-1], b[0,1] -> y[0,1]  (expert parallel over ep, column parallel over tp)
TEST(GroupedLinearTest, ExpertParallelTimesColumnParallel) {
    const SpmdInfo info = InferGroupedLinearForward(kEpTp, T({kTokens, kIn}, "[0,-1]"),
                                                    T({kExperts, kOut, kIn}, "[0,1,-1]"), T({kExperts, kOut}, "[0,1]"));
    EXPECT_EQ(S(info.Input("x")), "[0,-1]");
    EXPECT_EQ(S(info.Input("bias")), "[0,1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// ep x tp: x[0,1], w[0,-1,1] -> y[0,-1] partial{1}  (expert parallel over ep, row parallel over tp)
TEST(GroupedLinearTest, ExpertParallelTimesRowParallelIsPartialOnlyOverTp) {
    const SpmdInfo info = InferGroupedLinearForward(kEpTp, T({kTokens, kIn}, "[0,1]"),
                                                    T({kExperts, kOut, kIn}, "[0,-1,1]"), std::nullopt);
    EXPECT_EQ(S(info.Input("x")), "[0,1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1] partial{1}");
}

// dp x tp: x[0,-1], w[-1,1,-1] -> y[0,1]  (the rows' data-parallel sharding is kept)
TEST(GroupedLinearTest, DataParallelRowsAreKept) {
    const SpmdInfo info = InferGroupedLinearForward(kDpTp, T({kTokens, kIn}, "[0,-1]"),
                                                    T({kExperts, kOut, kIn}, "[-1,1,-1]"), std::nullopt);
    EXPECT_EQ(S(info.outputs[0]), "[0,1]");
}

// w[-1,0,-1] and x[-1,0]: the weight wins (parameters never move); x is gathered to [-1,-1]
TEST(GroupedLinearTest, WeightWinsTheConflictWithTheInput) {
    const SpmdInfo info = InferGroupedLinearForward(kTp, T({kTokens, kIn}, "[-1,0]"),
                                                    T({kExperts, kOut, kIn}, "[-1,0,-1]"), std::nullopt);
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
}

// reverse: y[-1,0] -> x[-1,-1], w[-1,0,-1], b[-1,0]
TEST(GroupedLinearTest, ReverseFromColumnShardedOutput) {
    const SpmdInfo info =
        InferGroupedLinearReverse(kTp, T({kTokens, kIn}, "[-1,-1]"), T({kExperts, kOut, kIn}, "[-1,-1,-1]"),
                                  T({kExperts, kOut}, "[-1,-1]"), T({kTokens, kOut}, "[-1,0]"));
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Input("weight")), "[-1,0,-1]");
    EXPECT_EQ(S(info.Input("bias")), "[-1,0]");
}

// reverse: y[-1,-1] partial{0} -> x[-1,0], w[-1,-1,0]
TEST(GroupedLinearTest, ReverseFromPartialOutputShardsInFeatures) {
    const SpmdInfo info =
        InferGroupedLinearReverse(kTp, T({kTokens, kIn}, "[-1,-1]"), T({kExperts, kOut, kIn}, "[-1,-1,-1]"),
                                  std::nullopt, T({kTokens, kOut}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.Input("x")), "[-1,0]");
    EXPECT_EQ(S(info.Input("weight")), "[-1,-1,0]");
}

// grad, column: x[-1,-1], w[-1,0,-1], b[-1,0], dy[-1,0] -> dx[-1,-1] partial{0}, dw[-1,0,-1], db[-1,0]
TEST(GroupedLinearTest, ColumnParallelGradReducesOnlyDx) {
    const SpmdInfo info =
        InferGroupedLinearGrad(kTp, T({kTokens, kIn}, "[-1,-1]"), T({kExperts, kOut, kIn}, "[-1,0,-1]"),
                               T({kExperts, kOut}, "[-1,0]"), T({kTokens, kOut}, "[-1,0]"));
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,0,-1]");
    EXPECT_EQ(S(info.Output("bias_grad")), "[-1,0]");
    EXPECT_EQ(info.Output("weight_grad").shape, (std::vector<int64_t>{kExperts, kOut, kIn}));
}

// grad, expert parallel: x[0,-1], w[0,-1,-1], b[0,-1], dy[0,-1] -> dx[0,-1], dw[0,-1,-1], db[0,-1]: nothing Partial
TEST(GroupedLinearTest, ExpertParallelGradsStayOnTheirExperts) {
    const SpmdInfo info =
        InferGroupedLinearGrad(kTp, T({kTokens, kIn}, "[0,-1]"), T({kExperts, kOut, kIn}, "[0,-1,-1]"),
                               T({kExperts, kOut}, "[0,-1]"), T({kTokens, kOut}, "[0,-1]"));
    EXPECT_EQ(S(info.Input("out_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,-1]");
    EXPECT_EQ(S(info.Output("weight_grad")), "[0,-1,-1]");
    EXPECT_EQ(S(info.Output("bias_grad")), "[0,-1]");
}

// grad, dp x tp: x[0,-1], w[-1,1,-1], dy[0,1] -> dw[-1,1,-1] partial{0} (rows summed per dp rank)
TEST(GroupedLinearTest, DataParallelRowsMakeTheWeightGradPartial) {
    const SpmdInfo info =
        InferGroupedLinearGrad(kDpTp, T({kTokens, kIn}, "[0,-1]"), T({kExperts, kOut, kIn}, "[-1,1,-1]"), std::nullopt,
                               T({kTokens, kOut}, "[0,1]"));
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,1,-1] partial{0}");
}

// errors: 3-D x, a weight without the experts dim, a bias of the wrong shape
TEST(GroupedLinearTest, ThreeDimensionalInputIsAnError) {
    try {
        InferGroupedLinearForward(kTp, T({2, kTokens, kIn}, "[-1,-1,-1]"), T({kExperts, kOut, kIn}, "[-1,-1,-1]"),
                                  std::nullopt);
        FAIL() << "expected SpmdError";
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("grouped_linear: x must be [tokens, in_features]"), std::string::npos)
            << e.what();
    }
}

TEST(GroupedLinearTest, WeightWithoutTheExpertDimIsAnError) {
    EXPECT_THROW(InferGroupedLinearForward(kTp, T({kTokens, kIn}, "[-1,-1]"), T({kOut, kIn}, "[-1,-1]"), std::nullopt),
                 SpmdError);
}

TEST(GroupedLinearTest, BiasWithoutTheExpertDimIsAnError) {
    EXPECT_THROW(InferGroupedLinearForward(kTp, T({kTokens, kIn}, "[-1,-1]"), T({kExperts, kOut, kIn}, "[-1,-1,-1]"),
                                           T({kOut}, "[-1]")),
                 SpmdError);
}

} // namespace
} // namespace shardline::spmd
