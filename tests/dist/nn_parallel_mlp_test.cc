// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h), and
// every phase's collectives are asserted from the mesh groups' counters against the table of DESIGN.md §6.
// This file: column -> row (the Megatron pair, bitwise) and ParallelMLP, with the GELU fused into the GEMM epilogues
// (one autograd node) and unfused (fc1 -> Gelu -> fc2), each against the dense reference and against each other.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 1/2/4; SHARDLINE_DIST_TENSOR_TEST_CUDA adds the bf16 and fp16
// cases) build this file, with the shared sizes, meshes, counts and comparisons of nn_test_util.h.

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/communicator.h>
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

void PrintTo(const PairCase &c, std::ostream *os) { *os << PairCaseName({c, 0}); }

class ColumnRowPairTest : public ::testing::TestWithParam<PairCase> {};

// column → row: forward one all-reduce (SP: all-gather x + reduce-scatter y); backward one all-reduce of dX if x
// requires grad (SP: all-gather dY + reduce-scatter dX if x requires grad).
TEST_P(ColumnRowPairTest, MatchesDenseBitwiseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const PairCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ColumnParallelLinear column(
        {.in_features = kHidden, .out_features = kFfn, .bias = c.bias, .sequence_parallel = sp}, Tp(mesh),
        WithName(Param(DType::kFloat32), "pair.column"));
    nn::RowParallelLinear row({.in_features = kFfn,
                               .out_features = kHidden,
                               .bias = c.bias,
                               .input_is_parallel = true,
                               .sequence_parallel = sp},
                              Tp(mesh), WithName(Param(DType::kFloat32), "pair.row"));
    const Data data = Data::kInteger;
    const DType f32 = DType::kFloat32;
    const PairFull full = MakePairFull(data, f32, 13);
    SetPairFull(column, row, full, c.bias);
    Variable x(DistTensor::FromFull(full.x, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = row.Forward(column.Forward(x).output).output;
    ExpectPairForward(mesh, sp, x, y);

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh, {{"tp", Planned(tp, PairCalls(sp, c.input_grad))}}, "backward");

    const PairGot got = GatherPair(x, y, column, row, c.bias);
    const DensePair ref =
        ReferencePair(full.x, full.w1, c.bias ? &full.b1 : nullptr, full.w2, c.bias ? &full.b2 : nullptr, full.dy);
    EXPECT_TRUE(Matches(got.y, {kSeq, kBatch, kHidden}, ref.y, data, f32)) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(got.dx, {kSeq, kBatch, kHidden}, ref.dx, data, f32)) << "dX";
    } else {
        EXPECT_FALSE(got.dx.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(got.dw1, {kFfn, kHidden}, ref.dw1, data, f32)) << "column dW";
    EXPECT_TRUE(Matches(got.dw2, {kHidden, kFfn}, ref.dw2, data, f32)) << "row dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(got.db1, {kFfn}, ref.db1, data, f32)) << "column db";
        EXPECT_TRUE(Matches(got.db2, {kHidden}, ref.db2, data, f32)) << "row db";
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
    bool gelu_fusion = true; ///< the GELU in fc1's GEMM epilogue, its gradient in fc2's dgrad
};

std::string MlpCaseName(const ::testing::TestParamInfo<MlpCase> &info) {
    const MlpCase &c = info.param;
    return fmt::format("{}_{}_{}_{}_{}", c.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       c.bias ? "bias" : "nobias", c.input_grad ? "xgrad" : "noxgrad", DTypeTag(c.dtype),
                       c.gelu_fusion ? "fused" : "unfused");
}

void PrintTo(const MlpCase &c, std::ostream *os) { *os << MlpCaseName({c, 0}); }

class ParallelMLPTest : public ::testing::TestWithParam<MlpCase> {};

// ParallelMLP = column → GELU(tanh) → row on random data (GELU leaves the integers), against float64 with GELU's
// exact derivative. Collectives as column → row: GELU is elementwise on the column's sharded output.
TEST_P(ParallelMLPTest, OutputAndGradientsMatchDenseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp(
        {.hidden = kHidden, .ffn_hidden = kFfn, .bias = c.bias, .sequence_parallel = sp, .gelu_fusion = c.gelu_fusion},
        Tp(mesh), WithName(Param(c.dtype), "mlp"));
    const Data data = Data::kRandom;
    const PairFull full = MakePairFull(data, c.dtype, 14);
    SetPairFull(*mlp.fc1, *mlp.fc2, full, c.bias);
    EXPECT_EQ(mlp.Parameters().size(), c.bias ? 4U : 2U);
    Variable x(DistTensor::FromFull(full.x, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = mlp.Forward(x);
    ExpectPairForward(mesh, sp, x, y);

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    // As column → row: with sp, fc2's bias grad comes from the all-gathered dY too (no all-reduce).
    ExpectCalls(mesh, {{"tp", Planned(tp, PairCalls(sp, c.input_grad))}}, "backward");

    const PairGot got = GatherPair(x, y, *mlp.fc1, *mlp.fc2, c.bias);
    // Dense float64: h = x·W1ᵀ + b1, a = gelu(h), y = a·W2ᵀ + b2.
    const DensePair ref = ReferencePair(full.x, full.w1, c.bias ? &full.b1 : nullptr, full.w2,
                                        c.bias ? &full.b2 : nullptr, full.dy, /*gelu=*/true);
    // Half: h, gelu(h) and dGELU each round once before the next GEMM; y and dX also sum tp rounded partials.
    // float32 fused on CUDA: where the tuner picks cuBLASLt's DGELU epilogue for fc2's dgrad, gelu' is its own
    // approximation, up to ~2.4e-5 off (tests/common/helpers.h, kCublasLtFp32GeluGradError): the gradients behind it
    // (dX, fc1's dW and db) sum g·gelu'-weighted terms, so they get rtol 1e-4 as the grouped MLP's fp32 DGELU does
    // (nn_grouped_mlp_test.cc); everything else keeps float32's 1e-5.
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    const double behind_dgelu = c.gelu_fusion ? 10.0 : 1.0;
#else
    const double behind_dgelu = 1.0;
#endif
    EXPECT_TRUE(Matches(got.y, {kSeq, kBatch, kHidden}, ref.y, data, c.dtype, HalfFactor(tp, 3))) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(got.dx, {kSeq, kBatch, kHidden}, ref.dx, data, c.dtype, HalfFactor(tp, 3), behind_dgelu))
            << "dX";
    } else {
        EXPECT_FALSE(got.dx.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(got.dw1, {kFfn, kHidden}, ref.dw1, data, c.dtype, HalfFactor(1, 2), behind_dgelu)) << "fc1 dW";
    EXPECT_TRUE(Matches(got.dw2, {kHidden, kFfn}, ref.dw2, data, c.dtype, HalfFactor(1, 2))) << "fc2 dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(got.db1, {kFfn}, ref.db1, data, c.dtype, HalfFactor(1, 2), behind_dgelu)) << "fc1 db";
        EXPECT_TRUE(Matches(got.db2, {kHidden}, ref.db2, data, c.dtype, HalfFactor(sp ? tp : 1))) << "fc2 db";
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
                    for (bool fused : {true, false}) {
                        cases.push_back({.sequence_parallel = sp,
                                         .bias = bias,
                                         .input_grad = input_grad,
                                         .dtype = dtype,
                                         .gelu_fusion = fused});
                    }
                }
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParallelMLPTest, ::testing::ValuesIn(MlpCases()), MlpCaseName);

// ---- the fused ParallelMLP against the unfused one ----------------------------------------------------------------

class ParallelMLPFusionTest : public ::testing::TestWithParam<MlpCase> {};

// An ffn size whose shards are multiples of 8 at tp 1, 2 and 4: on CUDA cuBLASLt may then fuse GELU_AUX_BIAS and
// DGELU(_BGRAD) (their aux leading dimension, ffn/tp, must divide by 8), so the fused path is really exercised.
constexpr std::int64_t kFusionFfn = 64;

struct FusionFull {
    Tensor x, w1, b1, w2, b2, dy;
};

/// One step of a ParallelMLP (hidden kHidden, ffn kFusionFfn) on the given full tensors: y and every gradient.
/// `chunks`: the block's comm_chunks; `counts`, when given, receives the tp group's collectives of the step.
PairGot MlpStep(const MlpCase &c, bool fused, DeviceMesh &mesh, const FusionFull &full, bool main_grads, int chunks = 0,
                comm::CollectiveCounts *counts = nullptr) {
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp({.hidden = kHidden,
                         .ffn_hidden = kFusionFfn,
                         .bias = c.bias,
                         .sequence_parallel = sp,
                         .gelu_fusion = fused,
                         .comm_chunks = chunks},
                        Tp(mesh), WithName(Param(c.dtype), fused ? "fused" : "unfused"));
    SetFull(mlp.fc1->weight, full.w1);
    SetFull(mlp.fc2->weight, full.w2);
    if (c.bias) {
        SetFull(mlp.fc1->bias, full.b1);
        SetFull(mlp.fc2->bias, full.b2);
    }
    if (main_grads) {
        for (Variable *p : {&mlp.fc1->weight, &mlp.fc1->bias, &mlp.fc2->weight, &mlp.fc2->bias}) {
            if (p->defined()) {
                p->AllocateMainGrad();
            }
        }
    }
    Variable x(DistTensor::FromFull(full.x, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);
    ResetCounts(mesh);
    Variable y = mlp.Forward(x);
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh); // a local slice: no collective
    y.Backward(&dy);
    if (counts != nullptr) {
        *counts = mesh.group(mesh.dim_index("tp")).Counts();
    }
    return GatherPair(x, y, *mlp.fc1, *mlp.fc2, c.bias);
}

// The same parameters and data through the fused block (one autograd node) and the unfused one (fc1 → Gelu → fc2):
// on the CPU bit for bit (the fused kernels compute what the separate ones do); on CUDA within twice each output's
// bound against float64, both being within it — the half types' factors of the matrix test above, and for float32 the
// GELU-epilogue budget of the kernel tests (4 roundings: cuBLASLt evaluates gelu and gelu' its own way). Into the
// parameters' own gradients and into float32 main grads.
TEST_P(ParallelMLPFusionTest, FusedMatchesTheUnfusedComposition) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const Data data = Data::kRandom;
    const FusionFull full{.x = MakeFull({kSeq, kBatch, kHidden}, "x", data, c.dtype, 15),
                          .w1 = MakeFull({kFusionFfn, kHidden}, "w1", data, c.dtype, 15),
                          .b1 = MakeFull({kFusionFfn}, "b1", data, c.dtype, 15),
                          .w2 = MakeFull({kHidden, kFusionFfn}, "w2", data, c.dtype, 15),
                          .b2 = MakeFull({kHidden}, "b2", data, c.dtype, 15),
                          .dy = MakeFull({kSeq, kBatch, kHidden}, "dy", data, c.dtype, 15)};
    for (const bool main_grads : {false, true}) {
        SCOPED_TRACE(main_grads ? "float32 main grads" : "parameter grads");
        const PairGot fused = MlpStep(c, true, mesh, full, main_grads);
        const PairGot apart = MlpStep(c, false, mesh, full, main_grads);
        struct Output {
            const char *name;
            const Tensor &fused;
            const Tensor &apart;
            double factor; ///< the matrix test's half-precision factor against float64
        };
        const std::vector<Output> outputs = {
            {"y", fused.y, apart.y, HalfFactor(tp, 3)},
            {"dX", fused.dx, apart.dx, HalfFactor(tp, 3)},
            {"fc1 dW", fused.dw1, apart.dw1, HalfFactor(1, 2)},
            {"fc1 db", fused.db1, apart.db1, HalfFactor(1, 2)},
            {"fc2 dW", fused.dw2, apart.dw2, HalfFactor(1, 2)},
            {"fc2 db", fused.db2, apart.db2, HalfFactor(c.sequence_parallel ? tp : 1)}};
        for (const Output &o : outputs) {
            ASSERT_EQ(o.fused.defined(), o.apart.defined()) << o.name;
            if (!o.fused.defined()) {
                continue;
            }
            if (TestDevice().is_cpu()) {
                EXPECT_EQ(o.fused.ToDoubleVector(), o.apart.ToDoubleVector()) << o.name << ": bit for bit on the CPU";
                continue;
            }
            const double rtol = testing::RelativeTolerance(c.dtype) * 2.0 * (IsHalf(c.dtype) ? o.factor : 4.0);
            const std::string diff = testing::CompareValues(o.fused.ToDoubleVector(), o.apart.ToDoubleVector(), rtol);
            EXPECT_TRUE(diff.empty()) << o.name << ": " << diff;
        }
    }
}

std::vector<MlpCase> FusionCases() {
    std::vector<MlpCase> cases;
    std::vector<DType> dtypes = {DType::kFloat32};
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    dtypes.push_back(DType::kBFloat16);
#endif
    for (DType dtype : dtypes) {
        for (bool sp : {false, true}) {
            for (bool bias : {true, false}) {
                cases.push_back({.sequence_parallel = sp, .bias = bias, .input_grad = true, .dtype = dtype});
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParallelMLPFusionTest, ::testing::ValuesIn(FusionCases()), MlpCaseName);

// ---- the residual block: x + MLP(x), the add in the GEMMs -----------------------------------------------------------

/// One step of x + MLP(x) (fused block): ResidualForward, or Add(x, Forward(x)); x's batch split over "dp" when the
/// mesh has it.
PairGot ResidualStep(const MlpCase &c, bool fused, DeviceMesh &mesh, const FusionFull &full) {
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp({.hidden = kHidden, .ffn_hidden = kFusionFfn, .bias = c.bias, .sequence_parallel = sp},
                        Tp(mesh), WithName(Param(c.dtype), fused ? "residual" : "add"));
    SetFull(mlp.fc1->weight, full.w1);
    SetFull(mlp.fc2->weight, full.w2);
    if (c.bias) {
        SetFull(mlp.fc1->bias, full.b1);
        SetFull(mlp.fc2->bias, full.b2);
    }
    std::map<int, std::vector<int>> shards;
    if (sp) {
        shards[0] = {mesh.dim_index("tp")};
    }
    if (mesh.ndim() == 2) {
        shards[1] = {mesh.dim_index("dp")};
    }
    Variable x(DistTensor::FromFull(full.x, LayoutOf(3, shards), mesh), c.input_grad);
    Variable y = fused ? mlp.ResidualForward(x) : autograd::Add(x, mlp.Forward(x));
    const DistTensor dy = DistTensor::FromFull(full.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    return GatherPair(x, y, *mlp.fc1, *mlp.fc2, c.bias);
}

// x + MLP(x) with the add in fc2's GEMM (forward) and in fc1's dgrad GEMM (x's pass-through gradient), against
// Add(x, Forward(x)): on a tp mesh (tp > 1: the adds after the collectives) and on a [W, 1] dp × tp mesh (tp 1: the
// GEMMs add them, the README job's case). On the CPU bit for bit; on CUDA within the fusion test's bounds.
TEST_P(ParallelMLPFusionTest, ResidualForwardMatchesAddOfTheBlock) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    const Data data = Data::kRandom;
    const FusionFull full{.x = MakeFull({kSeq, kBatch * 2, kHidden}, "x", data, c.dtype, 16),
                          .w1 = MakeFull({kFusionFfn, kHidden}, "w1", data, c.dtype, 16),
                          .b1 = MakeFull({kFusionFfn}, "b1", data, c.dtype, 16),
                          .w2 = MakeFull({kHidden, kFusionFfn}, "w2", data, c.dtype, 16),
                          .b2 = MakeFull({kHidden}, "b2", data, c.dtype, 16),
                          .dy = MakeFull({kSeq, kBatch * 2, kHidden}, "dy", data, c.dtype, 16)};
    DeviceMesh dp_only(World(), {World().size(), 1}, {"dp", "tp"});
    for (DeviceMesh *mesh : {&TpMesh(), &dp_only}) {
        const std::int64_t tp = SizeOf(*mesh, "tp");
        SCOPED_TRACE(::testing::Message() << "tp " << tp << " of " << World().size() << " ranks");
        const PairGot fused = ResidualStep(c, true, *mesh, full);
        const PairGot apart = ResidualStep(c, false, *mesh, full);
        const std::vector<std::tuple<const char *, const Tensor &, const Tensor &, double>> outputs = {
            {"y", fused.y, apart.y, HalfFactor(tp, 3)},
            {"dX", fused.dx, apart.dx, HalfFactor(tp, 3)},
            {"fc1 dW", fused.dw1, apart.dw1, HalfFactor(1, 2)},
            {"fc2 dW", fused.dw2, apart.dw2, HalfFactor(1, 2)}};
        for (const auto &[name, f, a, factor] : outputs) {
            ASSERT_EQ(f.defined(), a.defined()) << name;
            if (!f.defined()) {
                continue;
            }
            if (TestDevice().is_cpu()) {
                EXPECT_EQ(f.ToDoubleVector(), a.ToDoubleVector()) << name << ": bit for bit on the CPU";
                continue;
            }
            const double rtol = testing::RelativeTolerance(c.dtype) * 2.0 * (IsHalf(c.dtype) ? factor : 4.0);
            const std::string diff = testing::CompareValues(f.ToDoubleVector(), a.ToDoubleVector(), rtol);
            EXPECT_TRUE(diff.empty()) << name << ": " << diff;
        }
    }
}

// ---- the block with chunked collective-GEMM pipelines (comm_chunks)
// --------------------------------------------------

class ParallelMLPPipelineTest : public ::testing::TestWithParam<MlpCase> {};

// comm_chunks = C on the block (fc1 and fc2): every collective of the step runs as C, with the same bytes, and the
// values are those of C = 0 within the fusion test's budget on both devices: a GEMM on fewer rows may take another
// kernel (cuBLASLt; and OpenBLAS, whose kernels for the core it detects need not round a row the same at every row
// count: on a VM where OpenBLAS 0.3.21 picked its Prescott or Haswell kernels, C = 3 changed the last bits of y and
// dX), and the GELU leaves the integers, so no operands make the whole block exact. The chunked pipelines' bitwise
// equality on integer-valued operands is asserted per layer in functional_pipeline_test.cc. C = 3 does not divide the
// rows at tp 2 and 4.
TEST_P(ParallelMLPPipelineTest, ChunkedStepMatchesTheUnchunkedWithEveryCollectiveSplitInC) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const Data data = Data::kRandom;
    const FusionFull full{.x = MakeFull({kSeq, kBatch, kHidden}, "x", data, c.dtype, 16),
                          .w1 = MakeFull({kFusionFfn, kHidden}, "w1", data, c.dtype, 16),
                          .b1 = MakeFull({kFusionFfn}, "b1", data, c.dtype, 16),
                          .w2 = MakeFull({kHidden, kFusionFfn}, "w2", data, c.dtype, 16),
                          .b2 = MakeFull({kHidden}, "b2", data, c.dtype, 16),
                          .dy = MakeFull({kSeq, kBatch, kHidden}, "dy", data, c.dtype, 16)};
    comm::CollectiveCounts plain_counts;
    const PairGot plain = MlpStep(c, c.gelu_fusion, mesh, full, false, 0, &plain_counts);
    for (int chunks : {2, 3}) {
        SCOPED_TRACE(fmt::format("comm_chunks {}", chunks));
        comm::CollectiveCounts counts;
        const PairGot got = MlpStep(c, c.gelu_fusion, mesh, full, false, chunks, &counts);
        for (int k = 0; k < comm::kNumCollectiveKinds; ++k) {
            const auto kind = static_cast<comm::CollectiveKind>(k);
            EXPECT_EQ(counts.Calls(kind), chunks * plain_counts.Calls(kind)) << comm::CollectiveName(kind);
            EXPECT_EQ(counts.Bytes(kind), plain_counts.Bytes(kind)) << comm::CollectiveName(kind);
        }
        const std::vector<std::pair<const char *, std::pair<const Tensor *, const Tensor *>>> outputs = {
            {"y", {&got.y, &plain.y}},          {"dX", {&got.dx, &plain.dx}},       {"fc1 dW", {&got.dw1, &plain.dw1}},
            {"fc1 db", {&got.db1, &plain.db1}}, {"fc2 dW", {&got.dw2, &plain.dw2}}, {"fc2 db", {&got.db2, &plain.db2}}};
        for (const auto &[name, pair] : outputs) {
            ASSERT_EQ(pair.first->defined(), pair.second->defined()) << name;
            if (!pair.first->defined()) {
                continue;
            }
            const double rtol =
                testing::RelativeTolerance(c.dtype) * 2.0 * (IsHalf(c.dtype) ? HalfFactor(SizeOf(mesh, "tp"), 3) : 4.0);
            const std::string diff =
                testing::CompareValues(pair.first->ToDoubleVector(), pair.second->ToDoubleVector(), rtol);
            EXPECT_TRUE(diff.empty()) << name << ": " << diff;
        }
    }
}

std::vector<MlpCase> PipelineCases() {
    std::vector<MlpCase> cases;
    for (bool sp : {false, true}) {
        for (bool fused : {true, false}) {
            for (bool input_grad : {true, false}) {
                cases.push_back({.sequence_parallel = sp, .input_grad = input_grad, .gelu_fusion = fused});
            }
        }
    }
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    cases.push_back({.sequence_parallel = true, .dtype = DType::kBFloat16});
#endif
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParallelMLPPipelineTest, ::testing::ValuesIn(PipelineCases()), MlpCaseName);

} // namespace
} // namespace shardline
