// Seed 002's precision claim, measured: the fused bias epilogue (default provider: the bias added to the fp32
// accumulator, then one rounding to the dtype) is at least as accurate against float64 as the unfused path (legacy
// provider: the GEMM output rounded to the dtype, the bias added, rounded again).
//
// Over 120 random cases per dtype (M in [1, 256], N in 8·[1, 48], K in 8·[2, 128]: aligned, so the fused epilogue
// applies; X ~ N(0, 1), W ~ N(0, 1/K) so X·Wᵀ ~ N(0, 1), bias ~ N(0, 1), as large as the product), the mean over cases
// of each path's mean absolute error against float64 (computed from the rounded device inputs) must satisfy
// fused <= unfused. Prints one line per dtype for the record:
//     [precision] bf16 fused=... unfused=... ratio=... cases=... fused_better_or_equal=... differing_cases=...

#include <cmath>
#include <iostream>
#include <random>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

constexpr int kCases = 120;

using CudaBiasEpiloguePrecisionTest = CudaParamTest<DType>;

TEST_P(CudaBiasEpiloguePrecisionTest, FusedEpilogueIsNoLessAccurateThanUnfused) {
    const DType dtype = GetParam();
    std::mt19937_64 rng(dtype == DType::kBFloat16 ? 20021 : 20022);
    std::uniform_int_distribution<std::int64_t> pick_m(1, 256);
    std::uniform_int_distribution<std::int64_t> pick_n(1, 48);
    std::uniform_int_distribution<std::int64_t> pick_k(2, 128);

    double fused_sum = 0.0;
    double unfused_sum = 0.0;
    int fused_no_worse = 0;
    int differing_cases = 0;
    for (int c = 0; c < kCases; ++c) {
        const std::int64_t m = pick_m(rng);
        const std::int64_t n = 8 * pick_n(rng);
        const std::int64_t k = 8 * pick_k(rng);
        SCOPED_TRACE(::testing::Message() << "case " << c << ": M " << m << ", N " << n << ", K " << k);
        const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(c);
        const Tensor x = RandomGpu({m, k}, dtype, seed, "x");
        const Tensor w = RandomGpu({n, k}, dtype, seed, "w", 1.0 / std::sqrt(static_cast<double>(k)));
        const Tensor b = RandomGpu({n}, dtype, seed, "b");

        const Values fused = kernels::LinearForward(x, w, &b).ToDoubleVector();
        Values unfused;
        {
            ScopedProvider legacy(kernels::kLegacyProvider);
            unfused = kernels::LinearForward(x, w, &b).ToDoubleVector();
        }
        const Values bv = b.ToDoubleVector();
        const Values ref = RefLinearForward(x.ToDoubleVector(), w.ToDoubleVector(), &bv, m, n, k);
        // Both paths are correct to the dtype's tolerance (the unfused one rounds twice).
        ASSERT_TRUE(ValuesMatch(fused, ref, dtype, kUnfusedBiasRoundings)) << "fused";
        ASSERT_TRUE(ValuesMatch(unfused, ref, dtype, kUnfusedBiasRoundings)) << "unfused";

        const double fused_err = MeanAbsError(fused, ref);
        const double unfused_err = MeanAbsError(unfused, ref);
        fused_sum += fused_err;
        unfused_sum += unfused_err;
        fused_no_worse += fused_err <= unfused_err;
        differing_cases += fused != unfused;
    }
    const double fused_mean = fused_sum / kCases;
    const double unfused_mean = unfused_sum / kCases;
    const std::string line = fmt::format(
        "[precision] {} fused={:.6e} unfused={:.6e} ratio={:.4f} cases={} fused_better_or_equal={} differing_cases={}",
        ShortDTypeName(dtype), fused_mean, unfused_mean, fused_mean / unfused_mean, kCases, fused_no_worse,
        differing_cases);
    std::cout << line << std::endl;
    RecordProperty("precision", line);

    // The two paths must really differ (else the legacy provider did not run its unfused bias add, and the comparison
    // below would hold trivially).
    EXPECT_GE(differing_cases, kCases / 2) << "the legacy provider's output equals the fused one in most cases";
    EXPECT_LE(fused_mean, unfused_mean) << line;
}

INSTANTIATE_TEST_SUITE_P(DType, CudaBiasEpiloguePrecisionTest, HalfDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
