#pragma once

// The grouped ops' small kernels that read the group sizes on the device (no host synchronisation, capturable): the
// per-expert bias add and the per-expert bias grad. Declarations only: host code includes this without nvcc. Rows of
// group e are [offset_e, offset_e + sizes[e]) of a row-major rows×cols matrix, offset_e = Σ_{i<e} sizes[i]; a negative
// size reads as 0 and rows past `rows` belong to no group. Math and accumulation in fp32.

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// y(r, j) += bias[e(r)·bias_group_stride + j] for every row r of a group (y row-major, leading dimension ld).
cudaError_t LaunchGroupedBiasAdd(void *y, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                 const void *bias, DType bias_dtype, std::int64_t bias_group_stride,
                                 const std::int64_t *sizes, int groups, cudaStream_t stream);

/// dbias[e, j] (+)= Σ_{rows r of group e} dy(r, j), deterministic (one thread per (e, j), rows in order); a group with
/// no rows gets 0 (or keeps its value when accumulating).
cudaError_t LaunchGroupedColumnSum(const void *dy, DType dtype, std::int64_t rows, std::int64_t cols,
                                   const std::int64_t *sizes, int groups, void *dbias, DType out_dtype, bool accumulate,
                                   cudaStream_t stream);

} // namespace shardline::kernels::cuda
