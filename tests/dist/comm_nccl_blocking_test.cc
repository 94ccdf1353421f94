// Where the NCCL collectives run (issue 18 item 3): the communicators shardline creates issue them on a blocking NCCL
// communicator (a split of the non-blocking one made under the timeout), unless SHARDLINE_NCCL_BLOCKING=0. The other
// NCCL tests run on the default world, so every collective, split, int64 reduction, all_to_all_v and stream-ordering
// case already covers the blocking path; these tests check that the default really is blocking (through its host cost,
// which NCCL's thread per non-blocking group puts far apart), that the switch gives a working non-blocking world, and
// that a malformed value raises before anything collective.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>

#include "comm_nccl_helpers.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;
using Clock = std::chrono::steady_clock;

/// Sets SHARDLINE_NCCL_BLOCKING for the scope (it is read when a communicator is created) and restores it.
class BlockingEnv {
public:
    explicit BlockingEnv(const char* value) : previous_(env::Get("SHARDLINE_NCCL_BLOCKING")) {
        ::setenv("SHARDLINE_NCCL_BLOCKING", value, 1);
    }
    ~BlockingEnv() {
        if (previous_) {
            ::setenv("SHARDLINE_NCCL_BLOCKING", previous_->c_str(), 1);
        } else {
            ::unsetenv("SHARDLINE_NCCL_BLOCKING");
        }
    }
    BlockingEnv(const BlockingEnv&) = delete;
    BlockingEnv& operator=(const BlockingEnv&) = delete;

private:
    std::optional<std::string> previous_;
};

class NcclBlockingTest : public ::testing::Test {
protected:
    void SetUp() override { SHARDLINE_SKIP_WITHOUT_NCCL(); }
};

/// Host microseconds per AllReduce(t)->Wait(false) of 1 KiB, back to back: the median over 5 rounds of 200 calls.
double HostMicrosecondsPerCall(comm::Communicator& c) {
    Tensor t = InputTensor("host cost", c.rank(), 256, DType::kFloat32);
    for (int i = 0; i < 50; ++i) {
        c.AllReduce(t, ReduceOp::kMax)->Wait(false);
    }
    Synchronize(MyGpu());
    std::vector<double> rounds;
    for (int round = 0; round < 5; ++round) {
        const auto start = Clock::now();
        for (int i = 0; i < 200; ++i) {
            c.AllReduce(t, ReduceOp::kMax)->Wait(false);
        }
        rounds.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / 200);
        Synchronize(MyGpu());
    }
    std::sort(rounds.begin(), rounds.end());
    // max is idempotent: the values are still the inputs' maximum over ranks.
    EXPECT_TRUE(SameValues(t.ToDoubleVector(), ReduceOverRanks("host cost", c.size(), 256, ReduceOp::kMax)));
    return rounds[rounds.size() / 2];
}

// A non-blocking communicator's ncclGroupEnd starts an NCCL thread per call (NCCL >= 2.23): ~100 us per 1 KiB
// all_reduce on 4xH100, against ~15 us on a blocking one (docs/PERFORMANCE.md). 50 us separates the two with a margin
// of 3x on the blocking side; a default world whose collectives fell back to the non-blocking communicator fails.
TEST_F(NcclBlockingTest, DefaultWorldCostsWhatABlockingCommunicatorCostsPerCall) {
    if (const auto v = env::Get("SHARDLINE_NCCL_BLOCKING"); v && !env::ParseBool("SHARDLINE_NCCL_BLOCKING", *v)) {
        GTEST_SKIP() << "SHARDLINE_NCCL_BLOCKING=" << *v << " in the environment: the world is non-blocking";
    }
    comm::Communicator& world = Env().world();
    const double us = HostMicrosecondsPerCall(world);
    std::printf("[ measured ] rank %d: %.1f us per all_reduce(1 KiB)->Wait(false) on the default world\n", world.rank(),
                us);
    EXPECT_LT(us, 50.0) << "the default world's collectives cost what a non-blocking communicator's do";
}

// The switch: a world made with SHARDLINE_NCCL_BLOCKING=0 runs every kind of collective (even, uneven, int64,
// all_to_all_v) and splits, against the same expectations as the default world.
TEST_F(NcclBlockingTest, NonBlockingSwitchGivesAWorkingWorld) {
    std::unique_ptr<comm::Communicator> world;
    {
        BlockingEnv off("0");
        world = comm::Communicator::CreateNcclWorld(Env().host_world(), Env().local_rank(), "non-blocking world");
    }
    comm::Communicator& c = *world;
    const int n = c.size();
    Tensor t = InputTensor("nb all_reduce", c.rank(), 1001, DType::kFloat32);
    c.AllReduce(t, ReduceOp::kSum)->Wait(true);
    EXPECT_TRUE(SameValues(t.ToDoubleVector(), ReduceOverRanks("nb all_reduce", n, 1001, ReduceOp::kSum)));

    // int64 sum past 2^53: exact only as an integer reduction.
    const std::int64_t big = (std::int64_t{1} << 53) + 1;
    Tensor i64 = Tensor::Empty({1}, DType::kInt64, MyGpu());
    const std::int64_t mine = big + c.rank();
    ASSERT_EQ(cudaMemcpy(i64.data(), &mine, sizeof(mine), cudaMemcpyHostToDevice), cudaSuccess);
    c.AllReduce(i64, ReduceOp::kSum)->Wait(true);
    std::int64_t got = 0;
    ASSERT_EQ(cudaMemcpy(&got, i64.data(), sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, big * n + std::int64_t{n} * (n - 1) / 2);

    // all_to_all_v: rank r sends r + s + 1 elements to rank s, each the value 100·r + s.
    std::vector<std::int64_t> send(n);
    std::vector<std::int64_t> recv(n);
    std::vector<double> in;
    std::vector<double> expected;
    for (int s = 0; s < n; ++s) {
        send[s] = c.rank() + s + 1;
        recv[s] = s + c.rank() + 1;
        in.insert(in.end(), static_cast<std::size_t>(send[s]), 100.0 * c.rank() + s);
        expected.insert(expected.end(), static_cast<std::size_t>(recv[s]), 100.0 * s + c.rank());
    }
    Tensor a2a_in = Tensor::FromVector(in, {static_cast<std::int64_t>(in.size())}, DType::kFloat32).To(MyGpu());
    Tensor a2a_out = Tensor::Empty({static_cast<std::int64_t>(expected.size())}, DType::kFloat32, MyGpu());
    c.AllToAllV(a2a_in, send, a2a_out, recv)->Wait(true);
    EXPECT_TRUE(SameValues(a2a_out.ToDoubleVector(), expected));

    // Split: halves by rank parity, then a sum over each half.
    std::unique_ptr<comm::Communicator> half;
    {
        BlockingEnv off("0");
        half = c.Split(c.rank() % 2, c.rank(), "non-blocking half");
    }
    Tensor h = Tensor::Full({5}, static_cast<double>(c.rank()), DType::kFloat32, MyGpu());
    half->AllReduce(h, ReduceOp::kSum)->Wait(true);
    double sum = 0;
    for (int r = c.rank() % 2; r < n; r += 2) {
        sum += r;
    }
    EXPECT_TRUE(SameValues(h.ToDoubleVector(), std::vector<double>(5, sum)));
    EXPECT_FALSE(c.aborted());
    half.reset();
    world.reset();
}

TEST_F(NcclBlockingTest, MalformedSwitchRaisesBeforeAnythingCollective) {
    BlockingEnv bad("maybe");
    try {
        (void)comm::Communicator::CreateNcclWorld(Env().host_world(), Env().local_rank(), "never");
        ADD_FAILURE() << "SHARDLINE_NCCL_BLOCKING=maybe was accepted";
    } catch (const Error& e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("SHARDLINE_NCCL_BLOCKING"));
        EXPECT_THAT(e.what(), ::testing::HasSubstr("maybe"));
    }
}

} // namespace
} // namespace shardline::testing
