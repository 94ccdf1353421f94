// Gemm called directly, in cuBLAS's column-major convention, against a float64 reference written here.

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/gemm.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::DTypeParamName;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::RefGeluTanh;
using testing::RefGeluTanhGrad;
using testing::Values;
using testing::ValuesMatch;

/// One strided-batched GEMM problem with its buffers; leading dims padded past the rows so ld is really honoured.
struct Problem {
    bool trans_a = false;
    bool trans_b = false;
    std::int64_t m = 0, n = 0, k = 0;
    std::int64_t lda = 0, ldb = 0, ldc = 0;
    std::int64_t batch = 1;
    std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
    Tensor a, b, c;

    GemmParams Params(double alpha, double beta) const {
        return GemmParams{.trans_a = trans_a,
                          .trans_b = trans_b,
                          .m = m,
                          .n = n,
                          .k = k,
                          .a = a.data(),
                          .lda = lda,
                          .a_type = a.dtype(),
                          .b = b.data(),
                          .ldb = ldb,
                          .b_type = b.dtype(),
                          .c = c.data(),
                          .ldc = ldc,
                          .c_type = c.dtype(),
                          .batch_count = batch,
                          .stride_a = stride_a,
                          .stride_b = stride_b,
                          .stride_c = stride_c,
                          .alpha = alpha,
                          .beta = beta,
                          .device = Device::CPU()};
    }
};

/// A problem with random A, B, C. broadcast_a / broadcast_b give that operand stride 0 (one matrix for the batch).
Problem MakeProblem(DType dtype, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t batch,
                    bool broadcast_a = false, bool broadcast_b = false, std::uint64_t seed = 1) {
    Problem p;
    p.trans_a = ta;
    p.trans_b = tb;
    p.m = m;
    p.n = n;
    p.k = k;
    p.batch = batch;
    const std::int64_t a_rows = ta ? k : m;
    const std::int64_t a_cols = ta ? m : k;
    const std::int64_t b_rows = tb ? n : k;
    const std::int64_t b_cols = tb ? k : n;
    p.lda = a_rows + 2;
    p.ldb = b_rows + 3;
    p.ldc = m + 1;
    const std::int64_t a_elems = p.lda * a_cols + 5; // + a gap between batch entries
    const std::int64_t b_elems = p.ldb * b_cols + 1;
    const std::int64_t c_elems = p.ldc * n + 4;
    p.stride_a = broadcast_a ? 0 : a_elems;
    p.stride_b = broadcast_b ? 0 : b_elems;
    p.stride_c = c_elems;
    p.a = RandomTensor({(broadcast_a ? 1 : batch) * a_elems}, dtype, Device::CPU(), seed, "gemm.a");
    p.b = RandomTensor({(broadcast_b ? 1 : batch) * b_elems}, dtype, Device::CPU(), seed, "gemm.b");
    p.c = RandomTensor({batch * c_elems}, dtype, Device::CPU(), seed, "gemm.c");
    return p;
}

/// D[b] = alpha·op(A[b])·op(B[b]) + beta·C[b] in float64, on the same buffers (entries outside D keep C's values).
Values RefGemm(const Problem &p, const Values &a, const Values &b, const Values &c, double alpha, double beta) {
    Values d = c;
    for (std::int64_t bi = 0; bi < p.batch; ++bi) {
        const std::int64_t oa = bi * p.stride_a;
        const std::int64_t ob = bi * p.stride_b;
        const std::int64_t oc = bi * p.stride_c;
        for (std::int64_t i = 0; i < p.m; ++i) {
            for (std::int64_t j = 0; j < p.n; ++j) {
                double acc = 0.0;
                for (std::int64_t q = 0; q < p.k; ++q) {
                    const double av = p.trans_a ? a[oa + q + i * p.lda] : a[oa + i + q * p.lda];
                    const double bv = p.trans_b ? b[ob + j + q * p.ldb] : b[ob + q + j * p.ldb];
                    acc += av * bv;
                }
                const double cv = beta == 0.0 ? 0.0 : beta * c[oc + i + j * p.ldc];
                d[oc + i + j * p.ldc] = alpha * acc + cv;
            }
        }
    }
    return d;
}

class GemmTransposeTest : public ::testing::TestWithParam<std::tuple<DType, bool, bool>> {};

TEST_P(GemmTransposeTest, StridedBatchWithPaddedLeadingDimsMatchesReference) {
    const auto [dtype, ta, tb] = GetParam();
    const Problem p = MakeProblem(dtype, ta, tb, 7, 5, 33, 3);
    const Values a = p.a.ToDoubleVector();
    const Values b = p.b.ToDoubleVector();
    const Values c = p.c.ToDoubleVector();
    ASSERT_GT(AbsSum(a) * AbsSum(b) * AbsSum(c), 0.0);
    Gemm(p.Params(0.75, -0.5));
    EXPECT_TRUE(ValuesMatch(p.c, RefGemm(p, a, b, c, 0.75, -0.5), dtype));
}

TEST_P(GemmTransposeTest, SingleMatrixWithAlphaOneBetaZeroMatchesReference) {
    const auto [dtype, ta, tb] = GetParam();
    const Problem p = MakeProblem(dtype, ta, tb, 1, 17, 3, 1, false, false, 2);
    const Values a = p.a.ToDoubleVector();
    const Values b = p.b.ToDoubleVector();
    const Values c = p.c.ToDoubleVector();
    Gemm(p.Params(1.0, 0.0));
    EXPECT_TRUE(ValuesMatch(p.c, RefGemm(p, a, b, c, 1.0, 0.0), dtype));
}

TEST_P(GemmTransposeTest, StrideZeroBroadcastsAnOperandOverTheBatch) {
    const auto [dtype, ta, tb] = GetParam();
    for (const auto &[bcast_a, bcast_b] : {std::pair{true, false}, std::pair{false, true}}) {
        const Problem p = MakeProblem(dtype, ta, tb, 6, 4, 9, 4, bcast_a, bcast_b, 3);
        const Values a = p.a.ToDoubleVector();
        const Values b = p.b.ToDoubleVector();
        const Values c = p.c.ToDoubleVector();
        Gemm(p.Params(1.25, 0.0));
        EXPECT_TRUE(ValuesMatch(p.c, RefGemm(p, a, b, c, 1.25, 0.0), dtype))
            << "broadcast a=" << bcast_a << " b=" << bcast_b;
    }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GemmTransposeTest,
                         ::testing::Combine(CpuDTypes(), ::testing::Bool(), ::testing::Bool()), [](const auto &info) {
                             return std::string(DTypeName(std::get<0>(info.param))) +
                                    (std::get<1>(info.param) ? "_TA" : "_NA") +
                                    (std::get<2>(info.param) ? "_TB" : "_NB");
                         });

class GemmTest : public ::testing::TestWithParam<DType> {};

TEST_P(GemmTest, ZeroKGivesBetaTimesC) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, false, false, 4, 3, 0, 2);
    const Values c = p.c.ToDoubleVector();
    Gemm(p.Params(2.0, -1.5));
    EXPECT_TRUE(ValuesMatch(p.c, RefGemm(p, {}, {}, c, 2.0, -1.5), dtype));
}

TEST_P(GemmTest, BetaZeroNeverReadsC) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, false, true, 5, 6, 7, 1);
    const Values a = p.a.ToDoubleVector();
    const Values b = p.b.ToDoubleVector();
    Values c = p.c.ToDoubleVector();
    p.c.Fill(std::numeric_limits<double>::quiet_NaN());
    Gemm(p.Params(1.0, 0.0));
    const Values d = p.c.ToDoubleVector();
    const Values ref = RefGemm(p, a, b, c, 1.0, 0.0);
    for (std::int64_t j = 0; j < p.n; ++j) {
        for (std::int64_t i = 0; i < p.m; ++i) {
            const std::int64_t at = i + j * p.ldc;
            ASSERT_FALSE(std::isnan(d[at])) << "(" << i << ", " << j << ")";
            EXPECT_NEAR(d[at], ref[at], 1e-4 * (1 + std::abs(ref[at])));
        }
    }
    // k = 0 with beta = 0 writes zeros over NaN too.
    Problem z = MakeProblem(dtype, false, false, 3, 2, 0, 1);
    z.c.Fill(std::numeric_limits<double>::quiet_NaN());
    Gemm(z.Params(1.0, 0.0));
    const Values zd = z.c.ToDoubleVector();
    for (std::int64_t j = 0; j < z.n; ++j) {
        for (std::int64_t i = 0; i < z.m; ++i) {
            EXPECT_EQ(zd[i + j * z.ldc], 0.0);
        }
    }
}

TEST_P(GemmTest, EmptyOutputLeavesBuffersUntouched) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, false, false, 0, 3, 4, 1);
    const Values c = p.c.ToDoubleVector();
    Gemm(p.Params(1.0, 0.0));
    EXPECT_EQ(p.c.ToDoubleVector(), c);
    Problem q = MakeProblem(dtype, true, true, 3, 0, 4, 2);
    const Values qc = q.c.ToDoubleVector();
    Gemm(q.Params(1.0, 1.0));
    EXPECT_EQ(q.c.ToDoubleVector(), qc);
}

// ---------------------------------------------------------------------------------------------------------------------
// Epilogues

/// A small m×n problem with ld = m + 1 for C and aux, and random bias/aux operands.
struct EpilogueCase {
    Problem p;
    Values a, b, c;
    Tensor bias;
    Tensor aux;
};

EpilogueCase MakeEpilogueCase(DType dtype, bool tb, std::int64_t bias_len, std::uint64_t seed) {
    EpilogueCase e;
    e.p = MakeProblem(dtype, false, tb, 9, 13, 11, 1, false, false, seed);
    e.a = e.p.a.ToDoubleVector();
    e.b = e.p.b.ToDoubleVector();
    e.c = e.p.c.ToDoubleVector();
    e.bias = RandomTensor({bias_len}, dtype, Device::CPU(), seed, "gemm.bias");
    e.aux = RandomTensor({e.p.ldc * e.p.n}, dtype, Device::CPU(), seed, "gemm.aux");
    return e;
}

TEST_P(GemmTest, BiasEpilogueAddsOneBiasPerRowOfD) {
    const DType dtype = GetParam();
    EpilogueCase e = MakeEpilogueCase(dtype, false, 9, 4);
    const Values bias = e.bias.ToDoubleVector();
    GemmParams params = e.p.Params(1.0, 0.5);
    params.epilogue = GemmEpilogue::kBias;
    params.bias = e.bias.data();
    params.bias_type = dtype;
    Gemm(params);
    Values ref = RefGemm(e.p, e.a, e.b, e.c, 1.0, 0.5);
    for (std::int64_t j = 0; j < e.p.n; ++j) {
        for (std::int64_t i = 0; i < e.p.m; ++i) {
            ref[i + j * e.p.ldc] += bias[i];
        }
    }
    EXPECT_TRUE(ValuesMatch(e.p.c, ref, dtype));
}

TEST_P(GemmTest, BiasEpilogueAppliesToEveryBatchEntry) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, true, false, 5, 4, 6, 3, false, true, 5);
    const Values a = p.a.ToDoubleVector();
    const Values b = p.b.ToDoubleVector();
    const Values c = p.c.ToDoubleVector();
    const Tensor bias = RandomTensor({5}, dtype, Device::CPU(), 5, "gemm.bias");
    const Values bv = bias.ToDoubleVector();
    GemmParams params = p.Params(1.0, 0.0);
    params.epilogue = GemmEpilogue::kBias;
    params.bias = bias.data();
    params.bias_type = dtype;
    Gemm(params);
    Values ref = RefGemm(p, a, b, c, 1.0, 0.0);
    for (std::int64_t bi = 0; bi < p.batch; ++bi) {
        for (std::int64_t j = 0; j < p.n; ++j) {
            for (std::int64_t i = 0; i < p.m; ++i) {
                ref[bi * p.stride_c + i + j * p.ldc] += bv[i];
            }
        }
    }
    EXPECT_TRUE(ValuesMatch(p.c, ref, dtype));
}

TEST_P(GemmTest, GeluAuxBiasEpilogueSavesPreActivationAndAppliesGelu) {
    const DType dtype = GetParam();
    for (const bool with_bias : {true, false}) {
        EpilogueCase e = MakeEpilogueCase(dtype, true, 9, 6);
        const Values bias = e.bias.ToDoubleVector();
        GemmParams params = e.p.Params(1.0, 0.0);
        params.epilogue = GemmEpilogue::kGeluAuxBias;
        params.bias = with_bias ? e.bias.data() : nullptr;
        params.bias_type = dtype;
        params.aux = e.aux.data();
        params.ldaux = e.p.ldc;
        Gemm(params);
        const Values prod = RefGemm(e.p, e.a, e.b, e.c, 1.0, 0.0);
        const Values d = e.p.c.ToDoubleVector();
        Values got_aux;
        Values got_d;
        Values want_aux;
        Values want_d;
        const Values aux = e.aux.ToDoubleVector();
        for (std::int64_t j = 0; j < e.p.n; ++j) {
            for (std::int64_t i = 0; i < e.p.m; ++i) {
                const std::int64_t at = i + j * e.p.ldc;
                const double pre = prod[at] + (with_bias ? bias[i] : 0.0);
                want_aux.push_back(pre);
                want_d.push_back(RefGeluTanh(pre));
                got_aux.push_back(aux[at]);
                got_d.push_back(d[at]);
            }
        }
        EXPECT_TRUE(ValuesMatch(got_aux, want_aux, dtype)) << "with_bias=" << with_bias;
        EXPECT_TRUE(ValuesMatch(got_d, want_d, dtype, 4.0)) << "with_bias=" << with_bias;
    }
}

TEST_P(GemmTest, BGradBEpilogueSumsOpBOverK) {
    const DType dtype = GetParam();
    for (const bool tb : {false, true}) {
        EpilogueCase e = MakeEpilogueCase(dtype, tb, 13, 7);
        GemmParams params = e.p.Params(1.0, 0.0);
        params.epilogue = GemmEpilogue::kBGradB;
        params.bias = e.bias.data();
        params.bias_type = dtype;
        Gemm(params);
        EXPECT_TRUE(ValuesMatch(e.p.c, RefGemm(e.p, e.a, e.b, e.c, 1.0, 0.0), dtype)) << "tb=" << tb;
        Values want(13, 0.0);
        for (std::int64_t j = 0; j < e.p.n; ++j) {
            for (std::int64_t q = 0; q < e.p.k; ++q) {
                want[j] += tb ? e.b[j + q * e.p.ldb] : e.b[q + j * e.p.ldb];
            }
        }
        EXPECT_TRUE(ValuesMatch(e.bias, want, dtype)) << "tb=" << tb;
    }
}

TEST_P(GemmTest, DGeluBGradEpilogueScalesByGeluGradAndSumsRows) {
    const DType dtype = GetParam();
    EpilogueCase e = MakeEpilogueCase(dtype, false, 9, 8);
    const Values aux = e.aux.ToDoubleVector();
    GemmParams params = e.p.Params(1.0, 0.0);
    params.epilogue = GemmEpilogue::kDGeluBGrad;
    params.bias = e.bias.data();
    params.bias_type = dtype;
    params.aux = e.aux.data();
    params.ldaux = e.p.ldc;
    Gemm(params);
    const Values prod = RefGemm(e.p, e.a, e.b, e.c, 1.0, 0.0);
    const Values d = e.p.c.ToDoubleVector();
    Values want_d;
    Values got_d;
    Values want_bias(9, 0.0);
    for (std::int64_t j = 0; j < e.p.n; ++j) {
        for (std::int64_t i = 0; i < e.p.m; ++i) {
            const std::int64_t at = i + j * e.p.ldc;
            const double v = prod[at] * RefGeluTanhGrad(aux[at]);
            want_d.push_back(v);
            got_d.push_back(d[at]);
            want_bias[i] += v;
        }
    }
    EXPECT_TRUE(ValuesMatch(got_d, want_d, dtype, 4.0));
    EXPECT_TRUE(ValuesMatch(e.bias, want_bias, dtype, 4.0));
}

TEST_P(GemmTest, MixedOrHalfDTypesAreRejectedOnCpu) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, false, false, 2, 2, 2, 1);
    GemmParams params = p.Params(1.0, 0.0);
    // A, B float64 with a float32 C passes the generic validation (C may be float32) but not the CPU kernel.
    params.a_type = DType::kFloat64;
    params.b_type = DType::kFloat64;
    params.c_type = DType::kFloat32;
    try {
        Gemm(params);
        FAIL() << "CPU Gemm accepted float64 inputs with a float32 C";
    } catch (const DTypeError &e) {
        const std::string msg = e.what();
        EXPECT_THAT(msg, HasSubstr("Gemm"));
        EXPECT_THAT(msg, HasSubstr("A float64, B float64, C float32"));
        EXPECT_THAT(msg, HasSubstr("float32 or float64"));
    }
    params.a_type = params.b_type = params.c_type = DType::kFloat16;
    try {
        Gemm(params);
        FAIL() << "CPU Gemm accepted float16";
    } catch (const DTypeError &e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("A float16, B float16, C float16"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("CUDA only"));
    }
}

TEST_P(GemmTest, AuxEpilogueWithABatchIsRejected) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, false, false, 3, 3, 3, 2);
    Tensor aux = Tensor::Empty({p.ldc * p.n * 2}, dtype);
    GemmParams params = p.Params(1.0, 0.0);
    params.epilogue = GemmEpilogue::kGeluAuxBias;
    params.aux = aux.data();
    params.ldaux = p.ldc;
    try {
        Gemm(params);
        FAIL() << "accepted gelu_aux_bias with batch 2";
    } catch (const ShapeError &e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("gelu_aux_bias needs batch_count 1"));
    }
}

TEST_P(GemmTest, LeadingDimensionTooSmallIsAShapeError) {
    const DType dtype = GetParam();
    Problem p = MakeProblem(dtype, true, false, 4, 3, 5, 1);
    GemmParams params = p.Params(1.0, 0.0);
    params.lda = 4; // A is stored k×m = 5×4: lda must be >= 5
    try {
        Gemm(params);
        FAIL() << "accepted lda < rows of A";
    } catch (const ShapeError &e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("lda 4 must be >= 5"));
    }
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, GemmTest, CpuDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::kernels
