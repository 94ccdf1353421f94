#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "comm/backends.h"

namespace shardline::comm::detail {
namespace {

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
constexpr std::string_view kCheckOpNames[] = {"all_reduce",       "all_gather", "all_gather_v", "reduce_scatter",
                                              "reduce_scatter_v", "all_to_all", "all_to_all_v", "broadcast",
                                              "barrier",          "split"};

std::string_view CheckOpName(std::int64_t op) {
    return op >= 0 && op < static_cast<std::int64_t>(std::size(kCheckOpNames)) ? kCheckOpNames[op] : "unknown";
}

bool MpiRunning() {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    return initialized != 0 && finalized == 0;
}

double Seconds(Clock::duration d) {
    return std::chrono::duration<double>(d).count();
}

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

[[noreturn]] void ThrowAborted(const MpiGroupState &state, std::string_view op) {
    SHARDLINE_THROW(CommError, fmt::format("MPI {}", op),
                    "communicator '{}' was aborted (after a timeout, a failed debug check or Abort()); nothing is "
                    "called on an aborted communicator",
                    state.name);
}

// Blocks on an internal request (debug check, split rendezvous) with the op's deadline.
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

MPI_Datatype MpiType(DType dtype, std::string_view op) {
    switch (dtype) {
    case DType::kFloat32:
        return MPI_FLOAT;
    case DType::kFloat64:
        return MPI_DOUBLE;
    default:
        break;
    }
    SHARDLINE_THROW(DTypeError, fmt::format("MPI {}", op),
                    "the MPI backend moves float32 and float64 CPU tensors, got {} (use the NCCL backend for "
                    "half-precision CUDA tensors)",
                    DTypeName(dtype));
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

void CheckTensor(const Tensor &t, std::string_view op, std::string_view what) {
    SHARDLINE_CHECK(t.defined(), fmt::format("MPI {}", op), "{} must be a defined tensor", what);
    SHARDLINE_CHECK_AS(DeviceError, t.device().is_cpu(), fmt::format("MPI {}", op),
                       "{} must be a CPU tensor (the MPI backend moves host memory; CUDA tensors go through the NCCL "
                       "world), got {}",
                       what, t.ToString());
    MpiType(t.dtype(), op);
    SHARDLINE_CHECK(t.is_contiguous(), fmt::format("MPI {}", op), "{} must be contiguous, got a strided {}", what,
                    t.ToString());
}

void CheckSameDType(const Tensor &a, const Tensor &b, std::string_view op) {
    SHARDLINE_CHECK_AS(DTypeError, a.dtype() == b.dtype(), fmt::format("MPI {}", op),
                       "input and output must have the same dtype, got {} and {}", DTypeName(a.dtype()),
                       DTypeName(b.dtype()));
}

int ToInt(std::int64_t v, std::string_view op, std::string_view what) {
    SHARDLINE_CHECK_AS(ShapeError, v >= 0 && v <= INT_MAX, fmt::format("MPI {}", op),
                       "{} must lie in [0, 2^31-1] (MPI counts are int), got {}", what, v);
    return static_cast<int>(v);
}

// MPI forbids overlapping send and receive buffers (except through MPI_IN_PLACE).
void CheckNoOverlap(const Tensor &a, const Tensor &b, std::string_view op) {
    const auto *pa = static_cast<const char *>(a.data());
    const auto *pb = static_cast<const char *>(b.data());
    const bool overlap = a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
    SHARDLINE_CHECK(!overlap, fmt::format("MPI {}", op), "input and output must not overlap, got {} and {}",
                    a.ToString(), b.ToString());
}

std::vector<std::int64_t> CheckCounts(const std::vector<std::int64_t> &counts, int size, std::string_view op,
                                      std::string_view what) {
    SHARDLINE_CHECK_AS(ShapeError, static_cast<int>(counts.size()) == size, fmt::format("MPI {}", op),
                       "{} must have one entry per rank ({}), got {} entries", what, size, counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r) {
        SHARDLINE_CHECK_AS(ShapeError, counts[r] >= 0, fmt::format("MPI {}", op), "{}[{}] must be non-negative, got {}",
                           what, r, counts[r]);
    }
    return counts;
}

// Fills counts (first half of `ints`) and displacements (second half) as int.
void PackCountsDispls(const std::vector<std::int64_t> &counts, std::vector<int> &ints, std::string_view op) {
    const std::size_t n = counts.size();
    const std::size_t base = ints.size();
    ints.resize(base + 2 * n);
    std::int64_t displ = 0;
    for (std::size_t r = 0; r < n; ++r) {
        ints[base + r] = ToInt(counts[r], op, "count");
        ints[base + n + r] = ToInt(displ, op, "displacement");
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

std::string DescribeRecord(const std::int64_t *rec, int size) {
    const std::int64_t op = rec[0];
    std::string s = fmt::format("{} seq {}", CheckOpName(op), rec[1]);
    if (op == kCheckBarrier || op == kCheckSplit) {
        return s;
    }
    s += fmt::format(" count {} {}", rec[2],
                     rec[3] >= 0 && rec[3] <= static_cast<std::int64_t>(DType::kFloat64)
                         ? DTypeName(static_cast<DType>(rec[3]))
                         : std::string_view("?"));
    switch (op) {
    case kCheckAllReduce:
    case kCheckReduceScatter:
    case kCheckReduceScatterV:
        s += fmt::format(" op {}", ReduceOpName(static_cast<ReduceOp>(rec[4])));
        break;
    case kCheckBroadcast:
        s += fmt::format(" root {}", rec[4]);
        break;
    default:
        break;
    }
    if (op == kCheckAllGatherV || op == kCheckReduceScatterV) {
        s += fmt::format(" counts {}", std::vector<std::int64_t>(rec + 5, rec + 5 + size));
    }
    return s;
}

} // namespace

MpiGroupState::~MpiGroupState() {
    std::lock_guard lock(mutex);
    if (!MpiRunning()) {
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
    // not lose its communicator.
    if (comm != MPI_COMM_NULL && !aborted && pending == 0) {
        MPI_Comm_free(&comm);
    }
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name) : state_(std::make_shared<MpiGroupState>()) {
    state_->comm = comm;
    state_->name = std::move(name);
    SHARDLINE_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    SHARDLINE_CHECK_MPI(MPI_Comm_rank(comm, &state_->rank));
    SHARDLINE_CHECK_MPI(MPI_Comm_size(comm, &state_->size));
}

void MpiCommunicator::CheckUsable(std::string_view op) const {
    if (state_->aborted) {
        ThrowAborted(*state_, op);
    }
    SHARDLINE_CHECK_AS(CommError, MpiRunning(), fmt::format("MPI {}", op),
                       "MPI is not initialized or already finalized (group '{}')", state_->name);
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

MpiOpInfo MpiCommunicator::Begin(int check_op, std::string_view op, std::int64_t count, DType dtype, std::int64_t aux,
                                 const std::vector<std::int64_t> &a, const std::vector<std::int64_t> &b) {
    ReapOrphans();
    MpiOpInfo info{
        .op = op, .seq = ++seq_, .count = count, .dtype = dtype, .start = Clock::now(), .timeout = CommTimeout()};
    if (CommCheckEnabled()) {
        RunCheck(info, check_op, aux, a, b);
    }
    return info;
}

// Record layout: op, seq, count, dtype, aux (reduce op or root), then `size` entries of a (the counts of the V forms,
// send counts of all_to_all_v) and `size` entries of b (recv counts of all_to_all_v).
void MpiCommunicator::RunCheck(const MpiOpInfo &info, int check_op, std::int64_t aux,
                               const std::vector<std::int64_t> &a, const std::vector<std::int64_t> &b) {
    const int size = state_->size;
    const int width = 5 + 2 * size;
    std::vector<std::int64_t> mine(width, 0);
    const bool no_dtype = check_op == kCheckBarrier || check_op == kCheckSplit;
    mine[0] = check_op;
    mine[1] = info.seq;
    mine[2] = no_dtype ? 0 : info.count;
    mine[3] = no_dtype ? -1 : static_cast<std::int64_t>(info.dtype);
    mine[4] = aux;
    std::copy(a.begin(), a.end(), mine.begin() + 5);
    std::copy(b.begin(), b.end(), mine.begin() + 5 + size);

    // Leaked on timeout (MPI may still write it), freed otherwise.
    auto all = std::make_unique<std::vector<std::int64_t>>(static_cast<std::size_t>(width) * size);
    auto sent = std::make_unique<std::vector<std::int64_t>>(mine);
    MPI_Request request = MPI_REQUEST_NULL;
    SHARDLINE_CHECK_MPI(
        MPI_Iallgather(sent->data(), width, MPI_INT64_T, all->data(), width, MPI_INT64_T, state_->comm, &request));
    try {
        WaitInternal(*state_, request, info, "debug check (SHARDLINE_COMM_CHECK) of ");
    } catch (...) {
        (void)all.release();
        (void)sent.release();
        throw;
    }

    // The key of a record: all_to_all_v compares only op, seq and dtype (its counts differ per rank by design and are
    // checked pairwise below); every other op compares the whole record.
    auto key = [&](int r) {
        const std::int64_t *rec = all->data() + static_cast<std::size_t>(r) * width;
        if (rec[0] == kCheckAllToAllV) {
            return std::vector<std::int64_t>{rec[0], rec[1], rec[3]};
        }
        return std::vector<std::int64_t>(rec, rec + width);
    };
    std::map<std::vector<std::int64_t>, std::vector<int>> groups;
    for (int r = 0; r < size; ++r) {
        groups[key(r)].push_back(r);
    }
    std::vector<std::string> problems;
    if (groups.size() > 1) {
        // The reference is the record most ranks hold (ties: the one of the lowest rank).
        const std::vector<int> *reference = nullptr;
        for (const auto &[k, ranks] : groups) {
            if (reference == nullptr || ranks.size() > reference->size() ||
                (ranks.size() == reference->size() && ranks.front() < reference->front())) {
                reference = &ranks;
            }
        }
        std::vector<int> odd;
        for (int r = 0; r < size; ++r) {
            if (std::find(reference->begin(), reference->end(), r) == reference->end()) {
                odd.push_back(r);
            }
        }
        std::vector<std::string> lines;
        for (int r = 0; r < size; ++r) {
            lines.push_back(fmt::format("rank {}: {}", r, DescribeRecord(all->data() + std::size_t(r) * width, size)));
        }
        problems.push_back(fmt::format("{}; mismatching ranks: {}", fmt::join(lines, "; "), fmt::join(odd, ",")));
    } else if (check_op == kCheckAllToAllV) {
        // Rank s sends a[s][d] elements to rank d, which expects b[d][s].
        std::vector<int> odd;
        std::vector<std::string> pairs;
        for (int s = 0; s < size; ++s) {
            for (int d = 0; d < size; ++d) {
                const std::int64_t sends = (*all)[std::size_t(s) * width + 5 + d];
                const std::int64_t expects = (*all)[std::size_t(d) * width + 5 + size + s];
                if (sends != expects) {
                    pairs.push_back(fmt::format("rank {} sends {} to rank {}, which expects {}", s, sends, d, expects));
                    odd.push_back(s);
                    odd.push_back(d);
                }
            }
        }
        if (!pairs.empty()) {
            std::sort(odd.begin(), odd.end());
            odd.erase(std::unique(odd.begin(), odd.end()), odd.end());
            problems.push_back(fmt::format("all_to_all_v seq {}: {}; mismatching ranks: {}", info.seq,
                                           fmt::join(pairs, "; "), fmt::join(odd, ",")));
        }
    }
    if (!problems.empty()) {
        // Every rank holds the same table, so every rank reaches this verdict and raises; none issues the collective.
        state_->aborted = true;
        SHARDLINE_THROW(CommError, fmt::format("MPI {}", info.op),
                        "SHARDLINE_COMM_CHECK: the ranks of group '{}' disagree on collective seq {}: {}; the "
                        "communicator is aborted",
                        state_->name, info.seq, problems.front());
    }
}

WorkHandle MpiCommunicator::AllReduce(Tensor &tensor, ReduceOp op) {
    constexpr std::string_view kOp = "all_reduce";
    CheckUsable(kOp);
    CheckTensor(tensor, kOp, "tensor");
    const MPI_Datatype type = MpiType(tensor.dtype(), kOp);
    const int n = ToInt(tensor.numel(), kOp, "numel");
    const MpiOpInfo info = Begin(kCheckAllReduce, kOp, tensor.numel(), tensor.dtype(), static_cast<int>(op), {}, {});
    Count(CollectiveKind::kAllReduce, static_cast<std::int64_t>(tensor.nbytes()));
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {tensor};
    SHARDLINE_CHECK_MPI(
        MPI_Iallreduce(MPI_IN_PLACE, tensor.data(), n, type, MpiReduceOp(op), state_->comm, &pending->request));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) {
        finish = [t = tensor, size = size()] { Scale(t, size); };
    }
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::AllGather(const Tensor &input, Tensor &output) {
    constexpr std::string_view kOp = "all_gather";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == input.numel() * size(), "MPI all_gather",
                       "output must hold size·n = {}·{} = {} elements, got {}", size(), input.numel(),
                       input.numel() * size(), output.numel());
    const int n = ToInt(input.numel(), kOp, "numel");
    ToInt(output.numel(), kOp, "output numel");
    // The input may be this rank's block of the output (MPI_IN_PLACE); any other overlap is an error.
    const auto *block = static_cast<const char *>(output.data()) + input.nbytes() * static_cast<std::size_t>(rank());
    const bool in_place = input.numel() > 0 && input.data() == block;
    if (!in_place) {
        CheckNoOverlap(input, output, kOp);
    }
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    const MpiOpInfo info = Begin(kCheckAllGather, kOp, input.numel(), input.dtype(), 0, {}, {});
    Count(CollectiveKind::kAllGather, static_cast<std::int64_t>(input.nbytes()));
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data(), n, type, output.data(), n, type,
                                       state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::AllGatherV(const Tensor &input, Tensor &output, const std::vector<std::int64_t> &counts) {
    constexpr std::string_view kOp = "all_gather_v";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    CheckCounts(counts, size(), kOp, "counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == counts[rank()], "MPI all_gather_v",
                       "input must hold counts[rank {}] = {} elements, got {}", rank(), counts[rank()], input.numel());
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == total, "MPI all_gather_v",
                       "output must hold sum(counts) = {} elements, got {}", total, output.numel());
    CheckNoOverlap(input, output, kOp);
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(counts, pending->ints, kOp);
    const int n = ToInt(input.numel(), kOp, "numel");
    const MpiOpInfo info = Begin(kCheckAllGatherV, kOp, total, input.dtype(), 0, counts, {});
    Count(CollectiveKind::kAllGather, static_cast<std::int64_t>(input.nbytes()));
    pending->buffers = {input, output};
    const int *recv_counts = pending->ints.data();
    const int *displs = pending->ints.data() + size();
    SHARDLINE_CHECK_MPI(MPI_Iallgatherv(input.data(), n, type, output.data(), recv_counts, displs, type, state_->comm,
                                        &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::ReduceScatter(const Tensor &input, Tensor &output, ReduceOp op) {
    constexpr std::string_view kOp = "reduce_scatter";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == output.numel() * size(), "MPI reduce_scatter",
                       "input must hold size·n = {}·{} = {} elements, got {}", size(), output.numel(),
                       output.numel() * size(), input.numel());
    CheckNoOverlap(input, output, kOp);
    const int n = ToInt(output.numel(), kOp, "numel");
    ToInt(input.numel(), kOp, "input numel");
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    const MpiOpInfo info = Begin(kCheckReduceScatter, kOp, output.numel(), input.dtype(), static_cast<int>(op), {}, {});
    Count(CollectiveKind::kReduceScatter, static_cast<std::int64_t>(input.nbytes()));
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(MPI_Ireduce_scatter_block(input.data(), output.data(), n, type, MpiReduceOp(op), state_->comm,
                                                  &pending->request));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) {
        finish = [t = output, size = size()] { Scale(t, size); };
    }
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::ReduceScatterV(const Tensor &input, Tensor &output, const std::vector<std::int64_t> &counts,
                                           ReduceOp op) {
    constexpr std::string_view kOp = "reduce_scatter_v";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    CheckCounts(counts, size(), kOp, "counts");
    const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == total, "MPI reduce_scatter_v",
                       "input must hold sum(counts) = {} elements, got {}", total, input.numel());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == counts[rank()], "MPI reduce_scatter_v",
                       "output must hold counts[rank {}] = {} elements, got {}", rank(), counts[rank()],
                       output.numel());
    CheckNoOverlap(input, output, kOp);
    ToInt(total, kOp, "sum(counts)");
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(counts, pending->ints, kOp);
    const MpiOpInfo info = Begin(kCheckReduceScatterV, kOp, total, input.dtype(), static_cast<int>(op), counts, {});
    Count(CollectiveKind::kReduceScatter, static_cast<std::int64_t>(input.nbytes()));
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(MPI_Ireduce_scatter(input.data(), output.data(), pending->ints.data(), type, MpiReduceOp(op),
                                            state_->comm, &pending->request));
    std::function<void()> finish;
    if (op == ReduceOp::kAvg) {
        finish = [t = output, size = size()] { Scale(t, size); };
    }
    return std::make_shared<MpiWork>(state_, info, std::move(pending), std::move(finish));
}

WorkHandle MpiCommunicator::AllToAll(const Tensor &input, Tensor &output) {
    constexpr std::string_view kOp = "all_to_all";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    SHARDLINE_CHECK_AS(ShapeError, input.numel() % size() == 0, "MPI all_to_all",
                       "input numel ({}) must be divisible by the group size ({})", input.numel(), size());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == input.numel(), "MPI all_to_all",
                       "output must hold as many elements as the input ({}), got {}", input.numel(), output.numel());
    CheckNoOverlap(input, output, kOp);
    ToInt(input.numel(), kOp, "numel");
    const int block = ToInt(input.numel() / size(), kOp, "block");
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    const MpiOpInfo info = Begin(kCheckAllToAll, kOp, input.numel(), input.dtype(), 0, {}, {});
    Count(CollectiveKind::kAllToAll, static_cast<std::int64_t>(input.nbytes()));
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {input, output};
    SHARDLINE_CHECK_MPI(
        MPI_Ialltoall(input.data(), block, type, output.data(), block, type, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::AllToAllV(const Tensor &input, const std::vector<std::int64_t> &send_counts, Tensor &output,
                                      const std::vector<std::int64_t> &recv_counts) {
    constexpr std::string_view kOp = "all_to_all_v";
    CheckUsable(kOp);
    CheckTensor(input, kOp, "input");
    CheckTensor(output, kOp, "output");
    CheckSameDType(input, output, kOp);
    CheckCounts(send_counts, size(), kOp, "send_counts");
    CheckCounts(recv_counts, size(), kOp, "recv_counts");
    const std::int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0});
    const std::int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0});
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == send_total, "MPI all_to_all_v",
                       "input must hold sum(send_counts) = {} elements, got {}", send_total, input.numel());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == recv_total, "MPI all_to_all_v",
                       "output must hold sum(recv_counts) = {} elements, got {}", recv_total, output.numel());
    CheckNoOverlap(input, output, kOp);
    const MPI_Datatype type = MpiType(input.dtype(), kOp);
    auto pending = std::make_unique<MpiPendingOp>();
    PackCountsDispls(send_counts, pending->ints, kOp);
    PackCountsDispls(recv_counts, pending->ints, kOp);
    const MpiOpInfo info = Begin(kCheckAllToAllV, kOp, send_total, input.dtype(), 0, send_counts, recv_counts);
    Count(CollectiveKind::kAllToAll, static_cast<std::int64_t>(input.nbytes()));
    pending->buffers = {input, output};
    const int s = size();
    const int *ints = pending->ints.data();
    SHARDLINE_CHECK_MPI(MPI_Ialltoallv(input.data(), ints, ints + s, type, output.data(), ints + 2 * s, ints + 3 * s,
                                       type, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::Broadcast(Tensor &tensor, int root) {
    constexpr std::string_view kOp = "broadcast";
    CheckUsable(kOp);
    CheckTensor(tensor, kOp, "tensor");
    SHARDLINE_CHECK(root >= 0 && root < size(), "MPI broadcast", "root must lie in [0, {}), got {}", size(), root);
    const int n = ToInt(tensor.numel(), kOp, "numel");
    const MPI_Datatype type = MpiType(tensor.dtype(), kOp);
    const MpiOpInfo info = Begin(kCheckBroadcast, kOp, tensor.numel(), tensor.dtype(), root, {}, {});
    Count(CollectiveKind::kBroadcast, static_cast<std::int64_t>(tensor.nbytes()));
    auto pending = std::make_unique<MpiPendingOp>();
    pending->buffers = {tensor};
    SHARDLINE_CHECK_MPI(MPI_Ibcast(tensor.data(), n, type, root, state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

WorkHandle MpiCommunicator::Barrier() {
    constexpr std::string_view kOp = "barrier";
    CheckUsable(kOp);
    const MpiOpInfo info = Begin(kCheckBarrier, kOp, 0, DType::kFloat32, 0, {}, {});
    Count(CollectiveKind::kBarrier, 0);
    auto pending = std::make_unique<MpiPendingOp>();
    SHARDLINE_CHECK_MPI(MPI_Ibarrier(state_->comm, &pending->request));
    return std::make_shared<MpiWork>(state_, info, std::move(pending), nullptr);
}

std::unique_ptr<Communicator> MpiCommunicator::Split(int color, int key, std::string name) {
    constexpr std::string_view kOp = "split";
    CheckUsable(kOp);
    const MpiOpInfo info = Begin(kCheckSplit, kOp, 0, DType::kFloat32, 0, {}, {});
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
    return std::make_unique<MpiCommunicator>(sub, std::move(name));
}

void MpiCommunicator::Abort() noexcept {
    state_->aborted = true;
}

std::unique_ptr<Communicator> CreateMpiWorld(std::string name) {
    SHARDLINE_CHECK_AS(CommError, MpiRunning(), "CreateMpiWorld",
                       "MPI must be initialized (launch::Environment does it) and not finalized");
    MPI_Comm comm = MPI_COMM_NULL;
    SHARDLINE_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    return std::make_unique<MpiCommunicator>(comm, std::move(name));
}

} // namespace shardline::comm::detail
