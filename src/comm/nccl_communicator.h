#pragma once

// The NCCL backend: CUDA tensors (float32, float16, bfloat16, float64, int64). Private to the library; programs get
// one through Communicator::CreateNcclWorld, Communicator::FromNcclComm and Split. Arguments are validated by
// Communicator (communicator.cc) before any hook here runs. The files are listed in nccl_state.h.
//
// Two NCCL communicators per group that shardline creates: a non-blocking one made under the timeout (init, Split) and
// a blocking split of it that the collectives run on, because a non-blocking communicator's ncclGroupEnd hands every
// group to a new NCCL thread (NCCL >= 2.23), which costs ~80 us per call. SHARDLINE_NCCL_BLOCKING=0 runs the
// collectives on the non-blocking one instead. A borrowed communicator (FromNcclComm) is used as it is.
//
// Streams and events: every collective runs on a communication stream owned by the communicator. The issuing thread
// records an event on the compute stream (CudaContext::Get(device).stream()), makes the communication stream wait on
// it, enqueues the NCCL calls and records a done-event on the communication stream. Work::Wait(host=false) makes the
// compute stream wait on the done-event: no host synchronisation on the hot path. The tensors a collective touches
// stay referenced until it has completed (or until the compute stream is ordered after it), because tensors are
// freed stream-ordered on the compute stream.
//
// Faults, in two phases: (1) until the enqueue is done: on the issuing thread, until NCCL has left ncclInProgress
// (non-blocking), and by the watchdog, which aborts a call blocked inside NCCL (blocking; enqueue_watch.h);
// (2) until the done-event has fired. Phase 2 is watched by Work::Wait(host=true)/Test and by a watchdog thread per
// communicator that polls the outstanding done-events and ncclCommGetAsyncError, so a hung collective is detected
// even when nobody waits on the host. On timeout or an asynchronous error the communicator is aborted
// (ncclCommAbort) and every later call raises CommError with the reason.

#include <memory>
#include <string>
#include <vector>

#include <nccl.h>

#include <shardline/comm/communicator.h>

#include "comm/nccl_state.h"

namespace shardline::comm::detail {

/// The NCCL communicators of one group.
struct NcclComms {
    ncclComm_t collectives = nullptr; ///< what the collectives run on
    ncclComm_t control = nullptr;     ///< non-blocking, what Split splits; nullptr: `collectives` is split
};

class NcclCommunicator final : public Communicator {
public:
    /// Wraps `comms`, initialised NCCL communicators on CUDA device `device`. `owned`: finalized and destroyed with
    /// this object (the world, splits); else left to the caller (FromNcclComm, whose `control` is nullptr). A fault
    /// aborts them either way.
    NcclCommunicator(NcclComms comms, int device, int rank, int size, std::string name, bool owned);
    ~NcclCommunicator() override;
    NcclCommunicator(const NcclCommunicator&) = delete;
    NcclCommunicator& operator=(const NcclCommunicator&) = delete;

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string_view backend() const override { return "nccl"; }
    const std::string& name() const override { return name_; }
    Device device() const override { return Device::CUDA(device_); }

    std::unique_ptr<Communicator> Split(int color, int key, std::string name) override;

    void Abort() noexcept override;
    bool aborted() const override;

protected:
    /// The model dtypes, float64 for exact small reductions (checksums, byte counts and agreement in checkpoints;
    /// ncclFloat64 takes every reduce op), as torch's ProcessGroupNCCL moves double, and int64 for counts (the MoE
    /// dispatcher's tokens per expert; sum, max and min — avg is refused, it would truncate).
    std::vector<DType> dtypes() const override {
        return {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt64};
    }
    std::string AbortReason() const override;
    void CheckAgreement(const Collective& call) override;

    WorkHandle DoAllReduce(Tensor& tensor, ReduceOp op) override;
    WorkHandle DoAllGather(const Tensor& input, Tensor& output) override;
    WorkHandle DoAllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override;
    WorkHandle DoReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) override;
    WorkHandle DoReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                                ReduceOp op) override;
    WorkHandle DoAllToAll(const Tensor& input, Tensor& output) override;
    WorkHandle DoAllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                           const std::vector<std::int64_t>& recv_counts) override;
    WorkHandle DoBroadcast(Tensor& tensor, int root) override;
    WorkHandle DoBarrier() override;

private:
    template <class Enqueue> WorkHandle Issue(const NcclIssue& issue, Enqueue&& enqueue);

    std::shared_ptr<NcclState> state_;
    int device_;
    int rank_;
    int size_;
    std::string name_;
    bool owned_;
};

} // namespace shardline::comm::detail
