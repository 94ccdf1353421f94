#include <cstring>
#include <optional>
#include <string>

#include <shardline/core/context.h>
#include <shardline/core/env.h>

#include "comm/nccl_communicator.h"

// NCCL communicators from elsewhere: Split (ncclCommSplit), the world (id over the host world, ncclCommInitRankConfig)
// and a communicator the program made itself (FromNcclComm). Every communicator shardline makes is made non-blocking,
// polled under the timeout, and (unless SHARDLINE_NCCL_BLOCKING=0) split once more into the blocking communicator
// its collectives run on: ncclCommSplit takes the child's configuration, blocking included (nccl.h), and runs as the
// parent's group, so the blocking child is made on an NCCL thread that the timeout watches like any creation.

namespace shardline::comm {
namespace detail {
namespace {

/// ncclCommSplit of `parent` (every member calls it) into `child`, a communicator named `name`, blocking or not,
/// polled until done under the timeout; throws CommError (the child aborted) on a failure or the timeout. `child` must
/// outlive an abort of `parent`: a split still running on the parent's NCCL thread writes it when it completes, and
/// only aborting the parent (which joins that thread) ends it.
void SplitUnderTimeout(NcclState& s, ncclComm_t parent, int color, int key, const std::string& name, bool blocking,
                       std::string_view api, ncclComm_t& child) {
    child = nullptr;
    ncclConfig_t config = NcclConfig(name, blocking);
    const auto start = Clock::now();
    try {
        const ncclResult_t r = ncclCommSplit(parent, color, key, &child, &config);
        // The split runs as the parent's group: a non-blocking parent's on an NCCL thread, polled here; the child is
        // set once it is complete (a blocking child keeps no ncclInProgress state of its own to poll).
        WaitLeftInProgress(s, {parent, child}, r, api, std::function<std::string()>([&] {
                               return fmt::format("ncclCommSplit(color {}, key {}, {}) of group '{}' into '{}'", color,
                                                  key, blocking ? "blocking" : "non-blocking", s.name, name);
                           }),
                           start);
    } catch (...) {
        if (child != nullptr) {
            (void)ncclCommAbort(child);
            child = nullptr;
        }
        throw;
    }
    SHARDLINE_CHECK_AS(CommError, child != nullptr, api,
                       "ncclCommSplit(color {}) of group '{}' into '{}' returned no communicator", color, s.name, name);
}

/// A group's communicators (nccl_communicator.h) into `comms` (which must outlive an abort of `parent`, as above):
/// the non-blocking split of `parent`, and when `blocking` a blocking split of that one for the collectives.
void SplitComms(NcclState& s, ncclComm_t parent, int color, int key, const std::string& name, bool blocking,
                std::string_view api, NcclComms& comms) {
    SplitUnderTimeout(s, parent, color, key, name, /*blocking=*/false, api, comms.control);
    if (!blocking) {
        comms.collectives = comms.control;
        comms.control = nullptr;
        return;
    }
    try {
        // Every member splits its new group with one color and key: the same ranks in the same order, blocking.
        SplitUnderTimeout(s, comms.control, 0, 0, name, /*blocking=*/true, api, comms.collectives);
    } catch (...) {
        (void)ncclCommAbort(comms.control); // joins the split's thread, which may still write comms.collectives
        comms.control = nullptr;
        throw;
    }
}

} // namespace

std::unique_ptr<Communicator> NcclCommunicator::Split(int color, int key, std::string name) {
    constexpr std::string_view kApi = "NcclCommunicator::Split";
    NcclState& s = *state_;
    SHARDLINE_CHECK(color >= 0, kApi, "color must be >= 0 (every rank joins a group), got {}", color);
    if (s.abort_requested) {
        s.ThrowAborted(kApi);
    }
    const bool blocking = BlockingCollectives();
    DeviceGuard guard(device_);
    NcclComms comms; // outlives the lock, whose release aborts the parent on a failure (SplitUnderTimeout)
    {
        NcclLock lock(s);
        const ncclComm_t control = s.control;
        const ncclComm_t parent = control != nullptr ? control : s.comm.load();
        if (parent == nullptr || s.abort_requested) {
            s.ThrowAborted(kApi);
        }
        try {
            SplitComms(s, parent, color, key, name, blocking, kApi, comms);
        } catch (const std::exception& e) {
            // A split some ranks left early would leave the others waiting in it: abort this group too.
            s.NoteAbort(e.what());
            throw;
        }
    }
    int child_rank = 0;
    int child_size = 0;
    try {
        SHARDLINE_CHECK_NCCL(ncclCommUserRank(comms.collectives, &child_rank));
        SHARDLINE_CHECK_NCCL(ncclCommCount(comms.collectives, &child_size));
    } catch (...) {
        for (ncclComm_t c : {comms.collectives, comms.control}) {
            if (c != nullptr) {
                (void)ncclCommAbort(c);
            }
        }
        throw;
    }
    return std::make_unique<NcclCommunicator>(comms, device_, child_rank, child_size, std::move(name),
                                              /*owned=*/true);
}

} // namespace detail

// ---------------------------------------------------------------------------------------------------------------------
// World

std::unique_ptr<Communicator> Communicator::CreateNcclWorld(Communicator& host_world, int device, std::string name) {
    using namespace detail;
    constexpr std::string_view kApi = "CreateNcclWorld";
    SHARDLINE_CHECK_AS(DeviceError, host_world.device_type() == DeviceType::kCPU, kApi,
                       "host_world must move CPU tensors (an MPI communicator), got backend '{}'",
                       host_world.backend());
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
        (void)cudaGetLastError();
        visible = 0;
    }
    SHARDLINE_CHECK_AS(DeviceError, device >= 0 && device < visible, kApi,
                       "rank {} asked for cuda:{} but {} CUDA device(s) are visible", host_world.rank(), device,
                       visible);
    KeepMulticastOff();
    // Read before the id broadcast: a malformed value raises on every rank before anything collective.
    const bool blocking = BlockingCollectives();

    const int rank = host_world.rank();
    const int size = host_world.size();
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "the id travels as float32 words");
    if (rank == 0) {
        SHARDLINE_CHECK_NCCL(ncclGetUniqueId(&id));
    }
    Tensor blob =
        Tensor::FromBlob(&id, {static_cast<std::int64_t>(sizeof(id) / sizeof(float))}, DType::kFloat32, Device::CPU());
    host_world.Broadcast(blob, 0)->Wait(true);

    DeviceGuard guard(device);
    CudaContext::Get(device);
    ncclComm_t comm = nullptr;
    ncclConfig_t config = NcclConfig(name, /*blocking=*/false);
    const auto start = Clock::now();
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    // No communicator object owns it yet: poll here with the same timeout, abort on failure.
    NcclState probe;
    probe.name = name;
    ncclComm_t collectives = nullptr; // outlives the abort of `comm` below (SplitUnderTimeout)
    try {
        std::lock_guard lock(probe.nccl_mutex);
        WaitLeftInProgress(
            probe, {comm}, r, kApi,
            fmt::format("ncclCommInitRankConfig(rank {} of {}, cuda:{}) of group '{}'", rank, size, device, name),
            start);
        if (blocking) {
            // The collectives' blocking communicator: a split of the whole group, made under the same timeout.
            SplitUnderTimeout(probe, comm, 0, rank, name, /*blocking=*/true, kApi, collectives);
        }
    } catch (...) {
        if (comm != nullptr) {
            (void)ncclCommAbort(comm);
        }
        throw;
    }
    SHARDLINE_LOG_DEBUG("NCCL group '{}': rank {} of {} on cuda:{} ({}; init {:.3f} s)", name, rank, size, device,
                        blocking ? "blocking collectives" : "non-blocking collectives", Seconds(Clock::now() - start));
    const NcclComms comms = blocking ? NcclComms{.collectives = collectives, .control = comm}
                                     : NcclComms{.collectives = comm, .control = nullptr};
    return std::make_unique<NcclCommunicator>(comms, device, rank, size, std::move(name), /*owned=*/true);
}

std::unique_ptr<Communicator> Communicator::FromNcclComm(ncclComm_t comm, NcclCommOptions options) {
    constexpr std::string_view kApi = "FromNcclComm";
    SHARDLINE_CHECK(comm != nullptr, kApi, "expected an NCCL communicator, got nullptr (group '{}')", options.name);
    ncclResult_t async = ncclSuccess;
    SHARDLINE_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
    SHARDLINE_CHECK_AS(CommError, async == ncclSuccess, kApi,
                       "expected an initialised NCCL communicator, got ncclCommGetAsyncError = {} (group '{}'; a "
                       "non-blocking communicator must have left ncclInProgress)",
                       ncclGetErrorString(async), options.name);
    int device = -1;
    int rank = -1;
    int size = 0;
    SHARDLINE_CHECK_NCCL(ncclCommCuDevice(comm, &device));
    SHARDLINE_CHECK_NCCL(ncclCommUserRank(comm, &rank));
    SHARDLINE_CHECK_NCCL(ncclCommCount(comm, &size));
    // NCCL read NCCL_NVLS_ENABLE when the caller's program first used it and caches it for the process (the caller's
    // communicator and shardline's splits of it alike): setting it now would change nothing, so require it.
    const std::optional<std::string> nvls = env::Get("NCCL_NVLS_ENABLE");
    SHARDLINE_CHECK(
        nvls && *nvls == "0", kApi,
        "expected NCCL_NVLS_ENABLE=0 in the environment before the program's first NCCL call (NCCL reads it "
        "once per process; shardline never lets NCCL use NVLink multicast), got '{}' (group '{}')",
        nvls.value_or("unset"), options.name);
    // A malformed SHARDLINE_COMM_TIMEOUT_S / SHARDLINE_COMM_CHECK raises here, before the communicator exists, not
    // later from a collective or the watchdog.
    (void)CommTimeout();
    (void)CommCheckEnabled();
    // Used as it is, blocking or not (a caller's communicator is never replaced); Split makes shardline's own pair.
    return std::make_unique<detail::NcclCommunicator>(detail::NcclComms{.collectives = comm}, device, rank, size,
                                                      std::move(options.name), options.take_ownership);
}

} // namespace shardline::comm
