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
    // dy [..., out] is a row-major rows×out matrix; db[j] (+)= Σ_rows dy[row, j].
    const std::int64_t cols = args.dbias.numel();
    const std::int64_t rows = cols == 0 ? 0 : args.dy.numel() / cols;
    CudaContext &ctx = CudaContext::Get(args.dy.device().index);
    ColumnSum(ctx, args.dy.data(), args.dy.dtype(), rows, cols, cols, args.dbias.data(), args.dbias.dtype(),
              args.accumulate, ReduceImpl::kPlain);
}

} // namespace shardline::kernels::cuda
