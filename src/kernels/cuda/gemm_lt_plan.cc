// The cuBLASLt provider's plans: descriptors and layouts, the plan cache, and the algorithm choice — a tuning-cache
// record, else the heuristic's candidates (timed by gemm_lt_tuning.cc), else the unfused path with one warning.

#include "gemm_lt_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/gemm_tuning.h>

#include "cutlass/gemv_cutlass.h"
#include "gemm_common.h"
#include "kernels/gemm_tuning_internal.h"

// Log lines are formatted by fmt::format and given to spdlog as finished strings: spdlog's own formatting overloads
// instantiate fmt 9's float formatter in this file, which g++ 13 -O3 flags with a false -Warray-bounds.

namespace shardline::kernels::cuda::lt {
namespace {

// Tuning also asks the heuristic for its candidates under this workspace cap (see BuildPlan).
constexpr std::size_t kSmallWorkspaceBytes = std::size_t{1} << 20;

// Plans built under a GemmTuningPause (shapes that change from call to call) live in a cache of their own, emptied
// when it reaches this many plans: a long MoE run brings new per-expert shapes at every step.
constexpr std::size_t kMaxTransientPlans = 2048;

struct PlanCache {
    std::mutex mutex;
    std::unordered_map<GemmPlanKey, std::shared_ptr<LtPlan>, GemmPlanKeyHash> plans;
    std::unordered_map<std::string, bool> warned; ///< one fallback warning per key string
    /// Under a pause: the plans of exact shapes (bounded), and the heuristic's algorithm per shape class.
    std::unordered_map<GemmPlanKey, std::shared_ptr<LtPlan>, GemmPlanKeyHash> transient;
    std::unordered_map<GemmPlanKey, cublasLtMatmulAlgo_t, GemmPlanKeyHash> class_algos;
};

PlanCache &ThePlanCache() {
    // Never destroyed: plans hold cuBLASLt objects, and releasing them during static destruction would race the
    // library's own teardown.
    static PlanCache *cache = new PlanCache();
    return *cache;
}

/// The fused-epilogue eligibility predicate, checked before asking cuBLASLt. Empty when eligible; otherwise the
/// reason, which goes into the one warning for the key:
///  - batched problems run unfused: GemmParams carries no bias/aux batch strides, and a bias grad of a batch is a
///    sum over the batch, which the BGRAD epilogues do not compute;
///  - the bias (or bias-grad) vector must have D's dtype: cuBLASLt's bias vectors take D's type outside fp8/int8
///    kernels;
///  - the GELU aux matrix needs a leading dimension divisible by 8 (cuBLASLt's requirement for EPILOGUE_AUX_LD).
std::string FusedIneligibleReason(const GemmParams &p) {
    if (p.epilogue == GemmEpilogue::kNone) {
        return {};
    }
    if (p.batch_count > 1) {
        return fmt::format("batched (batch={}) epilogues run unfused", p.batch_count);
    }
    if (GemmUsesBias(p) && p.bias_type != p.c_type) {
        return fmt::format("bias dtype {} differs from D's {}", DTypeName(p.bias_type), DTypeName(p.c_type));
    }
    if (GemmEpilogueHasAux(p.epilogue) && p.ldaux % 8 != 0) {
        return fmt::format("ldaux {} is not a multiple of 8", p.ldaux);
    }
    return {};
}

cublasLtEpilogue_t LtEpilogue(const GemmParams &p) {
    switch (p.epilogue) {
    case GemmEpilogue::kNone:
        return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::kBias:
        return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kGeluAuxBias:
        return p.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::kBGradB:
        return CUBLASLT_EPILOGUE_BGRADB;
    case GemmEpilogue::kDGeluBGrad:
        return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::kDGelu:
        return CUBLASLT_EPILOGUE_DGELU;
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
}

std::string Describe(const GemmParams &p) {
    return fmt::format("m={} n={} k={} trans_a={} trans_b={} lda={} ldb={} ldc={}{} batch={} {}x{}->{} epilogue {}",
                       p.m, p.n, p.k, p.trans_a, p.trans_b, p.lda, p.ldb, p.ldc,
                       GemmHasSeparateC(p) ? fmt::format(" ldc_in={}", p.ldc_in) : std::string(), p.batch_count,
                       DTypeName(p.a_type), DTypeName(p.b_type), DTypeName(p.c_type), GemmEpilogueName(p.epilogue));
}

void WarnOnce(const std::string &key, const std::string &message) {
    PlanCache &cache = ThePlanCache();
    {
        std::lock_guard lock(cache.mutex);
        if (!cache.warned.emplace(key, true).second) {
            return;
        }
    }
    Logger().log(spdlog::level::warn, message);
}

/// Builds the plan for p: descriptors, epilogue attributes (with this call's pointers, whose alignment the heuristic
/// reads), then the algorithm (`reuse` when given and cuBLASLt's check accepts it for this shape, else a tuning-cache
/// record, timed candidates or the heuristic's first pick).
std::shared_ptr<LtPlan> BuildPlan(const GemmParams &p, const GemmPlanKey &key, CudaContext &ctx,
                                  const cublasLtMatmulAlgo_t *reuse = nullptr) {
    detail::GemmCounters().plans_built.fetch_add(1);
    auto plan = std::make_shared<LtPlan>();
    plan->key = GemmPlanKeyString(key);
    if (const std::string reason = FusedIneligibleReason(p); !reason.empty()) {
        WarnOnce(plan->key,
                 fmt::format("Gemm: fused epilogue {} not used for {} ({}): running the GEMM and separate epilogue "
                             "kernels for this shape",
                             GemmEpilogueName(p.epilogue), Describe(p), reason));
        return plan;
    }
    plan->gemv_eligible = GemvIneligibleReason(p, ctx).empty();
    const cublasComputeType_t compute = GemmComputeType(p, ctx);
    // alpha/beta are float for every dtype here: the compute type is 32F (or 32F_FAST_TF32).
    cublasLtMatmulDesc_t raw_desc = nullptr;
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F));
    plan->desc.reset(raw_desc);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, LtEpilogue(p));
    if (GemmUsesBias(p)) {
        plan->set_bias = true;
        plan->bias_ptr = p.bias;
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                static_cast<std::int32_t>(CudaDataType(p.bias_type, kOp)));
    }
    if (GemmEpilogueHasAux(p.epilogue)) {
        plan->set_aux = true;
        plan->aux_ptr = p.aux;
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux);
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.ldaux);
    }

    // Layouts as stored: A is m×k (k×m when transposed), B is k×n (n×k when transposed), C and D are m×n.
    const cudaDataType_t a_type = CudaDataType(p.a_type, kOp);
    const cudaDataType_t b_type = CudaDataType(p.b_type, kOp);
    const cudaDataType_t c_type = CudaDataType(p.c_type, kOp);
    plan->a = MakeLayout(a_type, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.batch_count, p.stride_a);
    plan->b = MakeLayout(b_type, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, p.batch_count, p.stride_b);
    plan->c = MakeLayout(c_type, p.m, p.n, p.ldc, p.batch_count, p.stride_c);
    if (GemmHasSeparateC(p)) {
        // C apart from D (a residual added by the GEMM): cuBLASLt takes separate C and D layouts natively.
        plan->c_in = MakeLayout(c_type, p.m, p.n, p.ldc_in, p.batch_count, p.stride_c_in);
    }
    cublasLtMatrixLayout_t c_layout = plan->c_in != nullptr ? plan->c_in.get() : plan->c.get();

    const GemmTuningOptions options = CurrentGemmTuningOptions();
    const DeviceIdentity &id = Identity(ctx.device());

    // 0. The algorithm of a similar shape (a transient plan's class), if cuBLASLt accepts it for this one.
    if (reuse != nullptr) {
        cublasLtMatmulHeuristicResult_t check{};
        if (cublasLtMatmulAlgoCheck(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), c_layout, plan->c.get(),
                                    reuse, &check) == CUBLAS_STATUS_SUCCESS &&
            check.workspaceSize <= ctx.workspace_bytes()) {
            plan->algo = *reuse;
            plan->usable = true;
            plan->candidate_count = 1;
            detail::GemmCounters().algo_reused.fetch_add(1);
            if (MeasuresEpilogue(p)) {
                CountEpilogueDecision(*plan); // untuned: the fused epilogue, one launch
            }
            SetUntimedGemv(*plan, false);
            return plan;
        }
    }

    // 1. A tuning-cache record: no heuristic query, no timing.
    if (std::optional<GemmTuningRecord> record = detail::FindTuningRecord(id.gpu, id.cublaslt_version, plan->key)) {
        cublasLtMatmulAlgo_t algo{};
        std::memcpy(&algo, record->algo.data(), sizeof(algo));
        cublasLtMatmulHeuristicResult_t check{};
        const cublasStatus_t status = cublasLtMatmulAlgoCheck(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(),
                                                              c_layout, plan->c.get(), &algo, &check);
        if (status == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= ctx.workspace_bytes()) {
            plan->algo = algo;
            plan->usable = true;
            plan->tuned = true;
            plan->from_file = true;
            plan->candidate_count = record->candidates;
            plan->chosen = record->chosen;
            plan->chosen_us = record->chosen_us;
            plan->first_us = record->first_us;
            if (MeasuresEpilogue(p)) {
                plan->epilogue_separate = record->epilogue_separate;
                plan->epilogue_fused_us = record->epilogue_fused_us;
                plan->epilogue_separate_us = record->epilogue_separate_us;
                if (plan->epilogue_separate) {
                    plan->apart = GetPlan(ApartGemmParams(p), ctx);
                }
                CountEpilogueDecision(*plan);
            }
            plan->gemv_us = record->gemv_us;
            plan->gemv_cublaslt_us = record->gemv_cublaslt_us;
            SetUntimedGemv(*plan, record->gemv);
            detail::GemmCounters().file_hits.fetch_add(1);
            if (plan->gemv_eligible && record->gemv_us == 0.0 && options.enabled && options.gemv == GemmGemv::kAuto &&
                !StreamCapturing(ctx.stream())) {
                // A record without a GEMV measurement (a file written before the GEMV, under SHARDLINE_GEMM_GEMV=off,
                // or by a build without CUTLASS): time the GEMV now against the record's algorithm and store it.
                std::lock_guard lock(plan->mutex);
                TuneGemvOnly(*plan, p, ctx);
            }
            return plan;
        }
        detail::GemmCounters().file_rejected.fetch_add(1);
        WarnOnce(plan->key + "|file",
                 fmt::format("Gemm: tuning-file record for {} refused by cuBLASLt ({}, workspace {} of {} bytes): "
                             "tuning afresh",
                             plan->key, cublasGetStatusName(status), check.workspaceSize, ctx.workspace_bytes()));
    }

    // 2. The heuristic's candidates.
    cublasLtMatmulPreference_t raw_pref = nullptr;
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&raw_pref));
    LtPreference pref(raw_pref);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(ctx.workspace_bytes()));
    const std::uint32_t align_a = key.align_a;
    const std::uint32_t align_b = key.align_b;
    const std::uint32_t align_c = key.align_c;
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            plan->c_in != nullptr ? static_cast<std::uint32_t>(key.align_c_in) : align_c);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);

    const int wanted = options.enabled ? options.top_k : 1;
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(wanted));
    int returned = 0;
    detail::GemmCounters().heuristic_queries.fetch_add(1);
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), c_layout, plan->c.get(),
                                       raw_pref, wanted, results.data(), &returned);
    results.resize(status == CUBLAS_STATUS_SUCCESS ? static_cast<std::size_t>(std::max(returned, 0)) : 0);
    std::erase_if(results, [](const cublasLtMatmulHeuristicResult_t &r) { return r.state != CUBLAS_STATUS_SUCCESS; });
    plan->full_workspace_candidates = static_cast<int>(results.size());
    if (options.enabled && ctx.workspace_bytes() > kSmallWorkspaceBytes && !results.empty()) {
        // The heuristic ranks differently under a small workspace cap (it then proposes the non-split kernels that
        // torch's default 1 MiB cuBLASLt workspace gets): time those candidates too. The first pick stays the
        // full-workspace one.
        std::vector<cublasLtMatmulHeuristicResult_t> more(static_cast<std::size_t>(wanted));
        int more_returned = 0;
        SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(kSmallWorkspaceBytes));
        detail::GemmCounters().heuristic_queries.fetch_add(1);
        if (cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), c_layout,
                                           plan->c.get(), raw_pref, wanted, more.data(),
                                           &more_returned) == CUBLAS_STATUS_SUCCESS) {
            for (int i = 0; i < more_returned; ++i) {
                const cublasLtMatmulHeuristicResult_t &r = more[static_cast<std::size_t>(i)];
                const bool seen = std::any_of(results.begin(), results.end(), [&](const auto &q) {
                    return std::memcmp(&q.algo, &r.algo, sizeof(r.algo)) == 0;
                });
                if (r.state == CUBLAS_STATUS_SUCCESS && !seen) {
                    results.push_back(r);
                }
            }
        }
    }
    if (results.empty()) {
        if (p.epilogue != GemmEpilogue::kNone) {
            WarnOnce(plan->key,
                     fmt::format("Gemm: cuBLASLt has no algorithm for epilogue {} with {} (heuristic: {}): running the "
                                 "GEMM and separate epilogue kernels for this shape",
                                 GemmEpilogueName(p.epilogue), Describe(p), cublasGetStatusName(status)));
        } else {
            WarnOnce(plan->key, fmt::format("Gemm: cuBLASLt has no algorithm for {} (heuristic: {}): using "
                                            "cublasGemmStridedBatchedEx for this shape",
                                            Describe(p), cublasGetStatusName(status)));
        }
        return plan;
    }
    plan->algo = results.front().algo;
    plan->candidate_count = static_cast<int>(results.size());
    plan->candidates = std::move(results);
    plan->usable = true;

    // 3. Timing, unless tuning is off or the stream is being captured (it needs a synchronisation; the first call
    //    outside the capture tunes the plan).
    if (options.enabled) {
        if (StreamCapturing(ctx.stream())) {
            plan->needs_tuning = true;
            SetUntimedGemv(*plan, false, false); // until the first call outside the capture tunes it
        } else {
            std::lock_guard lock(plan->mutex);
            TuneNow(*plan, p, ctx);
        }
    } else {
        if (MeasuresEpilogue(p)) {
            CountEpilogueDecision(*plan); // untuned: the fused epilogue, one launch
        }
        SetUntimedGemv(*plan, false);
    }
    return plan;
}

} // namespace

/// A column-major rows×cols matrix, strided-batched when batch > 1 (a stride of 0 broadcasts it).
LtMatrixLayout MakeLayout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                          std::int64_t batch, std::int64_t stride) {
    cublasLtMatrixLayout_t raw = nullptr;
    SHARDLINE_CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&raw, type, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ld));
    LtMatrixLayout layout(raw);
    if (batch > 1) {
        SHARDLINE_CHECK_AS(ShapeError, batch <= INT32_MAX, kOp, "batch count {} exceeds cuBLASLt's int32 limit", batch);
        SetLayout(raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<std::int32_t>(batch));
        SetLayout(raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
    return layout;
}

const DeviceIdentity &Identity(int device) {
    static std::mutex mutex;
    static auto *identities = new std::unordered_map<int, DeviceIdentity>();
    std::lock_guard lock(mutex);
    auto it = identities->find(device);
    if (it == identities->end()) {
        cudaDeviceProp prop{};
        SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
        it = identities
                 ->emplace(device,
                           DeviceIdentity{std::string(prop.name), static_cast<std::int64_t>(cublasLtGetVersion()),
                                          static_cast<std::size_t>(prop.l2CacheSize)})
                 .first;
    }
    return it->second;
}

GemmParams PlainParams(const GemmParams &p) {
    GemmParams plain = p;
    plain.epilogue = GemmEpilogue::kNone;
    plain.bias = nullptr;
    plain.aux = nullptr;
    plain.ldaux = 0;
    return plain;
}

bool MeasuresEpilogue(const GemmParams &p) {
    switch (p.epilogue) {
    case GemmEpilogue::kGeluAuxBias:
    case GemmEpilogue::kBGradB:
    case GemmEpilogue::kDGeluBGrad:
    case GemmEpilogue::kDGelu:
        return p.beta == 0.0 && p.batch_count == 1;
    case GemmEpilogue::kNone:
    case GemmEpilogue::kBias:
        break;
    }
    return false;
}

bool StreamCapturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
}

namespace {

/// The GEMV's arguments for an eligible p: column-major D (m×1) = Aᵀ·B, Aᵀ the row-major m×k weight, B the k-vector;
/// a bias is the epilogue's C with beta 1 (D = alpha·Aᵀx + bias, as cuBLASLt's BIAS epilogue: the bias is not scaled).
cutlass_gemv::Args GemvArgs(const GemmParams &p, cudaStream_t stream) {
    cutlass_gemv::Args args;
    args.element = p.a_type == DType::kBFloat16 ? cutlass_gemv::Element::kBFloat16 : cutlass_gemv::Element::kFloat16;
    args.rows = p.m;
    args.cols = p.k;
    args.a = p.a;
    args.x = p.b;
    args.d = p.c;
    args.alpha = static_cast<float>(p.alpha);
    if (p.epilogue == GemmEpilogue::kBias) {
        args.c = p.bias;
        args.beta = 1.0f;
    }
    args.stream = stream;
    return args;
}

} // namespace

std::string GemvIneligibleReason(const GemmParams &p, CudaContext &ctx) {
    if (!cutlass_gemv::Built()) {
        return "this build has no CUTLASS GEMV (built without CUTLASS)";
    }
    if (ctx.compute_capability() != 90) {
        return "the CUTLASS GEMV is sm_90a code; this device is not an sm_90";
    }
    if (p.n != 1 || p.batch_count != 1) {
        return "not one matrix-vector product (n != 1 or batched)";
    }
    if (!p.trans_a || p.lda != p.k || p.trans_b) {
        return "A is not a packed row-major matrix (trans_a with lda = k) or B is transposed";
    }
    if (p.a_type != p.b_type || p.a_type != p.c_type || (p.a_type != DType::kBFloat16 && p.a_type != DType::kFloat16)) {
        return "operands and D are not all bf16 or all fp16";
    }
    if (p.beta != 0.0 || (p.epilogue != GemmEpilogue::kNone && p.epilogue != GemmEpilogue::kBias) ||
        (p.epilogue == GemmEpilogue::kBias && p.bias_type != p.c_type)) {
        return "beta != 0, or an epilogue other than none or a bias in D's dtype";
    }
    if (const char *reason = cutlass_gemv::Unsupported(GemvArgs(p, ctx.stream()))) {
        return reason; // the kernel's own rules: k % 8, 16-byte A and x, m·k < 2^31
    }
    return {};
}

cudaError_t RunGemv(const GemmParams &p, cudaStream_t stream) { return cutlass_gemv::Run(GemvArgs(p, stream)); }

void SetUntimedGemv(LtPlan &plan, bool recorded_faster, bool count) {
    const GemmGemv mode = CurrentGemmTuningOptions().gemv;
    plan.gemv_faster = plan.gemv_eligible && recorded_faster;
    plan.gemv = plan.gemv_eligible && (mode == GemmGemv::kAlways || (mode == GemmGemv::kAuto && recorded_faster));
    if (plan.gemv && count) {
        detail::GemmCounters().gemv.fetch_add(1);
    }
}

/// One launch of `plan` with `algo` for p, writing D to `d` (p.c, or a scratch copy while tuning).
cublasStatus_t Launch(LtPlan &plan, const cublasLtMatmulAlgo_t &algo, const GemmParams &p, void *d, CudaContext &ctx,
                      cudaStream_t stream) {
    const float alpha = static_cast<float>(p.alpha);
    const float beta = static_cast<float>(p.beta);
    // D is written over C (same pointer, same layout), unless the plan has a separate C (c_in, its own layout).
    const bool separate = plan.c_in != nullptr;
    return cublasLtMatmul(ctx.lt_handle(), plan.desc.get(), &alpha, p.a, plan.a.get(), p.b, plan.b.get(), &beta,
                          separate ? p.c_in : d, separate ? plan.c_in.get() : plan.c.get(), d, plan.c.get(), &algo,
                          ctx.workspace(), ctx.workspace_bytes(), stream);
}

namespace {

/// x rounded up to a quarter of its power of two (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...).
std::int64_t ShapeClass(std::int64_t x) {
    if (x <= 8) {
        return x;
    }
    std::int64_t power = 1;
    while (power * 2 <= x) {
        power *= 2;
    }
    const std::int64_t quarter = power / 4;
    return (x + quarter - 1) / quarter * quarter;
}

/// A plan for a shape that changes from call to call (under a GemmTuningPause): from the transient cache, else built
/// with the algorithm the heuristic chose for the first shape of its class (checked for this one), else built with a
/// heuristic query whose pick then serves the class.
std::shared_ptr<LtPlan> TransientPlan(const GemmParams &p, const GemmPlanKey &key, CudaContext &ctx) {
    PlanCache &cache = ThePlanCache();
    GemmPlanKey class_key = key;
    class_key.m = ShapeClass(key.m);
    class_key.n = ShapeClass(key.n);
    class_key.k = ShapeClass(key.k);
    std::optional<cublasLtMatmulAlgo_t> algo;
    {
        std::lock_guard lock(cache.mutex);
        if (auto it = cache.transient.find(key); it != cache.transient.end()) {
            return it->second;
        }
        if (auto it = cache.class_algos.find(class_key); it != cache.class_algos.end()) {
            algo = it->second;
        }
    }
    std::shared_ptr<LtPlan> plan = BuildPlan(p, key, ctx, algo ? &*algo : nullptr);
    std::lock_guard lock(cache.mutex);
    if (!algo && plan->usable) {
        cache.class_algos.emplace(class_key, plan->algo);
    }
    if (cache.transient.size() >= kMaxTransientPlans) {
        cache.transient.clear(); // plans in use stay alive through their shared_ptr
    }
    return cache.transient.emplace(key, std::move(plan)).first->second;
}

} // namespace

std::shared_ptr<LtPlan> GetPlan(const GemmParams &p, CudaContext &ctx) {
    const GemmPlanKey key = MakeGemmPlanKey(p, ctx.allow_tf32(), ctx.workspace_bytes());
    PlanCache &cache = ThePlanCache();
    {
        std::lock_guard lock(cache.mutex);
        if (auto it = cache.plans.find(key); it != cache.plans.end()) {
            return it->second;
        }
    }
    if (detail::GemmTuningPaused()) {
        return TransientPlan(p, key, ctx);
    }
    // Built outside the cache lock: tuning takes milliseconds once per key, and other keys (other threads, other
    // devices) must not wait for it. Two threads racing on one new key both build; the first insert wins.
    std::shared_ptr<LtPlan> plan = BuildPlan(p, key, ctx);
    std::lock_guard lock(cache.mutex);
    return cache.plans.emplace(key, std::move(plan)).first->second;
}

} // namespace shardline::kernels::cuda::lt

namespace shardline::kernels::cuda {

void ClearPlanCache() {
    lt::PlanCache &cache = lt::ThePlanCache();
    std::lock_guard lock(cache.mutex);
    cache.plans.clear();
    cache.warned.clear();
    cache.transient.clear();
    cache.class_algos.clear();
}

std::vector<GemmPlanInfo> PlanInfos() {
    std::vector<std::shared_ptr<lt::LtPlan>> plans;
    {
        lt::PlanCache &cache = lt::ThePlanCache();
        std::lock_guard lock(cache.mutex);
        for (const auto &[key, plan] : cache.plans) {
            plans.push_back(plan);
        }
    }
    std::vector<GemmPlanInfo> infos;
    infos.reserve(plans.size());
    for (const std::shared_ptr<lt::LtPlan> &plan : plans) {
        std::lock_guard lock(plan->mutex);
        infos.push_back(GemmPlanInfo{.key = plan->key,
                                     .usable = plan->usable,
                                     .tuned = plan->tuned,
                                     .from_file = plan->from_file,
                                     .candidates = plan->candidate_count,
                                     .chosen = plan->chosen,
                                     .chosen_us = plan->chosen_us,
                                     .first_us = plan->first_us,
                                     .epilogue_separate = plan->epilogue_separate,
                                     .epilogue_fused_us = plan->epilogue_fused_us,
                                     .epilogue_separate_us = plan->epilogue_separate_us,
                                     .chosen_small_workspace = plan->tuned && !plan->from_file &&
                                                               plan->chosen >= plan->full_workspace_candidates,
                                     .gemv = plan->gemv,
                                     .gemv_us = plan->gemv_us,
                                     .gemv_cublaslt_us = plan->gemv_cublaslt_us});
    }
    std::sort(infos.begin(), infos.end(), [](const GemmPlanInfo &a, const GemmPlanInfo &b) { return a.key < b.key; });
    return infos;
}

} // namespace shardline::kernels::cuda
