#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/core/logging.h>

// The MPI backend: collectives, work handles, split and the factories (FromMpiComm, CreateMpiWorld). The debug
// agreement check is in mpi_check.cc; argument validation in communicator.cc.

namespace shardline::comm {
namespace detail {

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Polling backoff: tight MPI_Test calls first (MPI progresses only inside MPI calls), then short sleeps so that
// oversubscribed ranks (CI runs 4 ranks on 2 cores) leave the core to the peer they wait for.
class Backoff {
public:
    void Pause() {
        ++polls_;
        if (polls_ < 128) {
            return;
        }
        if (polls_ < 512) {
            std::this_thread::yield();
            return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(polls_ < 2048 ? 20 : 100));
    }

private:
    int polls_ = 0;
};

} // namespace

[[noreturn]] void ThrowTimeout(MpiGroupState &state, const MpiOpInfo &info, std::string_view phase) {
    state.aborted = true;
    const double elapsed = Seconds(Clock::now() - info.start);
    SHARDLINE_THROW(CommError, fmt::format("MPI {}", info.op),
                    "{}seq {} (count {} {}) on group '{}' ({} ranks) did not complete within the timeout of {:.1f} s "
                    "(elapsed {:.2f} s); the communicator is aborted. A rank is missing, stopped or issued another "
                    "collective (SHARDLINE_COMM_TIMEOUT_S sets the timeout, SHARDLINE_COMM_CHECK=1 checks that the "
                    "ranks agree)",
                    phase, info.seq, info.count, DTypeName(info.dtype), state.name, state.size,
                    std::chrono::duration<double>(info.timeout).count(), elapsed);
}

namespace {

[[noreturn]] void ThrowAborted(const MpiGroupState &state, std::string_view op) {
    SHARDLINE_THROW(CommError, fmt::format("MPI {}", op),
                    "communicator '{}' was aborted (after a timeout, a failed debug check or Abort()); nothing is "
                    "called on an aborted communicator",
                    state.name);
}

} // namespace

void WaitInternal(MpiGroupState &state, MPI_Request &request, const MpiOpInfo &info, std::string_view phase) {
    Backoff backoff;
    while (true) {
        int done = 0;
        SHARDLINE_CHECK_MPI(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
        if (done != 0) {
            return;
        }
        if (Clock::now() - info.start > info.timeout) {
            // The request stays active: MPI may still write the (leaked) buffer it points to.
            ThrowTimeout(state, info, phase);
        }
        backoff.Pause();
    }
}

namespace {

MPI_Datatype MpiType(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return MPI_FLOAT;
    case DType::kFloat64:
        return MPI_DOUBLE;
    case DType::kInt64:
        return MPI_INT64_T;
    default:
        break;
    }
    // Communicator validated the dtype (dtypes()).
    SHARDLINE_THROW(DTypeError, "MPI", "expected float32, float64 or int64, got {}", DTypeName(dtype));
}

MPI_Op MpiReduceOp(ReduceOp op) {
    switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
        return MPI_SUM;
    case ReduceOp::kMax:
        return MPI_MAX;
    case ReduceOp::kMin:
        return MPI_MIN;
    }
    return MPI_SUM;
}

// Appends counts, then displacements, as int (Communicator checked that their sum fits: max_count()).
void PackCountsDispls(const std::vector<std::int64_t> &counts, std::vector<int> &ints) {
    const std::size_t n = counts.size();
    const std::size_t base = ints.size();
    ints.resize(base + 2 * n);
    std::int64_t displ = 0;
    for (std::size_t r = 0; r < n; ++r) {
        ints[base + r] = static_cast<int>(counts[r]);
        ints[base + n + r] = static_cast<int>(displ);
        displ += counts[r];
    }
}

void Scale(const Tensor &t, int size) {
    const std::int64_t n = t.numel();
    if (t.dtype() == DType::kFloat32) {
        auto *p = static_cast<float *>(t.data());
        for (std::int64_t i = 0; i < n; ++i) {
            p[i] /= static_cast<float>(size);
        }
    } else {
        auto *p = static_cast<double *>(t.data());
        for (std::int64_t i = 0; i < n; ++i) {
            p[i] /= static_cast<double>(size);
        }
    }
}

class MpiWork final : public Work {
public:
    MpiWork(std::shared_ptr<MpiGroupState> state, MpiOpInfo info, std::unique_ptr<MpiPendingOp> op,
            std::function<void()> finish)
        : state_(std::move(state)), info_(info), op_(std::move(op)), finish_(std::move(finish)) {
        state_->pending += 1;
    }

    ~MpiWork() override {
        if (done_ || op_ == nullptr) {
            return;
        }
        // Dropped while in flight: MPI still owns the request and the buffers, so they must outlive this handle.
        // The communicator reaps them at its next call; on an aborted communicator they are leaked on purpose.
        try {
            op_->finish = std::move(finish_); // the result is still owed to whoever reads the buffer
            std::lock_guard lock(state_->mutex);
            state_->orphans.push_back(std::move(op_));
        } catch (...) {
            (void)op_.release();
        }
    }

    bool Test() override {
        std::lock_guard lock(mutex_);
        return TestLocked();
    }

    void Wait(bool /*host*/) override {
        std::lock_guard lock(mutex_);
        Backoff backoff;
        while (!TestLocked()) {
            backoff.Pause();
        }
    }

private:
    bool TestLocked() {
        if (done_) {
            return true;
        }
        if (state_->aborted) {
            ThrowAborted(*state_, info_.op);
        }
        int flag = 0;
        SHARDLINE_CHECK_MPI(MPI_Test(&op_->request, &flag, MPI_STATUS_IGNORE));
        if (flag != 0) {
            done_ = true;
            state_->pending -= 1;
            if (finish_) {
                finish_();
            }
            op_.reset();
            return true;
        }
        if (Clock::now() - info_.start > info_.timeout) {
            ThrowTimeout(*state_, info_, "");
        }
        return false;
    }

    std::shared_ptr<MpiGroupState> state_;
    MpiOpInfo info_;
    std::unique_ptr<MpiPendingOp> op_;
    std::function<void()> finish_;
    bool done_ = false;
    std::mutex mutex_;
};

} // namespace

MpiGroupState::~MpiGroupState() {
    std::lock_guard lock(mutex);
    if (!Communicator::MpiRunning()) {
        return;
    }
    for (auto &op : orphans) {
        int flag = 0;
        if (!aborted && MPI_Test(&op->request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag != 0) {
            pending -= 1;
            if (op->finish) {
                op->finish();
            }
            op.reset();
        } else {
            // Still in flight: MPI may write these buffers later, so they are leaked, never freed.
            (void)op.release();
        }
    }
    // Freeing is skipped for an aborted or busy communicator: its peers may be gone, and a pending collective must
    // not lose its communicator. A borrowed one stays the caller's, with its own error handler back.
    if (!owned) {
        if (comm != MPI_COMM_NULL && previous_errhandler != MPI_ERRHANDLER_NULL) {
            MPI_Comm_set_errhandler(comm, previous_errhandler);
            MPI_Errhandler_free(&previous_errhandler);
        }
        return;
    }
    if (comm != MPI_COMM_NULL && !aborted && pending == 0) {
        MPI_Comm_free(&comm);
    }
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, bool owned)
    : state_(std::make_shared<MpiGroupState>()) {
    state_->comm = comm;
    state_->name = std::move(name);
    state_->owned = owned;
    if (!owned) {
        SHARDLINE_CHECK_MPI(MPI_Comm_get_errhandler(comm, &state_->previous_errhandler));
    }
    SHARDLINE_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    SHARDLINE_CHECK_MPI(MPI_Comm_rank(comm, &state_->rank));
    SHARDLINE_CHECK_MPI(MPI_Comm_size(comm, &state_->size));
}

std::string MpiCommunicator::AbortReason() const { return "after a timeout, a failed debug check or Abort()"; }

void MpiCommunicator::CheckUsable(std::string_view op) const {
    Communicator::CheckUsable(op);
    SHARDLINE_CHECK_AS(CommError, Communicator::MpiRunning(), op,
                       "expected MPI to be initialized and not finalized, got it {} (group '{}')", "not running",
                       state_->name);
}

void MpiCommunicator::ReapOrphans() {
    std::lock_guard lock(state_->mutex);
    auto &orphans = state_->orphans;
    std::erase_if(orphans, [this](std::unique_ptr<MpiPendingOp> &op) {
        int flag = 0;
        if (MPI_Test(&op->request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag != 0) {
            state_->pending -= 1;
            if (op->finish) {
                op->finish();
            }
            return true;
        }
        return false;
    });
}

MpiOpInfo MpiCommunicator::Begin(std::string_view op, std::int64_t count, DType dtype) {
    ReapOrphans();
    return MpiOpInfo{
        .op = op, .seq = ++seq_, .count = count, .dtype = dtype, .start = Clock::now(), .timeout = CommTimeout()};
}

WorkHandle MpiCommunicator::DoAllReduce(Tensor &tensor, ReduceOp op) {
    const MpiOpInfo info = Begin("all_reduce", tensor.numel(), tensor.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {tensor};
    SHARDLINE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, tensor.data(), static_cast<int>(tensor.numel()),
                                       MpiType(tensor.dtype()), MpiReduceOp(op), state_->comm, &pending->request));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) {
        finish = [t = tensor, size = size()] { Scale(t, size); };
    }
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::DoAllGather(const Tensor &input, Tensor &output) {
    const MpiOpInfo info = Begin("all_gather", input.numel(), input.dtype());
    // The input may be this rank's block of the output (MPI_IN_PLACE; Communicator rejected any other overlap).
    const auto *block = static_cast<const char *>(output.data()) + input.nbytes() * static_cast<std::size_t>(rank());
    const bool in_place = input.numel() > 0 && input.data() == block;
    const int n = static_cast<int>(input.numel());
    const MPI_Datatype type = MpiType(input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data(), n, type, output.data(), n, type,
                                       state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::DoAllGatherV(const Tensor &input, Tensor &output, const std::vector<std::int64_t> &counts) {
    const MpiOpInfo info = Begin("all_gather_v", output.numel(), input.dtype());
    const MPI_Datatype type = MpiType(input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(counts, pending->ints);
    pending->buffers = {input, output};
    const int *recv_counts = pending->ints.data();
    const int *displs = pending->ints.data() + size();
    SHARDLINE_CHECK_MPI(MPI_Iallgatherv(input.data(), static_cast<int>(input.numel()), type, output.data(), recv_counts,
                                        displs, type, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::DoReduceScatter(const Tensor &input, Tensor &output, ReduceOp op) {
    const MpiOpInfo info = Begin("reduce_scatter", output.numel(), input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    // In place (output is this rank's block of the input, NCCL's form): MPI_IN_PLACE reads the whole input from the
    // receive buffer and leaves this rank's result at its start, so the result is moved to the block afterwards.
    const auto block = static_cast<std::size_t>(output.nbytes());
    const bool in_place =
        block > 0 && static_cast<const char *>(output.data()) ==
                         static_cast<const char *>(input.data()) + block * static_cast<std::size_t>(rank());
    SHARDLINE_CHECK_MPI(MPI_Ireduce_scatter_block(
        in_place ? MPI_IN_PLACE : input.data(), in_place ? input.data() : output.data(),
        static_cast<int>(output.numel()), MpiType(input.dtype()), MpiReduceOp(op), state_->comm, &pending->request));
    std::function<void()> finish = [t = output, from = input.data(), in_place, block, avg = op == ReduceOp::kAvg,
                                    size = size()] {
        if (in_place && from != t.data()) {
            std::memmove(t.data(), from, block);
        }
        if (avg) {
            Scale(t, size);
        }
    };
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::DoReduceScatterV(const Tensor &input, Tensor &output,
                                             const std::vector<std::int64_t> &counts, ReduceOp op) {
    const MpiOpInfo info = Begin("reduce_scatter_v", input.numel(), input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(counts, pending->ints);
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(MPI_Ireduce_scatter(input.data(), output.data(), pending->ints.data(), MpiType(input.dtype()),
                                            MpiReduceOp(op), state_->comm, &pending->request));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) {
        finish = [t = output, size = size()] { Scale(t, size); };
    }
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::DoAllToAll(const Tensor &input, Tensor &output) {
    const MpiOpInfo info = Begin("all_to_all", input.numel(), input.dtype());
    const int block = static_cast<int>(input.numel() / size());
    const MPI_Datatype type = MpiType(input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(
        MPI_Ialltoall(input.data(), block, type, output.data(), block, type, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::DoAllToAllV(const Tensor &input, const std::vector<std::int64_t> &send_counts,
                                        Tensor &output, const std::vector<std::int64_t> &recv_counts) {
    const MpiOpInfo info = Begin("all_to_all_v", input.numel(), input.dtype());
    const MPI_Datatype type = MpiType(input.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(send_counts, pending->ints);
    PackCountsDispls(recv_counts, pending->ints);
    pending->buffers = {input, output};
    const int s = size();
    const int *ints = pending->ints.data();
    SHARDLINE_CHECK_MPI(MPI_Ialltoallv(input.data(), ints, ints + s, type, output.data(), ints + 2 * s, ints + 3 * s,
                                       type, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::DoBroadcast(Tensor &tensor, int root) {
    const MpiOpInfo info = Begin("broadcast", tensor.numel(), tensor.dtype());
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {tensor};
    SHARDLINE_CHECK_MPI(MPI_Ibcast(tensor.data(), static_cast<int>(tensor.numel()), MpiType(tensor.dtype()), root,
                                   state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::DoBarrier() {
    const MpiOpInfo info = Begin("barrier", 0, DType::kFloat32);
    auto pending = std::make_unique<MpiPendingOp>();
    SHARDLINE_CHECK_MPI(MPI_Ibarrier(state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

std::unique_ptr<Communicator> MpiCommunicator::Split(int color, int key, std::string name) {
    constexpr std::string_view kOp = "split";
    CheckUsable(kOp);
    const MpiOpInfo info = Begin(kOp, 0, DType::kFloat32);
    if (CommCheckEnabled()) {
        RunCheck(info, kCheckSplit, 0, {}, {});
    }
    // MPI_Comm_split blocks without a deadline: a non-blocking barrier under the deadline first makes sure that every
    // rank has arrived, so a missing rank raises CommError instead of hanging the split.
    MPI_Request request = MPI_REQUEST_NULL;
    SHARDLINE_CHECK_MPI(MPI_Ibarrier(state_->comm, &request));
    WaitInternal(*state_, request, info, "rendezvous before ");
    MPI_Comm sub = MPI_COMM_NULL;
    SHARDLINE_CHECK_MPI(MPI_Comm_split(state_->comm, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    if (sub == MPI_COMM_NULL) {
        return nullptr;
    }
    return std::make_unique<MpiCommunicator>(sub, std::move(name), /*owned=*/true);
}

void MpiCommunicator::Abort() noexcept { state_->aborted = true; }

} // namespace detail

std::unique_ptr<Communicator> Communicator::FromMpiComm(MPI_Comm comm, MpiCommOptions options) {
    constexpr std::string_view kOp = "FromMpiComm";
    SHARDLINE_CHECK_AS(CommError, Communicator::MpiRunning(), kOp,
                       "expected MPI to be initialized and not finalized, got it not running (group '{}')",
                       options.name);
    SHARDLINE_CHECK(comm != MPI_COMM_NULL, kOp, "expected an MPI communicator, got MPI_COMM_NULL (group '{}')",
                    options.name);
    // A malformed SHARDLINE_COMM_TIMEOUT_S / SHARDLINE_COMM_CHECK raises here, before the communicator exists.
    (void)CommTimeout();
    (void)CommCheckEnabled();
    return std::make_unique<detail::MpiCommunicator>(comm, std::move(options.name), options.take_ownership);
}

bool Communicator::MpiRunning() {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    return initialized != 0 && finalized == 0;
}

std::unique_ptr<Communicator> Communicator::CreateMpiWorld(std::string name) {
    SHARDLINE_CHECK_AS(CommError, Communicator::MpiRunning(), "CreateMpiWorld",
                       "MPI must be initialized (launch::Environment does it) and not finalized");
    MPI_Comm comm = MPI_COMM_NULL;
    SHARDLINE_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    return FromMpiComm(comm, {.name = std::move(name), .take_ownership = true});
}

} // namespace shardline::comm
