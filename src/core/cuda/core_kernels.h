#pragma once

// Launchers for core's device kernels (core_kernels.cu). Plain declarations: host code includes this without
// nvcc. Each launcher enqueues on `stream` and returns the launch status (cudaGetLastError), which the caller
// checks with SHARDLINE_CHECK_CUDA.

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

#include "../cuda_backend.h"

namespace shardline::detail::cuda {

/// data[i] = dtype(float(RandomValueAt(args, GlobalIndexOf(args, i)))) for i < numel.
cudaError_t LaunchFillRandom(void *data, DType dtype, std::int64_t numel, const RandomKernelArgs &args,
                             cudaStream_t stream);
/// data[i] = dtype(float(value)) (float64: value itself).
cudaError_t LaunchFillValue(void *data, DType dtype, std::int64_t numel, double value, cudaStream_t stream);
/// dst[i] = dst_dtype(src[i]) through float (float64 ↔ float32 directly; int64 through double, truncated toward zero
/// and saturating when the destination is int64).
cudaError_t LaunchCast(const void *src, DType src_dtype, void *dst, DType dst_dtype, std::int64_t numel,
                       cudaStream_t stream);
/// Row-major contiguous dst from the strided view desc of src; element_size is 1, 2, 4 or 8 bytes.
cudaError_t LaunchStridedCopy(const void *src, void *dst, std::size_t element_size, const StridedCopyDesc &desc,
                              cudaStream_t stream);

} // namespace shardline::detail::cuda
