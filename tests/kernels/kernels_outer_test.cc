// Outer products on every device against float64 references: forward, both gradients together and each alone.

#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/kernels/outer.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::OuterBackward;
using kernels::OuterBackwardArgs;
using kernels::OuterForward;
using kernels::OuterForwardArgs;

/// x is [m], y is [n].
struct OuterDims {
    std::int64_t m;
    std::int64_t n;
};
void PrintTo(const OuterDims &d, std::ostream *os) { *os << d.m << "x" << d.n; }
const std::vector<OuterDims> kOuterDims = {{1, 1},   {5, 3},   {17, 33},  {128, 1},
                                           {1, 127}, {128, 7}, {1000, 3}, {64, 256}};

using OuterParam = std::tuple<DeviceDType, OuterDims>;

class OuterTest : public DeviceTest<OuterParam> {
protected:
    void SetUp() override {
        DeviceTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        std::tie(std::ignore, dims_) = GetParam();
        m_ = dims_.m;
        n_ = dims_.n;
        x_ = Random({m_}, dtype(), 30, "x");
        y_ = Random({n_}, dtype(), 30, "y");
        dout_ = Random({m_, n_}, dtype(), 31, "dout");
        xv_ = x_.ToDoubleVector();
        yv_ = y_.ToDoubleVector();
        doutv_ = dout_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(yv_) * AbsSum(doutv_), 0.0);
    }
    OuterDims dims_{};
    std::int64_t m_ = 0, n_ = 0;
    Tensor x_, y_, dout_;
    Values xv_, yv_, doutv_;
};

TEST_P(OuterTest, ForwardIsXiTimesYj) {
    Values want;
    for (std::int64_t i = 0; i < m_; ++i) {
        for (std::int64_t j = 0; j < n_; ++j) {
            want.push_back(xv_[i] * yv_[j]);
        }
    }
    Tensor out = Poison({m_, n_}, dtype());
    OuterForward(OuterForwardArgs{.x = x_, .y = y_, .out = out});
    EXPECT_TRUE(ValuesMatch(out, want, dtype()));
    const Tensor allocated = OuterForward(x_, y_);
    EXPECT_EQ(allocated.shape(), (Shape{m_, n_}));
    EXPECT_TRUE(ValuesMatch(allocated, want, dtype())) << "allocating wrapper";
}

TEST_P(OuterTest, BackwardGivesDoutTimesYAndDoutTransposedTimesX) {
    Values want_dx(m_, 0.0);
    Values want_dy(n_, 0.0);
    for (std::int64_t i = 0; i < m_; ++i) {
        for (std::int64_t j = 0; j < n_; ++j) {
            want_dx[i] += doutv_[i * n_ + j] * yv_[j];
            want_dy[j] += doutv_[i * n_ + j] * xv_[i];
        }
    }
    Tensor dx = Poison({m_}, dtype(), "poison_x");
    Tensor dy = Poison({n_}, dtype(), "poison_y");
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dx = &dx, .dy = &dy});
    EXPECT_TRUE(ValuesMatch(dx, want_dx, dtype())) << "dx = dout·y";
    EXPECT_TRUE(ValuesMatch(dy, want_dy, dtype())) << "dy = doutᵀ·x";

    // Each gradient alone (the other pointer null).
    Tensor dx_only = Poison({m_}, dtype(), "poison_dx_only");
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dx = &dx_only});
    EXPECT_TRUE(ValuesMatch(dx_only, want_dx, dtype())) << "dx only";
    Tensor dy_only = Poison({n_}, dtype(), "poison_dy_only");
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dy = &dy_only});
    EXPECT_TRUE(ValuesMatch(dy_only, want_dy, dtype())) << "dy only";
}

auto OuterCases(DeviceType type) { return DeviceCases(type, ::testing::ValuesIn(kOuterDims)); }
std::string OuterCaseName(const ::testing::TestParamInfo<OuterParam> &info) {
    const auto &[c, d] = info.param;
    return fmt::format("{}_{}x{}", DTypeName(c.dtype), d.m, d.n);
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(OuterTest, OuterCases, OuterCaseName);

} // namespace
} // namespace shardline::testing
