#pragma once

// Host-side pieces shared by the two CUDA Gemm providers (cuBLASLt "default", cuBLAS "legacy"): type mapping,
// CUDA-specific checks, degenerate sizes, the separate epilogue kernels, and the column/row reductions with their
// scratch buffers.

#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/dtype.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

#include "core/cuda/cublas_check.h"

namespace shardline::kernels::cuda {

/// Which column-sum kernel a provider uses: both are the deterministic row-split two-pass sum; the default
/// provider's loads 16-byte vectors where the layout allows, the legacy provider's (seed 002's plain kernel) loads
/// scalars.
enum class ReduceImpl : std::uint8_t { kVectorized, kPlain };

/// CUDA_R_32F / CUDA_R_16F / CUDA_R_16BF; throws DTypeError for float64.
cudaDataType_t CudaDataType(DType dtype, std::string_view op);
/// CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 for float32 operands when the context allows TF32.
cublasComputeType_t GemmComputeType(const GemmParams &p, const CudaContext &ctx);
/// What ValidateGemmParams leaves to the device: CUDA dtypes only (no float64), a CUDA device, a C stride when
/// batched (a broadcast output would race).
void CheckCudaGemm(const GemmParams &p, std::string_view op);

/// A separate C (GemmHasSeparateC) copied into D on ctx's stream, and p as the in-place problem it then is (c_in
/// cleared): the path of a provider or fallback whose BLAS call writes D over C (cublasGemmEx). p itself when C is D.
GemmParams InPlaceC(const GemmParams &p, CudaContext &ctx);

/// The GEMM of a fused epilogue run apart (what the tuning times against the fused epilogue, gemm_tuning.h), which
/// RunApartEpilogue then completes: kGeluAuxBias: the bias GEMM into aux; kDGeluBGrad: the kDGelu GEMM; kBGradB and
/// kDGelu: the plain product. Unbatched problems only (as every fused epilogue).
GemmParams ApartGemmParams(const GemmParams &p);
/// The kernels after ApartGemmParams(p)'s GEMM: GELU of aux into D; the column sum of D into the bias grad; BGRADB's
/// sum of op(B); kDGelu's GELU grad.
void RunApartEpilogue(const GemmParams &p, CudaContext &ctx, ReduceImpl impl);

/// m, n or k is 0: no BLAS call. D = beta·C (nothing when m or n is 0), then the epilogue with separate kernels
/// (a bias grad over an empty reduction is zero).
void RunDegenerateGemm(const GemmParams &p, CudaContext &ctx, ReduceImpl impl);
/// The epilogue of p as separate kernels on D = alpha·op(A)·op(B) + beta·C already computed in p.c. Batched:
/// the same bias for every batch entry, aux entries packed (ldaux·n elements apart), bias grads summed over the
/// batch.
void RunUnfusedEpilogue(const GemmParams &p, CudaContext &ctx, ReduceImpl impl);

/// out[c] (+)= Σ_r x[r·ld + c] over a row-major rows×cols view (fp32 accumulation, deterministic).
void ColumnSum(CudaContext &ctx, const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
               void *out, DType out_dtype, bool accumulate, ReduceImpl impl);
/// dbias[j] (+)= Σ_rows dy[row, j], dy [..., out] read as a row-major rows×out matrix: LinearBackwardBias of both
/// providers, which differ only in `impl`.
void BiasGradColumnSum(const LinearBackwardBiasArgs &args, ReduceImpl impl);
/// ColumnSum on a given stream (e.g. a side stream overlapping a GEMM that reads the same x).
void ColumnSumOn(CudaContext &ctx, cudaStream_t stream, const void *x, DType dtype, std::int64_t rows,
                 std::int64_t cols, std::int64_t ld, void *out, DType out_dtype, bool accumulate, ReduceImpl impl);
/// A float scratch buffer of at least `floats` elements reserved for reductions on `stream` of ctx's device, kept
/// across calls; nullptr when it would have to grow while the stream is being captured into a CUDA graph.
float *ReduceScratch(CudaContext &ctx, cudaStream_t stream, std::size_t floats);
/// out[r] (+)= Σ_c x[r·ld + c].
void RowSum(CudaContext &ctx, const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
            void *out, DType out_dtype, bool accumulate);

/// The plain GEMM through cublasGemmStridedBatchedEx (epilogue ignored): the legacy provider's product, and the
/// default provider's last resort when cuBLASLt offers no algorithm even without an epilogue.
void CublasGemmPlain(const GemmParams &p, CudaContext &ctx);

} // namespace shardline::kernels::cuda
