// The NCCL communicator's collectives against float64 expectations: every rank rebuilds every rank's input from the
// counter RNG, so each rank checks its own output without a gather. Even and uneven sizes, float32/float16/bfloat16,
// every ReduceOp; exact collective counts; stream ordering; sub-communicators on a 2x2 grid; argument errors.

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>

#include "comm_nccl_helpers.h"

namespace shardline::testing {
namespace {

using comm::CollectiveKind;
using comm::ReduceOp;

comm::Communicator& World() { return Env().world(); }

const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

class NcclCollectiveTest : public ::testing::TestWithParam<DType> {
protected:
    void SetUp() override { SHARDLINE_SKIP_WITHOUT_NCCL(); }
};

// Sizes: a small odd count (no vector width divides it) and 1 Mi elements (several NCCL channels and chunks).
const std::vector<std::int64_t> kSizes = {1001, 1 << 20};

TEST_P(NcclCollectiveTest, AllReduceMatchesEveryReduceOp) {
    comm::Communicator& world = World();
    for (std::int64_t n : kSizes) {
        for (ReduceOp op : kOps) {
            const std::string what = fmt::format("all_reduce/{}/{}", n, ReduceOpName(op));
            Tensor t = InputTensor(what, world.rank(), n, GetParam());
            world.AllReduce(t, op)->Wait();
            EXPECT_TRUE(SameValues(t.ToDoubleVector(), ReduceOverRanks(what, world.size(), n, op)))
                << what << " " << DTypeName(GetParam());
        }
    }
}

TEST_P(NcclCollectiveTest, AllGatherConcatenatesRankBlocks) {
    comm::Communicator& world = World();
    const std::int64_t n = 777;
    const std::string what = "all_gather";
    Tensor in = InputTensor(what, world.rank(), n, GetParam());
    Tensor out = Tensor::Empty({n * world.size()}, GetParam(), MyGpu());
    world.AllGather(in, out)->Wait();
    std::vector<double> expected;
    for (int r = 0; r < world.size(); ++r) {
        const auto v = InputValues(what, r, n);
        expected.insert(expected.end(), v.begin(), v.end());
    }
    EXPECT_TRUE(SameValues(out.ToDoubleVector(), expected));
}

std::vector<std::int64_t> UnevenCounts(int size) {
    // Rank 1 contributes nothing: a zero-sized block must not stall the group.
    std::vector<std::int64_t> counts(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
        counts[r] = r == 1 ? 0 : 7 + 13 * r;
    }
    return counts;
}

TEST_P(NcclCollectiveTest, AllGatherVPlacesUnevenBlocks) {
    comm::Communicator& world = World();
    const auto counts = UnevenCounts(world.size());
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    const std::string what = "all_gather_v";
    Tensor in = InputTensor(what, world.rank(), counts[world.rank()], GetParam());
    Tensor out = Tensor::Full({total}, 99.0, GetParam(), MyGpu());
    world.AllGatherV(in, out, counts)->Wait();
    std::vector<double> expected;
    for (int r = 0; r < world.size(); ++r) {
        const auto v = InputValues(what, r, counts[r]);
        expected.insert(expected.end(), v.begin(), v.end());
    }
    EXPECT_TRUE(SameValues(out.ToDoubleVector(), expected));
}

TEST_P(NcclCollectiveTest, ReduceScatterMatchesEveryReduceOp) {
    comm::Communicator& world = World();
    const std::int64_t n = 513; // per rank
    for (ReduceOp op : kOps) {
        const std::string what = fmt::format("reduce_scatter/{}", ReduceOpName(op));
        Tensor in = InputTensor(what, world.rank(), n * world.size(), GetParam());
        Tensor out = Tensor::Empty({n}, GetParam(), MyGpu());
        world.ReduceScatter(in, out, op)->Wait();
        EXPECT_TRUE(SameValues(out.ToDoubleVector(),
                               ReduceOverRanks(what, world.size(), n, op, n * world.rank(), n * world.size())))
            << ReduceOpName(op);
    }
}

TEST_P(NcclCollectiveTest, ReduceScatterVMatchesEveryReduceOp) {
    comm::Communicator& world = World();
    const auto counts = UnevenCounts(world.size());
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    const std::int64_t offset = std::accumulate(counts.begin(), counts.begin() + world.rank(), std::int64_t{0});
    for (ReduceOp op : kOps) {
        const std::string what = fmt::format("reduce_scatter_v/{}", ReduceOpName(op));
        Tensor in = InputTensor(what, world.rank(), total, GetParam());
        Tensor out = Tensor::Empty({counts[world.rank()]}, GetParam(), MyGpu());
        world.ReduceScatterV(in, out, counts, op)->Wait();
        EXPECT_TRUE(SameValues(out.ToDoubleVector(),
                               ReduceOverRanks(what, world.size(), counts[world.rank()], op, offset, total)))
            << ReduceOpName(op);
    }
}

TEST_P(NcclCollectiveTest, AllToAllExchangesBlocks) {
    comm::Communicator& world = World();
    const std::int64_t block = 101;
    const int n = world.size();
    const std::string what = "all_to_all";
    Tensor in = InputTensor(what, world.rank(), block * n, GetParam());
    Tensor out = Tensor::Empty({block * n}, GetParam(), MyGpu());
    world.AllToAll(in, out)->Wait();
    // Block r of the output is block `rank` of rank r's input.
    std::vector<double> expected;
    for (int r = 0; r < n; ++r) {
        const auto v = InputValues(what, r, block * n);
        expected.insert(expected.end(), v.begin() + block * world.rank(), v.begin() + block * (world.rank() + 1));
    }
    EXPECT_TRUE(SameValues(out.ToDoubleVector(), expected));
}

/// Elements rank i sends to rank r (some zero).
std::int64_t SendCount(int i, int r) { return (i + 2 * r) % 5 * 3; }

TEST_P(NcclCollectiveTest, AllToAllVExchangesUnevenBlocks) {
    comm::Communicator& world = World();
    const int n = world.size();
    const int me = world.rank();
    std::vector<std::int64_t> send(n);
    std::vector<std::int64_t> recv(n);
    for (int r = 0; r < n; ++r) {
        send[r] = SendCount(me, r);
        recv[r] = SendCount(r, me);
    }
    const std::int64_t sent = std::accumulate(send.begin(), send.end(), std::int64_t{0});
    const std::int64_t received = std::accumulate(recv.begin(), recv.end(), std::int64_t{0});
    const std::string what = "all_to_all_v";
    Tensor in = InputTensor(what, me, sent, GetParam());
    Tensor out = Tensor::Full({received}, 99.0, GetParam(), MyGpu());
    world.AllToAllV(in, send, out, recv)->Wait();
    std::vector<double> expected;
    for (int r = 0; r < n; ++r) {
        std::int64_t their_sent = 0;
        std::int64_t offset = 0;
        for (int d = 0; d < n; ++d) {
            if (d == me) {
                offset = their_sent;
            }
            their_sent += SendCount(r, d);
        }
        const auto v = InputValues(what, r, their_sent);
        expected.insert(expected.end(), v.begin() + offset, v.begin() + offset + SendCount(r, me));
    }
    EXPECT_TRUE(SameValues(out.ToDoubleVector(), expected));
}

TEST_P(NcclCollectiveTest, BroadcastCopiesRootFromEveryRoot) {
    comm::Communicator& world = World();
    const std::int64_t n = 4099;
    for (int root = 0; root < world.size(); ++root) {
        const std::string what = fmt::format("broadcast/{}", root);
        Tensor t = InputTensor(what, world.rank(), n, GetParam());
        world.Broadcast(t, root)->Wait();
        EXPECT_TRUE(SameValues(t.ToDoubleVector(), InputValues(what, root, n))) << "root " << root;
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclCollectiveTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16), DTypeParamName);

class NcclCommunicatorTest : public ::testing::Test {
protected:
    void SetUp() override { SHARDLINE_SKIP_WITHOUT_NCCL(); }
};

TEST_F(NcclCommunicatorTest, CountsEveryCollectiveExactly) {
    comm::Communicator& world = World();
    const int n = world.size();
    world.ResetCounts();
    const DType dt = DType::kBFloat16; // 2 bytes
    Tensor a = InputTensor("counts/a", world.rank(), 64, dt);
    Tensor gathered = Tensor::Empty({64 * n}, dt, MyGpu());
    Tensor scattered = Tensor::Empty({64 / n}, dt, MyGpu());
    Tensor exchanged = Tensor::Empty({64}, dt, MyGpu());
    world.AllReduce(a, ReduceOp::kSum)->Wait();
    world.AllReduce(a, ReduceOp::kMax)->Wait();
    world.AllGather(a, gathered)->Wait();
    world.ReduceScatter(a, scattered, ReduceOp::kSum)->Wait();
    world.AllToAll(a, exchanged)->Wait(true);
    world.Broadcast(a, 0)->Wait();
    world.Barrier()->Wait(true);
    const comm::CollectiveCounts c = world.Counts();
    EXPECT_EQ(c.Calls(CollectiveKind::kAllReduce), 2);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllReduce), 2 * 64 * 2);
    EXPECT_EQ(c.Calls(CollectiveKind::kAllGather), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllGather), 64 * 2);
    EXPECT_EQ(c.Calls(CollectiveKind::kReduceScatter), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kReduceScatter), 64 * 2);
    EXPECT_EQ(c.Calls(CollectiveKind::kAllToAll), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kAllToAll), 64 * 2);
    EXPECT_EQ(c.Calls(CollectiveKind::kBroadcast), 1);
    EXPECT_EQ(c.Calls(CollectiveKind::kBarrier), 1);
    EXPECT_EQ(c.Bytes(CollectiveKind::kBarrier), 0);
    EXPECT_EQ(c.TotalCalls(), 7);
}

// The result is consumed by a kernel on the compute stream (a dtype cast) with no host synchronisation in between.
// Rank 0 joins late, so the collective finishes long after the others have queued their cast: without the
// done-event wait they would cast the input, not the sum.
TEST_F(NcclCommunicatorTest, ComputeStreamConsumesResultWithoutHostSync) {
    comm::Communicator& world = World();
    const std::int64_t n = 8 << 20; // 32 MiB of float32
    const std::string what = "ordering";
    Tensor t = InputTensor(what, world.rank(), n, DType::kFloat32);
    // The input is ready on the compute stream; wait for it on the host so the delay below is the only skew.
    Synchronize(MyGpu());
    if (world.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    comm::WorkHandle work = world.AllReduce(t, ReduceOp::kSum);
    work->Wait(/*host=*/false);
    Tensor consumed = t.To(DType::kFloat16); // a kernel on the compute stream
    t = Tensor();                            // the input's memory is freed stream-ordered: must stay valid
    const std::vector<double> got = consumed.ToDoubleVector();
    EXPECT_TRUE(SameValues(got, ReduceOverRanks(what, world.size(), n, ReduceOp::kSum)));
    EXPECT_TRUE(work->Test());
}

TEST_F(NcclCommunicatorTest, ManyCollectivesInFlightWithoutWaiting) {
    comm::Communicator& world = World();
    const std::int64_t n = 4096;
    std::vector<Tensor> tensors;
    std::vector<comm::WorkHandle> works;
    for (int i = 0; i < 64; ++i) {
        tensors.push_back(InputTensor(fmt::format("inflight/{}", i), world.rank(), n, DType::kFloat32));
        works.push_back(world.AllReduce(tensors.back(), ReduceOp::kSum));
    }
    for (auto& w : works) {
        w->Wait();
    }
    for (int i = 0; i < 64; ++i) {
        EXPECT_TRUE(SameValues(tensors[i].ToDoubleVector(),
                               ReduceOverRanks(fmt::format("inflight/{}", i), world.size(), n, ReduceOp::kSum)))
            << i;
    }
}

// Handles dropped at once (no Wait): the watchdog alone retires the work and releases the tensors it kept. It retires
// the finished prefix of its list (done-events complete in issue order), polls on its own period while busy and sleeps
// without a deadline once idle, woken by the next call only then (watchdog_wake.h): a burst of 256 calls must all be
// retired, and so must one call issued after the watchdog has gone to sleep (were that wake-up missing, its tensor
// would stay kept forever).
TEST_F(NcclCommunicatorTest, WatchdogRetiresDroppedWorkInABurstAndAfterIdle) {
    comm::Communicator& world = World();
    const std::int64_t n = 1001;
    const auto all_released = [](const std::vector<Tensor>& ts) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (std::chrono::steady_clock::now() < deadline) {
            if (std::all_of(ts.begin(), ts.end(), [](const Tensor& t) { return t.storage().use_count() == 1; })) {
                return true;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return false;
    };
    for (const int calls : {256, 1}) {
        std::vector<Tensor> tensors;
        for (int i = 0; i < calls; ++i) {
            tensors.push_back(InputTensor(fmt::format("dropped/{}/{}", calls, i), world.rank(), n, DType::kFloat32));
        }
        for (int i = 0; i < calls; ++i) {
            (void)world.AllReduce(tensors[i], ReduceOp::kSum); // the handle is dropped here
        }
        EXPECT_TRUE(all_released(tensors)) << calls << " dropped call(s) were not retired by the watchdog";
        world.Barrier()->Wait(true); // orders the compute stream after every collective above
        for (int i = 0; i < calls; ++i) {
            EXPECT_TRUE(SameValues(tensors[i].ToDoubleVector(), ReduceOverRanks(fmt::format("dropped/{}/{}", calls, i),
                                                                                world.size(), n, ReduceOp::kSum)))
                << calls << "/" << i;
        }
        // Let the watchdog go idle past its idle polls (100 ms) and sleep without a deadline before the single call.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
}

// A 2x2 grid (row-major rank = row * 2 + col): rows and columns as sub-communicators.
TEST_F(NcclCommunicatorTest, SplitTwoByTwoRowsAndColumns) {
    comm::Communicator& world = World();
    if (world.size() != 4) {
        GTEST_SKIP() << "the 2x2 split needs 4 ranks, got " << world.size();
    }
    const int row = world.rank() / 2;
    const int col = world.rank() % 2;
    const comm::CollectiveCounts before = world.Counts();
    std::unique_ptr<comm::Communicator> rows = world.Split(row, col, fmt::format("row {}", row));
    std::unique_ptr<comm::Communicator> cols = world.Split(col, row, fmt::format("col {}", col));
    ASSERT_EQ(rows->size(), 2);
    ASSERT_EQ(cols->size(), 2);
    EXPECT_EQ(rows->rank(), col);
    EXPECT_EQ(cols->rank(), row);
    EXPECT_EQ(rows->backend(), "nccl");

    // Row all-reduce: the sum of the two ranks of this row.
    const std::int64_t n = 1000;
    Tensor t = InputTensor("split/rows", world.rank(), n, DType::kFloat32);
    rows->AllReduce(t, ReduceOp::kSum)->Wait();
    std::vector<double> expected(n);
    const auto a = InputValues("split/rows", row * 2, n);
    const auto b = InputValues("split/rows", row * 2 + 1, n);
    for (std::int64_t e = 0; e < n; ++e) {
        expected[e] = a[e] + b[e];
    }
    EXPECT_TRUE(SameValues(t.ToDoubleVector(), expected));

    // Column all-gather: the blocks of world ranks col and col + 2, in column-rank order.
    Tensor in = InputTensor("split/cols", world.rank(), n, DType::kBFloat16);
    Tensor out = Tensor::Empty({2 * n}, DType::kBFloat16, MyGpu());
    cols->AllGather(in, out)->Wait();
    std::vector<double> gathered = InputValues("split/cols", col, n);
    const auto second = InputValues("split/cols", col + 2, n);
    gathered.insert(gathered.end(), second.begin(), second.end());
    EXPECT_TRUE(SameValues(out.ToDoubleVector(), gathered));

    // Counts belong to the communicator that ran the collective; a split is not a collective.
    EXPECT_EQ(rows->Counts().Calls(CollectiveKind::kAllReduce), 1);
    EXPECT_EQ(rows->Counts().TotalCalls(), 1);
    EXPECT_EQ(cols->Counts().Calls(CollectiveKind::kAllGather), 1);
    EXPECT_EQ(cols->Counts().TotalCalls(), 1);
    EXPECT_EQ(world.Counts().TotalCalls(), before.TotalCalls());
}

TEST_F(NcclCommunicatorTest, Float64AllReduceIsExact) {
    // float64 moves for exact small reductions (checkpoint checksums and byte counts): integers past 2^24 stay exact.
    comm::Communicator& world = World();
    const double big = 4294967295.0; // a crc32
    Tensor t =
        Tensor::FromVector(std::vector<double>{big, static_cast<double>(world.rank() + 1), -0.5}, {3}, DType::kFloat64)
            .To(MyGpu());
    world.AllReduce(t, ReduceOp::kSum)->Wait(true);
    const double p = world.size();
    EXPECT_EQ(t.ToDoubleVector(), (std::vector<double>{big * p, p * (p + 1) / 2, -0.5 * p}));
    world.AllReduce(t, ReduceOp::kMax)->Wait(true);
    EXPECT_EQ(t.ToDoubleVector()[0], big * p);
}

// int64 moves exactly (the MoE dispatcher's token counts): values past 2^53, where a float64 would round.
std::vector<std::int64_t> Int64OnHost(const Tensor& t) {
    const Tensor host = t.To(Device::CPU());
    const auto* p = static_cast<const std::int64_t*>(host.data());
    return {p, p + host.numel()};
}

Tensor Int64OnGpu(const std::vector<std::int64_t>& v) {
    Tensor t = Tensor::Zeros({static_cast<std::int64_t>(v.size())}, DType::kInt64);
    std::copy(v.begin(), v.end(), static_cast<std::int64_t*>(t.data()));
    return t.To(MyGpu());
}

TEST_F(NcclCommunicatorTest, Int64CollectivesAreExactPastTwoToThe53) {
    comm::Communicator& world = World();
    const std::int64_t p = world.size();
    const std::int64_t me = world.rank();
    const std::int64_t big = (std::int64_t{1} << 58) + 1; // not a float64; big·p fits for p ≤ 16
    Tensor x = Int64OnGpu({big, me + 1, -3 * me});
    world.AllReduce(x, ReduceOp::kSum)->Wait(true);
    EXPECT_EQ(Int64OnHost(x), (std::vector<std::int64_t>{big * p, p * (p + 1) / 2, -3 * p * (p - 1) / 2}));
    Tensor m = Int64OnGpu({big + me, -me});
    world.AllReduce(m, ReduceOp::kMax)->Wait(true);
    EXPECT_EQ(Int64OnHost(m), (std::vector<std::int64_t>{big + p - 1, 0}));
    EXPECT_THROW(world.AllReduce(m, ReduceOp::kAvg), DTypeError);
    std::vector<std::int64_t> counts(p);
    std::vector<std::int64_t> expected(p);
    for (std::int64_t r = 0; r < p; ++r) {
        counts[r] = big + me * p + r;
        expected[r] = big + r * p + me;
    }
    Tensor recv = Tensor::Zeros({p}, DType::kInt64, MyGpu());
    world.AllToAllV(Int64OnGpu(counts), std::vector<std::int64_t>(p, 1), recv, std::vector<std::int64_t>(p, 1))
        ->Wait(true);
    EXPECT_EQ(Int64OnHost(recv), expected);
}

TEST_F(NcclCommunicatorTest, RejectsCpuTensorsAndWrongSizes) {
    comm::Communicator& world = World();
    Tensor cpu = Tensor::Zeros({8}, DType::kFloat32, Device::CPU());
    EXPECT_THROW(world.AllReduce(cpu, ReduceOp::kSum), DeviceError);
    Tensor in = Tensor::Zeros({8}, DType::kFloat32, MyGpu());
    Tensor wrong = Tensor::Zeros({8 * world.size() + 1}, DType::kFloat32, MyGpu());
    EXPECT_THROW(world.AllGather(in, wrong), ShapeError);
    EXPECT_THROW(world.AllGatherV(in, wrong, {1}), ShapeError);
    EXPECT_THROW(world.Broadcast(in, world.size()), Error);
    // Nothing was issued: the communicator still works.
    EXPECT_FALSE(world.aborted());
    world.Barrier()->Wait(true);
}

} // namespace
} // namespace shardline::testing
