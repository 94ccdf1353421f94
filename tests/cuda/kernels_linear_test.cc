// Linear kernels on CUDA (default provider: cuBLASLt with fused epilogues) against float64 references, for float32,
// float16 and bfloat16. The references read the device inputs back (ToDoubleVector), so they see the rounded inputs;
// every output starts as random garbage, so a kernel that skips an element or reads its output fails.

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::LinearActivation;
using kernels::LinearBackwardBias;
using kernels::LinearBackwardBiasArgs;
using kernels::LinearBackwardInput;
using kernels::LinearBackwardInputArgs;
using kernels::LinearBackwardWeight;
using kernels::LinearBackwardWeightArgs;
using kernels::LinearForward;
using kernels::LinearForwardArgs;

/// x is [lead..., in], weight [out, in]. M = Π lead.
struct LinearShape {
    Shape lead;
    std::int64_t in;
    std::int64_t out;
};

// M = 1, 7, 128, 1000; odd in/out (17, 33, 127) where cuBLASLt gets 2- or 4-byte alignment only; a 3-d input; and
// aligned shapes where the fused epilogues apply.
const std::vector<LinearShape> kShapes = {
    {{1}, 17, 33}, {{7}, 33, 17}, {{128}, 127, 64}, {{1000}, 64, 127}, {{3, 5}, 40, 24}, {{128}, 256, 96},
};

Shape WithLast(Shape lead, std::int64_t last) {
    lead.push_back(last);
    return lead;
}

std::string Describe(const LinearShape& s) {
    return "x " + ShapeToString(WithLast(s.lead, s.in)) + ", weight [" + std::to_string(s.out) + ", " +
           std::to_string(s.in) + "]";
}

std::int64_t Rows(const LinearShape& s) {
    return Numel(s.lead);
}

/// Random garbage for an output the kernel must overwrite.
Tensor Poison(const Shape& shape, DType dtype) {
    return RandomGpu(shape, dtype, 999, "poison", 100.0);
}

using CudaLinearTest = CudaParamTest<DType>;

TEST_P(CudaLinearTest, ForwardMatchesFloat64WithAndWithoutBias) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        for (const bool with_bias : {false, true}) {
            SCOPED_TRACE(::testing::Message() << Describe(s) << (with_bias ? ", bias" : ", no bias"));
            const std::int64_t m = Rows(s);
            // weight ~ N(0, 1/in) keeps y ~ N(0, 1); the bias ~ N(0, 1) is as large as the product.
            const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 1, "x");
            const Tensor w = RandomGpu({s.out, s.in}, dtype, 1, "w", 1.0 / std::sqrt(static_cast<double>(s.in)));
            const Tensor b = RandomGpu({s.out}, dtype, 1, "b");
            Tensor y = Poison(WithLast(s.lead, s.out), dtype);
            LinearForward(LinearForwardArgs{.x = x, .weight = w, .bias = with_bias ? &b : nullptr, .y = y});
            const Values bv = b.ToDoubleVector();
            const Values ref =
                RefLinearForward(x.ToDoubleVector(), w.ToDoubleVector(), with_bias ? &bv : nullptr, m, s.out, s.in);
            const int roundings = with_bias ? kUnfusedBiasRoundings : 1;
            EXPECT_TRUE(ValuesMatch(y, ref, dtype, roundings));
            EXPECT_GT(AbsSum(ref), 0.0);

            // The allocating wrapper computes the same.
            const Tensor y2 = LinearForward(x, w, with_bias ? &b : nullptr);
            EXPECT_EQ(y2.shape(), y.shape());
            EXPECT_TRUE(ValuesMatch(y2, ref, dtype, roundings));
        }
    }
}

TEST_P(CudaLinearTest, ForwardWithMisalignedPointers) {
    const DType dtype = GetParam();
    // Every operand one element past a 256-byte pool allocation: no 16-byte alignment, so cuBLASLt must be asked for
    // algorithms that allow it (alignment is part of the algorithm cache key).
    for (const LinearShape& s : {LinearShape{{64}, 64, 48}, LinearShape{{7}, 33, 17}}) {
        SCOPED_TRACE(Describe(s));
        const std::int64_t m = Rows(s);
        const Tensor x0 = RandomGpu(WithLast(s.lead, s.in), dtype, 2, "x");
        const Tensor w0 = RandomGpu({s.out, s.in}, dtype, 2, "w", 1.0 / std::sqrt(static_cast<double>(s.in)));
        const Tensor b0 = RandomGpu({s.out}, dtype, 2, "b");
        MisalignedTensor x = MisalignedCopy(x0);
        MisalignedTensor w = MisalignedCopy(w0);
        MisalignedTensor b = MisalignedCopy(b0);
        MisalignedTensor y = MisalignedCopy(Poison(WithLast(s.lead, s.out), dtype));
        LinearForward(LinearForwardArgs{.x = x.view, .weight = w.view, .bias = &b.view, .y = y.view});
        const Values bv = b0.ToDoubleVector();
        const Values ref = RefLinearForward(x0.ToDoubleVector(), w0.ToDoubleVector(), &bv, m, s.out, s.in);
        EXPECT_TRUE(ValuesMatch(y.view, ref, dtype, kUnfusedBiasRoundings));
        // Nothing written before the view.
        EXPECT_EQ(y.backing.ToDoubleVector()[0], 0.0);
    }
}

TEST_P(CudaLinearTest, ForwardGeluSavesThePreActivation) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        for (const bool with_bias : {true, false}) {
            SCOPED_TRACE(::testing::Message() << Describe(s) << (with_bias ? ", bias" : ", no bias"));
            const std::int64_t m = Rows(s);
            const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 3, "x");
            const Tensor w = RandomGpu({s.out, s.in}, dtype, 3, "w", 1.0 / std::sqrt(static_cast<double>(s.in)));
            const Tensor b = RandomGpu({s.out}, dtype, 3, "b");
            Tensor y = Poison(WithLast(s.lead, s.out), dtype);
            Tensor pre = Poison(WithLast(s.lead, s.out), dtype);
            LinearForward(LinearForwardArgs{.x = x,
                                            .weight = w,
                                            .bias = with_bias ? &b : nullptr,
                                            .y = y,
                                            .activation = LinearActivation::kGeluTanh,
                                            .pre_activation = &pre});
            const Values bv = b.ToDoubleVector();
            const Values pre_ref =
                RefLinearForward(x.ToDoubleVector(), w.ToDoubleVector(), with_bias ? &bv : nullptr, m, s.out, s.in);
            Values y_ref(pre_ref.size());
            for (std::size_t i = 0; i < pre_ref.size(); ++i) {
                y_ref[i] = RefGeluTanh(pre_ref[i]);
            }
            EXPECT_TRUE(ValuesMatch(pre, pre_ref, dtype, with_bias ? kUnfusedBiasRoundings : kEpilogueRoundings))
                << "pre-activation";
            EXPECT_TRUE(ValuesMatch(y, y_ref, dtype, kGeluEpilogueRoundings)) << "activation";
        }
    }
}

TEST_P(CudaLinearTest, BackwardInputMatchesFloat64) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        SCOPED_TRACE(Describe(s));
        const std::int64_t m = Rows(s);
        const Tensor dy = RandomGpu(WithLast(s.lead, s.out), dtype, 4, "dy");
        const Tensor w = RandomGpu({s.out, s.in}, dtype, 4, "w");
        Tensor dx = Poison(WithLast(s.lead, s.in), dtype);
        LinearBackwardInput(LinearBackwardInputArgs{.dy = dy, .weight = w, .dx = dx});
        const Values ref = RefLinearBackwardInput(dy.ToDoubleVector(), w.ToDoubleVector(), m, s.out, s.in);
        EXPECT_TRUE(ValuesMatch(dx, ref, dtype));
        const Tensor dx2 = LinearBackwardInput(dy, w);
        EXPECT_EQ(dx2.shape(), dx.shape());
        EXPECT_TRUE(ValuesMatch(dx2, ref, dtype));
    }
}

TEST_P(CudaLinearTest, BackwardWeightMatchesFloat64) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        SCOPED_TRACE(Describe(s));
        const std::int64_t m = Rows(s);
        const Tensor dy = RandomGpu(WithLast(s.lead, s.out), dtype, 5, "dy");
        const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 5, "x");
        Tensor dw = Poison({s.out, s.in}, dtype);
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw});
        const Values ref = RefLinearBackwardWeight(dy.ToDoubleVector(), x.ToDoubleVector(), m, s.out, s.in);
        EXPECT_TRUE(ValuesMatch(dw, ref, dtype));
        const Tensor dw2 = LinearBackwardWeight(dy, x);
        EXPECT_EQ(dw2.shape(), (Shape{s.out, s.in}));
        EXPECT_TRUE(ValuesMatch(dw2, ref, dtype));
    }
}

TEST_P(CudaLinearTest, BackwardWeightWithBiasGrad) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        SCOPED_TRACE(Describe(s));
        const std::int64_t m = Rows(s);
        const Tensor dy = RandomGpu(WithLast(s.lead, s.out), dtype, 6, "dy");
        const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 6, "x");
        Tensor dw = Poison({s.out, s.in}, dtype);
        Tensor db = Poison({s.out}, dtype);
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .dbias = &db});
        const Values dyv = dy.ToDoubleVector();
        // The bias grad may ride in the wgrad GEMM's BGRADB epilogue, which rounds its D and its sum in fp16 kernels.
        EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv, x.ToDoubleVector(), m, s.out, s.in), dtype,
                                kEpilogueRoundings))
            << "dweight";
        EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv, m, s.out), dtype, kEpilogueRoundings))
            << "dbias (BGRADB or a separate sum)";
    }
}

TEST_P(CudaLinearTest, BackwardWeightAccumulatesIntoFloat32MainGrad) {
    const DType dtype = GetParam();
    for (const LinearShape& s : kShapes) {
        SCOPED_TRACE(Describe(s));
        const std::int64_t m = Rows(s);
        const double scale = std::sqrt(static_cast<double>(m)); // the old grads as large as the new ones
        const Tensor dy = RandomGpu(WithLast(s.lead, s.out), dtype, 7, "dy");
        const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 7, "x");
        Tensor main_dw = RandomGpu({s.out, s.in}, DType::kFloat32, 7, "main_dw", scale);
        Tensor main_db = RandomGpu({s.out}, DType::kFloat32, 7, "main_db", scale);
        const Values old_dw = main_dw.ToDoubleVector();
        const Values old_db = main_db.ToDoubleVector();
        const Values dyv = dy.ToDoubleVector();
        const Values new_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), m, s.out, s.in);
        const Values new_db = RefColumnSum(dyv, m, s.out);

        // Twice: main += new, then main += new again (beta = 1 each time, never overwritten).
        for (int step = 1; step <= 2; ++step) {
            SCOPED_TRACE(::testing::Message() << "accumulation step " << step);
            LinearBackwardWeight(
                LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = main_dw, .dbias = &main_db, .accumulate = true});
            Values want_dw(old_dw.size());
            Values want_db(old_db.size());
            for (std::size_t i = 0; i < want_dw.size(); ++i) {
                want_dw[i] = old_dw[i] + step * new_dw[i];
            }
            for (std::size_t i = 0; i < want_db.size(); ++i) {
                want_db[i] = old_db[i] + step * new_db[i];
            }
            // The main grad is float32: products of the inputs are exact in fp32, sums accumulate in fp32.
            EXPECT_TRUE(ValuesMatch(main_dw, want_dw, DType::kFloat32, step)) << "dweight = old + new";
            EXPECT_TRUE(ValuesMatch(main_db, want_db, DType::kFloat32, step)) << "dbias = old + new";
        }
    }
}

TEST_P(CudaLinearTest, BackwardWeightAccumulatesInTheInputDType) {
    const DType dtype = GetParam();
    const LinearShape s{{96}, 40, 24};
    const Tensor dy = RandomGpu(WithLast(s.lead, s.out), dtype, 8, "dy");
    const Tensor x = RandomGpu(WithLast(s.lead, s.in), dtype, 8, "x");
    Tensor dw = RandomGpu({s.out, s.in}, dtype, 8, "old", std::sqrt(96.0));
    const Values old = dw.ToDoubleVector();
    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .accumulate = true});
    Values want = RefLinearBackwardWeight(dy.ToDoubleVector(), x.ToDoubleVector(), 96, s.out, s.in);
    for (std::size_t i = 0; i < want.size(); ++i) {
        want[i] += old[i];
    }
    EXPECT_TRUE(ValuesMatch(dw, want, dtype, kEpilogueRoundings)); // beta = 1
}

struct BiasCase {
    Shape dy;
    const char* path;
};

TEST_P(CudaLinearTest, BackwardBiasMatchesFloat64) {
    const DType dtype = GetParam();
    // N multiple of 8 takes the vectorised path, odd N the scalar one; M = 4096 runs the two-pass reduction.
    const std::vector<BiasCase> cases = {
        {{1, 8}, "vectorised"},    {{7, 1032}, "vectorised"},     {{4096, 1032}, "vectorised"},
        {{4096, 8}, "vectorised"}, {{4, 1024, 24}, "vectorised"}, {{1, 33}, "scalar"},
        {{7, 1}, "scalar"},        {{4096, 1031}, "scalar"},      {{4096, 33}, "scalar"},
    };
    for (const BiasCase& c : cases) {
        const std::int64_t n = c.dy.back();
        const std::int64_t m = Numel(c.dy) / n;
        const Tensor dy = RandomGpu(c.dy, dtype, 9, "dy");
        const Values ref = RefColumnSum(dy.ToDoubleVector(), m, n);
        for (const DType out_dtype : {dtype, DType::kFloat32}) {
            SCOPED_TRACE(::testing::Message()
                         << "dy " << ShapeToString(c.dy) << " (" << c.path << "), dbias " << DTypeName(out_dtype));
            Tensor db = Poison({n}, out_dtype);
            LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db});
            EXPECT_TRUE(ValuesMatch(db, ref, out_dtype));

            Tensor acc = RandomGpu({n}, out_dtype, 9, "old", std::sqrt(static_cast<double>(m)));
            const Values old = acc.ToDoubleVector();
            LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = acc, .accumulate = true});
            Values want(ref.size());
            for (std::size_t i = 0; i < want.size(); ++i) {
                want[i] = old[i] + ref[i];
            }
            EXPECT_TRUE(ValuesMatch(acc, want, out_dtype)) << "accumulate";
        }
        const Tensor db2 = LinearBackwardBias(dy);
        EXPECT_EQ(db2.dtype(), dtype);
        EXPECT_TRUE(ValuesMatch(db2, ref, dtype)) << "allocating wrapper";
    }
}

TEST_P(CudaLinearTest, BackwardBiasWithMisalignedInput) {
    const DType dtype = GetParam();
    // N = 64 would take the vectorised path, but dy starts one element off a 16-byte boundary.
    const Tensor dy0 = RandomGpu({513, 64}, dtype, 10, "dy");
    MisalignedTensor dy = MisalignedCopy(dy0);
    Tensor db = Poison({64}, dtype);
    LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy.view, .dbias = db});
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dy0.ToDoubleVector(), 513, 64), dtype));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaLinearTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
