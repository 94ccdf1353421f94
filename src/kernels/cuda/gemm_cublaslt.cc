// The default provider's Gemm: cuBLASLt with fused epilogues, one cached plan per problem key.
//
// A plan (matmul descriptor, the three layouts and the heuristic's algorithm) is built on the first call with a
// given key and reused: a repeated call makes no heuristic query and creates no descriptor; it only points the
// descriptor at this call's bias/aux vectors and launches. When cuBLASLt offers no algorithm for a fused epilogue
// (or the problem is outside what the epilogues support, see FusedIneligibleReason), the plan says so, one warning
// is logged for that key, and every call runs the plain GEMM followed by the separate epilogue kernels.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <cublasLt.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/kernels/gemm.h>

#include "cuda_ops.h"
#include "gemm_common.h"

// Log lines are formatted by fmt::format and given to spdlog as finished strings: spdlog's own formatting overloads
// instantiate fmt 9's float formatter in this file, which g++ 13 -O3 flags with a false -Warray-bounds.

namespace shardline::kernels::cuda {
namespace {

constexpr std::string_view kOp = GemmOp::kName;

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

/// The largest power of two ≤ 16 dividing the address (and, when batched, the batch stride in bytes): cuBLASLt picks
/// vectorised kernels by operand alignment, so the alignment class is part of the plan key.
std::uint8_t AlignmentClass(const void *ptr, std::int64_t batch, std::int64_t stride_elems, DType dtype) {
    std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(ptr);
    if (batch > 1) {
        bits |= static_cast<std::uintptr_t>(stride_elems) * ElementSize(dtype);
    }
    if (bits == 0) {
        return 16;
    }
    const std::uintptr_t low = bits & (~bits + 1);
    return static_cast<std::uint8_t>(low >= 16 ? 16 : low);
}

// ---------------------------------------------------------------------------------------------------------------------
// Plan cache

struct PlanKey {
    int device = 0;
    int compute = 0;
    bool trans_a = false;
    bool trans_b = false;
    bool has_bias = false;
    GemmEpilogue epilogue = GemmEpilogue::kNone;
    DType a_type = DType::kFloat32;
    DType b_type = DType::kFloat32;
    DType c_type = DType::kFloat32;
    DType bias_type = DType::kFloat32;
    std::uint8_t align_a = 0;
    std::uint8_t align_b = 0;
    std::uint8_t align_c = 0;
    std::uint8_t align_bias = 0;
    std::uint8_t align_aux = 0;
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;
    std::int64_t lda = 0;
    std::int64_t ldb = 0;
    std::int64_t ldc = 0;
    std::int64_t ldaux = 0;
    std::int64_t batch = 1;
    std::int64_t stride_a = 0;
    std::int64_t stride_b = 0;
    std::int64_t stride_c = 0;

    bool operator==(const PlanKey &) const = default;
};

struct PlanKeyHash {
    std::size_t operator()(const PlanKey &key) const noexcept {
        std::uint64_t h = 0xcbf29ce484222325ULL;
        auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
        mix(static_cast<std::uint64_t>(key.device));
        mix(static_cast<std::uint64_t>(key.compute));
        mix((static_cast<std::uint64_t>(key.trans_a) << 0) | (static_cast<std::uint64_t>(key.trans_b) << 1) |
            (static_cast<std::uint64_t>(key.has_bias) << 2) | (static_cast<std::uint64_t>(key.epilogue) << 8) |
            (static_cast<std::uint64_t>(key.a_type) << 16) | (static_cast<std::uint64_t>(key.b_type) << 24) |
            (static_cast<std::uint64_t>(key.c_type) << 32) | (static_cast<std::uint64_t>(key.bias_type) << 40));
        mix((static_cast<std::uint64_t>(key.align_a) << 0) | (static_cast<std::uint64_t>(key.align_b) << 8) |
            (static_cast<std::uint64_t>(key.align_c) << 16) | (static_cast<std::uint64_t>(key.align_bias) << 24) |
            (static_cast<std::uint64_t>(key.align_aux) << 32));
        for (std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.ldaux, key.batch, key.stride_a,
                               key.stride_b, key.stride_c}) {
            mix(static_cast<std::uint64_t>(v));
        }
        return static_cast<std::size_t>(h);
    }
};

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
};

struct PlanCache {
    std::mutex mutex;
    std::unordered_map<PlanKey, std::shared_ptr<LtPlan>, PlanKeyHash> plans;
};

PlanCache &ThePlanCache() {
    // Never destroyed: plans hold cuBLASLt objects, and releasing them during static destruction would race the
    // library's own teardown.
    static PlanCache *cache = new PlanCache();
    return *cache;
}

PlanKey MakeKey(const GemmParams &p, const CudaContext &ctx) {
    const bool epilogue = p.epilogue != GemmEpilogue::kNone;
    const bool has_aux = p.epilogue == GemmEpilogue::kGeluAuxBias || p.epilogue == GemmEpilogue::kDGeluBGrad;
    const bool has_bias = epilogue && p.bias != nullptr;
    PlanKey key;
    key.device = ctx.device();
    key.compute = static_cast<int>(GemmComputeType(p, ctx));
    key.trans_a = p.trans_a;
    key.trans_b = p.trans_b;
    key.has_bias = has_bias;
    key.epilogue = p.epilogue;
    key.a_type = p.a_type;
    key.b_type = p.b_type;
    key.c_type = p.c_type;
    key.bias_type = has_bias ? p.bias_type : DType::kFloat32;
    key.align_a = AlignmentClass(p.a, p.batch_count, p.stride_a, p.a_type);
    key.align_b = AlignmentClass(p.b, p.batch_count, p.stride_b, p.b_type);
    key.align_c = AlignmentClass(p.c, p.batch_count, p.stride_c, p.c_type);
    key.align_bias = has_bias ? AlignmentClass(p.bias, 1, 0, p.bias_type) : 0;
    key.align_aux = has_aux ? AlignmentClass(p.aux, 1, 0, p.c_type) : 0;
    key.m = p.m;
    key.n = p.n;
    key.k = p.k;
    key.lda = p.lda;
    key.ldb = p.ldb;
    key.ldc = p.ldc;
    key.ldaux = has_aux ? p.ldaux : 0;
    key.batch = p.batch_count;
    key.stride_a = p.batch_count > 1 ? p.stride_a : 0;
    key.stride_b = p.batch_count > 1 ? p.stride_b : 0;
    key.stride_c = p.batch_count > 1 ? p.stride_c : 0;
    return key;
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

/// Builds the plan for p: descriptors, epilogue attributes (with this call's pointers, whose alignment the
/// heuristic reads) and the heuristic's first algorithm.
std::shared_ptr<LtPlan> BuildPlan(const GemmParams &p, CudaContext &ctx) {
    auto plan = std::make_shared<LtPlan>();
    if (const std::string reason = FusedIneligibleReason(p); !reason.empty()) {
        Logger().log(spdlog::level::warn,
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
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
        SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                static_cast<std::int32_t>(CudaDataType(p.bias_type, kOp)));
    }
    if (p.epilogue == GemmEpilogue::kGeluAuxBias || p.epilogue == GemmEpilogue::kDGeluBGrad) {
        plan->set_aux = true;
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

    cublasLtMatmulPreference_t raw_pref = nullptr;
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&raw_pref));
    LtPreference pref(raw_pref);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(ctx.workspace_bytes()));
    const std::uint32_t align_a = AlignmentClass(p.a, p.batch_count, p.stride_a, p.a_type);
    const std::uint32_t align_b = AlignmentClass(p.b, p.batch_count, p.stride_b, p.b_type);
    const std::uint32_t align_c = AlignmentClass(p.c, p.batch_count, p.stride_c, p.c_type);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);

    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), raw_desc, plan->a.get(), plan->b.get(), plan->c.get(),
                                       plan->c.get(), raw_pref, 1, &result, &returned);
    if (status != CUBLAS_STATUS_SUCCESS || returned == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
        if (p.epilogue != GemmEpilogue::kNone) {
            Logger().log(
                spdlog::level::warn,
                fmt::format("Gemm: cuBLASLt has no algorithm for epilogue {} with {} (heuristic: {}): running the "
                            "GEMM and separate epilogue kernels for this shape",
                            GemmEpilogueName(p.epilogue), Describe(p), cublasGetStatusName(status)));
        } else {
            Logger().log(spdlog::level::warn,
                         fmt::format("Gemm: cuBLASLt has no algorithm for {} (heuristic: {}): using "
                                     "cublasGemmStridedBatchedEx for this shape",
                                     Describe(p), cublasGetStatusName(status)));
        }
        return plan;
    }
    plan->algo = result.algo;
    plan->usable = true;
    return plan;
}

std::shared_ptr<LtPlan> GetPlan(const GemmParams &p, CudaContext &ctx) {
    const PlanKey key = MakeKey(p, ctx);
    PlanCache &cache = ThePlanCache();
    std::lock_guard lock(cache.mutex);
    if (auto it = cache.plans.find(key); it != cache.plans.end()) {
        return it->second;
    }
    // Built under the cache lock: a miss costs tens of µs once per key, and concurrent first calls with one key
    // then log one warning, not several.
    std::shared_ptr<LtPlan> plan = BuildPlan(p, ctx);
    cache.plans.emplace(key, plan);
    return plan;
}

void Execute(LtPlan &plan, const GemmParams &p, CudaContext &ctx) {
    const float alpha = static_cast<float>(p.alpha);
    const float beta = static_cast<float>(p.beta);
    std::lock_guard lock(plan.mutex);
    if (plan.set_bias) {
        SetDesc(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
    }
    if (plan.set_aux) {
        SetDesc(plan.desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux);
    }
    // D is written over C (same pointer, same layout).
    SHARDLINE_CHECK_CUBLAS(cublasLtMatmul(ctx.lt_handle(), plan.desc.get(), &alpha, p.a, plan.a.get(), p.b,
                                          plan.b.get(), &beta, p.c, plan.c.get(), p.c, plan.c.get(), &plan.algo,
                                          ctx.workspace(), ctx.workspace_bytes(), ctx.stream()));
}

/// The product without epilogue: cuBLASLt, or cuBLAS when cuBLASLt has nothing for the shape.
void RunPlain(const GemmParams &p, CudaContext &ctx) {
    GemmParams plain = p;
    plain.epilogue = GemmEpilogue::kNone;
    plain.bias = nullptr;
    plain.aux = nullptr;
    plain.ldaux = 0;
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

} // namespace shardline::kernels::cuda
