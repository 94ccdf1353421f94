#pragma once

// A device's side stream, which kernels fork from the compute stream for work that may run beside it (LinearBackward's
// column sums, GroupedLinearBackward's wgrad) and join back before they return, so the caller sees one stream and a
// CUDA graph capture of the compute stream takes the side branch in.

#include <mutex>

#include <cuda_runtime_api.h>

namespace shardline::kernels::cuda {

/// The side stream (highest priority, so work on it is scheduled as soon as SMs free up) and the two events that fork
/// it from and join it to the compute stream. Created on first use, never destroyed. Memory the side work uses must be
/// allocated before the fork and released after the join (stream-ordered frees go to the compute stream), or be the
/// side stream's own (ReduceScratch keyed by the stream).
struct SideStream {
    std::mutex mutex; ///< one fork/join at a time per device: the events are reused
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;
};

/// Device `device`'s side stream.
SideStream &SideStreamOf(int device);

/// Makes the side stream wait for everything queued on `main` so far (hold side.mutex from the fork to the join).
void ForkSideStream(SideStream &side, cudaStream_t main);
/// Makes `main` wait for everything queued on the side stream so far. `on_error`: the join of an error path, which
/// never throws (a capture must not be left with an unjoined branch, and the side writes must precede reuse).
void JoinSideStream(SideStream &side, cudaStream_t main, bool on_error = false);

} // namespace shardline::kernels::cuda
