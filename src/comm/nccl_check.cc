#include <shardline/core/context.h>

#include "comm/nccl_communicator.h"

// SHARDLINE_COMM_CHECK for the NCCL backend: before a collective the ranks all-gather (op, seq, count, dtype) over the
// communicator itself, on its stream, and every rank reaches the same verdict (NCCL completes a count mismatch
// silently: measured). all_to_all_v also exchanges its count matrix.

namespace shardline::comm::detail {
namespace {

// Debug-mode record: (op, seq, count, dtype). op packs the kind with its reduce op or root.
std::int64_t PackOp(const NcclIssue& issue) {
    return static_cast<std::int64_t>(issue.kind) * 1000000 + (issue.uneven ? 500000 : 0) + issue.aux;
}

std::string DescribePacked(const std::int64_t* rec) {
    const auto kind = static_cast<CollectiveKind>(rec[0] / 1000000);
    const std::int64_t rest = rec[0] % 1000000;
    const bool uneven = rest >= 500000;
    const std::int64_t aux = rest % 500000;
    const auto dtype = static_cast<DType>(rec[3]);
    const bool valid_kind = rec[0] >= 0 && rec[0] / 1000000 < kNumCollectiveKinds;
    const bool valid_dtype = rec[3] >= 0 && rec[3] <= static_cast<std::int64_t>(DType::kInt64);
    return fmt::format("{}{} #{} count {} {}", valid_kind ? DescribeOp(kind, aux) : fmt::format("op {}", rec[0]),
                       uneven ? " (uneven)" : "", rec[1], rec[2],
                       valid_dtype ? std::string(DTypeName(dtype)) : fmt::format("dtype {}", rec[3]));
}

/// Debug mode: all-gathers `words` int64 from every rank into check_buffer and copies them to `out` (size·words).
/// A host wait, bounded by the timeout (phase 1 and 2 as for any collective). nccl_mutex held.
void ExchangeRecords(NcclState& s, const std::int64_t* mine, std::int64_t words, std::vector<std::int64_t>& out,
                     std::string_view api, const std::string& what) {
    const std::int64_t needed = words * (s.size + 1);
    if (s.check_record < needed) {
        if (s.check_buffer != nullptr) {
            SHARDLINE_CHECK_CUDA(cudaFreeAsync(s.check_buffer, s.stream));
            s.check_buffer = nullptr;
        }
        SHARDLINE_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&s.check_buffer),
                                             static_cast<std::size_t>(needed) * sizeof(std::int64_t), s.stream));
        s.check_record = needed;
    }
    std::int64_t* send = s.check_buffer;
    std::int64_t* recv = s.check_buffer + words;
    // Pageable host → device: staged at once, no wait on the stream.
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(send, mine, static_cast<std::size_t>(words) * sizeof(std::int64_t),
                                         cudaMemcpyHostToDevice, s.stream));
    const ncclComm_t comm = s.comm;
    const auto start = Clock::now();
    SHARDLINE_CHECK_NCCL(ncclGroupStart());
    // As a collective's enqueue (nccl_collectives.cc): it may block inside NCCL, where the watchdog's abort releases
    // it.
    s.enqueue.Enter(start);
    WakeWatchdog(s);
    const ncclResult_t gather = ncclAllGather(send, recv, static_cast<std::size_t>(words), ncclInt64, comm, s.stream);
    const ncclResult_t end = ncclGroupEnd();
    s.enqueue.Leave();
    if (s.abort_done) {
        s.ThrowAborted(api);
    }
    WaitLeftInProgress(s, {comm}, gather != ncclSuccess && gather != ncclInProgress ? gather : end, api, what, start);
    SHARDLINE_CHECK_CUDA(cudaEventRecord(s.check_event, s.stream));
    const auto timeout = CommTimeout();
    Backoff backoff;
    while (true) {
        const cudaError_t q = cudaEventQuery(s.check_event);
        if (q == cudaSuccess) {
            break;
        }
        if (q != cudaErrorNotReady) {
            SHARDLINE_CHECK_CUDA(q);
        }
        ncclResult_t async = ncclSuccess;
        SHARDLINE_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
        SHARDLINE_CHECK_AS(CommError, async == ncclSuccess || async == ncclInProgress, api,
                           "{} failed asynchronously: {}", what, ncclGetErrorString(async));
        if (s.abort_requested) {
            s.ThrowAborted(api);
        }
        const auto elapsed = Clock::now() - start;
        SHARDLINE_CHECK_AS(CommError, elapsed <= timeout, api,
                           "{} did not finish within {:.1f} s (phase 2: kernel; elapsed {:.1f} s); communicator "
                           "aborted",
                           what, Seconds(timeout), Seconds(elapsed));
        backoff.Pause();
    }
    out.resize(static_cast<std::size_t>(words * s.size));
    // Device → pageable host waits for the copy; the stream is idle up to it (the event above fired).
    SHARDLINE_CHECK_CUDA(
        cudaMemcpyAsync(out.data(), recv, out.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, s.stream));
}

/// Debug mode: every rank learns every rank's (op, seq, count, dtype) and returns the same verdict: an empty string
/// when they agree, else a message listing them. all_to_all_v also checks that send_counts[r] of rank i equals
/// recv_counts[i] of rank r. nccl_mutex held.
} // namespace

std::string AgreementVerdict(NcclState& s, const NcclIssue& issue, std::int64_t seq) {
    const std::int64_t mine[4] = {PackOp(issue), seq, issue.count, static_cast<std::int64_t>(issue.dtype)};
    std::vector<std::int64_t> all;
    const std::string what = fmt::format("SHARDLINE_COMM_CHECK exchange before {} #{} on group '{}'",
                                         DescribeOp(issue.kind, issue.aux), seq, s.name);
    ExchangeRecords(s, mine, 4, all, issue.api, what);
    bool agree = true;
    for (int r = 1; r < s.size; ++r) {
        agree = agree && std::equal(all.begin(), all.begin() + 4, all.begin() + 4 * r);
    }
    if (agree && issue.send_counts != nullptr) {
        const std::int64_t n = s.size;
        std::vector<std::int64_t> counts(static_cast<std::size_t>(2 * n));
        std::copy(issue.send_counts->begin(), issue.send_counts->end(), counts.begin());
        std::copy(issue.recv_counts->begin(), issue.recv_counts->end(), counts.begin() + n);
        std::vector<std::int64_t> matrix;
        ExchangeRecords(s, counts.data(), 2 * n, matrix, issue.api, what);
        std::string pairs;
        for (std::int64_t i = 0; i < n; ++i) {
            for (std::int64_t r = 0; r < n; ++r) {
                const std::int64_t sent = matrix[static_cast<std::size_t>(i * 2 * n + r)];
                const std::int64_t expected = matrix[static_cast<std::size_t>(r * 2 * n + n + i)];
                if (sent != expected) {
                    pairs +=
                        fmt::format("; rank {} sends {} elements to rank {}, which expects {}", i, sent, r, expected);
                }
            }
        }
        if (!pairs.empty()) {
            return fmt::format("SHARDLINE_COMM_CHECK: ranks of group '{}' disagree on {} #{}{}", s.name,
                               DescribeOp(issue.kind, issue.aux), seq, pairs);
        }
        return {};
    }
    if (agree) {
        return {};
    }
    std::string listing;
    for (int r = 0; r < s.size; ++r) {
        listing += fmt::format("; rank {}: {}", r, DescribePacked(all.data() + 4 * r));
    }
    return fmt::format("SHARDLINE_COMM_CHECK: ranks of group '{}' disagree before collective #{}{}", s.name, seq,
                       listing);
}

void NcclCommunicator::CheckAgreement(const Collective& call) {
    const NcclIssue issue{.api = call.op,
                          .kind = call.kind,
                          .count = call.recv_counts != nullptr ? -1 : call.count,
                          .dtype = call.dtype,
                          .aux = call.aux,
                          .uneven = call.uneven,
                          .send_counts = call.recv_counts != nullptr ? call.counts : nullptr,
                          .recv_counts = call.recv_counts};
    NcclState& s = *state_;
    DeviceGuard guard(device_);
    // The check waits on the host for its own all-gather, which a capture cannot contain: it runs on the eager calls
    // (e.g. the warm-up step before capture), not on the captured ones.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(CudaContext::Get(device_).stream(), &capture));
    if (capture != cudaStreamCaptureStatusNone) {
        return;
    }
    std::string mismatch;
    {
        NcclLock lock(s);
        if (s.comm == nullptr || s.abort_requested) {
            s.ThrowAborted(issue.api);
        }
        try {
            // The sequence number the collective is about to take (Issue assigns it).
            mismatch = AgreementVerdict(s, issue, s.seq + 1);
        } catch (...) {
            s.NoteAbortAndRethrow(issue, "checking");
        }
    }
    // Nothing was issued: the communicator stays usable.
    SHARDLINE_CHECK_AS(CommError, mismatch.empty(), issue.api, "{}", mismatch);
}

} // namespace shardline::comm::detail
