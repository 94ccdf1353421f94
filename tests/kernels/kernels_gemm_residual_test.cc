// A residual added by the GEMM: Gemm with a C apart from D (GemmParams::c_in), and the Linear ops built on it
// (LinearForwardArgs::residual, LinearBackwardInputArgs / LinearBackwardArgs::dx_residual), on every device and with
// every provider that serves Gemm (CPU: default; CUDA: default = cuBLASLt with C and D in separate layouts, legacy =
// C copied into D, then cublasGemmEx with beta), against float64 references on random data: C is only read, D's
// padding is untouched, the in-place form (C is D) still works; and the checks of a separate C (partial overlap, an aux
// epilogue, leading dim, a residual's shape, dtype and activation).

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::testing {
namespace {

using kernels::Gemm;
using kernels::GemmEpilogue;
using kernels::GemmParams;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// The providers that serve Gemm on a device (as kernels_gemm_test.cc): the CPU's default; CUDA's default and legacy.
std::vector<std::string> Providers(DeviceType type) {
    if (type == DeviceType::kCPU) {
        return {std::string(kernels::kDefaultProvider)};
    }
    return {std::string(kernels::kDefaultProvider), std::string(kernels::kLegacyProvider)};
}

using ResidualParam = std::tuple<DeviceDType, std::string>;

class GemmResidualTest : public DeviceTest<ResidualParam> {
protected:
    void SetUp() override {
        DeviceTest<ResidualParam>::SetUp();
        if (IsSkipped()) {
            return;
        }
        provider_.emplace(std::get<1>(GetParam()));
    }
    void TearDown() override {
        provider_.reset();
        DeviceTest<ResidualParam>::TearDown();
    }

private:
    std::optional<ScopedProvider> provider_;
};

/// One problem with a separate C: column-major A (m×k, k×m stored when ta), B (k×n, n×k when tb), C_in with leading
/// dim m + pad_c and D with m + pad_d, `batch` entries `gap` elements apart.
struct SeparateCase {
    bool ta = false;
    bool tb = false;
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;
    std::int64_t batch = 1;
    std::int64_t pad_c = 0;
    std::int64_t pad_d = 0;
    std::int64_t gap = 0;
    double alpha = 1.0;
    double beta = 1.0;
    bool bias = false;
};

TEST_P(GemmResidualTest, SeparateCMatchesReferenceAndIsOnlyRead) {
    const std::vector<SeparateCase> cases = {
        {.ta = true, .m = 64, .n = 48, .k = 40, .bias = true},           // the Linear forward's shape, aligned
        {.m = 64, .n = 40, .k = 48},                                     // the dgrad's shape, no epilogue
        {.ta = true, .m = 33, .n = 17, .k = 127, .bias = true},          // odd sizes: 2- or 4-byte alignment
        {.m = 9, .n = 13, .k = 11, .pad_c = 3, .pad_d = 1, .beta = 0.5}, // leading dims of their own
        {.tb = true,
         .m = 5,
         .n = 4,
         .k = 6,
         .batch = 3,
         .pad_c = 2,
         .pad_d = 1,
         .gap = 4,
         .alpha = 0.75,
         .beta = -1.5,
         .bias = true},                                     // strided batches (unfused bias)
        {.m = 7, .n = 6, .k = 0, .pad_c = 1, .bias = true}, // k = 0: D = beta·C + bias
    };
    for (const SeparateCase &c : cases) {
        SCOPED_TRACE(::testing::Message()
                     << "ta " << c.ta << " tb " << c.tb << " m " << c.m << " n " << c.n << " k " << c.k << " batch "
                     << c.batch << " beta " << c.beta << (c.bias ? " +bias" : ""));
        const std::uint64_t seed = static_cast<std::uint64_t>(c.m * 100 + c.n * 10 + c.k);
        const std::int64_t lda = c.ta ? c.k : c.m;
        const std::int64_t ldb = c.tb ? c.n : c.k;
        const std::int64_t ldc = c.m + c.pad_c;
        const std::int64_t ldd = c.m + c.pad_d;
        const std::int64_t sa = std::max<std::int64_t>(1, lda * (c.ta ? c.m : c.k)) + c.gap;
        const std::int64_t sb = std::max<std::int64_t>(1, ldb * (c.tb ? c.k : c.n)) + c.gap;
        const std::int64_t sc = ldc * c.n + c.gap;
        const std::int64_t sd = ldd * c.n + c.gap;
        const Tensor a = Random({sa * c.batch}, dtype(), seed, "a");
        const Tensor b = Random({sb * c.batch}, dtype(), seed, "b");
        const Tensor c_in = Random({sc * c.batch}, dtype(), seed, "c_in");
        Tensor d = Random({sd * c.batch}, dtype(), seed, "d", 100.0); // D's prior values must not matter
        const Tensor bias = Random({c.m}, dtype(), seed, "bias");
        const Values av = a.ToDoubleVector(), bv = b.ToDoubleVector(), cv = c_in.ToDoubleVector();
        const Values d_before = d.ToDoubleVector(), biasv = bias.ToDoubleVector();
        ASSERT_GT(AbsSum(cv) * AbsSum(biasv), 0.0);
        Gemm(GemmParams{.trans_a = c.ta,
                        .trans_b = c.tb,
                        .m = c.m,
                        .n = c.n,
                        .k = c.k,
                        .a = a.data(),
                        .lda = std::max<std::int64_t>(1, lda),
                        .a_type = dtype(),
                        .b = b.data(),
                        .ldb = std::max<std::int64_t>(1, ldb),
                        .b_type = dtype(),
                        .c = d.data(),
                        .ldc = ldd,
                        .c_type = dtype(),
                        .c_in = c_in.data(),
                        .ldc_in = ldc,
                        .batch_count = c.batch,
                        .stride_a = sa,
                        .stride_b = sb,
                        .stride_c = sd,
                        .stride_c_in = sc,
                        .alpha = c.alpha,
                        .beta = c.beta,
                        .epilogue = c.bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                        .bias = c.bias ? bias.data() : nullptr,
                        .bias_type = dtype(),
                        .device = device()});
        EXPECT_EQ(c_in.ToDoubleVector(), cv) << "C was written";
        const Values got = d.ToDoubleVector();
        Values want_d, got_d;
        std::vector<bool> in_d(got.size(), false);
        for (std::int64_t e = 0; e < c.batch; ++e) {
            for (std::int64_t j = 0; j < c.n; ++j) {
                for (std::int64_t i = 0; i < c.m; ++i) {
                    double acc = 0.0;
                    for (std::int64_t p = 0; p < c.k; ++p) {
                        const double x = c.ta ? av[e * sa + p + i * lda] : av[e * sa + i + p * lda];
                        const double y = c.tb ? bv[e * sb + j + p * ldb] : bv[e * sb + p + j * ldb];
                        acc += x * y;
                    }
                    want_d.push_back(c.alpha * acc + c.beta * cv[e * sc + i + j * ldc] + (c.bias ? biasv[i] : 0.0));
                    const std::size_t at = static_cast<std::size_t>(e * sd + i + j * ldd);
                    got_d.push_back(got[at]);
                    in_d[at] = true;
                }
            }
        }
        for (std::size_t at = 0; at < got.size(); ++at) {
            if (!in_d[at]) {
                ASSERT_EQ(got[at], d_before[at]) << "element " << at << " of D's buffer, outside D, was written";
            }
        }
        // The bias and C may each be added to a rounded GEMM output (legacy, unfused epilogues): one more rounding
        // than a bias alone.
        EXPECT_TRUE(ValuesMatch(got_d, want_d, dtype(), OnCuda(kUnfusedBiasRoundings + 1)));
    }
}

TEST_P(GemmResidualTest, CGivenAsDItselfRunsInPlace) {
    // c_in == c with the same layout is the in-place GEMM: D = A·B + D.
    const std::int64_t m = 16, n = 8, k = 24;
    const Tensor a = Random({m * k}, dtype(), 5, "a");
    const Tensor b = Random({k * n}, dtype(), 5, "b");
    Tensor d = Random({m * n}, dtype(), 5, "d");
    const Values av = a.ToDoubleVector(), bv = b.ToDoubleVector(), dv = d.ToDoubleVector();
    Gemm(GemmParams{.m = m,
                    .n = n,
                    .k = k,
                    .a = a.data(),
                    .lda = m,
                    .a_type = dtype(),
                    .b = b.data(),
                    .ldb = k,
                    .b_type = dtype(),
                    .c = d.data(),
                    .ldc = m,
                    .c_type = dtype(),
                    .c_in = d.data(),
                    .ldc_in = m,
                    .beta = 1.0,
                    .device = device()});
    Values want(dv.size());
    for (std::int64_t j = 0; j < n; ++j) {
        for (std::int64_t i = 0; i < m; ++i) {
            double acc = dv[i + j * m];
            for (std::int64_t p = 0; p < k; ++p) {
                acc += av[i + p * m] * bv[p + j * k];
            }
            want[i + j * m] = acc;
        }
    }
    EXPECT_TRUE(ValuesMatch(d, want, dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(GemmResidualTest, SeparateCOverlappingDOrWithAnAuxEpilogueIsRejected) {
    const std::int64_t m = 8, n = 4, k = 8;
    const Tensor a = Random({m * k}, dtype(), 6, "a");
    const Tensor b = Random({k * n}, dtype(), 6, "b");
    Tensor buffer = Random({m * n * 2}, dtype(), 6, "d");
    Tensor aux = Random({m * n}, dtype(), 6, "aux");
    const auto at = [&](std::int64_t elements) {
        return static_cast<char *>(buffer.data()) + elements * static_cast<std::int64_t>(ElementSize(dtype()));
    };
    const GemmParams base{.m = m,
                          .n = n,
                          .k = k,
                          .a = a.data(),
                          .lda = m,
                          .a_type = dtype(),
                          .b = b.data(),
                          .ldb = k,
                          .b_type = dtype(),
                          .c = buffer.data(),
                          .ldc = m,
                          .c_type = dtype(),
                          .c_in = at(m * n),
                          .ldc_in = m,
                          .beta = 1.0,
                          .device = device()};
    EXPECT_NO_THROW(Gemm(base)) << "C right after D: apart";
    GemmParams overlap = base;
    overlap.c_in = at(m * n - 3);
    EXPECT_THAT(MessageOf<ShapeError>([&] { Gemm(overlap); }), AllOf(HasSubstr("Gemm"), HasSubstr("overlaps D")));
    GemmParams same_pointer = base;
    same_pointer.c_in = buffer.data();
    same_pointer.ldc_in = m + 1;
    EXPECT_THAT(MessageOf<ShapeError>([&] { Gemm(same_pointer); }),
                AllOf(HasSubstr("ldc_in 9 vs ldc 8"), HasSubstr("alias D partially")));
    GemmParams short_ld = base;
    short_ld.ldc_in = m - 1;
    EXPECT_THAT(MessageOf<ShapeError>([&] { Gemm(short_ld); }), HasSubstr("ldc_in 7 must be >= m 8"));
    GemmParams gelu = base;
    gelu.epilogue = GemmEpilogue::kGeluAuxBias;
    gelu.aux = aux.data();
    gelu.ldaux = m;
    EXPECT_THAT(MessageOf<Error>([&] { Gemm(gelu); }),
                HasSubstr("a separate C (c_in) takes epilogue none or bias, got gelu_aux_bias"));
    GemmParams beta_zero = overlap;
    beta_zero.beta = 0.0;
    EXPECT_NO_THROW(Gemm(beta_zero)) << "beta = 0 never reads C, wherever it is";
}

auto ResidualCases(DeviceType type) { return DeviceCases(type, ::testing::ValuesIn(Providers(type))); }
std::string ResidualCaseName(const ::testing::TestParamInfo<ResidualParam> &info) {
    return std::string(DTypeName(std::get<0>(info.param).dtype)) + "_" + std::get<1>(info.param);
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(GemmResidualTest, ResidualCases, ResidualCaseName);

// ---------------------------------------------------------------------------------------------------------------------
// The Linear ops' residuals

using LinearResidualTest = GemmResidualTest;

TEST_P(LinearResidualTest, ForwardAddsTheResidualInTheGemm) {
    for (const auto &[rows, in, out] : {std::tuple{128, 64, 64}, std::tuple{7, 33, 17}, std::tuple{1000, 64, 127}}) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " in " << in << " out " << out);
        const std::uint64_t seed = static_cast<std::uint64_t>(rows + in + out);
        const Tensor x = Random({rows, in}, dtype(), seed, "x");
        const Tensor w = Random({out, in}, dtype(), seed, "w", 1.0 / std::sqrt(static_cast<double>(in)));
        const Tensor b = Random({out}, dtype(), seed, "b");
        const Tensor r = Random({rows, out}, dtype(), seed, "r");
        const Values rv = r.ToDoubleVector();
        const Values bv = b.ToDoubleVector();
        const Values want = AddScaled(RefLinearForward(x.ToDoubleVector(), w.ToDoubleVector(), &bv, rows, out, in), rv);
        Tensor y = Poison({rows, out}, dtype());
        kernels::LinearForward({.x = x, .weight = w, .bias = &b, .y = y, .residual = &r});
        EXPECT_TRUE(ValuesMatch(y, want, dtype(), OnCuda(kUnfusedBiasRoundings + 1)));
        EXPECT_EQ(r.ToDoubleVector(), rv) << "the residual was written";
        // The residual may be y itself: y += x·Wᵀ + b.
        Tensor acc = r.Clone();
        kernels::LinearForward({.x = x, .weight = w, .bias = &b, .y = acc, .residual = &acc});
        EXPECT_TRUE(ValuesMatch(acc, want, dtype(), OnCuda(kUnfusedBiasRoundings + 1))) << "in place";
    }
}

TEST_P(LinearResidualTest, BackwardAddsTheResidualGradientInTheDgradGemm) {
    for (const auto &[rows, in, out] : {std::tuple{128, 64, 256}, std::tuple{7, 33, 17}, std::tuple{1000, 127, 64}}) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " in " << in << " out " << out);
        const std::uint64_t seed = static_cast<std::uint64_t>(rows * 3 + in + out);
        const Tensor x = Random({rows, in}, dtype(), seed, "x");
        const Tensor w = Random({out, in}, dtype(), seed, "w", 1.0 / std::sqrt(static_cast<double>(out)));
        const Tensor dy = Random({rows, out}, dtype(), seed, "dy");
        const Tensor g = Random({rows, in}, dtype(), seed, "g");
        const Values gv = g.ToDoubleVector();
        const Values want =
            AddScaled(RefLinearBackwardInput(dy.ToDoubleVector(), w.ToDoubleVector(), rows, out, in), gv);
        Tensor dx = Poison({rows, in}, dtype());
        kernels::LinearBackwardInput({.dy = dy, .weight = w, .dx = dx, .dx_residual = &g});
        EXPECT_TRUE(ValuesMatch(dx, want, dtype(), OnCuda(kEpilogueRoundings))) << "LinearBackwardInput";
        EXPECT_EQ(g.ToDoubleVector(), gv) << "dx_residual was written";
        // LinearBackward (on CUDA its own kernel, the bias grad beside the GEMMs): dx with the residual, and dW, db
        // unchanged by it.
        Tensor dx2 = Poison({rows, in}, dtype());
        Tensor dw = Poison({out, in}, dtype());
        Tensor db = Poison({out}, dtype());
        kernels::LinearBackward(
            {.dy = dy, .x = &x, .weight = &w, .dx = &dx2, .dweight = &dw, .dbias = &db, .dx_residual = &g});
        EXPECT_TRUE(ValuesMatch(dx2, want, dtype(), OnCuda(kEpilogueRoundings))) << "LinearBackward dx";
        EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dy.ToDoubleVector(), x.ToDoubleVector(), rows, out, in),
                                dtype(), OnCuda(kEpilogueRoundings)))
            << "LinearBackward dweight";
        EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dy.ToDoubleVector(), rows, out), dtype())) << "LinearBackward dbias";
    }
}

TEST_P(LinearResidualTest, BadResidualsAreRejected) {
    const Tensor x = Random({4, 8}, dtype(), 9, "x");
    const Tensor w = Random({6, 8}, dtype(), 9, "w");
    const Tensor dy = Random({4, 6}, dtype(), 9, "dy");
    Tensor y = Poison({4, 6}, dtype());
    Tensor pre = Poison({4, 6}, dtype());
    const Tensor wrong_shape = Random({4, 5}, dtype(), 9, "r");
    EXPECT_THAT(
        MessageOf<ShapeError>([&] { kernels::LinearForward({.x = x, .weight = w, .y = y, .residual = &wrong_shape}); }),
        AllOf(HasSubstr("LinearForward"), HasSubstr("residual")));
    const Tensor other_dtype = Random({4, 6}, dtype() == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32, 9, "r");
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { kernels::LinearForward({.x = x, .weight = w, .y = y, .residual = &other_dtype}); }),
        AllOf(HasSubstr("LinearForward"), HasSubstr("residual")));
    const Tensor r = Random({4, 6}, dtype(), 9, "r");
    EXPECT_THAT(MessageOf<Error>([&] {
                    kernels::LinearForward({.x = x,
                                            .weight = w,
                                            .y = y,
                                            .activation = kernels::LinearActivation::kGeluTanh,
                                            .pre_activation = &pre,
                                            .residual = &r});
                }),
                HasSubstr("takes no activation"));
    Tensor dx = Poison({4, 8}, dtype());
    const Tensor g_wrong = Random({4, 6}, dtype(), 9, "g");
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { kernels::LinearBackwardInput({.dy = dy, .weight = w, .dx = dx, .dx_residual = &g_wrong}); }),
                AllOf(HasSubstr("LinearBackwardInput"), HasSubstr("dx_residual")));
    const Tensor g = Random({4, 8}, dtype(), 9, "g");
    EXPECT_THAT(MessageOf<Error>([&] { kernels::LinearBackward({.dy = dy, .x = &x, .dx_residual = &g}); }),
                HasSubstr("dx_residual is added to dx: it needs dx"));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearResidualTest, ResidualCases, ResidualCaseName);

} // namespace
} // namespace shardline::testing
