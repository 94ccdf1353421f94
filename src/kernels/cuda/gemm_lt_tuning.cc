// Tuning the cuBLASLt provider's plans: the heuristic's candidates timed on the call's own operands (the fastest is
// kept), for the measured epilogues (GELU_AUX, BGRADB, DGELU, DGELU_BGRAD) the fused epilogue timed against the same
// work run apart (e.g. the plain GEMM + a separate column sum), and for matrix-vector products CUTLASS's GEMV against
// the kept algorithm.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/gemm_tuning.h>

#include "candidate_timer.h"
#include "gemm_common.h"
#include "gemm_lt_plan.h"
#include "kernels/gemm_tuning_internal.h"

namespace shardline::kernels::cuda::lt {
namespace {

// Tuning: a candidate replaces the heuristic's first pick only when it is faster by this fraction on two passes, and
// a measured fused epilogue is kept only when it beats running it apart by it (timing noise of repeated launches on one
// GPU is below 1 %; a tie keeps the apart path, whose GEMM is the simpler kernel and whose bias grads are summed by
// the deterministic column sum).
constexpr double kTuningMargin = 0.01;
/// A buffer twice the L2 size when p's operands (and output) fit in twice the L2 cache, else an empty tensor: see
/// CandidateTimer.
Tensor ColdFlushBuffer(const GemmParams &p, CudaContext &ctx) {
    const std::size_t l2 = Identity(ctx.device()).l2_bytes;
    const auto bytes = [](std::int64_t rows, std::int64_t cols, DType t) {
        return static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(ElementSize(t));
    };
    const double operands = static_cast<double>(p.batch_count) *
                            (bytes(p.m, p.k, p.a_type) + bytes(p.k, p.n, p.b_type) + bytes(p.m, p.n, p.c_type));
    if (l2 == 0 || operands >= 2.0 * static_cast<double>(l2)) {
        return {};
    }
    return Tensor::Empty(Shape{static_cast<std::int64_t>(2 * l2 / sizeof(float))}, DType::kFloat32, p.device);
}

/// Times plan.candidates on p's operands and keeps the fastest in plan.algo (called under plan.mutex, stream not
/// capturing). D goes to p.c when beta == 0 or C is apart from D (the real call overwrites it right after; a separate
/// C is only read) and to a scratch copy of C otherwise (an accumulating GEMM must not add twice).
void TuneCandidates(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const cudaStream_t stream = ctx.stream();
    const std::size_t n_cand = plan.candidates.size();
    Tensor scratch;
    void *d = p.c;
    if (p.beta != 0.0 && plan.c_in == nullptr) {
        const std::int64_t elems = p.stride_c * (p.batch_count - 1) + p.ldc * p.n;
        scratch = Tensor::Empty(Shape{elems}, p.c_type, p.device);
        SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(scratch.data(), p.c, scratch.nbytes(), cudaMemcpyDeviceToDevice, stream));
        d = scratch.data();
    }
    const Tensor flush = ColdFlushBuffer(p, ctx);
    CandidateTimer events(stream, flush.defined() ? flush.data() : nullptr, flush.defined() ? flush.nbytes() : 0);
    std::vector<double> pass1(n_cand, -1.0);
    std::vector<int> reps(n_cand, kMinReps);
    for (std::size_t i = 0; i < n_cand; ++i) {
        const cublasLtMatmulAlgo_t &algo = plan.candidates[i].algo;
        auto launch = [&] { return Launch(plan, algo, p, d, ctx, stream) == CUBLAS_STATUS_SUCCESS; };
        const double single = events.Time(1, launch); // also the warm-up
        if (single < 0.0) {
            continue;
        }
        reps[i] = RepsFor(single);
        pass1[i] = events.Time(reps[i], launch);
    }
    int best = -1;
    for (std::size_t i = 0; i < n_cand; ++i) {
        if (pass1[i] > 0.0 && (best < 0 || pass1[i] < pass1[static_cast<std::size_t>(best)])) {
            best = static_cast<int>(i);
        }
    }
    SHARDLINE_CHECK_AS(CudaError, best >= 0, kOp, "no cuBLASLt candidate ran for {}", plan.key);
    int chosen = best;
    double chosen_us = pass1[static_cast<std::size_t>(best)];
    double first_us = pass1[0];
    if (best != 0 && pass1[0] > 0.0) {
        // Confirm on a second pass, interleaved, before leaving the heuristic's first pick.
        auto time = [&](std::size_t i) {
            return events.Time(reps[i], [&] {
                return Launch(plan, plan.candidates[i].algo, p, d, ctx, stream) == CUBLAS_STATUS_SUCCESS;
            });
        };
        const double first2 = time(0);
        const double best2 = time(static_cast<std::size_t>(best));
        const bool faster = pass1[static_cast<std::size_t>(best)] < pass1[0] * (1.0 - kTuningMargin) && best2 > 0.0 &&
                            best2 < first2 * (1.0 - kTuningMargin);
        first_us = std::min(pass1[0], first2);
        if (faster) {
            chosen_us = std::min(pass1[static_cast<std::size_t>(best)], best2);
        } else {
            chosen = 0;
            chosen_us = first_us;
        }
    }
    plan.algo = plan.candidates[static_cast<std::size_t>(chosen)].algo;
    plan.candidate_count = static_cast<int>(n_cand);
    plan.chosen = chosen;
    plan.chosen_us = chosen_us;
    plan.first_us = first_us;
    plan.tuned = true;
    detail::GemmCounters().tuned.fetch_add(1);
}

/// A measured epilogue (MeasuresEpilogue): the fused epilogue with its tuned algorithm against the apart path — the
/// apart GEMM (ApartGemmParams, through its own tuned plan) followed by RunApartEpilogue — both on p's operands. beta
/// is 0, and the inputs (A, B, and for DGELU the aux) are only read, so repeated runs write the same outputs (D, the
/// bias grad, GELU_AUX's aux), which the real call then overwrites. Called under plan.mutex, stream not capturing.
void DecideEpilogue(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const cudaStream_t stream = ctx.stream();
    const GemmParams apart_params = ApartGemmParams(p);
    plan.apart = GetPlan(apart_params, ctx);
    const Tensor flush = ColdFlushBuffer(p, ctx);
    CandidateTimer events(stream, flush.defined() ? flush.data() : nullptr, flush.defined() ? flush.nbytes() : 0);
    auto fused = [&] { return Launch(plan, plan.algo, p, p.c, ctx, stream) == CUBLAS_STATUS_SUCCESS; };
    auto separate = [&] {
        RunWithPlan(*plan.apart, apart_params, ctx);
        RunApartEpilogue(p, ctx, ReduceImpl::kVectorized);
        return true;
    };
    const double fused_single = events.Time(1, fused);
    SHARDLINE_CHECK_AS(CudaError, fused_single > 0.0, kOp, "the tuned {} algorithm failed for {}",
                       GemmEpilogueName(p.epilogue), plan.key);
    (void)events.Time(1, separate);
    const int reps = RepsFor(fused_single);
    double fused_us = 0.0;
    double separate_us = 0.0;
    for (int pass = 0; pass < 2; ++pass) {
        const double f = events.Time(reps, fused);
        const double s = events.Time(reps, separate);
        fused_us = pass == 0 ? f : std::min(fused_us, f);
        separate_us = pass == 0 ? s : std::min(separate_us, s);
    }
    plan.epilogue_fused_us = fused_us;
    plan.epilogue_separate_us = separate_us;
    plan.epilogue_separate = !(fused_us < separate_us * (1.0 - kTuningMargin));
}

/// A matrix-vector product (plan.gemv_eligible): CUTLASS's GEMV against the algorithm TuneCandidates kept, both on p's
/// operands, interleaved over two passes (beta is 0, so repeats write the same D). plan.gemv_faster records whether the
/// GEMV won by the tuning margin (what the tuning file keeps); GemmGemv::kAuto runs the winner, kAlways the GEMV
/// anyway, kOff times nothing. A GEMV that fails to launch leaves the plan on cuBLASLt, with a warning. Called under
/// plan.mutex, stream not capturing.
void DecideGemv(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const GemmGemv mode = CurrentGemmTuningOptions().gemv;
    plan.gemv = false;
    plan.gemv_faster = false;
    plan.gemv_us = 0.0;
    plan.gemv_cublaslt_us = 0.0;
    if (!plan.gemv_eligible || mode == GemmGemv::kOff) {
        return;
    }
    const cudaStream_t stream = ctx.stream();
    const Tensor flush = ColdFlushBuffer(p, ctx);
    CandidateTimer events(stream, flush.defined() ? flush.data() : nullptr, flush.defined() ? flush.nbytes() : 0);
    cudaError_t gemv_status = cudaSuccess;
    auto gemv = [&] {
        gemv_status = RunGemv(p, stream);
        return gemv_status == cudaSuccess;
    };
    auto lt = [&] { return Launch(plan, plan.algo, p, p.c, ctx, stream) == CUBLAS_STATUS_SUCCESS; };
    const double single = events.Time(1, gemv); // also the warm-up
    if (single < 0.0) {
        Logger().log(spdlog::level::warn,
                     fmt::format("Gemm: CUTLASS's GEMV did not run for {} ({}): keeping cuBLASLt for this shape",
                                 plan.key, cudaGetErrorString(gemv_status)));
        return;
    }
    (void)events.Time(1, lt);
    const int reps = RepsFor(single);
    double gemv_us = 0.0;
    double lt_us = 0.0;
    bool ran = true;
    for (int pass = 0; pass < 2; ++pass) {
        const double g = events.Time(reps, gemv);
        const double l = events.Time(reps, lt);
        ran = ran && g >= 0.0 && l >= 0.0;
        gemv_us = pass == 0 ? g : std::min(gemv_us, g);
        lt_us = pass == 0 ? l : std::min(lt_us, l);
    }
    if (!ran) {
        Logger().log(spdlog::level::warn,
                     fmt::format("Gemm: CUTLASS's GEMV or cuBLASLt failed while timing {} ({}): keeping cuBLASLt for "
                                 "this shape",
                                 plan.key, cudaGetErrorString(gemv_status)));
        return;
    }
    plan.gemv_us = gemv_us;
    plan.gemv_cublaslt_us = lt_us;
    plan.gemv_faster = gemv_us < lt_us * (1.0 - kTuningMargin);
    plan.gemv = mode == GemmGemv::kAlways || plan.gemv_faster;
    if (plan.gemv) {
        detail::GemmCounters().gemv.fetch_add(1);
    }
}

GemmTuningRecord MakeRecord(const LtPlan &plan, const DeviceIdentity &id) {
    GemmTuningRecord r;
    r.gpu = id.gpu;
    r.cublaslt_version = id.cublaslt_version;
    r.key = plan.key;
    static_assert(sizeof(plan.algo) == sizeof(r.algo), "cublasLtMatmulAlgo_t is 8 uint64 words");
    std::memcpy(r.algo.data(), &plan.algo, sizeof(plan.algo));
    r.candidates = plan.candidate_count;
    r.chosen = plan.chosen;
    r.chosen_us = plan.chosen_us;
    r.first_us = plan.first_us;
    r.epilogue_separate = plan.epilogue_separate;
    r.epilogue_fused_us = plan.epilogue_fused_us;
    r.epilogue_separate_us = plan.epilogue_separate_us;
    r.gemv = plan.gemv_faster; // what was measured, not what a mode forced
    r.gemv_us = plan.gemv_us;
    r.gemv_cublaslt_us = plan.gemv_cublaslt_us;
    return r;
}

} // namespace

void TuneGemvOnly(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    DecideGemv(plan, p, ctx);
    detail::StoreTuningRecord(MakeRecord(plan, Identity(ctx.device())));
}

void CountEpilogueDecision(const LtPlan &plan) {
    if (plan.epilogue_separate) {
        detail::GemmCounters().epilogue_separate.fetch_add(1);
    } else {
        detail::GemmCounters().epilogue_fused.fetch_add(1);
    }
}

/// Tunes a plan built during a capture, or just built outside one (under plan.mutex).
void TuneNow(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    TuneCandidates(plan, p, ctx);
    if (MeasuresEpilogue(p)) {
        DecideEpilogue(plan, p, ctx);
        CountEpilogueDecision(plan);
    }
    DecideGemv(plan, p, ctx);
    plan.needs_tuning = false;
    detail::StoreTuningRecord(MakeRecord(plan, Identity(ctx.device())));
}

} // namespace shardline::kernels::cuda::lt
