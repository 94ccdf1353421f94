#include "comm/nccl_state.h"

#include <cstdlib>
#include <optional>

#include <shardline/core/context.h>
#include <shardline/core/env.h>

// The NCCL backend's state machinery: op descriptions, the phase-1 wait, the watchdog (phase 2 when nobody waits on
// the host) and the work handles.

namespace shardline::comm::detail {

void NcclState::NoteAbortAndRethrow(const NcclIssue& issue, std::string_view doing) {
    try {
        throw;
    } catch (const CommError& e) {
        NoteAbort(e.what());
        throw;
    } catch (const std::exception& e) {
        NoteAbort(::shardline::detail::FormatError(
            __FILE__, __LINE__, issue.api,
            fmt::format("{} {} failed: {}", doing, DescribeOp(issue.kind, issue.aux), e.what())));
        throw;
    }
}

NcclOp::~NcclOp() {
    if (state != nullptr) {
        state->ReleaseEvent(done);
    }
}

std::string NcclOp::Describe() const {
    return fmt::format("{} #{} (count {}, {}) on group '{}' (rank {} of {})", DescribeOp(kind, aux), seq, count,
                       DTypeName(dtype), state->name, state->rank, state->size);
}

/// Phase 1: NCCL has accepted the call (ncclGroupEnd/Init/Split returned) but a non-blocking communicator may still be
/// working on it. Polls until it has left ncclInProgress; throws CommError on an error, a requested abort or the
/// timeout. `comms` are polled together (a split polls parent and child). nccl_mutex held.
void WaitLeftInProgress(NcclState& state, std::initializer_list<ncclComm_t> comms, ncclResult_t returned,
                        std::string_view api, const std::function<std::string()>& describe, Clock::time_point start) {
    if (returned != ncclSuccess && returned != ncclInProgress) {
        SHARDLINE_THROW(CommError, api, "{} failed: {} ({})", describe(), ncclGetErrorString(returned),
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
                SHARDLINE_THROW(CommError, api, "{}: ncclCommGetAsyncError failed: {}", describe(),
                                ncclGetErrorString(r));
            }
            if (async == ncclInProgress) {
                in_progress = true;
            } else if (async != ncclSuccess) {
                SHARDLINE_THROW(CommError, api, "{} failed asynchronously: {} ({})", describe(),
                                ncclGetErrorString(async), ncclGetLastError(c));
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
                            describe(), Seconds(timeout), Seconds(elapsed));
        }
        backoff.Pause();
    }
}

ncclConfig_t NcclConfig(const std::string& name, bool blocking) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    config.commName = name.c_str();
    return config;
}

bool BlockingCollectives() { return env::GetBool("SHARDLINE_NCCL_BLOCKING", true); }

void WakeWatchdog(NcclState& state) {
    bool asleep = false;
    {
        std::lock_guard lock(state.mutex);
        asleep = state.wake.Asleep();
    }
    if (asleep) {
        state.wake.Notify();
    }
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

// ---------------------------------------------------------------------------------------------------------------------
// Watchdog: phase 2 when nobody waits on the host.

void NcclState::WatchdogLoop() noexcept {
    try {
        (void)cudaSetDevice(device);
        std::vector<std::shared_ptr<NcclOp>> ops;
        while (true) {
            {
                std::unique_lock lock(mutex);
                // Nothing to watch: no work in flight, no thread inside NCCL and no requested abort left to carry out.
                const auto idle = [&] {
                    return outstanding.empty() && !enqueue.Inside() && (!abort_requested || abort_done);
                };
                wake.Wait(lock, stop, idle);
                if (stop) {
                    return;
                }
                if (idle()) {
                    continue; // an idle poll (watchdog_wake.h): nothing in flight to query or to fail
                }
                ops.assign(outstanding.begin(), outstanding.end());
            }

            // Retire finished work (its tensors may go back to the pool now) and look at the oldest unfinished op.
            // Every tracked op's done-event is recorded on the one communication stream, in the order the ops were
            // appended (both under nccl_mutex), so they complete in list order: the finished ones are a prefix, and
            // the first unfinished op is the oldest (if it is not overdue, nothing later is). The pass therefore
            // queries the finished ops and one more, not the whole list, and pops the prefix; only this thread
            // removes from the list while it runs (the destructor joins it first).
            const auto now = Clock::now();
            const auto timeout = CommTimeout();
            std::shared_ptr<NcclOp> overdue;
            // Tracked, not yet recorded: its enqueue is under way. Only the last op can be in that state.
            std::shared_ptr<NcclOp> enqueuing = !ops.empty() && !ops.back()->recorded ? ops.back() : nullptr;
            std::string cuda_failure;
            std::size_t finished = 0;
            for (auto& op : ops) {
                if (!op->recorded) {
                    break; // its event still holds an earlier op's record
                }
                const cudaError_t q = cudaEventQuery(op->done);
                if (q == cudaSuccess && !abort_requested && op->status == NcclOp::kPending &&
                    now - op->issued > timeout) {
                    // Finished, but only after its deadline: a peer's aborted kernel running to its end completes a
                    // collective with garbage (AbortGrace). Past the deadline it is a timeout, as if still running.
                    overdue = op;
                    break;
                }
                if (q == cudaSuccess) {
                    // A done-event also fires when an abort made the kernel exit (this rank's own timeout, seen by a
                    // host waiter first): after an abort request, a finished kernel proves nothing — failed, so that a
                    // waiter raises rather than reads a collective that never ran to its end (measured on 4×H200: a
                    // healthy rank printed "completed" after its own abort without this).
                    int expected = NcclOp::kPending;
                    op->status.compare_exchange_strong(expected, abort_requested ? NcclOp::kFailed : NcclOp::kDone);
                    op->Release();
                    ++finished;
                    continue;
                }
                if (q != cudaErrorNotReady) {
                    (void)cudaGetLastError();
                    cuda_failure = fmt::format("{}: CUDA reported {} ({}) while it ran", op->Describe(),
                                               cudaGetErrorName(q), cudaGetErrorString(q));
                } else if (op->status == NcclOp::kPending && now - op->issued > timeout) {
                    overdue = op;
                }
                break;
            }
            if (finished > 0) {
                std::lock_guard lock(mutex);
                outstanding.erase(outstanding.begin(), outstanding.begin() + static_cast<std::ptrdiff_t>(finished));
            }
            ops.clear();

            if (!abort_requested) {
                const auto inside = enqueue.InsideFor(now);
                if (inside > timeout) {
                    // Phase 1 on a blocking communicator: the issuing thread has been inside NCCL (ncclGroupEnd) for
                    // the whole timeout, e.g. setting up a connection to a peer that never comes. Carried out below,
                    // from this thread: ncclCommAbort is what releases it. No kernel of this call runs yet, but the
                    // abort also ends every kernel still running on the communicator, and an earlier op's kernel can
                    // be one (overdue in this same pass: phase 1 is reported first). So it is a timeout's abort like
                    // any other, due AbortGrace after this call's deadline (Enter + timeout), which is after every
                    // earlier op's deadline + grace too: a healthy peer still inside any of them fails it at its own
                    // deadline rather than completing it with garbage. The thread is released at most AbortGrace
                    // (<= 1 s) later than without it, well within timeout + 5 s.
                    RequestTimeoutAbort(
                        ::shardline::detail::FormatError(
                            __FILE__, __LINE__, "NcclWatchdog",
                            fmt::format("{} did not finish within {:.1f} s (phase 1: enqueue, blocked inside NCCL; "
                                        "elapsed {:.1f} s); communicator aborted",
                                        enqueuing != nullptr
                                            ? enqueuing->Describe()
                                            : fmt::format("a call on group '{}' (rank {} of {})", name, rank, size),
                                        Seconds(timeout), Seconds(inside))),
                        now - inside, timeout);
                } else if (!cuda_failure.empty()) {
                    RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, "NcclWatchdog", cuda_failure));
                } else if (overdue != nullptr) {
                    RequestTimeoutAbort(
                        ::shardline::detail::FormatError(
                            __FILE__, __LINE__, "NcclWatchdog",
                            fmt::format("{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); "
                                        "communicator aborted",
                                        overdue->Describe(), Seconds(timeout), Seconds(now - overdue->issued))),
                        overdue->issued, timeout);
                } else if (nccl_mutex.try_lock()) {
                    // Asynchronous errors (a peer's connection dropped, ...) while work is in flight.
                    std::string failure;
                    if (ncclComm_t c = comm; c != nullptr) {
                        ncclResult_t async = ncclSuccess;
                        const ncclResult_t r = ncclCommGetAsyncError(c, &async);
                        if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
                            const ncclResult_t bad = r != ncclSuccess ? r : async;
                            failure = fmt::format("asynchronous NCCL error on group '{}' (rank {} of {}): {} ({})",
                                                  name, rank, size, ncclGetErrorString(bad), ncclGetLastError(c));
                        }
                    }
                    nccl_mutex.unlock();
                    if (!failure.empty()) {
                        RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, "NcclWatchdog", failure));
                    }
                }
            }
            overdue.reset();
            enqueuing.reset();

            if (abort_requested && !abort_done && AbortDue()) {
                // Carry out a requested abort once it is due (a timeout's waits for AbortGrace) and the mutex is free.
                // A holder is inside a bounded poll that checks the request, or blocked inside NCCL itself (a blocking
                // communicator's enqueue: a connection to a peer that never comes, a full launch queue behind a hung
                // kernel): NCCL's abort flag releases that one, so abort from here once it has been inside for
                // kInsideNcclGrace (torch's watchdog does the same). Any other holder gets another two timeouts, then
                // the process ends rather than hang.
                if (nccl_mutex.try_lock()) {
                    AbortNow();
                    nccl_mutex.unlock();
                } else if (enqueue.AbortIfStuck(Clock::now(), std::min<Clock::duration>(kInsideNcclGrace, timeout),
                                                [this] { AbortNow(); })) {
                    SHARDLINE_LOG_ERROR("NCCL communicator '{}': aborted from the watchdog to release a thread blocked "
                                        "inside NCCL",
                                        name);
                } else {
                    Clock::time_point requested;
                    {
                        std::lock_guard lock(mutex);
                        requested = abort_requested_at;
                    }
                    if (requested != Clock::time_point{} && Clock::now() - requested > 2 * timeout) {
                        SHARDLINE_LOG_ERROR(
                            "NCCL communicator '{}': abort requested {:.1f} s ago but a thread is stuck "
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
        const auto elapsed = Clock::now() - op_->issued;
        if (q == cudaSuccess && elapsed <= CommTimeout()) {
            // A done-event also fires when an abort made the kernel exit: trust it only while not aborted, and only
            // before the deadline (a peer's aborted kernel can complete it with garbage after it: AbortGrace).
            int expected = NcclOp::kPending;
            if (!state.abort_requested && op_->status.compare_exchange_strong(expected, NcclOp::kDone)) {
                op_->Release();
                return true;
            }
            ThrowIfFailed("Work::Test");
            return op_->status == NcclOp::kDone;
        }
        if (q != cudaSuccess && q != cudaErrorNotReady) {
            (void)cudaGetLastError();
            Fail("Work::Test", fmt::format("{}: CUDA reported {} ({}) while it ran", op_->Describe(),
                                           cudaGetErrorName(q), cudaGetErrorString(q)));
        }
        if (elapsed > CommTimeout()) {
            Fail("Work::Test",
                 fmt::format("{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); "
                             "communicator aborted",
                             op_->Describe(), Seconds(CommTimeout()), Seconds(elapsed)),
                 /*timed_out=*/true);
        }
        if (state.nccl_mutex.try_lock()) {
            std::string failure;
            if (ncclComm_t comm = state.comm; comm != nullptr) {
                ncclResult_t async = ncclSuccess;
                const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
                if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
                    failure = fmt::format("{}: asynchronous NCCL error: {} ({})", op_->Describe(),
                                          ncclGetErrorString(r != ncclSuccess ? r : async), ncclGetLastError(comm));
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

    [[noreturn]] void Fail(std::string_view api, const std::string& what, bool timed_out = false) {
        std::string reason = ::shardline::detail::FormatError(__FILE__, __LINE__, api, what);
        if (timed_out) {
            op_->state->RequestTimeoutAbort(std::move(reason), op_->issued, CommTimeout());
        } else {
            op_->state->RequestAbort(std::move(reason));
        }
        ThrowIfFailed(api);
        SHARDLINE_THROW(CommError, api, "{}", what); // the op finished just before the abort
    }

    std::shared_ptr<NcclOp> op_;
};

} // namespace

WorkHandle MakeNcclWork(std::shared_ptr<NcclOp> op) { return std::make_shared<NcclWork>(std::move(op)); }

} // namespace shardline::comm::detail
