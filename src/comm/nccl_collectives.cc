#include <array>
#include <numeric>

#include <shardline/core/context.h>

#include "comm/nccl_communicator.h"

// The NCCL collectives: the issue engine (streams, events, graph capture, phase 1) and one enqueue per collective.
// Arguments arrive validated (communicator.cc).

namespace shardline::comm::detail {
namespace {

char* Bytes(const Tensor& t) { return static_cast<char*>(t.data()); }

/// One collective's NCCL calls: `calls` enqueues them (inside ncclGroupStart/End) and returns the first non-success
/// status; `tensors` are kept alive until it completes.
template <class Calls> struct Enqueue {
    Calls calls;
    std::array<const Tensor*, 2> tensors;
    bool has_work;

    bool HasWork() const { return has_work; }
    void Keep(std::array<std::shared_ptr<Storage>, 2>& keep) const {
        for (std::size_t i = 0; i < tensors.size(); ++i) {
            if (tensors[i] != nullptr) {
                keep[i] = tensors[i]->storage();
            }
        }
    }
    ncclResult_t operator()(ncclComm_t comm, cudaStream_t stream) { return calls(comm, stream); }
};
template <class Calls> Enqueue<Calls> MakeEnqueue(Calls calls, const Tensor* a, const Tensor* b, bool has_work) {
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

/// Appends `op` to the watchdog's list, waking the watchdog only when it sleeps without a deadline (it has been idle
/// for kWatchdogIdlePolls polls); otherwise it finds the op on its next poll. No notify per call: watchdog_wake.h.
/// Ops are appended in issue order under nccl_mutex, so at most the last one is not yet recorded.
void Track(NcclState& s, const std::shared_ptr<NcclOp>& op) {
    bool asleep = false;
    {
        std::lock_guard track(s.mutex);
        s.outstanding.push_back(op);
        asleep = s.wake.Asleep();
    }
    if (asleep) {
        s.wake.Notify();
    }
}

} // namespace

template <class Enqueue> WorkHandle NcclCommunicator::Issue(const NcclIssue& issue, Enqueue&& enqueue) {
    NcclState& s = *state_;
    if (s.abort_requested) {
        s.ThrowAborted(issue.api);
    }
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
    {
        NcclLock lock(s);
        const ncclComm_t comm = s.comm;
        if (comm == nullptr || s.abort_requested) {
            s.ThrowAborted(issue.api);
        }
        const std::int64_t seq = ++s.seq;
        bool tracked = false;
        try {
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
                enqueue.Keep(op->keep);
            }

            // The communication stream must not start before what the compute stream has queued (the tensors'
            // producers): one record + one stream wait, both asynchronous; torch's ProcessGroupNCCL pays the same.
            SHARDLINE_CHECK_CUDA(cudaEventRecord(s.ready_event, compute));
            SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(s.stream, s.ready_event, 0));
            if (!captured) {
                // Tracked before the enqueue, while nccl_mutex is held: the watchdog sees a call blocked inside NCCL
                // (enqueue_watch.h), and an abort (NcclLock's destructor, the watchdog) fails this op instead of
                // leaving it pending, to be reported done once the aborted kernel's event fires.
                Track(s, op);
                tracked = true;
            } else {
                WakeWatchdog(s); // not tracked, but a blocked enqueue is still the watchdog's to release
            }
            if (enqueue.HasWork()) {
                SHARDLINE_CHECK_NCCL(ncclGroupStart());
                ncclResult_t first_error = ncclSuccess;
                // On a blocking communicator ncclGroupEnd enqueues on this thread and may block inside NCCL (a
                // connection to a peer that never comes): the watchdog aborts it after the timeout. Leave() waits for
                // such an abort to be carried out.
                s.enqueue.Enter(op->issued);
                try {
                    first_error = enqueue(comm, s.stream);
                } catch (...) {
                    (void)ncclGroupEnd();
                    s.enqueue.Leave();
                    throw;
                }
                const ncclResult_t end = ncclGroupEnd();
                s.enqueue.Leave();
                if (s.abort_done) {
                    s.ThrowAborted(issue.api); // released by the watchdog's abort: nothing more is called on it
                }
                const ncclResult_t returned = first_error != ncclSuccess ? first_error : end;
                // ncclSuccess: NCCL launched the group on this thread (a blocking communicator, or a group with
                // nothing to do): nothing is in progress, so phase 1 is over without a poll. Asynchronous errors
                // of the running kernel are the watchdog's (phase 2). Otherwise (a non-blocking communicator's
                // group runs on an NCCL thread and returns ncclInProgress) poll until it has left ncclInProgress.
                if (returned != ncclSuccess) {
                    WaitLeftInProgress(s, {comm}, returned, issue.api,
                                       std::function<std::string()>([&op] { return op->Describe(); }), op->issued);
                }
            }
            SHARDLINE_CHECK_CUDA(cudaEventRecord(op->done, s.stream));
            op->recorded = true;
        } catch (...) {
            if (tracked && !op->recorded) {
                // Kernels may already be queued on s.stream and still touch the kept tensors: the op fails, and the
                // watchdog releases them only once its done-event has fired (after the abort this failure leads to).
                op->status = NcclOp::kFailed;
                (void)cudaEventRecord(op->done, s.stream);
                op->recorded = true;
            }
            s.NoteAbortAndRethrow(issue, "issuing");
        }
    }
    return MakeNcclWork(std::move(op));
}

WorkHandle NcclCommunicator::DoAllReduce(Tensor& tensor, ReduceOp op) {
    constexpr std::string_view kApi = "all_reduce";
    const ncclDataType_t type = ToNccl(tensor.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const auto n = static_cast<std::size_t>(tensor.numel());
    void* data = tensor.data();
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllReduce,
                           .count = tensor.numel(),
                           .dtype = tensor.dtype(),
                           .aux = static_cast<std::int64_t>(op)},
                 MakeEnqueue([=](ncclComm_t comm,
                                 cudaStream_t stream) { return ncclAllReduce(data, data, n, type, red, comm, stream); },
                             &tensor, nullptr, n > 0));
}

WorkHandle NcclCommunicator::DoAllGather(const Tensor& input, Tensor& output) {
    constexpr std::string_view kApi = "all_gather";
    const ncclDataType_t type = ToNccl(input.dtype());
    const auto n = static_cast<std::size_t>(input.numel());
    const void* in = input.data();
    void* out = output.data();
    return Issue(
        NcclIssue{.api = kApi, .kind = CollectiveKind::kAllGather, .count = input.numel(), .dtype = input.dtype()},
        MakeEnqueue([=](ncclComm_t comm, cudaStream_t stream) { return ncclAllGather(in, out, n, type, comm, stream); },
                    &input, &output, n > 0));
}

WorkHandle NcclCommunicator::DoAllGatherV(const Tensor& input, Tensor& output,
                                          const std::vector<std::int64_t>& counts) {
    constexpr std::string_view kApi = "all_gather_v";
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    const ncclDataType_t type = ToNccl(input.dtype());
    const std::size_t elem = ElementSize(input.dtype());
    const void* in = input.data();
    char* out = Bytes(output);
    const int size = size_;
    // Rank r's block is a broadcast from root r into its place in the output; grouped, they run as one launch.
    return Issue(
        NcclIssue{
            .api = kApi, .kind = CollectiveKind::kAllGather, .count = total, .dtype = input.dtype(), .uneven = true},
        MakeEnqueue(
            [=, &counts](ncclComm_t comm, cudaStream_t stream) {
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
            },
            &input, &output, total > 0));
}

WorkHandle NcclCommunicator::DoReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) {
    constexpr std::string_view kApi = "reduce_scatter";
    const ncclDataType_t type = ToNccl(input.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const auto n = static_cast<std::size_t>(output.numel());
    const void* in = input.data();
    void* out = output.data();
    return Issue(
        NcclIssue{.api = kApi,
                  .kind = CollectiveKind::kReduceScatter,
                  .count = output.numel(),
                  .dtype = input.dtype(),
                  .aux = static_cast<std::int64_t>(op)},
        MakeEnqueue([=](ncclComm_t comm,
                        cudaStream_t stream) { return ncclReduceScatter(in, out, n, type, red, comm, stream); },
                    &input, &output, n > 0));
}

WorkHandle NcclCommunicator::DoReduceScatterV(const Tensor& input, Tensor& output,
                                              const std::vector<std::int64_t>& counts, ReduceOp op) {
    constexpr std::string_view kApi = "reduce_scatter_v";
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    const ncclDataType_t type = ToNccl(input.dtype());
    const ncclRedOp_t red = ToNccl(op);
    const std::size_t elem = ElementSize(input.dtype());
    const char* in = Bytes(input);
    void* out = output.data();
    const int size = size_;
    // Block r is reduced onto root r (non-roots never write their recvbuff); grouped into one launch.
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kReduceScatter,
                           .count = total,
                           .dtype = input.dtype(),
                           .aux = static_cast<std::int64_t>(op),
                           .uneven = true},
                 MakeEnqueue(
                     [=, &counts](ncclComm_t comm, cudaStream_t stream) {
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
                     },
                     &input, &output, total > 0));
}

WorkHandle NcclCommunicator::DoAllToAll(const Tensor& input, Tensor& output) {
    constexpr std::string_view kApi = "all_to_all";
    const ncclDataType_t type = ToNccl(input.dtype());
    const auto block = static_cast<std::size_t>(input.numel() / size_);
    const std::size_t block_bytes = block * ElementSize(input.dtype());
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const int size = size_;
    return Issue(
        NcclIssue{.api = kApi, .kind = CollectiveKind::kAllToAll, .count = input.numel(), .dtype = input.dtype()},
        MakeEnqueue(
            [=](ncclComm_t comm, cudaStream_t stream) {
                FirstError err;
                for (int r = 0; r < size; ++r) {
                    err += ncclSend(in + r * block_bytes, block, type, r, comm, stream);
                    err += ncclRecv(out + r * block_bytes, block, type, r, comm, stream);
                }
                return err.status;
            },
            &input, &output, block > 0));
}

WorkHandle NcclCommunicator::DoAllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts,
                                         Tensor& output, const std::vector<std::int64_t>& recv_counts) {
    constexpr std::string_view kApi = "all_to_all_v";
    const std::int64_t sent = input.numel();
    const std::int64_t received = output.numel();
    const ncclDataType_t type = ToNccl(input.dtype());
    const std::size_t elem = ElementSize(input.dtype());
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const int size = size_;
    return Issue(NcclIssue{.api = kApi,
                           .kind = CollectiveKind::kAllToAll,
                           .count = -1,
                           .dtype = input.dtype(),
                           .uneven = true,
                           .send_counts = &send_counts,
                           .recv_counts = &recv_counts},
                 MakeEnqueue(
                     [=, &send_counts, &recv_counts](ncclComm_t comm, cudaStream_t stream) {
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
                     },
                     &input, &output, sent > 0 || received > 0));
}

WorkHandle NcclCommunicator::DoBroadcast(Tensor& tensor, int root) {
    constexpr std::string_view kApi = "broadcast";
    const ncclDataType_t type = ToNccl(tensor.dtype());
    const auto n = static_cast<std::size_t>(tensor.numel());
    void* data = tensor.data();
    return Issue(
        NcclIssue{.api = kApi,
                  .kind = CollectiveKind::kBroadcast,
                  .count = tensor.numel(),
                  .dtype = tensor.dtype(),
                  .aux = root},
        MakeEnqueue([=](ncclComm_t comm,
                        cudaStream_t stream) { return ncclBroadcast(data, data, n, type, root, comm, stream); },
                    &tensor, nullptr, n > 0));
}

WorkHandle NcclCommunicator::DoBarrier() {
    // A one-float all-reduce on a buffer of our own: done when every rank has reached it.
    float* buffer = state_->barrier_buffer;
    return Issue(NcclIssue{.api = "barrier", .kind = CollectiveKind::kBarrier, .count = 1, .dtype = DType::kFloat32},
                 MakeEnqueue(
                     [=](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream);
                     },
                     nullptr, nullptr, true));
}

} // namespace shardline::comm::detail
