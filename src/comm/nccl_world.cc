#include <cstring>
#include <optional>
#include <string>

#include <shardline/core/context.h>
#include <shardline/core/env.h>

#include "comm/nccl_communicator.h"

// NCCL communicators from elsewhere: Split (ncclCommSplit), the world (id over the host world, ncclCommInitRankConfig)
// and a communicator the program made itself (FromNcclComm).

namespace shardline::comm {
namespace detail {

std::unique_ptr<Communicator> NcclCommunicator::Split(int color, int key, std::string name) {
    constexpr std::string_view kApi = "NcclCommunicator::Split";
    NcclState& s = *state_;
    SHARDLINE_CHECK(color >= 0, kApi, "color must be >= 0 (every rank joins a group), got {}", color);
    if (s.abort_requested) {
        s.ThrowAborted(kApi);
    }
    DeviceGuard guard(device_);
    ncclComm_t child = nullptr;
    {
        NcclLock lock(s);
        if (s.comm == nullptr || s.abort_requested) {
            s.ThrowAborted(kApi);
        }
        ncclConfig_t config = NonBlockingConfig(name);
        const auto start = Clock::now();
        try {
            const ncclResult_t r = ncclCommSplit(s.comm, color, key, &child, &config);
            WaitLeftInProgress(
                s, {s.comm, child}, r, kApi,
                fmt::format("ncclCommSplit(color {}, key {}) of group '{}' into '{}'", color, key, s.name, name),
                start);
        } catch (const std::exception& e) {
            if (child != nullptr) {
                (void)ncclCommAbort(child);
            }
            s.NoteAbort(e.what());
            throw;
        }
    }
    SHARDLINE_CHECK_AS(CommError, child != nullptr, kApi,
                       "ncclCommSplit(color {}) of group '{}' returned no communicator", color, s.name);
    int child_rank = 0;
    int child_size = 0;
    try {
        SHARDLINE_CHECK_NCCL(ncclCommUserRank(child, &child_rank));
        SHARDLINE_CHECK_NCCL(ncclCommCount(child, &child_size));
    } catch (...) {
        (void)ncclCommAbort(child);
        throw;
    }
    return std::make_unique<NcclCommunicator>(child, device_, child_rank, child_size, std::move(name),
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
    ncclConfig_t config = NonBlockingConfig(name);
    const auto start = Clock::now();
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    // No communicator object owns it yet: poll here with the same timeout, abort on failure.
    NcclState probe;
    probe.name = name;
    try {
        std::lock_guard lock(probe.nccl_mutex);
        WaitLeftInProgress(
            probe, {comm}, r, kApi,
            fmt::format("ncclCommInitRankConfig(rank {} of {}, cuda:{}) of group '{}'", rank, size, device, name),
            start);
    } catch (...) {
        if (comm != nullptr) {
            (void)ncclCommAbort(comm);
        }
        throw;
    }
    SHARDLINE_LOG_DEBUG("NCCL group '{}': rank {} of {} on cuda:{} (init {:.3f} s)", name, rank, size, device,
                        Seconds(Clock::now() - start));
    return std::make_unique<NcclCommunicator>(comm, device, rank, size, std::move(name), /*owned=*/true);
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
    return std::make_unique<detail::NcclCommunicator>(comm, device, rank, size, std::move(options.name),
                                                      options.take_ownership);
}

} // namespace shardline::comm
