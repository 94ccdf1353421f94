// Registration of the CUDA kernels with the typed dispatcher (called once by EnsureBuiltinKernels).

#include "kernels/register.h"

#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>
#include <shardline/kernels/optim.h>

#include "cuda_ops.h"
#include "kernels/linear_gemm.h"

namespace shardline::kernels::detail {

void RegisterCudaKernels() {
    constexpr DeviceType kCuda = DeviceType::kCUDA;
    // default: cuBLASLt Gemm with fused epilogues; vectorised bias grad; elementwise ops and reductions.
    Register<GemmOp>(kCuda, kDefaultProvider, &cuda::DefaultCudaGemm);
    Register<LinearBackwardBiasOp>(kCuda, kDefaultProvider, &cuda::DefaultLinearBackwardBias);
    Register<GeluForwardOp>(kCuda, kDefaultProvider, &cuda::CudaGeluForward);
    Register<GeluBackwardOp>(kCuda, kDefaultProvider, &cuda::CudaGeluBackward);
    Register<AddOp>(kCuda, kDefaultProvider, &cuda::CudaAdd);
    Register<ScaleOp>(kCuda, kDefaultProvider, &cuda::CudaScale);
    Register<SumOp>(kCuda, kDefaultProvider, &cuda::CudaSum);
    Register<LinearBackwardOp>(kCuda, kDefaultProvider, &cuda::CudaLinearBackward);
    Register<BiasAddOp>(kCuda, kDefaultProvider, &cuda::CudaBiasAdd);
    // default: embedding (deterministic sorted backward), cross-entropy stages, optimizer steps.
    Register<EmbeddingForwardOp>(kCuda, kDefaultProvider, &cuda::CudaEmbeddingForward);
    Register<EmbeddingBackwardOp>(kCuda, kDefaultProvider, &cuda::CudaEmbeddingBackward);
    Register<EmbeddingBagForwardOp>(kCuda, kDefaultProvider, &cuda::CudaEmbeddingBagForward);
    Register<EmbeddingBagBackwardOp>(kCuda, kDefaultProvider, &cuda::CudaEmbeddingBagBackward);
    Register<CrossEntropyRowMaxOp>(kCuda, kDefaultProvider, &cuda::CudaCrossEntropyRowMax);
    Register<CrossEntropyStatsOp>(kCuda, kDefaultProvider, &cuda::CudaCrossEntropyStats);
    Register<CrossEntropyLossOp>(kCuda, kDefaultProvider, &cuda::CudaCrossEntropyLoss);
    Register<CrossEntropyBackwardOp>(kCuda, kDefaultProvider, &cuda::CudaCrossEntropyBackward);
    Register<SgdStepOp>(kCuda, kDefaultProvider, &cuda::CudaSgdStep);
    Register<AdamWStepOp>(kCuda, kDefaultProvider, &cuda::CudaAdamWStep);
    Register<SgdStepMultiOp>(kCuda, kDefaultProvider, &cuda::CudaSgdStepMulti);
    Register<AdamWStepMultiOp>(kCuda, kDefaultProvider, &cuda::CudaAdamWStepMulti);
    // legacy: cublasGemmStridedBatchedEx + separate epilogue kernels; plain bias-grad kernel. Linear, Matmul and
    // Outer reach it through their compositions over Gemm.
    Register<GemmOp>(kCuda, kLegacyProvider, &cuda::LegacyCudaGemm);
    Register<LinearBackwardBiasOp>(kCuda, kLegacyProvider, &cuda::LegacyLinearBackwardBias);
    // The split ops one after another, each through the legacy provider (no side stream, no BGRADB).
    Register<LinearBackwardOp>(kCuda, kLegacyProvider, &CompositeLinearBackward);
    cuda::RegisterCudaGroupedKernels();
    cuda::RegisterCudaMoEKernels();
}

} // namespace shardline::kernels::detail
