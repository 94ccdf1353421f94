// Add and Scale on every device against float64 references: into a fresh output, allocating, and in place.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::Add;
using kernels::AddArgs;
using kernels::Scale;
using kernels::ScaleArgs;

// Odd element counts leave a tail after any vector width; one tensor spans many blocks.
const std::vector<Shape> kShapes = {{1}, {7, 33}, {3, 5, 129}, {(1 << 18) + 7}};

class ElementwiseTest : public DeviceTest<> {
protected:
    /// a and b of `shape`, and a + alpha·b in float64.
    void Operands(const Shape &shape) {
        a_ = Random(shape, dtype(), 43, "a");
        b_ = Random(shape, dtype(), 43, "b");
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
    for (const Shape &shape : kShapes) {
        ASSERT_NO_FATAL_FAILURE(Operands(shape));
        for (const double alpha : {1.0, -2.5, 0.0, -0.5, 2.5}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << ", alpha " << alpha);
            Tensor out = Poison(shape, dtype());
            Add(AddArgs{.a = a_, .b = b_, .out = out, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(out, Axpy(alpha), dtype()));
            const Tensor allocated = Add(a_, b_, alpha);
            EXPECT_EQ(allocated.shape(), a_.shape());
            EXPECT_TRUE(ValuesMatch(allocated, Axpy(alpha), dtype())) << "allocating wrapper";
        }
    }
}

TEST_P(ElementwiseTest, AddMayWriteOverItsFirstOperand) {
    for (const Shape &shape : kShapes) {
        ASSERT_NO_FATAL_FAILURE(Operands(shape));
        for (const double alpha : {0.5, 1.0, -0.5, 2.5}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << ", alpha " << alpha);
            Tensor inplace = a_.Clone();
            Add(AddArgs{.a = inplace, .b = b_, .out = inplace, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(inplace, Axpy(alpha), dtype())) << "out aliases a";
        }
    }
}

TEST_P(ElementwiseTest, AddMayWriteOverItsSecondOperand) {
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        ASSERT_NO_FATAL_FAILURE(Operands(shape));
        Tensor inplace = b_.Clone();
        Add(AddArgs{.a = a_, .b = inplace, .out = inplace, .alpha = 3.0});
        EXPECT_TRUE(ValuesMatch(inplace, Axpy(3.0), dtype())) << "out aliases b";
    }
}

TEST_P(ElementwiseTest, MisalignedOperandsGiveTheSameBitsAsAlignedOnes) {
    // CUDA reads 16-byte vectors only when every pointer allows; an operand one element off the grid takes the scalar
    // path, which must compute the same bits (the same float math per element).
    const Shape shape = {(1 << 12) + 3};
    ASSERT_NO_FATAL_FAILURE(Operands(shape));
    Tensor aligned = Poison(shape, dtype());
    Add(AddArgs{.a = a_, .b = b_, .out = aligned, .alpha = -1.5});
    // The same values at element offset 1 of a larger buffer.
    Tensor a_big = Poison({shape[0] + 1}, dtype());
    Tensor out_big = Poison({shape[0] + 1}, dtype());
    const std::size_t elem = ElementSize(dtype());
    Tensor a_off = Tensor::FromBlob(static_cast<char *>(a_big.data()) + elem, shape, dtype(), device());
    Tensor out_off = Tensor::FromBlob(static_cast<char *>(out_big.data()) + elem, shape, dtype(), device());
    a_off.CopyFrom(a_);
    Add(AddArgs{.a = a_off, .b = b_, .out = out_off, .alpha = -1.5});
    EXPECT_EQ(out_off.ToDoubleVector(), aligned.ToDoubleVector());
    Tensor scaled = Poison(shape, dtype());
    Scale(ScaleArgs{.x = a_, .out = scaled, .alpha = 0.37});
    Scale(ScaleArgs{.x = a_off, .out = out_off, .alpha = 0.37});
    EXPECT_EQ(out_off.ToDoubleVector(), scaled.ToDoubleVector());
}

TEST_P(ElementwiseTest, ScaleMultipliesEveryElement) {
    for (const Shape &shape : kShapes) {
        const Tensor x = Random(shape, dtype(), 44, "x");
        for (const double alpha : {-1.75, 0.37, -3.0}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << ", alpha " << alpha);
            Values want = x.ToDoubleVector();
            ASSERT_GT(AbsSum(want), 0.0);
            for (double &v : want) {
                v *= alpha;
            }
            Tensor out = Poison(shape, dtype());
            Scale(ScaleArgs{.x = x, .out = out, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(out, want, dtype()));
            EXPECT_TRUE(ValuesMatch(Scale(x, alpha), want, dtype())) << "allocating wrapper";
            Tensor inplace = x.Clone();
            Scale(ScaleArgs{.x = inplace, .out = inplace, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(inplace, want, dtype())) << "out aliases x";
        }
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(ElementwiseTest, DeviceCases, DeviceDTypeName);

} // namespace
} // namespace shardline::testing
