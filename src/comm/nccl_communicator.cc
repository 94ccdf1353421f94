#include "comm/nccl_communicator.h"

#include <algorithm>

#include <shardline/core/context.h>

// The NCCL communicator's life: creation (stream, events, watchdog), destruction (orderly finalize, or abort when
// work is overdue; a borrowed communicator is left to its owner) and Abort.

namespace shardline::comm::detail {
namespace {

/// ncclCommFinalize (polled on a non-blocking communicator until `deadline`), then ncclCommDestroy; ncclCommAbort if
/// the finalize does not complete. The work in flight has finished, so a blocking communicator's finalize returns
/// without waiting for peers.
void FinalizeAndDestroy(ncclComm_t comm, const std::string& name, Clock::time_point deadline) noexcept {
    ncclResult_t r = ncclCommFinalize(comm);
    Backoff backoff;
    while (r == ncclInProgress && Clock::now() < deadline) {
        backoff.Pause();
        ncclResult_t async = ncclInProgress;
        if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) {
            async = ncclInternalError;
        }
        r = async;
    }
    if (r == ncclSuccess) {
        (void)ncclCommDestroy(comm);
        return;
    }
    try {
        SHARDLINE_LOG_WARN("NCCL communicator '{}': ncclCommFinalize did not complete ({}); aborting", name,
                           ncclGetErrorString(r));
    } catch (...) {
    }
    (void)ncclCommAbort(comm);
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Communicator

NcclCommunicator::NcclCommunicator(NcclComms comms, int device, int rank, int size, std::string name, bool owned)
    : state_(std::make_shared<NcclState>()), device_(device), rank_(rank), size_(size), name_(std::move(name)),
      owned_(owned) {
    NcclState& s = *state_;
    s.comm = comms.collectives;
    s.control = comms.control;
    s.device = device;
    s.rank = rank;
    s.size = size;
    s.name = name_;
    try {
        DeviceGuard guard(device);
        CudaContext::Get(device); // the compute stream exists before ours is ordered against it
        // The highest priority: a collective overlapping a GEMM (the backward's dx all-reduce beside the wgrad GEMM,
        // DESIGN.md §10) gets SMs as soon as any free up, instead of waiting for the GEMM's queued blocks; this is
        // what orders the two without CUDA_DEVICE_MAX_CONNECTIONS=1.
        int least_priority = 0;
        int greatest_priority = 0;
        SHARDLINE_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
        SHARDLINE_CHECK_CUDA(cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest_priority));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&s.ready_event, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&s.check_event, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&s.barrier_buffer), sizeof(float), s.stream));
        SHARDLINE_CHECK_CUDA(cudaMemsetAsync(s.barrier_buffer, 0, sizeof(float), s.stream));
        s.watchdog = std::thread([state = state_.get()] { state->WatchdogLoop(); });
    } catch (...) {
        // The other ranks finished creating their side: leave the NCCL communicator in a state they can detect. A
        // borrowed one is the caller's to deal with.
        if (owned_) {
            for (ncclComm_t c : {comms.collectives, comms.control}) {
                if (c != nullptr) {
                    (void)ncclCommAbort(c);
                }
            }
        }
        s.comm = nullptr;
        s.control = nullptr;
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
        s.wake.NotifyAll();
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
            // Work still running is the normal state after Wait(host=false): it may complete (bounded below) before
            // the communicators are finalized. Only overdue work, or an abort already asked for, ends in
            // ncclCommAbort. (No op is mid-enqueue: the destructor does not run beside a call on this object.)
            const auto now = Clock::now();
            const auto timeout = CommTimeout();
            bool late = false; // a done-event fired only after its op's deadline: a timeout (AbortGrace, nccl_state.h)
            const auto overdue = [&] {
                return std::any_of(ops.begin(), ops.end(), [&](const std::shared_ptr<NcclOp>& op) {
                    return op->status == NcclOp::kPending && now - op->issued > timeout;
                });
            };
            const auto drained = [&] {
                bool all = true;
                const auto t = Clock::now();
                for (auto& op : ops) {
                    if (!op->recorded) {
                        all = false;
                        continue;
                    }
                    const cudaError_t q = cudaEventQuery(op->done);
                    if (q == cudaSuccess) {
                        // After an abort request, or after the op's deadline, a fired done-event proves nothing (the
                        // watchdog's rule, nccl_state.cc): a peer's aborted kernel may have completed it with garbage.
                        const bool past_deadline = t - op->issued > timeout;
                        int expected = NcclOp::kPending;
                        if (op->status.compare_exchange_strong(
                                expected, s.abort_requested || past_deadline ? NcclOp::kFailed : NcclOp::kDone)) {
                            late = late || past_deadline;
                        }
                    } else {
                        (void)cudaGetLastError();
                        all = false;
                    }
                }
                return all;
            };
            // A timeout's abort of this work is due AbortGrace after the oldest unfinished op's deadline (the
            // watchdog's rule), but at most AbortGrace from now: with a timeout longer than kMaxFinalize the drain
            // gives up before that deadline, and a destructor does not wait out the timeout.
            const auto timeout_abort_due = [&] {
                for (auto& op : ops) {
                    if (op->status != NcclOp::kDone) {
                        return std::min(op->issued + timeout, Clock::now()) + AbortGrace(timeout);
                    }
                }
                return Clock::time_point{};
            };
            bool done = drained();
            const bool abort = overdue() || late || s.abort_requested;
            if (s.comm != nullptr && !owned_) {
                if (abort) {
                    // Borrowed: aborting frees the caller's communicator, and after this destructor nothing could
                    // tell the caller so; leave it to them, loudly.
                    SHARDLINE_LOG_ERROR("borrowed NCCL communicator '{}' released with {}: shardline does not abort "
                                        "a communicator it does not own; its owner should ncclCommAbort it",
                                        s.name, s.abort_requested ? "an abort pending" : "overdue work in flight");
                }
                // Otherwise the caller finalizes and destroys it; work still running stays ordered before the compute
                // stream (below).
                s.comm = nullptr;
                s.control = nullptr;
            } else if (abort) {
                s.NoteAbort(fmt::format("NCCL communicator '{}' destroyed with overdue work in flight", s.name),
                            timeout_abort_due());
                // A timeout's abort waits out its grace (at most AbortGrace): aborting sooner could complete a
                // healthy peer's collective with garbage (nccl_state.h).
                std::this_thread::sleep_until(s.AbortNotBefore());
                s.AbortNow();
            } else if (s.comm != nullptr) {
                // Orderly: let the work in flight finish, then flush, quiesce and free each communicator. A blocking
                // communicator's ncclCommFinalize waits for its kernels on this thread, hence the drain first; a peer
                // that never arrives ends in abort.
                const auto start = Clock::now();
                const auto limit = std::min<Clock::duration>(timeout, kMaxFinalize);
                Backoff backoff;
                while (!done && !late && Clock::now() - start < limit) {
                    backoff.Pause();
                    done = drained();
                }
                if (!done || late) {
                    SHARDLINE_LOG_WARN("NCCL communicator '{}': work {} after {:.1f} s; aborting", s.name,
                                       late ? "finished past its deadline" : "still in flight",
                                       Seconds(Clock::now() - start));
                    s.NoteAbort(fmt::format("NCCL communicator '{}' destroyed with work that did not finish", s.name),
                                timeout_abort_due());
                    std::this_thread::sleep_until(s.AbortNotBefore()); // as above
                    s.AbortNow();
                } else {
                    for (std::atomic<ncclComm_t>* c : {&s.comm, &s.control}) {
                        if (ncclComm_t handle = c->exchange(nullptr); handle != nullptr) {
                            FinalizeAndDestroy(handle, s.name, start + limit);
                        }
                    }
                }
            }
            for (auto& op : ops) {
                // After a finalize the work completed; after an abort whatever had not finished failed.
                cudaError_t q = cudaErrorNotReady;
                if (op->recorded) {
                    q = cudaEventQuery(op->done);
                    (void)cudaGetLastError();
                }
                int expected = NcclOp::kPending;
                op->status.compare_exchange_strong(expected, q == cudaSuccess && !s.abort_requested ? NcclOp::kDone
                                                                                                    : NcclOp::kFailed);
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
    state_->RequestAbort(::shardline::detail::FormatError(__FILE__, __LINE__, "NcclCommunicator::Abort",
                                                          fmt::format("group '{}': Abort() was called", name_)));
}

bool NcclCommunicator::aborted() const { return state_->abort_requested; }

std::string NcclCommunicator::AbortReason() const {
    const std::string reason = state_->AbortReason();
    return reason.empty() ? std::string("Abort() was called") : reason;
}

} // namespace shardline::comm::detail
