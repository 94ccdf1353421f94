// Uneven shards in the tensor-parallel modules (issue 19): the sharded feature dim of ColumnParallelLinear (out),
// RowParallelLinear (in) and ParallelMLP (ffn) is kFfn = 22, which tp 3 splits 8, 8, 6 and tp 4 splits 6, 6, 6, 4
// (torch.chunk, as every layout of the project). Every rank builds the same full tensors from one seed; the TP run's
// output and every gradient are gathered (DistTensor::FullTensor) and compared with the single-rank dense float64
// reference: bitwise for integer-valued operands (|x| <= 8, every sum below 2^18: exact in fp32), rtol 1e-5 where GELU
// leaves the integers. Each phase's collectives are counted on the tp group, and the uneven ones carry each rank's own
// byte count. Registered at np 1, 2, 3 and 4 (tests/dist/dist_tensor.cmake); np 3 and 4 are the uneven runs.
// BACKEND cpu (MPI) and BACKEND cuda (NCCL; SHARDLINE_DIST_TENSOR_TEST_CUDA) build this file.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/spmd/layout.h>

#include "nn_test_util.h"

namespace shardline {
namespace {

using namespace nn_test;

// A sequence every tp of the test divides (sequence parallelism still needs that); the feature dim tp shards is uneven.
constexpr std::int64_t kUSeq = 12;
constexpr std::int64_t kURows = kUSeq * kBatch;
constexpr std::int64_t kUFfn = 22;
constexpr DType kF32 = DType::kFloat32;

/// This rank's torch.chunk part of `n` on the tp mesh.
std::int64_t Part(DeviceMesh &mesh, std::int64_t n) {
    return spmd::ChunkRange(n, SizeOf(mesh, "tp"), mesh.coordinate()[0]).second;
}

/// Dense float64 Linear on the uneven sizes: y[rows, out] = x·Wᵀ + b and its gradients.
DenseLinear Reference(const Tensor &x, const Tensor &w, const Tensor *b, const Tensor &dy, std::int64_t in,
                      std::int64_t out) {
    const Values xv = x.ToDoubleVector();
    const Values wv = w.ToDoubleVector();
    const Values dyv = dy.ToDoubleVector();
    const Values bv = b != nullptr ? b->ToDoubleVector() : Values();
    return {.y = testing::RefLinearForward(xv, wv, b != nullptr ? &bv : nullptr, kURows, out, in),
            .dx = testing::RefLinearBackwardInput(dyv, wv, kURows, out, in),
            .dw = testing::RefLinearBackwardWeight(dyv, xv, kURows, out, in),
            .db = testing::RefColumnSum(dyv, kURows, out)};
}

/// The all-gather (or reduce-scatter) bytes of this rank on the tp group: its own, uneven, input.
void ExpectBytes(DeviceMesh &mesh, CollectiveKind kind, std::int64_t bytes, std::string_view phase) {
    EXPECT_EQ(mesh.group(0).Counts().Bytes(kind), bytes) << phase << ": " << comm::CollectiveName(kind) << " bytes";
}

// ---- ColumnParallelLinear: out_features 22 --------------------------------------------------------------------------

enum class ColumnInput { kReplicated, kSequenceParallel, kGatherOutput };

struct ColumnCase {
    ColumnInput input = ColumnInput::kReplicated;
    bool bias = true;
};

std::string ColumnName(const ::testing::TestParamInfo<ColumnCase> &info) {
    const char *input = info.param.input == ColumnInput::kReplicated         ? "replicated"
                        : info.param.input == ColumnInput::kSequenceParallel ? "sequenceparallel"
                                                                             : "gatheroutput";
    return fmt::format("{}_{}", input, info.param.bias ? "bias" : "nobias");
}

void PrintTo(const ColumnCase &c, std::ostream *os) { *os << ColumnName({c, 0}); }

class UnevenColumnParallelLinearTest : public ::testing::TestWithParam<ColumnCase> {};

// W [22, 16] S(0): tp 3 holds rows 8, 8, 6. Replicated x: forward none, backward all-reduce dX. Sequence parallel:
// all-gather x (even: the sequence divides), reduce-scatter dX. gather_output: all-gather-v of y's uneven feature
// blocks (each rank sends its own s·b·part elements), backward a local slice of dY.
TEST_P(UnevenColumnParallelLinearTest, MatchesDenseBitwiseWithUnevenShards) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const ColumnCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.input == ColumnInput::kSequenceParallel;
    const bool gather = c.input == ColumnInput::kGatherOutput;
    nn::ColumnParallelLinear layer({.in_features = kHidden,
                                    .out_features = kUFfn,
                                    .bias = c.bias,
                                    .gather_output = gather,
                                    .sequence_parallel = sp},
                                   Tp(mesh), WithName(Param(kF32), "uneven.column"));
    const std::int64_t part = Part(mesh, kUFfn);
    ASSERT_EQ(layer.weight.local().shape(), (Shape{part, kHidden})) << "this rank's torch.chunk rows";

    const Data data = Data::kInteger;
    const Tensor x_full = MakeFull({kUSeq, kBatch, kHidden}, "x", data, kF32, 21);
    const Tensor w_full = MakeFull({kUFfn, kHidden}, "w", data, kF32, 21);
    const Tensor b_full = MakeFull({kUFfn}, "b", data, kF32, 21);
    const Tensor dy_full = MakeFull({kUSeq, kBatch, kUFfn}, "dy", data, kF32, 21);
    SetFull(layer.weight, w_full);
    if (c.bias) {
        SetFull(layer.bias, b_full);
    }
    Variable x(DistTensor::FromFull(x_full, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh), true);

    ResetCounts(mesh);
    Variable y = layer.Forward(x).output;
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_gather = sp || gather ? 1 : 0})}}, "forward");
    if (gather && tp > 1) {
        ExpectBytes(mesh, CollectiveKind::kAllGather, kUSeq * kBatch * part * 4, "forward");
    }
    if (!gather) {
        EXPECT_EQ(y.local().shape().back(), part) << "y keeps this rank's uneven features";
    }

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_reduce = sp ? 0 : 1, .reduce_scatter = sp ? 1 : 0})}}, "backward");

    const DenseLinear ref = Reference(x_full, w_full, c.bias ? &b_full : nullptr, dy_full, kHidden, kUFfn);
    EXPECT_TRUE(Matches(y.value().FullTensor(), {kUSeq, kBatch, kUFfn}, ref.y, data, kF32)) << "y";
    EXPECT_TRUE(Matches(FullGrad(x), {kUSeq, kBatch, kHidden}, ref.dx, data, kF32)) << "dX";
    EXPECT_TRUE(Matches(FullGrad(layer.weight), {kUFfn, kHidden}, ref.dw, data, kF32)) << "dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(FullGrad(layer.bias), {kUFfn}, ref.db, data, kF32)) << "db";
    }
}

INSTANTIATE_TEST_SUITE_P(Matrix, UnevenColumnParallelLinearTest,
                         ::testing::Values(ColumnCase{ColumnInput::kReplicated, true},
                                           ColumnCase{ColumnInput::kReplicated, false},
                                           ColumnCase{ColumnInput::kSequenceParallel, true},
                                           ColumnCase{ColumnInput::kGatherOutput, true},
                                           ColumnCase{ColumnInput::kGatherOutput, false}),
                         ColumnName);

// ---- RowParallelLinear: in_features 22 ------------------------------------------------------------------------------

struct RowCase {
    bool input_is_parallel = true;
    bool sequence_parallel = false;
    bool bias = true;
};

std::string RowName(const ::testing::TestParamInfo<RowCase> &info) {
    return fmt::format("{}_{}_{}", info.param.input_is_parallel ? "parallelinput" : "fullinput",
                       info.param.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       info.param.bias ? "bias" : "nobias");
}

void PrintTo(const RowCase &c, std::ostream *os) { *os << RowName({c, 0}); }

class UnevenRowParallelLinearTest : public ::testing::TestWithParam<RowCase> {};

// W [16, 22] S(1): tp 3 holds columns 8, 8, 6. input_is_parallel: x arrives S(-1) with the same uneven parts; forward
// all-reduce y (SP: reduce-scatter on the sequence), backward none (SP: all-gather dY). A full input: each rank slices
// its uneven part locally, and dX comes back by an all-gather-v of the uneven feature blocks.
TEST_P(UnevenRowParallelLinearTest, MatchesDenseBitwiseWithUnevenShards) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const RowCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::RowParallelLinear layer({.in_features = kUFfn,
                                 .out_features = kHidden,
                                 .bias = c.bias,
                                 .input_is_parallel = c.input_is_parallel,
                                 .sequence_parallel = sp},
                                Tp(mesh), WithName(Param(kF32), "uneven.row"));
    const std::int64_t part = Part(mesh, kUFfn);
    ASSERT_EQ(layer.weight.local().shape(), (Shape{kHidden, part})) << "this rank's torch.chunk columns";

    const Data data = Data::kInteger;
    const Tensor x_full = MakeFull({kUSeq, kBatch, kUFfn}, "x", data, kF32, 22);
    const Tensor w_full = MakeFull({kHidden, kUFfn}, "w", data, kF32, 22);
    const Tensor b_full = MakeFull({kHidden}, "b", data, kF32, 22);
    const Tensor dy_full = MakeFull({kUSeq, kBatch, kHidden}, "dy", data, kF32, 22);
    SetFull(layer.weight, w_full);
    if (c.bias) {
        SetFull(layer.bias, b_full);
    }
    const spmd::Layout x_layout = c.input_is_parallel ? LayoutOf(3, {{2, {0}}}) : spmd::Layout::Replicated(3);
    Variable x(DistTensor::FromFull(x_full, x_layout, mesh), true);
    if (c.input_is_parallel) {
        ASSERT_EQ(x.local().shape().back(), part) << "x arrives in the same uneven parts";
    }

    ResetCounts(mesh);
    Variable y = layer.Forward(x).output;
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_reduce = sp ? 0 : 1, .reduce_scatter = sp ? 1 : 0})}}, "forward");

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    const bool gather_dx = !c.input_is_parallel;
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_gather = sp || gather_dx ? 1 : 0})}}, "backward");
    if (gather_dx && tp > 1) {
        ExpectBytes(mesh, CollectiveKind::kAllGather, kUSeq * kBatch * part * 4, "backward");
    }

    const DenseLinear ref = Reference(x_full, w_full, c.bias ? &b_full : nullptr, dy_full, kUFfn, kHidden);
    EXPECT_TRUE(Matches(y.value().FullTensor(), {kUSeq, kBatch, kHidden}, ref.y, data, kF32)) << "y";
    EXPECT_TRUE(Matches(FullGrad(x), {kUSeq, kBatch, kUFfn}, ref.dx, data, kF32)) << "dX";
    EXPECT_TRUE(Matches(FullGrad(layer.weight), {kHidden, kUFfn}, ref.dw, data, kF32)) << "dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(FullGrad(layer.bias), {kHidden}, ref.db, data, kF32)) << "db";
    }
}

INSTANTIATE_TEST_SUITE_P(Matrix, UnevenRowParallelLinearTest,
                         ::testing::Values(RowCase{true, false, true}, RowCase{true, false, false},
                                           RowCase{true, true, true}, RowCase{false, false, true},
                                           RowCase{false, false, false}),
                         RowName);

// ---- column -> row and ParallelMLP: ffn 22
// ---------------------------------------------------------------------------

PairFull MakeUnevenPair(Data data, std::uint64_t seed) {
    return {.x = MakeFull({kUSeq, kBatch, kHidden}, "x", data, kF32, seed),
            .w1 = MakeFull({kUFfn, kHidden}, "w1", data, kF32, seed),
            .b1 = MakeFull({kUFfn}, "b1", data, kF32, seed),
            .w2 = MakeFull({kHidden, kUFfn}, "w2", data, kF32, seed),
            .b2 = MakeFull({kHidden}, "b2", data, kF32, seed),
            .dy = MakeFull({kUSeq, kBatch, kHidden}, "dy", data, kF32, seed)};
}

DensePair ReferenceUnevenPair(const PairFull &f, bool gelu) {
    const Values b1 = f.b1.ToDoubleVector();
    const Values b2 = f.b2.ToDoubleVector();
    return testing::RefMlp(f.x.ToDoubleVector(), f.w1.ToDoubleVector(), &b1, f.w2.ToDoubleVector(), &b2,
                           f.dy.ToDoubleVector(), kURows, kHidden, kUFfn, gelu);
}

/// y and every gradient of a column -> row run against the dense pair (bitwise for integer data).
/// With `gelu_budget` (the MLP on CUDA) fp32's rtol is 4x: at tp 3 the 8-feature shards may take cuBLASLt's fused
/// GELU / dGELU epilogues, which evaluate gelu and gelu' their own way (the fusion test's budget,
/// nn_parallel_mlp_test).
void ExpectPairMatches(const PairGot &got, const DensePair &ref, Data data, bool gelu_budget = false) {
    auto same = [&](const Tensor &t, const Shape &shape, const Values &want) -> ::testing::AssertionResult {
        if (!gelu_budget || data == Data::kInteger) {
            return Matches(t, shape, want, data, kF32);
        }
        if (!t.defined() || t.shape() != shape) {
            return ::testing::AssertionFailure() << "undefined or not " << ShapeToString(shape);
        }
        const std::string diff =
            testing::CompareValues(t.ToDoubleVector(), want, 4.0 * testing::RelativeTolerance(kF32));
        return diff.empty() ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << diff;
    };
    EXPECT_TRUE(same(got.y, {kUSeq, kBatch, kHidden}, ref.y)) << "y";
    EXPECT_TRUE(same(got.dx, {kUSeq, kBatch, kHidden}, ref.dx)) << "dX";
    EXPECT_TRUE(same(got.dw1, {kUFfn, kHidden}, ref.dw1)) << "fc1 dW";
    EXPECT_TRUE(same(got.db1, {kUFfn}, ref.db1)) << "fc1 db";
    EXPECT_TRUE(same(got.dw2, {kHidden, kUFfn}, ref.dw2)) << "fc2 dW";
    EXPECT_TRUE(same(got.db2, {kHidden}, ref.db2)) << "fc2 db";
}

class UnevenColumnRowPairTest : public ::testing::TestWithParam<bool> {};

// The Megatron pair on ffn 22: the column layer's uneven output is the row layer's uneven input (same torch.chunk
// parts, nothing moves between them). Forward one all-reduce, backward one all-reduce of dX (SP: all-gather x,
// reduce-scatter y; all-gather dY, reduce-scatter dX).
TEST_P(UnevenColumnRowPairTest, MatchesDenseBitwise) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const bool sp = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kUFfn, .sequence_parallel = sp}, Tp(mesh),
                                    WithName(Param(kF32), "uneven.pair.column"));
    nn::RowParallelLinear row(
        {.in_features = kUFfn, .out_features = kHidden, .input_is_parallel = true, .sequence_parallel = sp}, Tp(mesh),
        WithName(Param(kF32), "uneven.pair.row"));
    const PairFull full = MakeUnevenPair(Data::kInteger, 23);
    SetPairFull(column, row, full, true);
    Variable x(DistTensor::FromFull(full.x, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh), true);

    ResetCounts(mesh);
    Variable y = row.Forward(column.Forward(x).output).output;
    ExpectPairForward(mesh, sp, x, y);
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {{"tp", Planned(tp, PairCalls(sp))}}, "backward");

    ExpectPairMatches(GatherPair(x, y, column, row, true), ReferenceUnevenPair(full, false), Data::kInteger);
}

INSTANTIATE_TEST_SUITE_P(Matrix, UnevenColumnRowPairTest, ::testing::Bool(),
                         [](const auto &info) { return info.param ? "sequenceparallel" : "tensorparallel"; });

#if SHARDLINE_DIST_TENSOR_TEST_CUDA
class UnevenHalfPairTest : public ::testing::TestWithParam<DType> {};

// bf16 / fp16 on the GPUs: the uneven shards' rows are 6 or 8 half elements (12 or 16 bytes), so cuBLASLt sees
// pointers and leading dimensions of every alignment. Random data within the half types' budget of
// nn_parallel_mlp_test (y and dX sum tp rounded partials).
TEST_P(UnevenHalfPairTest, MatchesDenseWithinTheHalfBudget) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const DType dtype = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kUFfn}, Tp(mesh),
                                    WithName(Param(dtype), "uneven.half.column"));
    nn::RowParallelLinear row({.in_features = kUFfn, .out_features = kHidden, .input_is_parallel = true}, Tp(mesh),
                              WithName(Param(dtype), "uneven.half.row"));
    const Data data = Data::kRandom;
    const PairFull full{.x = MakeFull({kUSeq, kBatch, kHidden}, "x", data, dtype, 26),
                        .w1 = MakeFull({kUFfn, kHidden}, "w1", data, dtype, 26),
                        .b1 = MakeFull({kUFfn}, "b1", data, dtype, 26),
                        .w2 = MakeFull({kHidden, kUFfn}, "w2", data, dtype, 26),
                        .b2 = MakeFull({kHidden}, "b2", data, dtype, 26),
                        .dy = MakeFull({kUSeq, kBatch, kHidden}, "dy", data, dtype, 26)};
    SetPairFull(column, row, full, true);
    Variable x(DistTensor::FromFull(full.x, spmd::Layout::Replicated(3), mesh), true);
    Variable y = row.Forward(column.Forward(x).output).output;
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    const PairGot got = GatherPair(x, y, column, row, true);
    const DensePair ref = ReferenceUnevenPair(full, false);
    EXPECT_TRUE(Matches(got.y, {kUSeq, kBatch, kHidden}, ref.y, data, dtype, HalfFactor(tp, 3))) << "y";
    EXPECT_TRUE(Matches(got.dx, {kUSeq, kBatch, kHidden}, ref.dx, data, dtype, HalfFactor(tp, 3))) << "dX";
    EXPECT_TRUE(Matches(got.dw1, {kUFfn, kHidden}, ref.dw1, data, dtype, HalfFactor(1, 2))) << "fc1 dW";
    EXPECT_TRUE(Matches(got.db1, {kUFfn}, ref.db1, data, dtype, HalfFactor(1, 2))) << "fc1 db";
    EXPECT_TRUE(Matches(got.dw2, {kHidden, kUFfn}, ref.dw2, data, dtype, HalfFactor(1, 2))) << "fc2 dW";
    EXPECT_TRUE(Matches(got.db2, {kHidden}, ref.db2, data, dtype)) << "fc2 db";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, UnevenHalfPairTest, ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const auto &info) { return std::string(DTypeName(info.param)); });
#endif

struct MlpCase {
    bool sequence_parallel = false;
    bool gelu_fusion = true;
};

class UnevenParallelMLPTest : public ::testing::TestWithParam<MlpCase> {};

// ParallelMLP with ffn 22, fused (GELU in fc1's GEMM epilogue, its gradient in fc2's dgrad) and unfused. GELU leaves
// the integers, so the operands are integer-valued but the comparison is fp32's rtol 1e-5 (4e-5 on CUDA, see
// ExpectPairMatches) against float64 with GELU's exact derivative. Collectives as column -> row.
TEST_P(UnevenParallelMLPTest, MatchesDenseWithUnevenFfnShards) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp({.hidden = kHidden, .ffn_hidden = kUFfn, .sequence_parallel = sp, .gelu_fusion = c.gelu_fusion},
                        Tp(mesh), WithName(Param(kF32), "uneven.mlp"));
    ASSERT_EQ(mlp.fc1->weight.local().shape(), (Shape{Part(mesh, kUFfn), kHidden}));
    // Integers in [-8, 8] scaled by 1/8 keep GELU's arguments moderate; the values stay exactly representable.
    PairFull full = MakeUnevenPair(Data::kInteger, 24);
    for (Tensor *t : {&full.x, &full.w1, &full.w2}) {
        *t = kernels::Scale(*t, 0.125);
    }
    SetPairFull(*mlp.fc1, *mlp.fc2, full, true);
    Variable x(DistTensor::FromFull(full.x, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh), true);

    ResetCounts(mesh);
    Variable y = mlp.Forward(x);
    ExpectPairForward(mesh, sp, x, y);
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {{"tp", Planned(tp, PairCalls(sp))}}, "backward");

    ExpectPairMatches(GatherPair(x, y, *mlp.fc1, *mlp.fc2, true), ReferenceUnevenPair(full, true), Data::kRandom,
                      /*gelu_budget=*/!TestDevice().is_cpu());
}

INSTANTIATE_TEST_SUITE_P(Matrix, UnevenParallelMLPTest,
                         ::testing::Values(MlpCase{false, true}, MlpCase{false, false}, MlpCase{true, true}),
                         [](const auto &info) {
                             return fmt::format("{}_{}", info.param.sequence_parallel ? "sequenceparallel" : "tensor",
                                                info.param.gelu_fusion ? "fused" : "unfused");
                         });

// ---- initialisation: TP-size-invariant with uneven shards ---------------------------------------------------------

// Parameters are a function of (seed, name, global index): the uneven shards of a ParallelMLP gather to the weights of
// dense Linear layers of the same names, whatever tp is (tp 3: fc1 rows 8, 8, 6).
TEST(UnevenInitTest, UnevenShardsGatherToTheDenseLayersWeights) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const nn::ParameterOptions param = WithName(Param(kF32), "uneven.init");
    nn::ParallelMLP mlp({.hidden = kHidden, .ffn_hidden = kUFfn}, Tp(mesh), param);
    ASSERT_EQ(mlp.fc1->weight.local().shape(), (Shape{Part(mesh, kUFfn), kHidden}));
    ASSERT_EQ(mlp.fc2->weight.local().shape(), (Shape{kHidden, Part(mesh, kUFfn)}));
    nn::Linear fc1({.in_features = kHidden, .out_features = kUFfn}, WithName(param, "uneven.init.fc1"));
    nn::Linear fc2({.in_features = kUFfn, .out_features = kHidden}, WithName(param, "uneven.init.fc2"));
    EXPECT_TRUE(SameValues(mlp.fc1->weight.value().FullTensor(), fc1.weight.local())) << "fc1 weight";
    EXPECT_TRUE(SameValues(mlp.fc1->bias.value().FullTensor(), fc1.bias.local())) << "fc1 bias";
    EXPECT_TRUE(SameValues(mlp.fc2->weight.value().FullTensor(), fc2.weight.local())) << "fc2 weight";
    EXPECT_TRUE(SameValues(mlp.fc2->bias.value().FullTensor(), fc2.bias.local())) << "fc2 bias";
}

// ---- the functional layer, as a trainer with its own buffers calls it ---------------------------------------------

// A trainer sizes its buffers with TensorParallelGroup::ShardSize / ShardOffset: column fc1 (22 -> this rank's part of
// the features) then row fc2 on that part, forward and backward, on caller-owned tensors. Bitwise against the dense
// pair; the ranks' parts tile [0, 22) in rank order.
TEST(UnevenFunctionalTest, ShardSizeBuffersRunTheColumnRowPairBitwise) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const functional::TensorParallelGroup group = Tp(mesh);
    const std::int64_t part = group.ShardSize(kUFfn);
    const std::int64_t offset = group.ShardOffset(kUFfn);
    EXPECT_EQ(part, Part(mesh, kUFfn));
    EXPECT_EQ(offset, spmd::ChunkRange(kUFfn, tp, group.rank()).first);
    EXPECT_EQ(group.rank(), mesh.coordinate()[0]);

    const PairFull full = MakeUnevenPair(Data::kInteger, 25);
    const Device dev = TestDevice();
    // This rank's rows of W1 and b1 and columns of W2: the torch.chunk slices of the full tensors.
    const spmd::Layout rows = LayoutOf(2, {{0, {0}}});
    const Tensor w1 = DistTensor::FromFull(full.w1, rows, mesh).local();
    const Tensor b1 = DistTensor::FromFull(full.b1, LayoutOf(1, {{0, {0}}}), mesh).local();
    const Tensor w2 = DistTensor::FromFull(full.w2, LayoutOf(2, {{1, {0}}}), mesh).local();
    ASSERT_EQ(w1.shape(), (Shape{part, kHidden}));
    Tensor h = Tensor::Empty({kURows, part}, kF32, dev);
    Tensor y = Tensor::Empty({kURows, kHidden}, kF32, dev);
    const Tensor x = full.x.View({kURows, kHidden});
    const functional::ColumnParallelLinearOptions fc1{.in_features = kHidden, .out_features = kUFfn};
    const functional::RowParallelLinearOptions fc2{
        .in_features = kUFfn, .out_features = kHidden, .input_is_parallel = true};
    ResetCounts(mesh);
    functional::ColumnParallelLinearForward(fc1,
                                            {.x = functional::View(x),
                                             .weight = functional::View(w1),
                                             .bias = functional::View(b1),
                                             .y = functional::View(h)},
                                            group);
    functional::RowParallelLinearForward(fc2,
                                         {.x = functional::View(h),
                                          .weight = functional::View(w2),
                                          .bias = functional::View(full.b2),
                                          .y = functional::View(y)},
                                         group);
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_reduce = 1})}}, "forward");

    Tensor dh = Tensor::Empty({kURows, part}, kF32, dev);
    Tensor dx = Tensor::Empty({kURows, kHidden}, kF32, dev);
    Tensor dw1 = Tensor::Empty({part, kHidden}, kF32, dev);
    Tensor db1 = Tensor::Empty({part}, kF32, dev);
    Tensor dw2 = Tensor::Empty({kHidden, part}, kF32, dev);
    Tensor db2 = Tensor::Empty({kHidden}, kF32, dev);
    const Tensor dy = full.dy.View({kURows, kHidden});
    ResetCounts(mesh);
    functional::RowParallelLinearBackward(fc2,
                                          {.dy = functional::View(dy),
                                           .x = functional::View(h),
                                           .weight = functional::View(w2),
                                           .dx = functional::View(dh),
                                           .dweight = functional::View(dw2),
                                           .dbias = functional::View(db2)},
                                          group);
    functional::ColumnParallelLinearBackward(fc1,
                                             {.dy = functional::View(dh),
                                              .x = functional::View(x),
                                              .weight = functional::View(w1),
                                              .dx = functional::View(dx),
                                              .dweight = functional::View(dw1),
                                              .dbias = functional::View(db1)},
                                             group);
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_reduce = 1})}}, "backward");

    const DensePair ref = ReferenceUnevenPair(full, false);
    // The parameter gradients' shards against this rank's torch.chunk slice of the dense ones (rows or columns
    // [offset, offset + part)).
    auto slice = [&](const Values &v, std::int64_t cols_n, bool by_rows) {
        Values out;
        const std::int64_t rows_n = static_cast<std::int64_t>(v.size()) / cols_n;
        for (std::int64_t i = 0; i < rows_n; ++i) {
            for (std::int64_t j = 0; j < cols_n; ++j) {
                const std::int64_t k = by_rows ? i : j;
                if (k >= offset && k < offset + part) {
                    out.push_back(v[static_cast<std::size_t>(i * cols_n + j)]);
                }
            }
        }
        return out;
    };
    EXPECT_TRUE(Matches(y, {kURows, kHidden}, ref.y, Data::kInteger, kF32)) << "y";
    EXPECT_TRUE(Matches(dx, {kURows, kHidden}, ref.dx, Data::kInteger, kF32)) << "dX";
    EXPECT_TRUE(Matches(dw1, {part, kHidden}, slice(ref.dw1, kHidden, true), Data::kInteger, kF32)) << "dW1";
    EXPECT_TRUE(Matches(db1, {part}, slice(ref.db1, 1, true), Data::kInteger, kF32)) << "db1";
    EXPECT_TRUE(Matches(dw2, {kHidden, part}, slice(ref.dw2, kUFfn, false), Data::kInteger, kF32)) << "dW2";
    EXPECT_TRUE(Matches(db2, {kHidden}, ref.db2, Data::kInteger, kF32)) << "db2";
}

// ---- errors --------------------------------------------------------------------------------------------------------

// A size that leaves a rank without features (tp 3: 4 = 2 + 2 + 0) raises on every rank before any collective, from
// the module's constructor and from the autograd layer below it (parameters made by hand).
TEST(UnevenErrorsTest, ARankWithoutFeaturesRaisesOnEveryRankBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp < 3) {
        GTEST_SKIP() << "tp " << tp << ": n = tp + 1 leaves no rank empty below tp 3";
    }
    const std::int64_t n = tp + 1;
    ResetCounts(mesh);
    std::string message = "<no error>";
    try {
        nn::ColumnParallelLinear({.in_features = kHidden, .out_features = n}, Tp(mesh), {.name = "empty"});
    } catch (const ShapeError &e) {
        message = e.what();
    }
    EXPECT_NE(message.find(fmt::format("out_features ({}) over tp ({})", n, tp)), std::string::npos) << message;
    EXPECT_NE(message.find("every rank needs at least one"), std::string::npos) << message;

    // autograd::RowParallelLinear on parameters laid out by hand, with x needing a redistribution first: the check
    // comes before it.
    Variable w(DistTensor::FromFull(Tensor::Zeros({kHidden, n}, kF32, TestDevice()), LayoutOf(2, {{1, {0}}}), mesh),
               true);
    Variable b(DistTensor::FromFull(Tensor::Zeros({kHidden}, kF32, TestDevice()), spmd::Layout::Replicated(1), mesh),
               true);
    Variable x(DistTensor::FromFull(Tensor::Zeros({kUSeq, n}, kF32, TestDevice()), LayoutOf(2, {{0, {0}}}), mesh),
               true);
    ResetCounts(mesh);
    message = "<no error>";
    try {
        autograd::RowParallelLinear(x, w, b, {.in_features = n, .out_features = kHidden, .input_is_parallel = true},
                                    Tp(mesh));
    } catch (const ShapeError &e) {
        message = e.what();
    }
    EXPECT_NE(message.find("autograd::RowParallelLinear"), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("in_features ({}) over tp ({})", n, tp)), std::string::npos) << message;
    ExpectCalls(mesh, {}, "the refused calls");
}

} // namespace
} // namespace shardline
