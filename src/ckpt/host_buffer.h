#pragma once

// Private to src/ckpt: the host memory a save snapshots into, kept and reused across saves (allocating gigabytes of
// pinned memory per save would cost more than the copy).

#include <cstdint>

namespace shardline::ckpt::detail {

class HostBuffer {
public:
    HostBuffer() = default;
    ~HostBuffer();
    HostBuffer(const HostBuffer&) = delete;
    HostBuffer& operator=(const HostBuffer&) = delete;
    /// At least `bytes` bytes, 64-byte aligned; page-locked (cudaHostAlloc) when `pinned` and CUDA is available, else
    /// pageable. Invalidates what an earlier call returned when it must grow.
    void* Reserve(std::int64_t bytes, bool pinned);

private:
    void Free() noexcept;
    void* data_ = nullptr;
    std::int64_t bytes_ = 0;
    bool pinned_ = false;
};

} // namespace shardline::ckpt::detail
