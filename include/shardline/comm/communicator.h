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
//
// Validation is done once, here, for both backends: the public collectives are not virtual. They check the arguments
// on the calling rank (defined, device, dtype, contiguity, sizes and counts, root, overlap, the aborted state) and
// raise with one wording whatever the backend ("all_gather: expected output to hold ..., got ..."), then run the debug
// agreement check, hand the call to the backend (the protected Do* hooks) and count it once the hook has issued it.
// A rejected call (by the checks or by the backend) counts nothing.
//
// Bringing your own communicator: Communicator::FromMpiComm(MPI_Comm) and Communicator::FromNcclComm(ncclComm_t) wrap
// a communicator the program created (non-owning unless options.take_ownership). nccl.h is not needed for this header:
// ncclComm_t is declared below exactly as nccl.h declares it.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/config.h>
#include <shardline/core/tensor.h>

#if SHARDLINE_WITH_MPI
#include <mpi.h>
#endif

#if SHARDLINE_WITH_NCCL
// The same declaration as nccl.h's (repeating an identical typedef is legal), so that including this header does not
// need nccl.h.
struct ncclComm;
typedef struct ncclComm* ncclComm_t;
#endif

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

/// Options of Communicator::FromMpiComm.
struct MpiCommOptions {
    /// Group name for messages.
    std::string name = "mpi";
    /// Free the MPI communicator (MPI_Comm_free) with the shardline communicator. Off: the caller keeps and frees it;
    /// its error handler is restored when the shardline communicator is destroyed.
    bool take_ownership = false;
};

/// Options of Communicator::FromNcclComm.
struct NcclCommOptions {
    /// Group name for messages.
    std::string name = "nccl";
    /// Finalize and destroy the NCCL communicator with the shardline communicator. Off: the caller destroys it, after
    /// the shardline communicator. Either way a fault that raises CommError (timeout, asynchronous error) or Abort()
    /// calls ncclCommAbort on it, the only way to release a hung kernel: once aborted() is true the caller must neither
    /// use nor destroy it. Destroying the shardline communicator never aborts a borrowed one: with work overdue it
    /// logs an error and leaves the communicator to the caller (who should then ncclCommAbort it).
    /// NCCL reads NCCL_NVLS_ENABLE once per process, so FromNcclComm requires it to be "0" already (shardline never
    /// uses NVLink multicast) and raises otherwise.
    bool take_ownership = false;
};

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
    DeviceType device_type() const { return device().type; }
    /// The device whose tensors this communicator moves: cpu (MPI) or the NCCL communicator's cuda:N.
    virtual Device device() const = 0;

    /// In place: every rank ends with op over all ranks' `tensor`.
    WorkHandle AllReduce(Tensor& tensor, ReduceOp op);
    /// `output` (size·n elements) = concat over ranks of `input` (n elements).
    WorkHandle AllGather(const Tensor& input, Tensor& output);
    /// Uneven: rank r contributes counts[r] elements; `output` holds Σ counts.
    WorkHandle AllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts);
    /// `output` (n elements) = op over ranks of block `rank` of `input` (size·n elements).
    WorkHandle ReduceScatter(const Tensor& input, Tensor& output, ReduceOp op);
    /// Uneven: block r of `input` has counts[r] elements; `output` gets counts[rank].
    WorkHandle ReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                              ReduceOp op);
    /// Block r of `input` (n / size elements each) goes to rank r; `output` block r comes from rank r.
    WorkHandle AllToAll(const Tensor& input, Tensor& output);
    /// Uneven: send_counts[r] elements to rank r, recv_counts[r] from rank r, blocks packed in rank order.
    WorkHandle AllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                         const std::vector<std::int64_t>& recv_counts);
    /// In place: every rank ends with `root`'s tensor.
    WorkHandle Broadcast(Tensor& tensor, int root);
    WorkHandle Barrier();

    /// A sub-communicator of the ranks that pass the same color, ordered by key (MPI_Comm_split / ncclCommSplit).
    /// Collective over this communicator.
    virtual std::unique_ptr<Communicator> Split(int color, int key, std::string name) = 0;

    /// Aborts: in-flight work is abandoned, every later call raises CommError. Never blocks, never throws.
    virtual void Abort() noexcept = 0;
    virtual bool aborted() const = 0;

    /// Counters since creation (or the last ResetCounts).
    CollectiveCounts Counts() const;
    void ResetCounts();

#if SHARDLINE_WITH_MPI
    /// Wraps `comm`, an MPI communicator the caller created, for CPU tensors. Not collective. MPI must be initialized
    /// (MPI_THREAD_MULTIPLE, or FUNNELED and one thread calling). Sets MPI_ERRORS_RETURN on `comm` while in use.
    static std::unique_ptr<Communicator> FromMpiComm(MPI_Comm comm, MpiCommOptions options = {});
    /// Collective over MPI_COMM_WORLD: a communicator over a duplicate of it (owned), named `name`.
    static std::unique_ptr<Communicator> CreateMpiWorld(std::string name = "world");
    /// Whether MPI is initialized and not yet finalized: what FromMpiComm and CreateMpiWorld need.
    static bool MpiRunning();
#endif
#if SHARDLINE_WITH_NCCL
    /// Wraps `comm`, an initialised NCCL communicator the caller created (blocking or not), for CUDA tensors of its
    /// device (ncclCommCuDevice). Not collective. The collectives run on `comm` itself. The timeout covers the enqueue
    /// either way: a non-blocking communicator's by polling, a blocking one's by the watchdog, whose ncclCommAbort
    /// releases a call blocked inside NCCL (docs/comm.md).
    static std::unique_ptr<Communicator> FromNcclComm(ncclComm_t comm, NcclCommOptions options = {});
    /// Collective over `host_world` (a CPU communicator over the same ranks): rank 0 creates the ncclUniqueId and
    /// broadcasts it over host_world; every rank then creates a non-blocking NCCL communicator on CUDA device `device`
    /// under the timeout, and a blocking split of it that the collectives run on (SHARDLINE_NCCL_BLOCKING=0: they run
    /// on the non-blocking one). Both owned. Forces NCCL_NVLS_ENABLE=0.
    static std::unique_ptr<Communicator> CreateNcclWorld(Communicator& host_world, int device,
                                                         std::string name = "world");
#endif

protected:
    /// A validated collective, as the debug agreement check sees it.
    struct Collective {
        /// "all_reduce", "all_gather_v", ...: the op name of messages (the uneven forms are distinct calls).
        std::string_view op;
        CollectiveKind kind = CollectiveKind::kBarrier;
        bool uneven = false;
        /// Elements: the input of all_reduce, all_gather, all_to_all(_v), broadcast; the output of reduce_scatter;
        /// Σ counts for the V forms of all_gather and reduce_scatter; 0 for a barrier.
        std::int64_t count = 0;
        DType dtype = DType::kFloat32;
        /// The ReduceOp, or the broadcast root.
        std::int64_t aux = 0;
        /// Counted: this rank's input size.
        std::int64_t bytes = 0;
        /// The V forms' counts (all_to_all_v: the send counts), and all_to_all_v's receive counts.
        const std::vector<std::int64_t>* counts = nullptr;
        const std::vector<std::int64_t>* recv_counts = nullptr;
    };

    /// The dtypes this backend moves.
    virtual std::vector<DType> dtypes() const = 0;
    /// The largest element count (or displacement) one call may carry (MPI counts are int).
    virtual std::int64_t max_count() const { return INT64_MAX; }
    /// Why the communicator was aborted, for messages.
    virtual std::string AbortReason() const = 0;
    /// Raises CommError when nothing may be called (aborted; MPI finalized). Called first by every collective.
    virtual void CheckUsable(std::string_view op) const;
    /// SHARDLINE_COMM_CHECK: every rank learns every rank's `call` and raises CommError on a disagreement, before
    /// anything is issued or counted. Backends without an exchange of their own leave it empty.
    virtual void CheckAgreement(const Collective& call) { (void)call; }

    /// The backend's collectives, called with validated arguments, after the agreement check and the count.
    virtual WorkHandle DoAllReduce(Tensor& tensor, ReduceOp op) = 0;
    virtual WorkHandle DoAllGather(const Tensor& input, Tensor& output) = 0;
    virtual WorkHandle DoAllGatherV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) = 0;
    virtual WorkHandle DoReduceScatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
    virtual WorkHandle DoReduceScatterV(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts,
                                        ReduceOp op) = 0;
    virtual WorkHandle DoAllToAll(const Tensor& input, Tensor& output) = 0;
    virtual WorkHandle DoAllToAllV(const Tensor& input, const std::vector<std::int64_t>& send_counts, Tensor& output,
                                   const std::vector<std::int64_t>& recv_counts) = 0;
    virtual WorkHandle DoBroadcast(Tensor& tensor, int root) = 0;
    virtual WorkHandle DoBarrier() = 0;

private:
    /// The agreement check (in debug mode).
    void Admit(const Collective& call);
    /// Counts `call` (after its hook issued it without raising) and passes the work on.
    WorkHandle Issued(const Collective& call, WorkHandle work);
    void Count(CollectiveKind kind, std::int64_t bytes);
    void CheckTensor(const Tensor& tensor, std::string_view op, std::string_view what) const;
    /// Which overlap of input and output a collective accepts: none, or NCCL's (and MPI's) in-place forms.
    enum class InPlace : std::uint8_t {
        kNone,
        kInputIsRankBlockOfOutput, ///< all_gather: input == output + rank·n
        kOutputIsRankBlockOfInput, ///< reduce_scatter: output == input + rank·n
    };
    void CheckPair(const Tensor& input, const Tensor& output, std::string_view op, InPlace in_place_form) const;
    std::int64_t CheckCounts(const std::vector<std::int64_t>& counts, std::string_view op, std::string_view what) const;
    void CheckMaxCount(std::int64_t n, std::string_view op, std::string_view what) const;
    std::string Where() const;

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
