#pragma once

// Plain cuBLASLt GEMMs, the bench's own descriptors and no shardline kernel: the floors of bench/linear and the
// calibration ceiling (shared/BENCHMARKS.md, outside this repository: an 8192³ bf16 GEMM, best of the heuristic's top
// 8) that every GPU benchmark reports its TF/s against. Header-only; needs CUDA and cuBLASLt.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/dtype.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#include "common/bench_util.h"
#include "core/cuda/cublas_check.h"

namespace shardline::bench {

inline cudaDataType_t LtType(DType d) {
    if (d == DType::kFloat16) {
        return CUDA_R_16F;
    }
    if (d == DType::kBFloat16) {
        return CUDA_R_16BF;
    }
    return CUDA_R_32F;
}

/// One column-major GEMM D[m,n] = op(A)·op(B) with the heuristic's top 8 candidates; with a `bias` (m elements of
/// `dtype`), D = op(A)·op(B) + bias through CUBLASLT_EPILOGUE_BIAS, the call torch's F.linear makes for a Linear
/// forward. The heuristic sees that bias pointer; Run sets the bias of each call on the shared descriptor, as torch
/// sets it per call, so a bias-epilogue floor is not for concurrent use from several threads.
class LtFloor {
public:
    LtFloor(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
            std::int64_t ldb, std::int64_t ldc, DType dtype, DType c_dtype, bool tf32, float beta,
            const void* bias = nullptr)
        : beta_(beta), bias_epilogue_(bias != nullptr) {
        CudaContext& ctx = CudaContext::Current();
        handle_ = ctx.lt_handle();
        const cublasComputeType_t compute =
            dtype == DType::kFloat32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc_, compute, CUDA_R_32F));
        const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
        const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        if (bias_epilogue_) {
            const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
            SHARDLINE_CHECK_CUBLAS(
                cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
            SetBias(bias); // the heuristic reads the bias pointer's alignment
        }
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&a_, LtType(dtype), trans_a ? k : m, trans_a ? m : k, lda));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&b_, LtType(dtype), trans_b ? n : k, trans_b ? k : n, ldb));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&c_, LtType(c_dtype), m, n, ldc));
        workspace_bytes_ = ctx.workspace_bytes();
        SHARDLINE_CHECK_CUDA(cudaMalloc(&workspace_, std::max<std::size_t>(workspace_bytes_, 1)));
        cublasLtMatmulPreference_t pref = nullptr;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
        const std::uint64_t ws = workspace_bytes_;
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        std::vector<cublasLtMatmulHeuristicResult_t> results(8);
        int returned = 0;
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, c_, pref, 8, results.data(), &returned));
        cublasLtMatmulPreferenceDestroy(pref);
        results.resize(static_cast<std::size_t>(returned));
        for (const auto& r : results) {
            if (r.state == CUBLAS_STATUS_SUCCESS) {
                algos_.push_back(r.algo);
            }
        }
        SHARDLINE_CHECK(!algos_.empty(), "bench::LtFloor", "cuBLASLt has no algorithm for m={} n={} k={}", m, n, k);
    }
    ~LtFloor() {
        cudaFree(workspace_);
        cublasLtMatrixLayoutDestroy(a_);
        cublasLtMatrixLayoutDestroy(b_);
        cublasLtMatrixLayoutDestroy(c_);
        cublasLtMatmulDescDestroy(desc_);
    }
    LtFloor(const LtFloor&) = delete;
    LtFloor& operator=(const LtFloor&) = delete;

    std::size_t candidates() const { return algos_.size(); }
    /// `bias` is required with a bias epilogue and ignored without.
    bool Run(std::size_t algo, const void* a, const void* b, void* c, cudaStream_t stream,
             const void* bias = nullptr) const {
        if (bias_epilogue_) {
            SHARDLINE_CHECK(bias != nullptr, "bench::LtFloor", "a bias-epilogue floor needs a bias pointer");
            SetBias(bias);
        }
        const float alpha = 1.0f;
        return cublasLtMatmul(handle_, desc_, &alpha, a, a_, b, b_, &beta_, c, c_, c, c_, &algos_[algo], workspace_,
                              workspace_bytes_, stream) == CUBLAS_STATUS_SUCCESS;
    }

private:
    void SetBias(const void* bias) const {
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }

    cublasLtHandle_t handle_ = nullptr;
    cublasLtMatmulDesc_t desc_ = nullptr;
    cublasLtMatrixLayout_t a_ = nullptr;
    cublasLtMatrixLayout_t b_ = nullptr;
    cublasLtMatrixLayout_t c_ = nullptr;
    void* workspace_ = nullptr;
    std::size_t workspace_bytes_ = 0;
    float beta_ = 0.0f;
    bool bias_epilogue_ = false;
    std::vector<cublasLtMatmulAlgo_t> algos_;
};

/// Median µs of `iters` event-timed runs after `warmup`.
inline double MedianUs(cudaStream_t stream, int warmup, int iters, const std::function<void()>& fn) {
    for (int i = 0; i < warmup; ++i) {
        fn();
    }
    std::vector<cudaEvent_t> ev(static_cast<std::size_t>(2 * iters));
    for (auto& e : ev) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&e));
    }
    for (int i = 0; i < iters; ++i) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(ev[2 * i], stream));
        fn();
        SHARDLINE_CHECK_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> t(static_cast<std::size_t>(iters));
    for (int i = 0; i < iters; ++i) {
        float ms = 0.0f;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        t[static_cast<std::size_t>(i)] = 1000.0 * ms;
    }
    for (auto& e : ev) {
        SHARDLINE_CHECK_CUDA(cudaEventDestroy(e));
    }
    return Percentile(t, 0.5);
}

/// The candidate with the lowest median (2 warm-ups, 5 runs each, rotating over `sets` operand sets as the timed
/// iterations do, so that a problem that fits in L2 is not judged on cached operands) and its time, plus the first
/// pick's.
struct FloorChoice {
    std::size_t best = 0;
    double best_us = 0.0;
    double first_us = 0.0;
};
inline FloorChoice ChooseBest(const LtFloor& f, int sets, const std::function<bool(std::size_t, int)>& run,
                              cudaStream_t stream) {
    FloorChoice choice;
    int rotation = 0;
    for (std::size_t i = 0; i < f.candidates(); ++i) {
        bool ok = true;
        const double us = MedianUs(stream, 2, 5, [&] { ok = run(i, rotation++ % sets) && ok; });
        if (!ok) {
            continue;
        }
        if (i == 0) {
            choice.first_us = us;
        }
        if (choice.best_us == 0.0 || us < choice.best_us) {
            choice.best = i;
            choice.best_us = us;
        }
    }
    return choice;
}

/// The calibration GEMM: C[n,n] = A[n,n]·B[n,n] in bf16 (n = 8192), fp32 accumulation, best of the heuristic's top 8.
struct GemmCeiling {
    std::int64_t n = 8192;
    double median_us = 0.0;         ///< the best candidate, 20 timed runs after 5 warm-ups
    double tflops = 0.0;            ///< 2n³ / median_us: the ceiling
    double first_pick_tflops = 0.0; ///< the heuristic's first pick
    std::size_t best_index = 0;
};
inline GemmCeiling MeasureGemmCeiling(cudaStream_t stream, int device_index = 0) {
    GemmCeiling out;
    const std::int64_t n = out.n;
    const Device gpu = Device::CUDA(device_index);
    Tensor a = Tensor::Empty({n, n}, DType::kBFloat16, gpu);
    Tensor b = Tensor::Empty({n, n}, DType::kBFloat16, gpu);
    Tensor c = Tensor::Empty({n, n}, DType::kBFloat16, gpu);
    FillRandom(a, RandomSpec{.seed = 1, .name = "ceiling_a"});
    FillRandom(b, RandomSpec{.seed = 1, .name = "ceiling_b"});
    // Transposes (T, N), as Linear's forward runs its GEMM; the operands are square, so it is 2n³ flops either way.
    const LtFloor gemm(true, false, n, n, n, n, n, n, DType::kBFloat16, DType::kBFloat16, false, 0.0f);
    const FloorChoice choice = ChooseBest(
        gemm, 1, [&](std::size_t algo, int) { return gemm.Run(algo, a.data(), b.data(), c.data(), stream); }, stream);
    const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
    out.best_index = choice.best;
    out.median_us = MedianUs(stream, 5, 20, [&] { gemm.Run(choice.best, a.data(), b.data(), c.data(), stream); });
    const double first_us = MedianUs(stream, 2, 20, [&] { gemm.Run(0, a.data(), b.data(), c.data(), stream); });
    out.tflops = flops / (out.median_us * 1e-6) / 1e12;
    out.first_pick_tflops = flops / (first_us * 1e-6) / 1e12;
    return out;
}

} // namespace shardline::bench
