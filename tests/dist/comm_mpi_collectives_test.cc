// Every collective of the MPI backend against an expectation each rank computes locally from every rank's input
// (integer-valued data, so float32 and float64 sums are exact whatever order MPI reduces in).

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

comm::Communicator &World() { return DistEnv().world(); }

double Reduce(ReduceOp op, const std::vector<double> &v) {
    switch (op) {
    case ReduceOp::kSum:
        return std::accumulate(v.begin(), v.end(), 0.0);
    case ReduceOp::kAvg:
        return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    case ReduceOp::kMax:
        return *std::max_element(v.begin(), v.end());
    case ReduceOp::kMin:
        return *std::min_element(v.begin(), v.end());
    }
    return 0;
}

// Elementwise op over the ranks' inputs.
std::vector<double> ReduceAcrossRanks(ReduceOp op, const std::vector<std::vector<double>> &inputs) {
    const std::size_t n = inputs.front().size();
    std::vector<double> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        std::vector<double> column;
        for (const auto &in : inputs) {
            column.push_back(in[i]);
        }
        out[i] = Reduce(op, column);
    }
    return out;
}

// Exact for sum/max/min of integers; avg divides by the world size once (power of two in CI, exact too), and a
// relative 1e-6 covers other sizes in float32.
void ExpectValues(const std::vector<double> &actual, const std::vector<double> &expected, DType dtype) {
    ASSERT_EQ(actual.size(), expected.size());
    const double rtol = dtype == DType::kFloat32 ? 1e-6 : 1e-14;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        ASSERT_NEAR(actual[i], expected[i], rtol * std::abs(expected[i])) << "element " << i;
    }
}

std::vector<std::vector<double>> AllInputs(int size, std::int64_t n, DType dtype, std::uint64_t salt) {
    std::vector<std::vector<double>> inputs;
    for (int r = 0; r < size; ++r) {
        inputs.push_back(RankValues(r, n, dtype, salt));
    }
    return inputs;
}

TEST(MpiCollectivesTest, AllReduceComputesEveryOpInEveryDType) {
    auto &world = World();
    for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
            for (std::int64_t n : {0, 1, 7, 1000, 1 << 17}) {
                SCOPED_TRACE(fmt::format("{} {} n={}", DTypeName(dtype), comm::ReduceOpName(op), n));
                Tensor x = RankInput(world.rank(), n, dtype, 1);
                world.AllReduce(x, op)->Wait();
                ExpectValues(x.ToDoubleVector(), ReduceAcrossRanks(op, AllInputs(world.size(), n, dtype, 1)), dtype);
            }
        }
    }
}

TEST(MpiCollectivesTest, AllGatherConcatenatesRankBlocksInRankOrder) {
    auto &world = World();
    for (DType dtype : kDTypes) {
        for (std::int64_t n : {0, 1, 5, 4096}) {
            SCOPED_TRACE(fmt::format("{} n={}", DTypeName(dtype), n));
            Tensor x = RankInput(world.rank(), n, dtype, 2);
            Tensor out = Tensor::Full({n * world.size()}, -100.0, dtype);
            world.AllGather(x, out)->Wait();
            std::vector<double> expected;
            for (const auto &in : AllInputs(world.size(), n, dtype, 2)) {
                expected.insert(expected.end(), in.begin(), in.end());
            }
            ExpectValues(out.ToDoubleVector(), expected, dtype);
        }
    }
}

TEST(MpiCollectivesTest, AllGatherAcceptsTheOwnBlockOfTheOutputAsInput) {
    auto &world = World();
    const std::int64_t n = 6;
    Tensor out = Tensor::Zeros({n * world.size()}, DType::kFloat32);
    auto *block = static_cast<float *>(out.data()) + n * world.rank();
    Tensor mine = RankInput(world.rank(), n, DType::kFloat32, 3);
    std::copy_n(static_cast<const float *>(mine.data()), n, block);
    Tensor in = Tensor::FromBlob(block, {n}, DType::kFloat32, Device::CPU());
    world.AllGather(in, out)->Wait();
    std::vector<double> expected;
    for (const auto &v : AllInputs(world.size(), n, DType::kFloat32, 3)) {
        expected.insert(expected.end(), v.begin(), v.end());
    }
    ExpectValues(out.ToDoubleVector(), expected, DType::kFloat32);
}

// Uneven blocks, rank 1's empty: counts = {3, 0, 5, 1, ...}.
std::vector<std::int64_t> UnevenCounts(int size) {
    std::vector<std::int64_t> counts;
    for (int r = 0; r < size; ++r) {
        counts.push_back(r == 1 ? 0 : (3 + 2 * r) % 7);
    }
    return counts;
}

TEST(MpiCollectivesTest, AllGatherVConcatenatesUnevenAndEmptyBlocks) {
    auto &world = World();
    const auto counts = UnevenCounts(world.size());
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    for (DType dtype : kDTypes) {
        SCOPED_TRACE(DTypeName(dtype));
        Tensor x = RankInput(world.rank(), counts[world.rank()], dtype, 4);
        Tensor out = Tensor::Full({total}, -100.0, dtype);
        world.AllGatherV(x, out, counts)->Wait();
        std::vector<double> expected;
        for (int r = 0; r < world.size(); ++r) {
            const auto v = RankValues(r, counts[r], dtype, 4);
            expected.insert(expected.end(), v.begin(), v.end());
        }
        ExpectValues(out.ToDoubleVector(), expected, dtype);
    }
}

TEST(MpiCollectivesTest, ReduceScatterGivesEachRankItsReducedBlock) {
    auto &world = World();
    for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
            for (std::int64_t n : {0, 1, 9, 2048}) {
                SCOPED_TRACE(fmt::format("{} {} n={}", DTypeName(dtype), comm::ReduceOpName(op), n));
                Tensor x = RankInput(world.rank(), n * world.size(), dtype, 5);
                Tensor out = Tensor::Full({n}, -100.0, dtype);
                world.ReduceScatter(x, out, op)->Wait();
                const auto full = ReduceAcrossRanks(op, AllInputs(world.size(), n * world.size(), dtype, 5));
                const std::vector<double> expected(full.begin() + n * world.rank(),
                                                   full.begin() + n * (world.rank() + 1));
                ExpectValues(out.ToDoubleVector(), expected, dtype);
            }
        }
    }
}

TEST(MpiCollectivesTest, ReduceScatterInPlaceLeavesEachRankItsReducedBlockInsideTheInput) {
    // NCCL's in-place form: the output is this rank's block of the input (MPI_IN_PLACE underneath).
    auto &world = World();
    for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
            for (std::int64_t n : {1, 9, 2048}) {
                SCOPED_TRACE(fmt::format("{} {} n={}", DTypeName(dtype), comm::ReduceOpName(op), n));
                Tensor x = RankInput(world.rank(), n * world.size(), dtype, 6);
                Tensor block = Tensor::FromBlob(static_cast<char *>(x.data()) +
                                                    n * world.rank() * static_cast<std::int64_t>(ElementSize(dtype)),
                                                {n}, dtype, x.device());
                const std::int64_t before = world.Counts().Calls(comm::CollectiveKind::kReduceScatter);
                world.ReduceScatter(x, block, op)->Wait();
                EXPECT_EQ(world.Counts().Calls(comm::CollectiveKind::kReduceScatter), before + 1);
                const auto full = ReduceAcrossRanks(op, AllInputs(world.size(), n * world.size(), dtype, 6));
                const std::vector<double> expected(full.begin() + n * world.rank(),
                                                   full.begin() + n * (world.rank() + 1));
                ExpectValues(block.ToDoubleVector(), expected, dtype);
            }
        }
    }
}

TEST(MpiCollectivesTest, ReduceScatterVGivesEachRankItsUnevenBlock) {
    auto &world = World();
    const auto counts = UnevenCounts(world.size());
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    const std::int64_t offset = std::accumulate(counts.begin(), counts.begin() + world.rank(), std::int64_t{0});
    for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
            SCOPED_TRACE(fmt::format("{} {}", DTypeName(dtype), comm::ReduceOpName(op)));
            Tensor x = RankInput(world.rank(), total, dtype, 6);
            Tensor out = Tensor::Full({counts[world.rank()]}, -100.0, dtype);
            world.ReduceScatterV(x, out, counts, op)->Wait();
            const auto full = ReduceAcrossRanks(op, AllInputs(world.size(), total, dtype, 6));
            const std::vector<double> expected(full.begin() + offset, full.begin() + offset + counts[world.rank()]);
            ExpectValues(out.ToDoubleVector(), expected, dtype);
        }
    }
}

TEST(MpiCollectivesTest, AllToAllSendsBlockRToRankR) {
    auto &world = World();
    const int p = world.size();
    for (DType dtype : kDTypes) {
        for (std::int64_t block : {0, 1, 3, 1024}) {
            SCOPED_TRACE(fmt::format("{} block={}", DTypeName(dtype), block));
            Tensor x = RankInput(world.rank(), block * p, dtype, 7);
            Tensor out = Tensor::Full({block * p}, -100.0, dtype);
            world.AllToAll(x, out)->Wait();
            // Output block s is sender s's block `rank`.
            std::vector<double> expected;
            for (int s = 0; s < p; ++s) {
                const auto v = RankValues(s, block * p, dtype, 7);
                expected.insert(expected.end(), v.begin() + block * world.rank(),
                                v.begin() + block * (world.rank() + 1));
            }
            ExpectValues(out.ToDoubleVector(), expected, dtype);
        }
    }
}

// Rank s sends (s + 2d) % 3 elements to rank d: some pairs exchange nothing.
std::int64_t PairCount(int s, int d) { return (s + 2 * d) % 3; }

TEST(MpiCollectivesTest, AllToAllVExchangesUnevenAndEmptyBlocks) {
    auto &world = World();
    const int p = world.size();
    const int me = world.rank();
    std::vector<std::int64_t> send(p);
    std::vector<std::int64_t> recv(p);
    for (int r = 0; r < p; ++r) {
        send[r] = PairCount(me, r);
        recv[r] = PairCount(r, me);
    }
    const std::int64_t send_total = std::accumulate(send.begin(), send.end(), std::int64_t{0});
    const std::int64_t recv_total = std::accumulate(recv.begin(), recv.end(), std::int64_t{0});
    for (DType dtype : kDTypes) {
        SCOPED_TRACE(DTypeName(dtype));
        Tensor x = RankInput(me, send_total, dtype, 8);
        Tensor out = Tensor::Full({recv_total}, -100.0, dtype);
        world.AllToAllV(x, send, out, recv)->Wait();
        std::vector<double> expected;
        for (int s = 0; s < p; ++s) {
            std::int64_t offset = 0;
            for (int d = 0; d < me; ++d) {
                offset += PairCount(s, d);
            }
            std::int64_t sender_total = 0;
            for (int d = 0; d < p; ++d) {
                sender_total += PairCount(s, d);
            }
            const auto v = RankValues(s, sender_total, dtype, 8);
            expected.insert(expected.end(), v.begin() + offset, v.begin() + offset + PairCount(s, me));
        }
        ExpectValues(out.ToDoubleVector(), expected, dtype);
    }
}

TEST(MpiCollectivesTest, BroadcastCopiesTheRootTensorFromEveryRoot) {
    auto &world = World();
    for (DType dtype : kDTypes) {
        for (int root = 0; root < world.size(); ++root) {
            for (std::int64_t n : {0, 1, 3000}) {
                SCOPED_TRACE(fmt::format("{} root={} n={}", DTypeName(dtype), root, n));
                Tensor x = RankInput(world.rank(), n, dtype, 9);
                world.Broadcast(x, root)->Wait();
                ExpectValues(x.ToDoubleVector(), RankValues(root, n, dtype, 9), dtype);
            }
        }
    }
}

TEST(MpiCollectivesTest, BarrierCompletesOnEveryRank) {
    auto &world = World();
    for (int i = 0; i < 3; ++i) {
        world.Barrier()->Wait();
    }
    EXPECT_FALSE(world.aborted());
    EXPECT_EQ(world.backend(), "mpi");
    EXPECT_EQ(world.device_type(), DeviceType::kCPU);
}

// int64 moves exactly (counts past 2^53, where a float64 would round): sum, max, min, all-to-all-v of counts, gather,
// broadcast; avg is refused (an integer average would truncate).
std::vector<std::int64_t> Int64Values(const Tensor &t) {
    const auto *p = static_cast<const std::int64_t *>(t.data());
    return {p, p + t.numel()};
}

Tensor Int64Tensor(const std::vector<std::int64_t> &v) {
    Tensor t = Tensor::Zeros({static_cast<std::int64_t>(v.size())}, DType::kInt64);
    std::copy(v.begin(), v.end(), static_cast<std::int64_t *>(t.data()));
    return t;
}

TEST(MpiCollectivesTest, Int64CollectivesAreExactPastTwoToThe53) {
    auto &world = World();
    const std::int64_t p = world.size();
    const std::int64_t me = world.rank();
    const std::int64_t big = (std::int64_t{1} << 58) + 1; // not a float64; big·p fits for p ≤ 16
    Tensor x = Int64Tensor({big, me + 1, -3 * me});
    world.AllReduce(x, ReduceOp::kSum)->Wait();
    EXPECT_EQ(Int64Values(x), (std::vector<std::int64_t>{big * p, p * (p + 1) / 2, -3 * p * (p - 1) / 2}));
    Tensor m = Int64Tensor({big + me, -me});
    world.AllReduce(m, ReduceOp::kMax)->Wait();
    EXPECT_EQ(Int64Values(m), (std::vector<std::int64_t>{big + p - 1, 0}));
    Tensor n = Int64Tensor({big + me, -me});
    world.AllReduce(n, ReduceOp::kMin)->Wait();
    EXPECT_EQ(Int64Values(n), (std::vector<std::int64_t>{big, 1 - p}));
    EXPECT_THROW(world.AllReduce(n, ReduceOp::kAvg), DTypeError);

    // The MoE dispatcher's exchange: rank me sends count (me·p + r) + big to rank r, one per rank.
    std::vector<std::int64_t> counts(p);
    for (std::int64_t r = 0; r < p; ++r) {
        counts[r] = big + me * p + r;
    }
    Tensor send = Int64Tensor(counts);
    Tensor recv = Tensor::Zeros({p}, DType::kInt64);
    world.AllToAll(send, recv)->Wait();
    std::vector<std::int64_t> expected(p);
    for (std::int64_t r = 0; r < p; ++r) {
        expected[r] = big + r * p + me;
    }
    EXPECT_EQ(Int64Values(recv), expected);
    Tensor recv_v = Tensor::Zeros({p}, DType::kInt64);
    world.AllToAllV(send, std::vector<std::int64_t>(p, 1), recv_v, std::vector<std::int64_t>(p, 1))->Wait();
    EXPECT_EQ(Int64Values(recv_v), expected);

    Tensor gathered = Tensor::Zeros({p}, DType::kInt64);
    world.AllGather(Int64Tensor({big - me}), gathered)->Wait();
    std::vector<std::int64_t> all(p);
    for (std::int64_t r = 0; r < p; ++r) {
        all[r] = big - r;
    }
    EXPECT_EQ(Int64Values(gathered), all);
    Tensor b = Int64Tensor({me == p - 1 ? big : 0});
    world.Broadcast(b, static_cast<int>(p - 1))->Wait();
    EXPECT_EQ(Int64Values(b), (std::vector<std::int64_t>{big}));
}

} // namespace
} // namespace shardline::testing
