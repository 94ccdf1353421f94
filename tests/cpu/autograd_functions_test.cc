// Every autograd Function on local Variables: its gradients against float64 central finite differences of
// L = Σ f(inputs) ⊙ r (r random, passed to Backward as dL/dout), then the same gradients in float32 against the
// float64 ones just verified. Inputs are float32-representable so both runs see the same values.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/kernels/linear.h>

#include "gradcheck.h"
#include "helpers.h"
#include "reference.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using testing::CompareValues;
using testing::RandomTensor;
using testing::RelativeTolerance;
using testing::Values;

using gradcheck::Data;
using gradcheck::ExpectGradientsMatch;
using gradcheck::Ids;
using gradcheck::Op;

// ---- Linear ------------------------------------------------------------------------------------------------------

TEST(AutogradLinearTest, GradientsOfInputWeightAndBias) {
    // y[2,3,4] = x[2,3,5]·W[4,5]ᵀ + b[4]
    ExpectGradientsMatch([](const auto &v) { return Linear(v[0], v[1], v[2]); },
                         {Data({2, 3, 5}, "x"), Data({4, 5}, "w"), Data({4}, "b")}, {true, true, true});
}

TEST(AutogradLinearTest, GradientsWithoutBias) {
    ExpectGradientsMatch([](const auto &v) { return Linear(v[0], v[1]); }, {Data({6, 5}, "x"), Data({3, 5}, "w")},
                         {true, true});
}

TEST(AutogradLinearTest, GradientsOfEverySubsetOfInputs) {
    const std::vector<Tensor> in{Data({4, 5}, "x"), Data({3, 5}, "w"), Data({3}, "b")};
    for (int mask = 1; mask < 8; ++mask) {
        SCOPED_TRACE(fmt::format("x {} W {} b {}", mask & 1, (mask >> 1) & 1, (mask >> 2) & 1));
        ExpectGradientsMatch([](const auto &v) { return Linear(v[0], v[1], v[2]); }, in,
                             {(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0});
    }
}

TEST(AutogradLinearTest, BiasLeftOutGetsNoGradient) {
    // skip_bias_add's local form: y = x·Wᵀ (the caller adds b later), so b is not part of this op's value and gets no
    // gradient from it.
    Variable x(Data({4, 5}, "x"), true);
    Variable w(Data({3, 5}, "w"), true);
    Variable b(Data({3}, "b"), true);
    Variable y = Linear(x, w);
    const Tensor want = kernels::LinearForward(x.local(), w.local());
    EXPECT_EQ(y.local().ToDoubleVector(), want.ToDoubleVector());
    y.Backward(nullptr);
    EXPECT_TRUE(w.grad().defined());
    EXPECT_FALSE(b.grad().defined());
}

// ---- GELU, Add, BiasAdd, Scale -------------------------------------------------------------------------------------

TEST(AutogradGeluTest, TanhApproximationGradient) {
    ExpectGradientsMatch([](const auto &v) { return Gelu(v[0], kernels::GeluApproximation::kTanh); },
                         {Data({3, 7}, "x", 2.0)}, {true});
}

TEST(AutogradGeluTest, ErfGradient) {
    ExpectGradientsMatch([](const auto &v) { return Gelu(v[0], kernels::GeluApproximation::kErf); },
                         {Data({3, 7}, "x", 2.0)}, {true});
}

TEST(AutogradAddTest, GradientsWithAlpha) {
    // out = a - 0.5·b: da = dout, db = -0.5·dout.
    ExpectGradientsMatch([](const auto &v) { return Add(v[0], v[1], -0.5); },
                         {Data({2, 3, 4}, "a"), Data({2, 3, 4}, "b")}, {true, true});
}

TEST(AutogradAddTest, OnlyTheOperandThatNeedsAGradientGetsOne) {
    ExpectGradientsMatch([](const auto &v) { return Add(v[0], v[1], 3.0); }, {Data({5}, "a"), Data({5}, "b")},
                         {false, true});
}

TEST(AutogradBiasAddTest, GradientsOfInputAndBias) {
    // out[2,3,4] = x + b[4] broadcast over rows: db = Σ_rows dout.
    ExpectGradientsMatch([](const auto &v) { return BiasAdd(v[0], v[1]); }, {Data({2, 3, 4}, "x"), Data({4}, "b")},
                         {true, true});
}

TEST(AutogradBiasAddTest, BiasOnly) {
    ExpectGradientsMatch([](const auto &v) { return BiasAdd(v[0], v[1]); }, {Data({6, 4}, "x"), Data({4}, "b")},
                         {false, true});
}

TEST(AutogradScaleTest, Gradient) {
    ExpectGradientsMatch([](const auto &v) { return Scale(v[0], 2.5); }, {Data({3, 4}, "x")}, {true});
}

// ---- Sum / Mean
// ------------------------------------------------------------------------------------------------------

struct ReductionCase {
    std::vector<int> dims;
    bool keepdim = false;
    bool mean = false;
};

std::string ReductionName(const ::testing::TestParamInfo<ReductionCase> &info) {
    const ReductionCase &c = info.param;
    std::string dims = c.dims.empty() ? "all" : fmt::format("{}", fmt::join(c.dims, "_"));
    for (char &ch : dims) {
        if (ch == '-') {
            ch = 'm';
        }
    }
    return fmt::format("{}_dims_{}{}", c.mean ? "Mean" : "Sum", dims, c.keepdim ? "_keepdim" : "");
}

class AutogradReductionTest : public ::testing::TestWithParam<ReductionCase> {};

TEST_P(AutogradReductionTest, GradientBroadcastsBackOverTheReducedDims) {
    const ReductionCase c = GetParam();
    ExpectGradientsMatch(
        [c](const auto &v) { return c.mean ? Mean(v[0], c.dims, c.keepdim) : Sum(v[0], c.dims, c.keepdim); },
        {Data({2, 3, 4}, "x")}, {true});
}

INSTANTIATE_TEST_SUITE_P(PrefixAndSuffixDims, AutogradReductionTest,
                         ::testing::Values(ReductionCase{{}, false, false}, ReductionCase{{}, true, true},
                                           ReductionCase{{0}, false, false}, ReductionCase{{0, 1}, true, false},
                                           ReductionCase{{0}, false, true}, ReductionCase{{0, 1}, false, true},
                                           ReductionCase{{2}, false, false}, ReductionCase{{-1}, true, false},
                                           ReductionCase{{1, 2}, false, false}, ReductionCase{{-2, -1}, true, true},
                                           ReductionCase{{2}, false, true}),
                         ReductionName);

TEST(AutogradReductionErrorTest, MiddleDimHasNoBackward) {
    // Σ over dim 1 of [2,3,4] is neither a prefix nor a suffix: the forward runs, the backward says why it cannot.
    Variable x(Data({2, 3, 4}, "x"), true);
    Variable s = Sum(x, {1});
    EXPECT_EQ(s.shape(), (Shape{2, 4}));
    try {
        s.Backward(nullptr);
        FAIL() << "expected ShapeError";
    } catch (const ShapeError &e) {
        EXPECT_NE(std::string(e.what()).find("prefix or a suffix"), std::string::npos) << e.what();
    }
}

// ---- Matmul / Outer ------------------------------------------------------------------------------------------------

TEST(AutogradMatmulTest, SameBatchDims) {
    // [2,3,4]·[2,4,5] -> [2,3,5]
    ExpectGradientsMatch([](const auto &v) { return Matmul(v[0], v[1]); }, {Data({2, 3, 4}, "a"), Data({2, 4, 5}, "b")},
                         {true, true});
}

TEST(AutogradMatmulTest, BroadcastsBothOperandsBatchDims) {
    // [2,1,3,4]·[3,4,5] -> [2,3,3,5]: da sums over b's batch of 3, db over a's batch of 2.
    ExpectGradientsMatch([](const auto &v) { return Matmul(v[0], v[1]); },
                         {Data({2, 1, 3, 4}, "a"), Data({3, 4, 5}, "b")}, {true, true});
}

TEST(AutogradMatmulTest, BroadcastsAMatrixAgainstABatch) {
    // [3,4]·[2,4,5] -> [2,3,5]: da sums over the batch.
    ExpectGradientsMatch([](const auto &v) { return Matmul(v[0], v[1]); }, {Data({3, 4}, "a"), Data({2, 4, 5}, "b")},
                         {true, true});
    // [2,3,4]·[4,5]: db sums over the batch.
    ExpectGradientsMatch([](const auto &v) { return Matmul(v[0], v[1]); }, {Data({2, 3, 4}, "a"), Data({4, 5}, "b")},
                         {false, true});
}

TEST(AutogradOuterTest, Gradients) {
    ExpectGradientsMatch([](const auto &v) { return Outer(v[0], v[1]); }, {Data({4}, "x"), Data({3}, "y")},
                         {true, true});
    ExpectGradientsMatch([](const auto &v) { return Outer(v[0], v[1]); }, {Data({4}, "x"), Data({3}, "y")},
                         {true, false});
}

// ---- Embedding / CrossEntropy ------------------------------------------------------------------------------------

TEST(AutogradEmbeddingTest, RepeatedIdsAccumulateIntoTheirRows) {
    // ids [2,3] with repeats (row 1 three times, rows 0 and 6 unused): dW[v] = Σ_{ids == v} dout.
    ExpectGradientsMatch([](const auto &v) { return Embedding(v[0], v[1]); },
                         {Ids({1, 3, 1, 5, 1, 2}, {2, 3}), Data({7, 4}, "w")}, {false, true});
}

TEST(AutogradEmbeddingTest, UnusedRowsGetZeroGradient) {
    Variable ids(Ids({2, 2, 4}, {3}));
    Variable w(Data({6, 3}, "w"), true);
    Variable out = Embedding(ids, w);
    out.Backward(nullptr);
    const Values g = w.grad().local().ToDoubleVector();
    for (int row = 0; row < 6; ++row) {
        const double want = row == 2 ? 2.0 : row == 4 ? 1.0 : 0.0;
        for (int c = 0; c < 3; ++c) {
            EXPECT_EQ(g[static_cast<std::size_t>(row * 3 + c)], want) << "row " << row;
        }
    }
}

TEST(AutogradEmbeddingBagTest, GradientSumsEachBagsDoutIntoTheRowsOfItsIds) {
    // ids [3, 4]: bags of 3 along dim 0, row 1 in several bags and twice in one, rows 0 and 6 unused:
    // dW[v] = Σ_{(t, n) : ids[t, n] == v} dout[n].
    ExpectGradientsMatch([](const auto &v) { return EmbeddingBag(v[0], v[1]); },
                         {Ids({1, 3, 1, 5, 1, 2, 4, 1, 5, 1, 3, 2}, {3, 4}), Data({7, 5}, "w")}, {false, true});
}

TEST(AutogradEmbeddingBagTest, EqualsTheSumOverDimZeroOfTheLookup) {
    // The fused op against the composition it replaces (float64: the same sums in the same order on the CPU).
    const Tensor ids = Ids({0, 2, 4, 4, 1, 0, 3, 3, 2, 4, 0, 1}, {3, 2, 2});
    const Tensor w = Data({5, 3}, "w");
    const Tensor r = Data({2, 2, 3}, "dout");
    const DistTensor dout = DistTensor::Local(r);
    Variable fused_w(w.Clone(), true);
    Variable fused = EmbeddingBag(Variable(ids), fused_w);
    fused.Backward(&dout);
    Variable composed_w(w.Clone(), true);
    Variable composed = Sum(Embedding(Variable(ids), composed_w), {0});
    composed.Backward(&dout);
    EXPECT_EQ(fused.shape(), (Shape{2, 2, 3}));
    EXPECT_EQ(fused.local().ToDoubleVector(), composed.local().ToDoubleVector());
    EXPECT_EQ(fused_w.grad().local().ToDoubleVector(), composed_w.grad().local().ToDoubleVector());
}

TEST(AutogradEmbeddingBagTest, AFrozenTableRecordsNoGraph) {
    Variable out = EmbeddingBag(Variable(Ids({0, 1, 2, 1}, {2, 2})), Variable(Data({3, 4}, "w")));
    EXPECT_EQ(out.shape(), (Shape{2, 4}));
    EXPECT_FALSE(out.requires_grad());
    EXPECT_EQ(out.grad_fn(), nullptr);
}

class AutogradCrossEntropyTest : public ::testing::TestWithParam<dist::LossReduction> {};

TEST_P(AutogradCrossEntropyTest, LogitsGradient) {
    // logits [2,3,5], labels [2,3]; the loss is [2,3] (none) or a scalar (mean: ÷ 6 rows, sum).
    const dist::LossReduction reduction = GetParam();
    ExpectGradientsMatch([reduction](const auto &v) { return CrossEntropy(v[0], v[1], {.reduction = reduction}); },
                         {Data({2, 3, 5}, "logits", 2.0), Ids({0, 4, 2, 2, 1, 3}, {2, 3})}, {true, false});
}

INSTANTIATE_TEST_SUITE_P(Reductions, AutogradCrossEntropyTest,
                         ::testing::Values(dist::LossReduction::kMean, dist::LossReduction::kSum,
                                           dist::LossReduction::kNone),
                         [](const auto &info) {
                             switch (info.param) {
                             case dist::LossReduction::kMean:
                                 return std::string("Mean");
                             case dist::LossReduction::kSum:
                                 return std::string("Sum");
                             case dist::LossReduction::kNone:
                                 return std::string("None");
                             }
                             return std::string("Unknown");
                         });

TEST(AutogradCrossEntropyValueTest, MeanLossAndGradientMatchTheFormula) {
    // loss = mean_i (logsumexp(z_i) - z_i[y_i]); dz = (softmax(z) - onehot(y)) / N, in float64 by hand.
    const Tensor z = Data({4, 3}, "z", 1.5);
    const std::vector<double> labels{2, 0, 1, 2};
    Variable logits(z.To(DType::kFloat32), true);
    Variable loss = CrossEntropy(logits, Variable(Ids(labels, {4})));
    EXPECT_EQ(loss.shape(), Shape{});
    loss.Backward(nullptr);
    const Values zv = z.ToDoubleVector();
    double want_loss = 0.0;
    Values want_grad(zv.size());
    for (int i = 0; i < 4; ++i) {
        double m = zv[static_cast<std::size_t>(i * 3)];
        for (int c = 1; c < 3; ++c) {
            m = std::max(m, zv[static_cast<std::size_t>(i * 3 + c)]);
        }
        double s = 0.0;
        for (int c = 0; c < 3; ++c) {
            s += std::exp(zv[static_cast<std::size_t>(i * 3 + c)] - m);
        }
        const int y = static_cast<int>(labels[static_cast<std::size_t>(i)]);
        want_loss += (std::log(s) + m - zv[static_cast<std::size_t>(i * 3 + y)]) / 4.0;
        for (int c = 0; c < 3; ++c) {
            const double p = std::exp(zv[static_cast<std::size_t>(i * 3 + c)] - m) / s;
            want_grad[static_cast<std::size_t>(i * 3 + c)] = (p - (c == y ? 1.0 : 0.0)) / 4.0;
        }
    }
    EXPECT_TRUE(testing::ValuesMatch(loss.local(), {want_loss}, DType::kFloat32));
    EXPECT_TRUE(testing::ValuesMatch(logits.grad().local(), want_grad, DType::kFloat32));
}

// ---- Redistribute --------------------------------------------------------------------------------------------------

TEST(AutogradRedistributeTest, LocalIdentityPassesTheGradientThrough) {
    ExpectGradientsMatch([](const auto &v) { return Redistribute(v[0], spmd::Layout::Replicated(2)); },
                         {Data({3, 4}, "x")}, {true});
}

} // namespace
} // namespace shardline::autograd
