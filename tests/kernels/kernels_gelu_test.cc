// GELU (tanh and erf forms) forward and backward on every device against float64 references: the curved region, both
// tails and zero exactly, odd sizes, a tensor spanning many blocks, a misaligned input.

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::GeluApproximation;
using kernels::GeluBackward;
using kernels::GeluBackwardArgs;
using kernels::GeluForward;
using kernels::GeluForwardArgs;

void PrintTo(GeluApproximation approx, std::ostream *os) {
    *os << (approx == GeluApproximation::kTanh ? "tanh" : "erf");
}

// Odd element counts leave a tail after any vector width; one tensor spans many blocks.
const std::vector<Shape> kShapes = {{1}, {7, 33}, {3, 5, 129}, {(1 << 18) + 7}};

using GeluParam = std::tuple<DeviceDType, GeluApproximation>;

class GeluTest : public DeviceTest<GeluParam> {
protected:
    void SetUp() override {
        DeviceTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        approx_ = std::get<1>(GetParam());
        // Normal with sd 3 covers the curved region and both tails; the fixed values add far tails and zero.
        Values xs =
            RandomTensor({997}, DType::kFloat64, Device::CPU(), 3, "gelu.x", RandomDistribution::kNormal, 0.0, 3.0)
                .ToDoubleVector();
        for (double v : {0.0, -12.0, 12.0, -30.0, 30.0}) {
            xs.push_back(v);
        }
        x_ = OnDevice(xs, {2, 501}, dtype());
        dy_ = Random({2, 501}, dtype(), 3, "gelu.dy");
        xv_ = x_.ToDoubleVector();
        dyv_ = dy_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(dyv_), 0.0);
    }
    double Ref(double x) const { return approx_ == GeluApproximation::kTanh ? RefGeluTanh(x) : RefGeluErf(x); }
    double RefGrad(double x) const {
        return approx_ == GeluApproximation::kTanh ? RefGeluTanhGrad(x) : RefGeluErfGrad(x);
    }
    Values RefForward(const Values &x) const {
        Values y(x.size());
        std::transform(x.begin(), x.end(), y.begin(), [&](double v) { return Ref(v); });
        return y;
    }
    Values RefBackward(const Values &dy, const Values &x) const {
        Values dx(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) {
            dx[i] = dy[i] * RefGrad(x[i]);
        }
        return dx;
    }
    GeluApproximation approx_ = GeluApproximation::kTanh;
    Tensor x_, dy_;
    Values xv_, dyv_;
};

TEST_P(GeluTest, ForwardMatchesReference) {
    const Tensor y = GeluForward(x_, approx_);
    EXPECT_TRUE(ValuesMatch(y, RefForward(xv_), dtype()));
    const Values got = y.ToDoubleVector();
    EXPECT_EQ(got[xv_.size() - 5], 0.0);  // gelu(0)
    EXPECT_EQ(got[xv_.size() - 1], 30.0); // far right tail is the identity
    EXPECT_EQ(got[xv_.size() - 2], 0.0);  // far left tail is 0 (-0 compares equal)
}

TEST_P(GeluTest, BackwardIsDyTimesDerivative) {
    const Tensor dx = GeluBackward(dy_, x_, approx_);
    EXPECT_TRUE(ValuesMatch(dx, RefBackward(dyv_, xv_), dtype()));
}

TEST_P(GeluTest, ForwardWritesIntoACallerTensor) {
    Tensor y = Tensor::Full(x_.shape(), 9.0, dtype(), device());
    GeluForward(GeluForwardArgs{.x = x_, .y = y, .approximation = approx_});
    EXPECT_EQ(y.ToDoubleVector(), GeluForward(x_, approx_).ToDoubleVector());
}

TEST_P(GeluTest, ForwardMatchesFloat64OverShapes) {
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = Random(shape, dtype(), 40, "x");
        Tensor y = Poison(shape, dtype());
        GeluForward(GeluForwardArgs{.x = x, .y = y, .approximation = approx_});
        const Values ref = RefForward(x.ToDoubleVector());
        EXPECT_TRUE(ValuesMatch(y, ref, dtype()));
        EXPECT_TRUE(ValuesMatch(GeluForward(x, approx_), ref, dtype())) << "allocating wrapper";
    }
}

TEST_P(GeluTest, ForwardOfAMisalignedInput) {
    // An input that does not start on a vector boundary.
    const Tensor x0 = Random({1029}, dtype(), 41, "x");
    MisalignedTensor x = MisalignedCopy(x0);
    MisalignedTensor y = MisalignedCopy(Poison({1029}, dtype()));
    GeluForward(GeluForwardArgs{.x = x.view, .y = y.view, .approximation = approx_});
    EXPECT_TRUE(ValuesMatch(y.view, RefForward(x0.ToDoubleVector()), dtype())) << "misaligned";
}

TEST_P(GeluTest, BackwardMatchesFloat64OverShapes) {
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = Random(shape, dtype(), 42, "x");
        const Tensor dy = Random(shape, dtype(), 42, "dy");
        Tensor dx = Poison(shape, dtype());
        GeluBackward(GeluBackwardArgs{.dy = dy, .x = x, .dx = dx, .approximation = approx_});
        const Values ref = RefBackward(dy.ToDoubleVector(), x.ToDoubleVector());
        EXPECT_TRUE(ValuesMatch(dx, ref, dtype()));
        EXPECT_TRUE(ValuesMatch(GeluBackward(dy, x, approx_), ref, dtype())) << "allocating wrapper";
    }
}

auto GeluCases(DeviceType type) {
    return DeviceCases(type, ::testing::Values(GeluApproximation::kTanh, GeluApproximation::kErf));
}
std::string GeluCaseName(const ::testing::TestParamInfo<GeluParam> &info) {
    return std::string(DTypeName(std::get<0>(info.param).dtype)) +
           (std::get<1>(info.param) == GeluApproximation::kTanh ? "_tanh" : "_erf");
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(GeluTest, GeluCases, GeluCaseName);

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
} // namespace shardline::testing
