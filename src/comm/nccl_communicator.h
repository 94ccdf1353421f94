#pragma once

// The NCCL backend: CUDA tensors (float32, float16, bfloat16) over a non-blocking NCCL communicator.
//
// Streams and events: every collective runs on a communication stream owned by the communicator. The issuing thread
// records an event on the compute stream (CudaContext::Get(device).stream()), makes the communication stream wait on
// it, enqueues the NCCL calls and records a done-event on the communication stream. Work::Wait(host=false) makes the
// compute stream wait on the done-event: no host synchronisation on the hot path. The tensors a collective touches
// stay referenced until it has completed (or until the compute stream is ordered after it), because tensors are
// freed stream-ordered on the compute stream.
//
// Faults, in two phases: (1) on the issuing thread, until NCCL has left ncclInProgress (the enqueue is done);
// (2) until the done-event has fired. Phase 2 is watched by Work::Wait(host=true)/Test and by a watchdog thread per
// communicator that polls the outstanding done-events and ncclCommGetAsyncError, so a hung collective is detected
// even when nobody waits on the host. On timeout or an asynchronous error the communicator is aborted
// (ncclCommAbort) and every later call raises CommError with the reason.

#include <memory>
#include <string>
#include <vector>

#include <nccl.h>

#include <shardline/comm/communicator.h>

namespace shardline::comm::detail {

struct NcclState;
struct NcclIssue;

class NcclCommunicator final : public Communicator {
public:
    /// Takes ownership of `comm`, an initialised non-blocking NCCL communicator on CUDA device `device`.
    NcclCommunicator(ncclComm_t comm, int device, int rank, int size, std::string name);
    ~NcclCommunicator() override;
    NcclCommunicator(const NcclCommunicator&) = delete;
    NcclCommunicator& operator=(const NcclCommunicator&) = delete;

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string_view backend() const override { return "nccl"; }
    const std::string& name() const override { return name_; }
    DeviceType device_type() const override { return DeviceType::kCUDA; }
    int device() const { return device_; }

    WorkHandle AllReduce(Tensor& tensor, ReduceOp op) override;
    WorkHandle AllGather(const Tensor& input, Tensor& output) override;
    WorkHandle AllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override;
    WorkHandle ReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) override;
    WorkHandle ReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                              ReduceOp op) override;
    WorkHandle AllToAll(const Tensor& input, Tensor& output) override;
    WorkHandle AllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                         const std::vector<std::int64_t>& recv_counts) override;
    WorkHandle Broadcast(Tensor& tensor, int root) override;
    WorkHandle Barrier() override;

    std::unique_ptr<Communicator> Split(int color, int key, std::string name) override;

    void Abort() noexcept override;
    bool aborted() const override;

private:
    template <class Enqueue> WorkHandle Issue(const NcclIssue& issue, Enqueue&& enqueue);
    void CheckTensor(const Tensor& tensor, std::string_view api, std::string_view what) const;

    std::shared_ptr<NcclState> state_;
    int device_;
    int rank_;
    int size_;
    std::string name_;
};

} // namespace shardline::comm::detail
