#pragma once

// Times one body of work on a stream between two CUDA events (the GPU time of what it enqueues, synchronising on the
// stop event). Header-only; needs the CUDA runtime.

#include <cuda_runtime_api.h>

#include <shardline/core/error.h>

namespace shardline::bench {

class EventTimer {
public:
    explicit EventTimer(cudaStream_t stream) : stream_(stream) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&start_));
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&stop_));
    }
    ~EventTimer() {
        cudaEventDestroy(start_);
        cudaEventDestroy(stop_);
    }
    EventTimer(const EventTimer &) = delete;
    EventTimer &operator=(const EventTimer &) = delete;

    /// Microseconds between events recorded before and after body() enqueues its work.
    template <class F> double Microseconds(F &&body) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(start_, stream_));
        body();
        SHARDLINE_CHECK_CUDA(cudaEventRecord(stop_, stream_));
        SHARDLINE_CHECK_CUDA(cudaEventSynchronize(stop_));
        float ms = 0.0f;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
        return static_cast<double>(ms) * 1000.0;
    }

private:
    cudaStream_t stream_;
    cudaEvent_t start_ = nullptr;
    cudaEvent_t stop_ = nullptr;
};

} // namespace shardline::bench
