#pragma once

// The CUDA kernels registered by register.cc, one function per (op, provider).

#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/grouped_linear.h>
#include <shardline/kernels/linear.h>
#include <shardline/kernels/optim.h>

namespace shardline::kernels::cuda {

// provider "default"
void DefaultCudaGemm(const GemmParams &params);                     // gemm_cublaslt.cc
void DefaultLinearBackwardBias(const LinearBackwardBiasArgs &args); // ops.cc
void CudaGeluForward(const GeluForwardArgs &args);
void CudaGeluBackward(const GeluBackwardArgs &args);
void CudaAdd(const AddArgs &args);
void CudaScale(const ScaleArgs &args);
void CudaSum(const SumArgs &args);
void CudaBiasAdd(const BiasAddArgs &args);
// training_ops.cc
void CudaEmbeddingForward(const EmbeddingForwardArgs &args);
void CudaEmbeddingBackward(const EmbeddingBackwardArgs &args);
void CudaEmbeddingBagForward(const EmbeddingBagForwardArgs &args);
void CudaEmbeddingBagBackward(const EmbeddingBagBackwardArgs &args);
void CudaCrossEntropyRowMax(const CrossEntropyRowMaxArgs &args);
void CudaCrossEntropyStats(const CrossEntropyStatsArgs &args);
void CudaCrossEntropyLoss(const CrossEntropyLossArgs &args);
void CudaCrossEntropyBackward(const CrossEntropyBackwardArgs &args);
void CudaSgdStep(const SgdStepArgs &args);
void CudaAdamWStep(const AdamWStepArgs &args);
void CudaSgdStepMulti(const SgdStepMultiArgs &args);
void CudaAdamWStepMulti(const AdamWStepMultiArgs &args);

// provider "default", linear_backward.cc: the grads together, a large separate bias grad on a side stream
void CudaLinearBackward(const LinearBackwardArgs &args);
/// Whether the default Gemm runs this problem's measured epilogue (BGRADB, DGELU_BGRAD, ...) fused: tuned per shape
/// (gemm_tuning.h); false for an epilogue that is not measured, or one cuBLASLt cannot fuse (gemm_cublaslt.cc). A
/// rank-1 BGRADB (k = 1) always runs fused, in the rank-1 kernel's launch.
bool EpilogueRunsFused(const GemmParams &params);

// grouped_gemm.cc: GroupedGemm (CUTLASS or the cuBLASLt loop, per shape), the device-size grouped bias grad, and the
// legacy provider's GroupedGemm loop
void RegisterCudaGroupedKernels();
// grouped_linear_backward.cc: GroupedLinearBackward with the wgrad and bias grad on the side stream beside the dgrad
void CudaGroupedLinearBackward(const GroupedLinearBackwardArgs &args);
// moe_ops.cc: the mixture-of-experts router, permutation map, gather, combine and the combine's weight grad
void RegisterCudaMoEKernels();

// provider "legacy" (seed 002's rollback path), legacy.cc
void LegacyCudaGemm(const GemmParams &params);
void LegacyLinearBackwardBias(const LinearBackwardBiasArgs &args);

} // namespace shardline::kernels::cuda
