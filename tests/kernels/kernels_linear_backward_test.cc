// LinearBackward (dx, dweight and dbias together; on CUDA the separate bias grad on a side stream) on every device
// against the float64 references: every subset of the outputs, overwrite and accumulate (also into float32 main grads),
// a result read right after the call (CUDA's side stream must have joined the compute stream), no rows, CUDA's legacy
// provider, and the argument checks.

#include <cmath>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::LinearBackward;
using kernels::LinearBackwardArgs;
using ::testing::HasSubstr;

class LinearBackwardTest : public DeviceTest<> {
protected:
    // x [2, 3, in] (M = 6 rows), weight [out, in].
    static constexpr std::int64_t kRows = 6;
    static constexpr std::int64_t kIn = 5;
    static constexpr std::int64_t kOut = 7;

    void SetUp() override {
        DeviceTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        x_ = Random({2, 3, kIn}, dtype(), 11, "x");
        w_ = Random({kOut, kIn}, dtype(), 11, "w");
        dy_ = Random({2, 3, kOut}, dtype(), 11, "dy");
        ASSERT_GT(AbsSum(x_.ToDoubleVector()) * AbsSum(w_.ToDoubleVector()) * AbsSum(dy_.ToDoubleVector()), 0.0);
    }
    /// Garbage the op must overwrite (or, when accumulating, add to).
    Tensor Start(const Shape &shape, std::string_view name) const { return Random(shape, dtype(), 99, name); }
    Values RefDx() const { return RefLinearBackwardInput(dy_.ToDoubleVector(), w_.ToDoubleVector(), kRows, kOut, kIn); }
    Values RefDw() const {
        return RefLinearBackwardWeight(dy_.ToDoubleVector(), x_.ToDoubleVector(), kRows, kOut, kIn);
    }
    Values RefDb() const { return RefColumnSum(dy_.ToDoubleVector(), kRows, kOut); }

    Tensor x_, w_, dy_;
};

TEST_P(LinearBackwardTest, AllThreeGradsMatchFloat64) {
    Tensor dx = Start({2, 3, kIn}, "dx");
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .weight = &w_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype(), OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(LinearBackwardTest, OnlyTheGivenOutputsAreComputed) {
    // dx alone: x is not needed.
    Tensor dx = Start({2, 3, kIn}, "dx");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
    // dweight alone: the weight is not needed.
    Tensor dw = Start({kOut, kIn}, "dw");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype(), OnCuda(kEpilogueRoundings)));
    // dbias alone: neither is needed.
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
    // dx and dbias (a frozen weight): dbias without the wgrad GEMM.
    Tensor dx2 = Start({2, 3, kIn}, "dx2");
    Tensor db2 = Start({kOut}, "db2");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx2, .dbias = &db2});
    EXPECT_TRUE(ValuesMatch(dx2, RefDx(), dtype()));
    EXPECT_TRUE(ValuesMatch(db2, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(LinearBackwardTest, AccumulateAddsToWeightAndBiasGrads) {
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    const Values dw0 = dw.ToDoubleVector();
    const Values db0 = db.ToDoubleVector();
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw, .dbias = &db, .accumulate = true});
    // The new grad and the sum each rounded (beta = 1).
    EXPECT_TRUE(ValuesMatch(dw, AddScaled(dw0, RefDw()), dtype(), 2.0));
    EXPECT_TRUE(ValuesMatch(db, AddScaled(db0, RefDb()), dtype(), 2.0));
}

TEST_P(LinearBackwardTest, NoRowsZeroesTheParameterGradsUnlessAccumulating) {
    const Tensor dy = Tensor::Empty({0, kOut}, dtype(), device());
    const Tensor x = Tensor::Empty({0, kIn}, dtype(), device());
    Tensor dx = Tensor::Empty({0, kIn}, dtype(), device());
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

struct Case {
    std::int64_t m, in, out;
};
// Aligned shapes (CUDA's fused BGRADB possible), odd features (scalar column sum, 2-byte alignment) and a tall one
// whose column sum takes the two-pass path.
const std::vector<Case> kCases = {{256, 128, 96}, {33, 17, 41}, {4096, 64, 1032}};

std::string Name(const Case &c) {
    return "m=" + std::to_string(c.m) + " in=" + std::to_string(c.in) + " out=" + std::to_string(c.out);
}

TEST_P(LinearBackwardTest, EverySubsetOfGradsMatchesFloat64) {
    for (const Case &c : kCases) {
        const Tensor x = Random({c.m, c.in}, dtype(), 41, "x");
        const Tensor w = Random({c.out, c.in}, dtype(), 41, "w");
        const Tensor dy = Random({c.m, c.out}, dtype(), 41, "dy");
        const Values dyv = dy.ToDoubleVector();
        const Values ref_dx = RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_db = RefColumnSum(dyv, c.m, c.out);
        for (int mask = 1; mask < 8; ++mask) {
            const bool want_dx = (mask & 1) != 0;
            const bool want_dw = (mask & 2) != 0;
            const bool want_db = (mask & 4) != 0;
            SCOPED_TRACE(::testing::Message()
                         << Name(c) << (want_dx ? " dx" : "") << (want_dw ? " dw" : "") << (want_db ? " db" : ""));
            Tensor dx = Poison({c.m, c.in}, dtype());
            Tensor dw = Poison({c.out, c.in}, dtype());
            Tensor db = Poison({c.out}, dtype());
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .x = &x,
                                              .weight = &w,
                                              .dx = want_dx ? &dx : nullptr,
                                              .dweight = want_dw ? &dw : nullptr,
                                              .dbias = want_db ? &db : nullptr});
            // Read right away: on CUDA db comes from the side stream, which must have joined the compute stream.
            if (want_db) {
                EXPECT_TRUE(ValuesMatch(db, ref_db, dtype(), OnCuda(kEpilogueRoundings))) << "db";
            }
            if (want_dx) {
                EXPECT_TRUE(ValuesMatch(dx, ref_dx, dtype())) << "dx";
            }
            if (want_dw) {
                EXPECT_TRUE(ValuesMatch(dw, ref_dw, dtype(), OnCuda(kEpilogueRoundings))) << "dw";
            }
        }
    }
}

TEST_P(LinearBackwardTest, AccumulatesIntoMainGrads) {
    const DType main_dtype = MainGradDType(device(), dtype());
    for (const Case &c : kCases) {
        SCOPED_TRACE(Name(c));
        const Tensor x = Random({c.m, c.in}, dtype(), 42, "x");
        const Tensor w = Random({c.out, c.in}, dtype(), 42, "w");
        const Tensor dy = Random({c.m, c.out}, dtype(), 42, "dy");
        const double scale = std::sqrt(static_cast<double>(c.m));
        Tensor main_dw = Random({c.out, c.in}, main_dtype, 42, "main_dw", scale);
        Tensor main_db = Random({c.out}, main_dtype, 42, "main_db", scale);
        Tensor dx = Poison({c.m, c.in}, dtype());
        const Values old_dw = main_dw.ToDoubleVector();
        const Values old_db = main_db.ToDoubleVector();
        const Values dyv = dy.ToDoubleVector();
        const Values new_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
        const Values new_db = RefColumnSum(dyv, c.m, c.out);
        for (int step = 1; step <= 2; ++step) {
            SCOPED_TRACE(::testing::Message() << "step " << step);
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .x = &x,
                                              .weight = &w,
                                              .dx = &dx,
                                              .dweight = &main_dw,
                                              .dbias = &main_db,
                                              .accumulate = true});
            EXPECT_TRUE(ValuesMatch(main_db, AddScaled(old_db, new_db, step), main_dtype, step)) << "db";
            EXPECT_TRUE(ValuesMatch(main_dw, AddScaled(old_dw, new_dw, step), main_dtype, step)) << "dw";
            EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype()));
        }
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearBackwardTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// CUDA's legacy provider (cublasGemmEx and separate bias-grad kernels)

using LinearBackwardLegacyTest = DeviceTest<>;

TEST_P(LinearBackwardLegacyTest, LegacyProviderComputesTheSame) {
    ScopedProvider legacy(kernels::kLegacyProvider);
    const Case c{512, 128, 200};
    const Tensor x = Random({c.m, c.in}, dtype(), 43, "x");
    const Tensor w = Random({c.out, c.in}, dtype(), 43, "w");
    const Tensor dy = Random({c.m, c.out}, dtype(), 43, "dy");
    Tensor dx = Poison({c.m, c.in}, dtype());
    Tensor dw = Poison({c.out, c.in}, dtype());
    Tensor db = Poison({c.out}, dtype());
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w, .dx = &dx, .dweight = &dw, .dbias = &db});
    const Values dyv = dy.ToDoubleVector();
    EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype()));
    EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in), dtype()));
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv, c.m, c.out), dtype()));
}

INSTANTIATE_TEST_SUITE_P(Cuda, LinearBackwardLegacyTest, DeviceDTypes(DeviceType::kCUDA), DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Argument checks

TEST(LinearBackwardArgsTest, MissingInputsAndWrongShapesAreNamed) {
    const Tensor dy = RandomTensor({4, 3}, DType::kFloat32, Device::CPU(), 1, "dy");
    const Tensor x = RandomTensor({4, 2}, DType::kFloat32, Device::CPU(), 1, "x");
    Tensor dx = Tensor::Empty({4, 2}, DType::kFloat32);
    Tensor dw = Tensor::Empty({3, 2}, DType::kFloat32);
    Tensor bad_db = Tensor::Empty({2}, DType::kFloat32);
    auto error = [](const LinearBackwardArgs &args) -> std::string {
        try {
            LinearBackward(args);
        } catch (const Error &e) {
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
} // namespace shardline::testing
