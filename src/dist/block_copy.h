#pragma once

// Device-agnostic copies of blocks along one tensor dim, the packing and unpacking that turn the flat-buffer
// collectives of comm/ into moves along a tensor dim. CPU: memcpy loops; CUDA: cudaMemcpy2DAsync on the device's
// compute stream (so they are ordered with the kernels and with the communicators' events).

#include <cstdint>

#include <shardline/core/tensor.h>

namespace shardline::dist::detail {

/// dst[..., dst_start + i, ...] = src[..., src_start + i, ...] for i < length along `dim`. src and dst are contiguous,
/// same rank, dtype and device, and agree on every dim but `dim`.
void CopyDimBlock(const Tensor &src, int dim, std::int64_t src_start, Tensor &dst, std::int64_t dst_start,
                  std::int64_t length);

/// A contiguous copy of src[..., start:start+length, ...] along `dim`.
Tensor NarrowCopy(const Tensor &src, int dim, std::int64_t start, std::int64_t length);

/// Product of shape[0:dim]: when it is 1, blocks along `dim` are contiguous ranges of the flat buffer.
std::int64_t OuterSize(const Shape &shape, int dim);

} // namespace shardline::dist::detail
