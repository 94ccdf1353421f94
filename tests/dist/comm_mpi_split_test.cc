// Sub-communicators of the MPI backend (MPI_Comm_split): grouping by color, order by key, no-color ranks.

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;

// On 4 ranks a 2×2 mesh (rank = row·2 + col): color = row groups {0,1},{2,3}; color = col groups {0,2},{1,3}.
// On 2 ranks rows are {0},{1} and the column is {0,1}.
TEST(MpiSplitTest, SplitsIntoRowAndColumnGroupsOfATwoByTwoMesh) {
    auto &world = DistEnv().world();
    const int me = world.rank();
    const int p = world.size();
    const int row = me / 2;
    const int col = me % 2;
    auto rows = world.Split(row, me, fmt::format("row {}", row));
    auto cols = world.Split(col, me, fmt::format("col {}", col));
    ASSERT_NE(rows, nullptr);
    ASSERT_NE(cols, nullptr);

    std::vector<int> row_members;
    std::vector<int> col_members;
    for (int r = 0; r < p; ++r) {
        if (r / 2 == row) {
            row_members.push_back(r);
        }
        if (r % 2 == col) {
            col_members.push_back(r);
        }
    }
    EXPECT_EQ(rows->size(), static_cast<int>(row_members.size()));
    EXPECT_EQ(rows->rank(), col);
    EXPECT_EQ(rows->name(), fmt::format("row {}", row));
    EXPECT_EQ(cols->size(), static_cast<int>(col_members.size()));
    EXPECT_EQ(cols->rank(), row);
    EXPECT_EQ(cols->backend(), "mpi");

    // An all_reduce in each group sums exactly its members' inputs.
    const std::int64_t n = 100;
    for (auto *group : {rows.get(), cols.get()}) {
        const auto &members = group == rows.get() ? row_members : col_members;
        Tensor x = RankInput(me, n, DType::kFloat32, 20);
        group->AllReduce(x, ReduceOp::kSum)->Wait();
        std::vector<double> expected(n, 0.0);
        for (int r : members) {
            const auto v = RankValues(r, n, DType::kFloat32, 20);
            for (std::int64_t i = 0; i < n; ++i) {
                expected[i] += v[i];
            }
        }
        EXPECT_EQ(x.ToDoubleVector(), expected) << group->name();
        // An all_gather in the group orders blocks by the group rank.
        Tensor mine = Tensor::Full({1}, me, DType::kFloat64);
        Tensor all = Tensor::Zeros({group->size()}, DType::kFloat64);
        group->AllGather(mine, all)->Wait();
        std::vector<double> expected_ranks(members.begin(), members.end());
        EXPECT_EQ(all.ToDoubleVector(), expected_ranks) << group->name();
    }
    // Group collectives are counted on the group, not on the world.
    EXPECT_EQ(rows->Counts().Calls(comm::CollectiveKind::kAllReduce), 1);
    EXPECT_EQ(rows->Counts().Calls(comm::CollectiveKind::kAllGather), 1);
}

TEST(MpiSplitTest, KeyOrdersTheRanksOfAGroup) {
    auto &world = DistEnv().world();
    auto reversed = world.Split(0, world.size() - world.rank(), "reversed");
    ASSERT_NE(reversed, nullptr);
    EXPECT_EQ(reversed->size(), world.size());
    EXPECT_EQ(reversed->rank(), world.size() - 1 - world.rank());
    Tensor mine = Tensor::Full({1}, world.rank(), DType::kFloat32);
    Tensor all = Tensor::Zeros({world.size()}, DType::kFloat32);
    reversed->AllGather(mine, all)->Wait();
    std::vector<double> expected;
    for (int r = world.size() - 1; r >= 0; --r) {
        expected.push_back(r);
    }
    EXPECT_EQ(all.ToDoubleVector(), expected);
}

TEST(MpiSplitTest, NegativeColorLeavesTheRankOutOfEveryGroup) {
    auto &world = DistEnv().world();
    auto others = world.Split(world.rank() == 0 ? -1 : 7, world.rank(), "without rank 0");
    if (world.rank() == 0) {
        EXPECT_EQ(others, nullptr);
        return;
    }
    ASSERT_NE(others, nullptr);
    EXPECT_EQ(others->size(), world.size() - 1);
    EXPECT_EQ(others->rank(), world.rank() - 1);
    Tensor x = Tensor::Full({4}, 1.0, DType::kFloat64);
    others->AllReduce(x, ReduceOp::kSum)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(4, world.size() - 1));
}

TEST(MpiSplitTest, SubCommunicatorOfASubCommunicator) {
    auto &world = DistEnv().world();
    auto half = world.Split(world.rank() % 2, world.rank(), "half");
    ASSERT_NE(half, nullptr);
    auto single = half->Split(half->rank(), 0, "single");
    ASSERT_NE(single, nullptr);
    EXPECT_EQ(single->size(), 1);
    EXPECT_EQ(single->rank(), 0);
    Tensor x = Tensor::Full({3}, 2.5, DType::kFloat32);
    single->AllReduce(x, ReduceOp::kAvg)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(3, 2.5));
}

} // namespace
} // namespace shardline::testing
