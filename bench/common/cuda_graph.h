#pragma once

// A CUDA graph captured from a body of work on a stream (thread-local capture mode) and instantiated, for the benches
// that time a replayed step (bench/linear, bench/moe). Header-only; needs the CUDA runtime. A throw from the body
// ends the capture (the stream stays usable for the error's report) and propagates.

#include <functional>
#include <utility>

#include <cuda_runtime_api.h>

#include <shardline/core/error.h>

namespace shardline::bench {

class CudaGraph {
public:
    CudaGraph() = default;
    /// Captures body() on `stream`. Plans and tunings the body needs must exist already (an eager run first).
    CudaGraph(cudaStream_t stream, const std::function<void()> &body) : stream_(stream) {
        cudaGraph_t graph = nullptr;
        SHARDLINE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        try {
            body();
        } catch (...) {
            (void)cudaStreamEndCapture(stream, &graph);
            if (graph != nullptr) {
                cudaGraphDestroy(graph);
            }
            throw;
        }
        SHARDLINE_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
        const cudaError_t status = cudaGraphInstantiate(&exec_, graph, 0);
        cudaGraphDestroy(graph);
        SHARDLINE_CHECK_CUDA(status);
    }
    ~CudaGraph() {
        if (exec_ != nullptr) {
            cudaGraphExecDestroy(exec_);
        }
    }
    CudaGraph(CudaGraph &&other) noexcept : stream_(other.stream_), exec_(std::exchange(other.exec_, nullptr)) {}
    CudaGraph &operator=(CudaGraph &&other) noexcept {
        std::swap(stream_, other.stream_);
        std::swap(exec_, other.exec_);
        return *this;
    }
    CudaGraph(const CudaGraph &) = delete;
    CudaGraph &operator=(const CudaGraph &) = delete;

    explicit operator bool() const { return exec_ != nullptr; }
    /// Enqueues one replay on the capture stream (no wait).
    void Launch() const { SHARDLINE_CHECK_CUDA(cudaGraphLaunch(exec_, stream_)); }

private:
    cudaStream_t stream_ = nullptr;
    cudaGraphExec_t exec_ = nullptr;
};

} // namespace shardline::bench
