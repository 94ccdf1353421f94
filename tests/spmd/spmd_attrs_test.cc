// The attributes of issue 19: linear's trans_x / trans_y (Paddle's fused_gemm_epilogue), Partial(prod) through the
// planner and the rules (and the layouts refused because their Partials do not commute), embedding's sparse.
// Notation: layouts as text; linear labels x "mk" (trans_x "km"), weight "nk" (trans_y = false: "kn"), bias "n".

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;
using testing::S;
using testing::T;

const ProcessMesh kTp({4}, {"tp"});
const ProcessMesh k2x2({2, 2});

std::string ErrorOf(const std::function<void()> &fn) {
    try {
        fn();
    } catch (const SpmdError &e) {
        return e.what();
    }
    return "";
}

// ---- linear trans_x / trans_y ---------------------------------------------------------------------------------------

// trans_y=false: x mk[-1,-1], w kn[-1,0] ([in, out], Paddle's layout) -> y mn[-1,0]  (column parallel)
TEST(LinearAttrsTest, WeightInOutLayoutColumnParallel) {
    const SpmdInfo info = InferLinearForward(kTp, T({64, 32}, "[-1,-1]"), T({32, 48}, "[-1,0]"), T({48}, "[0]"),
                                             LinearAttrs{.trans_x = false, .trans_y = false});
    EXPECT_EQ(S(info.Input("weight")), "[-1,0]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,0]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{64, 48}));
}

// trans_y=false: x mk[-1,0], w kn[0,-1] -> y mn[-1,-1] partial{0}, bias after the reduction  (row parallel)
TEST(LinearAttrsTest, WeightInOutLayoutRowParallel) {
    const SpmdInfo info = InferLinearForward(kTp, T({64, 32}, "[-1,0]"), T({32, 48}, "[0,-1]"), T({48}, "[-1]"),
                                             LinearAttrs{.trans_x = false, .trans_y = false});
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
    EXPECT_TRUE(info.bias_after_reduction);
}

// trans_x: x km[0,-1] ([in, m]), w nk[-1,0] -> the weight wins k: x required [0,-1], y mn[-1,-1] partial{0}
TEST(LinearAttrsTest, TransposedInputShardedOnInFeatures) {
    const SpmdInfo info = InferLinearForward(kTp, T({32, 64}, "[0,-1]"), T({48, 32}, "[-1,0]"), std::nullopt,
                                             LinearAttrs{.trans_x = true, .trans_y = true});
    EXPECT_EQ(S(info.Input("x")), "[0,-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{64, 48}));
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// trans_x with a batch dim: x bkm[0,-1,1] on 2x2, w nk[-1,-1] -> y bmn[0,1,-1]
TEST(LinearAttrsTest, TransposedInputKeepsBatchAndMShardings) {
    const SpmdInfo info = InferLinearForward(k2x2, T({4, 32, 64}, "[0,-1,1]"), T({48, 32}, "[-1,-1]"), std::nullopt,
                                             LinearAttrs{.trans_x = true, .trans_y = true});
    EXPECT_EQ(S(info.outputs[0]), "[0,1,-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{4, 64, 48}));
}

// trans_x, trans_y=false, grad: x km[-1,0], w kn[-1,0], dy mn[0,-1] -> dx km[-1,0] partial{?}: dx = w dy^T
TEST(LinearAttrsTest, TransposedGradShardsLikeTheOperands) {
    const SpmdInfo info = InferLinearGrad(kTp, T({32, 64}, "[-1,0]"), T({32, 48}, "[-1,0]"), std::nullopt,
                                          T({64, 48}, "[-1,-1]"), LinearAttrs{.trans_x = true, .trans_y = false});
    // m (x dim 1) and n (w dim 1) both want mesh dim 0: the weight wins, x is required replicated on m.
    EXPECT_EQ(S(info.Input("weight")), "[-1,0]");
    EXPECT_EQ(S(info.Input("x")), "[-1,-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,0]");
}

// trans_x on a 1-D x, and in_features that disagree under trans_y=false: errors naming the flags
TEST(LinearAttrsTest, BadShapesUnderTheFlagsAreErrors) {
    EXPECT_NE(ErrorOf([] {
                  InferLinearForward(kTp, T({32}, "[-1]"), T({48, 32}, "[-1,-1]"), std::nullopt,
                                     LinearAttrs{.trans_x = true});
              }).find("rank >= 2"),
              std::string::npos);
    EXPECT_NE(ErrorOf([] {
                  InferLinearForward(kTp, T({64, 32}, "[-1,-1]"), T({48, 32}, "[-1,-1]"), std::nullopt,
                                     LinearAttrs{.trans_x = false, .trans_y = false});
              }).find("x.shape[-1] (32) must equal weight.shape[0] (in_features, 48) (trans_x=false, trans_y=false)"),
              std::string::npos);
}

// ---- Partial(prod)
// ---------------------------------------------------------------------------------------------------

// [-1] partial{0:prod} -> [-1]: one all_reduce(prod)
TEST(ProdPartialTest, ProdToReplicateIsAnAllReduceProd) {
    const RedistributePlan plan = PlanRedistribute(kTp, {8}, L("[-1] partial{0:prod}"), L("[-1]"));
    ASSERT_EQ(plan.steps.size(), 1u);
    EXPECT_EQ(plan.steps[0].collective, Collective::kAllReduce);
    EXPECT_EQ(plan.steps[0].reduce_op, ReduceOp::kProd);
}

// [-1] partial{0:prod} -> [0]: one reduce_scatter(prod), never all_reduce + slice
TEST(ProdPartialTest, ProdToShardIsAReduceScatterProd) {
    const RedistributePlan plan = PlanRedistribute(kTp, {8}, L("[-1] partial{0:prod}"), L("[0]"));
    ASSERT_EQ(plan.steps.size(), 1u);
    EXPECT_EQ(plan.steps[0].collective, Collective::kReduceScatter);
    EXPECT_EQ(plan.steps[0].reduce_op, ReduceOp::kProd);
}

// [-1] -> [-1] partial{0:prod}: free (the value on coordinate 0, ones elsewhere)
TEST(ProdPartialTest, ReplicateToProdIsALocalPartialize) {
    const RedistributePlan plan = PlanRedistribute(kTp, {8}, L("[-1]"), L("[-1] partial{0:prod}"));
    ASSERT_EQ(plan.steps.size(), 1u);
    EXPECT_EQ(plan.steps[0].collective, Collective::kLocalPartialize);
    EXPECT_EQ(plan.steps[0].reduce_op, ReduceOp::kProd);
    EXPECT_EQ(plan.cost_us, 0.0);
}

// partial{0:sum,1:max} on 2x2: max and sum do not commute -> refused (src and dst, rules too)
TEST(ProdPartialTest, PartialsThatDoNotCommuteAreRefused) {
    const std::string error = ErrorOf([] { PlanRedistribute(k2x2, {8}, L("[-1] partial{0:sum,1:max}"), L("[-1]")); });
    EXPECT_NE(error.find("Partial with sum on mesh dim 0 and max on mesh dim 1, which do not commute"),
              std::string::npos)
        << error;
    EXPECT_FALSE(ErrorOf([] { PlanRedistribute(k2x2, {8}, L("[-1]"), L("[-1] partial{0:prod,1:sum}")); }).empty());
    EXPECT_FALSE(ErrorOf([] { InferElementwiseForward(k2x2, "relu", {T({8}, "[-1] partial{0:max,1:min}")}); }).empty());
}

// partial{0:sum,1:avg} commute (both linear); partial{0:prod,1:prod} too; a size-1 mesh dim never matters
TEST(ProdPartialTest, PartialsThatCommuteAreAccepted) {
    EXPECT_EQ(PlanRedistribute(k2x2, {8}, L("[-1] partial{0:sum,1:avg}"), L("[-1]")).NumCollectives(), 2);
    EXPECT_EQ(PlanRedistribute(k2x2, {8}, L("[-1] partial{0:prod,1:prod}"), L("[-1]")).NumCollectives(), 2);
    EXPECT_NO_THROW(PlanRedistribute(ProcessMesh({2, 1}), {8}, L("[-1] partial{0:sum,1:max}"), L("[-1]")));
}

// multiply x[-1] partial{0:prod} * y[-1] partial{0:prod} -> out partial{0:prod} (prod x * prod y = prod xy)
TEST(ProdPartialTest, MultiplyOfTwoProdPartialsStaysProd) {
    const SpmdInfo info =
        InferElementwiseForward(kTp, "multiply", {T({8}, "[-1] partial{0:prod}"), T({8}, "[-1] partial{0:prod}")});
    EXPECT_EQ(S(info.inputs[0]), "[-1] partial{0:prod}");
    EXPECT_EQ(S(info.inputs[1]), "[-1] partial{0:prod}");
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0:prod}");
}

// multiply x partial{0:prod} * y R -> both R: y may not be multiplied on every rank
TEST(ProdPartialTest, MultiplyOfProdAndReplicateResolvesTheProd) {
    const SpmdInfo info = InferElementwiseForward(kTp, "multiply", {T({8}, "[-1] partial{0:prod}"), T({8}, "[-1]")});
    EXPECT_EQ(S(info.inputs[0]), "[-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1]");
}

// matmul x mk partial{0:prod}: a sum of products is no product of sums -> resolved first
TEST(ProdPartialTest, MatmulResolvesAProdOperand) {
    const SpmdInfo info = InferMatmulForward(kTp, T({4, 8}, "[-1,-1] partial{0:prod}"), T({8, 2}, "[-1,-1]"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1]");
}

// identity / abs / transpose keep partial{0:prod}; neg does not (prod of -x is +-prod x)
TEST(ProdPartialTest, UnaryOpsThatPreserveAProductKeepIt) {
    EXPECT_EQ(S(InferElementwiseForward(kTp, "identity", {T({8}, "[-1] partial{0:prod}")}).outputs[0]),
              "[-1] partial{0:prod}");
    EXPECT_EQ(S(InferElementwiseForward(kTp, "abs", {T({8}, "[-1] partial{0:prod}")}).outputs[0]),
              "[-1] partial{0:prod}");
    EXPECT_EQ(S(InferTransposeForward(kTp, T({2, 8}, "[-1,-1] partial{0:prod}"), {1, 0}).outputs[0]),
              "[-1,-1] partial{0:prod}");
    EXPECT_EQ(S(InferElementwiseForward(kTp, "neg", {T({8}, "[-1] partial{0:prod}")}).outputs[0]), "[-1]");
}

// prod over a sharded axis: ab[-1,0] -> a[-1] partial{0:prod}
TEST(ProdPartialTest, ProdReductionOverAShardedAxisGivesProdPartial) {
    const SpmdInfo info =
        InferReductionForward(kTp, T({3, 8}, "[-1,0]"), ReductionAttrs{.kind = ReductionKind::kProd, .axes = {1}});
    EXPECT_EQ(S(info.outputs[0]), "[-1] partial{0:prod}");
}

// prod grad: needs the forward output, reduced: out a[-1], out_grad a[-1]
TEST(ProdPartialTest, ProdReductionGradNeedsTheReducedOutput) {
    const SpmdInfo info = InferReductionGrad(kTp, T({3, 8}, "[-1,0]"), T({3}, "[-1]"),
                                             ReductionAttrs{.kind = ReductionKind::kProd, .axes = {1}});
    EXPECT_EQ(info.input_names, (std::vector<std::string>{"x", "out", "out_grad"}));
    EXPECT_EQ(S(info.Input("out")), "[-1]");
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,0]");
}

// ---- embedding sparse
// ------------------------------------------------------------------------------------------------

// sparse, ids bs[-1,-1], weight vh[-1,0] -> bsh[-1,-1,0]: hidden-sharded tables are supported
TEST(EmbeddingSparseTest, HiddenShardedTableIsSupported) {
    const SpmdInfo info =
        InferEmbeddingForward(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[-1,0]"), EmbeddingAttrs{.sparse = true});
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,0]");
}

// sparse, weight vh[0,-1] (vocab parallel): refused, as Paddle
TEST(EmbeddingSparseTest, VocabShardedTableIsAnError) {
    const std::string error = ErrorOf([] {
        InferEmbeddingForward(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[0,-1]"), EmbeddingAttrs{.sparse = true});
    });
    EXPECT_NE(error.find("embedding: sparse=true does not support a vocab-sharded table"), std::string::npos) << error;
}

// sparse grad, ids R, weight vh[-1,0], dy bsh[-1,-1,0] -> weight_grad [-1,0], not Partial: supported
TEST(EmbeddingSparseTest, GradWithReplicatedIdsIsSupported) {
    const SpmdInfo info = InferEmbeddingGrad(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[-1,0]"),
                                             T({2, 8, 64}, "[-1,-1,0]"), EmbeddingAttrs{.sparse = true});
    EXPECT_EQ(S(info.Output("weight_grad")), "[-1,0]");
}

// sparse grad, ids bs[0,-1] (data parallel): the row-sparse gradient would be Partial over mesh dim 0 -> error
TEST(EmbeddingSparseTest, GradWithBatchShardedIdsIsAnError) {
    const std::string error = ErrorOf([] {
        InferEmbeddingGrad(kTp, T({4, 8}, "[0,-1]"), T({1000, 64}, "[-1,-1]"), T({4, 8, 64}, "[0,-1,-1]"),
                           EmbeddingAttrs{.sparse = true});
    });
    EXPECT_NE(error.find("row-sparse weight gradient would be Partial over mesh dim(s) [0]"), std::string::npos)
        << error;
    // The dense gradient of the same layouts is P(sum) over mesh dim 0.
    EXPECT_EQ(S(InferEmbeddingGrad(kTp, T({4, 8}, "[0,-1]"), T({1000, 64}, "[-1,-1]"), T({4, 8, 64}, "[0,-1,-1]"))
                    .Output("weight_grad")),
              "[-1,-1] partial{0}");
}

// sparse reverse from a P(sum) output: the Partial goes to the table (never to its vocab dim)
TEST(EmbeddingSparseTest, ReverseNeverShardsTheVocab) {
    const SpmdInfo info = InferEmbeddingReverse(kTp, T({2, 8}, "[-1,-1]"), T({1000, 64}, "[-1,-1]"),
                                                T({2, 8, 64}, "[-1,-1,-1] partial{0}"), EmbeddingAttrs{.sparse = true});
    EXPECT_TRUE(info.Input("weight").layout.MeshDims(0).empty());
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1,-1] partial{0}");
}

} // namespace
} // namespace shardline::spmd
