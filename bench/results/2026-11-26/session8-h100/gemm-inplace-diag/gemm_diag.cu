// Diagnostic (not part of the project): which cuBLASLt algorithms round the product to bf16 before adding C (beta=1).
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#define CK(x)                                                                                                          \
    do {                                                                                                               \
        auto s_ = (x);                                                                                                 \
        if ((int)s_ != 0) {                                                                                            \
            printf("error %d at %s:%d\n", (int)s_, __FILE__, __LINE__);                                                \
        }                                                                                                              \
    } while (0)
static double bf(double v) { return (double)__bfloat162float(__float2bfloat16((float)v)); }
int main(int argc, char** argv) {
    int m = 24, n = 200, k = 64;
    bool tb = true;
    if (argc >= 4) {
        m = atoi(argv[1]);
        n = atoi(argv[2]);
        k = atoi(argv[3]);
    }
    if (argc >= 5) {
        tb = atoi(argv[4]) != 0;
    }
    std::mt19937_64 rng(3101);
    std::normal_distribution<double> nd(0, 1);
    std::uniform_int_distribution<int> sm(0, 2);
    std::uniform_real_distribution<double> nudge(-0.01, 0.01);
    std::vector<__nv_bfloat16> ha(m * k), hb(n * k), hc(m * n);
    std::vector<double> a(m * k), b(n * k), c0(m * n), want(m * n);
    for (int i = 0; i < m * k; ++i) {
        a[i] = bf(nd(rng));
        ha[i] = __float2bfloat16((float)a[i]);
    }
    for (int i = 0; i < n * k; ++i) {
        b[i] = sm(rng);
        hb[i] = __float2bfloat16((float)b[i]);
    }
    for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
            double s = 0;
            for (int l = 0; l < k; ++l) {
                s += a[l * m + i] * (tb ? b[l * n + j] : b[j * k + l]);
            }
            c0[j * m + i] = bf(-s + nudge(rng));
            hc[j * m + i] = __float2bfloat16((float)c0[j * m + i]);
            want[j * m + i] = c0[j * m + i] + s;
        }
    }
    void *da, *db, *dc, *dd, *ws;
    size_t wsb = 32 << 20;
    cudaMalloc(&da, m * k * 2);
    cudaMalloc(&db, n * k * 2);
    cudaMalloc(&dc, m * n * 2);
    cudaMalloc(&dd, m * n * 2);
    cudaMalloc(&ws, wsb);
    cudaMemcpy(da, ha.data(), m * k * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb.data(), n * k * 2, cudaMemcpyHostToDevice);
    auto bad = [&](void* out) {
        std::vector<__nv_bfloat16> h(m * n);
        cudaMemcpy(h.data(), out, m * n * 2, cudaMemcpyDeviceToHost);
        int over = 0;
        double worst = 0;
        for (int e = 0; e < m * n; ++e) {
            double g = __bfloat162float(h[e]);
            double w = want[e];
            double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(w), 1e-30)) - 7);
            double r = std::abs(g - w) / (ulp + 1e-6);
            if (r > 1) {
                ++over;
            }
            worst = std::max(worst, r);
        }
        return std::make_pair(over, worst);
    };
    cublasLtHandle_t lt;
    CK(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t desc;
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t opn = CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opn, sizeof(opn)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    cublasLtMatrixLayout_t la, lb, lc;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, m));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? n : k, tb ? k : n, tb ? n : k));
    CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m));
    float alpha = 1, beta = 1;
    for (int masked = 0; masked < 2; ++masked) {
        cublasLtMatmulPreference_t pref;
        CK(cublasLtMatmulPreferenceCreate(&pref));
        CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        if (masked) {
            uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
            CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                    sizeof(mask)));
        }
        cublasLtMatmulHeuristicResult_t res[32];
        int ret = 0;
        CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, res, &ret));
        printf("== m=%d n=%d k=%d %s masked=%d: %d algos\n", m, n, k, tb ? "nt" : "nn", masked, ret);
        for (int r = 0; r < ret; ++r) {
            int id = 0, tile = 0, splitk = 0, stages = 0, swz = 0, cust = 0;
            uint32_t red = 0;
            size_t w = 0;
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk),
                                                 &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red),
                                                 &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages),
                                                 &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz),
                                                 &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[r].algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &cust, sizeof(cust),
                                                 &w);
            for (int inplace = 1; inplace >= 0; --inplace) {
                cudaMemcpy(dc, hc.data(), m * n * 2, cudaMemcpyHostToDevice);
                cudaMemcpy(dd, hc.data(), m * n * 2, cudaMemcpyHostToDevice);
                void* out = inplace ? dc : dd;
                auto st =
                    cublasLtMatmul(lt, desc, &alpha, da, la, db, lb, &beta, dc, lc, out, lc, &res[r].algo, ws, wsb, 0);
                cudaDeviceSynchronize();
                auto [over, worst] = bad(out);
                printf("  #%d id=%d tile=%d splitk=%d red=%u stages=%d swz=%d custom=%d ws=%zu %s: status %d, %d of %d "
                       "over, worst %.1f ulp\n",
                       r, id, tile, splitk, red, stages, swz, cust, res[r].workspaceSize, inplace ? "C=D" : "C!=D",
                       (int)st, over, m * n, worst);
            }
        }
    }
    // cublasGemmEx
    cublasHandle_t h;
    CK(cublasCreate(&h));
    cudaMemcpy(dc, hc.data(), m * n * 2, cudaMemcpyHostToDevice);
    CK(cublasGemmEx(h, CUBLAS_OP_N, opb, m, n, k, &alpha, da, CUDA_R_16BF, m, db, CUDA_R_16BF, tb ? n : k, &beta, dc,
                    CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    cudaDeviceSynchronize();
    auto [o2, w2] = bad(dc);
    printf("cublasGemmEx: %d over, worst %.1f ulp\n", o2, w2);
    return 0;
}
