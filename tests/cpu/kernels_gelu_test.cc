#include <cmath>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::RandomTensor;
using testing::Values;
using testing::ValuesMatch;

class GeluTest : public ::testing::TestWithParam<std::tuple<DType, GeluApproximation>> {
protected:
    void SetUp() override {
        std::tie(dtype_, approx_) = GetParam();
        // Normal with sd 3 covers the curved region and both tails; the fixed values add far tails and zero.
        Values xs =
            RandomTensor({997}, DType::kFloat64, Device::CPU(), 3, "gelu.x", RandomDistribution::kNormal, 0.0, 3.0)
                .ToDoubleVector();
        for (double v : {0.0, -12.0, 12.0, -30.0, 30.0}) {
            xs.push_back(v);
        }
        x_ = Tensor::FromVector(xs, {2, 501}, DType::kFloat64).To(dtype_);
        dy_ = RandomTensor({2, 501}, dtype_, Device::CPU(), 3, "gelu.dy");
        xv_ = x_.ToDoubleVector();
        dyv_ = dy_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(dyv_), 0.0);
    }
    double Ref(double x) const {
        return approx_ == GeluApproximation::kTanh ? testing::RefGeluTanh(x) : testing::RefGeluErf(x);
    }
    double RefGrad(double x) const {
        return approx_ == GeluApproximation::kTanh ? testing::RefGeluTanhGrad(x) : testing::RefGeluErfGrad(x);
    }
    DType dtype_ = DType::kFloat32;
    GeluApproximation approx_ = GeluApproximation::kTanh;
    Tensor x_, dy_;
    Values xv_, dyv_;
};

TEST_P(GeluTest, ForwardMatchesReference) {
    const Tensor y = GeluForward(x_, approx_);
    Values want;
    for (double v : xv_) {
        want.push_back(Ref(v));
    }
    EXPECT_TRUE(ValuesMatch(y, want, dtype_));
    const Values got = y.ToDoubleVector();
    EXPECT_EQ(got[xv_.size() - 5], 0.0);  // gelu(0)
    EXPECT_EQ(got[xv_.size() - 1], 30.0); // far right tail is the identity
    EXPECT_EQ(got[xv_.size() - 2], 0.0);  // far left tail is 0 (-0 compares equal)
}

TEST_P(GeluTest, BackwardIsDyTimesDerivative) {
    const Tensor dx = GeluBackward(dy_, x_, approx_);
    Values want;
    for (std::size_t i = 0; i < xv_.size(); ++i) {
        want.push_back(dyv_[i] * RefGrad(xv_[i]));
    }
    EXPECT_TRUE(ValuesMatch(dx, want, dtype_));
}

TEST_P(GeluTest, ForwardWritesIntoACallerTensor) {
    Tensor y = Tensor::Full(x_.shape(), 9.0, dtype_);
    GeluForward(GeluForwardArgs{.x = x_, .y = y, .approximation = approx_});
    EXPECT_EQ(y.ToDoubleVector(), GeluForward(x_, approx_).ToDoubleVector());
}

INSTANTIATE_TEST_SUITE_P(Approximations, GeluTest,
                         ::testing::Combine(CpuDTypes(),
                                            ::testing::Values(GeluApproximation::kTanh, GeluApproximation::kErf)),
                         [](const auto &info) {
                             return std::string(DTypeName(std::get<0>(info.param))) +
                                    (std::get<1>(info.param) == GeluApproximation::kTanh ? "_tanh" : "_erf");
                         });

TEST(GeluApproximationTest, TanhAndErfFormsDifferSlightly) {
    const Tensor x = RandomTensor({1000}, DType::kFloat64, Device::CPU(), 4, "x");
    const Values t = GeluForward(x, GeluApproximation::kTanh).ToDoubleVector();
    const Values e = GeluForward(x, GeluApproximation::kErf).ToDoubleVector();
    double max_diff = 0.0;
    for (std::size_t i = 0; i < t.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(t[i] - e[i]));
    }
    EXPECT_GT(max_diff, 1e-5); // the approximation is really selected
    EXPECT_LT(max_diff, 1e-3); // and both are GELU
}

} // namespace
} // namespace shardline::kernels
