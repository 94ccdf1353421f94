#pragma once
// A CUDA graph captured from a body of work on a stream and instantiated, for the tests that replay a training step
// (tests/cuda/kernels_linear_graph_test.cc, tests/dist/nn_cuda_graph_test.cc). CUDA builds only.

#include <cstddef>
#include <functional>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace shardline::testing {

class CapturedGraph {
public:
    /// Captures `body` on `stream` (thread-local mode: other threads may still call CUDA); a throw from body ends
    /// the capture and propagates.
    CapturedGraph(cudaStream_t stream, const std::function<void()>& body) : stream_(stream) {
        EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        try {
            body();
        } catch (...) {
            cudaGraph_t broken = nullptr;
            (void)cudaStreamEndCapture(stream_, &broken);
            if (broken != nullptr) {
                cudaGraphDestroy(broken);
            }
            throw;
        }
        EXPECT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
        EXPECT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
    }
    ~CapturedGraph() {
        if (exec_ != nullptr) {
            cudaGraphExecDestroy(exec_);
        }
        if (graph_ != nullptr) {
            cudaGraphDestroy(graph_);
        }
    }
    CapturedGraph(const CapturedGraph&) = delete;
    CapturedGraph& operator=(const CapturedGraph&) = delete;

    /// Launches the graph on the capture stream and waits for it.
    void Replay() {
        ASSERT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    }
    /// The graph's nodes (kernels, memsets, memory nodes, joins).
    std::size_t nodes() const {
        std::size_t n = 0;
        EXPECT_EQ(cudaGraphGetNodes(graph_, nullptr, &n), cudaSuccess);
        return n;
    }

private:
    cudaStream_t stream_ = nullptr;
    cudaGraph_t graph_ = nullptr;
    cudaGraphExec_t exec_ = nullptr;
};

} // namespace shardline::testing
