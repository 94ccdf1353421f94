#pragma once

// GEMM epilogues as separate kernels (the legacy provider, and the default provider's unfused fallback) and the
// column/row reductions behind bias gradients and Sum. Declarations only: host code includes this without nvcc.
// Every launcher enqueues on `stream` and returns the launch status for SHARDLINE_CHECK_CUDA. Dtypes are float32,
// float16, bfloat16; math and accumulation are fp32.
//
// Matrices of the GEMM epilogues are column-major m×n with leading dimension ld: element (i, j) at d[i + j·ld].
// Reductions take a row-major rows×cols view with leading dimension ld: element (r, c) at x[r·ld + c].

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// d = beta·d; beta == 0 writes zeros without reading d (which may hold NaN garbage, as in BLAS).
cudaError_t LaunchScaleMatrix(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, float beta,
                              cudaStream_t stream);
/// d(i, j) += bias[i].
cudaError_t LaunchBiasAdd(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *bias,
                          DType bias_dtype, cudaStream_t stream);
/// v = d(i, j) + bias[i] (bias may be null); aux(i, j) = v; d(i, j) = gelu_tanh(v). aux has d's dtype.
cudaError_t LaunchBiasGeluAux(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *bias,
                              DType bias_dtype, void *aux, std::int64_t ldaux, cudaStream_t stream);
/// d(i, j) = gelu_tanh(aux(i, j)): the activation of a pre-activation that a bias GEMM wrote into aux. aux has d's
/// dtype.
cudaError_t LaunchGeluFromAux(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *aux,
                              std::int64_t ldaux, cudaStream_t stream);
/// d(i, j) *= gelu_tanh'(aux(i, j)). aux has d's dtype.
cudaError_t LaunchDGelu(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *aux,
                        std::int64_t ldaux, cudaStream_t stream);

/// How the vectorised column sum splits its work; computed on the host so that the caller can allocate the
/// fp32 partials (partial_elems floats; 0 when one pass suffices).
struct ColumnSumPlan {
    int vec = 1;             ///< elements per 16-byte load (1: scalar loads)
    std::int64_t splits = 1; ///< row chunks reduced by separate blocks, then summed in order
    std::int64_t rows_per_split = 0;
    std::int64_t partial_elems = 0;
};
/// Vector loads (when `vectorize`) need a 16-byte aligned x, and cols and ld multiples of the vector width;
/// otherwise scalar loads.
ColumnSumPlan PlanColumnSum(const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                            int multiprocessors, bool vectorize);
/// out[c] (+)= Σ_r x(r, c), deterministic: fixed row chunks, fixed in-block order, chunks summed in order.
cudaError_t LaunchColumnSum(const ColumnSumPlan &plan, const void *x, DType dtype, std::int64_t rows, std::int64_t cols,
                            std::int64_t ld, void *out, DType out_dtype, bool accumulate, float *partials,
                            cudaStream_t stream);
/// out[r] (+)= Σ_c x(r, c), one block per row, fixed-order tree reduction.
cudaError_t LaunchRowSum(const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld, void *out,
                         DType out_dtype, bool accumulate, cudaStream_t stream);

} // namespace shardline::kernels::cuda
