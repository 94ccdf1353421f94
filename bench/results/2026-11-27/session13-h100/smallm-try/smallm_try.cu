// Diagnostic: CUTLASS 4.2's SM90 TMA warp-specialized GEMM with the stream-K / split-K tile scheduler for the
// small-M decode forward y = x·Wᵀ + b (bf16, fp32 accumulate, per-row bias in the epilogue of the column-major
// D = W·xᵀ), against cuBLASLt's first pick with the BIAS epilogue, both under a CUDA graph over enough weight copies
// that W streams from HBM. One tile config per binary (-DCFG=1..4), several scheduler settings per run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#define CK(x)                                                                                                          \
    do {                                                                                                               \
        auto s_ = (x);                                                                                                 \
        if ((int)s_ != 0) {                                                                                            \
            printf("error %d at %s:%d\n", (int)s_, __FILE__, __LINE__);                                                \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
using bf = cutlass::bfloat16_t;
using namespace cute;
#if CFG == 1
using CtaTile = Shape<_128, _32, _128>;
#define CFGNAME "coop 128x32x128"
#elif CFG == 2
using CtaTile = Shape<_128, _64, _128>;
#define CFGNAME "coop 128x64x128"
#elif CFG == 3
using CtaTile = Shape<_128, _16, _256>;
#define CFGNAME "coop 128x16x256"
#else
using CtaTile = Shape<_128, _32, _256>;
#define CFGNAME "coop 128x32x256"
#endif
using Cluster = Shape<_1, _1, _1>;
using LayoutA = cutlass::layout::RowMajor;    // W [N_out, K]: K contiguous
using LayoutB = cutlass::layout::ColumnMajor; // xᵀ [K, M_tok]: K contiguous
using LayoutC = cutlass::layout::ColumnMajor; // D [N_out, M_tok] = y [M_tok, N_out] row-major
using Fusion = cutlass::epilogue::fusion::LinCombPerRowBias<bf, float, bf, bf, float>;
using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, CtaTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, bf, LayoutC, 8, bf, LayoutC, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
using Main = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf, LayoutA, 8, bf, LayoutB, 8, float, CtaTile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel =
    cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, cutlass::gemm::StreamKScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using Mode = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;
using Reduction = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::ReductionMode;

__global__ void Fill(__nv_bfloat16 *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        p[i] = __float2bfloat16(((int)(h % 2001) - 1000) / 1000.0f);
    }
}
struct Setting {
    const char *name;
    Mode mode;
    int splits;
    Reduction red;
};

int main(int argc, char **argv) {
    std::vector<long> sh; // triples N M K
    for (int i = 1; i < argc; ++i) {
        sh.push_back(atol(argv[i]));
    }
    const Setting settings[] = {
        {"heuristic", Mode::Heuristic, 1, Reduction::Deterministic},
        {"streamk det", Mode::StreamK, 1, Reduction::Deterministic},
        {"streamk nondet", Mode::StreamK, 1, Reduction::Nondeterministic},
        {"data-parallel", Mode::DataParallel, 1, Reduction::Deterministic},
        {"splitk 2", Mode::SplitK, 2, Reduction::Deterministic},
        {"splitk 4", Mode::SplitK, 4, Reduction::Deterministic},
        {"splitk 8", Mode::SplitK, 8, Reduction::Deterministic},
        {"splitk 11", Mode::SplitK, 11, Reduction::Deterministic},
        {"splitk 16", Mode::SplitK, 16, Reduction::Deterministic},
        {"splitk 8 nd", Mode::SplitK, 8, Reduction::Nondeterministic},
        {"splitk 16 nd", Mode::SplitK, 16, Reduction::Nondeterministic},
    };
    cublasLtHandle_t lt;
    CK(cublasLtCreate(&lt));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    void *ws;
    const size_t wsb = size_t(256) << 20;
    CK(cudaMalloc(&ws, wsb));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    printf("# %s, %d SMs\n", CFGNAME, hw.sm_count);
    for (size_t s = 0; s + 2 < sh.size(); s += 3) {
        const long N = sh[s], M = sh[s + 1], K = sh[s + 2];
        const size_t wbytes = (size_t)N * K * 2;
        const int sets = (int)std::min<size_t>(64, std::max<size_t>(8, (200u << 20) / wbytes + 1));
        std::vector<__nv_bfloat16 *> w(sets), x(sets), y(sets), b(sets);
        for (int i = 0; i < sets; ++i) {
            CK(cudaMalloc(&w[i], wbytes));
            CK(cudaMalloc(&x[i], M * K * 2));
            CK(cudaMalloc(&y[i], M * N * 2));
            CK(cudaMalloc(&b[i], N * 2));
            Fill<<<1024, 256>>>(w[i], N * K, 1 + 4 * i);
            Fill<<<1024, 256>>>(x[i], M * K, 2 + 4 * i);
            Fill<<<1024, 256>>>(b[i], N, 3 + 4 * i);
        }
        CK(cudaDeviceSynchronize());
        std::vector<__nv_bfloat16> hw_(N * K), hx(M * K), hb(N), hy(M * N);
        CK(cudaMemcpy(hw_.data(), w[0], wbytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hx.data(), x[0], M * K * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hb.data(), b[0], N * 2, cudaMemcpyDeviceToHost));
        std::vector<double> ref(M * N);
        for (long m = 0; m < M; ++m) {
            for (long n = 0; n < N; ++n) {
                double a = __bfloat162float(hb[n]);
                for (long k = 0; k < K; ++k) {
                    a += (double)__bfloat162float(hw_[n * K + k]) * __bfloat162float(hx[m * K + k]);
                }
                ref[m * N + n] = a;
            }
        }
        // cuBLASLt first pick, BIAS epilogue: D [N, M] column-major = Wᵀ(as K×N col-major, transposed) · xᵀ (K×M).
        cublasLtMatrixLayout_t la, lb, lc;
        CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
        CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
        CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
        cublasLtMatmulDesc_t d;
        CK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        int32_t bt = CUDA_R_16BF;
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
        const void *bp = b[0];
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
        cublasLtMatmulPreference_t pref;
        CK(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsz = 32 << 20;
        CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)));
        cublasLtMatmulHeuristicResult_t hr;
        int got = 0;
        CK(cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, pref, 1, &hr, &got));
        const float one = 1, zero = 0;
        auto lt_run = [&](int i) {
            const void *p = b[i];
            cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p, sizeof(p));
            return cublasLtMatmul(lt, d, &one, w[i], la, x[i], lb, &zero, y[i], lc, y[i], lc, &hr.algo, ws, wsb, st) ==
                   CUBLAS_STATUS_SUCCESS;
        };
        const double floor = (wbytes + 2.0 * (M * K + M * N + N)) / 3.01e6;
        printf("== N %ld M %ld K %ld: %d sets of %.1f MB, floor %.2f us, limit %.2f us\n", N, M, K, sets, wbytes / 1e6,
               floor, 1.25 * floor + 3);
        std::vector<Gemm> ops(sets);
        for (int c = -1; c < (int)(sizeof(settings) / sizeof(settings[0])); ++c) {
            std::vector<typename Gemm::Arguments> args(sets);
            bool ok = true;
            size_t need = 0;
            if (c >= 0) {
                for (int i = 0; i < sets; ++i) {
                    auto sa =
                        cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape((int)N, (int)K, 1));
                    auto sb =
                        cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape((int)M, (int)K, 1));
                    auto sc =
                        cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape((int)N, (int)M, 1));
                    auto sd =
                        cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape((int)N, (int)M, 1));
                    typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                               {(int)N, (int)M, (int)K, 1},
                                               {(bf *)w[i], sa, (bf *)x[i], sb},
                                               {{}, (bf *)y[i], sc, (bf *)y[i], sd},
                                               hw};
                    a.epilogue.thread.alpha = 1.0f;
                    a.epilogue.thread.beta = 0.0f;
                    a.epilogue.thread.bias_ptr = (bf *)b[i];
                    a.scheduler.decomposition_mode = settings[c].mode;
                    a.scheduler.splits = settings[c].splits;
                    a.scheduler.reduction_mode = settings[c].red;
                    if (Gemm::can_implement(a) != cutlass::Status::kSuccess) {
                        ok = false;
                    }
                    need = std::max(need, Gemm::get_workspace_size(a));
                    args[i] = a;
                }
            }
            const char *name = c < 0 ? "cublasLt first" : settings[c].name;
            if (!ok || need * sets > wsb) {
                printf("%-16s cannot run (workspace %zu)\n", name, need);
                continue;
            }
            auto run = [&](int i) {
                if (c < 0) {
                    return lt_run(i);
                }
                char *wsp = (char *)ws + need * i;
                if (ops[i].initialize(args[i], wsp, st) != cutlass::Status::kSuccess) {
                    return false;
                }
                return ops[i].run(st) == cutlass::Status::kSuccess;
            };
            CK(cudaMemsetAsync(y[0], 0xFF, M * N * 2, st));
            if (!run(0)) {
                printf("%-16s cannot run\n", name);
                continue;
            }
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(hy.data(), y[0], M * N * 2, cudaMemcpyDeviceToHost));
            double err = 0;
            for (long i = 0; i < M * N; ++i) {
                double v = __bfloat162float(hy[i]);
                err = std::isfinite(v) ? std::max(err, std::fabs(v - ref[i]) / (std::fabs(ref[i]) + 1)) : 1e9;
            }
            for (int i = 0; i < 200; ++i) {
                run(i % sets);
            }
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < 2 * sets; ++i) {
                run(i % sets);
            }
            CK(cudaStreamEndCapture(st, &g));
            cudaGraphExec_t ge;
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, st));
            std::vector<double> tv;
            for (int r = 0; r < 7; ++r) {
                CK(cudaEventRecord(e0, st));
                for (int k = 0; k < 10; ++k) {
                    CK(cudaGraphLaunch(ge, st));
                }
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                tv.push_back(1000.0 * ms / (10 * 2 * sets));
            }
            std::sort(tv.begin(), tv.end());
            printf("%-16s %7.2f us/call %s  %5.2f TB/s  ws %zu  maxrelerr %.2e\n", name, tv[3],
                   tv[3] <= 1.25 * floor + 3 ? "MEETS" : "     ", wbytes / tv[3] / 1e6, need, err);
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
        }
        fflush(stdout);
        for (int i = 0; i < sets; ++i) {
            cudaFree(w[i]);
            cudaFree(x[i]);
            cudaFree(y[i]);
            cudaFree(b[i]);
        }
        cublasLtMatmulDescDestroy(d);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
    }
    return 0;
}
