// The default provider's Gemm: cuBLASLt with fused epilogues, one cached plan per problem key.
//
// A plan (matmul descriptor, the three layouts and the chosen algorithm) is built on the first call with a given key
// and reused: a repeated call makes no heuristic query and creates no descriptor; it re-points the descriptor at this
// call's bias/aux vectors when they moved, and launches.
//
// Choosing the algorithm (see include/shardline/kernels/gemm_tuning.h; the key is in src/kernels/gemm_tuning.h): a
// record of the tuning-cache file wins (no heuristic query, no timing); else the heuristic's top-k candidates are
// timed once on the call's own operands and the fastest is kept (tuning on, the default), or its first pick is taken
// (tuning off). A BGRADB key also times the plain GEMM followed by the separate column sum and keeps the fused
// epilogue only where it measures faster.
//
// When cuBLASLt offers no algorithm for a fused epilogue (or the problem is outside what the epilogues support, see
// FusedIneligibleReason), the plan says so, one warning is logged for that key, and every call runs the plain GEMM
// followed by the separate epilogue kernels.

#include <algorithm>
#include <array>
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
#include <shardline/core/tensor.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/gemm_tuning.h>

#include "core/cuda/cublas_check.h"
#include "cuda_ops.h"
#include "gemm_common.h"
#include "kernels/gemm_tuning_internal.h"

// Log lines are formatted by fmt::format and given to spdlog as finished strings: spdlog's own formatting overloads
// instantiate fmt 9's float formatter in this file, which g++ 13 -O3 flags with a false -Warray-bounds.

namespace shardline::kernels::cuda {
namespace {

constexpr std::string_view kOp = GemmOp::kName;

// Tuning: a candidate replaces the heuristic's first pick only when it is faster by this fraction on two passes, and
// the fused BGRADB epilogue is kept only when it beats the plain GEMM + column sum by it (timing noise of repeated
// launches on one GPU is below 1 %; a tie keeps the simpler and, for the bias grad, exactly-summed path).
constexpr double kTuningMargin = 0.01;
// Each candidate runs once to warm up, then reps times between two events; reps targets ~kTuningBudgetUs per
// candidate and pass, within [kMinReps, kMaxReps].
constexpr double kTuningBudgetUs = 1000.0;
constexpr int kMinReps = 2;
constexpr int kMaxReps = 20;
// Tuning also asks the heuristic for its candidates under this workspace cap (see BuildPlan).
constexpr std::size_t kSmallWorkspaceBytes = std::size_t{1} << 20;

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

/// Times launches of tuning candidates on one stream. Warm: `reps` launches back to back between two events (the
/// operands stay in L2 when they fit, as they do when a large GEMM repeats). Cold (a flush buffer given, for problems
/// whose operands fit in L2): before each launch a write of twice the L2 size evicts them, and only the launch is timed,
/// as a decode step meets its weights coming from device memory.
class CandidateTimer {
public:
    CandidateTimer(cudaStream_t stream, void *flush, std::size_t flush_bytes)
        : stream_(stream), flush_(flush), flush_bytes_(flush_bytes) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&start_));
        if (cudaEventCreate(&stop_) != cudaSuccess) {
            cudaEventDestroy(start_);
            SHARDLINE_THROW(CudaError, kOp, "cudaEventCreate failed while tuning");
        }
    }
    ~CandidateTimer() {
        cudaEventDestroy(start_);
        cudaEventDestroy(stop_);
    }
    CandidateTimer(const CandidateTimer &) = delete;
    CandidateTimer &operator=(const CandidateTimer &) = delete;

    /// Mean µs of `reps` runs of launch(); a negative value when launch() reported a failure.
    template <class F> double Time(int reps, F &&launch) {
        if (flush_ == nullptr) {
            SHARDLINE_CHECK_CUDA(cudaEventRecord(start_, stream_));
            bool ok = true;
            for (int r = 0; r < reps && ok; ++r) {
                ok = launch();
            }
            return Stop(ok) / reps;
        }
        double total = 0.0;
        for (int r = 0; r < reps; ++r) {
            SHARDLINE_CHECK_CUDA(cudaMemsetAsync(flush_, r & 0xff, flush_bytes_, stream_));
            SHARDLINE_CHECK_CUDA(cudaEventRecord(start_, stream_));
            const double us = Stop(launch());
            if (us < 0.0) {
                return -1.0;
            }
            total += us;
        }
        return total / reps;
    }

private:
    double Stop(bool ok) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(stop_, stream_));
        SHARDLINE_CHECK_CUDA(cudaEventSynchronize(stop_));
        if (!ok) {
            return -1.0;
        }
        float ms = 0.0f;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
        return 1000.0 * static_cast<double>(ms);
    }

    cudaStream_t stream_ = nullptr;
    void *flush_ = nullptr;
    std::size_t flush_bytes_ = 0;
    cudaEvent_t start_ = nullptr;
    cudaEvent_t stop_ = nullptr;
};

int RepsFor(double single_us) {
    if (single_us <= 0.0) {
        return kMaxReps;
    }
    return std::clamp(static_cast<int>(kTuningBudgetUs / single_us), kMinReps, kMaxReps);
}

// ---------------------------------------------------------------------------------------------------------------------
// Plans

struct LtPlan {
    bool usable = false; ///< false: no algorithm (or not eligible); run the unfused path
    bool set_bias = false;
    bool set_aux = false;
    LtMatmulDesc desc;
    LtMatrixLayout a;
    LtMatrixLayout b;
    LtMatrixLayout c;
    cublasLtMatmulAlgo_t algo{};
    std::mutex mutex; ///< the bias/aux pointers are descriptor attributes: set and launch under one lock
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
    int candidate_count = 0; ///< candidates timed (or, from the file, timed when the record was made)
    int full_workspace_candidates = 0; ///< the first ones came from the full-workspace heuristic query
    int chosen = 0;
    double chosen_us = 0.0;
    double first_us = 0.0;

    // BGRADB keys: run the plain plan and the separate column sum instead of the fused epilogue.
    bool bgradb_separate = false;
    double bgradb_fused_us = 0.0;
    double bgradb_separate_us = 0.0;
    std::shared_ptr<LtPlan> plain;
};

struct PlanCache {
    std::mutex mutex;
    std::unordered_map<GemmPlanKey, std::shared_ptr<LtPlan>, GemmPlanKeyHash> plans;
    std::unordered_map<std::string, bool> warned; ///< one fallback warning per key string
};

PlanCache &ThePlanCache() {
    // Never destroyed: plans hold cuBLASLt objects, and releasing them during static destruction would race the
    // library's own teardown.
    static PlanCache *cache = new PlanCache();
    return *cache;
}

/// The GPU's name (cudaDeviceProp::name) and cuBLASLt's version: the tuning-cache file's record key.
struct DeviceIdentity {
    std::string gpu;
    std::int64_t cublaslt_version = 0;
    std::size_t l2_bytes = 0;
};
const DeviceIdentity &Identity(int device) {
    static std::mutex mutex;
    static auto *identities = new std::unordered_map<int, DeviceIdentity>();
    std::lock_guard lock(mutex);
    auto it = identities->find(device);
    if (it == identities->end()) {
        cudaDeviceProp prop{};
        SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
        it = identities
                 ->emplace(device, DeviceIdentity{std::string(prop.name),
                                                  static_cast<std::int64_t>(cublasLtGetVersion()),
                                                  static_cast<std::size_t>(prop.l2CacheSize)})
                 .first;
    }
    return it->second;
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
    if (p.bias != nullptr && p.bias_type != p.c_type) {
        return fmt::format("bias dtype {} differs from D's {}", DTypeName(p.bias_type), DTypeName(p.c_type));
    }
    const bool has_aux = p.epilogue == GemmEpilogue::kGeluAuxBias || p.epilogue == GemmEpilogue::kDGeluBGrad;
    if (has_aux && p.ldaux % 8 != 0) {
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
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
}

std::string Describe(const GemmParams &p) {
    return fmt::format("m={} n={} k={} trans_a={} trans_b={} lda={} ldb={} ldc={} batch={} {}x{}->{} epilogue {}", p.m,
                       p.n, p.k, p.trans_a, p.trans_b, p.lda, p.ldb, p.ldc, p.batch_count, DTypeName(p.a_type),
                       DTypeName(p.b_type), DTypeName(p.c_type), GemmEpilogueName(p.epilogue));
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

GemmParams PlainParams(const GemmParams &p) {
    GemmParams plain = p;
    plain.epilogue = GemmEpilogue::kNone;
    plain.bias = nullptr;
    plain.aux = nullptr;
    plain.ldaux = 0;
    return plain;
}

bool StreamCapturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
}

/// One launch of `plan` with `algo` for p, writing D to `d` (p.c, or a scratch copy while tuning).
cublasStatus_t Launch(LtPlan &plan, const cublasLtMatmulAlgo_t &algo, const GemmParams &p, void *d, CudaContext &ctx,
                      cudaStream_t stream) {
    const float alpha = static_cast<float>(p.alpha);
    const float beta = static_cast<float>(p.beta);
    // D is written over C (same pointer, same layout).
    return cublasLtMatmul(ctx.lt_handle(), plan.desc.get(), &alpha, p.a, plan.a.get(), p.b, plan.b.get(), &beta, d,
                          plan.c.get(), d, plan.c.get(), &algo, ctx.workspace(), ctx.workspace_bytes(), stream);
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

std::shared_ptr<LtPlan> GetPlan(const GemmParams &p, CudaContext &ctx);
void RunPlain(const GemmParams &p, CudaContext &ctx);

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
/// capturing). D goes to p.c when beta == 0 (the real call overwrites it right after) and to a scratch copy of C
/// otherwise (an accumulating GEMM must not add twice).
void TuneCandidates(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const cudaStream_t stream = ctx.stream();
    const std::size_t n_cand = plan.candidates.size();
    Tensor scratch;
    void *d = p.c;
    if (p.beta != 0.0) {
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
        const bool faster = pass1[static_cast<std::size_t>(best)] < pass1[0] * (1.0 - kTuningMargin) &&
                            best2 > 0.0 && best2 < first2 * (1.0 - kTuningMargin);
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

/// BGRADB: the fused epilogue with its tuned algorithm against the plain GEMM (its own tuned plan) followed by the
/// separate column sum, both on p's operands (beta is 0 for BGRADB, so they write p.c and p.bias, which the real call
/// overwrites). Called under plan.mutex, stream not capturing.
void DecideBGradB(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const cudaStream_t stream = ctx.stream();
    const GemmParams plain_params = PlainParams(p);
    plan.plain = GetPlan(plain_params, ctx);
    const Tensor flush = ColdFlushBuffer(p, ctx);
    CandidateTimer events(stream, flush.defined() ? flush.data() : nullptr, flush.defined() ? flush.nbytes() : 0);
    auto fused = [&] { return Launch(plan, plan.algo, p, p.c, ctx, stream) == CUBLAS_STATUS_SUCCESS; };
    auto separate = [&] {
        RunPlain(plain_params, ctx);
        RunUnfusedEpilogue(p, ctx, ReduceImpl::kVectorized);
        return true;
    };
    const double fused_single = events.Time(1, fused);
    SHARDLINE_CHECK_AS(CudaError, fused_single > 0.0, kOp, "the tuned BGRADB algorithm failed for {}", plan.key);
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
    plan.bgradb_fused_us = fused_us;
    plan.bgradb_separate_us = separate_us;
    plan.bgradb_separate = !(fused_us < separate_us * (1.0 - kTuningMargin));
}

void CountBGradB(const LtPlan &plan) {
    if (plan.bgradb_separate) {
        detail::GemmCounters().bgradb_separate.fetch_add(1);
    } else {
        detail::GemmCounters().bgradb_fused.fetch_add(1);
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
    r.bgradb_separate = plan.bgradb_separate;
    r.bgradb_fused_us = plan.bgradb_fused_us;
    r.bgradb_separate_us = plan.bgradb_separate_us;
    return r;
}

/// Tunes a plan built during a capture, or just built outside one (under plan.mutex).
void TuneNow(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    TuneCandidates(plan, p, ctx);
    if (p.epilogue == GemmEpilogue::kBGradB) {
        DecideBGradB(plan, p, ctx);
        CountBGradB(plan);
    }
    plan.needs_tuning = false;
    detail::StoreTuningRecord(MakeRecord(plan, Identity(ctx.device())));
}

/// Builds the plan for p: descriptors, epilogue attributes (with this call's pointers, whose alignment the heuristic
/// reads), then the algorithm (tuning-cache record, timed candidates or the heuristic's first pick).
std::shared_ptr<LtPlan> BuildPlan(const GemmParams &p, const GemmPlanKey &key, CudaContext &ctx) {
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
    const cublasComputeType_t compute = GemmComputeType(p, ctx);
    // alpha/beta are float for every dtype here: the compute type is 32F (or 32F_FAST_TF32).
    cublasLtMatmulDesc_t raw_desc = nullptr;
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F));
    plan->desc.reset(raw_desc);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, LtEpilogue(p));
    if (p.epilogue != GemmEpilogue::kNone && p.bias != nullptr) {
        plan->set_bias = true;
        plan->bias_ptr = p.bias;
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                static_cast<std::int32_t>(CudaDataType(p.bias_type, kOp)));
    }
    if (p.epilogue == GemmEpilogue::kGeluAuxBias || p.epilogue == GemmEpilogue::kDGeluBGrad) {
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

    const GemmTuningOptions options = CurrentGemmTuningOptions();
    const DeviceIdentity &id = Identity(ctx.device());

    // 1. A tuning-cache record: no heuristic query, no timing.
    if (std::optional<GemmTuningRecord> record = detail::FindTuningRecord(id.gpu, id.cublaslt_version, plan->key)) {
        cublasLtMatmulAlgo_t algo{};
        std::memcpy(&algo, record->algo.data(), sizeof(algo));
        cublasLtMatmulHeuristicResult_t check{};
        const cublasStatus_t status = cublasLtMatmulAlgoCheck(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(),
                                                              plan->c.get(), plan->c.get(), &algo, &check);
        if (status == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= ctx.workspace_bytes()) {
            plan->algo = algo;
            plan->usable = true;
            plan->tuned = true;
            plan->from_file = true;
            plan->candidate_count = record->candidates;
            plan->chosen = record->chosen;
            plan->chosen_us = record->chosen_us;
            plan->first_us = record->first_us;
            plan->bgradb_separate = record->bgradb_separate;
            plan->bgradb_fused_us = record->bgradb_fused_us;
            plan->bgradb_separate_us = record->bgradb_separate_us;
            if (p.epilogue == GemmEpilogue::kBGradB) {
                if (plan->bgradb_separate) {
                    plan->plain = GetPlan(PlainParams(p), ctx);
                }
                CountBGradB(*plan);
            }
            detail::GemmCounters().file_hits.fetch_add(1);
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
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);

    const int wanted = options.enabled ? options.top_k : 1;
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(wanted));
    int returned = 0;
    detail::GemmCounters().heuristic_queries.fetch_add(1);
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), plan->c.get(),
                                       plan->c.get(), raw_pref, wanted, results.data(), &returned);
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
        if (cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), plan->c.get(),
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
        } else {
            std::lock_guard lock(plan->mutex);
            TuneNow(*plan, p, ctx);
        }
    } else if (p.epilogue == GemmEpilogue::kBGradB) {
        CountBGradB(*plan); // untuned: the fused epilogue, one launch
    }
    return plan;
}

std::shared_ptr<LtPlan> GetPlan(const GemmParams &p, CudaContext &ctx) {
    const GemmPlanKey key = MakeGemmPlanKey(p, ctx.allow_tf32(), ctx.workspace_bytes());
    PlanCache &cache = ThePlanCache();
    {
        std::lock_guard lock(cache.mutex);
        if (auto it = cache.plans.find(key); it != cache.plans.end()) {
            return it->second;
        }
    }
    // Built outside the cache lock: tuning takes milliseconds once per key, and other keys (other threads, other
    // devices) must not wait for it. Two threads racing on one new key both build; the first insert wins.
    std::shared_ptr<LtPlan> plan = BuildPlan(p, key, ctx);
    std::lock_guard lock(cache.mutex);
    return cache.plans.emplace(key, std::move(plan)).first->second;
}

/// Under plan.mutex: points the descriptor at p's vectors and tunes a plan that was built during a capture, once the
/// stream is no longer captured.
void Prepare(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    PointAt(plan, p);
    if (plan.needs_tuning && !StreamCapturing(ctx.stream())) [[unlikely]] {
        TuneNow(plan, p, ctx);
    }
}

/// Runs a usable plan: its algorithm, or for a BGRADB plan that measured slower fused, the plain plan followed by the
/// separate column sum.
void Execute(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    std::unique_lock lock(plan.mutex);
    Prepare(plan, p, ctx);
    if (!plan.bgradb_separate) {
        SHARDLINE_CHECK_CUBLAS(Launch(plan, plan.algo, p, p.c, ctx, ctx.stream()));
        return;
    }
    const std::shared_ptr<LtPlan> plain = plan.plain;
    lock.unlock();
    if (plain != nullptr && plain->usable) {
        Execute(*plain, PlainParams(p), ctx);
    } else {
        RunPlain(p, ctx);
    }
    RunUnfusedEpilogue(p, ctx, ReduceImpl::kVectorized);
}

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

void CublasLtGemm(const GemmParams &p) {
    CheckCudaGemm(p, kOp);
    CudaContext &ctx = CudaContext::Get(p.device.index);
    if (p.m == 0 || p.n == 0 || p.k == 0) {
        RunDegenerateGemm(p, ctx, ReduceImpl::kVectorized);
        return;
    }
    if (p.epilogue == GemmEpilogue::kNone) {
        RunPlain(p, ctx);
        return;
    }
    const std::shared_ptr<LtPlan> plan = GetPlan(p, ctx);
    if (plan->usable) {
        Execute(*plan, p, ctx);
        return;
    }
    RunPlain(p, ctx);
    RunUnfusedEpilogue(p, ctx, ReduceImpl::kVectorized);
}

} // namespace

void DefaultCudaGemm(const GemmParams &params) {
    CublasLtGemm(params);
}

bool BGradBFused(const GemmParams &params) {
    CheckCudaGemm(params, kOp);
    if (params.epilogue != GemmEpilogue::kBGradB || params.m == 0 || params.n == 0 || params.k == 0) {
        return false;
    }
    CudaContext &ctx = CudaContext::Get(params.device.index);
    const std::shared_ptr<LtPlan> plan = GetPlan(params, ctx);
    if (!plan->usable) {
        return false;
    }
    std::lock_guard lock(plan->mutex);
    Prepare(*plan, params, ctx);
    return !plan->bgradb_separate;
}

void ClearPlanCache() {
    PlanCache &cache = ThePlanCache();
    std::lock_guard lock(cache.mutex);
    cache.plans.clear();
    cache.warned.clear();
}

std::vector<GemmPlanInfo> PlanInfos() {
    std::vector<std::shared_ptr<LtPlan>> plans;
    {
        PlanCache &cache = ThePlanCache();
        std::lock_guard lock(cache.mutex);
        for (const auto &[key, plan] : cache.plans) {
            plans.push_back(plan);
        }
    }
    std::vector<GemmPlanInfo> infos;
    infos.reserve(plans.size());
    for (const std::shared_ptr<LtPlan> &plan : plans) {
        std::lock_guard lock(plan->mutex);
        infos.push_back(GemmPlanInfo{.key = plan->key,
                                     .usable = plan->usable,
                                     .tuned = plan->tuned,
                                     .from_file = plan->from_file,
                                     .candidates = plan->candidate_count,
                                     .chosen = plan->chosen,
                                     .chosen_us = plan->chosen_us,
                                     .first_us = plan->first_us,
                                     .bgradb_separate = plan->bgradb_separate,
                                     .bgradb_fused_us = plan->bgradb_fused_us,
                                     .bgradb_separate_us = plan->bgradb_separate_us,
                                     .chosen_small_workspace = plan->tuned && !plan->from_file &&
                                                               plan->chosen >= plan->full_workspace_candidates});
    }
    std::sort(infos.begin(), infos.end(), [](const GemmPlanInfo &a, const GemmPlanInfo &b) { return a.key < b.key; });
    return infos;
}

} // namespace shardline::kernels::cuda
