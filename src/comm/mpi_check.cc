#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>

#include "comm/mpi_communicator.h"

// SHARDLINE_COMM_CHECK for the MPI backend: the ranks MPI_Iallgather one record per collective (op, seq, count,
// dtype, reduce op or root, the V counts) under the op's deadline; every rank holds the same table, reaches the same
// verdict, and raises before anything is issued.

namespace shardline::comm::detail {
namespace {

constexpr std::string_view kCheckOpNames[] = {"all_reduce",       "all_gather", "all_gather_v", "reduce_scatter",
                                              "reduce_scatter_v", "all_to_all", "all_to_all_v", "broadcast",
                                              "barrier",          "split"};

std::string_view CheckOpName(std::int64_t op) {
    return op >= 0 && op < static_cast<std::int64_t>(std::size(kCheckOpNames)) ? kCheckOpNames[op] : "unknown";
}

std::string DescribeRecord(const std::int64_t *rec, int size) {
    const std::int64_t op = rec[0];
    std::string s = fmt::format("{} seq {}", CheckOpName(op), rec[1]);
    if (op == kCheckBarrier || op == kCheckSplit) {
        return s;
    }
    s += fmt::format(" count {} {}", rec[2],
                     rec[3] >= 0 && rec[3] <= static_cast<std::int64_t>(DType::kInt64)
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

void MpiCommunicator::CheckAgreement(const Collective &call) {
    int check_op = kCheckBarrier;
    switch (call.kind) {
    case CollectiveKind::kAllReduce:
        check_op = kCheckAllReduce;
        break;
    case CollectiveKind::kAllGather:
        check_op = call.uneven ? kCheckAllGatherV : kCheckAllGather;
        break;
    case CollectiveKind::kReduceScatter:
        check_op = call.uneven ? kCheckReduceScatterV : kCheckReduceScatter;
        break;
    case CollectiveKind::kAllToAll:
        check_op = call.uneven ? kCheckAllToAllV : kCheckAllToAll;
        break;
    case CollectiveKind::kBroadcast:
        check_op = kCheckBroadcast;
        break;
    case CollectiveKind::kBarrier:
        check_op = kCheckBarrier;
        break;
    }
    // The record carries the sequence number the collective is about to take (Begin assigns it).
    const MpiOpInfo info{.op = call.op,
                         .seq = seq_ + 1,
                         .count = call.count,
                         .dtype = call.dtype,
                         .start = Clock::now(),
                         .timeout = CommTimeout()};
    static const std::vector<std::int64_t> kNone;
    RunCheck(info, check_op, call.aux, call.counts != nullptr ? *call.counts : kNone,
             call.recv_counts != nullptr ? *call.recv_counts : kNone);
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

} // namespace shardline::comm::detail
