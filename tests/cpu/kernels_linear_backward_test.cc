// LinearBackward (dx, dweight and dbias together) on the CPU against the float64 references: every subset of the
// outputs, overwrite and accumulate, and its argument checks.

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using ::testing::HasSubstr;
using testing::AbsSum;
using testing::RandomTensor;
using testing::RefColumnSum;
using testing::RefLinearBackwardInput;
using testing::RefLinearBackwardWeight;
using testing::Values;
using testing::ValuesMatch;

class LinearBackwardTest : public ::testing::TestWithParam<DType> {
protected:
    // x [2, 3, in] (M = 6 rows), weight [out, in].
    static constexpr std::int64_t kRows = 6;
    static constexpr std::int64_t kIn = 5;
    static constexpr std::int64_t kOut = 7;

    void SetUp() override {
        dtype_ = GetParam();
        x_ = RandomTensor({2, 3, kIn}, dtype_, Device::CPU(), 11, "x");
        w_ = RandomTensor({kOut, kIn}, dtype_, Device::CPU(), 11, "w");
        dy_ = RandomTensor({2, 3, kOut}, dtype_, Device::CPU(), 11, "dy");
        ASSERT_GT(AbsSum(x_.ToDoubleVector()) * AbsSum(w_.ToDoubleVector()) * AbsSum(dy_.ToDoubleVector()), 0.0);
    }
    /// Garbage the op must overwrite (or, when accumulating, add to).
    Tensor Start(const Shape& shape, std::string_view name) const {
        return RandomTensor(shape, dtype_, Device::CPU(), 99, name);
    }
    Values RefDx() const { return RefLinearBackwardInput(dy_.ToDoubleVector(), w_.ToDoubleVector(), kRows, kOut, kIn); }
    Values RefDw() const {
        return RefLinearBackwardWeight(dy_.ToDoubleVector(), x_.ToDoubleVector(), kRows, kOut, kIn);
    }
    Values RefDb() const { return RefColumnSum(dy_.ToDoubleVector(), kRows, kOut); }

    DType dtype_ = DType::kFloat32;
    Tensor x_, w_, dy_;
};

TEST_P(LinearBackwardTest, AllThreeGradsMatchFloat64) {
    Tensor dx = Start({2, 3, kIn}, "dx");
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .weight = &w_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype_));
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype_));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype_));
}

TEST_P(LinearBackwardTest, OnlyTheGivenOutputsAreComputed) {
    // dx alone: x is not needed.
    Tensor dx = Start({2, 3, kIn}, "dx");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype_));
    // dweight alone: the weight is not needed.
    Tensor dw = Start({kOut, kIn}, "dw");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype_));
    // dbias alone: neither is needed.
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype_));
    // dx and dbias (a frozen weight): dbias without the wgrad GEMM.
    Tensor dx2 = Start({2, 3, kIn}, "dx2");
    Tensor db2 = Start({kOut}, "db2");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx2, .dbias = &db2});
    EXPECT_TRUE(ValuesMatch(dx2, RefDx(), dtype_));
    EXPECT_TRUE(ValuesMatch(db2, RefDb(), dtype_));
}

TEST_P(LinearBackwardTest, AccumulateAddsToWeightAndBiasGrads) {
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    const Values dw0 = dw.ToDoubleVector();
    const Values db0 = db.ToDoubleVector();
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw, .dbias = &db, .accumulate = true});
    Values want_dw = RefDw();
    Values want_db = RefDb();
    for (std::size_t i = 0; i < want_dw.size(); ++i) {
        want_dw[i] += dw0[i];
    }
    for (std::size_t i = 0; i < want_db.size(); ++i) {
        want_db[i] += db0[i];
    }
    EXPECT_TRUE(ValuesMatch(dw, want_dw, dtype_, 2.0));
    EXPECT_TRUE(ValuesMatch(db, want_db, dtype_, 2.0));
}

TEST_P(LinearBackwardTest, NoRowsZeroesTheParameterGradsUnlessAccumulating) {
    const Tensor dy = Tensor::Empty({0, kOut}, dtype_);
    const Tensor x = Tensor::Empty({0, kIn}, dtype_);
    Tensor dx = Tensor::Empty({0, kIn}, dtype_);
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_EQ(AbsSum(dw.ToDoubleVector()), 0.0);
    EXPECT_EQ(AbsSum(db.ToDoubleVector()), 0.0);
    Tensor dw2 = Start({kOut, kIn}, "dw2");
    const Values before = dw2.ToDoubleVector();
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .dweight = &dw2, .accumulate = true});
    EXPECT_EQ(dw2.ToDoubleVector(), before);
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, LinearBackwardTest, testing::CpuDTypes(), testing::DTypeParamName);

TEST(LinearBackwardArgsTest, MissingInputsAndWrongShapesAreNamed) {
    const Tensor dy = RandomTensor({4, 3}, DType::kFloat32, Device::CPU(), 1, "dy");
    const Tensor x = RandomTensor({4, 2}, DType::kFloat32, Device::CPU(), 1, "x");
    Tensor dx = Tensor::Empty({4, 2}, DType::kFloat32);
    Tensor dw = Tensor::Empty({3, 2}, DType::kFloat32);
    Tensor bad_db = Tensor::Empty({2}, DType::kFloat32);
    auto error = [](const LinearBackwardArgs& args) -> std::string {
        try {
            LinearBackward(args);
        } catch (const Error& e) {
            return e.what();
        }
        return "accepted";
    };
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dx = &dx}), HasSubstr("LinearBackward: dx needs the weight"));
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dweight = &dw}),
                HasSubstr("LinearBackward: dweight needs the input x"));
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dbias = &bad_db}), HasSubstr("dbias must have shape [3]"));
    Tensor wrong_dw = Tensor::Empty({2, 3}, DType::kFloat32);
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .x = &x, .dweight = &wrong_dw}),
                HasSubstr("dweight must have shape [3, 2]"));
    // Nothing asked: nothing done, no error.
    EXPECT_EQ(error(LinearBackwardArgs{.dy = dy}), "accepted");
}

} // namespace
} // namespace shardline::kernels
