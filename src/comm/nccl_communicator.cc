#include "comm/nccl_communicator.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <shardline/core/context.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "comm/backends.h"

namespace shardline::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at outstanding work. Timeouts are seconds; this bounds how long a finished
// collective's tensors stay referenced when nobody waits on it.
constexpr auto kWatchdogPoll = std::chrono::milliseconds(2);
// How long a destructor lets ncclCommFinalize run before it falls back to ncclCommAbort.
constexpr auto kMaxFinalize = std::chrono::seconds(30);

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

ncclDataType_t ToNccl(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return ncclFloat32;
    case DType::kFloat16:
        return ncclFloat16;
    case DType::kBFloat16:
        return ncclBfloat16;
    case DType::kFloat64:
    case DType::kInt64:
        break;
    }
    SHARDLINE_THROW(DTypeError, "NcclCommunicator", "NCCL collectives take float32, float16 or bfloat16, got {}",
                    DTypeName(dtype));
}

ncclRedOp_t ToNccl(ReduceOp op) {
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

std::string DescribeOp(CollectiveKind kind, std::int64_t aux) {
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

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// State shared by the communicator, its work handles and its watchdog.

/// What one collective call is, for counting, messages and the debug-mode agreement.
struct NcclIssue {
    std::string_view api;
    CollectiveKind kind;
    std::int64_t bytes;   // counted: this rank's input size
    std::int64_t count;   // elements, as every rank must agree (-1: checked per pair, all_to_all_v)
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
    /// Issued while the compute stream was capturing a CUDA graph: it runs when the graph is launched, so the host
    /// neither tracks nor waits for it (the watchdog never sees it; its events belong to the capture).
    bool captured = false;
    std::atomic<int> status{kPending};
    std::mutex keep_mutex;
    std::vector<std::shared_ptr<Storage>> keep; // released once the collective is complete or ordered on compute

    ~NcclOp();
    std::string Describe() const;
    void Release() {
        std::vector<std::shared_ptr<Storage>> drop;
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

    // Every NCCL call on `comm` holds nccl_mutex (NCCL allows one thread at a time on a communicator, abort included).
    // Holders never keep it longer than a bounded poll.
    std::timed_mutex nccl_mutex;
    ncclComm_t comm = nullptr;
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
    std::condition_variable wake;
    std::string abort_reason;
    Clock::time_point abort_requested_at;
    std::deque<std::shared_ptr<NcclOp>> outstanding;
    std::vector<cudaEvent_t> event_pool;
    bool stop = false;
    std::thread watchdog;

    std::string AbortReason() {
        std::lock_guard lock(mutex);
        return abort_reason;
    }

    /// Records why (the first reason wins); whoever holds nccl_mutex next carries out the abort. For holders of
    /// nccl_mutex (NcclLock aborts when it releases it).
    void NoteAbort(std::string reason) noexcept {
        try {
            std::lock_guard lock(mutex);
            if (abort_reason.empty()) {
                abort_reason = std::move(reason);
                abort_requested_at = Clock::now();
            }
        } catch (...) {
            // a reason we could not store is still an abort
        }
        abort_requested = true;
    }

    /// NoteAbort, then aborts at once when nccl_mutex is free. Never blocks; never call it holding nccl_mutex.
    void RequestAbort(std::string reason) noexcept {
        NoteAbort(std::move(reason));
        if (nccl_mutex.try_lock()) {
            AbortLocked();
            nccl_mutex.unlock();
        }
        wake.notify_all();
    }

    /// nccl_mutex held. Work whose done-event already fired finished before the abort and stays valid; the rest fails.
    void AbortLocked() noexcept {
        abort_requested = true;
        if (comm == nullptr) {
            return;
        }
        std::vector<std::shared_ptr<NcclOp>> ops;
        try {
            std::lock_guard lock(mutex);
            ops.assign(outstanding.begin(), outstanding.end());
        } catch (...) {
        }
        for (auto& op : ops) {
            int expected = NcclOp::kPending;
            const cudaError_t q = cudaEventQuery(op->done);
            if (q != cudaErrorNotReady) {
                (void)cudaGetLastError();
            }
            op->status.compare_exchange_strong(expected, q == cudaSuccess ? NcclOp::kDone : NcclOp::kFailed);
        }
        const ncclResult_t r = ncclCommAbort(comm);
        comm = nullptr;
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

    void WatchdogLoop() noexcept;
};

NcclOp::~NcclOp() {
    if (state != nullptr) {
        state->ReleaseEvent(done);
    }
}

std::string NcclOp::Describe() const {
    return fmt::format("{} #{} (count {}, {}) on group '{}' (rank {} of {})", DescribeOp(kind, aux), seq, count,
                       DTypeName(dtype), state->name, state->rank, state->size);
}

namespace {

/// nccl_mutex for the scope; a requested abort is carried out before the mutex is released.
class NcclLock {
public:
    explicit NcclLock(NcclState& state) : state_(state), lock_(state.nccl_mutex) {}
    ~NcclLock() {
        if (state_.abort_requested && state_.comm != nullptr) {
            state_.AbortLocked();
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
void WaitLeftInProgress(NcclState& state, std::initializer_list<ncclComm_t> comms, ncclResult_t returned,
                        std::string_view api, const std::string& what, Clock::time_point start) {
    if (returned != ncclSuccess && returned != ncclInProgress) {
        SHARDLINE_THROW(CommError, api, "{} failed: {} ({})", what, ncclGetErrorString(returned),
                        ncclGetLastError(nullptr));
    }
    const auto timeout = CommTimeout();
    Backoff backoff;
    while (true) {
        bool in_progress = false;
        for (ncclComm_t c : comms) {
            if (c == nullptr) {
                continue;
            }
            ncclResult_t async = ncclSuccess;
            const ncclResult_t r = ncclCommGetAsyncError(c, &async);
            if (r != ncclSuccess) {
                SHARDLINE_THROW(CommError, api, "{}: ncclCommGetAsyncError failed: {}", what, ncclGetErrorString(r));
            }
            if (async == ncclInProgress) {
                in_progress = true;
            } else if (async != ncclSuccess) {
                SHARDLINE_THROW(CommError, api, "{} failed asynchronously: {} ({})", what, ncclGetErrorString(async),
                                ncclGetLastError(c));
            }
        }
        if (!in_progress) {
            return;
        }
        if (state.abort_requested) {
            state.ThrowAborted(api);
        }
        const auto elapsed = Clock::now() - start;
        if (elapsed > timeout) {
            SHARDLINE_THROW(CommError, api,
                            "{} did not leave ncclInProgress within {:.1f} s (phase 1: enqueue; elapsed {:.1f} s); "
                            "communicator aborted",
                            what, Seconds(timeout), Seconds(elapsed));
        }
        backoff.Pause();
    }
}

ncclConfig_t NonBlockingConfig(const std::string& name) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = name.c_str();
    return config;
}

/// NVLink multicast can put shared GPUs out of service: NCCL must never use NVLS, whatever the caller's environment.
void KeepMulticastOff() {
    const std::optional<std::string> env = env::Get("NCCL_NVLS_ENABLE");
    if (env && *env == "0") {
        return;
    }
    if (env) {
        SHARDLINE_LOG_WARN("NCCL_NVLS_ENABLE={} overridden to 0: shardline never lets NCCL use NVLink multicast", *env);
    }
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Watchdog: phase 2 when nobody waits on the host.

void NcclState::WatchdogLoop() noexcept {
    try {
        (void)cudaSetDevice(device);
        std::vector<std::shared_ptr<NcclOp>> ops;
        while (true) {
            {
                std::unique_lock lock(mutex);
                if (outstanding.empty() && (!abort_requested || abort_done)) {
                    wake.wait(lock, [&] { return stop || !outstanding.empty(); });
                } else {
                    wake.wait_for(lock, kWatchdogPoll, [&] { return stop; });
                }
                if (stop) {
                    return;
                }
                ops.assign(outstanding.begin(), outstanding.end());
            }

            // Retire finished work (its tensors may go back to the pool now), find the oldest overdue one.
            const auto now = Clock::now();
            const auto timeout = CommTimeout();
            std::shared_ptr<NcclOp> overdue;
            std::string cuda_failure;
            std::vector<NcclOp*> finished;
            for (auto& op : ops) {
                const cudaError_t q = cudaEventQuery(op->done);
                if (q == cudaSuccess) {
                    int expected = NcclOp::kPending;
                    op->status.compare_exchange_strong(expected, NcclOp::kDone);
                    op->Release();
                    finished.push_back(op.get());
                } else if (q != cudaErrorNotReady) {
                    (void)cudaGetLastError();
                    if (cuda_failure.empty()) {
                        cuda_failure = fmt::format("{}: CUDA reported {} ({}) while it ran", op->Describe(),
                                                   cudaGetErrorName(q), cudaGetErrorString(q));
                    }
                } else if (op->status == NcclOp::kPending && overdue == nullptr && now - op->issued > timeout) {
                    overdue = op;
                }
            }
            if (!finished.empty()) {
                std::lock_guard lock(mutex);
                std::erase_if(outstanding, [&](const std::shared_ptr<NcclOp>& op) {
                    return std::find(finished.begin(), finished.end(), op.get()) != finished.end();
                });
            }
            ops.clear();

            if (!abort_requested) {
                if (!cuda_failure.empty()) {
                    RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, "NcclWatchdog", cuda_failure));
                } else if (overdue != nullptr) {
                    RequestAbort(::shardline::detail::FormatError(
                        __FILE__, __LINE__, "NcclWatchdog",
                        fmt::format("{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); "
                                    "communicator aborted",
                                    overdue->Describe(), Seconds(timeout), Seconds(now - overdue->issued))));
                } else if (nccl_mutex.try_lock()) {
                    // Asynchronous errors (a peer's connection dropped, ...) while work is in flight.
                    std::string failure;
                    if (comm != nullptr) {
                        ncclResult_t async = ncclSuccess;
                        const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
                        if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
                            const ncclResult_t bad = r != ncclSuccess ? r : async;
                            failure = fmt::format("asynchronous NCCL error on group '{}' (rank {} of {}): {} ({})",
                                                  name, rank, size, ncclGetErrorString(bad), ncclGetLastError(comm));
                        }
                    }
                    nccl_mutex.unlock();
                    if (!failure.empty()) {
                        RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, "NcclWatchdog", failure));
                    }
                }
            }
            overdue.reset();

            if (abort_requested && !abort_done) {
                // Carry out a requested abort that found the mutex busy. A holder is inside a bounded poll that checks
                // the request, or stuck inside NCCL itself (a full launch queue behind a hung kernel): give it another
                // timeout, then end the process rather than hang.
                if (nccl_mutex.try_lock()) {
                    AbortLocked();
                    nccl_mutex.unlock();
                } else {
                    Clock::time_point requested;
                    {
                        std::lock_guard lock(mutex);
                        requested = abort_requested_at;
                    }
                    if (requested != Clock::time_point{} && Clock::now() - requested > 2 * timeout) {
                        SHARDLINE_LOG_ERROR("NCCL communicator '{}': abort requested {:.1f} s ago but a thread is stuck "
                                            "inside NCCL; terminating the process ({})",
                                            name, Seconds(Clock::now() - requested), AbortReason());
                        std::abort();
                    }
                }
            }
        }
    } catch (const std::exception& e) {
        try {
            SHARDLINE_LOG_ERROR("NCCL watchdog of '{}' stopped: {}", name, e.what());
        } catch (...) {
        }
    } catch (...) {
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Work

namespace {

class NcclWork final : public Work {
public:
    explicit NcclWork(std::shared_ptr<NcclOp> op) : op_(std::move(op)) {}

    void Wait(bool host) override {
        NcclState& state = *op_->state;
        if (op_->captured) {
            SHARDLINE_CHECK_AS(CommError, !host, "Work::Wait",
                               "{} was captured into a CUDA graph: it runs when the graph is launched, so the host "
                               "cannot wait for it (Wait(false) orders it on the stream)",
                               op_->Describe());
            DeviceGuard guard(state.device);
            SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(CudaContext::Get(state.device).stream(), op_->done, 0));
            return;
        }
        ThrowIfFailed("Work::Wait");
        if (op_->status != NcclOp::kDone) {
            DeviceGuard guard(state.device);
            // Ordered after the collective: the compute stream's later work, and any stream-ordered free of the
            // tensors, waits for it. The tensors need no reference from here on.
            SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(CudaContext::Get(state.device).stream(), op_->done, 0));
            if (!host) {
                op_->Release();
                return;
            }
        }
        if (!host) {
            return;
        }
        Backoff backoff;
        while (!Test()) {
            backoff.Pause();
        }
    }

    bool Test() override {
        NcclState& state = *op_->state;
        SHARDLINE_CHECK_AS(CommError, !op_->captured, "Work::Test",
                           "{} was captured into a CUDA graph: it completes when the graph runs, not now (Wait(false) "
                           "orders it on the stream)",
                           op_->Describe());
        ThrowIfFailed("Work::Test");
        if (op_->status == NcclOp::kDone) {
            return true;
        }
        const cudaError_t q = cudaEventQuery(op_->done);
        if (q == cudaSuccess) {
            // A done-event also fires when an abort made the kernel exit: trust it only while not aborted.
            int expected = NcclOp::kPending;
            if (!state.abort_requested && op_->status.compare_exchange_strong(expected, NcclOp::kDone)) {
                op_->Release();
                return true;
            }
            ThrowIfFailed("Work::Test");
            return op_->status == NcclOp::kDone;
        }
        if (q != cudaErrorNotReady) {
            (void)cudaGetLastError();
            Fail("Work::Test", fmt::format("{}: CUDA reported {} ({}) while it ran", op_->Describe(),
                                           cudaGetErrorName(q), cudaGetErrorString(q)));
        }
        const auto elapsed = Clock::now() - op_->issued;
        if (elapsed > CommTimeout()) {
            Fail("Work::Test", fmt::format("{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); "
                                           "communicator aborted",
                                           op_->Describe(), Seconds(CommTimeout()), Seconds(elapsed)));
        }
        if (state.nccl_mutex.try_lock()) {
            std::string failure;
            if (state.comm != nullptr) {
                ncclResult_t async = ncclSuccess;
                const ncclResult_t r = ncclCommGetAsyncError(state.comm, &async);
                if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
                    failure = fmt::format("{}: asynchronous NCCL error: {} ({})", op_->Describe(),
                                          ncclGetErrorString(r != ncclSuccess ? r : async),
                                          ncclGetLastError(state.comm));
                }
            }
            state.nccl_mutex.unlock();
            if (!failure.empty()) {
                Fail("Work::Test", failure);
            }
        }
        return false;
    }

private:
    void ThrowIfFailed(std::string_view api) {
        NcclState& state = *op_->state;
        if (op_->status == NcclOp::kFailed || (op_->status == NcclOp::kPending && state.abort_requested)) {
            const std::string reason = state.AbortReason();
            SHARDLINE_THROW(CommError, api, "{} failed: NCCL communicator '{}' was aborted: {}", op_->Describe(),
                            state.name, reason.empty() ? std::string("Abort() was called") : reason);
        }
    }

    [[noreturn]] void Fail(std::string_view api, const std::string& what) {
        op_->state->RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, api, what));
        ThrowIfFailed(api);
        SHARDLINE_THROW(CommError, api, "{}", what); // the op finished just before the abort
    }

    std::shared_ptr<NcclOp> op_;
};

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Communicator

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device, int rank, int size, std::string name)
    : state_(std::make_shared<NcclState>()), device_(device), rank_(rank), size_(size), name_(std::move(name)) {
    NcclState& s = *state_;
    s.comm = comm;
    s.device = device;
    s.rank = rank;
    s.size = size;
    s.name = name_;
    try {
        DeviceGuard guard(device);
        CudaContext::Get(device); // the compute stream exists before ours is ordered against it
        SHARDLINE_CHECK_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&s.ready_event, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&s.check_event, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(
            cudaMallocAsync(reinterpret_cast<void**>(&s.barrier_buffer), sizeof(float), s.stream));
        SHARDLINE_CHECK_CUDA(cudaMemsetAsync(s.barrier_buffer, 0, sizeof(float), s.stream));
        s.watchdog = std::thread([state = state_.get()] { state->WatchdogLoop(); });
    } catch (...) {
        // The other ranks finished creating their side: leave the NCCL communicator in a state they can detect.
        (void)ncclCommAbort(s.comm);
        s.comm = nullptr;
        if (s.barrier_buffer != nullptr) {
            (void)cudaFreeAsync(s.barrier_buffer, s.stream);
        }
        for (cudaEvent_t e : {s.ready_event, s.check_event}) {
            if (e != nullptr) {
                (void)cudaEventDestroy(e);
            }
        }
        if (s.stream != nullptr) {
            (void)cudaStreamDestroy(s.stream);
        }
        s.closed = true;
        throw;
    }
}

NcclCommunicator::~NcclCommunicator() {
    NcclState& s = *state_;
    try {
        {
            std::lock_guard lock(s.mutex);
            s.stop = true;
        }
        s.wake.notify_all();
        if (s.watchdog.joinable()) {
            s.watchdog.join();
        }

        int previous = -1;
        (void)cudaGetDevice(&previous);
        (void)cudaSetDevice(s.device);

        std::vector<std::shared_ptr<NcclOp>> ops;
        {
            std::lock_guard lock(s.mutex);
            ops.assign(s.outstanding.begin(), s.outstanding.end());
            s.outstanding.clear();
        }
        {
            std::unique_lock lock(s.nccl_mutex);
            // Work still running is the normal state after Wait(host=false): finalize lets it complete (bounded
            // below). Only overdue work, or an abort already asked for, ends in ncclCommAbort.
            bool overdue = false;
            const auto now = Clock::now();
            for (auto& op : ops) {
                const cudaError_t q = cudaEventQuery(op->done);
                if (q == cudaSuccess) {
                    int expected = NcclOp::kPending;
                    op->status.compare_exchange_strong(expected, NcclOp::kDone);
                } else {
                    (void)cudaGetLastError();
                    overdue = overdue || (op->status == NcclOp::kPending && now - op->issued > CommTimeout());
                }
            }
            if (s.comm != nullptr) {
                if (overdue || s.abort_requested) {
                    s.NoteAbort(fmt::format("NCCL communicator '{}' destroyed with overdue work in flight", s.name));
                    s.AbortLocked();
                } else {
                    // Orderly: flush, wait (bounded) for NCCL to quiesce, free. A peer that never arrives ends in abort.
                    ncclResult_t r = ncclCommFinalize(s.comm);
                    const auto start = Clock::now();
                    const auto limit = std::min<Clock::duration>(CommTimeout(), kMaxFinalize);
                    Backoff backoff;
                    while (r == ncclInProgress && Clock::now() - start < limit) {
                        backoff.Pause();
                        ncclResult_t async = ncclInProgress;
                        if (ncclCommGetAsyncError(s.comm, &async) != ncclSuccess) {
                            async = ncclInternalError;
                        }
                        r = async;
                    }
                    if (r == ncclSuccess) {
                        (void)ncclCommDestroy(s.comm);
                    } else {
                        SHARDLINE_LOG_WARN("NCCL communicator '{}': ncclCommFinalize did not complete ({}); aborting",
                                           s.name, ncclGetErrorString(r));
                        (void)ncclCommAbort(s.comm);
                    }
                    s.comm = nullptr;
                }
            }
            for (auto& op : ops) {
                // After a finalize the work completed; after an abort whatever had not finished failed.
                const cudaError_t q = cudaEventQuery(op->done);
                (void)cudaGetLastError();
                int expected = NcclOp::kPending;
                op->status.compare_exchange_strong(expected, q == cudaSuccess ? NcclOp::kDone : NcclOp::kFailed);
            }
        }
        s.NoteAbort(fmt::format("NCCL communicator '{}' was destroyed", s.name)); // for handles that outlive it

        // Frees on the compute stream (the tensors kept by unfinished work) must follow whatever the communication
        // stream still runs: order the compute stream after it. An aborted collective exits, so this never hangs.
        cudaEvent_t join = nullptr;
        if (cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess) {
            if (cudaEventRecord(join, s.stream) == cudaSuccess) {
                if (CudaContext* ctx = &CudaContext::Get(s.device); ctx != nullptr) {
                    (void)cudaStreamWaitEvent(ctx->stream(), join, 0);
                }
            }
            (void)cudaEventDestroy(join);
        }
        (void)cudaGetLastError();
        for (auto& op : ops) {
            op->Release();
        }
        ops.clear();

        if (s.barrier_buffer != nullptr) {
            (void)cudaFreeAsync(s.barrier_buffer, s.stream);
        }
        if (s.check_buffer != nullptr) {
            (void)cudaFreeAsync(s.check_buffer, s.stream);
        }
        {
            std::lock_guard lock(s.mutex);
            s.closed = true;
            for (cudaEvent_t e : s.event_pool) {
                (void)cudaEventDestroy(e);
            }
            s.event_pool.clear();
        }
        (void)cudaEventDestroy(s.ready_event);
        (void)cudaEventDestroy(s.check_event);
        (void)cudaStreamDestroy(s.stream); // returns at once; the stream's resources go when its work is done
        (void)cudaGetLastError();
        if (previous >= 0) {
            (void)cudaSetDevice(previous);
        }
    } catch (const std::exception& e) {
        try {
            SHARDLINE_LOG_ERROR("destroying NCCL communicator '{}': {}", s.name, e.what());
        } catch (...) {
        }
    } catch (...) {
    }
}

void NcclCommunicator::Abort() noexcept {
    state_->RequestAbort(
        ::shardline::detail::FormatError(__FILE__, __LINE__, "NcclCommunicator::Abort", fmt::format("group '{}': Abort() was called", name_)));
}

bool NcclCommunicator::aborted() const { return state_->abort_requested; }

void NcclCommunicator::CheckTensor(const Tensor& tensor, std::string_view api, std::string_view what) const {
    SHARDLINE_CHECK(tensor.defined(), api, "{} must be a defined tensor", what);
    SHARDLINE_CHECK_AS(DeviceError, tensor.device() == Device::CUDA(device_), api,
                       "{} must live on cuda:{} (the device of NCCL group '{}'), got {}", what, device_, name_,
                       ToString(tensor.device()));
    SHARDLINE_CHECK_AS(ShapeError, tensor.is_contiguous(), api, "{} must be contiguous, got strides {}", what,
                       ShapeToString(tensor.strides()));
    SHARDLINE_CHECK_AS(DTypeError, tensor.dtype() != DType::kFloat64, api,
                       "{}: NCCL collectives take float32, float16 or bfloat16, got {}", what,
                       DTypeName(tensor.dtype()));
}

namespace {

// Debug-mode record: (op, seq, count, dtype). op packs the kind with its reduce op or root.
std::int64_t PackOp(const NcclIssue& issue) {
    return static_cast<std::int64_t>(issue.kind) * 1000000 + (issue.uneven ? 500000 : 0) + issue.aux;
}

std::string DescribePacked(const std::int64_t* rec) {
    const auto kind = static_cast<CollectiveKind>(rec[0] / 1000000);
    const std::int64_t rest = rec[0] % 1000000;
    const bool uneven = rest >= 500000;
    const std::int64_t aux = rest % 500000;
    const auto dtype = static_cast<DType>(rec[3]);
    const bool valid_kind = rec[0] >= 0 && rec[0] / 1000000 < kNumCollectiveKinds;
    const bool valid_dtype = rec[3] >= 0 && rec[3] <= static_cast<std::int64_t>(DType::kFloat64);
    return fmt::format("{}{} #{} count {} {}", valid_kind ? DescribeOp(kind, aux) : fmt::format("op {}", rec[0]),
                       uneven ? " (uneven)" : "", rec[1], rec[2],
                       valid_dtype ? std::string(DTypeName(dtype)) : fmt::format("dtype {}", rec[3]));
}

/// Debug mode: all-gathers `words` int64 from every rank into check_buffer and copies them to `out` (size·words).
/// A host wait, bounded by the timeout (phase 1 and 2 as for any collective). nccl_mutex held.
void ExchangeRecords(NcclState& s, const std::int64_t* mine, std::int64_t words, std::vector<std::int64_t>& out,
                     std::string_view api, const std::string& what) {
    const std::int64_t needed = words * (s.size + 1);
    if (s.check_record < needed) {
        if (s.check_buffer != nullptr) {
            SHARDLINE_CHECK_CUDA(cudaFreeAsync(s.check_buffer, s.stream));
            s.check_buffer = nullptr;
        }
        SHARDLINE_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&s.check_buffer),
                                             static_cast<std::size_t>(needed) * sizeof(std::int64_t), s.stream));
        s.check_record = needed;
    }
    std::int64_t* send = s.check_buffer;
    std::int64_t* recv = s.check_buffer + words;
    // Pageable host → device: staged at once, no wait on the stream.
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(send, mine, static_cast<std::size_t>(words) * sizeof(std::int64_t),
                                         cudaMemcpyHostToDevice, s.stream));
    const auto start = Clock::now();
    SHARDLINE_CHECK_NCCL(ncclGroupStart());
    const ncclResult_t gather = ncclAllGather(send, recv, static_cast<std::size_t>(words), ncclInt64, s.comm, s.stream);
    const ncclResult_t end = ncclGroupEnd();
    WaitLeftInProgress(s, {s.comm}, gather != ncclSuccess && gather != ncclInProgress ? gather : end, api, what,
                       start);
    SHARDLINE_CHECK_CUDA(cudaEventRecord(s.check_event, s.stream));
    const auto timeout = CommTimeout();
    Backoff backoff;
    while (true) {
        const cudaError_t q = cudaEventQuery(s.check_event);
        if (q == cudaSuccess) {
            break;
        }
        if (q != cudaErrorNotReady) {
            SHARDLINE_CHECK_CUDA(q);
        }
        ncclResult_t async = ncclSuccess;
        SHARDLINE_CHECK_NCCL(ncclCommGetAsyncError(s.comm, &async));
        SHARDLINE_CHECK_AS(CommError, async == ncclSuccess || async == ncclInProgress, api,
                           "{} failed asynchronously: {}", what, ncclGetErrorString(async));
        if (s.abort_requested) {
            s.ThrowAborted(api);
        }
        const auto elapsed = Clock::now() - start;
        SHARDLINE_CHECK_AS(CommError, elapsed <= timeout, api,
                           "{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); communicator "
                           "aborted",
                           what, Seconds(timeout), Seconds(elapsed));
        backoff.Pause();
    }
    out.resize(static_cast<std::size_t>(words * s.size));
    // Device → pageable host waits for the copy; the stream is idle up to it (the event above fired).
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(out.data(), recv, out.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost,
                                         s.stream));
}

/// Debug mode: every rank learns every rank's (op, seq, count, dtype) and returns the same verdict: an empty string
/// when they agree, else a message listing them. all_to_all_v also checks that send_counts[r] of rank i equals
/// recv_counts[i] of rank r. nccl_mutex held.
std::string CheckAgreement(NcclState& s, const NcclIssue& issue, std::int64_t seq) {
    const std::int64_t mine[4] = {PackOp(issue), seq, issue.count, static_cast<std::int64_t>(issue.dtype)};
    std::vector<std::int64_t> all;
    const std::string what = fmt::format("SHARDLINE_COMM_CHECK exchange before {} #{} on group '{}'",
                                         DescribeOp(issue.kind, issue.aux), seq, s.name);
    ExchangeRecords(s, mine, 4, all, issue.api, what);
    bool agree = true;
    for (int r = 1; r < s.size; ++r) {
        agree = agree && std::equal(all.begin(), all.begin() + 4, all.begin() + 4 * r);
    }
    if (agree && issue.send_counts != nullptr) {
        const std::int64_t n = s.size;
        std::vector<std::int64_t> counts(static_cast<std::size_t>(2 * n));
        std::copy(issue.send_counts->begin(), issue.send_counts->end(), counts.begin());
        std::copy(issue.recv_counts->begin(), issue.recv_counts->end(), counts.begin() + n);
        std::vector<std::int64_t> matrix;
        ExchangeRecords(s, counts.data(), 2 * n, matrix, issue.api, what);
        std::string pairs;
        for (std::int64_t i = 0; i < n; ++i) {
            for (std::int64_t r = 0; r < n; ++r) {
                const std::int64_t sent = matrix[static_cast<std::size_t>(i * 2 * n + r)];
                const std::int64_t expected = matrix[static_cast<std::size_t>(r * 2 * n + n + i)];
                if (sent != expected) {
                    pairs += fmt::format("; rank {} sends {} elements to rank {}, which expects {}", i, sent, r,
                                         expected);
                }
            }
        }
        if (!pairs.empty()) {
            return fmt::format("SHARDLINE_COMM_CHECK: ranks of group '{}' disagree on {} #{}{}", s.name,
                               DescribeOp(issue.kind, issue.aux), seq, pairs);
        }
        return {};
    }
    if (agree) {
        return {};
    }
    std::string listing;
    for (int r = 0; r < s.size; ++r) {
        listing += fmt::format("; rank {}: {}", r, DescribePacked(all.data() + 4 * r));
    }
    return fmt::format("SHARDLINE_COMM_CHECK: ranks of group '{}' disagree before collective #{}{}", s.name, seq,
                       listing);
}

std::int64_t CheckCounts(const std::vector<std::int64_t>& counts, int size, std::string_view api,
                         std::string_view what) {
    SHARDLINE_CHECK_AS(ShapeError, static_cast<int>(counts.size()) == size, api,
                       "{} must have one entry per rank ({}), got {}", what, size, counts.size());
    std::int64_t total = 0;
    for (std::int64_t c : counts) {
        SHARDLINE_CHECK_AS(ShapeError, c >= 0, api, "{} must be >= 0, got {}", what, fmt::join(counts, ", "));
        total += c;
    }
    return total;
}

char* Bytes(const Tensor& t) { return static_cast<char*>(t.data()); }

} // namespace

template <class Enqueue> WorkHandle NcclCommunicator::Issue(const NcclIssue& issue, Enqueue&& enqueue) {
    NcclState& s = *state_;
    if (s.abort_requested) {
        s.ThrowAborted(issue.api);
    }
    Count(issue.kind, issue.bytes);
    DeviceGuard guard(device_);
    cudaStream_t compute = CudaContext::Get(device_).stream();
    // Under CUDA graph capture of the compute stream the collective becomes part of the graph: s.stream joins the
    // capture through ready_event and rejoins the compute stream through op->done in Wait.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(compute, &capture));
    SHARDLINE_CHECK_AS(CommError, capture != cudaStreamCaptureStatusInvalidated, issue.api,
                       "the compute stream of cuda:{} is in an invalidated CUDA graph capture", device_);
    const bool captured = capture == cudaStreamCaptureStatusActive;

    std::shared_ptr<NcclOp> op;
    std::string mismatch;
    {
        NcclLock lock(s);
        if (s.comm == nullptr || s.abort_requested) {
            s.ThrowAborted(issue.api);
        }
        const std::int64_t seq = ++s.seq;
        try {
            // The agreement check waits on the host for its own all-gather, which a capture cannot contain: it runs
            // on the eager calls (e.g. the warm-up step before capture), not on the captured ones.
            if (CommCheckEnabled() && !captured) {
                mismatch = CheckAgreement(s, issue, seq);
            }
            if (mismatch.empty()) {
                op = std::make_shared<NcclOp>();
                op->state = state_;
                op->kind = issue.kind;
                op->aux = issue.aux;
                op->seq = seq;
                op->count = issue.count;
                op->dtype = issue.dtype;
                op->done = s.AcquireEvent();
                op->issued = Clock::now();
                op->captured = captured;
                if (!captured) {
                    // (Captured tensors are graph memory whose frees the capture orders after the collective.)
                    std::vector<std::shared_ptr<Storage>> keep;
                    enqueue.Keep(keep);
                    op->keep = std::move(keep);
                }

                SHARDLINE_CHECK_CUDA(cudaEventRecord(s.ready_event, compute));
                SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(s.stream, s.ready_event, 0));
                if (enqueue.HasWork()) {
                    SHARDLINE_CHECK_NCCL(ncclGroupStart());
                    ncclResult_t first_error = ncclSuccess;
                    try {
                        first_error = enqueue(s.comm, s.stream);
                    } catch (...) {
                        (void)ncclGroupEnd();
                        throw;
                    }
                    const ncclResult_t end = ncclGroupEnd();
                    try {
                        WaitLeftInProgress(s, {s.comm}, first_error != ncclSuccess ? first_error : end, issue.api,
                                           op->Describe(), op->issued);
                    } catch (...) {
                        // Kernels may already be queued on s.stream and still touch the kept tensors: track the op
                        // as failed so the watchdog releases them only once its done-event has fired (after the
                        // abort this failure leads to).
                        op->status = NcclOp::kFailed;
                        if (!captured) {
                            (void)cudaEventRecord(op->done, s.stream);
                            std::lock_guard track(s.mutex);
                            s.outstanding.push_back(op);
                        }
                        throw;
                    }
                }
                SHARDLINE_CHECK_CUDA(cudaEventRecord(op->done, s.stream));
                if (!captured) {
                    // Registered before nccl_mutex is released: an abort carried out by NcclLock's destructor must see
                    // this op, or it would stay pending and be reported done once the aborted kernel's event fires.
                    std::lock_guard track(s.mutex);
                    s.outstanding.push_back(op);
                }
            }
        } catch (const CommError& e) {
            s.NoteAbort(e.what());
            throw;
        } catch (const std::exception& e) {
            s.NoteAbort(::shardline::detail::FormatError(__FILE__, __LINE__, issue.api,
                                               fmt::format("issuing {} failed: {}",
                                                           DescribeOp(issue.kind, issue.aux), e.what())));
            throw;
        }
    }
    SHARDLINE_CHECK_AS(CommError, mismatch.empty(), issue.api, "{}", mismatch);
    s.wake.notify_one();
    return std::make_shared<NcclWork>(std::move(op));
}

namespace {

/// One collective's NCCL calls: `calls` enqueues them (inside ncclGroupStart/End) and returns the first non-success
/// status; `tensors` are kept alive until it completes.
template <class Calls> struct Enqueue {
    Calls calls;
    std::array<const Tensor*, 2> tensors;
    bool has_work;

    bool HasWork() const { return has_work; }
    void Keep(std::vector<std::shared_ptr<Storage>>& keep) const {
        for (const Tensor* t : tensors) {
            if (t != nullptr && t->storage() != nullptr) {
                keep.push_back(t->storage());
            }
        }
    }
    ncclResult_t operator()(ncclComm_t comm, cudaStream_t stream) { return calls(comm, stream); }
};
template <class Calls>
Enqueue<Calls> MakeEnqueue(Calls calls, const Tensor* a, const Tensor* b, bool has_work) {
    return Enqueue<Calls>{std::move(calls), {a, b}, has_work};
}

/// Keeps the first failure of a sequence of NCCL calls (ncclInProgress is not one).
struct FirstError {
    ncclResult_t status = ncclSuccess;
    void operator+=(ncclResult_t r) {
        if (status == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
            status = r;
        }
    }
};

} // namespace

WorkHandle NcclCommunicator::AllReduce(Tensor& tensor, ReduceOp op) {
    constexpr std::string_view kApi = "NcclCommunicator::AllReduce";
    CheckTensor(tensor, kApi, "tensor");
    const ncclDataType_t type = ToNccl(tensor.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const auto n = static_cast<std::size_t>(tensor.numel());
    void* data = tensor.data();
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllReduce,
                           .bytes = static_cast<std::int64_t>(tensor.nbytes()),
                           .count = tensor.numel(),
                           .dtype = tensor.dtype(),
                           .aux = static_cast<std::int64_t>(op)},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     return ncclAllReduce(data, data, n, type, red, comm, stream);
                 }, &tensor, nullptr, n > 0));
}

WorkHandle NcclCommunicator::AllGather(const Tensor& input, Tensor& output) {
    constexpr std::string_view kApi = "NcclCommunicator::AllGather";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == input.numel() * size_, kApi,
                       "output must hold size ({}) x input ({}) = {} elements, got {}", size_, input.numel(),
                       input.numel() * size_, output.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const auto n = static_cast<std::size_t>(input.numel());
    const void* in = input.data();
    void* out = output.data();
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllGather,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = input.numel(),
                           .dtype = input.dtype()},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     return ncclAllGather(in, out, n, type, comm, stream);
                 }, &input, &output, n > 0));
}

WorkHandle NcclCommunicator::AllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) {
    constexpr std::string_view kApi = "NcclCommunicator::AllGatherV";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    const std::int64_t total = CheckCounts(counts, size_, kApi, "counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == counts[rank_], kApi,
                       "input of rank {} must hold counts[{}] = {} elements, got {}", rank_, rank_, counts[rank_],
                       input.numel());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == total, kApi, "output must hold sum(counts) = {} elements, got {}",
                       total, output.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const std::size_t elem = ElementSize(input.dtype());
    const void* in = input.data();
    char* out = Bytes(output);
    const int size = size_;
    // Rank r's block is a broadcast from root r into its place in the output; grouped, they run as one launch.
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllGather,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = total,
                           .dtype = input.dtype(),
                           .uneven = true},
                 MakeEnqueue([=, &counts](ncclComm_t comm, cudaStream_t stream) {
                     FirstError err;
                     std::size_t offset = 0;
                     for (int r = 0; r < size; ++r) {
                         const auto c = static_cast<std::size_t>(counts[r]);
                         if (c > 0) {
                             err += ncclBroadcast(in, out + offset * elem, c, type, r, comm, stream);
                         }
                         offset += c;
                     }
                     return err.status;
                 }, &input, &output, total > 0));
}

WorkHandle NcclCommunicator::ReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) {
    constexpr std::string_view kApi = "NcclCommunicator::ReduceScatter";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == output.numel() * size_, kApi,
                       "input must hold size ({}) x output ({}) = {} elements, got {}", size_, output.numel(),
                       output.numel() * size_, input.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const auto n = static_cast<std::size_t>(output.numel());
    const void* in = input.data();
    void* out = output.data();
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kReduceScatter,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = output.numel(),
                           .dtype = input.dtype(),
                           .aux = static_cast<std::int64_t>(op)},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     return ncclReduceScatter(in, out, n, type, red, comm, stream);
                 }, &input, &output, n > 0));
}

WorkHandle NcclCommunicator::ReduceScatterV(const Tensor& input, Tensor& output,
                                            const std::vector<std::int64_t>& counts, ReduceOp op) {
    constexpr std::string_view kApi = "NcclCommunicator::ReduceScatterV";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    const std::int64_t total = CheckCounts(counts, size_, kApi, "counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == total, kApi, "input must hold sum(counts) = {} elements, got {}",
                       total, input.numel());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == counts[rank_], kApi,
                       "output of rank {} must hold counts[{}] = {} elements, got {}", rank_, rank_, counts[rank_],
                       output.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const std::size_t elem = ElementSize(input.dtype());
    const char* in = Bytes(input);
    void* out = output.data();
    const int size = size_;
    // Block r is reduced onto root r (non-roots never write their recvbuff); grouped into one launch.
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kReduceScatter,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = total,
                           .dtype = input.dtype(),
                           .aux = static_cast<std::int64_t>(op),
                           .uneven = true},
                 MakeEnqueue([=, &counts](ncclComm_t comm, cudaStream_t stream) {
                     FirstError err;
                     std::size_t offset = 0;
                     for (int r = 0; r < size; ++r) {
                         const auto c = static_cast<std::size_t>(counts[r]);
                         if (c > 0) {
                             err += ncclReduce(in + offset * elem, out, c, type, red, r, comm, stream);
                         }
                         offset += c;
                     }
                     return err.status;
                 }, &input, &output, total > 0));
}

WorkHandle NcclCommunicator::AllToAll(const Tensor& input, Tensor& output) {
    constexpr std::string_view kApi = "NcclCommunicator::AllToAll";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == output.numel() && input.numel() % size_ == 0, kApi,
                       "input and output must hold the same number of elements, divisible by size ({}), got {} and {}",
                       size_, input.numel(), output.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const auto block = static_cast<std::size_t>(input.numel() / size_);
    const std::size_t block_bytes = block * ElementSize(input.dtype());
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const int size = size_;
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllToAll,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = input.numel(),
                           .dtype = input.dtype()},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     FirstError err;
                     for (int r = 0; r < size; ++r) {
                         err += ncclSend(in + r * block_bytes, block, type, r, comm, stream);
                         err += ncclRecv(out + r * block_bytes, block, type, r, comm, stream);
                     }
                     return err.status;
                 }, &input, &output, block > 0));
}

WorkHandle NcclCommunicator::AllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts,
                                       Tensor& output, const std::vector<std::int64_t>& recv_counts) {
    constexpr std::string_view kApi = "NcclCommunicator::AllToAllV";
    CheckTensor(input, kApi, "input");
    CheckTensor(output, kApi, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), kApi,
                       "input and output must have one dtype, got {} and {}", DTypeName(input.dtype()),
                       DTypeName(output.dtype()));
    const std::int64_t sent = CheckCounts(send_counts, size_, kApi, "send_counts");
    const std::int64_t received = CheckCounts(recv_counts, size_, kApi, "recv_counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == sent, kApi, "input must hold sum(send_counts) = {} elements, got {}",
                       sent, input.numel());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == received, kApi,
                       "output must hold sum(recv_counts) = {} elements, got {}", received, output.numel());
    const ncclDataType_t type = ToNccl(input.dtype());
    const std::size_t elem = ElementSize(input.dtype());
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const int size = size_;
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllToAll,
                           .bytes = static_cast<std::int64_t>(input.nbytes()),
                           .count = -1,
                           .dtype = input.dtype(),
                           .uneven = true,
                           .send_counts = &send_counts,
                           .recv_counts = &recv_counts},
                 MakeEnqueue([=, &send_counts, &recv_counts](ncclComm_t comm, cudaStream_t stream) {
                     FirstError err;
                     std::size_t send_offset = 0;
                     std::size_t recv_offset = 0;
                     for (int r = 0; r < size; ++r) {
                         const auto sc = static_cast<std::size_t>(send_counts[r]);
                         const auto rc = static_cast<std::size_t>(recv_counts[r]);
                         if (sc > 0) {
                             err += ncclSend(in + send_offset * elem, sc, type, r, comm, stream);
                         }
                         if (rc > 0) {
                             err += ncclRecv(out + recv_offset * elem, rc, type, r, comm, stream);
                         }
                         send_offset += sc;
                         recv_offset += rc;
                     }
                     return err.status;
                 }, &input, &output, sent > 0 || received > 0));
}

WorkHandle NcclCommunicator::Broadcast(Tensor& tensor, int root) {
    constexpr std::string_view kApi = "NcclCommunicator::Broadcast";
    CheckTensor(tensor, kApi, "tensor");
    SHARDLINE_CHECK(root >= 0 && root < size_, kApi, "root must be in [0, {}), got {}", size_, root);
    const ncclDataType_t type = ToNccl(tensor.dtype());
    const auto n = static_cast<std::size_t>(tensor.numel());
    void* data = tensor.data();
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kBroadcast,
                           .bytes = static_cast<std::int64_t>(tensor.nbytes()),
                           .count = tensor.numel(),
                           .dtype = tensor.dtype(),
                           .aux = root},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     return ncclBroadcast(data, data, n, type, root, comm, stream);
                 }, &tensor, nullptr, n > 0));
}

WorkHandle NcclCommunicator::Barrier() {
    // A one-float all-reduce on a buffer of our own: done when every rank has reached it.
    float* buffer = state_->barrier_buffer;
    return Issue(NcclIssue{.api = "NcclCommunicator::Barrier",
                           .kind = CollectiveKind::kBarrier,
                           .bytes = 0,
                           .count = 1,
                           .dtype = DType::kFloat32},
                 MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) {
                     return ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream);
                 }, nullptr, nullptr, true));
}

std::unique_ptr<Communicator> NcclCommunicator::Split(int color, int key, std::string name) {
    constexpr std::string_view kApi = "NcclCommunicator::Split";
    NcclState& s = *state_;
    SHARDLINE_CHECK(color >= 0, kApi, "color must be >= 0 (every rank joins a group), got {}", color);
    if (s.abort_requested) {
        s.ThrowAborted(kApi);
    }
    DeviceGuard guard(device_);
    ncclComm_t child = nullptr;
    {
        NcclLock lock(s);
        if (s.comm == nullptr || s.abort_requested) {
            s.ThrowAborted(kApi);
        }
        ncclConfig_t config = NonBlockingConfig(name);
        const auto start = Clock::now();
        try {
            const ncclResult_t r = ncclCommSplit(s.comm, color, key, &child, &config);
            WaitLeftInProgress(s, {s.comm, child}, r, kApi,
                               fmt::format("ncclCommSplit(color {}, key {}) of group '{}' into '{}'", color, key,
                                           s.name, name),
                               start);
        } catch (const std::exception& e) {
            if (child != nullptr) {
                (void)ncclCommAbort(child);
            }
            s.NoteAbort(e.what());
            throw;
        }
    }
    SHARDLINE_CHECK_AS(CommError, child != nullptr, kApi, "ncclCommSplit(color {}) of group '{}' returned no communicator",
                       color, s.name);
    int child_rank = 0;
    int child_size = 0;
    try {
        SHARDLINE_CHECK_NCCL(ncclCommUserRank(child, &child_rank));
        SHARDLINE_CHECK_NCCL(ncclCommCount(child, &child_size));
    } catch (...) {
        (void)ncclCommAbort(child);
        throw;
    }
    return std::make_unique<NcclCommunicator>(child, device_, child_rank, child_size, std::move(name));
}

// ---------------------------------------------------------------------------------------------------------------------
// World

std::unique_ptr<Communicator> CreateNcclWorld(Communicator& host_world, int device, std::string name) {
    constexpr std::string_view kApi = "CreateNcclWorld";
    SHARDLINE_CHECK_AS(DeviceError, host_world.device_type() == DeviceType::kCPU, kApi,
                       "host_world must move CPU tensors (an MPI communicator), got backend '{}'",
                       host_world.backend());
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
        (void)cudaGetLastError();
        visible = 0;
    }
    SHARDLINE_CHECK_AS(DeviceError, device >= 0 && device < visible, kApi,
                       "rank {} asked for cuda:{} but {} CUDA device(s) are visible", host_world.rank(), device,
                       visible);
    KeepMulticastOff();

    const int rank = host_world.rank();
    const int size = host_world.size();
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "the id travels as float32 words");
    if (rank == 0) {
        SHARDLINE_CHECK_NCCL(ncclGetUniqueId(&id));
    }
    Tensor blob = Tensor::FromBlob(&id, {static_cast<std::int64_t>(sizeof(id) / sizeof(float))}, DType::kFloat32,
                                   Device::CPU());
    host_world.Broadcast(blob, 0)->Wait(true);

    DeviceGuard guard(device);
    CudaContext::Get(device);
    ncclComm_t comm = nullptr;
    ncclConfig_t config = NonBlockingConfig(name);
    const auto start = Clock::now();
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    // No communicator object owns it yet: poll here with the same timeout, abort on failure.
    NcclState probe;
    probe.name = name;
    try {
        std::lock_guard lock(probe.nccl_mutex);
        WaitLeftInProgress(probe, {comm}, r, kApi,
                           fmt::format("ncclCommInitRankConfig(rank {} of {}, cuda:{}) of group '{}'", rank, size,
                                       device, name),
                           start);
    } catch (...) {
        if (comm != nullptr) {
            (void)ncclCommAbort(comm);
        }
        throw;
    }
    SHARDLINE_LOG_DEBUG("NCCL group '{}': rank {} of {} on cuda:{} (init {:.3f} s)", name, rank, size, device,
                        Seconds(Clock::now() - start));
    return std::make_unique<NcclCommunicator>(comm, device, rank, size, std::move(name));
}

} // namespace shardline::comm::detail
