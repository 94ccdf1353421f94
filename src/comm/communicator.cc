#include <shardline/comm/communicator.h>

#include <atomic>
#include <cstdlib>
#include <string>

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
