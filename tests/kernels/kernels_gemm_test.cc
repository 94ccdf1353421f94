// Gemm called directly, in cuBLAS's column-major convention, on every device and with every provider that serves it
// (CPU: default; CUDA: default = cuBLASLt, legacy = cublasGemmEx + separate epilogue kernels), against a float64
// column-major reference: transposes, leading dimensions with padding, strided batches with gaps and stride 0,
// alpha/beta, empty problems, every epilogue; CUDA's half inputs into a float32 C; the CPU's own dtype checks.

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/gemm_tuning.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::Gemm;
using kernels::GemmEpilogue;
using kernels::GemmParams;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// How a column-major operand lies in its flat buffer.
struct Layout {
    std::int64_t pad = 0; ///< extra rows in the leading dimension (ld = rows + pad), so ld is really honoured
    std::int64_t gap = 0; ///< extra elements after each batch entry
    bool shared = false;  ///< stride 0: one matrix serves the whole batch
    double stddev = 1.0;  ///< of its normal random values
};

/// A column-major operand in a flat buffer: `batch` matrices of rows×cols with leading dimension ld, `stride` elements
/// apart; `host` holds the buffer's initial contents.
struct Operand {
    std::int64_t rows = 0;
    std::int64_t cols = 0;
    std::int64_t ld = 0;
    std::int64_t stride = 0;
    std::int64_t batch = 1;
    Tensor data;
    Values host;

    double At(std::int64_t b, std::int64_t i, std::int64_t j) const {
        return host[static_cast<std::size_t>(b * stride + i + j * ld)];
    }
};

Operand MakeOperand(std::int64_t rows, std::int64_t cols, std::int64_t batch, const Layout &layout, DType dtype,
                    Device device, std::uint64_t seed, std::string_view name) {
    Operand o;
    o.rows = rows;
    o.cols = cols;
    o.batch = batch;
    o.ld = std::max<std::int64_t>(1, rows + layout.pad);
    const std::int64_t entry = o.ld * cols + layout.gap;
    o.stride = layout.shared ? 0 : entry;
    const std::int64_t copies = layout.shared ? 1 : batch;
    o.data = RandomTensor({std::max<std::int64_t>(1, copies * entry)}, dtype, device, seed, name,
                          RandomDistribution::kNormal, 0.0, layout.stddev);
    o.host = o.data.ToDoubleVector();
    return o;
}

/// opA(i, p) of a column-major A (m×k, or k×m stored when trans).
double OpAt(const Operand &x, bool trans, std::int64_t b, std::int64_t i, std::int64_t p) {
    return trans ? x.At(b, p, i) : x.At(b, i, p);
}

/// D[b] = alpha·op(A[b])·op(B[b]) + beta·C[b] (+ bias[i]) in float64 over C's whole buffer (entries outside D keep C's
/// values; beta = 0 never reads C).
Values RefGemm(const Operand &a, bool ta, const Operand &b, bool tb, const Operand &c, std::int64_t m, std::int64_t n,
               std::int64_t k, double alpha, double beta, const Values *bias = nullptr) {
    Values d = c.host;
    for (std::int64_t bi = 0; bi < c.batch; ++bi) {
        for (std::int64_t j = 0; j < n; ++j) {
            for (std::int64_t i = 0; i < m; ++i) {
                double acc = 0.0;
                for (std::int64_t p = 0; p < k; ++p) {
                    acc += OpAt(a, ta, bi, i, p) * OpAt(b, tb, bi, p, j);
                }
                const double cv = beta == 0.0 ? 0.0 : beta * c.At(bi, i, j);
                d[static_cast<std::size_t>(bi * c.stride + i + j * c.ld)] =
                    alpha * acc + cv + (bias != nullptr ? (*bias)[i] : 0.0);
            }
        }
    }
    return d;
}

/// `buffer` (C's layout) within the m×n D of every batch entry, in order.
Values Region(const Operand &c, const Values &buffer, std::int64_t m, std::int64_t n) {
    Values out;
    for (std::int64_t bi = 0; bi < c.batch; ++bi) {
        for (std::int64_t j = 0; j < n; ++j) {
            for (std::int64_t i = 0; i < m; ++i) {
                out.push_back(buffer[static_cast<std::size_t>(bi * c.stride + i + j * c.ld)]);
            }
        }
    }
    return out;
}

/// C's buffer after the call: D (the m×n of every batch entry) against `want` (RefGemm's whole buffer) with the
/// rounding budget, and every entry outside D (leading-dimension padding, gaps) untouched, exactly.
void ExpectD(const Operand &c, const Values &want, std::int64_t m, std::int64_t n, DType dtype, double roundings) {
    const Values got = c.data.ToDoubleVector();
    std::vector<bool> in_d(got.size(), false);
    for (std::int64_t bi = 0; bi < c.batch; ++bi) {
        for (std::int64_t j = 0; j < n; ++j) {
            for (std::int64_t i = 0; i < m; ++i) {
                in_d[static_cast<std::size_t>(bi * c.stride + i + j * c.ld)] = true;
            }
        }
    }
    for (std::size_t at = 0; at < got.size(); ++at) {
        if (!in_d[at]) {
            ASSERT_EQ(got[at], c.host[at]) << "element " << at << " of C, outside D, was written";
        }
    }
    EXPECT_TRUE(ValuesMatch(Region(c, got, m, n), Region(c, want, m, n), dtype, roundings));
}

/// Column-major throughout: the operands are built column-major, so no row-major derivation is needed.
GemmParams Params(const Operand &a, bool ta, const Operand &b, bool tb, Operand &c, std::int64_t m, std::int64_t n,
                  std::int64_t k, double alpha, double beta, Device device) {
    return GemmParams{.trans_a = ta,
                      .trans_b = tb,
                      .m = m,
                      .n = n,
                      .k = k,
                      .a = a.data.data(),
                      .lda = a.ld,
                      .a_type = a.data.dtype(),
                      .b = b.data.data(),
                      .ldb = b.ld,
                      .b_type = b.data.dtype(),
                      .c = c.data.data(),
                      .ldc = c.ld,
                      .c_type = c.data.dtype(),
                      .batch_count = c.batch,
                      .stride_a = a.stride,
                      .stride_b = b.stride,
                      .stride_c = c.stride,
                      .alpha = alpha,
                      .beta = beta,
                      .device = device};
}

/// One product problem: D = alpha·op(A)·op(B) + beta·C (+ a bias epilogue).
struct ProductCase {
    bool ta = false;
    bool tb = false;
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;
    std::int64_t batch = 1;
    Layout a{};
    Layout b{};
    Layout c{};
    double alpha = 1.0;
    double beta = 0.0;
    bool bias = false;
};

/// The providers that serve Gemm on a device, each a case: the CPU's default (OpenBLAS); CUDA's default (cuBLASLt)
/// and legacy (cublasGemmEx and separate epilogue kernels).
std::vector<std::string> GemmProviders(DeviceType type) {
    if (type == DeviceType::kCPU) {
        return {std::string(kernels::kDefaultProvider)};
    }
    return {std::string(kernels::kDefaultProvider), std::string(kernels::kLegacyProvider)};
}

/// A Gemm case on its device with its provider selected; Param is (DeviceDType, provider, ...).
template <class Param> class GemmFixture : public DeviceTest<Param> {
protected:
    void SetUp() override {
        DeviceTest<Param>::SetUp();
        if (this->IsSkipped()) {
            return;
        }
        provider_.emplace(std::get<1>(this->GetParam()));
    }
    void TearDown() override {
        provider_.reset();
        DeviceTest<Param>::TearDown();
    }

    /// Whether the case runs CUDA's default provider (cuBLASLt, and the rank-1 kernel for k = 1).
    bool OnCudaDefault() const {
        return this->device().is_cuda() && std::get<1>(this->GetParam()) == kernels::kDefaultProvider;
    }

    Operand Make(std::int64_t rows, std::int64_t cols, std::int64_t batch, const Layout &layout, DType dtype,
                 std::uint64_t seed, std::string_view name) const {
        return MakeOperand(rows, cols, batch, layout, dtype, this->device(), seed, name);
    }

    /// Runs the product with A and B of `ab_type` and C of `c_type` and checks D against float64 and that the rest of
    /// C's buffer is untouched.
    void CheckProduct(const ProductCase &c, DType ab_type, DType c_type) {
        SCOPED_TRACE(::testing::Message()
                     << "ta " << c.ta << " tb " << c.tb << " m " << c.m << " n " << c.n << " k " << c.k << " batch "
                     << c.batch << (c.a.shared ? " (a shared)" : "") << (c.b.shared ? " (b shared)" : "") << " alpha "
                     << c.alpha << " beta " << c.beta << " C " << DTypeName(c_type) << (c.bias ? " +bias" : ""));
        const Operand a = Make(c.ta ? c.k : c.m, c.ta ? c.m : c.k, c.batch, c.a, ab_type, 50, "a");
        const Operand b = Make(c.tb ? c.n : c.k, c.tb ? c.k : c.n, c.batch, c.b, ab_type, 50, "b");
        Operand d = Make(c.m, c.n, c.batch, c.c, c_type, 50, "c");
        Tensor bias = this->Random({c.m}, c_type, 50, "bias");
        const Values bias_v = bias.ToDoubleVector();
        ASSERT_GT(AbsSum(a.host) * AbsSum(b.host) * AbsSum(d.host), 0.0);
        GemmParams params = Params(a, c.ta, b, c.tb, d, c.m, c.n, c.k, c.alpha, c.beta, this->device());
        if (c.bias) {
            params.epilogue = GemmEpilogue::kBias;
            params.bias = bias.data();
            params.bias_type = c_type;
        }
        Gemm(params);
        const Values want = RefGemm(a, c.ta, b, c.tb, d, c.m, c.n, c.k, c.alpha, c.beta, c.bias ? &bias_v : nullptr);
        ExpectD(d, want, c.m, c.n, c_type,
                this->OnCuda(c.bias ? kUnfusedBiasRoundings : (c.beta != 0.0 ? kEpilogueRoundings : 1)));
    }

private:
    std::optional<ScopedProvider> provider_;
};

// The CPU problems' layouts: every leading dimension padded, a gap between batch entries.
constexpr Layout kPaddedA{.pad = 2, .gap = 5};
constexpr Layout kPaddedB{.pad = 3, .gap = 1};
constexpr Layout kPaddedC{.pad = 1, .gap = 4};

std::string ProviderName(const DeviceDType &c, const std::string &provider) {
    return std::string(DTypeName(c.dtype)) + "_" + provider;
}

// ---------------------------------------------------------------------------------------------------------------------
// Products, per transpose pair

using GemmTransposeParam = std::tuple<DeviceDType, std::string, bool, bool>;
class GemmTransposeTest : public GemmFixture<GemmTransposeParam> {
protected:
    bool ta() const { return std::get<2>(GetParam()); }
    bool tb() const { return std::get<3>(GetParam()); }
};

TEST_P(GemmTransposeTest, StridedBatchWithPaddedLeadingDimsMatchesReference) {
    CheckProduct({.ta = ta(),
                  .tb = tb(),
                  .m = 7,
                  .n = 5,
                  .k = 33,
                  .batch = 3,
                  .a = kPaddedA,
                  .b = kPaddedB,
                  .c = kPaddedC,
                  .alpha = 0.75,
                  .beta = -0.5},
                 dtype(), dtype());
}

TEST_P(GemmTransposeTest, SingleMatrixWithAlphaOneBetaZeroMatchesReference) {
    CheckProduct({.ta = ta(), .tb = tb(), .m = 1, .n = 17, .k = 3, .a = kPaddedA, .b = kPaddedB, .c = kPaddedC},
                 dtype(), dtype());
}

TEST_P(GemmTransposeTest, StrideZeroBroadcastsAnOperandOverTheBatch) {
    for (const auto &[shared_a, shared_b] : {std::pair{true, false}, std::pair{false, true}}) {
        Layout a = kPaddedA;
        Layout b = kPaddedB;
        a.shared = shared_a;
        b.shared = shared_b;
        CheckProduct(
            {.ta = ta(), .tb = tb(), .m = 6, .n = 4, .k = 9, .batch = 4, .a = a, .b = b, .c = kPaddedC, .alpha = 1.25},
            dtype(), dtype());
    }
}

TEST_P(GemmTransposeTest, ProductsWithLeadingDimsAndBatches) {
    CheckProduct({.ta = ta(), .tb = tb(), .m = 33, .n = 17, .k = 127}, dtype(), dtype());
    CheckProduct({.ta = ta(),
                  .tb = tb(),
                  .m = 64,
                  .n = 48,
                  .k = 40,
                  .batch = 3,
                  .a = {.pad = 3},
                  .b = {.pad = 3},
                  .c = {.pad = 3},
                  .alpha = 0.5,
                  .beta = 0.75},
                 dtype(), dtype());
    CheckProduct({.ta = ta(), .tb = tb(), .m = 24, .n = 40, .k = 16, .batch = 4, .b = {.shared = true}, .beta = 1.0},
                 dtype(), dtype());
}

TEST_P(GemmTransposeTest, RankOneProductsMatchReference) {
    // k = 1: on CUDA's default provider the rank-1 kernel (no cuBLASLt plan), with 16-byte vectors of D where A's
    // elements are contiguous, m and ldc are multiples of the vector and A and D are aligned (problems 1, 4 and 5, and
    // 3 without trans_a), else one element per thread (2, 3 with trans_a, whose lda is 3, and 6); the other providers
    // run their GEMM.
    const kernels::GemmPlanStats before = kernels::GetGemmPlanStats();
    CheckProduct({.ta = ta(), .tb = tb(), .m = 64, .n = 48, .k = 1}, dtype(), dtype());
    CheckProduct({.ta = ta(),
                  .tb = tb(),
                  .m = 7,
                  .n = 5,
                  .k = 1,
                  .a = kPaddedA,
                  .b = kPaddedB,
                  .c = kPaddedC,
                  .alpha = 0.75,
                  .beta = -0.5},
                 dtype(), dtype());
    CheckProduct({.ta = ta(),
                  .tb = tb(),
                  .m = 40,
                  .n = 33,
                  .k = 1,
                  .a = {.pad = 2},
                  .b = {.pad = 1},
                  .c = {.pad = 8},
                  .alpha = -1.5,
                  .beta = 1.0},
                 dtype(), dtype());
    // Columns enough for the y blocks to loop (kMaxBlocks), and a column longer than one block.
    CheckProduct({.ta = ta(), .tb = tb(), .m = 8, .n = 70000, .k = 1, .beta = 0.5}, dtype(), dtype());
    CheckProduct({.ta = ta(), .tb = tb(), .m = 4104, .n = 3, .k = 1}, dtype(), dtype());
    // One element per thread over several blocks down a column, the y blocks looping.
    CheckProduct({.ta = ta(), .tb = tb(), .m = 1027, .n = 9000, .k = 1, .alpha = 2.0, .beta = -1.0}, dtype(), dtype());
    const kernels::GemmPlanStats after = kernels::GetGemmPlanStats();
    if (OnCudaDefault()) {
        EXPECT_EQ(after.rank_one - before.rank_one, 6U) << "every k = 1 product ran the rank-1 kernel";
        EXPECT_EQ(after.plans_built, before.plans_built) << "and built no cuBLASLt plan";
    } else {
        EXPECT_EQ(after.rank_one, before.rank_one);
    }
}

auto GemmTransposeCases(DeviceType type) {
    return DeviceCases(type, ::testing::ValuesIn(GemmProviders(type)), ::testing::Bool(), ::testing::Bool());
}
std::string GemmTransposeCaseName(const ::testing::TestParamInfo<GemmTransposeParam> &info) {
    const auto &[c, provider, ta, tb] = info.param;
    return ProviderName(c, provider) + (ta ? "_TA" : "_NA") + (tb ? "_TB" : "_NB");
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(GemmTransposeTest, GemmTransposeCases, GemmTransposeCaseName);

// ---------------------------------------------------------------------------------------------------------------------
// Empty problems, beta, epilogues, argument checks

using GemmParam = std::tuple<DeviceDType, std::string>;
using GemmTest = GemmFixture<GemmParam>;

TEST_P(GemmTest, ZeroKGivesBetaTimesC) {
    CheckProduct(
        {.m = 4, .n = 3, .k = 0, .batch = 2, .a = kPaddedA, .b = kPaddedB, .c = kPaddedC, .alpha = 2.0, .beta = -1.5},
        dtype(), dtype());
}

TEST_P(GemmTest, BetaZeroNeverReadsC) {
    const Operand a = Make(5, 7, 1, kPaddedA, dtype(), 1, "gemm.a");
    const Operand b = Make(6, 7, 1, kPaddedB, dtype(), 1, "gemm.b"); // trans_b: stored n×k
    Operand c = Make(5, 6, 1, kPaddedC, dtype(), 1, "gemm.c");
    c.data.Fill(std::numeric_limits<double>::quiet_NaN());
    Gemm(Params(a, false, b, true, c, 5, 6, 7, 1.0, 0.0, device()));
    const Values d = Region(c, c.data.ToDoubleVector(), 5, 6);
    for (std::size_t i = 0; i < d.size(); ++i) {
        ASSERT_FALSE(std::isnan(d[i])) << "element " << i << " of D";
    }
    EXPECT_TRUE(ValuesMatch(d, Region(c, RefGemm(a, false, b, true, c, 5, 6, 7, 1.0, 0.0), 5, 6), dtype()));
    // k = 1 (CUDA's rank-1 kernel), vectorised (m = 64) and not (m = 5): beta = 0 reads no D either.
    for (const std::int64_t m : {std::int64_t{5}, std::int64_t{64}}) {
        const Operand a1 = Make(m, 1, 1, {}, dtype(), 3, "gemm.a");
        const Operand b1 = Make(6, 1, 1, {}, dtype(), 3, "gemm.b"); // trans_b: stored n×k
        Operand c1 = Make(m, 6, 1, {}, dtype(), 3, "gemm.c");
        c1.data.Fill(std::numeric_limits<double>::quiet_NaN());
        Gemm(Params(a1, false, b1, true, c1, m, 6, 1, 1.0, 0.0, device()));
        const Values d1 = c1.data.ToDoubleVector();
        for (std::size_t i = 0; i < d1.size(); ++i) {
            ASSERT_FALSE(std::isnan(d1[i])) << "element " << i << " of D, k = 1, m = " << m;
        }
        EXPECT_TRUE(ValuesMatch(d1, RefGemm(a1, false, b1, true, c1, m, 6, 1, 1.0, 0.0), dtype()));
    }
    // k = 0 with beta = 0 writes zeros over NaN too.
    Operand z = Make(3, 2, 1, kPaddedC, dtype(), 2, "gemm.c");
    z.data.Fill(std::numeric_limits<double>::quiet_NaN());
    Gemm(Params(a, false, b, false, z, 3, 2, 0, 1.0, 0.0, device()));
    EXPECT_EQ(Region(z, z.data.ToDoubleVector(), 3, 2), Values(6, 0.0));
}

TEST_P(GemmTest, EmptyOutputLeavesBuffersUntouched) {
    // m = 0.
    const Operand a = Make(0, 4, 1, kPaddedA, dtype(), 3, "gemm.a");
    const Operand b = Make(4, 3, 1, kPaddedB, dtype(), 3, "gemm.b");
    Operand c = Make(0, 3, 1, kPaddedC, dtype(), 3, "gemm.c");
    Gemm(Params(a, false, b, false, c, 0, 3, 4, 1.0, 0.0, device()));
    EXPECT_EQ(c.data.ToDoubleVector(), c.host);
    // n = 0, batched, beta = 1.
    const Operand qa = Make(4, 3, 2, kPaddedA, dtype(), 4, "gemm.a"); // trans_a: stored k×m
    const Operand qb = Make(0, 4, 2, kPaddedB, dtype(), 4, "gemm.b"); // trans_b: stored n×k
    Operand qc = Make(3, 0, 2, kPaddedC, dtype(), 4, "gemm.c");
    Gemm(Params(qa, true, qb, true, qc, 3, 0, 4, 1.0, 1.0, device()));
    EXPECT_EQ(qc.data.ToDoubleVector(), qc.host);
}

TEST_P(GemmTest, EmptyReductionGivesBetaCPlusBias) {
    const std::int64_t m = 24;
    const std::int64_t n = 10;
    for (const double beta : {0.0, 0.5}) {
        for (const bool bias : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "k = 0, beta " << beta << (bias ? ", bias" : ""));
            Tensor d = Random({m * n}, dtype(), 54, "c", 100.0);
            const Values c = d.ToDoubleVector();
            Tensor bias_t = Random({m}, dtype(), 54, "bias");
            const Values bv = bias_t.ToDoubleVector();
            try {
                // A and B may be null when k = 0 (ValidateGemmParams).
                Gemm(GemmParams{.m = m,
                                .n = n,
                                .k = 0,
                                .lda = m,
                                .a_type = dtype(),
                                .ldb = 1,
                                .b_type = dtype(),
                                .c = d.data(),
                                .ldc = m,
                                .c_type = dtype(),
                                .beta = beta,
                                .epilogue = bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                                .bias = bias ? bias_t.data() : nullptr,
                                .bias_type = dtype(),
                                .device = device()});
            } catch (const Error &e) {
                GTEST_SKIP() << "Gemm with k = 0 is not supported by this provider: " << e.what();
            }
            Values want(c.size());
            for (std::int64_t j = 0; j < n; ++j) {
                for (std::int64_t i = 0; i < m; ++i) {
                    want[i + j * m] = beta * c[i + j * m] + (bias ? bv[i] : 0.0);
                }
            }
            EXPECT_TRUE(ValuesMatch(d, want, dtype(), OnCuda(bias ? kUnfusedBiasRoundings : 1)));
        }
    }
}

TEST_P(GemmTest, BiasEpilogueAddsOneBiasPerRowOfD) {
    CheckProduct({.m = 9, .n = 13, .k = 11, .a = kPaddedA, .b = kPaddedB, .c = kPaddedC, .beta = 0.5, .bias = true},
                 dtype(), dtype());
    CheckProduct({.ta = true, .m = 64, .n = 48, .k = 40, .bias = true}, dtype(), dtype());
    CheckProduct({.ta = true, .m = 33, .n = 17, .k = 127, .bias = true}, dtype(), dtype());
}

TEST_P(GemmTest, BiasEpilogueAppliesToEveryBatchEntry) {
    Layout shared_b = kPaddedB;
    shared_b.shared = true;
    CheckProduct(
        {.ta = true, .m = 5, .n = 4, .k = 6, .batch = 3, .a = kPaddedA, .b = shared_b, .c = kPaddedC, .bias = true},
        dtype(), dtype());
    CheckProduct({.tb = true, .m = 32, .n = 16, .k = 24, .batch = 3, .bias = true}, dtype(), dtype());
}

/// An m×n epilogue problem: C's (and aux's) leading dimension m + pad.
struct EpilogueCase {
    std::int64_t m;
    std::int64_t n;
    std::int64_t k;
    std::int64_t pad;
    std::uint64_t seed;
};
// The CPU's padded small problem, an aligned one and an odd one.
const std::vector<EpilogueCase> kEpilogueCases = {{9, 13, 11, 1, 6}, {64, 48, 40, 0, 51}, {33, 17, 127, 0, 51}};

TEST_P(GemmTest, GeluAuxBiasEpilogueSavesPreActivationAndAppliesGelu) {
    for (const EpilogueCase &s : kEpilogueCases) {
        for (const bool with_bias : {true, false}) {
            // Y = X·Wᵀ in column-major form (A = W stored k×m, B = Xᵀ stored k×n) and its mirror image.
            for (const auto &[ta, tb] : {std::pair{true, false}, std::pair{false, true}}) {
                SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k << " trans_a " << ta
                                                  << " trans_b " << tb << (with_bias ? " bias" : " no bias"));
                // A scaled by 1/√k keeps the pre-activation near N(0, 1), where GELU is curved.
                const Layout scaled{.stddev = 1.0 / std::sqrt(static_cast<double>(s.k))};
                const Operand a = Make(ta ? s.k : s.m, ta ? s.m : s.k, 1, scaled, dtype(), s.seed, "a");
                const Operand b = Make(tb ? s.n : s.k, tb ? s.k : s.n, 1, {}, dtype(), s.seed, "b");
                Operand d = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 100.0}, dtype(), 999, "poison");
                Operand aux = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 100.0}, dtype(), 998, "poison");
                Tensor bias = Random({s.m}, dtype(), s.seed, "bias");
                const Values bv = bias.ToDoubleVector();
                GemmParams params = Params(a, ta, b, tb, d, s.m, s.n, s.k, 1.0, 0.0, device());
                params.epilogue = GemmEpilogue::kGeluAuxBias;
                params.bias = with_bias ? bias.data() : nullptr;
                params.bias_type = dtype();
                params.aux = aux.data.data();
                params.ldaux = aux.ld;
                Gemm(params);
                const Values pre =
                    Region(d, RefGemm(a, ta, b, tb, d, s.m, s.n, s.k, 1.0, 0.0, with_bias ? &bv : nullptr), s.m, s.n);
                Values act(pre.size());
                std::transform(pre.begin(), pre.end(), act.begin(), RefGeluTanh);
                EXPECT_TRUE(ValuesMatch(Region(aux, aux.data.ToDoubleVector(), s.m, s.n), pre, dtype(),
                                        OnCuda(with_bias ? kUnfusedBiasRoundings : kEpilogueRoundings)))
                    << "aux = pre-activation";
                EXPECT_TRUE(
                    ValuesMatch(Region(d, d.data.ToDoubleVector(), s.m, s.n), act, dtype(), kGeluEpilogueRoundings))
                    << "D = gelu_tanh(pre-activation)";
            }
        }
    }
}

TEST_P(GemmTest, BGradBEpilogueSumsOpBOverK) {
    // Also k = 1, aligned and padded, with alpha 0.5 (which scales D, not the bias grad): on CUDA's default provider
    // the rank-1 kernel writes D and the bias grad in one launch.
    std::vector<EpilogueCase> cases = kEpilogueCases;
    cases.push_back({64, 40, 1, 0, 52});
    cases.push_back({33, 17, 1, 1, 53});
    const kernels::GemmPlanStats before = kernels::GetGemmPlanStats();
    for (const EpilogueCase &s : cases) {
        for (const bool tb : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k << " trans_b " << tb);
            const Operand a = Make(s.m, s.k, 1, {.pad = s.pad}, dtype(), s.seed + 1, "a");
            const Operand b = Make(tb ? s.n : s.k, tb ? s.k : s.n, 1, {.pad = s.pad}, dtype(), s.seed + 1, "b");
            Operand d = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 100.0}, dtype(), 999, "poison");
            Tensor bgrad = Poison({s.n}, dtype(), "poison_bgrad");
            const double alpha = s.k == 1 ? 0.5 : 1.0;
            GemmParams params = Params(a, false, b, tb, d, s.m, s.n, s.k, alpha, 0.0, device());
            params.epilogue = GemmEpilogue::kBGradB;
            params.bias = bgrad.data();
            params.bias_type = dtype();
            Gemm(params);
            Values sums(static_cast<std::size_t>(s.n), 0.0);
            for (std::int64_t j = 0; j < s.n; ++j) {
                for (std::int64_t p = 0; p < s.k; ++p) {
                    sums[j] += OpAt(b, tb, 0, p, j);
                }
            }
            ExpectD(d, RefGemm(a, false, b, tb, d, s.m, s.n, s.k, alpha, 0.0), s.m, s.n, dtype(),
                    OnCuda(kEpilogueRoundings));
            EXPECT_TRUE(ValuesMatch(bgrad, sums, dtype(), OnCuda(kEpilogueRoundings))) << "bias[j] = Σ_k op(B)[k, j]";
        }
    }
    if (OnCudaDefault()) {
        EXPECT_EQ(kernels::GetGemmPlanStats().rank_one - before.rank_one, 4U) << "the k = 1 cases, both trans_b";
    }
}

TEST_P(GemmTest, DGeluBGradEpilogueScalesByGeluGradAndSumsRows) {
    for (const EpilogueCase &s : kEpilogueCases) {
        SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
        // The dgrad of a GELU layer: D = (Wᵀ-like A)·dY, times gelu'(pre-activation saved in aux).
        const Operand a = Make(s.m, s.k, 1, {.pad = s.pad}, dtype(), s.seed + 2, "a");
        const Operand b = Make(s.k, s.n, 1, {.pad = s.pad}, dtype(), s.seed + 2, "b");
        Operand aux = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 1.5}, dtype(), s.seed + 2, "aux");
        Operand d = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 100.0}, dtype(), 999, "poison");
        Tensor bgrad = Poison({s.m}, dtype(), "poison_bgrad");
        GemmParams params = Params(a, false, b, false, d, s.m, s.n, s.k, 1.0, 0.0, device());
        params.epilogue = GemmEpilogue::kDGeluBGrad;
        params.bias = bgrad.data();
        params.bias_type = dtype();
        params.aux = aux.data.data();
        params.ldaux = aux.ld;
        Gemm(params);
        const Values prod = Region(d, RefGemm(a, false, b, false, d, s.m, s.n, s.k, 1.0, 0.0), s.m, s.n);
        const Values pre = Region(aux, aux.host, s.m, s.n);
        Values want(prod.size());
        Values sums(static_cast<std::size_t>(s.m), 0.0);
        for (std::int64_t j = 0; j < s.n; ++j) {
            for (std::int64_t i = 0; i < s.m; ++i) {
                const std::size_t at = static_cast<std::size_t>(i + j * s.m);
                want[at] = prod[at] * RefGeluTanhGrad(pre[at]);
                sums[i] += want[at];
            }
        }
        // Unfused paths round the product before the GELU grad, and may sum the rounded D; a fused epilogue evaluates
        // gelu' in its own arithmetic.
        EXPECT_TRUE(ValuesMatch(Region(d, d.data.ToDoubleVector(), s.m, s.n), want, dtype(), kGeluEpilogueRoundings))
            << "D = A·B ⊙ gelu'(aux)";
        EXPECT_TRUE(ValuesMatch(bgrad, sums, dtype(), kGeluEpilogueRoundings)) << "bias[i] = Σ_j D[i, j]";
    }
}

TEST_P(GemmTest, DGeluEpilogueScalesByGeluGradWithoutABiasGrad) {
    for (const EpilogueCase &s : kEpilogueCases) {
        SCOPED_TRACE(::testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
        // DGELU_BGRAD without the bias grad (the dgrad of a GELU layer whose bias grad accumulates elsewhere).
        const Operand a = Make(s.m, s.k, 1, {.pad = s.pad}, dtype(), s.seed + 3, "a");
        const Operand b = Make(s.k, s.n, 1, {.pad = s.pad}, dtype(), s.seed + 3, "b");
        Operand aux = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 1.5}, dtype(), s.seed + 3, "aux");
        Operand d = Make(s.m, s.n, 1, {.pad = s.pad, .stddev = 100.0}, dtype(), 999, "poison");
        Tensor untouched = Poison({s.m}, dtype(), "poison_bias");
        const Values untouched_before = untouched.ToDoubleVector();
        GemmParams params = Params(a, false, b, false, d, s.m, s.n, s.k, 1.0, 0.0, device());
        params.epilogue = GemmEpilogue::kDGelu;
        params.bias = untouched.data(); // a stray bias pointer: kDGelu neither reads nor writes it
        params.bias_type = dtype();
        params.aux = aux.data.data();
        params.ldaux = aux.ld;
        Gemm(params);
        const Values prod = Region(d, RefGemm(a, false, b, false, d, s.m, s.n, s.k, 1.0, 0.0), s.m, s.n);
        const Values pre = Region(aux, aux.host, s.m, s.n);
        Values want(prod.size());
        for (std::size_t at = 0; at < prod.size(); ++at) {
            want[at] = prod[at] * RefGeluTanhGrad(pre[at]);
        }
        EXPECT_TRUE(ValuesMatch(Region(d, d.data.ToDoubleVector(), s.m, s.n), want, dtype(), kGeluEpilogueRoundings))
            << "D = A·B ⊙ gelu'(aux)";
        EXPECT_EQ(untouched.ToDoubleVector(), untouched_before) << "kDGelu wrote the bias vector";
        // aux (the pre-activation) is only read.
        EXPECT_EQ(aux.data.ToDoubleVector(), aux.host);
    }
}

TEST_P(GemmTest, LeadingDimensionTooSmallIsAShapeError) {
    const Operand a = Make(5, 4, 1, {}, dtype(), 5, "gemm.a"); // trans_a: stored k×m = 5×4
    const Operand b = Make(5, 3, 1, {}, dtype(), 5, "gemm.b");
    Operand c = Make(4, 3, 1, {}, dtype(), 5, "gemm.c");
    GemmParams params = Params(a, true, b, false, c, 4, 3, 5, 1.0, 0.0, device());
    params.lda = 4; // lda must be >= 5
    EXPECT_THAT(MessageOf<ShapeError>([&] { Gemm(params); }), HasSubstr("lda 4 must be >= 5"));
}

auto GemmCases(DeviceType type) { return DeviceCases(type, ::testing::ValuesIn(GemmProviders(type))); }
std::string GemmCaseName(const ::testing::TestParamInfo<GemmParam> &info) {
    return ProviderName(std::get<0>(info.param), std::get<1>(info.param));
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(GemmTest, GemmCases, GemmCaseName);

// ---------------------------------------------------------------------------------------------------------------------
// CUDA: half inputs into a float32 C

using GemmMixedTest = GemmFixture<GemmParam>;

TEST_P(GemmMixedTest, HalfInputsIntoFloat32Accumulator) {
    // The wgrad accumulation shape: C float32, beta = 1.
    CheckProduct({.tb = true, .m = 40, .n = 24, .k = 96, .beta = 1.0}, dtype(), DType::kFloat32);
    CheckProduct({.tb = true, .m = 33, .n = 17, .k = 7, .beta = 1.0}, dtype(), DType::kFloat32);
    // One token's wgrad into a main grad: the rank-1 kernel (default provider), vectorised and scalar.
    CheckProduct({.tb = true, .m = 256, .n = 24, .k = 1, .beta = 1.0}, dtype(), DType::kFloat32);
    CheckProduct({.tb = true, .m = 33, .n = 17, .k = 1, .c = {.pad = 1}, .beta = 1.0}, dtype(), DType::kFloat32);
}

INSTANTIATE_TEST_SUITE_P(Cuda, GemmMixedTest, GemmCases(DeviceType::kCUDA), GemmCaseName);

// ---------------------------------------------------------------------------------------------------------------------
// The CPU: one float dtype for A, B and C; aux epilogues on a single matrix

using GemmCpuChecksTest = GemmFixture<GemmParam>;

TEST_P(GemmCpuChecksTest, MixedOrHalfDTypesAreRejectedOnCpu) {
    const Operand a = Make(2, 2, 1, {}, dtype(), 1, "gemm.a");
    const Operand b = Make(2, 2, 1, {}, dtype(), 1, "gemm.b");
    Operand c = Make(2, 2, 1, {}, dtype(), 1, "gemm.c");
    GemmParams params = Params(a, false, b, false, c, 2, 2, 2, 1.0, 0.0, device());
    // A, B float64 with a float32 C passes the generic validation (C may be float32) but not the CPU kernel.
    params.a_type = DType::kFloat64;
    params.b_type = DType::kFloat64;
    params.c_type = DType::kFloat32;
    EXPECT_THAT(MessageOf<DTypeError>([&] { Gemm(params); }),
                AllOf(HasSubstr("Gemm"), HasSubstr("A float64, B float64, C float32"), HasSubstr("float32 or float64")))
        << "float64 inputs with a float32 C";
    params.a_type = params.b_type = params.c_type = DType::kFloat16;
    EXPECT_THAT(MessageOf<DTypeError>([&] { Gemm(params); }),
                AllOf(HasSubstr("A float16, B float16, C float16"), HasSubstr("CUDA only")))
        << "float16";
}

TEST_P(GemmCpuChecksTest, AuxEpilogueWithABatchIsRejected) {
    const Operand a = Make(3, 3, 2, {}, dtype(), 1, "gemm.a");
    const Operand b = Make(3, 3, 2, {}, dtype(), 1, "gemm.b");
    Operand c = Make(3, 3, 2, {}, dtype(), 1, "gemm.c");
    Tensor aux = Tensor::Empty({c.ld * 3 * 2}, dtype(), device());
    GemmParams params = Params(a, false, b, false, c, 3, 3, 3, 1.0, 0.0, device());
    params.epilogue = GemmEpilogue::kGeluAuxBias;
    params.aux = aux.data();
    params.ldaux = c.ld;
    EXPECT_THAT(MessageOf<ShapeError>([&] { Gemm(params); }), HasSubstr("gelu_aux_bias needs batch_count 1"));
}

INSTANTIATE_TEST_SUITE_P(Cpu, GemmCpuChecksTest, GemmCases(DeviceType::kCPU), GemmCaseName);

} // namespace
} // namespace shardline::testing
