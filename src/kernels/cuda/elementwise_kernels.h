#pragma once

// Launchers for the elementwise ops and the general Sum (elementwise_kernels.cu). Declarations only: host code
// includes this without nvcc. Contiguous tensors, float32/float16/bfloat16, fp32 math; each launcher returns the
// launch status for SHARDLINE_CHECK_CUDA.

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// y = gelu(x): tanh approximation, or the erf form when `erf`.
cudaError_t LaunchGeluForward(const void *x, void *y, DType dtype, std::int64_t n, bool erf, cudaStream_t stream);
/// dx = dy·gelu'(x).
cudaError_t LaunchGeluBackward(const void *dy, const void *x, void *dx, DType dtype, std::int64_t n, bool erf,
                               cudaStream_t stream);
/// out = a + alpha·b (out may alias a or b).
cudaError_t LaunchAdd(const void *a, const void *b, void *out, DType dtype, std::int64_t n, float alpha,
                      cudaStream_t stream);
/// out = alpha·x (out may alias x).
cudaError_t LaunchScale(const void *x, void *out, DType dtype, std::int64_t n, float alpha, cudaStream_t stream);

/// out[r, j] = x[r, j] + bias[j] over a row-major rows×cols x (out may alias x); 16-byte vectors when cols and the
/// pointers allow.
cudaError_t LaunchBiasAddRows(const void *x, const void *bias, void *out, DType dtype, std::int64_t rows,
                              std::int64_t cols, cudaStream_t stream);

/// x viewed [outer, reduce, inner] (row-major): out[o, i] = Σ_r x[o, r, i], one thread per output.
cudaError_t LaunchMiddleSum(const void *x, DType dtype, std::int64_t outer, std::int64_t reduce, std::int64_t inner,
                            void *out, DType out_dtype, cudaStream_t stream);

inline constexpr int kMaxSumRank = 8;
/// Any reduction: the output walks the kept dims (row-major), each output sums over the reduced dims.
struct SumDesc {
    int kept_rank = 0;
    std::int64_t kept_shape[kMaxSumRank] = {};
    std::int64_t kept_stride[kMaxSumRank] = {}; ///< x's strides (elements) of the kept dims
    int reduced_rank = 0;
    std::int64_t reduced_shape[kMaxSumRank] = {};
    std::int64_t reduced_stride[kMaxSumRank] = {};
    std::int64_t out_numel = 0;
    std::int64_t reduced_numel = 0;
};
cudaError_t LaunchGenericSum(const void *x, DType dtype, const SumDesc &desc, void *out, DType out_dtype,
                             cudaStream_t stream);

} // namespace shardline::kernels::cuda
