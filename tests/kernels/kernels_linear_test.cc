// Linear kernels on every device (CUDA's default provider: cuBLASLt with fused epilogues) against the float64
// references, over shapes that include M = 1, odd K and N (where cuBLASLt gets 2- or 4-byte alignment only), batch dims
// and aligned shapes where the fused epilogues apply. The references read the inputs back (ToDoubleVector), so they
// see the rounded inputs; outputs start as random garbage, so a kernel that skips an element or reads its output
// fails. On the CPU, the fused GELU kernels give the separate kernels' values bit for bit.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::GeluBackward;
using kernels::GeluForward;
using kernels::LinearActivation;
using kernels::LinearBackward;
using kernels::LinearBackwardArgs;
using kernels::LinearBackwardBias;
using kernels::LinearBackwardBiasArgs;
using kernels::LinearBackwardInput;
using kernels::LinearBackwardInputArgs;
using kernels::LinearBackwardWeight;
using kernels::LinearBackwardWeightArgs;
using kernels::LinearForward;
using kernels::LinearForwardArgs;

struct LinearShape {
    Shape x; ///< [..., in]
    std::int64_t out;
};
void PrintTo(const LinearShape &s, std::ostream *os) { *os << "x " << ShapeToString(s.x) << ", out " << s.out; }

std::string ShapeName(const LinearShape &s) { return fmt::format("x_{}_out_{}", fmt::join(s.x, "_"), s.out); }

/// The cases: each shape its own case, and the sweep, one case over several shapes.
struct LinearShapes {
    std::vector<LinearShape> shapes;
    std::string name;
};
void PrintTo(const LinearShapes &s, std::ostream *os) { *os << s.name; }

std::vector<LinearShapes> LinearShapeCases() {
    const std::vector<LinearShape> own = {
        {{1, 17}, 33},    // M = 1
        {{5, 1}, 1},      // K = N = 1
        {{7, 3}, 127},    // odd, tall N
        {{33, 127}, 3},   // odd, long K
        {{2, 3, 33}, 17}, // batch dims
        {{64, 96}, 80},   // aligned
    };
    std::vector<LinearShapes> cases;
    for (const LinearShape &s : own) {
        cases.push_back({{s}, ShapeName(s)});
    }
    // M = 7, 128, 1000; odd in/out (17, 33, 127) where cuBLASLt gets 2- or 4-byte alignment only; a 3-d input; and
    // aligned shapes where the fused epilogues apply.
    cases.push_back(
        {{{{7, 33}, 17}, {{128, 127}, 64}, {{1000, 64}, 127}, {{3, 5, 40}, 24}, {{128, 256}, 96}}, "sweep"});
    return cases;
}

using LinearParam = std::tuple<DeviceDType, LinearShapes>;

class LinearTest : public DeviceTest<LinearParam> {
protected:
    /// Runs `body` once per shape of the case, after Prepare.
    template <class Body> void ForEachShape(Body body) {
        for (const LinearShape &shape : std::get<1>(GetParam()).shapes) {
            SCOPED_TRACE(::testing::PrintToString(shape));
            ASSERT_NO_FATAL_FAILURE(Prepare(shape));
            body();
        }
    }
    /// x, weight, bias and dy of `shape`, and their values.
    void Prepare(const LinearShape &shape) {
        shape_ = shape;
        in_ = shape_.x.back();
        out_ = shape_.out;
        rows_ = Numel(shape_.x) / in_;
        y_shape_ = shape_.x;
        y_shape_.back() = out_;
        const std::uint64_t seed = static_cast<std::uint64_t>(rows_ * 1000 + in_ * 10 + out_);
        // weight ~ N(0, 1/in) keeps y ~ N(0, 1); the bias ~ N(0, 1) is as large as the product.
        x_ = Random(shape_.x, dtype(), seed, "x");
        w_ = Random({out_, in_}, dtype(), seed, "w", 1.0 / std::sqrt(static_cast<double>(in_)));
        b_ = Random({out_}, dtype(), seed, "b");
        dy_ = Random(y_shape_, dtype(), seed, "dy");
        xv_ = x_.ToDoubleVector();
        wv_ = w_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        dyv_ = dy_.ToDoubleVector();
        ASSERT_GT(AbsSum(xv_) * AbsSum(wv_) * AbsSum(bv_) * AbsSum(dyv_), 0.0);
    }

    LinearShape shape_;
    std::int64_t in_ = 0, out_ = 0, rows_ = 0;
    Shape y_shape_;
    Tensor x_, w_, b_, dy_;
    Values xv_, wv_, bv_, dyv_;
};

TEST_P(LinearTest, ForwardWithoutBiasMatchesReference) {
    ForEachShape([&] {
        const Values ref = RefLinearForward(xv_, wv_, nullptr, rows_, out_, in_);
        Tensor y = Poison(y_shape_, dtype());
        LinearForward(LinearForwardArgs{.x = x_, .weight = w_, .y = y});
        EXPECT_TRUE(ValuesMatch(y, ref, dtype()));
        const Tensor allocated = LinearForward(x_, w_);
        EXPECT_EQ(allocated.shape(), y_shape_);
        EXPECT_TRUE(ValuesMatch(allocated, ref, dtype())) << "allocating wrapper";
    });
}

TEST_P(LinearTest, ForwardWithBiasMatchesReference) {
    ForEachShape([&] {
        Tensor y = Poison(y_shape_, dtype());
        LinearForward(LinearForwardArgs{.x = x_, .weight = w_, .bias = &b_, .y = y});
        const Values ref = RefLinearForward(xv_, wv_, &bv_, rows_, out_, in_);
        EXPECT_TRUE(ValuesMatch(y, ref, dtype(), OnCuda(kUnfusedBiasRoundings)));
        const Tensor allocated = LinearForward(x_, w_, &b_);
        EXPECT_EQ(allocated.shape(), y_shape_);
        if (device().is_cpu()) {
            // The allocating wrapper gives the same values, bit for bit.
            EXPECT_EQ(allocated.ToDoubleVector(), y.ToDoubleVector());
        } else {
            EXPECT_TRUE(ValuesMatch(allocated, ref, dtype(), kUnfusedBiasRoundings)) << "allocating wrapper";
        }
    });
}

TEST_P(LinearTest, ForwardGeluSavesPreActivationAndAppliesGelu) {
    ForEachShape([&] {
        for (const bool with_bias : {true, false}) {
            SCOPED_TRACE(with_bias ? "bias" : "no bias");
            Tensor y = Poison(y_shape_, dtype(), "poison_y");
            Tensor pre = Poison(y_shape_, dtype(), "poison_pre");
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
            EXPECT_TRUE(
                ValuesMatch(pre, ref_pre, dtype(), OnCuda(with_bias ? kUnfusedBiasRoundings : kEpilogueRoundings)))
                << "pre-activation";
            EXPECT_TRUE(ValuesMatch(y, ref_y, dtype(), kGeluEpilogueRoundings)) << "activation";
        }
    });
}

TEST_P(LinearTest, BackwardInputMatchesReference) {
    ForEachShape([&] {
        const Values ref = RefLinearBackwardInput(dyv_, wv_, rows_, out_, in_);
        Tensor dx = Poison(shape_.x, dtype());
        LinearBackwardInput(LinearBackwardInputArgs{.dy = dy_, .weight = w_, .dx = dx});
        EXPECT_TRUE(ValuesMatch(dx, ref, dtype()));
        const Tensor allocated = LinearBackwardInput(dy_, w_);
        EXPECT_EQ(allocated.shape(), shape_.x);
        EXPECT_TRUE(ValuesMatch(allocated, ref, dtype())) << "allocating wrapper";
    });
}

TEST_P(LinearTest, BackwardWeightMatchesReference) {
    ForEachShape([&] {
        const Values ref = RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_);
        Tensor dw = Poison({out_, in_}, dtype());
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy_, .x = x_, .dweight = dw});
        EXPECT_TRUE(ValuesMatch(dw, ref, dtype()));
        const Tensor allocated = LinearBackwardWeight(dy_, x_);
        EXPECT_EQ(allocated.shape(), (Shape{out_, in_}));
        EXPECT_TRUE(ValuesMatch(allocated, ref, dtype())) << "allocating wrapper";
    });
}

TEST_P(LinearTest, BackwardWeightFusesBiasGrad) {
    ForEachShape([&] {
        Tensor dw = Poison({out_, in_}, dtype(), "poison_dw");
        Tensor db = Poison({out_}, dtype(), "poison_db"); // overwritten, not accumulated
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy_, .x = x_, .dweight = dw, .dbias = &db});
        // On CUDA the bias grad may ride in the wgrad GEMM's BGRADB epilogue, which rounds its D and its sum in fp16
        // kernels.
        EXPECT_TRUE(
            ValuesMatch(dw, RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_), dtype(), OnCuda(kEpilogueRoundings)))
            << "dweight";
        EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv_, rows_, out_), dtype(), OnCuda(kEpilogueRoundings)))
            << "dbias (BGRADB or a separate sum)";
    });
}

TEST_P(LinearTest, BackwardWeightAccumulatesIntoExistingGrads) {
    ForEachShape([&] {
        Tensor dw = Random({out_, in_}, dtype(), 99, "dw.old");
        Tensor db = Random({out_}, dtype(), 99, "db.old");
        const Values want_dw = AddScaled(dw.ToDoubleVector(), RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_));
        const Values want_db = AddScaled(db.ToDoubleVector(), RefColumnSum(dyv_, rows_, out_));
        LinearBackwardWeight(
            LinearBackwardWeightArgs{.dy = dy_, .x = x_, .dweight = dw, .dbias = &db, .accumulate = true});
        EXPECT_TRUE(ValuesMatch(dw, want_dw, dtype(), OnCuda(kEpilogueRoundings))); // beta = 1
        EXPECT_TRUE(ValuesMatch(db, want_db, dtype(), OnCuda(kEpilogueRoundings)));
    });
}

TEST_P(LinearTest, BackwardWeightAccumulatesIntoTheMainGrad) {
    ForEachShape([&] {
        const DType main_dtype = MainGradDType(device(), dtype());
        const double scale = std::sqrt(static_cast<double>(rows_)); // the old grads as large as the new ones
        Tensor main_dw = Random({out_, in_}, main_dtype, 7, "main_dw", scale);
        Tensor main_db = Random({out_}, main_dtype, 7, "main_db", scale);
        const Values old_dw = main_dw.ToDoubleVector();
        const Values old_db = main_db.ToDoubleVector();
        const Values new_dw = RefLinearBackwardWeight(dyv_, xv_, rows_, out_, in_);
        const Values new_db = RefColumnSum(dyv_, rows_, out_);
        // Twice: main += new, then main += new again (beta = 1 each time, never overwritten).
        for (int step = 1; step <= 2; ++step) {
            SCOPED_TRACE(::testing::Message() << "accumulation step " << step);
            LinearBackwardWeight(LinearBackwardWeightArgs{
                .dy = dy_, .x = x_, .dweight = main_dw, .dbias = &main_db, .accumulate = true});
            // Products of the inputs are exact in the main grad's dtype, sums accumulate in it.
            EXPECT_TRUE(ValuesMatch(main_dw, AddScaled(old_dw, new_dw, step), main_dtype, step))
                << "dweight = old + new";
            EXPECT_TRUE(ValuesMatch(main_db, AddScaled(old_db, new_db, step), main_dtype, step)) << "dbias = old + new";
        }
    });
}

TEST_P(LinearTest, BackwardBiasIsTheColumnSum) {
    ForEachShape([&] {
        const Values ref = RefColumnSum(dyv_, rows_, out_);
        Tensor db = Poison({out_}, dtype());
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy_, .dbias = db});
        EXPECT_TRUE(ValuesMatch(db, ref, dtype()));
        const Tensor allocated = LinearBackwardBias(dy_);
        EXPECT_EQ(allocated.shape(), (Shape{out_}));
        EXPECT_TRUE(ValuesMatch(allocated, ref, dtype())) << "allocating wrapper";
    });
}

TEST_P(LinearTest, BackwardBiasAccumulates) {
    ForEachShape([&] {
        Tensor db = Random({out_}, dtype(), 7, "db.old");
        const Values want = AddScaled(db.ToDoubleVector(), RefColumnSum(dyv_, rows_, out_));
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy_, .dbias = db, .accumulate = true});
        EXPECT_TRUE(ValuesMatch(db, want, dtype()));
    });
}

auto LinearCases(DeviceType type) { return DeviceCases(type, ::testing::ValuesIn(LinearShapeCases())); }
std::string LinearCaseName(const ::testing::TestParamInfo<LinearParam> &info) {
    return std::string(DTypeName(std::get<0>(info.param).dtype)) + "_" + std::get<1>(info.param).name;
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearTest, LinearCases, LinearCaseName);

// ---------------------------------------------------------------------------------------------------------------------
// Pointer alignment, dtype accumulation and the bias grad's reduction paths

using LinearKernelsTest = DeviceTest<>;

Shape WithLast(Shape lead, std::int64_t last) {
    lead.push_back(last);
    return lead;
}

TEST_P(LinearKernelsTest, ForwardWithMisalignedPointers) {
    // Every operand one element past an allocation: no 16-byte alignment, so cuBLASLt must be asked for algorithms
    // that allow it (alignment is part of the algorithm cache key).
    for (const LinearShape &s : {LinearShape{{64, 64}, 48}, LinearShape{{7, 33}, 17}}) {
        SCOPED_TRACE(::testing::PrintToString(s));
        const std::int64_t in = s.x.back();
        const std::int64_t m = Numel(s.x) / in;
        const Tensor x0 = Random(s.x, dtype(), 2, "x");
        const Tensor w0 = Random({s.out, in}, dtype(), 2, "w", 1.0 / std::sqrt(static_cast<double>(in)));
        const Tensor b0 = Random({s.out}, dtype(), 2, "b");
        MisalignedTensor x = MisalignedCopy(x0);
        MisalignedTensor w = MisalignedCopy(w0);
        MisalignedTensor b = MisalignedCopy(b0);
        MisalignedTensor y = MisalignedCopy(Poison({m, s.out}, dtype()));
        LinearForward(LinearForwardArgs{.x = x.view, .weight = w.view, .bias = &b.view, .y = y.view});
        const Values bv = b0.ToDoubleVector();
        const Values ref = RefLinearForward(x0.ToDoubleVector(), w0.ToDoubleVector(), &bv, m, s.out, in);
        EXPECT_TRUE(ValuesMatch(y.view, ref, dtype(), OnCuda(kUnfusedBiasRoundings)));
        // Nothing written before the view.
        EXPECT_EQ(y.backing.ToDoubleVector()[0], 0.0);
    }
}

TEST_P(LinearKernelsTest, BackwardWeightAccumulatesInTheInputDType) {
    const LinearShape s{{96, 40}, 24};
    const Tensor dy = Random({96, s.out}, dtype(), 8, "dy");
    const Tensor x = Random(s.x, dtype(), 8, "x");
    Tensor dw = Random({s.out, 40}, dtype(), 8, "old", std::sqrt(96.0));
    const Values old = dw.ToDoubleVector();
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .accumulate = true});
    const Values want = AddScaled(old, RefLinearBackwardWeight(dy.ToDoubleVector(), x.ToDoubleVector(), 96, s.out, 40));
    EXPECT_TRUE(ValuesMatch(dw, want, dtype(), OnCuda(kEpilogueRoundings))); // beta = 1
}

struct BiasCase {
    Shape dy;
    const char *path;
};

TEST_P(LinearKernelsTest, BackwardBiasMatchesFloat64IntoEitherDType) {
    // On CUDA, N multiple of 8 takes the vectorised path, odd N the scalar one; M = 4096 runs the two-pass reduction.
    const std::vector<BiasCase> cases = {
        {{1, 8}, "vectorised"},    {{7, 1032}, "vectorised"},     {{4096, 1032}, "vectorised"},
        {{4096, 8}, "vectorised"}, {{4, 1024, 24}, "vectorised"}, {{1, 33}, "scalar"},
        {{7, 1}, "scalar"},        {{4096, 1031}, "scalar"},      {{4096, 33}, "scalar"},
    };
    for (const BiasCase &c : cases) {
        const std::int64_t n = c.dy.back();
        const std::int64_t m = Numel(c.dy) / n;
        const Tensor dy = Random(c.dy, dtype(), 9, "dy");
        const Values ref = RefColumnSum(dy.ToDoubleVector(), m, n);
        for (const DType out_dtype : {dtype(), DType::kFloat32}) {
            SCOPED_TRACE(::testing::Message()
                         << "dy " << ShapeToString(c.dy) << " (" << c.path << "), dbias " << DTypeName(out_dtype));
            Tensor db = Poison({n}, out_dtype);
            LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db});
            EXPECT_TRUE(ValuesMatch(db, ref, out_dtype));

            Tensor acc = Random({n}, out_dtype, 9, "old", std::sqrt(static_cast<double>(m)));
            const Values old = acc.ToDoubleVector();
            LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = acc, .accumulate = true});
            EXPECT_TRUE(ValuesMatch(acc, AddScaled(old, ref), out_dtype)) << "accumulate";
        }
        const Tensor db2 = LinearBackwardBias(dy);
        EXPECT_EQ(db2.dtype(), dtype());
        EXPECT_TRUE(ValuesMatch(db2, ref, dtype())) << "allocating wrapper";
    }
}

TEST_P(LinearKernelsTest, BackwardBiasWithMisalignedInput) {
    // N = 64 would take CUDA's vectorised path, but dy starts one element off a 16-byte boundary.
    const Tensor dy0 = Random({513, 64}, dtype(), 10, "dy");
    MisalignedTensor dy = MisalignedCopy(dy0);
    Tensor db = Poison({64}, dtype());
    LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy.view, .dbias = db});
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dy0.ToDoubleVector(), 513, 64), dtype()));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearKernelsTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// The CPU's fused GELU epilogues, float64 bias-grad accumulation and empty inputs

TEST(LinearGeluCpuTest, FusedKernelsEqualTheSeparateOnesBitForBit) {
    // On the CPU the fused forward (GEMM + bias + GELU) and backward (dgrad ⊙ gelu', the previous bias grad) give
    // exactly the values of LinearForward(bias) → GeluForward and LinearBackwardInput → GeluBackward →
    // LinearBackwardBias: the fused ParallelMLP trains as the unfused one did.
    for (const DType dtype : {DType::kFloat32, DType::kFloat64}) {
        SCOPED_TRACE(DTypeName(dtype));
        const std::int64_t m = 37, in = 24, out = 40;
        const Tensor x = RandomTensor({m, in}, dtype, Device::CPU(), 56, "x");
        const Tensor w1 = RandomTensor({out, in}, dtype, Device::CPU(), 56, "w1");
        const Tensor b1 = RandomTensor({out}, dtype, Device::CPU(), 56, "b1");
        Tensor pre = Tensor::Empty({m, out}, dtype);
        Tensor h = Tensor::Empty({m, out}, dtype);
        LinearForward(LinearForwardArgs{.x = x,
                                        .weight = w1,
                                        .bias = &b1,
                                        .y = h,
                                        .activation = LinearActivation::kGeluTanh,
                                        .pre_activation = &pre});
        const Tensor pre_sep = LinearForward(x, w1, &b1);
        const Tensor h_sep = GeluForward(pre_sep, kernels::GeluApproximation::kTanh);
        EXPECT_EQ(pre.ToDoubleVector(), pre_sep.ToDoubleVector());
        EXPECT_EQ(h.ToDoubleVector(), h_sep.ToDoubleVector());

        // The next layer W2 [in, out] takes h; its dgrad undoes the GELU.
        const Tensor w2 = RandomTensor({in, out}, dtype, Device::CPU(), 56, "w2");
        const Tensor dy = RandomTensor({m, in}, dtype, Device::CPU(), 56, "dy");
        for (const bool accumulate : {false, true}) {
            Tensor dpre = Tensor::Empty({m, out}, dtype);
            Tensor db1 = RandomTensor({out}, dtype, Device::CPU(), 57, "db1");
            Tensor db1_sep = db1.Clone();
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .weight = &w2,
                                              .dx = &dpre,
                                              .accumulate = accumulate,
                                              .input_activation = LinearActivation::kGeluTanh,
                                              .pre_activation = &pre,
                                              .pre_activation_dbias = &db1});
            const Tensor dh_sep = LinearBackwardInput(dy, w2);
            const Tensor dpre_sep = GeluBackward(dh_sep, pre, kernels::GeluApproximation::kTanh);
            LinearBackwardBias(LinearBackwardBiasArgs{.dy = dpre_sep, .dbias = db1_sep, .accumulate = accumulate});
            EXPECT_EQ(dpre.ToDoubleVector(), dpre_sep.ToDoubleVector()) << "accumulate " << accumulate;
            EXPECT_EQ(db1.ToDoubleVector(), db1_sep.ToDoubleVector()) << "accumulate " << accumulate;
        }
    }
}

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
} // namespace shardline::testing
