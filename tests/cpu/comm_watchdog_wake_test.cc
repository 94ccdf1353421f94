// The NCCL watchdog's wake policy (src/comm/watchdog_wake.h) on a model of the watchdog: a thread that retires a
// mutex-guarded work list on each pass, as nccl_state.cc's WatchdogLoop does with done-events. Checked: no notify is
// needed while work keeps arriving, the watchdog sleeps without a deadline after its idle polls and the next arrival
// (Asleep + Notify) wakes it, no wake-up is lost across many sleep/arrive rounds, an abort-like NotifyAll wakes it when
// it is no longer idle, and stop ends either wait at once.

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "comm/watchdog_wake.h"

namespace shardline::comm::detail {
namespace {

using namespace std::chrono_literals;

/// The watchdog model. Work items are retired (popped) on each pass; `passes` counts the passes that found work or a
/// pending "abort", `wakeups` every return from Wait.
class Model {
public:
    Model(std::chrono::milliseconds poll, int idle_polls) : wake_(poll, idle_polls) {
        thread_ = std::thread([this] { Loop(); });
    }
    ~Model() { Stop(); }

    /// The issuing side: append one item; returns whether it had to notify (the watchdog slept without a deadline).
    bool Arrive() {
        bool asleep = false;
        {
            std::lock_guard lock(mutex_);
            work_.push_back(1);
            ++arrived_;
            asleep = wake_.Asleep();
        }
        if (asleep) {
            wake_.Notify();
        }
        return asleep;
    }
    void RequestAbort() {
        {
            std::lock_guard lock(mutex_);
            abort_ = true;
        }
        wake_.NotifyAll();
    }
    void Stop() {
        {
            std::lock_guard lock(mutex_);
            stop_ = true;
        }
        wake_.NotifyAll();
        if (thread_.joinable()) {
            thread_.join();
        }
    }
    bool Asleep() {
        std::lock_guard lock(mutex_);
        return wake_.Asleep();
    }
    std::int64_t retired() {
        std::lock_guard lock(mutex_);
        return retired_;
    }
    std::int64_t arrived() {
        std::lock_guard lock(mutex_);
        return arrived_;
    }
    bool abort_seen() const { return abort_seen_; }
    std::int64_t wakeups() const { return wakeups_; }

    /// Polls `pred` every millisecond for up to `limit`.
    template <class Pred> static bool Within(std::chrono::milliseconds limit, Pred pred) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        while (!pred()) {
            if (std::chrono::steady_clock::now() > deadline) {
                return false;
            }
            std::this_thread::sleep_for(1ms);
        }
        return true;
    }

private:
    void Loop() {
        std::unique_lock lock(mutex_);
        while (true) {
            wake_.Wait(lock, stop_, [&] { return work_.empty() && !(abort_ && !abort_seen_); });
            ++wakeups_;
            if (stop_) {
                return;
            }
            retired_ += static_cast<std::int64_t>(work_.size());
            work_.clear();
            if (abort_) {
                abort_seen_ = true;
            }
        }
    }

    std::mutex mutex_;
    WatchdogWake wake_;
    std::deque<int> work_;
    bool stop_ = false;
    bool abort_ = false;
    std::atomic<bool> abort_seen_{false};
    std::int64_t arrived_ = 0;
    std::int64_t retired_ = 0;
    std::atomic<std::int64_t> wakeups_{0};
    std::thread thread_;
};

TEST(WatchdogWakeTest, SteadyArrivalsNeedNoNotifyAndAreAllRetired) {
    Model m(2ms, /*idle_polls=*/500); // sleeps only after 1 s without work: not within this test, even when loaded
    int notified = 0;
    const auto end = std::chrono::steady_clock::now() + 200ms;
    while (std::chrono::steady_clock::now() < end) {
        notified += m.Arrive() ? 1 : 0;
        std::this_thread::sleep_for(100us);
    }
    // The very first arrival may find the watchdog already asleep (it started idle); none after it.
    EXPECT_LE(notified, 1);
    EXPECT_TRUE(Model::Within(5000ms, [&] { return m.retired() == m.arrived(); }))
        << m.retired() << " of " << m.arrived() << " retired";
    // One pass per poll period, not one per arrival.
    EXPECT_LT(m.wakeups(), m.arrived());
}

TEST(WatchdogWakeTest, SleepsAfterItsIdlePollsAndTheNextArrivalWakesIt) {
    Model m(1ms, /*idle_polls=*/5);
    ASSERT_TRUE(Model::Within(5000ms, [&] { return m.Asleep(); })) << "never went to sleep while idle";
    const std::int64_t wakeups = m.wakeups();
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(m.wakeups(), wakeups) << "an idle, sleeping watchdog must not poll";
    EXPECT_TRUE(m.Arrive()) << "the arrival must see the sleeping watchdog and notify it";
    EXPECT_TRUE(Model::Within(5000ms, [&] { return m.retired() == 1; }));
}

TEST(WatchdogWakeTest, NoWakeUpIsLostAcrossManySleepArriveRounds) {
    Model m(1ms, /*idle_polls=*/0); // sleeps after the first idle pass: every round goes through the sleeping wait
    for (int round = 1; round <= 200; ++round) {
        ASSERT_TRUE(Model::Within(5000ms, [&] { return m.Asleep(); })) << "round " << round;
        m.Arrive();
        ASSERT_TRUE(Model::Within(5000ms, [&] { return m.retired() == round; }))
            << "round " << round << ": the arrival was not retired (lost wake-up)";
    }
}

TEST(WatchdogWakeTest, NotifyAllWakesASleepingWatchdogThatIsNoLongerIdle) {
    Model m(1ms, /*idle_polls=*/0);
    ASSERT_TRUE(Model::Within(5000ms, [&] { return m.Asleep(); }));
    m.RequestAbort(); // like NcclState::RequestAbort: an abort to carry out makes the watchdog busy
    EXPECT_TRUE(Model::Within(5000ms, [&] { return m.abort_seen(); }));
}

TEST(WatchdogWakeTest, StopEndsASleepingAndAPollingWaitAtOnce) {
    for (const bool sleeping : {true, false}) {
        // A 60 s poll: returning quickly proves stop cut the wait short.
        Model m(60000ms, /*idle_polls=*/sleeping ? 0 : 1000);
        if (sleeping) {
            ASSERT_TRUE(Model::Within(5000ms, [&] { return m.Asleep(); }));
        } else {
            std::this_thread::sleep_for(20ms); // inside its first 60 s poll
            EXPECT_FALSE(m.Asleep());
        }
        const auto start = std::chrono::steady_clock::now();
        m.Stop();
        EXPECT_LT(std::chrono::steady_clock::now() - start, 5000ms) << (sleeping ? "sleeping" : "polling");
    }
}

} // namespace
} // namespace shardline::comm::detail
