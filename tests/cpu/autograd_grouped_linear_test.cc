// autograd::GroupedLinear (mixture-of-experts experts) on local Variables: the float64 gradient check of x, W and b
// (every subset, with and without bias, empty and one-row experts), the graph is not cut (a loss that uses only the
// grouped output gives x, W and b their gradients, also through two grouped layers), grad_fn exactly when an input
// requires grad, strided inputs get correct gradients, and needs_input_grad decides which backward kernels run
// (observed through a counting provider).

#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/grouped_linear.h>
#include <shardline/kernels/ops.h>

#include "gradcheck.h"
#include "helpers.h"

namespace shardline::autograd {
namespace {

using gradcheck::Data;
using gradcheck::ExpectGradientsMatch;
using testing::Values;

/// 4 experts over 8 rows: uneven, one empty and one single-row expert.
Tensor Sizes() { return Tensor::FromVector({3, 0, 1, 4}, Shape{4}, DType::kInt64); }

TEST(AutogradGroupedLinearTest, GradientsOfInputWeightAndBias) {
    // y[8,3] = x[8,5]·W_eᵀ + b_e per expert, W [4,3,5], b [4,3]
    const Tensor sizes = Sizes();
    ExpectGradientsMatch([&](const auto &v) { return GroupedLinear(v[0], v[1], v[2], sizes); },
                         {Data({8, 5}, "x"), Data({4, 3, 5}, "w"), Data({4, 3}, "b")}, {true, true, true});
}

TEST(AutogradGroupedLinearTest, GradientsWithoutBias) {
    const Tensor sizes = Sizes();
    ExpectGradientsMatch([&](const auto &v) { return GroupedLinear(v[0], v[1], Variable(), sizes); },
                         {Data({8, 5}, "x"), Data({4, 3, 5}, "w")}, {true, true});
}

TEST(AutogradGroupedLinearTest, GradientsOfEverySubsetOfInputs) {
    const Tensor sizes = Sizes();
    const std::vector<Tensor> in{Data({8, 5}, "x"), Data({4, 3, 5}, "w"), Data({4, 3}, "b")};
    for (int mask = 1; mask < 8; ++mask) {
        SCOPED_TRACE(fmt::format("x {} W {} b {}", mask & 1, (mask >> 1) & 1, (mask >> 2) & 1));
        ExpectGradientsMatch([&](const auto &v) { return GroupedLinear(v[0], v[1], v[2], sizes); }, in,
                             {(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0});
    }
}

TEST(AutogradGroupedLinearTest, OneExpertIsALinear) {
    const Tensor sizes = Tensor::FromVector({6}, Shape{1}, DType::kInt64);
    ExpectGradientsMatch([&](const auto &v) { return GroupedLinear(v[0], v[1], v[2], sizes); },
                         {Data({6, 5}, "x"), Data({1, 3, 5}, "w"), Data({1, 3}, "b")}, {true, true, true});
}

TEST(AutogradGroupedLinearTest, GraphIsNotCut) {
    // L = Σ y with y the grouped output only: dL/dy = 1, so db_e = rows_e per entry, dW_e[o, :] = Σ_rows x_e and
    // dx[r, :] = Σ_o W_e(r)[o, :]. A cut graph leaves the leaves without grads.
    const Tensor sizes = Sizes();
    Variable x(Data({8, 5}, "x"), true);
    Variable w(Data({4, 3, 5}, "w"), true);
    Variable b(Data({4, 3}, "b"), true);
    Variable loss = Sum(GroupedLinear(x, w, b, sizes));
    ASSERT_NE(loss.grad_fn(), nullptr);
    loss.Backward(nullptr);
    ASSERT_TRUE(x.grad().defined());
    ASSERT_TRUE(w.grad().defined());
    ASSERT_TRUE(b.grad().defined());
    const std::vector<std::int64_t> rows = {3, 0, 1, 4};
    const Values xv = x.local().ToDoubleVector();
    const Values wv = w.local().ToDoubleVector();
    const Values dx = x.grad().local().ToDoubleVector();
    const Values dw = w.grad().local().ToDoubleVector();
    const Values db = b.grad().local().ToDoubleVector();
    std::int64_t first = 0;
    for (std::size_t e = 0; e < rows.size(); ++e) {
        for (std::int64_t o = 0; o < 3; ++o) {
            EXPECT_EQ(db[e * 3 + static_cast<std::size_t>(o)], static_cast<double>(rows[e])) << "expert " << e;
            for (std::int64_t i = 0; i < 5; ++i) {
                double want = 0.0;
                for (std::int64_t r = first; r < first + rows[e]; ++r) {
                    want += xv[static_cast<std::size_t>(r * 5 + i)];
                }
                EXPECT_NEAR(dw[(e * 3 + static_cast<std::size_t>(o)) * 5 + static_cast<std::size_t>(i)], want, 1e-12);
            }
        }
        for (std::int64_t r = first; r < first + rows[e]; ++r) {
            for (std::int64_t i = 0; i < 5; ++i) {
                double want = 0.0;
                for (std::int64_t o = 0; o < 3; ++o) {
                    want += wv[(e * 3 + static_cast<std::size_t>(o)) * 5 + static_cast<std::size_t>(i)];
                }
                EXPECT_NEAR(dx[static_cast<std::size_t>(r * 5 + i)], want, 1e-12);
            }
        }
        first += rows[e];
    }
}

TEST(AutogradGroupedLinearTest, GradientsFlowThroughTwoGroupedLayers) {
    // An expert MLP: x → grouped fc1 → GELU → grouped fc2. x and both weights get their gradients (checked against
    // finite differences).
    const Tensor sizes = Sizes();
    ExpectGradientsMatch(
        [&](const auto &v) {
            return GroupedLinear(Gelu(GroupedLinear(v[0], v[1], Variable(), sizes)), v[2], Variable(), sizes);
        },
        {Data({8, 5}, "x"), Data({4, 6, 5}, "w1"), Data({4, 3, 6}, "w2")}, {true, true, true});
}

// GeluGroupedLinear(z, W, b) = GroupedLinear(Gelu(z), W, b) with the GELU's gradient in the dgrad's epilogue: the
// gradient check of every subset of its inputs, and bit for bit the separate GELU node's values (the CPU runs the same
// GEMMs and the same double-precision gelu').
TEST(AutogradGroupedLinearTest, GeluGroupedLinearGradientsOfEverySubsetOfInputs) {
    const Tensor sizes = Sizes();
    const std::vector<Tensor> in{Data({8, 5}, "z"), Data({4, 3, 5}, "w"), Data({4, 3}, "b")};
    for (int mask = 1; mask < 8; ++mask) {
        SCOPED_TRACE(fmt::format("z {} W {} b {}", mask & 1, (mask >> 1) & 1, (mask >> 2) & 1));
        ExpectGradientsMatch([&](const auto &v) { return GeluGroupedLinear(v[0], v[1], v[2], sizes); }, in,
                             {(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0});
    }
}

TEST(AutogradGroupedLinearTest, GeluGroupedLinearIsTheGeluNodeBitForBit) {
    const Tensor sizes = Sizes();
    for (const DType dtype : {DType::kFloat32, DType::kFloat64}) {
        SCOPED_TRACE(DTypeName(dtype));
        const Tensor z = Data({8, 5}, "z", 1.5).To(dtype), w = Data({4, 3, 5}, "w").To(dtype);
        const Tensor b = Data({4, 3}, "b").To(dtype), dy = Data({8, 3}, "dy").To(dtype);
        std::vector<std::vector<Values>> runs;
        for (const bool fused : {true, false}) {
            Variable vz(z.Clone(), true), vw(w.Clone(), true), vb(b.Clone(), true);
            const Variable y = fused ? GeluGroupedLinear(vz, vw, vb, sizes) : GroupedLinear(Gelu(vz), vw, vb, sizes);
            EXPECT_EQ(y.grad_fn()->name(), fused ? "GeluGroupedLinearBackward" : "GroupedLinearBackward");
            const dist::DistTensor g = dist::DistTensor::Local(dy);
            y.Backward(&g);
            runs.push_back({y.local().ToDoubleVector(), vz.grad().local().ToDoubleVector(),
                            vw.grad().local().ToDoubleVector(), vb.grad().local().ToDoubleVector()});
        }
        EXPECT_EQ(runs[0], runs[1]) << "y, dz, dW, db";
    }
}

TEST(AutogradGroupedLinearTest, OutputHasAGradFnExactlyWhenAnInputRequiresGrad) {
    const Tensor sizes = Sizes();
    const Variable frozen =
        GroupedLinear(Variable(Data({8, 5}, "x")), Variable(Data({4, 3, 5}, "w")), Variable(Data({4, 3}, "b")), sizes);
    EXPECT_FALSE(frozen.requires_grad());
    EXPECT_EQ(frozen.grad_fn(), nullptr);
    for (int which = 0; which < 3; ++which) {
        const Variable y =
            GroupedLinear(Variable(Data({8, 5}, "x"), which == 0), Variable(Data({4, 3, 5}, "w"), which == 1),
                          Variable(Data({4, 3}, "b"), which == 2), sizes);
        EXPECT_TRUE(y.requires_grad()) << "input " << which;
        ASSERT_NE(y.grad_fn(), nullptr) << "input " << which;
        EXPECT_EQ(y.grad_fn()->name(), "GroupedLinearBackward");
    }
}

TEST(AutogradGroupedLinearTest, StridedInputsGetTheContiguousInputsGradients) {
    const Tensor sizes = Sizes();
    const Tensor xt = Data({5, 8}, "xt");    // x = xtᵀ, a strided view
    const Tensor wt = Data({4, 5, 3}, "wt"); // W = wt with its last two dims swapped
    Variable x_view(xt.Transpose(0, 1), true);
    Variable w_view(wt.Transpose(1, 2), true);
    Variable x_dense(xt.Transpose(0, 1).Contiguous(), true);
    Variable w_dense(wt.Transpose(1, 2).Contiguous(), true);
    const Variable y_view = GroupedLinear(x_view, w_view, Variable(), sizes);
    const Variable y_dense = GroupedLinear(x_dense, w_dense, Variable(), sizes);
    EXPECT_EQ(y_view.local().ToDoubleVector(), y_dense.local().ToDoubleVector());
    Sum(y_view).Backward(nullptr);
    Sum(y_dense).Backward(nullptr);
    ASSERT_TRUE(x_view.grad().defined() && w_view.grad().defined());
    EXPECT_EQ(x_view.grad().global_shape(), (Shape{8, 5}));
    EXPECT_EQ(w_view.grad().global_shape(), (Shape{4, 3, 5}));
    EXPECT_EQ(x_view.grad().local().ToDoubleVector(), x_dense.grad().local().ToDoubleVector());
    EXPECT_EQ(w_view.grad().local().ToDoubleVector(), w_dense.grad().local().ToDoubleVector());
}

TEST(AutogradGroupedLinearTest, MissingGroupSizesIsAClearError) {
    const std::string message = testing::MessageOf<Error>(
        [] { GroupedLinear(Variable(Data({8, 5}, "x"), true), Variable(Data({4, 3, 5}, "w")), Variable(), Tensor()); });
    EXPECT_NE(message.find("autograd::GroupedLinear: the group sizes (int64 [experts]) must be given"),
              std::string::npos)
        << message;
}

// ---- needs_input_grad decides which backward kernels run ----------------------------------------------------------

constexpr std::string_view kCounting = "grouped-counting";

struct GroupedCalls {
    int input = 0;
    int weight = 0;
    int weight_with_bias = 0;
    int bias = 0;
};
GroupedCalls g_calls;
kernels::GroupedLinearBackwardInputOp::Fn g_input = nullptr;
kernels::GroupedLinearBackwardWeightOp::Fn g_weight = nullptr;
kernels::GroupedLinearBackwardBiasOp::Fn g_bias = nullptr;

void CountingInput(const kernels::GroupedLinearBackwardInputArgs &args) {
    ++g_calls.input;
    g_input(args);
}
void CountingWeight(const kernels::GroupedLinearBackwardWeightArgs &args) {
    ++g_calls.weight;
    g_calls.weight_with_bias += args.dbias != nullptr ? 1 : 0;
    g_weight(args);
}
void CountingBias(const kernels::GroupedLinearBackwardBiasArgs &args) {
    ++g_calls.bias;
    g_bias(args);
}

class GroupedBackwardKernelsTest : public ::testing::TestWithParam<int /*mask of x, W, b requiring grad*/> {
protected:
    void SetUp() override {
        kernels::ResetProviderSelection();
        g_input = kernels::OpTable<kernels::GroupedLinearBackwardInputOp>::Resolve(DeviceType::kCPU).fn;
        g_weight = kernels::OpTable<kernels::GroupedLinearBackwardWeightOp>::Resolve(DeviceType::kCPU).fn;
        g_bias = kernels::OpTable<kernels::GroupedLinearBackwardBiasOp>::Resolve(DeviceType::kCPU).fn;
        kernels::Register<kernels::GroupedLinearBackwardInputOp>(DeviceType::kCPU, kCounting, &CountingInput);
        kernels::Register<kernels::GroupedLinearBackwardWeightOp>(DeviceType::kCPU, kCounting, &CountingWeight);
        kernels::Register<kernels::GroupedLinearBackwardBiasOp>(DeviceType::kCPU, kCounting, &CountingBias);
        kernels::SetProvider(kCounting);
        g_calls = {};
    }
    void TearDown() override {
        kernels::UnregisterProviderEverywhere(kCounting);
        kernels::ResetProviderSelection();
    }
};

TEST_P(GroupedBackwardKernelsTest, OnlyTheNeededKernelsRun) {
    const int mask = GetParam();
    const bool need_x = (mask & 1) != 0, need_w = (mask & 2) != 0, need_b = (mask & 4) != 0;
    Variable x(Data({8, 5}, "x"), need_x);
    Variable w(Data({4, 3, 5}, "w"), need_w);
    Variable b(Data({4, 3}, "b"), need_b);
    Sum(GroupedLinear(x, w, b, Sizes())).Backward(nullptr);
    EXPECT_EQ(g_calls.input, need_x ? 1 : 0) << "dx: frozen inputs skip the dgrad";
    EXPECT_EQ(g_calls.weight, need_w ? 1 : 0) << "dW: frozen experts skip the wgrad";
    EXPECT_EQ(g_calls.weight_with_bias, need_w && need_b ? 1 : 0) << "db rides with dW";
    // The bias grad alone (without dW) runs its own kernel; with dW it is computed inside the wgrad op.
    EXPECT_EQ(g_calls.bias, need_b ? 1 : 0);
    EXPECT_EQ(x.grad().defined(), need_x);
    EXPECT_EQ(w.grad().defined(), need_w);
    EXPECT_EQ(b.grad().defined(), need_b);
}

INSTANTIATE_TEST_SUITE_P(Masks, GroupedBackwardKernelsTest, ::testing::Range(1, 8),
                         [](const ::testing::TestParamInfo<int> &info) {
                             return fmt::format("x{}_w{}_b{}", info.param & 1, (info.param >> 1) & 1,
                                                (info.param >> 2) & 1);
                         });

} // namespace
} // namespace shardline::autograd
