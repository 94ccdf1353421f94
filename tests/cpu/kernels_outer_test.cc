#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/kernels/outer.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::RandomTensor;
using testing::Values;
using testing::ValuesMatch;

class OuterTest : public ::testing::TestWithParam<std::tuple<DType, std::pair<std::int64_t, std::int64_t>>> {
protected:
    void SetUp() override {
        std::pair<std::int64_t, std::int64_t> mn;
        std::tie(dtype_, mn) = GetParam();
        std::tie(m_, n_) = mn;
        x_ = RandomTensor({m_}, dtype_, Device::CPU(), 5, "x");
        y_ = RandomTensor({n_}, dtype_, Device::CPU(), 5, "y");
        dout_ = RandomTensor({m_, n_}, dtype_, Device::CPU(), 5, "dout");
        xv_ = x_.ToDoubleVector();
        yv_ = y_.ToDoubleVector();
        doutv_ = dout_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(yv_) * AbsSum(doutv_), 0.0);
    }
    DType dtype_ = DType::kFloat32;
    std::int64_t m_ = 0, n_ = 0;
    Tensor x_, y_, dout_;
    Values xv_, yv_, doutv_;
};

TEST_P(OuterTest, ForwardIsXiTimesYj) {
    const Tensor out = OuterForward(x_, y_);
    EXPECT_EQ(out.shape(), (Shape{m_, n_}));
    Values want;
    for (std::int64_t i = 0; i < m_; ++i) {
        for (std::int64_t j = 0; j < n_; ++j) {
            want.push_back(xv_[i] * yv_[j]);
        }
    }
    EXPECT_TRUE(ValuesMatch(out, want, dtype_));
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
    Tensor dx = Tensor::Full({m_}, 5.0, dtype_);
    Tensor dy = Tensor::Full({n_}, 5.0, dtype_);
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dx = &dx, .dy = &dy});
    EXPECT_TRUE(ValuesMatch(dx, want_dx, dtype_));
    EXPECT_TRUE(ValuesMatch(dy, want_dy, dtype_));

    // Each gradient alone; the other output is left untouched.
    Tensor dx_only = Tensor::Full({m_}, 5.0, dtype_);
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dx = &dx_only});
    EXPECT_TRUE(ValuesMatch(dx_only, want_dx, dtype_));
    Tensor dy_only = Tensor::Full({n_}, 5.0, dtype_);
    OuterBackward(OuterBackwardArgs{.dout = dout_, .x = x_, .y = y_, .dy = &dy_only});
    EXPECT_TRUE(ValuesMatch(dy_only, want_dy, dtype_));
}

INSTANTIATE_TEST_SUITE_P(Sizes, OuterTest,
                         ::testing::Combine(CpuDTypes(),
                                            ::testing::Values(std::pair<std::int64_t, std::int64_t>{1, 1},
                                                              std::pair<std::int64_t, std::int64_t>{5, 3},
                                                              std::pair<std::int64_t, std::int64_t>{17, 33},
                                                              std::pair<std::int64_t, std::int64_t>{128, 1},
                                                              std::pair<std::int64_t, std::int64_t>{1, 127})),
                         [](const auto &info) {
                             return fmt::format("{}_{}x{}", DTypeName(std::get<0>(info.param)),
                                                std::get<1>(info.param).first, std::get<1>(info.param).second);
                         });

} // namespace
} // namespace shardline::kernels
