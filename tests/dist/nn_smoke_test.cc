// Smoke test of the parallel modules (lead's first check; the full matrix is in nn_*_test.cc, nn_test_util.h).

#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/kernels/linear.h>
#include <shardline/nn/linear.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

void SetFull(Variable &p, const Tensor &full) {
    DistTensor shard = DistTensor::FromFull(full, p.value().layout(), p.value().mesh());
    Tensor local = p.local();
    local.CopyFrom(shard.local());
}

TEST(ParallelLinearSmokeTest, ColumnThenRowMatchesDense) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const nn::TensorParallelGroup tp = nn::TensorParallelGroup::Named(mesh, "tp");
    nn::ColumnParallelLinear col({.in_features = 8, .out_features = 4 * w}, tp, {.name = "c"});
    nn::RowParallelLinear row({.in_features = 4 * w, .out_features = 6, .input_is_parallel = true}, tp, {.name = "r"});
    const Tensor xf = RandomFull({5, 8}, "x");
    const Tensor w1 = RandomFull({4 * w, 8}, "w1");
    const Tensor b1 = RandomFull({4 * w}, "b1");
    const Tensor w2 = RandomFull({6, 4 * w}, "w2");
    const Tensor b2 = RandomFull({6}, "b2");
    const Tensor dyf = RandomFull({5, 6}, "dy");
    SetFull(col.weight, w1);
    SetFull(col.bias, b1);
    SetFull(row.weight, w2);
    SetFull(row.bias, b2);
    Variable x(DistTensor::FromFull(xf, spmd::Layout::Replicated(2), mesh), true);
    mesh.group(0).ResetCounts();
    Variable h = col.Forward(x).output;
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), 0);
    Variable y = row.Forward(h).output;
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    mesh.group(0).ResetCounts();
    const DistTensor dy = DistTensor::FromFull(dyf, spmd::Layout::Replicated(2), mesh);
    y.Backward(&dy);
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), w > 1 ? 1 : 0);

    // Dense reference on every rank.
    const Tensor hd = kernels::LinearForward(xf, w1, &b1);
    const Tensor yd = kernels::LinearForward(hd, w2, &b2);
    EXPECT_TRUE(SameValues(y.value().FullTensor(), yd));
    const Tensor dh = kernels::LinearBackwardInput(dyf, w2);
    EXPECT_TRUE(SameValues(row.weight.grad().FullTensor(), kernels::LinearBackwardWeight(dyf, hd)));
    EXPECT_TRUE(SameValues(row.bias.grad().FullTensor(), kernels::LinearBackwardBias(dyf)));
    EXPECT_TRUE(SameValues(col.weight.grad().FullTensor(), kernels::LinearBackwardWeight(dh, xf)));
    EXPECT_TRUE(SameValues(col.bias.grad().FullTensor(), kernels::LinearBackwardBias(dh)));
    EXPECT_TRUE(SameValues(x.grad().FullTensor(), kernels::LinearBackwardInput(dh, w1)));
}

} // namespace
} // namespace shardline
