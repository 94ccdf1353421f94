#pragma once

// A thread blocked inside NCCL, and the watchdog that releases it. Private to src/comm; no CUDA or NCCL, so it is
// tested on the CPU (tests/cpu/comm_enqueue_watch_test.cc).
//
// On a blocking NCCL communicator a collective is enqueued by the calling thread itself, and that call can block: a
// lazy connection setup to a peer that never arrives, or a launch queue full behind a hung kernel. Nothing the thread
// does can bound it; only ncclCommAbort from another thread (it sets the abort flag NCCL's waits poll) releases it.
// That is torch's ProcessGroupNCCL design (blocking communicators, a watchdog that aborts on a timeout). The issuing
// thread marks the call with Enter/Leave; the watchdog asks AbortIfStuck. The abort runs under the mutex that Leave
// takes, so a thread that comes back from NCCL while the abort is being carried out waits for it before anything
// else is called on the communicator, and an abort can never start after the thread has left: ncclCommAbort only
// ever overlaps the call it is meant to release.

#include <atomic>
#include <chrono>
#include <mutex>

namespace shardline::comm::detail {

class EnqueueWatch {
public:
    using Clock = std::chrono::steady_clock;

    /// Issuing thread, just before a call into NCCL that may block. One thread at a time (the caller holds the
    /// communicator's NCCL mutex); lock-free, as it runs on every collective.
    void Enter(Clock::time_point now) noexcept {
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
        since_ns_.store(ns > 0 ? ns : 1, std::memory_order_release); // 0 means "not inside"
    }

    /// Issuing thread, as the call returns: waits for an abort the watchdog is carrying out on this call.
    void Leave() noexcept {
        std::lock_guard lock(mutex_);
        since_ns_.store(0, std::memory_order_relaxed);
        aborted_ = false;
    }

    /// Whether a thread is inside a marked call, and since when (for the watchdog's idle test and its messages).
    bool Inside() const noexcept { return since_ns_.load(std::memory_order_acquire) != 0; }
    Clock::duration InsideFor(Clock::time_point now) const noexcept {
        const auto ns = since_ns_.load(std::memory_order_acquire);
        if (ns == 0) {
            return Clock::duration::zero();
        }
        return now - Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(ns)));
    }

    /// Watchdog: when a thread has been inside a marked call for longer than `limit`, runs `abort()` (ncclCommAbort,
    /// which releases it) while Leave waits, and returns true. Returns false, without calling `abort`, when no thread
    /// is inside, it has not been inside that long, or this call has already been aborted: a released thread may not
    /// be scheduled before the watchdog's next poll, and that poll must not abort the communicator a second time.
    template <class Abort> bool AbortIfStuck(Clock::time_point now, Clock::duration limit, Abort&& abort) {
        std::lock_guard lock(mutex_);
        if (aborted_ || !Inside() || InsideFor(now) <= limit) {
            return false;
        }
        aborted_ = true; // before abort(): a throwing abort is not retried on every poll either
        abort();
        return true;
    }

private:
    std::mutex mutex_;
    std::atomic<long long> since_ns_{0};
    bool aborted_ = false; // the call now inside has been aborted (guarded by mutex_; cleared by Leave)
};

} // namespace shardline::comm::detail
