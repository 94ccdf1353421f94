#pragma once

// Private to the cuBLASLt provider, which is three files: gemm_cublaslt.cc (the op entry points), gemm_lt_plan.cc
// (descriptors and layouts, the plan cache, the algorithm choice) and gemm_lt_tuning.cc (timing the candidates, the
// fused-or-apart decision of the measured epilogues). Shared here: the RAII cuBLASLt objects, the plan, and the
// functions the files call across.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/kernels/gemm.h>

#include "core/cuda/cublas_check.h"
#include "kernels/gemm_tuning.h"

namespace shardline::kernels::cuda::lt {

inline constexpr std::string_view kOp = GemmOp::kName;

// ---------------------------------------------------------------------------------------------------------------------
// RAII for cuBLASLt objects. Destroy statuses are ignored: a destructor must not throw.

template <class T, cublasStatus_t (*Destroy)(T *)> struct LtDeleter {
    void operator()(T *p) const noexcept {
        if (p != nullptr) {
            (void)Destroy(p);
        }
    }
};
using LtMatmulDesc =
    std::unique_ptr<cublasLtMatmulDescOpaque_t, LtDeleter<cublasLtMatmulDescOpaque_t, &cublasLtMatmulDescDestroy>>;
using LtMatrixLayout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t,
                                       LtDeleter<cublasLtMatrixLayoutOpaque_t, &cublasLtMatrixLayoutDestroy>>;
using LtPreference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                                     LtDeleter<cublasLtMatmulPreferenceOpaque_t, &cublasLtMatmulPreferenceDestroy>>;

template <class V> void SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V &value) {
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}
template <class V> void SetLayout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const V &value) {
    SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, attr, &value, sizeof(value)));
}
template <class V>
void SetPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const V &value) {
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

/// A column-major rows×cols matrix, strided-batched when batch > 1 (a stride of 0 broadcasts it).
LtMatrixLayout MakeLayout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                          std::int64_t batch, std::int64_t stride);

// ---------------------------------------------------------------------------------------------------------------------
// Plans

struct LtPlan {
    bool usable = false; ///< false: no algorithm (or not eligible); run the unfused path
    bool set_bias = false;
    bool set_aux = false;
    LtMatmulDesc desc;
    LtMatrixLayout a;
    LtMatrixLayout b;
    LtMatrixLayout c;    ///< D, and C when C is D
    LtMatrixLayout c_in; ///< a separate C (GemmHasSeparateC); null when C is D
    cublasLtMatmulAlgo_t algo{};
    std::mutex mutex;               ///< the bias/aux pointers are descriptor attributes: set and launch under one lock
    const void *bias_ptr = nullptr; ///< what the descriptor points at now
    const void *aux_ptr = nullptr;

    // How the algorithm was chosen.
    std::string key;
    bool tuned = false;
    bool from_file = false;
    /// Built while its stream was being captured: timing needs a synchronisation, so the heuristic's first pick runs
    /// until the first call outside a capture tunes it.
    bool needs_tuning = false;
    std::vector<cublasLtMatmulHeuristicResult_t> candidates;
    int candidate_count = 0;           ///< candidates timed (or, from the file, timed when the record was made)
    int full_workspace_candidates = 0; ///< the first ones came from the full-workspace heuristic query
    int chosen = 0;
    double chosen_us = 0.0;
    double first_us = 0.0;

    // Measured epilogues (MeasuresEpilogue): run the apart GEMM's plan and RunApartEpilogue instead of the fused
    // epilogue where that measured faster.
    bool epilogue_separate = false;
    double epilogue_fused_us = 0.0;
    double epilogue_separate_us = 0.0;
    std::shared_ptr<LtPlan> apart; ///< the plan of ApartGemmParams(p), when epilogue_separate

    // Matrix-vector products (GemvIneligibleReason empty, and cuBLASLt has an algorithm: the plan is usable): CUTLASS's
    // GEMV instead of the algorithm, per GemmGemv.
    bool gemv_eligible = false;
    bool gemv = false;             ///< runs the GEMV
    bool gemv_faster = false;      ///< tuning (or the file's record) found the GEMV faster by the margin
    double gemv_us = 0.0;          ///< timed by tuning (0: not timed)
    double gemv_cublaslt_us = 0.0; ///< the algorithm in the same passes
};

/// The GPU's name (cudaDeviceProp::name) and cuBLASLt's version: the tuning-cache file's record key.
struct DeviceIdentity {
    std::string gpu;
    std::int64_t cublaslt_version = 0;
    std::size_t l2_bytes = 0;
};
const DeviceIdentity &Identity(int device);

// gemm_lt_plan.cc

/// The plan for p's key: the cached one, else built now (descriptors, then the algorithm: a tuning-cache record, the
/// timed candidates or the heuristic's first pick).
std::shared_ptr<LtPlan> GetPlan(const GemmParams &p, CudaContext &ctx);
/// p without its epilogue: the plain product.
GemmParams PlainParams(const GemmParams &p);
/// Whether p's fused epilogue is timed against running it apart (ApartGemmParams' GEMM, then RunApartEpilogue) and
/// kept only where it measures faster: GELU_AUX(_BIAS), BGRADB, DGELU and DGELU_BGRAD, with beta = 0 (timing repeats
/// the call, which must not add into C twice). A bias epilogue costs the GEMM nothing and is always fused.
bool MeasuresEpilogue(const GemmParams &p);
bool StreamCapturing(cudaStream_t stream);
/// Empty when p may run CUTLASS's GEMV (the eligibility of GemmGemv, gemm_tuning.h; it depends only on p's plan key
/// and the device), else the reason.
std::string GemvIneligibleReason(const GemmParams &p, CudaContext &ctx);
/// p through CUTLASS's GEMV on `stream` (p eligible): D = alpha·op(A)·x (+ the bias).
cudaError_t RunGemv(const GemmParams &p, cudaStream_t stream);
/// One launch of `plan` with `algo` for p, writing D to `d` (p.c, or a scratch copy while tuning). C is p.c_in with
/// its own layout when the plan has one, else `d` (D written over C).
cublasStatus_t Launch(LtPlan &plan, const cublasLtMatmulAlgo_t &algo, const GemmParams &p, void *d, CudaContext &ctx,
                      cudaStream_t stream);

// gemm_lt_tuning.cc

/// Times the plan's candidates on p's operands and keeps the fastest; for a measured epilogue also decides fused
/// against apart; stores the record in the tuning-cache file (under plan.mutex, stream not capturing).
void TuneNow(LtPlan &plan, const GemmParams &p, CudaContext &ctx);
/// A plan read from a tuning-file record without a GEMV measurement (plan.gemv_eligible, GemmGemv::kAuto, tuning on,
/// stream not capturing): times the GEMV against the record's algorithm (DecideGemv) and stores the record with it
/// (under plan.mutex).
void TuneGemvOnly(LtPlan &plan, const GemmParams &p, CudaContext &ctx);
/// Counts a measured epilogue's decision (GemmPlanStats).
void CountEpilogueDecision(const LtPlan &plan);
/// Sets plan.gemv for a plan that is not timed now (untuned; from a tuning-file record whose measurement says
/// `recorded_faster`; built inside a capture, until its tuning): GemmGemv's kAlways, or kAuto and recorded_faster;
/// never when not eligible. Counts it in GemmPlanStats::gemv when `count` (a plan waiting for its tuning is counted
/// when DecideGemv decides).
void SetUntimedGemv(LtPlan &plan, bool recorded_faster, bool count = true);

// gemm_cublaslt.cc

/// The product without epilogue: cuBLASLt, or cuBLAS when cuBLASLt has nothing for the shape.
void RunPlain(const GemmParams &p, CudaContext &ctx);
/// p through `plan` (p's plan): its algorithm (or, for a measured epilogue that runs apart, the apart plan and
/// RunApartEpilogue), or, when the plan is not usable, the plain product and the separate epilogue kernels.
void RunWithPlan(LtPlan &plan, const GemmParams &p, CudaContext &ctx);

} // namespace shardline::kernels::cuda::lt
