#pragma once

// The NCCL backend's shared pieces: the state a communicator shares with its work handles and its watchdog, the
// polling helpers, and the functions the backend's files call across. Private to src/comm.
//
// Files: nccl_state.cc (op descriptions, the phase-1 wait, the watchdog, work handles), nccl_check.cc (the debug
// agreement check), nccl_collectives.cc (the issue engine and the collectives), nccl_communicator.cc (creation,
// destruction, abort), nccl_world.cc (split, CreateNcclWorld, FromNcclComm, the NVLS guard, the blocking split);
// enqueue_watch.h (a thread blocked inside NCCL and the watchdog's abort that releases it).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/tensor.h>

#include "comm/enqueue_watch.h"
#include "comm/watchdog_wake.h"

namespace shardline::comm::detail {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at outstanding work. Timeouts are seconds; this bounds how long a finished
// collective's tensors stay referenced when nobody waits on it.
inline constexpr auto kWatchdogPoll = std::chrono::milliseconds(2);
// Idle polls (100 ms) before the watchdog sleeps without a deadline and a call has to wake it (watchdog_wake.h).
inline constexpr int kWatchdogIdlePolls = 50;
// How long a destructor lets work in flight and ncclCommFinalize run before it falls back to ncclCommAbort.
inline constexpr auto kMaxFinalize = std::chrono::seconds(30);
// How long after a collective's deadline a timed-out rank waits before it calls ncclCommAbort (the CommError itself is
// raised at once). An aborted NCCL kernel does not stop: its waits give up and it runs to its end, storing whatever it
// holds with valid flags into its peers' buffers (prims_ll.h: readLL breaks out of its wait on the abort flag and the
// step's storeLL still posts). A peer still inside the same collective then sees it complete, with garbage. Deferring
// the abort lets every healthy peer whose collective started within the grace reach its own deadline first and fail
// the op (a completion after the deadline or after an abort request counts as a failure); a program that exits on the
// CommError never sends the garbage at all. Seen on 4×H100 (2026-11-26, f176c25 with blocking communicators): without
// it, a healthy rank of a job with a silent or stopped rank printed "all_reduce completed" (docs/comm.md).
inline Clock::duration AbortGrace(Clock::duration timeout) {
    return std::min<Clock::duration>(std::chrono::seconds(1), timeout / 4);
}
// An abort requested (Abort(), an asynchronous error, a timeout) and due (a timeout's after AbortGrace) while the
// issuing thread has been inside NCCL this long is carried out from the watchdog, concurrently (enqueue_watch.h): the
// thread is blocked there, not enqueueing.
inline constexpr auto kInsideNcclGrace = std::chrono::seconds(1);

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

inline ncclDataType_t ToNccl(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return ncclFloat32;
    case DType::kFloat16:
        return ncclFloat16;
    case DType::kBFloat16:
        return ncclBfloat16;
    case DType::kFloat64:
        return ncclFloat64;
    case DType::kInt64:
        return ncclInt64;
    }
    SHARDLINE_THROW(DTypeError, "NcclCommunicator",
                    "NCCL collectives take float32, float16, bfloat16, float64 or int64, got {}", DTypeName(dtype));
}

inline ncclRedOp_t ToNccl(ReduceOp op) {
    switch (op) {
    case ReduceOp::kSum:
        return ncclSum;
    case ReduceOp::kAvg:
        return ncclAvg;
    case ReduceOp::kMax:
        return ncclMax;
    case ReduceOp::kMin:
        return ncclMin;
    }
    SHARDLINE_THROW(Error, "NcclCommunicator", "unknown ReduceOp {}", static_cast<int>(op));
}

/// Makes `device` current for the scope and restores the caller's device (callers may drive several GPUs).
class DeviceGuard {
public:
    explicit DeviceGuard(int device) {
        if (cudaGetDevice(&previous_) != cudaSuccess) {
            (void)cudaGetLastError();
            previous_ = -1;
        }
        if (previous_ != device) {
            SHARDLINE_CHECK_CUDA(cudaSetDevice(device));
        }
        device_ = device;
    }
    ~DeviceGuard() {
        if (previous_ >= 0 && previous_ != device_) {
            (void)cudaSetDevice(previous_);
        }
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int previous_ = -1;
    int device_ = -1;
};

/// Polls that stay cheap when the wait is short. Enqueueing on a non-blocking communicator usually finishes within tens
/// of microseconds, and the first sleep_for costs ~60 µs whatever it asks for (timer slack), so: yield for the first
/// 200 µs (what a blocking communicator's own spin costs), then sleep, doubling up to 1 ms.
class Backoff {
public:
    void Pause() {
        if (Clock::now() - start_ < std::chrono::microseconds(200)) {
            std::this_thread::yield();
            return;
        }
        std::this_thread::sleep_for(sleep_);
        sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
    }

private:
    Clock::time_point start_ = Clock::now();
    std::chrono::microseconds sleep_{20};
};

inline std::string DescribeOp(CollectiveKind kind, std::int64_t aux) {
    switch (kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduceScatter:
        return fmt::format("{}({})", CollectiveName(kind), ReduceOpName(static_cast<ReduceOp>(aux)));
    case CollectiveKind::kBroadcast:
        return fmt::format("{}(root {})", CollectiveName(kind), aux);
    default:
        return std::string(CollectiveName(kind));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// State shared by the communicator, its work handles and its watchdog.

struct NcclState;

/// What one collective call is, for counting, messages and the debug-mode agreement.
struct NcclIssue {
    std::string_view api;
    CollectiveKind kind;
    std::int64_t count; // elements, as every rank must agree (-1: checked per pair, all_to_all_v)
    DType dtype;
    std::int64_t aux = 0; // reduce op or broadcast root
    bool uneven = false;
    const std::vector<std::int64_t>* send_counts = nullptr; // all_to_all_v: checked as a matrix in debug mode
    const std::vector<std::int64_t>* recv_counts = nullptr;
};

struct NcclOp {
    enum Status : int { kPending, kDone, kFailed };

    std::shared_ptr<NcclState> state;
    CollectiveKind kind;
    std::int64_t aux;
    std::int64_t seq;
    std::int64_t count;
    DType dtype;
    Clock::time_point issued;
    cudaEvent_t done = nullptr;
    /// The done-event has been recorded for this op (set once the enqueue has returned). The op is tracked before it
    /// is enqueued, so that the watchdog sees a call blocked inside NCCL; until then its pooled event still holds an
    /// earlier op's record and must not be queried.
    std::atomic<bool> recorded{false};
    /// Issued while the compute stream was capturing a CUDA graph: it runs when the graph is launched, so the host
    /// neither tracks nor waits for it (the watchdog never sees it; its events belong to the capture).
    bool captured = false;
    std::atomic<int> status{kPending};
    std::mutex keep_mutex;
    /// The storages of the (at most two) tensors the collective touches, released once it is complete or ordered on
    /// the compute stream. A fixed array: no per-call vector allocation on the issue path.
    std::array<std::shared_ptr<Storage>, 2> keep;

    ~NcclOp();
    std::string Describe() const;
    void Release() {
        std::array<std::shared_ptr<Storage>, 2> drop;
        {
            std::lock_guard lock(keep_mutex);
            drop.swap(keep);
        }
    }
};

struct NcclState {
    int device = 0;
    int rank = 0;
    int size = 1;
    std::string name;

    // Every NCCL call on `comm` and `control` holds nccl_mutex (NCCL allows one thread at a time on a communicator).
    // Holders never keep it longer than a bounded poll or one call into NCCL; the one exception to the rule is the
    // watchdog's ncclCommAbort of a call blocked inside NCCL (enqueue_watch.h), which takes abort_mutex instead.
    std::timed_mutex nccl_mutex;
    // The communicator the collectives run on: blocking for the communicators shardline creates (a split of
    // `control`, unless SHARDLINE_NCCL_BLOCKING=0), the caller's own for FromNcclComm.
    std::atomic<ncclComm_t> comm{nullptr};
    // Non-blocking, for Split (polled under the timeout); nullptr when `comm` itself is the one to split.
    std::atomic<ncclComm_t> control{nullptr};
    // Marks the calls into NCCL that may block on a blocking communicator (ncclGroupEnd), for the watchdog.
    EnqueueWatch enqueue;
    // Serialises the one ncclCommAbort (AbortNow), whoever carries it out.
    std::mutex abort_mutex;
    std::int64_t seq = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t ready_event = nullptr; // re-recorded per call: a stream wait captures the record at call time
    float* barrier_buffer = nullptr;
    std::int64_t* check_buffer = nullptr; // debug mode: [record | n records]
    std::int64_t check_record = 0;        // int64 per record
    cudaEvent_t check_event = nullptr;

    std::atomic<bool> abort_requested{false};
    std::atomic<bool> abort_done{false}; // ncclCommAbort has been called
    std::atomic<bool> closed{false};

    // Guards everything below.
    std::mutex mutex;
    WatchdogWake wake{kWatchdogPoll, kWatchdogIdlePolls}; // the watchdog's waits; no notify per call
    std::string abort_reason;
    Clock::time_point abort_requested_at;
    Clock::time_point abort_not_before; // a timeout's abort waits for the grace (AbortGrace); others are due at once
    std::deque<std::shared_ptr<NcclOp>> outstanding;
    std::vector<cudaEvent_t> event_pool;
    bool stop = false;
    std::thread watchdog;

    std::string AbortReason() {
        std::lock_guard lock(mutex);
        return abort_reason;
    }

    /// Records why (the first reason wins); whoever holds nccl_mutex next carries out the abort, once it is due
    /// (`not_before`: a timeout's deadline + AbortGrace; default: at once). For holders of nccl_mutex (NcclLock aborts
    /// when it releases it).
    void NoteAbort(std::string reason, Clock::time_point not_before = {}) noexcept {
        try {
            std::lock_guard lock(mutex);
            if (abort_reason.empty()) {
                abort_reason = std::move(reason);
                abort_requested_at = Clock::now();
                abort_not_before = not_before;
            }
        } catch (...) {
            // a reason we could not store is still an abort
        }
        abort_requested = true;
    }

    /// NoteAbort, then aborts at once when it is due and nccl_mutex is free (else its holder, or the watchdog, does
    /// when it is due). Never blocks; never call it holding nccl_mutex.
    void RequestAbort(std::string reason, Clock::time_point not_before = {}) noexcept {
        NoteAbort(std::move(reason), not_before);
        if (AbortDue() && nccl_mutex.try_lock()) {
            AbortNow();
            nccl_mutex.unlock();
        }
        wake.NotifyAll();
    }

    /// A timed-out op's abort: due AbortGrace after its deadline (see AbortGrace for why it waits).
    void RequestTimeoutAbort(std::string reason, Clock::time_point issued, Clock::duration timeout) noexcept {
        RequestAbort(std::move(reason), issued + timeout + AbortGrace(timeout));
    }

    /// When the requested abort may be carried out (a default time point: at once).
    Clock::time_point AbortNotBefore() noexcept {
        std::lock_guard lock(mutex);
        return abort_not_before;
    }
    /// An abort was requested and may be carried out now.
    bool AbortDue() noexcept { return abort_requested && Clock::now() >= AbortNotBefore(); }

    /// Aborts `comm` and `control` once. The caller holds nccl_mutex, or is the watchdog releasing a thread blocked
    /// inside NCCL (EnqueueWatch::AbortIfStuck); either way only once the abort is due (AbortDue; the destructor sleeps
    /// until then). After an immediate abort (Abort(), an NCCL or CUDA error), work whose done-event already fired
    /// finished before it and stays valid; the rest fails. After a timeout's deferred abort every op still pending
    /// fails: a done-event that fired during the grace may be a peer's aborted kernel running to its end (AbortGrace).
    void AbortNow() noexcept {
        abort_requested = true;
        std::lock_guard abort_lock(abort_mutex);
        if (abort_done) {
            return;
        }
        std::vector<std::shared_ptr<NcclOp>> ops;
        bool deferred = false;
        try {
            std::lock_guard lock(mutex);
            ops.assign(outstanding.begin(), outstanding.end());
            deferred = abort_not_before != Clock::time_point{};
        } catch (...) {
        }
        for (auto& op : ops) {
            int expected = NcclOp::kPending;
            cudaError_t q = cudaErrorNotReady;
            if (op->recorded) {
                q = cudaEventQuery(op->done);
                if (q != cudaErrorNotReady) {
                    (void)cudaGetLastError();
                }
            }
            op->status.compare_exchange_strong(expected,
                                               q == cudaSuccess && !deferred ? NcclOp::kDone : NcclOp::kFailed);
        }
        ncclResult_t r = ncclSuccess;
        for (std::atomic<ncclComm_t>* c : {&comm, &control}) {
            if (ncclComm_t handle = c->exchange(nullptr); handle != nullptr) {
                const ncclResult_t ri = ncclCommAbort(handle);
                r = r == ncclSuccess ? ri : r;
            }
        }
        abort_done = true;
        try {
            SHARDLINE_LOG_ERROR("NCCL communicator '{}' aborted ({}): {}", name,
                                r == ncclSuccess ? "ncclCommAbort ok" : ncclGetErrorString(r), AbortReason());
        } catch (...) {
        }
    }

    cudaEvent_t AcquireEvent() {
        {
            std::lock_guard lock(mutex);
            if (!event_pool.empty()) {
                cudaEvent_t e = event_pool.back();
                event_pool.pop_back();
                return e;
            }
        }
        cudaEvent_t e = nullptr;
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        return e;
    }

    void ReleaseEvent(cudaEvent_t e) noexcept {
        if (e == nullptr) {
            return;
        }
        if (!closed) {
            try {
                std::lock_guard lock(mutex);
                if (!closed) {
                    event_pool.push_back(e);
                    return;
                }
            } catch (...) {
            }
        }
        (void)cudaEventDestroy(e);
    }

    [[noreturn]] void ThrowAborted(std::string_view api) {
        const std::string reason = AbortReason();
        SHARDLINE_THROW(CommError, api, "NCCL communicator '{}' was aborted: {}", name,
                        reason.empty() ? std::string("Abort() was called") : reason);
    }

    /// Called from a catch block around a collective's host-side step (`doing`: "issuing", "checking"): notes the
    /// abort the failure leaves behind and rethrows. A CommError says what happened; another exception is described
    /// with the collective.
    [[noreturn]] void NoteAbortAndRethrow(const NcclIssue& issue, std::string_view doing);

    void WatchdogLoop() noexcept;
};

/// nccl_mutex for the scope; a requested abort that is due is carried out before the mutex is released.
class NcclLock {
public:
    explicit NcclLock(NcclState& state) : state_(state), lock_(state.nccl_mutex) {}
    ~NcclLock() {
        if (state_.abort_requested && !state_.abort_done && state_.AbortDue()) {
            state_.AbortNow(); // not yet due: the watchdog carries it out when it is
        }
    }
    NcclLock(const NcclLock&) = delete;
    NcclLock& operator=(const NcclLock&) = delete;

private:
    NcclState& state_;
    std::unique_lock<std::timed_mutex> lock_;
};

/// Phase 1: NCCL has accepted the call (ncclGroupEnd/Init/Split returned) but a non-blocking communicator may still be
/// working on it. Polls until it has left ncclInProgress; throws CommError on an error, a requested abort or the
/// timeout. `comms` are polled together (a split polls parent and child). nccl_mutex held.
/// `describe` names the call in a message; it runs only when one is raised (the issue path calls this once per
/// collective on a non-blocking communicator, and formatting the op's description every time costs a string).
void WaitLeftInProgress(NcclState& state, std::initializer_list<ncclComm_t> comms, ncclResult_t returned,
                        std::string_view api, const std::function<std::string()>& describe, Clock::time_point start);
inline void WaitLeftInProgress(NcclState& state, std::initializer_list<ncclComm_t> comms, ncclResult_t returned,
                               std::string_view api, const std::string& what, Clock::time_point start) {
    WaitLeftInProgress(state, comms, returned, api, std::function<std::string()>([&] { return what; }), start);
}

/// A configuration named `name` (the string must outlive the config's use), blocking or not.
ncclConfig_t NcclConfig(const std::string& name, bool blocking);

/// Whether the communicators shardline creates run their collectives on a blocking NCCL communicator
/// (SHARDLINE_NCCL_BLOCKING, default 1; read at each creation).
bool BlockingCollectives();

/// The watchdog runs every `poll`; a thread that has entered NCCL (EnqueueWatch::Enter) on a communicator whose
/// watchdog sleeps without a deadline wakes it (the collectives do this through Track; other callers here).
void WakeWatchdog(NcclState& state);

/// NVLink multicast can put shared GPUs out of service: NCCL must never use NVLS, whatever the caller's environment.
void KeepMulticastOff();

/// The work handle of an issued op.
WorkHandle MakeNcclWork(std::shared_ptr<NcclOp> op);

/// Debug mode: every rank learns every rank's (op, seq, count, dtype) and returns the same verdict: an empty string
/// when they agree, else a message listing them. nccl_mutex held.
std::string AgreementVerdict(NcclState& s, const NcclIssue& issue, std::int64_t seq);

} // namespace shardline::comm::detail
