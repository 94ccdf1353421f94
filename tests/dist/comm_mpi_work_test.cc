// Work handles of the MPI backend: Test/Wait semantics, several works in flight, handles that outlive or are dropped
// before completion, Abort, and the timeout's CommError.

#include <chrono>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;
using ::testing::HasSubstr;

std::vector<double> SumOverRanks(int size, std::int64_t n, DType dtype, std::uint64_t salt) {
    std::vector<double> sum(n, 0.0);
    for (int r = 0; r < size; ++r) {
        const auto v = RankValues(r, n, dtype, salt);
        for (std::int64_t i = 0; i < n; ++i) {
            sum[i] += v[i];
        }
    }
    return sum;
}

TEST(MpiWorkTest, TestTurnsTrueOnceDoneAndWaitAfterwardsReturnsAtOnce) {
    auto &world = DistEnv().world();
    const std::int64_t n = 1 << 16;
    Tensor x = RankInput(world.rank(), n, DType::kFloat32, 30);
    auto work = world.AllReduce(x, ReduceOp::kSum);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    bool done = false;
    while (!(done = work->Test()) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ASSERT_TRUE(done);
    EXPECT_TRUE(work->Test());
    work->Wait();
    work->Wait(/*host=*/true);
    EXPECT_EQ(x.ToDoubleVector(), SumOverRanks(world.size(), n, DType::kFloat32, 30));
}

TEST(MpiWorkTest, SeveralWorksInFlightCompleteWhateverTheWaitOrder) {
    auto &world = DistEnv().world();
    std::vector<Tensor> xs;
    std::vector<comm::WorkHandle> works;
    for (int i = 0; i < 4; ++i) {
        xs.push_back(RankInput(world.rank(), 1000 + i, DType::kFloat64, 31 + i));
        works.push_back(world.AllReduce(xs.back(), ReduceOp::kSum));
    }
    for (int i = 3; i >= 0; --i) {
        works[i]->Wait();
    }
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(xs[i].ToDoubleVector(), SumOverRanks(world.size(), 1000 + i, DType::kFloat64, 31 + i)) << i;
    }
}

TEST(MpiWorkTest, AvgIsAppliedWhenTheWorkCompletes) {
    auto &world = DistEnv().world();
    Tensor x = Tensor::Full({5}, 2.0 * (world.rank() + 1), DType::kFloat32);
    world.AllReduce(x, ReduceOp::kAvg)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(5, world.size() + 1.0));
}

TEST(MpiWorkTest, AWorkOutlivesItsCommunicator) {
    auto &world = DistEnv().world();
    auto group = world.Split(0, world.rank(), "short-lived");
    ASSERT_NE(group, nullptr);
    Tensor x = RankInput(world.rank(), 4096, DType::kFloat32, 35);
    auto work = group->AllReduce(x, ReduceOp::kSum);
    group.reset();
    work->Wait();
    EXPECT_EQ(x.ToDoubleVector(), SumOverRanks(world.size(), 4096, DType::kFloat32, 35));
}

TEST(MpiWorkTest, ADroppedHandleStillCompletesAndLaterCollectivesWork) {
    auto &world = DistEnv().world();
    Tensor dropped = RankInput(world.rank(), 2048, DType::kFloat32, 36);
    (void)world.AllReduce(dropped, ReduceOp::kSum); // handle dropped in flight: kept alive by the communicator
    Tensor x = RankInput(world.rank(), 16, DType::kFloat32, 37);
    world.AllReduce(x, ReduceOp::kSum)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), SumOverRanks(world.size(), 16, DType::kFloat32, 37));
    // MPI defines a nonblocking collective's buffer only once its request has completed, and a dropped handle's request
    // completes when the communicator's progress (MPI_Test of its orphans at each later call) reaches it, not at a
    // fixed point: later calls may finish first (on an H100 host's 16 cores, rank 3 of 4 once read the buffer after
    // the barrier but before the dropped all-reduce's last round). So later collectives drive it, and the ranks agree
    // (a min all-reduce) on when every rank sees the result, within a bound.
    const std::vector<double> want = SumOverRanks(world.size(), 2048, DType::kFloat32, 36);
    bool everywhere = false;
    for (int round = 0; round < 1000 && !everywhere; ++round) {
        Tensor done = Tensor::Full({1}, dropped.ToDoubleVector() == want ? 1.0 : 0.0, DType::kFloat32);
        world.AllReduce(done, ReduceOp::kMin)->Wait();
        everywhere = done.ToDoubleVector().at(0) == 1.0;
    }
    EXPECT_EQ(dropped.ToDoubleVector(), want);
}

TEST(MpiWorkTest, AbortMakesEveryLaterCallRaiseAtOnce) {
    auto &world = DistEnv().world();
    auto group = world.Split(0, world.rank(), "to abort");
    ASSERT_NE(group, nullptr);
    Tensor x = Tensor::Zeros({4}, DType::kFloat32);
    group->AllReduce(x, ReduceOp::kSum)->Wait();
    group->Abort();
    group->Abort(); // idempotent
    EXPECT_TRUE(group->aborted());
    const auto start = std::chrono::steady_clock::now();
    try {
        group->AllReduce(x, ReduceOp::kSum);
        ADD_FAILURE() << "AllReduce on an aborted communicator did not raise";
    } catch (const CommError &e) {
        EXPECT_THAT(e.what(), HasSubstr("aborted"));
        EXPECT_THAT(e.what(), HasSubstr("to abort"));
    }
    EXPECT_THROW(group->Barrier(), CommError);
    EXPECT_THROW(group->Split(0, 0, "child"), CommError);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
    EXPECT_EQ(group->Counts().Calls(comm::CollectiveKind::kAllReduce), 1);
    EXPECT_EQ(group->rank(), world.rank());
}

// Rank 0 joins late: the others time out after 0.3 s with a CommError naming op, seq, count, group and elapsed time;
// then rank 0 joins, so MPI's pending requests complete and nothing is left in flight.
TEST(MpiWorkTest, TimeoutRaisesCommErrorNamingOpSeqCountGroupAndElapsed) {
    auto &env = DistEnv();
    auto &world = env.world();
    auto group = world.Split(0, world.rank(), "timeout group");
    ASSERT_NE(group, nullptr);
    Tensor warmup = Tensor::Zeros({1}, DType::kFloat32);
    group->AllReduce(warmup, ReduceOp::kSum)->Wait(); // seq 1
    Tensor x = Tensor::Full({12}, 1.0, DType::kFloat32);
    comm::SetCommTimeout(std::chrono::milliseconds(300));
    if (world.rank() != 0) {
        auto work = group->AllReduce(x, ReduceOp::kSum); // seq 2
        const auto start = std::chrono::steady_clock::now();
        try {
            work->Wait();
            ADD_FAILURE() << "Wait did not time out";
        } catch (const CommError &e) {
            const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            EXPECT_GE(elapsed, 0.25);
            EXPECT_LT(elapsed, 5.0);
            EXPECT_THAT(e.what(), HasSubstr("all_reduce"));
            EXPECT_THAT(e.what(), HasSubstr("seq 2"));
            EXPECT_THAT(e.what(), HasSubstr("count 12 float32"));
            EXPECT_THAT(e.what(), HasSubstr("'timeout group'"));
            EXPECT_THAT(e.what(), HasSubstr("elapsed 0."));
            EXPECT_THAT(e.what(), HasSubstr(fmt::format("[rank {}/{}]", world.rank(), world.size())));
        }
        EXPECT_TRUE(group->aborted());
        EXPECT_THROW(work->Wait(), CommError);
        EXPECT_THROW(group->Barrier(), CommError);
    }
    comm::SetCommTimeout(std::chrono::milliseconds(0));
    env.host_world().Barrier()->Wait();
    if (world.rank() == 0) {
        group->AllReduce(x, ReduceOp::kSum)->Wait();
        EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(12, world.size()));
        EXPECT_FALSE(group->aborted());
    }
    // The others' abandoned requests complete while they poll the host world.
    env.host_world().Barrier()->Wait();
}

} // namespace
} // namespace shardline::testing
