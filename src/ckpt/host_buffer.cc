#include "host_buffer.h"

#include <cstdlib>

#include <shardline/config.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardline::ckpt::detail {

HostBuffer::~HostBuffer() { Free(); }

void HostBuffer::Free() noexcept {
    if (data_ == nullptr) {
        return;
    }
#if SHARDLINE_HAVE_CUDA
    if (pinned_) {
        cudaFreeHost(data_);
        data_ = nullptr;
        return;
    }
#endif
    std::free(data_);
    data_ = nullptr;
}

void* HostBuffer::Reserve(std::int64_t bytes, bool pinned) {
    if (bytes <= bytes_ && (pinned_ || !pinned)) {
        return data_;
    }
    Free();
    bytes_ = 0;
    pinned_ = false;
    if (bytes == 0) {
        return nullptr;
    }
#if SHARDLINE_HAVE_CUDA
    if (pinned) {
        if (cudaHostAlloc(&data_, static_cast<std::size_t>(bytes), cudaHostAllocDefault) == cudaSuccess) {
            bytes_ = bytes;
            pinned_ = true;
            return data_;
        }
        cudaGetLastError(); // clear it: pageable memory serves, only slower
        data_ = nullptr;
        SHARDLINE_LOG_WARN("ckpt: cudaHostAlloc of {} bytes failed; the snapshot uses pageable memory", bytes);
    }
#endif
    const std::size_t rounded = (static_cast<std::size_t>(bytes) + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    SHARDLINE_CHECK(data_ != nullptr, "ckpt::Save", "could not allocate {} bytes of host memory for the snapshot",
                    bytes);
    bytes_ = bytes;
    return data_;
}

} // namespace shardline::ckpt::detail
