#include <string>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::DTypeParamName;
using testing::RandomTensor;
using testing::Values;
using testing::ValuesMatch;

class ElementwiseTest : public ::testing::TestWithParam<DType> {
protected:
    void SetUp() override {
        a_ = RandomTensor({7, 33}, GetParam(), Device::CPU(), 8, "a");
        b_ = RandomTensor({7, 33}, GetParam(), Device::CPU(), 8, "b");
        av_ = a_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        ASSERT_GT(AbsSum(av_) * AbsSum(bv_), 0.0);
    }
    Values Axpy(double alpha) const {
        Values v(av_.size());
        for (std::size_t i = 0; i < v.size(); ++i) {
            v[i] = av_[i] + alpha * bv_[i];
        }
        return v;
    }
    Tensor a_, b_;
    Values av_, bv_;
};

TEST_P(ElementwiseTest, AddIsAPlusAlphaB) {
    for (double alpha : {1.0, -2.5, 0.0}) {
        const Tensor out = Add(a_, b_, alpha);
        EXPECT_EQ(out.shape(), a_.shape());
        EXPECT_TRUE(ValuesMatch(out, Axpy(alpha), GetParam())) << "alpha " << alpha;
    }
}

TEST_P(ElementwiseTest, AddMayWriteOverItsFirstOperand) {
    Add(AddArgs{.a = a_, .b = b_, .out = a_, .alpha = 0.5});
    EXPECT_TRUE(ValuesMatch(a_, Axpy(0.5), GetParam()));
}

TEST_P(ElementwiseTest, AddMayWriteOverItsSecondOperand) {
    Add(AddArgs{.a = a_, .b = b_, .out = b_, .alpha = 3.0});
    EXPECT_TRUE(ValuesMatch(b_, Axpy(3.0), GetParam()));
}

TEST_P(ElementwiseTest, ScaleMultipliesEveryElement) {
    Values want(av_.size());
    for (std::size_t i = 0; i < av_.size(); ++i) {
        want[i] = -1.75 * av_[i];
    }
    EXPECT_TRUE(ValuesMatch(Scale(a_, -1.75), want, GetParam()));
    Scale(ScaleArgs{.x = a_, .out = a_, .alpha = -1.75}); // in place
    EXPECT_TRUE(ValuesMatch(a_, want, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, ElementwiseTest, CpuDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::kernels
