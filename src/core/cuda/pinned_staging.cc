// Pinned staging blocks for host-to-device copies (pinned_staging.h). Per device, a handful of cudaHostAlloc blocks,
// each with an event recorded after the copy that last read it: a block is reused once its event has completed, and a
// new one is allocated (up to a cap) when none is free. Blocks live until exit, like the device contexts.

#include "pinned_staging.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include <shardline/core/error.h>

#include "context_internal.h"

namespace shardline::detail {
namespace {

/// Larger copies go the plain way: staging them would only add a host memcpy to a copy that is bandwidth-bound anyway.
constexpr std::size_t kMaxStagedBytes = std::size_t{64} << 20;
/// Pinned memory a device may hold for staging (pinned pages are taken from the host's pageable memory).
constexpr std::size_t kMaxPinnedBytesPerDevice = std::size_t{256} << 20;
constexpr std::size_t kMinBlockBytes = std::size_t{1} << 20;

struct Block {
    void *host = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t last_read = nullptr; ///< recorded after the copy that last read the block
};

struct DeviceStaging {
    std::mutex mutex;
    std::vector<Block> blocks;
    std::size_t pinned_bytes = 0;
};

DeviceStaging &StagingOf(int device) {
    static DeviceStaging staging[kMaxCudaDevices];
    return staging[device];
}

bool Idle(const Block &b) {
    const cudaError_t status = cudaEventQuery(b.last_read);
    if (status == cudaSuccess) {
        return true;
    }
    // cudaErrorNotReady is a state, not an error; anything else is a real failure of earlier work.
    if (status != cudaErrorNotReady) {
        SHARDLINE_CHECK_CUDA(status);
    }
    return false;
}

/// The smallest idle block of at least `bytes`, or a new one; nullptr at the cap.
Block *Acquire(DeviceStaging &s, std::size_t bytes) {
    Block *best = nullptr;
    for (Block &b : s.blocks) {
        if (b.bytes >= bytes && (best == nullptr || b.bytes < best->bytes) && Idle(b)) {
            best = &b;
        }
    }
    if (best != nullptr) {
        return best;
    }
    std::size_t size = kMinBlockBytes;
    while (size < bytes) {
        size *= 2;
    }
    if (s.pinned_bytes + size > kMaxPinnedBytesPerDevice) {
        return nullptr;
    }
    Block b;
    b.bytes = size;
    SHARDLINE_CHECK_CUDA(cudaHostAlloc(&b.host, size, cudaHostAllocPortable));
    const cudaError_t status = cudaEventCreateWithFlags(&b.last_read, cudaEventDisableTiming);
    if (status != cudaSuccess) {
        cudaFreeHost(b.host);
        SHARDLINE_CHECK_CUDA(status);
    }
    s.pinned_bytes += size;
    s.blocks.push_back(b);
    return &s.blocks.back();
}

} // namespace

bool StagedHostToDevice(void *dst, const void *src, std::size_t bytes, int device, cudaStream_t stream) {
    if (bytes > kMaxStagedBytes || device < 0 || device >= kMaxCudaDevices) {
        return false;
    }
    DeviceStaging &s = StagingOf(device);
    std::lock_guard lock(s.mutex);
    Block *b = Acquire(s, bytes);
    if (b == nullptr) {
        return false;
    }
    std::memcpy(b->host, src, bytes);
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, b->host, bytes, cudaMemcpyHostToDevice, stream));
    SHARDLINE_CHECK_CUDA(cudaEventRecord(b->last_read, stream));
    return true;
}

} // namespace shardline::detail
