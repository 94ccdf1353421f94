// Grouped Linear kernels (mixture-of-experts: one GEMM per expert over its rows) on every device against float64
// references computed group by group: uneven group sizes including 0 and 1 rows, E = 1, 5 and 64, every dtype,
// sizes on the host and on the device, overwrite and accumulate (also into float32 main grads). Outputs start as
// random garbage, so a kernel that skips a row, or leaves an empty group's gradient unwritten, fails.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::testing {
namespace {

using kernels::GroupedLinearBackward;
using kernels::GroupedLinearBackwardBias;
using kernels::GroupedLinearBackwardBiasArgs;
using kernels::GroupedLinearBackwardInput;
using kernels::GroupedLinearBackwardInputArgs;
using kernels::GroupedLinearBackwardWeight;
using kernels::GroupedLinearBackwardWeightArgs;
using kernels::GroupedLinearForward;
using kernels::GroupedLinearForwardArgs;
using ::testing::HasSubstr;

/// The group sizes of a case.
struct GroupCase {
    std::vector<std::int64_t> sizes;
    std::string name;
};
void PrintTo(const GroupCase &c, std::ostream *os) { *os << c.name; }

std::vector<GroupCase> GroupCases() {
    // 64 experts, skewed like a router's counts: many empty and one-row experts among larger ones.
    std::vector<std::int64_t> many(64);
    for (std::size_t e = 0; e < many.size(); ++e) {
        const std::int64_t r = static_cast<std::int64_t>((e * 37 + 11) % 13);
        many[e] = r < 4 ? 0 : (r < 6 ? 1 : r);
    }
    return {{{13}, "e1"}, {{3, 0, 1, 9, 0}, "e5_uneven"}, {many, "e64"}, {{0, 0, 0}, "no_rows"}};
}

using GroupedParam = std::tuple<DeviceDType, GroupCase, bool /*sizes on the device*/>;

class GroupedLinearTest : public DeviceTest<GroupedParam> {
protected:
    static constexpr std::int64_t kIn = 24;
    static constexpr std::int64_t kOut = 40;

    void SetUp() override {
        DeviceTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        sizes_ = std::get<1>(GetParam()).sizes;
        experts_ = static_cast<std::int64_t>(sizes_.size());
        rows_ = 0;
        for (std::int64_t s : sizes_) {
            rows_ += s;
        }
        std::vector<double> sv(sizes_.begin(), sizes_.end());
        const Tensor host = Tensor::FromVector(sv, Shape{experts_}, DType::kInt64);
        group_sizes_ = std::get<2>(GetParam()) ? host.To(device()) : host;
        x_ = Random({rows_, kIn}, dtype(), 5, "x");
        w_ = Random({experts_, kOut, kIn}, dtype(), 5, "w", 1.0 / std::sqrt(static_cast<double>(kIn)));
        b_ = Random({experts_, kOut}, dtype(), 5, "b");
        dy_ = Random({rows_, kOut}, dtype(), 5, "dy");
        xv_ = x_.ToDoubleVector();
        wv_ = w_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        dyv_ = dy_.ToDoubleVector();
        ASSERT_GT(AbsSum(wv_) * AbsSum(bv_), 0.0);
        ASSERT_TRUE(rows_ == 0 || AbsSum(xv_) * AbsSum(dyv_) > 0.0);
    }

    /// Rows [first, first + count) of a row-major matrix with `cols` columns.
    static Values RowsOf(const Values &v, std::int64_t first, std::int64_t count, std::int64_t cols) {
        return Values(v.begin() + first * cols, v.begin() + (first + count) * cols);
    }
    static Values GroupOf(const Values &v, std::int64_t e, std::int64_t elements) {
        return Values(v.begin() + e * elements, v.begin() + (e + 1) * elements);
    }
    static void Append(Values &to, const Values &from) { to.insert(to.end(), from.begin(), from.end()); }

    Values RefForward(bool bias) const {
        Values y;
        std::int64_t offset = 0;
        for (std::int64_t e = 0; e < experts_; ++e) {
            const std::int64_t m = sizes_[static_cast<std::size_t>(e)];
            const Values b = GroupOf(bv_, e, kOut);
            Append(y, RefLinearForward(RowsOf(xv_, offset, m, kIn), GroupOf(wv_, e, kOut * kIn), bias ? &b : nullptr, m,
                                       kOut, kIn));
            offset += m;
        }
        return y;
    }
    Values RefDx() const {
        Values dx;
        std::int64_t offset = 0;
        for (std::int64_t e = 0; e < experts_; ++e) {
            const std::int64_t m = sizes_[static_cast<std::size_t>(e)];
            Append(dx,
                   RefLinearBackwardInput(RowsOf(dyv_, offset, m, kOut), GroupOf(wv_, e, kOut * kIn), m, kOut, kIn));
            offset += m;
        }
        return dx;
    }
    Values RefDw() const {
        Values dw;
        std::int64_t offset = 0;
        for (std::int64_t e = 0; e < experts_; ++e) {
            const std::int64_t m = sizes_[static_cast<std::size_t>(e)];
            Append(dw, m == 0 ? Values(kOut * kIn, 0.0)
                              : RefLinearBackwardWeight(RowsOf(dyv_, offset, m, kOut), RowsOf(xv_, offset, m, kIn), m,
                                                        kOut, kIn));
            offset += m;
        }
        return dw;
    }
    Values RefDb() const {
        Values db;
        std::int64_t offset = 0;
        for (std::int64_t e = 0; e < experts_; ++e) {
            const std::int64_t m = sizes_[static_cast<std::size_t>(e)];
            Append(db, m == 0 ? Values(kOut, 0.0) : RefColumnSum(RowsOf(dyv_, offset, m, kOut), m, kOut));
            offset += m;
        }
        return db;
    }

    std::vector<std::int64_t> sizes_;
    std::int64_t experts_ = 0, rows_ = 0;
    Tensor group_sizes_, x_, w_, b_, dy_;
    Values xv_, wv_, bv_, dyv_;
};

TEST_P(GroupedLinearTest, ForwardMatchesFloat64PerGroup) {
    Tensor y = Poison({rows_, kOut}, dtype());
    GroupedLinearForward(GroupedLinearForwardArgs{.x = x_, .weight = w_, .group_sizes = group_sizes_, .y = y});
    EXPECT_TRUE(ValuesMatch(y, RefForward(false), dtype()));
}

TEST_P(GroupedLinearTest, ForwardWithBiasAddsEachExpertsBias) {
    Tensor y = Poison({rows_, kOut}, dtype());
    GroupedLinearForward(
        GroupedLinearForwardArgs{.x = x_, .weight = w_, .bias = &b_, .group_sizes = group_sizes_, .y = y});
    // On CUDA the CUTLASS path adds the bias after the GEMM's output was rounded (kUnfusedBiasRoundings).
    EXPECT_TRUE(ValuesMatch(y, RefForward(true), dtype(), OnCuda(kUnfusedBiasRoundings)));
    const Tensor allocated = GroupedLinearForward(x_, w_, &b_, group_sizes_);
    EXPECT_EQ(allocated.shape(), (Shape{rows_, kOut}));
    EXPECT_TRUE(ValuesMatch(allocated, RefForward(true), dtype(), OnCuda(kUnfusedBiasRoundings)))
        << "allocating wrapper";
}

TEST_P(GroupedLinearTest, BackwardInputMatchesFloat64PerGroup) {
    Tensor dx = Poison({rows_, kIn}, dtype());
    GroupedLinearBackwardInput(
        GroupedLinearBackwardInputArgs{.dy = dy_, .weight = w_, .group_sizes = group_sizes_, .dx = dx});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
}

// The dgrad through a GELU (input_activation gelu_tanh: GroupedGemm's kDGelu): dx_e = (dy_e·W_e) ⊙ gelu_tanh'(z_e),
// against float64; the split pair (the dgrad, then GeluBackward) gives the same values — bit for bit on the CPU, where
// the loop runs the same GEMM and the same double-precision gelu'; and the one-call backward gives the split op's.
TEST_P(GroupedLinearTest, BackwardInputThroughGeluMatchesFloat64AndTheSplitPair) {
    const Tensor z = Random({rows_, kIn}, dtype(), 6, "z", 1.5);
    const Values zv = z.ToDoubleVector();
    const Values plain = RefDx();
    Values want(plain.size()), g_abs(plain.size());
    for (std::size_t i = 0; i < plain.size(); ++i) {
        want[i] = plain[i] * RefGeluTanhGrad(zv[i]);
        g_abs[i] = std::abs(plain[i]);
    }
    Tensor dx = Poison({rows_, kIn}, dtype());
    GroupedLinearBackwardInput({.dy = dy_,
                                .weight = w_,
                                .group_sizes = group_sizes_,
                                .dx = dx,
                                .input_activation = kernels::LinearActivation::kGeluTanh,
                                .pre_activation = &z});
    EXPECT_TRUE(GeluGradMatch(dx, want, g_abs, dtype(), kGeluEpilogueRoundings));
    Tensor dx_plain = Poison({rows_, kIn}, dtype());
    GroupedLinearBackwardInput({.dy = dy_, .weight = w_, .group_sizes = group_sizes_, .dx = dx_plain});
    const Tensor unfused = kernels::GeluBackward(dx_plain, z, kernels::GeluApproximation::kTanh);
    if (device().is_cpu()) {
        EXPECT_EQ(dx.ToDoubleVector(), unfused.ToDoubleVector()) << "the CPU runs the same ops either way";
    } else {
        EXPECT_TRUE(GeluGradMatch(dx, unfused.ToDoubleVector(), g_abs, dtype(), kGeluEpilogueRoundings));
    }
    Tensor dx_one = Poison({rows_, kIn}, dtype());
    Tensor dw = Poison({experts_, kOut, kIn}, dtype());
    GroupedLinearBackward({.dy = dy_,
                           .x = &x_,
                           .weight = &w_,
                           .group_sizes = group_sizes_,
                           .dx = &dx_one,
                           .dweight = &dw,
                           .input_activation = kernels::LinearActivation::kGeluTanh,
                           .pre_activation = &z});
    EXPECT_EQ(dx_one.ToDoubleVector(), dx.ToDoubleVector()) << "one call: the split op's dx";
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype())) << "the wgrad is untouched by the activation";
}

TEST_P(GroupedLinearTest, BackwardInputThroughGeluRefusesAMissingPreActivation) {
    Tensor dx = Poison({rows_, kIn}, dtype());
    EXPECT_THAT(MessageOf<Error>([&] {
                    GroupedLinearBackwardInput({.dy = dy_,
                                                .weight = w_,
                                                .group_sizes = group_sizes_,
                                                .dx = dx,
                                                .input_activation = kernels::LinearActivation::kGeluTanh});
                }),
                HasSubstr("GroupedLinearBackwardInput: input_activation gelu_tanh needs the pre-activation"));
    if (rows_ > 0) {
        EXPECT_THAT(MessageOf<Error>([&] {
                        GroupedLinearBackwardInput({.dy = dy_,
                                                    .weight = w_,
                                                    .group_sizes = group_sizes_,
                                                    .dx = dx,
                                                    .input_activation = kernels::LinearActivation::kGeluTanh,
                                                    .pre_activation = &dx});
                    }),
                    HasSubstr("pre_activation must not be dx itself"));
    }
    const Tensor z = Random({rows_, kIn}, dtype(), 6, "z");
    Tensor dw = Poison({experts_, kOut, kIn}, dtype());
    EXPECT_THAT(MessageOf<Error>([&] {
                    GroupedLinearBackward({.dy = dy_,
                                           .x = &x_,
                                           .group_sizes = group_sizes_,
                                           .dweight = &dw,
                                           .input_activation = kernels::LinearActivation::kGeluTanh,
                                           .pre_activation = &z});
                }),
                HasSubstr("GroupedLinearBackward: input_activation applies to dx, which is not wanted"));
}

TEST_P(GroupedLinearTest, BackwardWeightWritesEveryExpertAndZeroesEmptyOnes) {
    Tensor dw = Poison({experts_, kOut, kIn}, dtype());
    Tensor db = Poison({experts_, kOut}, dtype());
    GroupedLinearBackwardWeight(
        GroupedLinearBackwardWeightArgs{.dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype()));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype()));
}

TEST_P(GroupedLinearTest, BackwardWeightAccumulatesIntoTheMainGrad) {
    const DType main_dtype = MainGradDType(device(), dtype());
    const double scale = std::sqrt(8.0); // old grads about as large as the new ones
    Tensor dw = Random({experts_, kOut, kIn}, main_dtype, 7, "main_dw", scale);
    Tensor db = Random({experts_, kOut}, main_dtype, 7, "main_db", scale);
    const Values want_dw = AddScaled(dw.ToDoubleVector(), RefDw());
    const Values want_db = AddScaled(db.ToDoubleVector(), RefDb());
    GroupedLinearBackwardWeight(GroupedLinearBackwardWeightArgs{
        .dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw, .dbias = &db, .accumulate = true});
    // Empty experts keep their old grads exactly (inside the tolerance: the comparison is against old + 0).
    EXPECT_TRUE(ValuesMatch(dw, want_dw, main_dtype, OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, want_db, main_dtype, OnCuda(kEpilogueRoundings)));
}

TEST_P(GroupedLinearTest, BackwardWeightOverwritesTheMainGrad) {
    // The first backward after a deferred ZeroGrad writes the fp32 main grad with beta = 0 (a MoE run at bf16 with
    // GradSync's buckets was refused here on 4×H200): poisoned old values must not survive, empty experts get zero.
    const DType main_dtype = MainGradDType(device(), dtype());
    Tensor dw = Poison({experts_, kOut, kIn}, main_dtype);
    Tensor db = Poison({experts_, kOut}, main_dtype);
    GroupedLinearBackwardWeight(
        GroupedLinearBackwardWeightArgs{.dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), main_dtype, OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), main_dtype, OnCuda(kEpilogueRoundings)));
}

TEST_P(GroupedLinearTest, BackwardWeightAccumulatesInTheComputeDType) {
    Tensor dw = Random({experts_, kOut, kIn}, dtype(), 8, "dw.old");
    Tensor db = Random({experts_, kOut}, dtype(), 8, "db.old");
    const Values want_dw = AddScaled(dw.ToDoubleVector(), RefDw());
    const Values want_db = AddScaled(db.ToDoubleVector(), RefDb());
    GroupedLinearBackwardWeight(GroupedLinearBackwardWeightArgs{
        .dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw, .dbias = &db, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(dw, want_dw, dtype(), OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, want_db, dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(GroupedLinearTest, BackwardBiasIsEachGroupsColumnSum) {
    Tensor db = Poison({experts_, kOut}, dtype());
    GroupedLinearBackwardBias(GroupedLinearBackwardBiasArgs{.dy = dy_, .group_sizes = group_sizes_, .dbias = db});
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype()));
    Tensor acc = Random({experts_, kOut}, dtype(), 9, "db.old");
    const Values want = AddScaled(acc.ToDoubleVector(), RefDb());
    GroupedLinearBackwardBias(
        GroupedLinearBackwardBiasArgs{.dy = dy_, .group_sizes = group_sizes_, .dbias = acc, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(acc, want, dtype()));
}

TEST_P(GroupedLinearTest, BackwardInOneCallIsTheSplitOps) {
    // GroupedLinearBackward for dx, dW and db (on CUDA the parameter grads may run beside the dgrad): the float64
    // reference, and bitwise what the split ops give.
    Tensor dx = Poison({rows_, kIn}, dtype());
    Tensor dw = Poison({experts_, kOut, kIn}, dtype());
    Tensor db = Poison({experts_, kOut}, dtype());
    GroupedLinearBackward(
        {.dy = dy_, .x = &x_, .weight = &w_, .group_sizes = group_sizes_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype()));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype()));
    Tensor dx_split = Poison({rows_, kIn}, dtype());
    Tensor dw_split = Poison({experts_, kOut, kIn}, dtype());
    Tensor db_split = Poison({experts_, kOut}, dtype());
    GroupedLinearBackwardInput(
        GroupedLinearBackwardInputArgs{.dy = dy_, .weight = w_, .group_sizes = group_sizes_, .dx = dx_split});
    GroupedLinearBackwardWeight(GroupedLinearBackwardWeightArgs{
        .dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw_split, .dbias = &db_split});
    EXPECT_EQ(dx.ToDoubleVector(), dx_split.ToDoubleVector()) << "dx";
    EXPECT_EQ(dw.ToDoubleVector(), dw_split.ToDoubleVector()) << "dW";
    EXPECT_EQ(db.ToDoubleVector(), db_split.ToDoubleVector()) << "db";
}

TEST_P(GroupedLinearTest, BackwardInOneCallAccumulatesEachGradItAsksFor) {
    // Only the parameter grads, into main grads, and db in another dtype than dW where the device has one; then dx
    // alone. Empty experts keep their old grads.
    const DType main_dtype = MainGradDType(device(), dtype());
    Tensor dw = Random({experts_, kOut, kIn}, main_dtype, 7, "main_dw", 2.0);
    Tensor db = Random({experts_, kOut}, dtype(), 7, "main_db", 2.0);
    const Values want_dw = AddScaled(dw.ToDoubleVector(), RefDw());
    const Values want_db = AddScaled(db.ToDoubleVector(), RefDb());
    GroupedLinearBackward(
        {.dy = dy_, .x = &x_, .group_sizes = group_sizes_, .dweight = &dw, .dbias = &db, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(dw, want_dw, main_dtype, OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, want_db, dtype(), OnCuda(kEpilogueRoundings)));
    Tensor dx = Poison({rows_, kIn}, dtype());
    GroupedLinearBackward({.dy = dy_, .weight = &w_, .group_sizes = group_sizes_, .dx = &dx});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
}

TEST_P(GroupedLinearTest, GroupedBiasAddAddsEachExpertsBiasToItsRows) {
    Tensor y = Random({rows_, kOut}, dtype(), 3, "y");
    Values want = y.ToDoubleVector();
    std::int64_t offset = 0;
    for (std::int64_t e = 0; e < experts_; ++e) {
        for (std::int64_t r = offset; r < offset + sizes_[static_cast<std::size_t>(e)]; ++r) {
            for (std::int64_t j = 0; j < kOut; ++j) {
                want[static_cast<std::size_t>(r * kOut + j)] += bv_[static_cast<std::size_t>(e * kOut + j)];
            }
        }
        offset += sizes_[static_cast<std::size_t>(e)];
    }
    kernels::GroupedBiasAdd(y, b_, group_sizes_);
    EXPECT_TRUE(ValuesMatch(y, want, dtype()));
}

TEST_P(GroupedLinearTest, LegacyProviderLoopsItsOwnGemm) {
    // The loop provider's Gemm inherits the selected provider (CUDA: cublasGemmEx; the CPU has only "default").
    kernels::SetProvider(kernels::kLegacyProvider);
    Tensor y = Poison({rows_, kOut}, dtype());
    GroupedLinearForward(
        GroupedLinearForwardArgs{.x = x_, .weight = w_, .bias = &b_, .group_sizes = group_sizes_, .y = y});
    EXPECT_TRUE(ValuesMatch(y, RefForward(true), dtype(), OnCuda(kUnfusedBiasRoundings)));
    Tensor dw = Poison({experts_, kOut, kIn}, dtype());
    GroupedLinearBackwardWeight(
        GroupedLinearBackwardWeightArgs{.dy = dy_, .x = x_, .group_sizes = group_sizes_, .dweight = dw});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype()));
}

std::string GroupedName(const ::testing::TestParamInfo<GroupedParam> &info) {
    return fmt::format("{}_{}_{}", ShortDTypeName(std::get<0>(info.param).dtype), std::get<1>(info.param).name,
                       std::get<2>(info.param) ? "device_sizes" : "host_sizes");
}

auto GroupedCases(DeviceType type) {
    // The CPU has no device memory apart from the host's: host sizes only.
    const std::vector<bool> locations =
        type == DeviceType::kCPU ? std::vector<bool>{false} : std::vector<bool>{false, true};
    return DeviceCases(type, ::testing::ValuesIn(GroupCases()), ::testing::ValuesIn(locations));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(GroupedLinearTest, GroupedCases, GroupedName);

// ---------------------------------------------------------------------------------------------------------------------
// Argument checks (CPU): each names the op, the value and the expectation.

TEST(GroupedLinearErrorsTest, BadArgumentsNameTheOpAndTheExpectation) {
    const Tensor x = Tensor::Zeros({6, 4}, DType::kFloat32);
    const Tensor w = Tensor::Zeros({3, 5, 4}, DType::kFloat32);
    Tensor y = Tensor::Zeros({6, 5}, DType::kFloat32);
    auto sizes = [](std::vector<double> v) {
        const auto n = static_cast<std::int64_t>(v.size());
        return Tensor::FromVector(v, Shape{n}, DType::kInt64);
    };
    auto forward = [&](const Tensor &xx, const Tensor &ww, const Tensor &s) {
        return MessageOf<Error>(
            [&] { GroupedLinearForward(GroupedLinearForwardArgs{.x = xx, .weight = ww, .group_sizes = s, .y = y}); });
    };
    EXPECT_THAT(forward(x, w, sizes({2, 2, 1})),
                HasSubstr("GroupedLinearForward: group sizes must sum to the 6 grouped rows, got a sum of 5"));
    EXPECT_THAT(forward(x, w, sizes({4, -1, 3})),
                HasSubstr("GroupedLinearForward: group sizes must be >= 0, got sizes[1] = -1"));
    EXPECT_THAT(forward(x, w, sizes({3, 3})), HasSubstr("group_sizes must be [experts] = [3], got"));
    EXPECT_THAT(forward(x, w, Tensor::FromVector({2, 2, 2}, Shape{3}, DType::kFloat32)),
                HasSubstr("group_sizes must be int64"));
    EXPECT_THAT(forward(x, Tensor::Zeros({5, 4}, DType::kFloat32), sizes({6})),
                HasSubstr("weight must be [experts, out_features, in_features]"));
    EXPECT_THAT(forward(Tensor::Zeros({6, 3}, DType::kFloat32), w, sizes({2, 2, 2})),
                HasSubstr("x must be [tokens, 4] (rows grouped by expert"));
    EXPECT_THAT(forward(x.Transpose(0, 1), w, sizes({2, 2, 2})), HasSubstr("x must be contiguous"));
    Tensor dw_half = Tensor::Zeros({3, 5, 4}, DType::kFloat64);
    EXPECT_THAT(MessageOf<Error>([&] {
                    GroupedLinearBackwardWeight(GroupedLinearBackwardWeightArgs{
                        .dy = y, .x = x, .group_sizes = sizes({2, 2, 2}), .dweight = dw_half});
                }),
                HasSubstr("GroupedLinearBackwardWeight: dweight must have x's dtype float32"));
    // The one-call backward names itself and checks every grad it is asked for before running any.
    Tensor dx = Tensor::Zeros({6, 4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<Error>([&] { GroupedLinearBackward({.dy = y, .group_sizes = sizes({2, 2, 2}), .dx = &dx}); }),
                HasSubstr("GroupedLinearBackward: dx needs the weight, got dx"));
    EXPECT_THAT(MessageOf<Error>(
                    [&] { GroupedLinearBackward({.dy = y, .group_sizes = sizes({2, 2, 2}), .dweight = &dw_half}); }),
                HasSubstr("GroupedLinearBackward: dweight needs x, got dweight"));
    dx.Fill(7.0);
    EXPECT_THAT(
        MessageOf<Error>([&] {
            GroupedLinearBackward(
                {.dy = y, .x = &x, .weight = &w, .group_sizes = sizes({2, 2, 2}), .dx = &dx, .dweight = &dw_half});
        }),
        HasSubstr("GroupedLinearBackward: dweight must have x's dtype float32"));
    EXPECT_EQ(dx.ToDoubleVector(), std::vector<double>(24, 7.0)) << "dx was written before the checks of dweight";
}

} // namespace
} // namespace shardline::testing
