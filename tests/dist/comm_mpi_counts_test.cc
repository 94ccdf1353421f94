// Collective counters: exact calls and bytes per kind after a known sequence.

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::CollectiveKind;
using comm::ReduceOp;

TEST(MpiCountsTest, CountsCallsAndBytesPerKindAfterAKnownSequence) {
    auto &world = DistEnv().world();
    auto group = world.Split(0, world.rank(), "counted");
    ASSERT_NE(group, nullptr);
    const int p = group->size();
    const int me = group->rank();
    EXPECT_EQ(group->Counts().TotalCalls(), 0);

    Tensor a = Tensor::Zeros({10}, DType::kFloat32); // 40 B
    group->AllReduce(a, ReduceOp::kSum)->Wait();
    group->AllReduce(a, ReduceOp::kMax)->Wait();
    Tensor g_in = Tensor::Zeros({5}, DType::kFloat64); // 40 B
    Tensor g_out = Tensor::Zeros({5 * p}, DType::kFloat64);
    group->AllGather(g_in, g_out)->Wait();
    std::vector<std::int64_t> counts(p);
    for (int r = 0; r < p; ++r) {
        counts[r] = r + 1;
    }
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    Tensor v_in = Tensor::Zeros({counts[me]}, DType::kFloat32); // 4·(me+1) B
    Tensor v_out = Tensor::Zeros({total}, DType::kFloat32);
    group->AllGatherV(v_in, v_out, counts)->Wait();
    Tensor rs_in = Tensor::Zeros({3 * p}, DType::kFloat64); // 24·p B
    Tensor rs_out = Tensor::Zeros({3}, DType::kFloat64);
    group->ReduceScatter(rs_in, rs_out, ReduceOp::kAvg)->Wait();
    Tensor a2a_in = Tensor::Zeros({2 * p}, DType::kFloat32); // 8·p B
    Tensor a2a_out = Tensor::Zeros({2 * p}, DType::kFloat32);
    group->AllToAll(a2a_in, a2a_out)->Wait();
    Tensor b = Tensor::Zeros({7}, DType::kFloat32); // 28 B
    group->Broadcast(b, 0)->Wait();
    group->Barrier()->Wait();
    group->Barrier()->Wait();

    const auto c = group->Counts();
    EXPECT_EQ(c.Calls(CollectiveKind::kAllReduce), 2);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllReduce), 80);
    EXPECT_EQ(c.Calls(CollectiveKind::kAllGather), 2);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllGather), 40 + 4 * (me + 1));
    EXPECT_EQ(c.Calls(CollectiveKind::kReduceScatter), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kReduceScatter), 24 * p);
    EXPECT_EQ(c.Calls(CollectiveKind::kAllToAll), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllToAll), 8 * p);
    EXPECT_EQ(c.Calls(CollectiveKind::kBroadcast), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kBroadcast), 28);
    EXPECT_EQ(c.Calls(CollectiveKind::kBarrier), 2);
    EXPECT_EQ(c.Bytes(CollectiveKind::kBarrier), 0);
    EXPECT_EQ(c.TotalCalls(), 9);

    // A call rejected by validation issues nothing and counts nothing.
    Tensor wrong = Tensor::Zeros({5 * p + 1}, DType::kFloat64);
    EXPECT_THROW(group->AllGather(g_in, wrong), ShapeError);
    EXPECT_EQ(group->Counts().TotalCalls(), 9);

    group->ResetCounts();
    EXPECT_EQ(group->Counts().TotalCalls(), 0);
    EXPECT_EQ(group->Counts().Bytes(CollectiveKind::kAllReduce), 0);
    group->AllReduce(a, ReduceOp::kSum)->Wait();
    EXPECT_EQ(group->Counts().Calls(CollectiveKind::kAllReduce), 1);
    EXPECT_EQ(group->Counts().TotalCalls(), 1);
}

TEST(MpiCountsTest, SplitAndInternalExchangesAreNotCounted) {
    auto &world = DistEnv().world();
    auto group = world.Split(0, world.rank(), "parent");
    ASSERT_NE(group, nullptr);
    auto child = group->Split(0, group->rank(), "child");
    ASSERT_NE(child, nullptr);
    comm::SetCommCheck(true);
    Tensor a = Tensor::Zeros({4}, DType::kFloat32);
    group->AllReduce(a, ReduceOp::kSum)->Wait();
    comm::SetCommCheck(false);
    EXPECT_EQ(group->Counts().TotalCalls(), 1);
    EXPECT_EQ(group->Counts().Calls(CollectiveKind::kAllReduce), 1);
    EXPECT_EQ(child->Counts().TotalCalls(), 0);
}

} // namespace
} // namespace shardline::testing
