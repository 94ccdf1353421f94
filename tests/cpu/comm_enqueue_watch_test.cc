// The NCCL watchdog's release of a thread blocked inside NCCL (src/comm/enqueue_watch.h) on a model: the "NCCL call"
// is a wait on an abort flag, as NCCL's connection setup polls its abort flag, and the "abort" sets the flag, as
// ncclCommAbort does. Checked: a call that returns in time is never aborted; a stuck one is aborted once, after the
// limit and not before, and released by it; the thread coming back from NCCL waits in Leave until the abort has been
// carried out (nothing else may touch the communicator meanwhile); an abort never starts after Leave.

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "comm/enqueue_watch.h"

namespace shardline::comm::detail {
namespace {

using namespace std::chrono_literals;
using Clock = EnqueueWatch::Clock;

TEST(EnqueueWatchTest, NothingInsideIsNeverAborted) {
    EnqueueWatch watch;
    EXPECT_FALSE(watch.Inside());
    EXPECT_EQ(watch.InsideFor(Clock::now()), Clock::duration::zero());
    int aborts = 0;
    EXPECT_FALSE(watch.AbortIfStuck(Clock::now() + 1h, 0s, [&] { ++aborts; }));
    EXPECT_EQ(aborts, 0);
}

TEST(EnqueueWatchTest, CallThatReturnsWithinTheLimitIsNotAborted) {
    EnqueueWatch watch;
    const auto start = Clock::now();
    watch.Enter(start);
    EXPECT_TRUE(watch.Inside());
    int aborts = 0;
    // Inside for 1 s, limit 2 s: not stuck yet.
    EXPECT_FALSE(watch.AbortIfStuck(start + 1s, 2s, [&] { ++aborts; }));
    watch.Leave();
    EXPECT_FALSE(watch.Inside());
    // Long after: the thread has left, so no abort, whatever the limit.
    EXPECT_FALSE(watch.AbortIfStuck(start + 1h, 0s, [&] { ++aborts; }));
    EXPECT_EQ(aborts, 0);
}

TEST(EnqueueWatchTest, InsideForMeasuresFromEnter) {
    EnqueueWatch watch;
    const auto start = Clock::now();
    watch.Enter(start);
    EXPECT_EQ(std::chrono::duration_cast<std::chrono::milliseconds>(watch.InsideFor(start + 1500ms)).count(), 1500);
    EXPECT_FALSE(watch.AbortIfStuck(start + 1500ms, 1500ms, [] {})) << "exactly the limit is not past it";
    EXPECT_TRUE(watch.AbortIfStuck(start + 1501ms, 1500ms, [] {}));
    watch.Leave();
}

// The model of a blocking communicator's enqueue stuck on a peer that never comes, and its watchdog.
TEST(EnqueueWatchTest, StuckCallIsAbortedOnceAfterTheLimitAndReleased) {
    EnqueueWatch watch;
    std::atomic<bool> abort_flag{false};    // NCCL's abort flag
    std::atomic<bool> abort_running{false}; // inside the "ncclCommAbort"
    std::atomic<bool> left_during_abort{false};
    std::atomic<int> aborts{0};
    std::atomic<bool> released{false};
    Clock::time_point entered;
    Clock::time_point left;

    std::thread issuer([&] {
        entered = Clock::now();
        watch.Enter(entered);
        while (!abort_flag.load()) { // the blocked NCCL call
            std::this_thread::sleep_for(100us);
        }
        watch.Leave(); // must wait for the abort to finish
        left_during_abort = abort_running.load();
        left = Clock::now();
        released = true;
    });

    const auto limit = 200ms;
    const auto start = Clock::now();
    while (!released && Clock::now() - start < 5s) { // the watchdog's polls
        watch.AbortIfStuck(Clock::now(), limit, [&] {
            abort_running = true;
            ++aborts;
            abort_flag = true;                 // releases the blocked call ...
            std::this_thread::sleep_for(50ms); // ... while the rest of the abort still runs
            abort_running = false;
        });
        std::this_thread::sleep_for(2ms);
    }
    issuer.join();
    ASSERT_TRUE(released.load()) << "the stuck call was never released";
    EXPECT_EQ(aborts.load(), 1);
    EXPECT_FALSE(left_during_abort.load()) << "Leave returned while the abort was still running";
    const auto held = left - entered;
    EXPECT_GE(held, limit) << "aborted before the limit";
    EXPECT_LT(held, limit + 2s);
    EXPECT_FALSE(watch.Inside());
}

// Many short calls against a watchdog polling with a limit no call reaches: never an abort (the race between a call
// leaving and the watchdog's check must not produce one).
TEST(EnqueueWatchTest, ShortCallsRacingTheWatchdogAreNeverAborted) {
    EnqueueWatch watch;
    std::atomic<bool> stop{false};
    std::atomic<int> aborts{0};
    std::thread watchdog([&] {
        while (!stop) {
            watch.AbortIfStuck(Clock::now(), 500ms, [&] { ++aborts; });
        }
    });
    for (int i = 0; i < 20000; ++i) {
        watch.Enter(Clock::now());
        watch.Leave();
    }
    stop = true;
    watchdog.join();
    EXPECT_EQ(aborts.load(), 0);
}

} // namespace
} // namespace shardline::comm::detail
