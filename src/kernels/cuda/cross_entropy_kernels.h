#pragma once

// Launchers for the cross-entropy stages (cross_entropy_kernels.cu). Declarations only: host code includes this
// without nvcc. logits are a row-major n×c matrix of float32/float16/bfloat16 with n, c > 0; statistics, dloss and
// loss are float32; labels are int64. Each launcher returns the launch status for SHARDLINE_CHECK_CUDA.

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// row_max[i] = max_c logits[i, c] (a NaN makes the row NaN).
cudaError_t LaunchCrossEntropyRowMax(const void *logits, DType dtype, std::int64_t n, std::int64_t c, float *row_max,
                                     cudaStream_t stream);
/// sum_exp[i] = Σ_c exp(logits[i, c] - row_max[i]); target[i] = logits[i, labels[i] - class_start] or 0.
cudaError_t LaunchCrossEntropyStats(const void *logits, DType dtype, std::int64_t n, std::int64_t c,
                                    const float *row_max, const std::int64_t *labels, std::int64_t class_start,
                                    float *sum_exp, float *target, cudaStream_t stream);
/// loss[i] = log(sum_exp[i]) + row_max[i] - target[i] (loss may alias any input).
cudaError_t LaunchCrossEntropyLoss(const float *row_max, const float *sum_exp, const float *target, float *loss,
                                   std::int64_t n, cudaStream_t stream);
/// dlogits[i, c] = scale·dloss[i or 0]·(exp(logits[i, c] - row_max[i]) / sum_exp[i] - [c == labels[i] - class_start])
/// (dlogits may alias logits).
cudaError_t LaunchCrossEntropyBackward(const void *logits, DType dtype, std::int64_t n, std::int64_t c,
                                       const float *row_max, const float *sum_exp, const std::int64_t *labels,
                                       std::int64_t class_start, const float *dloss, bool dloss_broadcast, float scale,
                                       void *dlogits, cudaStream_t stream);

} // namespace shardline::kernels::cuda
