#pragma once

// The MPI backend: collectives on CPU tensors (float32, float64) through non-blocking MPI calls behind Work
// handles. Private to the library; programs get one through Communicator::CreateMpiWorld, Communicator::FromMpiComm
// and Split. Files: mpi_communicator.cc (state, work, collectives, split, factories), mpi_check.cc (the debug check).
//
// Validation is local and done by Communicator (communicator.cc) before any hook here runs: sizes, counts, dtypes and
// devices are checked on the calling rank before any MPI call, so a bad argument raises there and issues nothing. A
// rank that raises does not take part in the collective, so the others wait for it until the timeout (or until the
// program's main, through launch::RunMain, calls MPI_Abort). Cross-rank disagreement (one rank passes another count, op
// or root) is what SHARDLINE_COMM_CHECK=1 catches: the ranks exchange (op, sequence, count, dtype, op/root, counts)
// before every collective and all of them raise.
//
// Timeouts: Wait polls MPI_Test until the collective finishes or CommTimeout() has passed since it was issued; then
// the communicator is aborted and CommError names the op, sequence number, count, group and elapsed time.
//
// Abort: MPI has no per-communicator abort that leaves the process usable (MPI_Abort ends the job, and a pending
// non-blocking collective can be neither cancelled nor freed). Abort() therefore only marks the communicator: every
// later call raises CommError at once, in-flight requests and their buffers are kept alive (leaked) so MPI may still
// complete them safely, and the MPI communicator is never freed. The program is expected to end: its main catches
// the CommError and calls MPI_Abort (launch::RunMain does).

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <mpi.h>

#include <shardline/comm/communicator.h>

namespace shardline::comm::detail {

/// What is in flight for one non-blocking MPI call: the request and everything MPI reads or writes until it
/// completes (tensors, count and displacement arrays).
struct MpiPendingOp {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<Tensor> buffers;
    std::vector<int> ints;
    /// Runs once the request completed (avg: divide the sum by the group size), also for an orphaned op.
    std::function<void()> finish;
};

/// Shared by a communicator and its Work handles, so a handle may outlive its communicator.
struct MpiGroupState {
    MPI_Comm comm = MPI_COMM_NULL;
    /// Freed with the state (MPI_Comm_free). A borrowed communicator (FromMpiComm) gets its error handler back instead.
    bool owned = true;
    MPI_Errhandler previous_errhandler = MPI_ERRHANDLER_NULL;
    std::string name;
    int rank = 0;
    int size = 1;
    std::atomic<bool> aborted{false};
    /// Requests issued and not yet seen complete (the MPI communicator is freed only when none is left).
    std::atomic<std::int64_t> pending{0};
    std::mutex mutex;
    /// Ops whose Work handle was dropped before completion: kept alive and reaped at the next call.
    std::vector<std::unique_ptr<MpiPendingOp>> orphans;

    MpiGroupState() = default;
    MpiGroupState(const MpiGroupState &) = delete;
    MpiGroupState &operator=(const MpiGroupState &) = delete;
    ~MpiGroupState();
};

/// One collective's identity, for messages and the debug check.
struct MpiOpInfo {
    std::string_view op;
    std::int64_t seq = 0;
    std::int64_t count = 0;
    DType dtype = DType::kFloat32;
    std::chrono::steady_clock::time_point start;
    std::chrono::milliseconds timeout{0};
};

using Clock = std::chrono::steady_clock;

// The ops the debug check tells apart (the even and uneven forms of one kind are different calls).
enum CheckOp : int {
    kCheckAllReduce,
    kCheckAllGather,
    kCheckAllGatherV,
    kCheckReduceScatter,
    kCheckReduceScatterV,
    kCheckAllToAll,
    kCheckAllToAllV,
    kCheckBroadcast,
    kCheckBarrier,
    kCheckSplit,
};

/// Marks the communicator aborted and raises the timeout's CommError (`phase` prefixes what timed out).
[[noreturn]] void ThrowTimeout(MpiGroupState &state, const MpiOpInfo &info, std::string_view phase);
/// Blocks on an internal request (debug check, split rendezvous) with the op's deadline.
void WaitInternal(MpiGroupState &state, MPI_Request &request, const MpiOpInfo &info, std::string_view phase);

class MpiCommunicator final : public Communicator {
public:
    /// Wraps `comm` (its error handler is set to MPI_ERRORS_RETURN); `owned`: MPI_Comm_free it at the end, else restore
    /// its error handler.
    MpiCommunicator(MPI_Comm comm, std::string name, bool owned);
    ~MpiCommunicator() override = default;

    int rank() const override { return state_->rank; }
    int size() const override { return state_->size; }
    std::string_view backend() const override { return "mpi"; }
    const std::string &name() const override { return state_->name; }
    Device device() const override { return Device::CPU(); }

    /// color < 0: this rank joins no group and gets nullptr (MPI_UNDEFINED).
    std::unique_ptr<Communicator> Split(int color, int key, std::string name) override;

    void Abort() noexcept override;
    bool aborted() const override { return state_->aborted.load(); }

    /// The underlying MPI communicator (for tests and host-side tools).
    MPI_Comm mpi_comm() const { return state_->comm; }

protected:
    std::vector<DType> dtypes() const override { return {DType::kFloat32, DType::kFloat64, DType::kInt64}; }
    std::int64_t max_count() const override { return INT_MAX; }
    std::string AbortReason() const override;
    void CheckUsable(std::string_view op) const override;
    void CheckAgreement(const Collective &call) override;

    WorkHandle DoAllReduce(Tensor &tensor, ReduceOp op) override;
    WorkHandle DoAllGather(const Tensor &input, Tensor &output) override;
    WorkHandle DoAllGatherV(const Tensor &input, Tensor &output, const std::vector<std::int64_t> &counts) override;
    WorkHandle DoReduceScatter(const Tensor &input, Tensor &output, ReduceOp op) override;
    WorkHandle DoReduceScatterV(const Tensor &input, Tensor &output, const std::vector<std::int64_t> &counts,
                                ReduceOp op) override;
    WorkHandle DoAllToAll(const Tensor &input, Tensor &output) override;
    WorkHandle DoAllToAllV(const Tensor &input, const std::vector<std::int64_t> &send_counts, Tensor &output,
                           const std::vector<std::int64_t> &recv_counts) override;
    WorkHandle DoBroadcast(Tensor &tensor, int root) override;
    WorkHandle DoBarrier() override;

private:
    /// Reaps finished orphans and assigns the next sequence number.
    MpiOpInfo Begin(std::string_view op, std::int64_t count, DType dtype);
    /// The debug check's exchange (mpi_check.cc): `a` holds the V counts (all_to_all_v: send), `b` all_to_all_v's
    /// receive counts.
    void RunCheck(const MpiOpInfo &info, int check_op, std::int64_t aux, const std::vector<std::int64_t> &a,
                  const std::vector<std::int64_t> &b);
    void ReapOrphans();

    std::shared_ptr<MpiGroupState> state_;
    std::int64_t seq_ = 0;
};

} // namespace shardline::comm::detail
