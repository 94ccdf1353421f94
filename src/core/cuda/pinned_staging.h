#pragma once

// Private to src/core/cuda: pinned host blocks through which host-to-device copies from pageable memory go.

#include <cstddef>

#include <cuda_runtime_api.h>

namespace shardline::detail {

/// Copies `bytes` from pageable host memory `src` to device memory `dst` on `stream` without waiting for the work
/// already queued there: the bytes are copied into a pinned block first (a cudaMemcpyAsync straight from pageable
/// memory waits for the stream's earlier work once the copy outgrows the driver's own staging, so a training loop
/// that uploads its next batch would idle the GPU at every step). `src` may be reused as soon as this returns.
/// Returns false, having done nothing, when the copy is larger than a block may be or the blocks of `device` are all
/// in flight and at their cap; the caller then copies the plain way.
bool StagedHostToDevice(void *dst, const void *src, std::size_t bytes, int device, cudaStream_t stream);

} // namespace shardline::detail
