// Expert tensor parallelism (issue 15): a grouped expert MLP, ColumnParallelGroupedLinear → RowParallelGroupedLinear
// over E experts with uneven routing (an empty and a one-row expert), against a single-rank dense float64 reference
// computed expert by expert — bitwise with integer-valued operands — with the exact collectives of every phase (the
// column → row pair's: one all-reduce forward, one of dX backward only when x needs a grad). Also: the parallel
// experts' global parameters are the local GroupedLinear's (TP-invariant counter-based init), a group of one rank
// (kNoTensorParallel: whole experts, no collective), and grouped layers refuse sequence parallelism before any
// collective.

#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/nn/linear.h>

#include "nn_test_util.h"

namespace shardline {
namespace {

using namespace nn_test;

constexpr std::int64_t kExperts = 4;
/// 16 routed rows: uneven, one expert empty and one with a single row.
const std::vector<std::int64_t> kGroupRows = {5, 0, 1, 10};

Tensor GroupSizes() {
    return Tensor::FromVector(std::vector<double>(kGroupRows.begin(), kGroupRows.end()), Shape{kExperts},
                              DType::kInt64);
}

/// Rows [first, first + count) of a row-major [rows, cols] matrix, and expert e's block of a per-expert tensor.
Values Slice(const Values &v, std::int64_t first, std::int64_t count, std::int64_t cols) {
    return Values(v.begin() + first * cols, v.begin() + (first + count) * cols);
}

void Append(Values &to, const Values &from) { to.insert(to.end(), from.begin(), from.end()); }

/// The dense grouped MLP in float64: per expert e, RefMlp on its rows with its parameters.
testing::RefMlpResult ReferenceGroupedMlp(const Tensor &x, const Tensor &w1, const Tensor *b1, const Tensor &w2,
                                          const Tensor *b2, const Tensor &dy, bool gelu = false) {
    const Values xv = x.ToDoubleVector(), w1v = w1.ToDoubleVector(), w2v = w2.ToDoubleVector();
    const Values dyv = dy.ToDoubleVector();
    const Values b1v = b1 != nullptr ? b1->ToDoubleVector() : Values(kExperts * kFfn, 0.0);
    const Values b2v = b2 != nullptr ? b2->ToDoubleVector() : Values(kExperts * kHidden, 0.0);
    testing::RefMlpResult all;
    std::int64_t first = 0;
    for (std::int64_t e = 0; e < kExperts; ++e) {
        const std::int64_t m = kGroupRows[static_cast<std::size_t>(e)];
        const Values eb1 = Slice(b1v, e, 1, kFfn);
        const Values eb2 = Slice(b2v, e, 1, kHidden);
        const testing::RefMlpResult r = testing::RefMlp(Slice(xv, first, m, kHidden), Slice(w1v, e, 1, kFfn * kHidden),
                                                        &eb1, Slice(w2v, e, 1, kHidden * kFfn), &eb2,
                                                        Slice(dyv, first, m, kHidden), m, kHidden, kFfn, gelu);
        Append(all.y, r.y);
        Append(all.dx, r.dx);
        // An expert without rows has zero parameter gradients.
        Append(all.dw1, m > 0 ? r.dw1 : Values(kFfn * kHidden, 0.0));
        Append(all.db1, m > 0 ? r.db1 : Values(kFfn, 0.0));
        Append(all.dw2, m > 0 ? r.dw2 : Values(kHidden * kFfn, 0.0));
        Append(all.db2, m > 0 ? r.db2 : Values(kHidden, 0.0));
        first += m;
    }
    return all;
}

struct GroupedCase {
    bool bias = true;
    bool input_grad = true;
};

std::string GroupedCaseName(const ::testing::TestParamInfo<GroupedCase> &info) {
    return fmt::format("{}_{}", info.param.bias ? "bias" : "nobias", info.param.input_grad ? "xgrad" : "noxgrad");
}

class GroupedMlpTest : public ::testing::TestWithParam<GroupedCase> {};

// column → row over experts: forward one all-reduce (the row layer's y, then each expert's bias once); backward one
// all-reduce of dX only when x requires grad, none for the parameters (they stay sharded on tp).
TEST_P(GroupedMlpTest, ExpertTensorParallelMatchesDenseBitwiseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const GroupedCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    nn::ColumnParallelGroupedLinear column(
        {.in_features = kHidden, .out_features = kFfn, .bias = c.bias, .num_experts = kExperts}, Tp(mesh),
        WithName(Param(DType::kFloat32), "experts.fc1"));
    nn::RowParallelGroupedLinear row({.in_features = kFfn,
                                      .out_features = kHidden,
                                      .bias = c.bias,
                                      .input_is_parallel = true,
                                      .num_experts = kExperts},
                                     Tp(mesh), WithName(Param(DType::kFloat32), "experts.fc2"));
    const Data data = Data::kInteger;
    const DType f32 = DType::kFloat32;
    const Tensor x_full = MakeFull({kRows, kHidden}, "x", data, f32, 17);
    const Tensor w1 = MakeFull({kExperts, kFfn, kHidden}, "w1", data, f32, 17);
    const Tensor b1 = MakeFull({kExperts, kFfn}, "b1", data, f32, 17);
    const Tensor w2 = MakeFull({kExperts, kHidden, kFfn}, "w2", data, f32, 17);
    const Tensor b2 = MakeFull({kExperts, kHidden}, "b2", data, f32, 17);
    const Tensor dy_full = MakeFull({kRows, kHidden}, "dy", data, f32, 17);
    SetFull(column.weight, w1);
    SetFull(row.weight, w2);
    if (c.bias) {
        SetFull(column.bias, b1);
        SetFull(row.bias, b2);
    }
    const Tensor sizes = GroupSizes();
    Variable x(DistTensor::FromFull(x_full, spmd::Layout::Replicated(2), mesh), c.input_grad);

    ResetCounts(mesh);
    const nn::LinearOutput hidden = column.Forward(x, sizes);
    EXPECT_TRUE(SameLayout(mesh, hidden.output.value().layout(), LayoutOf(2, {{1, {0}}})))
        << "the column experts' output is sharded on its features over tp";
    Variable y = row.Forward(hidden.output, sizes).output;
    ExpectCalls(mesh, {{"tp", Planned(tp, Calls{.all_reduce = 1})}}, "forward");

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {{"tp", Planned(tp, Calls{.all_reduce = c.input_grad ? 1 : 0})}}, "backward");

    const testing::RefMlpResult ref =
        ReferenceGroupedMlp(x_full, w1, c.bias ? &b1 : nullptr, w2, c.bias ? &b2 : nullptr, dy_full);
    EXPECT_TRUE(Matches(y.value().FullTensor(), {kRows, kHidden}, ref.y, data, f32)) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(FullGrad(x), {kRows, kHidden}, ref.dx, data, f32)) << "dX";
    } else {
        EXPECT_FALSE(x.grad().defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(FullGrad(column.weight), {kExperts, kFfn, kHidden}, ref.dw1, data, f32)) << "column dW";
    EXPECT_TRUE(Matches(FullGrad(row.weight), {kExperts, kHidden, kFfn}, ref.dw2, data, f32)) << "row dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(FullGrad(column.bias), {kExperts, kFfn}, ref.db1, data, f32)) << "column db";
        EXPECT_TRUE(Matches(FullGrad(row.bias), {kExperts, kHidden}, ref.db2, data, f32)) << "row db";
    }
}

INSTANTIATE_TEST_SUITE_P(Matrix, GroupedMlpTest,
                         ::testing::Values(GroupedCase{true, true}, GroupedCase{true, false}, GroupedCase{false, true}),
                         GroupedCaseName);

// A group of one rank (TensorParallelGroup::kNoTensorParallel, a MoE layer's whole experts at etp 1): the same column
// → row pair with its parameters whole on every rank runs no collective in either direction, and the parameter
// gradients are Partial only over the mesh dims that shard x's rows — none here, so they come out whole and exact.
TEST(GroupedMlpNoTensorParallelTest, AGroupOfOneRankRunsWholeExpertsWithoutCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const functional::TensorParallelGroup one{.mesh = &mesh,
                                              .tp_dim = functional::TensorParallelGroup::kNoTensorParallel};
    EXPECT_EQ(one.size(), 1);
    EXPECT_EQ(one.rank(), 0);
    const Data data = Data::kInteger;
    const DType f32 = DType::kFloat32;
    const Tensor x_full = MakeFull({kRows, kHidden}, "x", data, f32, 17);
    const Tensor w1 = MakeFull({kExperts, kFfn, kHidden}, "w1", data, f32, 17);
    const Tensor b1 = MakeFull({kExperts, kFfn}, "b1", data, f32, 17);
    const Tensor w2 = MakeFull({kExperts, kHidden, kFfn}, "w2", data, f32, 17);
    const Tensor b2 = MakeFull({kExperts, kHidden}, "b2", data, f32, 17);
    const Tensor dy_full = MakeFull({kRows, kHidden}, "dy", data, f32, 17);
    const auto whole = [&](const Tensor &full) {
        return Variable(DistTensor::FromFull(full, spmd::Layout::Replicated(full.rank()), mesh), true);
    };
    const Variable w1v = whole(w1), b1v = whole(b1), w2v = whole(w2), b2v = whole(b2);
    const Variable x = whole(x_full);
    const Tensor sizes = GroupSizes();

    ResetCounts(mesh);
    const Variable hidden = autograd::ColumnParallelGroupedLinear(
        x, w1v, b1v, sizes, {.in_features = kHidden, .out_features = kFfn, .num_experts = kExperts}, one);
    const Variable y = autograd::RowParallelGroupedLinear(
        hidden, w2v, b2v, sizes,
        {.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true, .num_experts = kExperts}, one);
    ExpectCalls(mesh, {}, "forward");
    EXPECT_EQ(hidden.local().shape(), (Shape{kRows, kFfn})) << "every rank computes all of ffn";
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {}, "backward");

    const testing::RefMlpResult ref = ReferenceGroupedMlp(x_full, w1, &b1, w2, &b2, dy_full);
    EXPECT_TRUE(Matches(y.value().FullTensor(), {kRows, kHidden}, ref.y, data, f32)) << "y";
    EXPECT_TRUE(Matches(FullGrad(x), {kRows, kHidden}, ref.dx, data, f32)) << "dX";
    for (const Variable *p : {&w1v, &b1v, &w2v, &b2v}) {
        EXPECT_FALSE(p->grad().layout().IsPartial()) << "x's rows are on every rank: nothing to reduce";
    }
    EXPECT_TRUE(Matches(FullGrad(w1v), {kExperts, kFfn, kHidden}, ref.dw1, data, f32)) << "column dW";
    EXPECT_TRUE(Matches(FullGrad(b1v), {kExperts, kFfn}, ref.db1, data, f32)) << "column db";
    EXPECT_TRUE(Matches(FullGrad(w2v), {kExperts, kHidden, kFfn}, ref.dw2, data, f32)) << "row dW";
    EXPECT_TRUE(Matches(FullGrad(b2v), {kExperts, kHidden}, ref.db2, data, f32)) << "row db";
}

// The tanh GELU between the grouped layers as one Function with fc2 (autograd::GeluRowParallelGroupedLinear: the
// dGELU in fc2's grouped dgrad epilogue, no GELU node): on random data the output and every wanted gradient equal the
// separate GELU node's (bit for bit on the CPU, where the same kernels run; fp32 on CUDA takes cuBLASLt's DGELU per
// expert) and the float64 reference; only the wanted gradients come out, with some inputs not requiring one.
struct GeluFusionCase {
    bool x_grad = true;
    bool fc1_grad = true; ///< fc1's weight and bias
    bool fc2_weight_grad = true;
    std::string name;
};
void PrintTo(const GeluFusionCase &c, std::ostream *os) { *os << c.name; }

class GroupedMlpGeluFusionTest : public ::testing::TestWithParam<GeluFusionCase> {};

TEST_P(GroupedMlpGeluFusionTest, FusedDGeluEqualsTheGeluNodeAndTheReference) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const GeluFusionCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const Data data = Data::kRandom;
    const DType f32 = DType::kFloat32;
    const Tensor x_full = MakeFull({kRows, kHidden}, "x", data, f32, 19);
    const Tensor w1 = MakeFull({kExperts, kFfn, kHidden}, "w1", data, f32, 19);
    const Tensor b1 = MakeFull({kExperts, kFfn}, "b1", data, f32, 19);
    const Tensor w2 = MakeFull({kExperts, kHidden, kFfn}, "w2", data, f32, 19);
    const Tensor b2 = MakeFull({kExperts, kHidden}, "b2", data, f32, 19);
    const Tensor dy_full = MakeFull({kRows, kHidden}, "dy", data, f32, 19);
    const Tensor sizes = GroupSizes();
    struct Run {
        Tensor y, dx, dw1, db1, dw2, db2;
    };
    auto run = [&](bool fused) {
        nn::ColumnParallelGroupedLinear column({.in_features = kHidden, .out_features = kFfn, .num_experts = kExperts},
                                               Tp(mesh), WithName(Param(f32), "experts.fc1"));
        nn::RowParallelGroupedLinear row(
            {.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true, .num_experts = kExperts},
            Tp(mesh), WithName(Param(f32), "experts.fc2"));
        SetFull(column.weight, w1);
        SetFull(column.bias, b1);
        SetFull(row.weight, w2);
        SetFull(row.bias, b2);
        column.weight.set_requires_grad(c.fc1_grad);
        column.bias.set_requires_grad(c.fc1_grad);
        row.weight.set_requires_grad(c.fc2_weight_grad);
        Variable x(DistTensor::FromFull(x_full, spmd::Layout::Replicated(2), mesh), c.x_grad);
        const Variable pre = column.Forward(x, sizes).output;
        const Variable y =
            fused ? autograd::GeluRowParallelGroupedLinear(pre, row.weight, row.bias, sizes, row.options(), Tp(mesh))
                  : row.Forward(autograd::Gelu(pre), sizes).output;
        const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
        y.Backward(&dy);
        return Run{.y = y.value().FullTensor(),
                   .dx = FullGrad(x),
                   .dw1 = FullGrad(column.weight),
                   .db1 = FullGrad(column.bias),
                   .dw2 = FullGrad(row.weight),
                   .db2 = FullGrad(row.bias)};
    };
    const Run fused = run(true);
    const Run unfused = run(false);
    const testing::RefMlpResult ref = ReferenceGroupedMlp(x_full, w1, &b1, w2, &b2, dy_full, /*gelu=*/true);
    const bool cpu = TestDevice().is_cpu();
    const std::vector<std::tuple<const char *, Tensor, Tensor, Values, bool>> outputs = {
        {"y", fused.y, unfused.y, ref.y, true},
        {"dX", fused.dx, unfused.dx, ref.dx, c.x_grad},
        {"fc1 dW", fused.dw1, unfused.dw1, ref.dw1, c.fc1_grad},
        {"fc1 db", fused.db1, unfused.db1, ref.db1, c.fc1_grad},
        {"fc2 dW", fused.dw2, unfused.dw2, ref.dw2, c.fc2_weight_grad},
        {"fc2 db", fused.db2, unfused.db2, ref.db2, true}};
    for (const auto &[what, got, want, reference, wanted] : outputs) {
        SCOPED_TRACE(what);
        ASSERT_EQ(got.defined(), wanted) << "only the wanted gradients";
        ASSERT_EQ(want.defined(), wanted);
        if (!wanted) {
            continue;
        }
        if (cpu) {
            EXPECT_TRUE(Matches(got, want.shape(), reference, data, f32)) << "against the float64 reference";
            EXPECT_EQ(got.ToDoubleVector(), want.ToDoubleVector()) << "the same ops as the GELU node's";
        } else {
            // fp32 on CUDA: the loop's cuBLASLt DGELU evaluates gelu' up to ~2.4e-5 off (docs/kernels.md).
            const std::string vs_ref = testing::CompareValues(got.ToDoubleVector(), reference, 1e-4);
            EXPECT_TRUE(vs_ref.empty()) << "against the float64 reference: " << vs_ref;
            const std::string diff = testing::CompareValues(got.ToDoubleVector(), want.ToDoubleVector(), 1e-4);
            EXPECT_TRUE(diff.empty()) << "against the GELU node: " << diff;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Grads, GroupedMlpGeluFusionTest,
                         ::testing::Values(GeluFusionCase{.name = "all"},
                                           GeluFusionCase{.x_grad = false, .name = "no_x_grad"},
                                           GeluFusionCase{.fc2_weight_grad = false, .name = "fc2_weight_frozen"},
                                           GeluFusionCase{.x_grad = false, .fc1_grad = false, .name = "only_fc2"}),
                         [](const ::testing::TestParamInfo<GeluFusionCase> &info) { return info.param.name; });

TEST(GroupedLinearInitTest, ParallelExpertsHoldTheLocalGroupedLinearsParameters) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const nn::ParameterOptions param = WithName(Param(DType::kFloat32), "experts.init");
    const nn::GroupedLinear dense({.num_experts = kExperts, .in_features = kHidden, .out_features = kFfn}, param);
    const nn::ColumnParallelGroupedLinear column(
        {.in_features = kHidden, .out_features = kFfn, .num_experts = kExperts}, Tp(mesh), param);
    const nn::RowParallelGroupedLinear row({.in_features = kHidden, .out_features = kFfn, .num_experts = kExperts},
                                           Tp(mesh), param);
    const Values want_w = dense.weight.local().ToDoubleVector();
    const Values want_b = dense.bias.local().ToDoubleVector();
    EXPECT_EQ(column.weight.value().FullTensor().ToDoubleVector(), want_w);
    EXPECT_EQ(column.bias.value().FullTensor().ToDoubleVector(), want_b);
    EXPECT_EQ(row.weight.value().FullTensor().ToDoubleVector(), want_w);
    EXPECT_EQ(row.bias.value().FullTensor().ToDoubleVector(), want_b);
}

TEST(GroupedLinearErrorTest, SequenceParallelIsRefusedBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    ResetCounts(mesh);
    std::string message = "threw nothing";
    try {
        nn::ColumnParallelGroupedLinear column(
            {.in_features = kHidden, .out_features = kFfn, .sequence_parallel = true, .num_experts = kExperts},
            Tp(mesh), Param(DType::kFloat32));
    } catch (const Error &e) {
        message = e.what();
    }
    EXPECT_NE(message.find("ColumnParallelGroupedLinear: 'column_grouped': needs num_experts > 0 (got 4) and no "
                           "sequence_parallel"),
              std::string::npos)
        << message;
    ExpectCalls(mesh, {}, "a refused configuration");
}

} // namespace
} // namespace shardline
