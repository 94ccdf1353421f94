// The default provider's Gemm: cuBLASLt with fused epilogues, one cached plan per problem key.
//
// A plan (matmul descriptor, the three layouts and the chosen algorithm) is built on the first call with a given key
// and reused: a repeated call makes no heuristic query and creates no descriptor; it re-points the descriptor at this
// call's bias/aux vectors when they moved, and launches.
//
// The entry points are here; the plans (descriptors, cache, algorithm choice) are in gemm_lt_plan.cc and the timing in
// gemm_lt_tuning.cc, with what they share in gemm_lt_plan.h.
//
// Choosing the algorithm (see include/shardline/kernels/gemm_tuning.h; the key is in src/kernels/gemm_tuning.h): a
// record of the tuning-cache file wins (no heuristic query, no timing); else the heuristic's top-k candidates are
// timed once on the call's own operands and the fastest is kept (tuning on, the default), or its first pick is taken
// (tuning off). A measured epilogue (GELU_AUX, BGRADB, DGELU, DGELU_BGRAD) is also timed against the same work run
// apart (e.g. the plain GEMM followed by the separate column sum), and kept fused only where that measures faster.
//
// A matrix-vector product (a Linear forward of one token) may run CUTLASS's GEMV instead (cutlass/gemv_cutlass.h),
// where tuning measured it faster or SHARDLINE_GEMM_GEMV=always says so (GemmGemv in gemm_tuning.h).
//
// A rank-1 product (k = 1: the wgrad GEMM of one token, the Outer op) runs as one plain kernel launch and builds no
// plan (rank_one_kernels.h), with BGRADB's bias grad in the same launch: cuBLASLt's call costs the host more than a
// launch, and its k = 1 kernels took more GPU time than this one (docs/PERFORMANCE.md, "Host cost, round 6").
//
// When cuBLASLt offers no algorithm for a fused epilogue (or the problem is outside what the epilogues support, see
// FusedIneligibleReason), the plan says so, one warning is logged for that key, and every call runs the plain GEMM
// followed by the separate epilogue kernels.

#include <atomic>
#include <memory>
#include <mutex>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/gemm.h>

#include "cuda_ops.h"
#include "gemm_common.h"
#include "gemm_lt_plan.h"
#include "kernels/gemm_tuning_internal.h"
#include "rank_one_kernels.h"

namespace shardline::kernels::cuda::lt {
namespace {

bool IsCudaFloat(DType dtype) {
    return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

/// Whether p runs as the rank-1 kernel: k = 1, one matrix, D written over C, no epilogue or BGRADB (whose bias grad
/// at k = 1 is op(B) itself), A and B of one float dtype. Any other k = 1 problem (a bias or GELU epilogue, a batch, a
/// separate C) goes to cuBLASLt.
bool RunsAsRankOne(const GemmParams &p) {
    return p.k == 1 && p.batch_count == 1 && !GemmHasSeparateC(p) &&
           (p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kBGradB) && p.a_type == p.b_type &&
           IsCudaFloat(p.a_type) && IsCudaFloat(p.c_type) &&
           (p.epilogue == GemmEpilogue::kNone || IsCudaFloat(p.bias_type));
}

/// D = alpha·op(A)·op(B) + beta·D for k = 1. op(A) is m×1: A stored m×1 (element i at a[i]) or, transposed, 1×m
/// (a[i·lda]). op(B) is 1×n: B stored 1×n (b[j·ldb]) or, transposed, n×1 (b[j]).
void RunRankOne(const GemmParams &p, CudaContext &ctx) {
    const bool bgrad = p.epilogue == GemmEpilogue::kBGradB;
    SHARDLINE_CHECK_CUDA(LaunchRankOne(RankOneArgs{.a = p.a,
                                                   .inc_a = p.trans_a ? p.lda : 1,
                                                   .b = p.b,
                                                   .inc_b = p.trans_b ? 1 : p.ldb,
                                                   .ab_type = p.a_type,
                                                   .d = p.c,
                                                   .ldd = p.ldc,
                                                   .d_type = p.c_type,
                                                   .m = p.m,
                                                   .n = p.n,
                                                   .alpha = static_cast<float>(p.alpha),
                                                   .beta = static_cast<float>(p.beta),
                                                   .bias = bgrad ? p.bias : nullptr,
                                                   .bias_type = p.bias_type},
                                       ctx.stream()));
    detail::GemmCounters().rank_one.fetch_add(1, std::memory_order_relaxed);
}

/// Points the descriptor at this call's bias/aux vectors (under plan.mutex). Parameters keep their addresses across
/// steps, so the common case sets nothing.
void PointAt(LtPlan &plan, const GemmParams &p) {
    if (plan.set_bias && plan.bias_ptr != p.bias) {
        SetDesc(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
        plan.bias_ptr = p.bias;
    }
    if (plan.set_aux && plan.aux_ptr != p.aux) {
        SetDesc(plan.desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux);
        plan.aux_ptr = p.aux;
    }
}

/// Under plan.mutex: points the descriptor at p's vectors and tunes a plan that was built during a capture, once the
/// stream is no longer captured.
void Prepare(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    PointAt(plan, p);
    if (plan.needs_tuning && !StreamCapturing(ctx.stream())) [[unlikely]] {
        TuneNow(plan, p, ctx);
    }
}

/// Runs a usable plan: its algorithm, CUTLASS's GEMV where the plan chose it (a matrix-vector product), or for a
/// measured epilogue that ran faster apart, the apart GEMM's plan followed by RunApartEpilogue.
void Execute(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    std::unique_lock lock(plan.mutex);
    Prepare(plan, p, ctx);
    if (plan.gemv) {
        lock.unlock();
        SHARDLINE_CHECK_CUDA(RunGemv(p, ctx.stream()));
        return;
    }
    if (!plan.epilogue_separate) {
        SHARDLINE_CHECK_CUBLAS(Launch(plan, plan.algo, p, p.c, ctx, ctx.stream()));
        return;
    }
    const std::shared_ptr<LtPlan> apart = plan.apart;
    lock.unlock();
    const GemmParams apart_params = ApartGemmParams(p);
    if (apart != nullptr) {
        RunWithPlan(*apart, apart_params, ctx);
    } else {
        RunWithPlan(*GetPlan(apart_params, ctx), apart_params, ctx);
    }
    RunApartEpilogue(p, ctx, ReduceImpl::kVectorized);
}

} // namespace

/// The product without epilogue: cuBLASLt, or cuBLAS when cuBLASLt has nothing for the shape.
void RunPlain(const GemmParams &p, CudaContext &ctx) {
    const GemmParams plain = PlainParams(p);
    const std::shared_ptr<LtPlan> plan = GetPlan(plain, ctx);
    if (plan->usable) {
        Execute(*plan, plain, ctx);
    } else {
        CublasGemmPlain(plain, ctx);
    }
}

void RunWithPlan(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    if (plan.usable) {
        Execute(plan, p, ctx);
        return;
    }
    if (p.epilogue == GemmEpilogue::kNone) {
        CublasGemmPlain(p, ctx);
        return;
    }
    RunPlain(p, ctx);
    RunUnfusedEpilogue(p, ctx, ReduceImpl::kVectorized);
}

namespace {

void CublasLtGemm(const GemmParams &p) {
    CheckCudaGemm(p, kOp);
    CudaContext &ctx = CudaContext::Get(p.device.index);
    if (p.m == 0 || p.n == 0 || p.k == 0) {
        RunDegenerateGemm(p, ctx, ReduceImpl::kVectorized);
        return;
    }
    if (RunsAsRankOne(p)) {
        RunRankOne(p, ctx);
        return;
    }
    if (p.epilogue == GemmEpilogue::kNone) {
        RunPlain(p, ctx);
        return;
    }
    RunWithPlan(*GetPlan(p, ctx), p, ctx);
}

} // namespace
} // namespace shardline::kernels::cuda::lt

namespace shardline::kernels::cuda {

void DefaultCudaGemm(const GemmParams &params) { lt::CublasLtGemm(params); }

bool EpilogueRunsFused(const GemmParams &params) {
    CheckCudaGemm(params, lt::kOp);
    if (params.m == 0 || params.n == 0 || params.k == 0) {
        return false;
    }
    if (lt::RunsAsRankOne(params)) {
        return params.epilogue == GemmEpilogue::kBGradB; // in the rank-1 kernel's launch
    }
    if (!lt::MeasuresEpilogue(params)) {
        return false;
    }
    CudaContext &ctx = CudaContext::Get(params.device.index);
    const std::shared_ptr<lt::LtPlan> plan = lt::GetPlan(params, ctx);
    if (!plan->usable) {
        return false;
    }
    std::lock_guard lock(plan->mutex);
    lt::Prepare(*plan, params, ctx);
    return !plan->epilogue_separate;
}

} // namespace shardline::kernels::cuda
