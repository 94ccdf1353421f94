// The NCCL watchdog's release of a thread blocked inside NCCL (src/comm/enqueue_watch.h) on a model: the "NCCL call"
// is a wait on an abort flag, as NCCL's connection setup polls its abort flag, and the "abort" sets the flag, as
// ncclCommAbort does. Checked: a call that returns in time is never aborted; a stuck one is aborted once, after the
// limit and not before, and released by it; the thread coming back from NCCL waits in Leave until the abort has been
// carried out (nothing else may touch the communicator meanwhile); an abort never starts after Leave; a released
// thread that comes back late is not aborted again, and an abort that throws is not retried.

#include <atomic>
#include <chrono>
#include <stdexcept>
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

// A released thread that is not scheduled before the watchdog polls again (a loaded machine) is still inside; the
// second poll must not abort again. Only the next call, after Leave, can be aborted.
TEST(EnqueueWatchTest, AnAbortedCallIsNotAbortedAgainBeforeItLeaves) {
    EnqueueWatch watch;
    const auto start = Clock::now();
    watch.Enter(start);
    int aborts = 0;
    EXPECT_TRUE(watch.AbortIfStuck(start + 3s, 1s, [&] { ++aborts; }));
    EXPECT_TRUE(watch.Inside()) << "the released thread has not left yet";
    EXPECT_FALSE(watch.AbortIfStuck(start + 4s, 1s, [&] { ++aborts; }));
    EXPECT_FALSE(watch.AbortIfStuck(start + 1h, 0s, [&] { ++aborts; }));
    EXPECT_EQ(aborts, 1);
    watch.Leave();
    EXPECT_FALSE(watch.AbortIfStuck(start + 1h, 0s, [&] { ++aborts; }));

    // The next call is a new one: stuck, it is aborted (once).
    const auto next = start + 2h;
    watch.Enter(next);
    EXPECT_FALSE(watch.AbortIfStuck(next + 1s, 2s, [&] { ++aborts; }));
    EXPECT_TRUE(watch.AbortIfStuck(next + 3s, 2s, [&] { ++aborts; }));
    EXPECT_FALSE(watch.AbortIfStuck(next + 4s, 2s, [&] { ++aborts; }));
    EXPECT_EQ(aborts, 2);
    watch.Leave();
    EXPECT_FALSE(watch.Inside());
}

// An abort that throws counts as carried out: the watchdog does not retry it on every poll.
TEST(EnqueueWatchTest, AThrowingAbortIsNotRetried) {
    EnqueueWatch watch;
    const auto start = Clock::now();
    watch.Enter(start);
    int aborts = 0;
    EXPECT_THROW(watch.AbortIfStuck(start + 3s, 1s,
                                    [&] {
                                        ++aborts;
                                        throw std::runtime_error("ncclCommAbort failed");
                                    }),
                 std::runtime_error);
    EXPECT_FALSE(watch.AbortIfStuck(start + 4s, 1s, [&] { ++aborts; }));
    EXPECT_EQ(aborts, 1);
    watch.Leave();
}

// The model of a blocking communicator's enqueue stuck on a peer that never comes, and its watchdog polling every 2 ms.
// After the "abort" releases the call, the issuing thread stays unscheduled for `unscheduled` (a loaded machine) before
// it calls Leave. Checked: one abort, after the limit; Leave never returns while the abort runs; the thread is
// released.
void ExpectStuckCallAbortedOnceAndReleased(Clock::duration unscheduled) {
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
        std::this_thread::sleep_for(unscheduled);
        watch.Leave(); // must wait for the abort to finish
        left_during_abort = abort_running.load();
        left = Clock::now();
        released = true;
    });

    const auto limit = 200ms;
    const auto start = Clock::now();
    while (!released && Clock::now() - start < 30s) { // the watchdog's polls
        watch.AbortIfStuck(Clock::now(), limit, [&] {
            abort_running = true;
            ++aborts;
            abort_flag = true;                 // releases the blocked call ...
            std::this_thread::sleep_for(50ms); // ... while the rest of the abort still runs
            abort_running = false;
        });
        std::this_thread::sleep_for(2ms);
    }
    abort_flag = true; // never aborted (a failure, reported below): release the issuer so that join returns
    issuer.join();
    ASSERT_TRUE(released.load()) << "the stuck call was never released";
    EXPECT_EQ(aborts.load(), 1);
    EXPECT_FALSE(left_during_abort.load()) << "Leave returned while the abort was still running";
    const auto held = left - entered;
    EXPECT_GE(held, limit) << "aborted before the limit";
    EXPECT_LT(held, limit + 10s) << "released long after the limit"; // generous: CI runs this beside busy MPI ranks
    EXPECT_FALSE(watch.Inside());
}

// The released thread comes back at once, while the abort still runs: Leave waits for it.
TEST(EnqueueWatchTest, StuckCallIsAbortedOnceAfterTheLimitAndReleased) { ExpectStuckCallAbortedOnceAndReleased(0ms); }

// The released thread runs only 80 ms later, after the abort: the watchdog's polls in between abort nothing (before,
// they aborted again: CI on 2a5f6c0 failed this way under load).
TEST(EnqueueWatchTest, ALateReleasedThreadIsNotAbortedAgain) { ExpectStuckCallAbortedOnceAndReleased(80ms); }

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
