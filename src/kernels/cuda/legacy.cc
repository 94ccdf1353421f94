// The "legacy" provider (seed 002's rollback path): cublasGemmStridedBatchedEx for the product, then every epilogue
// as a separate kernel, and a plain column-sum kernel for bias grads. It registers only Gemm and LinearBackwardBias:
// the Linear/Matmul/Outer compositions call Gemm and so inherit it.

#include <shardline/core/context.h>
#include <shardline/core/tensor.h>

#include "cuda_ops.h"
#include "gemm_common.h"

namespace shardline::kernels::cuda {

void LegacyCudaGemm(const GemmParams &p) {
    CheckCudaGemm(p, GemmOp::kName);
    CudaContext &ctx = CudaContext::Get(p.device.index);
    if (p.m == 0 || p.n == 0 || p.k == 0) {
        RunDegenerateGemm(p, ctx, ReduceImpl::kPlain);
        return;
    }
    // D = alpha·op(A)·op(B) + beta·C as given (column-major, strided-batched; the caller derived the operands),
    // then the epilogue on D.
    CublasGemmPlain(p, ctx);
    RunUnfusedEpilogue(p, ctx, ReduceImpl::kPlain);
}

void LegacyLinearBackwardBias(const LinearBackwardBiasArgs &args) {
    BiasGradColumnSum(args, ReduceImpl::kPlain); // seed 002's scalar column sum
}

} // namespace shardline::kernels::cuda
