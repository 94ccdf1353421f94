// Gemm with beta = 1 into a half-precision D (C = D, the accumulate of a gradient without an fp32 main grad): the
// result must be the float64 C + A·op(B) up to fp32 accumulation and one rounding into the dtype — also where C and
// the product nearly cancel, which is where a reduction in the output precision (split-K partial sums rounded to
// bf16/fp16) shows. Seen on an H100 (830006f): EmbeddingBag's count-GEMM backward accumulating into a bf16 gradient
// gave 0 for an element whose float64 value is 0.0073 (the shape of the first case below). Prints the worst error per
// case against its bound:
//     [gemm beta=1] bf16 m=24 n=200 k=64 nt: worst 0.31 of the bound, 0 of 4800 elements over

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/kernels/gemm.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using CudaGemmAccumulatePrecisionTest = CudaParamTest<DType>;

struct Case {
    std::int64_t m, n, k;
    bool trans_b;
};

/// One unit in the last place of |x| in the dtype (bf16: 8 significant bits, fp16: 11), subnormals ignored.
double Ulp(double x, DType dtype) {
    const int bits = dtype == DType::kBFloat16 ? 8 : 11;
    const double a = std::max(std::abs(x), dtype == DType::kBFloat16 ? 1e-30 : 6.1e-5);
    return std::ldexp(1.0, std::ilogb(a) - (bits - 1));
}

TEST_P(CudaGemmAccumulatePrecisionTest, BetaOneIntoAHalfOutputIsTheFloat64SumRoundedAboutOnce) {
    const DType dtype = GetParam();
    // Column-major, as GemmParams: A m×k (lda m), B n×k used transposed (ldb n) or k×n (ldb k), D m×n (ldc m).
    const Case cases[] = {{24, 200, 64, true}, {64, 64, 4096, false}, {128, 96, 8192, true}, {8, 8, 65536, false}};
    std::mt19937_64 rng(dtype == DType::kBFloat16 ? 3101 : 3102);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_int_distribution<int> small(0, 2);
    std::uniform_real_distribution<double> nudge(-0.01, 0.01);
    for (const Case &c : cases) {
        const std::string name =
            fmt::format("{} m={} n={} k={} {}", DTypeName(dtype), c.m, c.n, c.k, c.trans_b ? "nt" : "nn");
        SCOPED_TRACE(name);
        // A ~ N(0, 1); B small integers (as a count matrix); both rounded to the dtype by the upload.
        std::vector<double> a(static_cast<std::size_t>(c.m * c.k));
        std::vector<double> b(static_cast<std::size_t>(c.n * c.k));
        for (double &v : a) {
            v = normal(rng);
        }
        for (double &v : b) {
            v = small(rng);
        }
        const Tensor ta = Tensor::FromVector(a, {c.k, c.m}, dtype).To(Gpu());
        const Tensor tb = Tensor::FromVector(b, c.trans_b ? Shape{c.k, c.n} : Shape{c.n, c.k}, dtype).To(Gpu());
        a = ta.ToDoubleVector();
        b = tb.ToDoubleVector();
        const auto A = [&](std::int64_t i, std::int64_t l) { return a[static_cast<std::size_t>(l * c.m + i)]; };
        const auto B = [&](std::int64_t l, std::int64_t j) { // op(B)[l, j]
            return c.trans_b ? b[static_cast<std::size_t>(l * c.n + j)] : b[static_cast<std::size_t>(j * c.k + l)];
        };
        // The product in float64, and its magnitude sum for the fp32-accumulation part of the bound.
        std::vector<double> product(static_cast<std::size_t>(c.m * c.n));
        std::vector<double> magnitude(product.size());
        for (std::int64_t j = 0; j < c.n; ++j) {
            for (std::int64_t i = 0; i < c.m; ++i) {
                double s = 0.0;
                double mag = 0.0;
                for (std::int64_t l = 0; l < c.k; ++l) {
                    s += A(i, l) * B(l, j);
                    mag += std::abs(A(i, l) * B(l, j));
                }
                product[static_cast<std::size_t>(j * c.m + i)] = s;
                magnitude[static_cast<std::size_t>(j * c.m + i)] = mag;
            }
        }
        // C ≈ −product + a nudge: D = C + product nearly cancels everywhere.
        std::vector<double> initial(product.size());
        for (std::size_t e = 0; e < initial.size(); ++e) {
            initial[e] = -product[e] + nudge(rng);
        }
        Tensor d = Tensor::FromVector(initial, {c.n, c.m}, dtype).To(Gpu());
        initial = d.ToDoubleVector();
        kernels::Gemm(kernels::GemmParams{.trans_b = c.trans_b,
                                          .m = c.m,
                                          .n = c.n,
                                          .k = c.k,
                                          .a = ta.data(),
                                          .lda = c.m,
                                          .a_type = dtype,
                                          .b = tb.data(),
                                          .ldb = c.trans_b ? c.n : c.k,
                                          .b_type = dtype,
                                          .c = d.data(),
                                          .ldc = c.m,
                                          .c_type = dtype,
                                          .beta = 1.0,
                                          .device = Gpu()});
        const std::vector<double> got = d.ToDoubleVector();
        // Bound: one rounding into the dtype (an ulp, generous against the half ulp of a correct rounding) + fp32
        // accumulation of the k products and of C (4·2^-24 per unit of magnitude, generous against k·2^-24 worst
        // case being far larger than typical). A partial sum rounded to the dtype costs ~2^-9·|partial| in bf16.
        double worst = 0.0;
        int over = 0;
        std::size_t worst_at = 0;
        for (std::size_t e = 0; e < got.size(); ++e) {
            const double want = initial[e] + product[e];
            const double bound = Ulp(want, dtype) + 4.0 * std::ldexp(magnitude[e] + std::abs(initial[e]), -24) *
                                                        std::sqrt(static_cast<double>(c.k));
            const double ratio = std::abs(got[e] - want) / bound;
            if (ratio > 1.0) {
                ++over;
            }
            if (ratio > worst) {
                worst = ratio;
                worst_at = e;
            }
        }
        std::cout << fmt::format("[gemm beta=1] {}: worst {:.2f} of the bound (got {} want {}), {} of {} elements over",
                                 name, worst, got[worst_at], initial[worst_at] + product[worst_at], over, got.size())
                  << std::endl;
        EXPECT_EQ(over, 0) << "worst " << worst << "x the bound at " << worst_at << ": got " << got[worst_at]
                           << ", want " << initial[worst_at] + product[worst_at];
    }
}

INSTANTIATE_TEST_SUITE_P(HalfDTypes, CudaGemmAccumulatePrecisionTest,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType> &info) {
                             return std::string(DTypeName(info.param));
                         });

} // namespace
} // namespace shardline::testing
