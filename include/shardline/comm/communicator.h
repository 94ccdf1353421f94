#pragma once

// Communicators: the collectives shardline needs, behind one interface with two backends
// (NCCL for CUDA tensors, MPI for CPU tensors). Every call is asynchronous and returns a Work handle; the
// synchronous forms wait on it. Every collective is counted per communicator (tests read the counters).
//
// Buffers are contiguous tensors; gathers and scatters concatenate along the flat element order (rank r's block
// follows rank r-1's). Multi-dimensional redistribution (which tensor dim is split) is dist/'s business.
//
// Faults: a collective that does not finish within the timeout (SHARDLINE_COMM_TIMEOUT_S, default 120 s) or that
// reports an asynchronous error aborts the communicator and raises CommError naming the op, its sequence number,
// the count, the group and the elapsed time. Nothing is called on an aborted communicator afterwards (every call
// raises CommError at once). Destructors are noexcept and never block.
// SHARDLINE_COMM_CHECK=1: before each collective the ranks exchange (op, sequence, count, dtype) and every rank
// raises CommError on a mismatch (NCCL itself completes a count mismatch silently).

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/core/tensor.h>

namespace shardline::comm {

enum class ReduceOp : std::uint8_t { kSum, kAvg, kMax, kMin };
std::string_view ReduceOpName(ReduceOp op);

enum class CollectiveKind : std::uint8_t {
    kAllReduce,
    kAllGather,
    kReduceScatter,
    kAllToAll,
    kBroadcast,
    kBarrier,
};
inline constexpr int kNumCollectiveKinds = 6;
std::string_view CollectiveName(CollectiveKind kind);

/// Calls and bytes per collective kind on one communicator. Bytes are what this rank contributes: the input
/// buffer's size (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast), 0 for a barrier.
struct CollectiveCounts {
    std::int64_t calls[kNumCollectiveKinds] = {};
    std::int64_t bytes[kNumCollectiveKinds] = {};

    std::int64_t Calls(CollectiveKind kind) const { return calls[static_cast<int>(kind)]; }
    std::int64_t Bytes(CollectiveKind kind) const { return bytes[static_cast<int>(kind)]; }
    std::int64_t TotalCalls() const;
};

/// An asynchronous collective in flight.
class Work {
public:
    virtual ~Work() = default;
    /// Blocks until done (for NCCL: until the collective is ordered before the compute stream's later work, and,
    /// when `host` is true, until it has finished on the device). Raises CommError on timeout or failure.
    virtual void Wait(bool host = false) = 0;
    /// True when finished (never blocks). Raises CommError on failure or once the timeout has passed.
    virtual bool Test() = 0;
};
using WorkHandle = std::shared_ptr<Work>;

/// The collectives of one group of ranks.
class Communicator {
public:
    virtual ~Communicator() = default;

    virtual int rank() const = 0;
    virtual int size() const = 0;
    /// "nccl" or "mpi".
    virtual std::string_view backend() const = 0;
    /// Human-readable group name for messages ("world", "mesh dim 1 'tp' group 0 {0,1}").
    virtual const std::string& name() const = 0;
    /// The device type whose tensors this communicator moves.
    virtual DeviceType device_type() const = 0;

    /// In place: every rank ends with op over all ranks' `tensor`.
    virtual WorkHandle AllReduce(Tensor& tensor, ReduceOp op) = 0;
    /// `output` (size·n elements) = concat over ranks of `input` (n elements).
    virtual WorkHandle AllGather(const Tensor& input, Tensor& output) = 0;
    /// Uneven: rank r contributes counts[r] elements; `output` holds Σ counts.
    virtual WorkHandle AllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) = 0;
    /// `output` (n elements) = op over ranks of block `rank` of `input` (size·n elements).
    virtual WorkHandle ReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
    /// Uneven: block r of `input` has counts[r] elements; `output` gets counts[rank].
    virtual WorkHandle ReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                                      ReduceOp op) = 0;
    /// Block r of `input` (n / size elements each) goes to rank r; `output` block r comes from rank r.
    virtual WorkHandle AllToAll(const Tensor& input, Tensor& output) = 0;
    /// Uneven: send_counts[r] elements to rank r, recv_counts[r] from rank r, blocks packed in rank order.
    virtual WorkHandle AllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                                 const std::vector<std::int64_t>& recv_counts) = 0;
    /// In place: every rank ends with `root`'s tensor.
    virtual WorkHandle Broadcast(Tensor& tensor, int root) = 0;
    virtual WorkHandle Barrier() = 0;

    /// A sub-communicator of the ranks that pass the same color, ordered by key (MPI_Comm_split / ncclCommSplit).
    /// Collective over this communicator.
    virtual std::unique_ptr<Communicator> Split(int color, int key, std::string name) = 0;

    /// Aborts: in-flight work is abandoned, every later call raises CommError. Never blocks, never throws.
    virtual void Abort() noexcept = 0;
    virtual bool aborted() const = 0;

    /// Counters since creation (or the last ResetCounts).
    CollectiveCounts Counts() const;
    void ResetCounts();

protected:
    /// Backends call this once per collective, before issuing it.
    void Count(CollectiveKind kind, std::int64_t bytes);

private:
    mutable std::mutex counts_mutex_;
    CollectiveCounts counts_;
};

/// SHARDLINE_COMM_TIMEOUT_S (default 120 s), read once.
std::chrono::milliseconds CommTimeout();
/// SHARDLINE_COMM_CHECK=1, read once.
bool CommCheckEnabled();
/// Overrides for tests (a negative/zero timeout restores the environment's value).
void SetCommTimeout(std::chrono::milliseconds timeout);
void SetCommCheck(bool enabled);

} // namespace shardline::comm
