// Gemm on CUDA, called directly: transposes, leading dimensions with padding, strided batches (incl. stride 0),
// alpha/beta, mixed half inputs with a float32 C, and every epilogue, for the default (cuBLASLt) and the legacy
// (cublasGemmEx + separate kernels) providers, against a float64 column-major reference.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/gemm.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::Gemm;
using kernels::GemmEpilogue;
using kernels::GemmParams;

/// A column-major operand stored in a flat device buffer: `batch` matrices of rows×cols with leading dimension ld,
/// `stride` elements apart (0: one matrix shared by the batch).
struct Operand {
    std::int64_t rows = 0;
    std::int64_t cols = 0;
    std::int64_t ld = 0;
    std::int64_t stride = 0;
    Tensor data;
    Values host;

    double At(std::int64_t b, std::int64_t i, std::int64_t j) const {
        return host[static_cast<std::size_t>(b * stride + i + j * ld)];
    }
};

Operand MakeOperand(std::int64_t rows, std::int64_t cols, std::int64_t pad, std::int64_t batch, bool shared,
                    DType dtype, std::uint64_t seed, std::string_view name, double stddev = 1.0) {
    Operand o;
    o.rows = rows;
    o.cols = cols;
    o.ld = std::max<std::int64_t>(1, rows + pad);
    o.stride = shared ? 0 : o.ld * cols;
    const std::int64_t copies = shared ? 1 : batch;
    o.data = RandomGpu({std::max<std::int64_t>(1, copies * o.ld * cols)}, dtype, seed, name, stddev);
    o.host = o.data.ToDoubleVector();
    return o;
}

/// opA(i, p) of a column-major A (m×k, or k×m stored when trans).
double OpAt(const Operand& x, bool trans, std::int64_t b, std::int64_t i, std::int64_t p) {
    return trans ? x.At(b, p, i) : x.At(b, i, p);
}

using GemmParam = std::tuple<DType, std::string>;
using CudaGemmTest = CudaParamTest<GemmParam>;

std::string GemmParamName(const ::testing::TestParamInfo<GemmParam>& info) {
    return std::string(DTypeName(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

struct ProductCase {
    bool ta;
    bool tb;
    std::int64_t m;
    std::int64_t n;
    std::int64_t k;
    std::int64_t pad; ///< extra rows in every leading dimension
    std::int64_t batch;
    bool shared_b; ///< stride_b = 0
    double alpha;
    double beta;
};

/// Runs D = alpha·op(A)·op(B) + beta·C (+ a bias epilogue when `bias` is set) and checks D against float64, and that
/// the padding rows of C (between m and ldc) are untouched.
void CheckProduct(const ProductCase& c, DType ab_type, DType c_type, bool bias) {
    SCOPED_TRACE(::testing::Message() << "ta " << c.ta << " tb " << c.tb << " m " << c.m << " n " << c.n << " k " << c.k
                                      << " pad " << c.pad << " batch " << c.batch << (c.shared_b ? " (b shared)" : "")
                                      << " alpha " << c.alpha << " beta " << c.beta << " C " << DTypeName(c_type)
                                      << (bias ? " +bias" : ""));
    const Operand a = MakeOperand(c.ta ? c.k : c.m, c.ta ? c.m : c.k, c.pad, c.batch, false, ab_type, 50, "a");
    const Operand b = MakeOperand(c.tb ? c.n : c.k, c.tb ? c.k : c.n, c.pad, c.batch, c.shared_b, ab_type, 50, "b");
    Operand d = MakeOperand(c.m, c.n, c.pad, c.batch, false, c_type, 50, "c");
    const Tensor bias_t = RandomGpu({c.m}, c_type, 50, "bias");
    const Values bias_v = bias_t.ToDoubleVector();
    // Column-major throughout: no row-major derivation needed, the operands are built column-major.
    Gemm(GemmParams{.trans_a = c.ta,
                    .trans_b = c.tb,
                    .m = c.m,
                    .n = c.n,
                    .k = c.k,
                    .a = a.data.data(),
                    .lda = a.ld,
                    .a_type = ab_type,
                    .b = b.data.data(),
                    .ldb = b.ld,
                    .b_type = ab_type,
                    .c = d.data.data(),
                    .ldc = d.ld,
                    .c_type = c_type,
                    .batch_count = c.batch,
                    .stride_a = a.stride,
                    .stride_b = b.stride,
                    .stride_c = d.stride,
                    .alpha = c.alpha,
                    .beta = c.beta,
                    .epilogue = bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                    .bias = bias ? bias_t.data() : nullptr,
                    .bias_type = c_type,
                    .device = Gpu()});
    const Values got_all = d.data.ToDoubleVector();
    Values got;
    Values want;
    for (std::int64_t bi = 0; bi < c.batch; ++bi) {
        for (std::int64_t j = 0; j < c.n; ++j) {
            for (std::int64_t i = 0; i < d.ld; ++i) {
                const std::size_t at = static_cast<std::size_t>(bi * d.stride + i + j * d.ld);
                if (i >= c.m) {
                    ASSERT_EQ(got_all[at], d.host[at]) << "padding row " << i << " of C written (batch " << bi << ")";
                    continue;
                }
                double acc = 0.0;
                for (std::int64_t p = 0; p < c.k; ++p) {
                    acc += OpAt(a, c.ta, bi, i, p) * OpAt(b, c.tb, bi, p, j);
                }
                want.push_back(c.alpha * acc + c.beta * d.host[at] + (bias ? bias_v[i] : 0.0));
                got.push_back(got_all[at]);
            }
        }
    }
    EXPECT_TRUE(
        ValuesMatch(got, want, c_type, bias ? kUnfusedBiasRoundings : (c.beta != 0.0 ? kEpilogueRoundings : 1)));
}

TEST_P(CudaGemmTest, ProductsWithTransposesLeadingDimsAndBatches) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
            CheckProduct({ta, tb, 33, 17, 127, 0, 1, false, 1.0, 0.0}, dtype, dtype, false);
            CheckProduct({ta, tb, 64, 48, 40, 3, 3, false, 0.5, 0.75}, dtype, dtype, false);
            CheckProduct({ta, tb, 24, 40, 16, 0, 4, true, 1.0, 1.0}, dtype, dtype, false);
        }
    }
}

TEST_P(CudaGemmTest, BiasEpilogue) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    CheckProduct({true, false, 64, 48, 40, 0, 1, false, 1.0, 0.0}, dtype, dtype, true);
    CheckProduct({true, false, 33, 17, 127, 0, 1, false, 1.0, 0.0}, dtype, dtype, true);
    CheckProduct({false, true, 32, 16, 24, 0, 3, false, 1.0, 0.0}, dtype, dtype, true); // the bias for every batch
}

TEST_P(CudaGemmTest, HalfInputsIntoFloat32Accumulator) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    // The wgrad accumulation shape: C float32, beta = 1.
    CheckProduct({false, true, 40, 24, 96, 0, 1, false, 1.0, 1.0}, dtype, DType::kFloat32, false);
    CheckProduct({false, true, 33, 17, 7, 0, 1, false, 1.0, 1.0}, dtype, DType::kFloat32, false);
}

/// m×n column-major with ld = m.
struct EpilogueShape {
    std::int64_t m;
    std::int64_t n;
    std::int64_t k;
};
const std::vector<EpilogueShape> kEpilogueShapes = {{64, 48, 40}, {33, 17, 127}};

TEST_P(CudaGemmTest, GeluAuxBiasEpilogue) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    for (const EpilogueShape& s : kEpilogueShapes) {
        for (const bool with_bias : {true, false}) {
            SCOPED_TRACE(::testing::Message()
                         << "m " << s.m << " n " << s.n << " k " << s.k << (with_bias ? " bias" : " no bias"));
            const double w_scale = 1.0 / std::sqrt(static_cast<double>(s.k));
            const Operand a = MakeOperand(s.k, s.m, 0, 1, false, dtype, 51, "a", w_scale); // trans_a
            const Operand b = MakeOperand(s.k, s.n, 0, 1, false, dtype, 51, "b");
            const Tensor bias = RandomGpu({s.m}, dtype, 51, "bias");
            Tensor d = RandomGpu({s.m * s.n}, dtype, 999, "poison", 100.0);
            Tensor aux = RandomGpu({s.m * s.n}, dtype, 998, "poison", 100.0);
            Gemm(GemmParams{.trans_a = true,
                            .m = s.m,
                            .n = s.n,
                            .k = s.k,
                            .a = a.data.data(),
                            .lda = s.k,
                            .a_type = dtype,
                            .b = b.data.data(),
                            .ldb = s.k,
                            .b_type = dtype,
                            .c = d.data(),
                            .ldc = s.m,
                            .c_type = dtype,
                            .epilogue = GemmEpilogue::kGeluAuxBias,
                            .bias = with_bias ? bias.data() : nullptr,
                            .bias_type = dtype,
                            .aux = aux.data(),
                            .ldaux = s.m,
                            .device = Gpu()});
            const Values bv = bias.ToDoubleVector();
            Values pre(static_cast<std::size_t>(s.m * s.n));
            Values act(pre.size());
            for (std::int64_t j = 0; j < s.n; ++j) {
                for (std::int64_t i = 0; i < s.m; ++i) {
                    double acc = with_bias ? bv[i] : 0.0;
                    for (std::int64_t p = 0; p < s.k; ++p) {
                        acc += OpAt(a, true, 0, i, p) * OpAt(b, false, 0, p, j);
                    }
                    pre[i + j * s.m] = acc;
                    act[i + j * s.m] = RefGeluTanh(acc);
                }
            }
            EXPECT_TRUE(ValuesMatch(aux, pre, dtype, with_bias ? kUnfusedBiasRoundings : kEpilogueRoundings))
                << "aux = pre-activation";
            EXPECT_TRUE(ValuesMatch(d, act, dtype, kGeluEpilogueRoundings)) << "D = gelu_tanh(pre-activation)";
        }
    }
}

TEST_P(CudaGemmTest, BGradBEpilogue) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    for (const EpilogueShape& s : kEpilogueShapes) {
        for (const bool tb : {true, false}) {
            SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k << " trans_b " << tb);
            const Operand a = MakeOperand(s.m, s.k, 0, 1, false, dtype, 52, "a");
            const Operand b = MakeOperand(tb ? s.n : s.k, tb ? s.k : s.n, 0, 1, false, dtype, 52, "b");
            Tensor d = RandomGpu({s.m * s.n}, dtype, 999, "poison", 100.0);
            Tensor bgrad = RandomGpu({s.n}, dtype, 998, "poison", 100.0);
            Gemm(GemmParams{.trans_a = false,
                            .trans_b = tb,
                            .m = s.m,
                            .n = s.n,
                            .k = s.k,
                            .a = a.data.data(),
                            .lda = a.ld,
                            .a_type = dtype,
                            .b = b.data.data(),
                            .ldb = b.ld,
                            .b_type = dtype,
                            .c = d.data(),
                            .ldc = s.m,
                            .c_type = dtype,
                            .epilogue = GemmEpilogue::kBGradB,
                            .bias = bgrad.data(),
                            .bias_type = dtype,
                            .device = Gpu()});
            Values prod(static_cast<std::size_t>(s.m * s.n));
            Values sums(static_cast<std::size_t>(s.n), 0.0);
            for (std::int64_t j = 0; j < s.n; ++j) {
                for (std::int64_t p = 0; p < s.k; ++p) {
                    sums[j] += OpAt(b, tb, 0, p, j);
                }
                for (std::int64_t i = 0; i < s.m; ++i) {
                    double acc = 0.0;
                    for (std::int64_t p = 0; p < s.k; ++p) {
                        acc += OpAt(a, false, 0, i, p) * OpAt(b, tb, 0, p, j);
                    }
                    prod[i + j * s.m] = acc;
                }
            }
            EXPECT_TRUE(ValuesMatch(d, prod, dtype, kEpilogueRoundings)) << "D = A·op(B)";
            EXPECT_TRUE(ValuesMatch(bgrad, sums, dtype, kEpilogueRoundings)) << "bias[j] = Σ_k op(B)[k, j]";
        }
    }
}

TEST_P(CudaGemmTest, DGeluBGradEpilogue) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    for (const EpilogueShape& s : kEpilogueShapes) {
        SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
        // The dgrad of a GELU layer: D = (Wᵀ-like A)·dY, times gelu'(pre-activation saved in aux).
        const Operand a = MakeOperand(s.m, s.k, 0, 1, false, dtype, 53, "a");
        const Operand b = MakeOperand(s.k, s.n, 0, 1, false, dtype, 53, "b");
        const Tensor aux = RandomGpu({s.m * s.n}, dtype, 53, "aux", 1.5);
        Tensor d = RandomGpu({s.m * s.n}, dtype, 999, "poison", 100.0);
        Tensor bgrad = RandomGpu({s.m}, dtype, 998, "poison", 100.0);
        Gemm(GemmParams{.m = s.m,
                        .n = s.n,
                        .k = s.k,
                        .a = a.data.data(),
                        .lda = s.m,
                        .a_type = dtype,
                        .b = b.data.data(),
                        .ldb = s.k,
                        .b_type = dtype,
                        .c = d.data(),
                        .ldc = s.m,
                        .c_type = dtype,
                        .epilogue = GemmEpilogue::kDGeluBGrad,
                        .bias = bgrad.data(),
                        .bias_type = dtype,
                        .aux = aux.data(),
                        .ldaux = s.m,
                        .device = Gpu()});
        const Values auxv = aux.ToDoubleVector();
        Values want(static_cast<std::size_t>(s.m * s.n));
        Values sums(static_cast<std::size_t>(s.m), 0.0);
        for (std::int64_t j = 0; j < s.n; ++j) {
            for (std::int64_t i = 0; i < s.m; ++i) {
                double acc = 0.0;
                for (std::int64_t p = 0; p < s.k; ++p) {
                    acc += OpAt(a, false, 0, i, p) * OpAt(b, false, 0, p, j);
                }
                const double v = acc * RefGeluTanhGrad(auxv[i + j * s.m]);
                want[i + j * s.m] = v;
                sums[i] += v;
            }
        }
        // Unfused paths round the product before the GELU grad, and may sum the rounded D; a fused epilogue evaluates
        // gelu' in its own arithmetic.
        EXPECT_TRUE(ValuesMatch(d, want, dtype, kGeluEpilogueRoundings)) << "D = A·B ⊙ gelu'(aux)";
        EXPECT_TRUE(ValuesMatch(bgrad, sums, dtype, kGeluEpilogueRoundings)) << "bias[i] = Σ_j D[i, j]";
    }
}

TEST_P(CudaGemmTest, EmptyReductionGivesBetaCPlusBias) {
    const auto& [dtype, provider] = GetParam();
    ScopedProvider scoped(provider);
    const std::int64_t m = 24;
    const std::int64_t n = 10;
    for (const double beta : {0.0, 0.5}) {
        for (const bool bias : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "k = 0, beta " << beta << (bias ? ", bias" : ""));
            Tensor d = RandomGpu({m * n}, dtype, 54, "c", 100.0);
            const Values c = d.ToDoubleVector();
            const Tensor bias_t = RandomGpu({m}, dtype, 54, "bias");
            const Values bv = bias_t.ToDoubleVector();
            try {
                // A and B may be null when k = 0 (ValidateGemmParams).
                Gemm(GemmParams{.m = m,
                                .n = n,
                                .k = 0,
                                .lda = m,
                                .a_type = dtype,
                                .ldb = 1,
                                .b_type = dtype,
                                .c = d.data(),
                                .ldc = m,
                                .c_type = dtype,
                                .beta = beta,
                                .epilogue = bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                                .bias = bias ? bias_t.data() : nullptr,
                                .bias_type = dtype,
                                .device = Gpu()});
            } catch (const Error& e) {
                GTEST_SKIP() << "Gemm with k = 0 is not supported by this provider: " << e.what();
            }
            Values want(c.size());
            for (std::int64_t j = 0; j < n; ++j) {
                for (std::int64_t i = 0; i < m; ++i) {
                    want[i + j * m] = beta * c[i + j * m] + (bias ? bv[i] : 0.0);
                }
            }
            EXPECT_TRUE(ValuesMatch(d, want, dtype, bias ? kUnfusedBiasRoundings : 1));
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Provider, CudaGemmTest,
                         ::testing::Combine(CudaDTypes(), ::testing::Values(std::string(kernels::kDefaultProvider),
                                                                            std::string(kernels::kLegacyProvider))),
                         GemmParamName);

} // namespace
} // namespace shardline::testing
