#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>

namespace shardline::comm {
namespace {

std::chrono::milliseconds EnvironmentTimeout() {
    // A millisecond at least: a zero timeout would fail every collective.
    const double seconds = env::GetDouble("SHARDLINE_COMM_TIMEOUT_S", 120.0, 1e-3, 1e9);
    return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
}

bool EnvironmentCheck() { return env::GetBool("SHARDLINE_COMM_CHECK", false); }

std::atomic<std::int64_t> g_timeout_override_ms{0};
std::atomic<int> g_check_override{-1};

} // namespace

std::string_view ReduceOpName(ReduceOp op) {
    switch (op) {
    case ReduceOp::kSum:
        return "sum";
    case ReduceOp::kAvg:
        return "avg";
    case ReduceOp::kMax:
        return "max";
    case ReduceOp::kMin:
        return "min";
    }
    return "unknown";
}

std::string_view CollectiveName(CollectiveKind kind) {
    switch (kind) {
    case CollectiveKind::kAllReduce:
        return "all_reduce";
    case CollectiveKind::kAllGather:
        return "all_gather";
    case CollectiveKind::kReduceScatter:
        return "reduce_scatter";
    case CollectiveKind::kAllToAll:
        return "all_to_all";
    case CollectiveKind::kBroadcast:
        return "broadcast";
    case CollectiveKind::kBarrier:
        return "barrier";
    }
    return "unknown";
}

std::int64_t CollectiveCounts::TotalCalls() const {
    std::int64_t total = 0;
    for (std::int64_t c : calls) {
        total += c;
    }
    return total;
}

CollectiveCounts Communicator::Counts() const {
    std::lock_guard lock(counts_mutex_);
    return counts_;
}

void Communicator::ResetCounts() {
    std::lock_guard lock(counts_mutex_);
    counts_ = CollectiveCounts{};
}

void Communicator::Count(CollectiveKind kind, std::int64_t bytes) {
    std::lock_guard lock(counts_mutex_);
    counts_.calls[static_cast<int>(kind)] += 1;
    counts_.bytes[static_cast<int>(kind)] += bytes;
}

// ---------------------------------------------------------------------------------------------------------------------
// Validation, once for every backend. Messages read "<op>: expected <what>, got <values> (group 'g', rank r of n)".

namespace {

constexpr std::string_view kAllReduce = "all_reduce";
constexpr std::string_view kAllGather = "all_gather";
constexpr std::string_view kAllGatherV = "all_gather_v";
constexpr std::string_view kReduceScatter = "reduce_scatter";
constexpr std::string_view kReduceScatterV = "reduce_scatter_v";
constexpr std::string_view kAllToAll = "all_to_all";
constexpr std::string_view kAllToAllV = "all_to_all_v";
constexpr std::string_view kBroadcast = "broadcast";
constexpr std::string_view kBarrier = "barrier";

std::int64_t Bytes(const Tensor& t) { return static_cast<std::int64_t>(t.nbytes()); }

} // namespace

std::string Communicator::Where() const {
    return fmt::format("group '{}', rank {} of {}, {}", name(), rank(), size(), backend());
}

void Communicator::CheckUsable(std::string_view op) const {
    if (aborted()) {
        SHARDLINE_THROW(CommError, op,
                        "expected a usable communicator, got communicator '{}' aborted: {}; nothing is called on an "
                        "aborted communicator ({})",
                        name(), AbortReason(), Where());
    }
}

void Communicator::CheckTensor(const Tensor& t, std::string_view op, std::string_view what) const {
    SHARDLINE_CHECK(t.defined(), op, "expected {} to be a defined tensor, got an undefined one ({})", what, Where());
    const Device want = device();
    SHARDLINE_CHECK_AS(DeviceError, t.device() == want, op,
                       "expected {} on {} (the device of {} group '{}'), got {} ({})", what, ToString(want), backend(),
                       name(), t.ToString(), Where());
    const std::vector<DType> supported = dtypes();
    const bool dtype_ok = std::find(supported.begin(), supported.end(), t.dtype()) != supported.end();
    if (!dtype_ok) {
        std::vector<std::string_view> names;
        for (DType d : supported) {
            names.push_back(DTypeName(d));
        }
        SHARDLINE_THROW(DTypeError, op, "expected {} of dtype {} (what the {} backend moves), got {} ({})", what,
                        fmt::join(names, " or "), backend(), DTypeName(t.dtype()), Where());
    }
    SHARDLINE_CHECK_AS(ShapeError, t.is_contiguous(), op, "expected {} to be contiguous, got strides {} of {} ({})",
                       what, ShapeToString(t.strides()), t.ToString(), Where());
    // Inline rather than CheckMaxCount(..., fmt::format("{} numel", what)): that would format a string on every call.
    SHARDLINE_CHECK_AS(ShapeError, t.numel() <= max_count(), op,
                       "expected {} numel in [0, {}] (the {} backend's count limit), got {} ({})", what, max_count(),
                       backend(), t.numel(), Where());
}

void Communicator::CheckPair(const Tensor& input, const Tensor& output, std::string_view op,
                             InPlace in_place_form) const {
    CheckTensor(input, op, "input");
    CheckTensor(output, op, "output");
    SHARDLINE_CHECK_AS(DTypeError, input.dtype() == output.dtype(), op,
                       "expected input and output of one dtype, got {} and {} ({})", DTypeName(input.dtype()),
                       DTypeName(output.dtype()), Where());
    // Overlapping buffers are undefined in MPI and NCCL alike, except the in-place forms: all_gather's input may be
    // this rank's block of its output, reduce_scatter's output this rank's block of its input (as NCCL defines them).
    const auto* pi = static_cast<const char*>(input.data());
    const auto* po = static_cast<const char*>(output.data());
    const std::size_t ni = input.nbytes();
    const std::size_t no = output.nbytes();
    const auto r = static_cast<std::size_t>(rank());
    const bool in_place = (in_place_form == InPlace::kInputIsRankBlockOfOutput && ni > 0 && pi == po + ni * r) ||
                          (in_place_form == InPlace::kOutputIsRankBlockOfInput && no > 0 && po == pi + no * r);
    const bool overlap = ni > 0 && no > 0 && pi < po + no && po < pi + ni;
    SHARDLINE_CHECK(!overlap || in_place, op, "expected input and output not to overlap, got {} and {} ({})",
                    input.ToString(), output.ToString(), Where());
}

std::int64_t Communicator::CheckCounts(const std::vector<std::int64_t>& counts, std::string_view op,
                                       std::string_view what) const {
    SHARDLINE_CHECK_AS(ShapeError, static_cast<int>(counts.size()) == size(), op,
                       "expected {} with one entry per rank ({}), got {} entries ({})", what, size(), counts.size(),
                       Where());
    std::int64_t total = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
        SHARDLINE_CHECK_AS(ShapeError, counts[r] >= 0, op, "expected {}[{}] to be non-negative, got {} ({})", what, r,
                           counts[r], Where());
        total += counts[r];
    }
    CheckMaxCount(total, op, fmt::format("sum({})", what));
    return total;
}

void Communicator::CheckMaxCount(std::int64_t n, std::string_view op, std::string_view what) const {
    SHARDLINE_CHECK_AS(ShapeError, n <= max_count(), op,
                       "expected {} in [0, {}] (the {} backend's count limit), got {} ({})", what, max_count(),
                       backend(), n, Where());
}

namespace {

void CheckReduceOp(ReduceOp op, DType dtype, std::string_view api) {
    const auto v = static_cast<int>(op);
    SHARDLINE_CHECK(v >= 0 && v <= static_cast<int>(ReduceOp::kMin), api,
                    "expected a ReduceOp (sum, avg, max or min), got {}", v);
    // An integer average would truncate (NCCL divides in the integer type): counts are summed, then divided by whoever
    // knows what they mean.
    SHARDLINE_CHECK_AS(DTypeError, !(op == ReduceOp::kAvg && dtype == DType::kInt64), api,
                       "expected sum, max or min for int64 tensors, got avg (an integer average would truncate)");
}

} // namespace

void Communicator::Admit(const Collective& call) {
    if (CommCheckEnabled()) {
        CheckAgreement(call);
    }
}

WorkHandle Communicator::Issued(const Collective& call, WorkHandle work) {
    // Counted once the backend has issued it: a hook that raises (an abort in between, an invalidated capture) leaves
    // the counters as they were, so "a rejected call counts nothing" holds for every rejection.
    Count(call.kind, call.bytes);
    return work;
}

WorkHandle Communicator::AllReduce(Tensor& tensor, ReduceOp op) {
    CheckUsable(kAllReduce);
    CheckTensor(tensor, kAllReduce, "tensor");
    CheckReduceOp(op, tensor.dtype(), kAllReduce);
    const Collective call{.op = kAllReduce,
                          .kind = CollectiveKind::kAllReduce,
                          .count = tensor.numel(),
                          .dtype = tensor.dtype(),
                          .aux = static_cast<std::int64_t>(op),
                          .bytes = Bytes(tensor)};
    Admit(call);
    return Issued(call, DoAllReduce(tensor, op));
}

WorkHandle Communicator::AllGather(const Tensor& input, Tensor& output) {
    CheckUsable(kAllGather);
    CheckPair(input, output, kAllGather, InPlace::kInputIsRankBlockOfOutput);
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == input.numel() * size(), kAllGather,
                       "expected output to hold size·n = {}·{} = {} elements, got {} ({})", size(), input.numel(),
                       input.numel() * size(), output.numel(), Where());
    const Collective call{.op = kAllGather,
                          .kind = CollectiveKind::kAllGather,
                          .count = input.numel(),
                          .dtype = input.dtype(),
                          .bytes = Bytes(input)};
    Admit(call);
    return Issued(call, DoAllGather(input, output));
}

WorkHandle Communicator::AllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) {
    CheckUsable(kAllGatherV);
    CheckPair(input, output, kAllGatherV, InPlace::kNone);
    const std::int64_t total = CheckCounts(counts, kAllGatherV, "counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == counts[rank()], kAllGatherV,
                       "expected input to hold counts[rank {}] = {} elements, got {} ({})", rank(), counts[rank()],
                       input.numel(), Where());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == total, kAllGatherV,
                       "expected output to hold sum(counts) = {} elements, got {} ({})", total, output.numel(),
                       Where());
    const Collective call{.op = kAllGatherV,
                          .kind = CollectiveKind::kAllGather,
                          .uneven = true,
                          .count = total,
                          .dtype = input.dtype(),
                          .bytes = Bytes(input),
                          .counts = &counts};
    Admit(call);
    return Issued(call, DoAllGatherV(input, output, counts));
}

WorkHandle Communicator::ReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) {
    CheckUsable(kReduceScatter);
    CheckPair(input, output, kReduceScatter, InPlace::kOutputIsRankBlockOfInput);
    CheckReduceOp(op, input.dtype(), kReduceScatter);
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == output.numel() * size(), kReduceScatter,
                       "expected input to hold size·n = {}·{} = {} elements, got {} ({})", size(), output.numel(),
                       output.numel() * size(), input.numel(), Where());
    const Collective call{.op = kReduceScatter,
                          .kind = CollectiveKind::kReduceScatter,
                          .count = output.numel(),
                          .dtype = input.dtype(),
                          .aux = static_cast<std::int64_t>(op),
                          .bytes = Bytes(input)};
    Admit(call);
    return Issued(call, DoReduceScatter(input, output, op));
}

WorkHandle Communicator::ReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                                        ReduceOp op) {
    CheckUsable(kReduceScatterV);
    CheckPair(input, output, kReduceScatterV, InPlace::kNone);
    CheckReduceOp(op, input.dtype(), kReduceScatterV);
    const std::int64_t total = CheckCounts(counts, kReduceScatterV, "counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == total, kReduceScatterV,
                       "expected input to hold sum(counts) = {} elements, got {} ({})", total, input.numel(), Where());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == counts[rank()], kReduceScatterV,
                       "expected output to hold counts[rank {}] = {} elements, got {} ({})", rank(), counts[rank()],
                       output.numel(), Where());
    const Collective call{.op = kReduceScatterV,
                          .kind = CollectiveKind::kReduceScatter,
                          .uneven = true,
                          .count = total,
                          .dtype = input.dtype(),
                          .aux = static_cast<std::int64_t>(op),
                          .bytes = Bytes(input),
                          .counts = &counts};
    Admit(call);
    return Issued(call, DoReduceScatterV(input, output, counts, op));
}

WorkHandle Communicator::AllToAll(const Tensor& input, Tensor& output) {
    CheckUsable(kAllToAll);
    CheckPair(input, output, kAllToAll, InPlace::kNone);
    SHARDLINE_CHECK_AS(ShapeError, input.numel() % size() == 0, kAllToAll,
                       "expected input numel divisible by the group size {}, got {} ({})", size(), input.numel(),
                       Where());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == input.numel(), kAllToAll,
                       "expected output to hold as many elements as the input ({}), got {} ({})", input.numel(),
                       output.numel(), Where());
    const Collective call{.op = kAllToAll,
                          .kind = CollectiveKind::kAllToAll,
                          .count = input.numel(),
                          .dtype = input.dtype(),
                          .bytes = Bytes(input)};
    Admit(call);
    return Issued(call, DoAllToAll(input, output));
}

WorkHandle Communicator::AllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                                   const std::vector<std::int64_t>& recv_counts) {
    CheckUsable(kAllToAllV);
    CheckPair(input, output, kAllToAllV, InPlace::kNone);
    const std::int64_t sent = CheckCounts(send_counts, kAllToAllV, "send_counts");
    const std::int64_t received = CheckCounts(recv_counts, kAllToAllV, "recv_counts");
    SHARDLINE_CHECK_AS(ShapeError, input.numel() == sent, kAllToAllV,
                       "expected input to hold sum(send_counts) = {} elements, got {} ({})", sent, input.numel(),
                       Where());
    SHARDLINE_CHECK_AS(ShapeError, output.numel() == received, kAllToAllV,
                       "expected output to hold sum(recv_counts) = {} elements, got {} ({})", received, output.numel(),
                       Where());
    const Collective call{.op = kAllToAllV,
                          .kind = CollectiveKind::kAllToAll,
                          .uneven = true,
                          .count = sent,
                          .dtype = input.dtype(),
                          .bytes = Bytes(input),
                          .counts = &send_counts,
                          .recv_counts = &recv_counts};
    Admit(call);
    return Issued(call, DoAllToAllV(input, send_counts, output, recv_counts));
}

WorkHandle Communicator::Broadcast(Tensor& tensor, int root) {
    CheckUsable(kBroadcast);
    CheckTensor(tensor, kBroadcast, "tensor");
    SHARDLINE_CHECK(root >= 0 && root < size(), kBroadcast, "expected root in [0, {}), got {} ({})", size(), root,
                    Where());
    const Collective call{.op = kBroadcast,
                          .kind = CollectiveKind::kBroadcast,
                          .count = tensor.numel(),
                          .dtype = tensor.dtype(),
                          .aux = root,
                          .bytes = Bytes(tensor)};
    Admit(call);
    return Issued(call, DoBroadcast(tensor, root));
}

WorkHandle Communicator::Barrier() {
    CheckUsable(kBarrier);
    const Collective call{.op = kBarrier, .kind = CollectiveKind::kBarrier};
    Admit(call);
    return Issued(call, DoBarrier());
}

std::chrono::milliseconds CommTimeout() {
    if (const std::int64_t ms = g_timeout_override_ms.load(); ms > 0) {
        return std::chrono::milliseconds(ms);
    }
    static const std::chrono::milliseconds timeout = EnvironmentTimeout();
    return timeout;
}

bool CommCheckEnabled() {
    if (const int o = g_check_override.load(); o >= 0) {
        return o == 1;
    }
    static const bool enabled = EnvironmentCheck();
    return enabled;
}

void SetCommTimeout(std::chrono::milliseconds timeout) { g_timeout_override_ms = timeout.count(); }
void SetCommCheck(bool enabled) { g_check_override = enabled ? 1 : 0; }

} // namespace shardline::comm
