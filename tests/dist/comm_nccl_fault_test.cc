// Faults on the NCCL communicator, each asserting the observed outcome: a rank that skips a collective → the healthy
// ranks raise CommError within timeout + 5 s, through a host wait and through the watchdog alone, and also when it is
// the communicator's first call (whose enqueue may block inside NCCL on the absent peer: released by the watchdog's
// abort, or by Abort()); a count mismatch under SHARDLINE_COMM_CHECK → every rank raises before anything is issued.
// Each test makes its own communicator (a fault aborts it) and restores the timeout and check settings.

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>

#include "comm_nccl_helpers.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = std::chrono::seconds(5);
constexpr auto kSlack = std::chrono::seconds(5);
constexpr std::int64_t kFaultCount = 1 << 16;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

class NcclFaultTest : public ::testing::Test {
protected:
    void SetUp() override {
        SHARDLINE_SKIP_WITHOUT_NCCL();
        comm::SetCommTimeout(kTimeout);
    }
    void TearDown() override {
        comm::SetCommTimeout(std::chrono::milliseconds(0));
        comm::SetCommCheck(false);
        if (comm_ != nullptr) {
            const auto start = Clock::now();
            comm_.reset();
            EXPECT_LT(SecondsSince(start), 3.0) << "destroying the communicator must not block";
        }
    }

    /// `warm_up`: first use sets up the connections (lazily, per algorithm and protocol): a warm-up that every rank
    /// joins, of the size the tests then fault, so the faulted call is enqueued at once and only its kernel waits.
    /// Without it the first call sets up its connections, with the faulty peer absent.
    comm::Communicator& Fresh(const std::string& name, bool warm_up = true) {
        comm_ = comm::Communicator::CreateNcclWorld(Env().host_world(), Env().local_rank(), name);
        if (warm_up) {
            Tensor t = Tensor::Full({kFaultCount}, 1.0, DType::kFloat32, MyGpu());
            comm_->AllReduce(t, ReduceOp::kSum)->Wait(true);
        }
        return *comm_;
    }

    /// Healthy ranks: an all_reduce that the skipper never joins, as the communicator's first call, so that on a
    /// blocking communicator the issuing thread may block inside NCCL (its connection setup waits for the absent
    /// peer) and only the watchdog's ncclCommAbort releases it; else the enqueue returns and the kernel waits (phase
    /// 2). Returns the CommError's text and its time from the call, and whether the enqueue returned; prints which
    /// phase it was.
    static std::string FirstCallOnAbsentPeer(comm::Communicator& c, double& elapsed, bool* enqueued_out = nullptr) {
        Tensor t = Tensor::Full({kFaultCount}, 1.0, DType::kFloat32, MyGpu());
        const auto start = Clock::now();
        bool enqueued = false;
        bool& enqueued_ref = enqueued_out != nullptr ? *enqueued_out : enqueued;
        enqueued_ref = false;
        try {
            comm::WorkHandle work = c.AllReduce(t, ReduceOp::kSum);
            enqueued_ref = true;
            work->Wait(/*host=*/true);
            ADD_FAILURE() << "all_reduce with a rank missing completed";
        } catch (const CommError& e) {
            elapsed = SecondsSince(start);
            std::printf("[ measured ] rank %d: CommError %s after %.2f s: %s\n", c.rank(),
                        enqueued_ref ? "from the wait (the enqueue returned)" : "from the call (blocked inside NCCL)",
                        elapsed, e.what());
            return e.what();
        }
        elapsed = SecondsSince(start);
        return {};
    }

    static void HostBarrier() { Env().host_world().Barrier()->Wait(true); }
    /// The skipping rank reaches the host barrier at once while the others first sit out their NCCL timeout: its wait
    /// must outlast timeout + slack, or the host world itself times out and aborts.
    static void SkipperHostBarrier() {
        comm::SetCommTimeout(kTimeout + kSlack + std::chrono::seconds(10));
        HostBarrier();
        comm::SetCommTimeout(kTimeout);
    }
    static int Skipper() { return Env().world_size() - 1; }

    std::unique_ptr<comm::Communicator> comm_;
};

TEST_F(NcclFaultTest, SkippedCollectiveRaisesCommErrorThroughHostWait) {
    comm::Communicator& c = Fresh("fault skip host");
    Tensor t = Tensor::Full({kFaultCount}, 1.0, DType::kFloat32, MyGpu());
    if (c.rank() != Skipper()) {
        const auto start = Clock::now();
        try {
            c.AllReduce(t, ReduceOp::kSum)->Wait(/*host=*/true);
            ADD_FAILURE() << "all_reduce with a rank missing completed";
        } catch (const CommError& e) {
            const double elapsed = SecondsSince(start);
            EXPECT_GE(elapsed, std::chrono::duration<double>(kTimeout).count() - 0.1) << e.what();
            EXPECT_LE(elapsed, std::chrono::duration<double>(kTimeout + kSlack).count()) << e.what();
            // Names the op, its sequence number (the warm-up was #1), the count, the group and the elapsed time.
            EXPECT_THAT(e.what(), HasSubstr("all_reduce(sum) #2"));
            EXPECT_THAT(e.what(), HasSubstr("count 65536"));
            EXPECT_THAT(e.what(), HasSubstr("'fault skip host'"));
            EXPECT_THAT(e.what(), HasSubstr("elapsed"));
        }
        EXPECT_TRUE(c.aborted());
        EXPECT_THROW(c.AllReduce(t, ReduceOp::kSum), CommError);
        HostBarrier();
    } else {
        // The skipping rank leaves only once the others have raised, so nothing but the timeout ended their wait.
        SkipperHostBarrier();
        c.Abort();
        EXPECT_TRUE(c.aborted());
        EXPECT_THROW(c.Barrier(), CommError);
    }
}

TEST_F(NcclFaultTest, WatchdogAbortsHungCollectiveWithoutHostWait) {
    comm::Communicator& c = Fresh("fault skip watchdog");
    Tensor t = Tensor::Full({kFaultCount}, 1.0, DType::kFloat32, MyGpu());
    if (c.rank() != Skipper()) {
        const auto start = Clock::now();
        comm::WorkHandle work = c.AllReduce(t, ReduceOp::kSum);
        work->Wait(/*host=*/false); // orders the compute stream only: nobody waits on the host
        while (!c.aborted() && Clock::now() - start < kTimeout + kSlack + std::chrono::seconds(1)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        const double elapsed = SecondsSince(start);
        EXPECT_TRUE(c.aborted()) << "the watchdog did not abort within " << elapsed << " s";
        EXPECT_GE(elapsed, std::chrono::duration<double>(kTimeout).count() - 0.1);
        EXPECT_LE(elapsed, std::chrono::duration<double>(kTimeout + kSlack).count());
        // The next call, and the work handle, raise.
        try {
            c.AllReduce(t, ReduceOp::kSum);
            ADD_FAILURE() << "a call on an aborted communicator did not raise";
        } catch (const CommError& e) {
            EXPECT_THAT(e.what(), HasSubstr("all_reduce(sum) #2"));
            EXPECT_THAT(e.what(), HasSubstr("phase 2"));
        }
        EXPECT_THROW(work->Test(), CommError);
        EXPECT_THROW(work->Wait(/*host=*/true), CommError);
        // The aborted kernel exited: the compute stream, which waits on it, drains.
        Synchronize(MyGpu());
        HostBarrier();
    } else {
        SkipperHostBarrier();
        c.Abort();
    }
}

// Phase 1 on the default (blocking) communicator: a call blocked inside NCCL on a peer that never comes is released
// by the watchdog's abort after the timeout and raises CommError naming the op and the group.
TEST_F(NcclFaultTest, FirstCallOnAnAbsentPeerRaisesCommErrorAfterTheTimeout) {
    comm::Communicator& c = Fresh("fault first call", /*warm_up=*/false);
    if (c.rank() != Skipper()) {
        double elapsed = 0;
        bool enqueued = false;
        const std::string what = FirstCallOnAbsentPeer(c, elapsed, &enqueued);
        EXPECT_GE(elapsed, std::chrono::duration<double>(kTimeout).count() - 0.1) << what;
        EXPECT_LE(elapsed, std::chrono::duration<double>(kTimeout + kSlack).count()) << what;
        if (!enqueued) {
            // Phase 1: only the abort releases the call, and a timeout's abort waits AbortGrace (1 s at a 5 s timeout)
            // after the deadline: it also ends any earlier kernel still running (nccl_state.cc, WatchdogLoop).
            EXPECT_THAT(what, HasSubstr("phase 1: enqueue, blocked inside NCCL"));
            EXPECT_GE(elapsed, std::chrono::duration<double>(kTimeout).count() + 1.0 - 0.1) << what;
        }
        EXPECT_THAT(what, HasSubstr("all_reduce(sum) #1"));
        EXPECT_THAT(what, HasSubstr("'fault first call'"));
        EXPECT_THAT(what, HasSubstr("elapsed"));
        EXPECT_TRUE(c.aborted());
        Tensor t = Tensor::Full({16}, 1.0, DType::kFloat32, MyGpu());
        EXPECT_THROW(c.AllReduce(t, ReduceOp::kSum), CommError);
        Synchronize(MyGpu()); // whatever was enqueued exited with the abort
        HostBarrier();
    } else {
        SkipperHostBarrier();
        c.Abort();
    }
}

// Abort() from another thread releases a call blocked inside NCCL (the watchdog carries it out once the call has been
// inside for a second), long before the timeout would.
TEST_F(NcclFaultTest, AbortReleasesAFirstCallBlockedOnAnAbsentPeer) {
    comm::Communicator& c = Fresh("fault abort blocked", /*warm_up=*/false);
    if (c.rank() != Skipper()) {
        std::thread aborter([&c] {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            c.Abort();
        });
        double elapsed = 0;
        const std::string what = FirstCallOnAbsentPeer(c, elapsed);
        aborter.join();
        EXPECT_GE(elapsed, 1.4) << what;
        EXPECT_LT(elapsed, 4.5) << "the abort did not release the call before the 5 s timeout: " << what;
        EXPECT_THAT(what, HasSubstr("Abort() was called"));
        EXPECT_THAT(what, HasSubstr("'fault abort blocked'"));
        EXPECT_TRUE(c.aborted());
        Synchronize(MyGpu());
        HostBarrier();
    } else {
        SkipperHostBarrier();
        c.Abort();
    }
}

TEST_F(NcclFaultTest, CommCheckCountMismatchRaisesOnEveryRank) {
    comm::Communicator& c = Fresh("fault check");
    comm::SetCommCheck(true);
    const std::int64_t n = c.rank() == 0 ? 1024 : 1000;
    Tensor t = Tensor::Full({n}, 1.0, DType::kBFloat16, MyGpu());
    try {
        c.AllReduce(t, ReduceOp::kSum)->Wait(true);
        ADD_FAILURE() << "mismatched counts were not reported";
    } catch (const CommError& e) {
        EXPECT_THAT(e.what(), HasSubstr("disagree"));
        EXPECT_THAT(e.what(), HasSubstr("count 1024"));
        EXPECT_THAT(e.what(), HasSubstr("count 1000"));
        EXPECT_THAT(e.what(), HasSubstr("'fault check'"));
    }
    // Nothing was issued: the communicator is intact and the next, matching call succeeds (still checked).
    EXPECT_FALSE(c.aborted());
    Tensor ok = Tensor::Full({512}, 2.0, DType::kBFloat16, MyGpu());
    c.AllReduce(ok, ReduceOp::kSum)->Wait(true);
    EXPECT_TRUE(SameValues(ok.ToDoubleVector(), std::vector<double>(512, 2.0 * c.size())));
}

TEST_F(NcclFaultTest, CommCheckAllToAllVPairMismatchRaisesOnEveryRank) {
    comm::Communicator& c = Fresh("fault check a2av");
    comm::SetCommCheck(true);
    const int n = c.size();
    std::vector<std::int64_t> send(n, 4);
    std::vector<std::int64_t> recv(n, 4);
    if (c.rank() == 0) {
        recv[1] = 5; // rank 1 sends 4 to rank 0, which expects 5
    }
    std::int64_t received = 0;
    for (std::int64_t r : recv) {
        received += r;
    }
    Tensor in = Tensor::Full({4 * n}, 1.0, DType::kFloat32, MyGpu());
    Tensor out = Tensor::Empty({received}, DType::kFloat32, MyGpu());
    try {
        c.AllToAllV(in, send, out, recv)->Wait(true);
        ADD_FAILURE() << "mismatched all_to_all_v counts were not reported";
    } catch (const CommError& e) {
        EXPECT_THAT(e.what(), HasSubstr("rank 1 sends 4 elements to rank 0, which expects 5"));
    }
    EXPECT_FALSE(c.aborted());
}

TEST_F(NcclFaultTest, AbortIsImmediateAndEveryLaterCallRaises) {
    comm::Communicator& c = Fresh("fault abort");
    HostBarrier();
    const auto start = Clock::now();
    c.Abort();
    EXPECT_LT(SecondsSince(start), 3.0);
    EXPECT_TRUE(c.aborted());
    Tensor t = Tensor::Full({16}, 1.0, DType::kFloat32, MyGpu());
    EXPECT_THROW(c.AllReduce(t, ReduceOp::kSum), CommError);
    EXPECT_THROW(c.Barrier(), CommError);
    EXPECT_THROW(c.Split(0, c.rank(), "never"), CommError);
}

} // namespace
} // namespace shardline::testing
