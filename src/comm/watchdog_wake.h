#pragma once

// When the NCCL watchdog (nccl_state.cc) runs its passes, and when the issuing thread must wake it. Private to
// src/comm; no CUDA or NCCL, so it is tested on the CPU (tests/cpu/comm_watchdog_wake_test.cc).
//
// The watchdog polls every `poll` while there is something to watch, and for `idle_polls` more periods once there is
// not; only then does it sleep without a deadline. The issuing thread notifies it only in that state. So a steady
// stream of calls costs no notify at all (a notify per call was a futex wake-up on the issuing thread plus an extra
// watchdog pass contending for the mutex and the CUDA driver with the next call), and an idle communicator's watchdog
// costs nothing after `poll · idle_polls`. torch's ProcessGroupNCCL watchdog likewise polls its work list on its own
// period and is never woken per collective.

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace shardline::comm::detail {

class WatchdogWake {
public:
    WatchdogWake(std::chrono::milliseconds poll, int idle_polls) : poll_(poll), idle_polls_(idle_polls) {}

    /// Watchdog thread, `lock` held on the mutex that guards the watched state and `stop`. `idle()` (evaluated under
    /// the lock): nothing to watch. Returns after one poll period, at once when `stop` is set and notified, or, after
    /// `idle_polls` idle passes in a row, when woken by the issuing thread (Asleep + Notify) or by NotifyAll with
    /// `idle()` false.
    template <class Idle> void Wait(std::unique_lock<std::mutex>& lock, const bool& stop, Idle idle) {
        if (!idle()) {
            idle_passes_ = 0;
        } else if (++idle_passes_ > idle_polls_) {
            asleep_ = true;
            cv_.wait(lock, [&] { return stop || !idle(); });
            asleep_ = false;
            idle_passes_ = 0;
            return;
        }
        cv_.wait_for(lock, poll_, [&] { return stop; });
    }

    /// Issuing thread, the same lock held, after making `idle()` false (appending work): whether the watchdog sleeps
    /// without a deadline. Then call Notify() once the lock is released.
    bool Asleep() const { return asleep_; }
    void Notify() { cv_.notify_one(); }
    /// After setting `stop` (under the lock) or requesting an abort: wakes the watchdog wherever it waits.
    void NotifyAll() { cv_.notify_all(); }

private:
    std::condition_variable cv_;
    std::chrono::milliseconds poll_;
    int idle_polls_;
    int idle_passes_ = 0; // guarded by the caller's mutex, as asleep_
    bool asleep_ = false;
};

} // namespace shardline::comm::detail
