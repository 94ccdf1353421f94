// A communicator the program made itself: an MPI_Comm_split of MPI_COMM_WORLD (even and odd ranks) handed to
// shardline with Communicator::FromMpiComm. Values against a reference computed locally, exact counters, and
// non-owning: the test's MPI_Comm outlives the shardline communicator and the test frees it. Also the one wording of a
// validation error (communicator.cc validates for every backend).

#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::CollectiveKind;
using comm::ReduceOp;
using ::testing::HasSubstr;

/// The ranks of MPI_COMM_WORLD with this rank's parity, in rank order.
std::vector<int> SameParity(int world_rank, int world_size) {
    std::vector<int> ranks;
    for (int r = world_rank % 2; r < world_size; r += 2) {
        ranks.push_back(r);
    }
    return ranks;
}

TEST(MpiFromCommTest, BorrowedSplitRunsCollectivesAndStaysTheCallers) {
    int world_rank = 0;
    int world_size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    MPI_Comm mine = MPI_COMM_NULL;
    ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, world_rank % 2, world_rank, &mine), MPI_SUCCESS);
    const std::vector<int> members = SameParity(world_rank, world_size);
    const int n = static_cast<int>(members.size());
    {
        auto group = comm::Communicator::FromMpiComm(mine, {.name = fmt::format("parity {}", world_rank % 2)});
        ASSERT_NE(group, nullptr);
        EXPECT_EQ(group->backend(), "mpi");
        EXPECT_EQ(group->size(), n);
        EXPECT_EQ(group->rank(), world_rank / 2);

        // all_reduce(sum) of 1 + world rank + i: Σ over the members.
        std::vector<double> values(5);
        for (int i = 0; i < 5; ++i) {
            values[i] = 1.0 + world_rank + i;
        }
        Tensor x = Tensor::FromVector(values, {5}, DType::kFloat64);
        group->AllReduce(x, ReduceOp::kSum)->Wait();
        std::vector<double> sum(5, 0.0);
        for (int r : members) {
            for (int i = 0; i < 5; ++i) {
                sum[i] += 1.0 + r + i;
            }
        }
        EXPECT_EQ(x.ToDoubleVector(), sum);

        // all_gather of (world rank, world rank + 0.5): the members' pairs in group-rank order.
        Tensor in = Tensor::FromVector({double(world_rank), world_rank + 0.5}, {2}, DType::kFloat32);
        Tensor out = Tensor::Zeros({2 * n}, DType::kFloat32);
        group->AllGather(in, out)->Wait();
        std::vector<double> gathered;
        for (int r : members) {
            gathered.push_back(r);
            gathered.push_back(r + 0.5);
        }
        EXPECT_EQ(out.ToDoubleVector(), gathered);

        const comm::CollectiveCounts counts = group->Counts();
        EXPECT_EQ(counts.Calls(CollectiveKind::kAllReduce), 1);
        EXPECT_EQ(counts.Bytes(CollectiveKind::kAllReduce), 5 * 8);
        EXPECT_EQ(counts.Calls(CollectiveKind::kAllGather), 1);
        EXPECT_EQ(counts.Bytes(CollectiveKind::kAllGather), 2 * 4);
        EXPECT_EQ(counts.TotalCalls(), 2);
    }
    // Non-owning: the shardline communicator is gone, the test's MPI_Comm still works, and the test frees it.
    int one = 1;
    int total = 0;
    EXPECT_EQ(MPI_Allreduce(&one, &total, 1, MPI_INT, MPI_SUM, mine), MPI_SUCCESS);
    EXPECT_EQ(total, n);
    EXPECT_EQ(MPI_Comm_free(&mine), MPI_SUCCESS);
    EXPECT_EQ(mine, MPI_COMM_NULL);
}

TEST(MpiFromCommTest, TakeOwnershipFreesTheCommunicator) {
    MPI_Comm dup = MPI_COMM_NULL;
    ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
    auto group = comm::Communicator::FromMpiComm(dup, {.name = "owned dup", .take_ownership = true});
    Tensor x = Tensor::Full({3}, 2.0, DType::kFloat32);
    group->AllReduce(x, ReduceOp::kMax)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(3, 2.0));
    EXPECT_EQ(group->Counts().TotalCalls(), 1);
    group.reset(); // MPI_Comm_free(dup): a double free would be an MPI error at finalize
}

// The same mistake raises the same words on every backend: the message names the op, the expectation, the values and
// the group and rank (the NCCL path runs the same check in communicator.cc).
TEST(MpiFromCommTest, WrongAllGatherOutputSizeRaisesTheUnifiedMessage) {
    auto group = comm::Communicator::CreateMpiWorld("unified");
    const int p = group->size();
    Tensor in = Tensor::Zeros({4}, DType::kFloat32);
    Tensor out = Tensor::Zeros({4 * p + 1}, DType::kFloat32);
    try {
        group->AllGather(in, out);
        ADD_FAILURE() << "a wrong output size was accepted";
    } catch (const ShapeError &e) {
        EXPECT_THAT(e.what(), HasSubstr(fmt::format("all_gather: expected output to hold size·n = {}·4 = {} elements, "
                                                    "got {} (group 'unified', rank {} of {}, mpi)",
                                                    p, 4 * p, 4 * p + 1, group->rank(), p)));
    }
    EXPECT_EQ(group->Counts().TotalCalls(), 0);
    EXPECT_FALSE(group->aborted());
}

} // namespace
} // namespace shardline::testing
