// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h), and
// every phase's collectives are asserted from the mesh groups' counters against the table of DESIGN.md §6.
// This file: column -> row (the Megatron pair, bitwise) and ParallelMLP.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_DIST_TENSOR_TEST_CUDA adds the bf16 and fp16
// cases) build this file, with the shared sizes, meshes, counts and comparisons of nn_test_util.h.

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/spmd/layout.h>

#include "nn_test_util.h"

namespace shardline {
namespace {

using namespace nn_test;

// ---- column → row (the Megatron pair), bitwise ----------------------------------------------------------------------

struct PairCase {
    bool sequence_parallel = false;
    bool bias = true;
    bool input_grad = true;
};

std::string PairCaseName(const ::testing::TestParamInfo<PairCase> &info) {
    const PairCase &c = info.param;
    return fmt::format("{}_{}_{}", c.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       c.bias ? "bias" : "nobias", c.input_grad ? "xgrad" : "noxgrad");
}

void PrintTo(const PairCase &c, std::ostream *os) {
    *os << PairCaseName({c, 0});
}

class ColumnRowPairTest : public ::testing::TestWithParam<PairCase> {};

// column → row: forward one all-reduce (SP: all-gather x + reduce-scatter y); backward one all-reduce of dX if x
// requires grad (SP: all-gather dY + reduce-scatter dX if x requires grad).
TEST_P(ColumnRowPairTest, MatchesDenseBitwiseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const PairCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ColumnParallelLinear column({.in_features = kHidden,
                                     .out_features = kFfn,
                                     .bias = c.bias,
                                     .sequence_parallel = sp},
                                    Tp(mesh), WithName(Param(DType::kFloat32), "pair.column"));
    nn::RowParallelLinear row({.in_features = kFfn,
                               .out_features = kHidden,
                               .bias = c.bias,
                               .input_is_parallel = true,
                               .sequence_parallel = sp},
                              Tp(mesh), WithName(Param(DType::kFloat32), "pair.row"));
    const Data data = Data::kInteger;
    const DType f32 = DType::kFloat32;
    const std::uint64_t seed = 13;
    const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, f32, seed);
    const Tensor w1 = MakeFull({kFfn, kHidden}, "w1", data, f32, seed);
    const Tensor b1 = MakeFull({kFfn}, "b1", data, f32, seed);
    const Tensor w2 = MakeFull({kHidden, kFfn}, "w2", data, f32, seed);
    const Tensor b2 = MakeFull({kHidden}, "b2", data, f32, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, f32, seed);
    SetFull(column.weight, w1);
    SetFull(row.weight, w2);
    if (c.bias) {
        SetFull(column.bias, b1);
        SetFull(row.bias, b2);
    }
    Variable x(DistTensor::FromFull(x_full, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = row.Forward(column.Forward(x).output).output;
    ExpectCalls(mesh, {{"tp", Planned(tp, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1})}},
                "forward");
    EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
        << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    Calls backward;
    if (sp) {
        backward = {.all_reduce = 0, .all_gather = 1, .reduce_scatter = c.input_grad ? 1 : 0};
    } else {
        backward = {.all_reduce = c.input_grad ? 1 : 0};
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, backward)}}, "backward");

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw1_got = FullGrad(column.weight);
    const Tensor dw2_got = FullGrad(row.weight);
    const Tensor db1_got = c.bias ? FullGrad(column.bias) : Tensor();
    const Tensor db2_got = c.bias ? FullGrad(row.bias) : Tensor();
    const DensePair ref = ReferencePair(x_full, w1, c.bias ? &b1 : nullptr, w2, c.bias ? &b2 : nullptr, dy_full);
    EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, ref.y, data, f32)) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden}, ref.dx, data, f32)) << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw1_got, {kFfn, kHidden}, ref.dw1, data, f32)) << "column dW";
    EXPECT_TRUE(Matches(dw2_got, {kHidden, kFfn}, ref.dw2, data, f32)) << "row dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(db1_got, {kFfn}, ref.db1, data, f32)) << "column db";
        EXPECT_TRUE(Matches(db2_got, {kHidden}, ref.db2, data, f32)) << "row db";
    }
}

std::vector<PairCase> PairCases() {
    std::vector<PairCase> cases;
    for (bool sp : {false, true}) {
        for (bool bias : {true, false}) {
            for (bool input_grad : {true, false}) {
                cases.push_back({.sequence_parallel = sp, .bias = bias, .input_grad = input_grad});
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ColumnRowPairTest, ::testing::ValuesIn(PairCases()), PairCaseName);

// ---- ParallelMLP ---------------------------------------------------------------------------------------------------

struct MlpCase {
    bool sequence_parallel = false;
    bool bias = true;
    bool input_grad = true;
    DType dtype = DType::kFloat32;
};

std::string MlpCaseName(const ::testing::TestParamInfo<MlpCase> &info) {
    const MlpCase &c = info.param;
    return fmt::format("{}_{}_{}_{}", c.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       c.bias ? "bias" : "nobias", c.input_grad ? "xgrad" : "noxgrad", DTypeTag(c.dtype));
}

void PrintTo(const MlpCase &c, std::ostream *os) {
    *os << MlpCaseName({c, 0});
}

class ParallelMLPTest : public ::testing::TestWithParam<MlpCase> {};

// ParallelMLP = column → GELU(tanh) → row on random data (GELU leaves the integers), against float64 with GELU's
// exact derivative. Collectives as column → row: GELU is elementwise on the column's sharded output.
TEST_P(ParallelMLPTest, OutputAndGradientsMatchDenseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp({.hidden = kHidden,
                         .ffn_hidden = kFfn,
                         .bias = c.bias,
                         .sequence_parallel = sp},
                        Tp(mesh), WithName(Param(c.dtype), "mlp"));
    const Data data = Data::kRandom;
    const std::uint64_t seed = 14;
    const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, c.dtype, seed);
    const Tensor w1 = MakeFull({kFfn, kHidden}, "w1", data, c.dtype, seed);
    const Tensor b1 = MakeFull({kFfn}, "b1", data, c.dtype, seed);
    const Tensor w2 = MakeFull({kHidden, kFfn}, "w2", data, c.dtype, seed);
    const Tensor b2 = MakeFull({kHidden}, "b2", data, c.dtype, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, c.dtype, seed);
    SetFull(mlp.fc1->weight, w1);
    SetFull(mlp.fc2->weight, w2);
    if (c.bias) {
        SetFull(mlp.fc1->bias, b1);
        SetFull(mlp.fc2->bias, b2);
    }
    EXPECT_EQ(mlp.Parameters().size(), c.bias ? 4U : 2U);
    Variable x(DistTensor::FromFull(x_full, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = mlp.Forward(x);
    ExpectCalls(mesh, {{"tp", Planned(tp, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1})}},
                "forward");
    EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
        << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    Calls backward;
    if (sp) {
        // all-gather dY (fc2's bias grad comes from it too: no all-reduce), reduce-scatter dX if x needs a grad.
        backward = {.all_reduce = 0, .all_gather = 1, .reduce_scatter = c.input_grad ? 1 : 0};
    } else {
        backward = {.all_reduce = c.input_grad ? 1 : 0};
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, backward)}}, "backward");

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw1_got = FullGrad(mlp.fc1->weight);
    const Tensor dw2_got = FullGrad(mlp.fc2->weight);
    const Tensor db1_got = c.bias ? FullGrad(mlp.fc1->bias) : Tensor();
    const Tensor db2_got = c.bias ? FullGrad(mlp.fc2->bias) : Tensor();

    // Dense float64: h = x·W1ᵀ + b1, a = gelu(h), y = a·W2ᵀ + b2.
    const Values xv = x_full.ToDoubleVector();
    const Values w1v = w1.ToDoubleVector();
    const Values w2v = w2.ToDoubleVector();
    const Values b1v = b1.ToDoubleVector();
    const Values b2v = b2.ToDoubleVector();
    const Values dyv = dy_full.ToDoubleVector();
    const Values h = testing::RefLinearForward(xv, w1v, c.bias ? &b1v : nullptr, kRows, kFfn, kHidden);
    Values a(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) {
        a[i] = testing::RefGeluTanh(h[i]);
    }
    const Values y_ref = testing::RefLinearForward(a, w2v, c.bias ? &b2v : nullptr, kRows, kHidden, kFfn);
    Values dh = testing::RefLinearBackwardInput(dyv, w2v, kRows, kHidden, kFfn);
    for (std::size_t i = 0; i < dh.size(); ++i) {
        dh[i] *= testing::RefGeluTanhGrad(h[i]);
    }
    // Half: h, gelu(h) and dGELU each round once before the next GEMM; y and dX also sum tp rounded partials.
    EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, y_ref, data, c.dtype, HalfFactor(tp, 3))) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden},
                            testing::RefLinearBackwardInput(dh, w1v, kRows, kFfn, kHidden), data, c.dtype,
                            HalfFactor(tp, 3)))
            << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw1_got, {kFfn, kHidden}, testing::RefLinearBackwardWeight(dh, xv, kRows, kFfn, kHidden), data,
                        c.dtype, HalfFactor(1, 2)))
        << "fc1 dW";
    EXPECT_TRUE(Matches(dw2_got, {kHidden, kFfn}, testing::RefLinearBackwardWeight(dyv, a, kRows, kHidden, kFfn), data,
                        c.dtype, HalfFactor(1, 2)))
        << "fc2 dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(db1_got, {kFfn}, testing::RefColumnSum(dh, kRows, kFfn), data, c.dtype, HalfFactor(1, 2)))
            << "fc1 db";
        EXPECT_TRUE(Matches(db2_got, {kHidden}, testing::RefColumnSum(dyv, kRows, kHidden), data, c.dtype,
                            HalfFactor(sp ? tp : 1)))
            << "fc2 db";
    }
}

std::vector<MlpCase> MlpCases() {
    std::vector<MlpCase> cases;
    std::vector<DType> dtypes = {DType::kFloat32};
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    dtypes.push_back(DType::kBFloat16);
    dtypes.push_back(DType::kFloat16);
#endif
    for (DType dtype : dtypes) {
        for (bool sp : {false, true}) {
            for (bool bias : {true, false}) {
                for (bool input_grad : {true, false}) {
                    cases.push_back({.sequence_parallel = sp, .bias = bias, .input_grad = input_grad, .dtype = dtype});
                }
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParallelMLPTest, ::testing::ValuesIn(MlpCases()), MlpCaseName);

} // namespace
} // namespace shardline
