// Linear kernels on the CPU against the float64 references, over shapes that include M = 1, odd K and N and
// batch dims.

#include <string>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <shardline/kernels/linear.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::RandomTensor;
using testing::RefColumnSum;
using testing::RefGeluTanh;
using testing::RefLinearBackwardInput;
using testing::RefLinearBackwardWeight;
using testing::RefLinearForward;
using testing::Values;
using testing::ValuesMatch;

struct LinearShape {
    Shape x; ///< [..., in]
    std::int64_t out;
};

std::string ShapeName(const LinearShape &s) {
    return fmt::format("x_{}_out_{}", fmt::join(s.x, "_"), s.out);
}

class LinearTest : public ::testing::TestWithParam<std::tuple<DType, LinearShape>> {
protected:
    void SetUp() override {
        std::tie(dtype_, shape_) = GetParam();
        in_ = shape_.x.back();
        out_ = shape_.out;
        rows_ = Numel(shape_.x) / in_;
        y_shape_ = shape_.x;
        y_shape_.back() = out_;
        const std::uint64_t seed = static_cast<std::uint64_t>(rows_ * 1000 + in_ * 10 + out_);
        x_ = RandomTensor(shape_.x, dtype_, Device::CPU(), seed, "x");
        w_ = RandomTensor({out_, in_}, dtype_, Device::CPU(), seed, "w");
        b_ = RandomTensor({out_}, dtype_, Device::CPU(), seed, "b");
        dy_ = RandomTensor(y_shape_, dtype_, Device::CPU(), seed, "dy");
        xv_ = x_.ToDoubleVector();
        wv_ = w_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        dyv_ = dy_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(wv_) * AbsSum(bv_) * AbsSum(dyv_), 0.0);
    }

    DType dtype_ = DType::kFloat32;
    LinearShape shape_;
    std::int64_t in_ = 0, out_ = 0, rows_ = 0;
    Shape y_shape_;
    Tensor x_, w_, b_, dy_;
    Values xv_, wv_, bv_, dyv_;
};

TEST_P(LinearTest, ForwardWithoutBiasMatchesReference) {
    const Tensor y = LinearForward(x_, w_);
    EXPECT_EQ(y.shape(), y_shape_);
    EXPECT_TRUE(ValuesMatch(y, RefLinearForward(xv_, wv_, nullptr, rows_, out_, in_), dtype_));
}

TEST_P(LinearTest, ForwardWithBiasMatchesReference) {
    Tensor y = Tensor::Empty(y_shape_, dtype_);
    LinearForward(LinearForwardArgs{.x = x_, .weight = w_, .bias = &b_, .y = y});
    EXPECT_TRUE(ValuesMatch(y, RefLinearForward(xv_, wv_, &bv_, rows_, out_, in_), dtype_));
    // The allocating wrapper gives the same values.
    EXPECT_EQ(LinearForward(x_, w_, &b_).ToDoubleVector(), y.ToDoubleVector());
}

TEST_P(LinearTest, ForwardGeluSavesPreActivationAndAppliesGelu) {
    for (const bool with_bias : {true, false}) {
        Tensor y = Tensor::Empty(y_shape_, dtype_);
        Tensor pre = Tensor::Empty(y_shape_, dtype_);
        LinearForward(LinearForwardArgs{.x = x_,
                                        .weight = w_,
                                        .bias = with_bias ? &b_ : nullptr,
                                        .y = y,
                                        .activation = LinearActivation::kGeluTanh,
                                        .pre_activation = &pre});
        const Values ref_pre = RefLinearForward(xv_, wv_, with_bias ? &bv_ : nullptr, rows_, out_, in_);
        Values ref_y(ref_pre.size());
        for (std::size_t i = 0; i < ref_pre.size(); ++i) {
            ref_y[i] = RefGeluTanh(ref_pre[i]);
        }
        EXPECT_TRUE(ValuesMatch(pre, ref_pre, dtype_)) << "with_bias=" << with_bias;
        EXPECT_TRUE(ValuesMatch(y, ref_y, dtype_, 4.0)) << "with_bias=" << with_bias;
    }
}

TEST_P(LinearTest, BackwardInputMatchesReference) {
    const Tensor dx = LinearBackwardInput(dy_, w_);
    EXPECT_EQ(dx.shape(), shape_.x);
    EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv_, wv_, rows_, out_, in_), dtype_));
}

TEST_P(LinearTest, BackwardWeightMatchesReference) {
    const Tensor dw = LinearBackwardWeight(dy_, x_);
    EXPECT_EQ(dw.shape(), (Shape{out_, in_}));
    EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_), dtype_));
}

TEST_P(LinearTest, BackwardWeightFusesBiasGrad) {
    Tensor dw = Tensor::Empty({out_, in_}, dtype_);
    Tensor db = Tensor::Full({out_}, 123.0, dtype_); // overwritten, not accumulated
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy_, .x = x_, .dweight = dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_), dtype_));
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv_, rows_, out_), dtype_));
}

TEST_P(LinearTest, BackwardWeightAccumulatesIntoExistingGrads) {
    Tensor dw = RandomTensor({out_, in_}, dtype_, Device::CPU(), 99, "dw.old");
    Tensor db = RandomTensor({out_}, dtype_, Device::CPU(), 99, "db.old");
    Values want_dw = dw.ToDoubleVector();
    Values want_db = db.ToDoubleVector();
    const Values step_dw = RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_);
    const Values step_db = RefColumnSum(dyv_, rows_, out_);
    for (std::size_t i = 0; i < want_dw.size(); ++i) {
        want_dw[i] += step_dw[i];
    }
    for (std::size_t i = 0; i < want_db.size(); ++i) {
        want_db[i] += step_db[i];
    }
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy_, .x = x_, .dweight = dw, .dbias = &db, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(dw, want_dw, dtype_));
    EXPECT_TRUE(ValuesMatch(db, want_db, dtype_));
}

TEST_P(LinearTest, BackwardBiasIsTheColumnSum) {
    const Tensor db = LinearBackwardBias(dy_);
    EXPECT_EQ(db.shape(), (Shape{out_}));
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv_, rows_, out_), dtype_));
}

TEST_P(LinearTest, BackwardBiasAccumulates) {
    Tensor db = RandomTensor({out_}, dtype_, Device::CPU(), 7, "db.old");
    Values want = db.ToDoubleVector();
    const Values sum = RefColumnSum(dyv_, rows_, out_);
    for (std::size_t i = 0; i < want.size(); ++i) {
        want[i] += sum[i];
    }
    LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy_, .dbias = db, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(db, want, dtype_));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Combine(CpuDTypes(),
                                            ::testing::Values(LinearShape{{1, 17}, 33},  // M = 1
                                                              LinearShape{{5, 1}, 1},    // K = N = 1
                                                              LinearShape{{7, 3}, 127},  // odd, tall N
                                                              LinearShape{{33, 127}, 3}, // odd, long K
                                                              LinearShape{{2, 3, 33}, 17}, LinearShape{{64, 96}, 80})),
                         [](const auto &info) {
                             return std::string(DTypeName(std::get<0>(info.param))) + "_" +
                                    ShapeName(std::get<1>(info.param));
                         });

TEST(LinearBiasTest, Float64GradIntoFloat32BiasIsAccumulatedInFloat64) {
    const Tensor dy = RandomTensor({300, 7}, DType::kFloat64, Device::CPU(), 3, "dy");
    Tensor db = Tensor::Empty({7}, DType::kFloat32);
    LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db});
    const Values want = RefColumnSum(dy.ToDoubleVector(), 300, 7);
    const Values got = db.ToDoubleVector();
    for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i], static_cast<double>(static_cast<float>(want[i]))) << i; // one rounding, at the end
    }
}

TEST(LinearBiasTest, EmptyRowsGiveZeroGradsOrKeepAccumulatedOnes) {
    const Tensor dy = Tensor::Empty({0, 5}, DType::kFloat32);
    const Tensor x = Tensor::Empty({0, 4}, DType::kFloat32);
    Tensor dw = Tensor::Full({5, 4}, 3.0, DType::kFloat32);
    Tensor db = Tensor::Full({5}, 3.0, DType::kFloat32);
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .dbias = &db, .accumulate = true});
    EXPECT_EQ(dw.ToDoubleVector(), Values(20, 3.0));
    EXPECT_EQ(db.ToDoubleVector(), Values(5, 3.0));
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .dbias = &db});
    EXPECT_EQ(dw.ToDoubleVector(), Values(20, 0.0));
    EXPECT_EQ(db.ToDoubleVector(), Values(5, 0.0));
    EXPECT_EQ(LinearBackwardBias(dy).ToDoubleVector(), Values(5, 0.0));
}

} // namespace
} // namespace shardline::kernels
