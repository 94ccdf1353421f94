#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x2({2, 2});

// abc[0,-1,1] perm [2,0,1] -> cab[1,0,-1]
TEST(TransposeTest, ShardingsMoveWithDims) {
    const SpmdInfo info = InferTransposeForward(k2x2, T({2, 3, 4}, "[0,-1,1]"), {2, 0, 1});
    EXPECT_EQ(S(info.outputs[0]), "[1,0,-1]");
    EXPECT_EQ(info.outputs[0].shape, (std::vector<int64_t>{4, 2, 3}));
}

// partial{0:max} passes
TEST(TransposeTest, PartialPasses) {
    EXPECT_EQ(S(InferTransposeForward(k2x2, T({2, 3}, "[1,-1] partial{0:max}"), {1, 0}).outputs[0]),
              "[-1,1] partial{0:max}");
}

TEST(TransposeTest, BadPermIsAnError) {
    EXPECT_THROW(InferTransposeForward(k2x2, T({2, 3}, "[-1,-1]"), {0, 0}), SpmdError);
    EXPECT_THROW(InferTransposeForward(k2x2, T({2, 3}, "[-1,-1]"), {0}), SpmdError);
}

// reverse: out [1,0] with perm [1,0] -> x [0,1]
TEST(TransposeTest, Reverse) {
    EXPECT_EQ(S(InferTransposeReverse(k2x2, T({2, 3}, "[-1,-1]"), T({3, 2}, "[1,0]"), {1, 0}).inputs[0]), "[0,1]");
}

// grad: out_grad [0,-1] -> x_grad [-1,0]
TEST(TransposeTest, GradTransposesBack) {
    const SpmdInfo info = InferTransposeGrad(k2x2, T({2, 3}, "[-1,-1]"), T({3, 2}, "[0,-1]"), {1, 0});
    EXPECT_EQ(S(info.Output("x_grad")), "[-1,0]");
}

} // namespace
} // namespace shardline::spmd
