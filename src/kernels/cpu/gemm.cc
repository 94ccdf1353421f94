// CPU Gemm: OpenBLAS does the product (one cblas_?gemm per batch entry), plain loops do the epilogue exactly as
// include/shardline/kernels/gemm.h documents it. Everything is column-major, as in cuBLAS: element (i, j) of an
// m×n matrix with leading dimension ld sits at i + j·ld.

#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include <cblas.h>

#include <shardline/core/error.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/math.h"

namespace shardline::kernels::cpu {
namespace {

constexpr std::string_view kOp = GemmOp::kName;

int ToBlasInt(std::int64_t value, std::string_view what) {
    SHARDLINE_CHECK_AS(ShapeError, value <= INT_MAX, kOp, "{} = {} exceeds the 32-bit BLAS interface (max {})", what,
                       value, INT_MAX);
    return static_cast<int>(value);
}

CBLAS_TRANSPOSE BlasTrans(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

void BlasGemm(bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
              float beta, float *c, int ldc) {
    cblas_sgemm(CblasColMajor, BlasTrans(ta), BlasTrans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void BlasGemm(bool ta, bool tb, int m, int n, int k, double alpha, const double *a, int lda, const double *b, int ldb,
              double beta, double *c, int ldc) {
    cblas_dgemm(CblasColMajor, BlasTrans(ta), BlasTrans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/// The bias vector in its own dtype (float32 or float64; checked before any work).
double LoadBias(const void *bias, DType type, std::int64_t i) {
    return type == DType::kFloat64 ? static_cast<const double *>(bias)[i]
                                   : static_cast<double>(static_cast<const float *>(bias)[i]);
}

void StoreBias(void *bias, DType type, std::int64_t i, double value) {
    if (type == DType::kFloat64) {
        static_cast<double *>(bias)[i] = value;
    } else {
        static_cast<float *>(bias)[i] = static_cast<float>(value);
    }
}

/// What the CPU path supports beyond ValidateGemmParams: one float dtype for A, B and C; a float bias; and the
/// aux/bias-grad epilogues on a single matrix (GemmParams carries no aux or bias batch stride).
void CheckCpuParams(const GemmParams &p) {
    const bool float_type = p.a_type == DType::kFloat32 || p.a_type == DType::kFloat64;
    SHARDLINE_CHECK_AS(DTypeError, float_type && p.b_type == p.a_type && p.c_type == p.a_type, kOp,
                       "CPU Gemm takes A, B and C of one dtype, float32 or float64 (half types run on CUDA only), "
                       "got A {}, B {}, C {}",
                       DTypeName(p.a_type), DTypeName(p.b_type), DTypeName(p.c_type));
    const bool compute_ok = p.compute == GemmCompute::kDefault ||
                            (p.compute == GemmCompute::kFloat32 && p.a_type == DType::kFloat32) ||
                            (p.compute == GemmCompute::kFloat64 && p.a_type == DType::kFloat64);
    SHARDLINE_CHECK_AS(DTypeError, compute_ok, kOp,
                       "CPU Gemm computes in the operands' precision: compute type must be default or match A ({}), "
                       "got {}",
                       DTypeName(p.a_type), p.compute == GemmCompute::kFloat32 ? "float32" : "float64");
    if (GemmUsesBias(p)) {
        SHARDLINE_CHECK_AS(DTypeError, p.bias_type == DType::kFloat32 || p.bias_type == DType::kFloat64, kOp,
                           "CPU Gemm epilogue {} needs a float32 or float64 bias, got {}", GemmEpilogueName(p.epilogue),
                           DTypeName(p.bias_type));
    }
    const bool single_matrix_epilogue = GemmEpilogueHasAux(p.epilogue) || p.epilogue == GemmEpilogue::kBGradB;
    SHARDLINE_CHECK_AS(ShapeError, !single_matrix_epilogue || p.batch_count == 1, kOp,
                       "epilogue {} needs batch_count 1 (no aux/bias batch stride), got batch_count {}",
                       GemmEpilogueName(p.epilogue), p.batch_count);
    ToBlasInt(p.m, "m");
    ToBlasInt(p.n, "n");
    ToBlasInt(p.k, "k");
    ToBlasInt(p.lda, "lda");
    ToBlasInt(p.ldb, "ldb");
    ToBlasInt(p.ldc, "ldc");
}

/// D = alpha·op(A)·op(B) + beta·C for one batch entry (D over C). k = 0 leaves D = beta·C; beta = 0 never reads C.
template <class T> void Product(const GemmParams &p, const T *a, const T *b, T *c) {
    if (p.m == 0 || p.n == 0) {
        return;
    }
    if (p.k == 0) {
        const T beta = static_cast<T>(p.beta);
        for (std::int64_t j = 0; j < p.n; ++j) {
            T *col = c + j * p.ldc;
            for (std::int64_t i = 0; i < p.m; ++i) {
                col[i] = p.beta == 0.0 ? T(0) : beta * col[i];
            }
        }
        return;
    }
    BlasGemm(p.trans_a, p.trans_b, static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k),
             static_cast<T>(p.alpha), a, static_cast<int>(p.lda), b, static_cast<int>(p.ldb), static_cast<T>(p.beta), c,
             static_cast<int>(p.ldc));
}

template <class T> void Epilogue(const GemmParams &p, const T *b, T *d) {
    const std::int64_t m = p.m;
    const std::int64_t n = p.n;
    switch (p.epilogue) {
    case GemmEpilogue::kNone:
        return;
    case GemmEpilogue::kBias: {
        // D[i, j] += bias[i]: one bias entry per row of the column-major D.
        std::vector<T> bias(static_cast<std::size_t>(m));
        for (std::int64_t i = 0; i < m; ++i) {
            bias[i] = static_cast<T>(LoadBias(p.bias, p.bias_type, i));
        }
        for (std::int64_t j = 0; j < n; ++j) {
            T *col = d + j * p.ldc;
            for (std::int64_t i = 0; i < m; ++i) {
                col[i] += bias[i];
            }
        }
        return;
    }
    case GemmEpilogue::kGeluAuxBias: {
        // aux = D + bias[i] (the pre-activation), D = gelu_tanh(aux). GELU reads the stored (rounded) aux, which the
        // backward reads too: the same values as a bias GEMM followed by GeluForward, bit for bit.
        T *aux = static_cast<T *>(p.aux);
        for (std::int64_t j = 0; j < n; ++j) {
            T *col = d + j * p.ldc;
            T *aux_col = aux + j * p.ldaux;
            for (std::int64_t i = 0; i < m; ++i) {
                const double pre =
                    static_cast<double>(col[i]) + (p.bias != nullptr ? LoadBias(p.bias, p.bias_type, i) : 0.0);
                aux_col[i] = static_cast<T>(pre);
                col[i] = static_cast<T>(GeluTanh(static_cast<double>(aux_col[i])));
            }
        }
        return;
    }
    case GemmEpilogue::kBGradB: {
        // bias[j] = Σ_k op(B)[k, j]. op(B) = B (k×n, column j contiguous) or Bᵀ (B stored n×k, row j strided).
        std::vector<double> sum(static_cast<std::size_t>(n), 0.0);
        if (!p.trans_b) {
            for (std::int64_t j = 0; j < n; ++j) {
                const T *col = b + j * p.ldb;
                double acc = 0.0;
                for (std::int64_t kk = 0; kk < p.k; ++kk) {
                    acc += static_cast<double>(col[kk]);
                }
                sum[j] = acc;
            }
        } else {
            for (std::int64_t kk = 0; kk < p.k; ++kk) {
                const T *col = b + kk * p.ldb;
                for (std::int64_t j = 0; j < n; ++j) {
                    sum[j] += static_cast<double>(col[j]);
                }
            }
        }
        for (std::int64_t j = 0; j < n; ++j) {
            StoreBias(p.bias, p.bias_type, j, sum[j]);
        }
        return;
    }
    case GemmEpilogue::kDGeluBGrad: {
        // D = D ⊙ gelu_tanh'(aux); bias[i] = Σ_j D[i, j].
        const T *aux = static_cast<const T *>(p.aux);
        std::vector<double> sum(static_cast<std::size_t>(m), 0.0);
        for (std::int64_t j = 0; j < n; ++j) {
            T *col = d + j * p.ldc;
            const T *aux_col = aux + j * p.ldaux;
            for (std::int64_t i = 0; i < m; ++i) {
                const T v = static_cast<T>(static_cast<double>(col[i]) * GeluTanhGrad(aux_col[i]));
                col[i] = v;
                sum[i] += static_cast<double>(v);
            }
        }
        for (std::int64_t i = 0; i < m; ++i) {
            StoreBias(p.bias, p.bias_type, i, sum[i]);
        }
        return;
    }
    case GemmEpilogue::kDGelu: {
        // D = D ⊙ gelu_tanh'(aux).
        const T *aux = static_cast<const T *>(p.aux);
        for (std::int64_t j = 0; j < n; ++j) {
            T *col = d + j * p.ldc;
            const T *aux_col = aux + j * p.ldaux;
            for (std::int64_t i = 0; i < m; ++i) {
                col[i] = static_cast<T>(static_cast<double>(col[i]) * GeluTanhGrad(aux_col[i]));
            }
        }
        return;
    }
    }
}

/// D += beta·C for a separate C (c_in): added after the product and the bias, so that a residual connection fused here
/// rounds as the unfused sum (x + (x·Wᵀ + b)) does, bit for bit.
template <class T> void AddSeparateC(const GemmParams &p, const T *c_in, T *d) {
    const T beta = static_cast<T>(p.beta);
    for (std::int64_t j = 0; j < p.n; ++j) {
        T *col = d + j * p.ldc;
        const T *c_col = c_in + j * p.ldc_in;
        for (std::int64_t i = 0; i < p.m; ++i) {
            col[i] = p.beta == 1.0 ? col[i] + c_col[i] : col[i] + beta * c_col[i];
        }
    }
}

template <class T> void TypedGemm(const GemmParams &p) {
    const T *a = static_cast<const T *>(p.a);
    const T *b = static_cast<const T *>(p.b);
    T *c = static_cast<T *>(p.c);
    const bool separate_c = GemmHasSeparateC(p);
    GemmParams product = p;
    if (separate_c) {
        product.beta = 0.0; // D = alpha·op(A)·op(B) (+ bias), then + beta·C
    }
    for (std::int64_t batch = 0; batch < p.batch_count; ++batch) {
        // Pointers are only formed for non-null operands (k = 0 or an empty D may pass nulls).
        const T *ab = a != nullptr ? a + batch * p.stride_a : nullptr;
        const T *bb = b != nullptr ? b + batch * p.stride_b : nullptr;
        T *cb = c != nullptr ? c + batch * p.stride_c : nullptr;
        Product<T>(product, ab, bb, cb);
        Epilogue<T>(product, bb, cb);
        if (separate_c && cb != nullptr) {
            AddSeparateC<T>(p, static_cast<const T *>(p.c_in) + batch * p.stride_c_in, cb);
        }
    }
}

} // namespace

void Gemm(const GemmParams &params) {
    CheckCpuParams(params);
    if (params.a_type == DType::kFloat64) {
        TypedGemm<double>(params);
    } else {
        TypedGemm<float>(params);
    }
}

} // namespace shardline::kernels::cpu
