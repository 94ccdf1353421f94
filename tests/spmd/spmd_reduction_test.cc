#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x2({2, 2});

SpmdInfo Fwd(const TensorSpec &x, ReductionKind kind, std::vector<int> axes, bool keepdim = false) {
    return InferReductionForward(k2x2, x, {.kind = kind, .axes = std::move(axes), .keepdim = keepdim});
}

// sum abc[0,1,-1] over b -> ac[0,-1] partial{1}
TEST(ReductionTest, SumOverShardedAxisIsPartialSum) {
    EXPECT_EQ(S(Fwd(T({4, 6, 8}, "[0,1,-1]"), ReductionKind::kSum, {1}).outputs[0]), "[0,-1] partial{1}");
}

// mean -> partial sum (local kernel divides by the global count)
TEST(ReductionTest, MeanOverShardedAxisIsPartialSum) {
    EXPECT_EQ(S(Fwd(T({4, 6}, "[0,-1]"), ReductionKind::kMean, {0}).outputs[0]), "[-1] partial{0}");
}

// max -> partial max
TEST(ReductionTest, MaxOverShardedAxisIsPartialMax) {
    EXPECT_EQ(S(Fwd(T({4, 6}, "[0,1]"), ReductionKind::kMax, {-1}).outputs[0]), "[0] partial{1:max}");
}

// min -> partial min
TEST(ReductionTest, MinOverShardedAxisIsPartialMin) {
    EXPECT_EQ(S(Fwd(T({4, 6}, "[0,1]"), ReductionKind::kMin, {1}).outputs[0]), "[0] partial{1:min}");
}

// sum over all axes -> scalar partial{0,1}
TEST(ReductionTest, SumOverAllAxes) {
    const SpmdInfo info = Fwd(T({4, 6}, "[0,1]"), ReductionKind::kSum, {});
    EXPECT_EQ(S(info.outputs[0]), "[] partial{0,1}");
    EXPECT_TRUE(info.outputs[0].shape.empty());
}

// keepdim: reduced dims are replicated size-1 dims
TEST(ReductionTest, KeepDimInsertsReplicatedUnitDims) {
    const SpmdInfo info = Fwd(T({4, 6}, "[0,1]"), ReductionKind::kSum, {1}, true);
    EXPECT_EQ(S(info.outputs[0]), "[0,-1] partial{1}");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{4, 1}));
}

// sum of a partial{0} input keeps it
TEST(ReductionTest, SumKeepsSumPartial) {
    EXPECT_EQ(S(Fwd(T({4, 6}, "[-1,1] partial{0}"), ReductionKind::kSum, {1}).outputs[0]), "[-1] partial{0,1}");
}

// max of a partial{0:max} keeps it; max of partial{0:sum} reduces it
TEST(ReductionTest, MaxKeepsOnlyMaxPartial) {
    EXPECT_EQ(S(Fwd(T({4, 6}, "[-1,-1] partial{0:max}"), ReductionKind::kMax, {1}).outputs[0]), "[-1] partial{0:max}");
    EXPECT_EQ(S(Fwd(T({4, 6}, "[-1,-1] partial{0}"), ReductionKind::kMax, {1}).inputs[0]), "[-1,-1]");
}

TEST(ReductionTest, BadAxesAreErrors) {
    EXPECT_THROW(Fwd(T({4, 6}, "[-1,-1]"), ReductionKind::kSum, {2}), SpmdError);
    EXPECT_THROW(Fwd(T({4, 6}, "[-1,-1]"), ReductionKind::kSum, {1, -1}), SpmdError);
}

// reverse: a[0] partial{1} from sum over b -> ab[0,1]
TEST(ReductionTest, ReverseShardsReducedAxisForPartial) {
    const SpmdInfo info = InferReductionReverse(k2x2, T({4, 6}, "[-1,-1]"), T({4}, "[0] partial{1}"),
                                                {.kind = ReductionKind::kSum, .axes = {1}});
    EXPECT_EQ(S(info.inputs[0]), "[0,1]");
}

// grad: dx gets the input sharding, dy replicated on the reduced mesh dim
TEST(ReductionTest, GradBroadcastsOutputGrad) {
    const SpmdInfo info =
        InferReductionGrad(k2x2, T({4, 6}, "[0,1]"), T({4}, "[0]"), {.kind = ReductionKind::kSum, .axes = {1}});
    EXPECT_EQ(S(info.Input("out_grad")), "[0]");
    EXPECT_EQ(S(info.Output("x_grad")), "[0,1]");
}

// grad of max needs the reduced forward output
TEST(ReductionTest, GradOfMaxNeedsTheReducedOutput) {
    const SpmdInfo info = InferReductionGrad(k2x2, T({4, 6}, "[0,1]"), T({4, 1}, "[0,-1]"),
                                             {.kind = ReductionKind::kMax, .axes = {1}, .keepdim = true});
    EXPECT_EQ(S(info.Input("out")), "[0,-1]");
    EXPECT_EQ(info.Input("out").shape, (std::vector<int64_t>{4, 1}));
    EXPECT_EQ(S(info.Output("x_grad")), "[0,1]");
}

} // namespace
} // namespace shardline::spmd
