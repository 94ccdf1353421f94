// autograd::ParallelMLPWithResidual — x + ParallelMLP(x) with the add in the GEMMs (fc2's residual, fc1's dx_residual)
// — on the CPU over MPI at np 1, 2, 4: float64 gradients against central finite differences of the distributed
// forward; values and gradients equal to Add(x, ParallelMLP(x)) bit for bit in float32 and float64 (tp 1: the GEMMs
// add the residual; tp > 1: it is added after fc2's reduction and fc1's dx collective), with and without sequence
// parallelism, on a dp×tp mesh, for every subset of inputs that need a gradient, with the same collectives; at tp 1 no
// Add kernel runs (a counting provider); a block that does not keep the hidden size raises before any collective.

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/ops.h>

#include "dist_tensor_test_util.h"
#include "parallel_mlp_test_util.h"
#include "reference.h"

namespace shardline {
namespace {

using namespace dist_test;
using namespace parallel_mlp_test;
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using testing::Values;

/// This file's problem values (autograd_parallel_mlp_test.cc uses the header's default seed).
constexpr std::uint64_t kSeed = 43;

Variable Fused(Leaves &l, const TensorParallelGroup &tp, bool sp) {
    return autograd::ParallelMLPWithResidual(l.x, l.w1, l.b1, l.w2, l.b2, Fc1(sp), Fc2(sp), tp);
}
Variable Apart(Leaves &l, const TensorParallelGroup &tp, bool sp) {
    return autograd::Add(l.x, autograd::ParallelMLP(l.x, l.w1, l.b1, l.w2, l.b2, Fc1(sp), Fc2(sp), tp));
}

// ---- gradients against finite differences ------------------------------------------------------------------------

class ParallelMlpResidualGradTest : public ::testing::TestWithParam<bool> {};

// L = Σ y ⊙ r with y = x + MLP(x), distributed, in float64: autograd's gradients of every input against central
// differences of L. x's gradient is r (the pass-through) plus the MLP's, out of one dgrad GEMM at tp 1.
TEST_P(ParallelMlpResidualGradTest, Float64GradientsMatchCentralDifferences) {
    const bool sp = GetParam();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat64, 1, kSeed);
    Leaves l = MakeLeaves(p, mesh, sp);
    const Result got = Step([&](Leaves &v) { return Fused(v, tp, sp); }, l, p.dy);
    ExpectGradsMatchCentralDifferences(got, p, mesh, sp, [&](Leaves &v) { return Fused(v, tp, sp); });
    // The pass-through is really in dx: dx minus the MLP alone's dx is dy.
    Leaves mlp_only = MakeLeaves(p, mesh, sp);
    const Result plain =
        Step([&](Leaves &v) { return autograd::ParallelMLP(v.x, v.w1, v.b1, v.w2, v.b2, Fc1(sp), Fc2(sp), tp); },
             mlp_only, p.dy);
    const Values r = p.dy.ToDoubleVector();
    const Values dx = got.grads[0].ToDoubleVector();
    const Values dx_mlp = plain.grads[0].ToDoubleVector();
    Values pass(dx.size());
    for (std::size_t k = 0; k < dx.size(); ++k) {
        pass[k] = dx[k] - dx_mlp[k];
    }
    EXPECT_TRUE(testing::CompareValues(pass, r, 1e-12, 1e-12).empty()) << "dx - dx(MLP) is dy";
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, ParallelMlpResidualGradTest, ::testing::Bool(),
                         [](const auto &info) { return info.param ? "sequenceparallel" : "tensorparallel"; });

// ---- Add(x, ParallelMLP(x)), bit for bit
// -----------------------------------------------------------------------------

// On the CPU the GEMM adds a separate C after its product and bias, and after a reduction the add is the same Add, so
// the fused block equals Add(x, ParallelMLP(x)) bit for bit — on a tp mesh and on dp×tp (at np 2 that is dp 2 × tp 1:
// the residual in the GEMMs with a batch split over dp), with and without sequence parallelism, in float32 and float64
// — and issues the same collectives (the residual adds none).
TEST(ParallelMlpResidualTest, MatchesAddOfTheMlpBitForBit) {
    ExpectSameBitsAndCollectivesOnEveryMesh(Fused, Apart, kSeed, "the residual issues no collective");
}

// needs_input_grad still decides: for every subset of inputs that need a gradient, exactly those gradients come out,
// equal bit for bit to Add(x, ParallelMLP(x))'s (x without a gradient: no dx and no pass-through; only x: dx alone).
TEST(ParallelMlpResidualTest, EverySubsetOfNeededGradientsMatchesTheAdd) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32, kBatch, kSeed);
    for (int mask = 1; mask < 32; ++mask) {
        Needs needs{};
        for (std::size_t i = 0; i < 5; ++i) {
            needs[i] = ((mask >> i) & 1) != 0;
        }
        SCOPED_TRACE(::testing::Message() << "needs mask " << mask);
        Leaves fused = MakeLeaves(p, mesh, false, needs);
        Leaves apart = MakeLeaves(p, mesh, false, needs);
        const Result a = Step([&](Leaves &v) { return Apart(v, tp, false); }, apart, p.dy);
        const Result f = Step([&](Leaves &v) { return Fused(v, tp, false); }, fused, p.dy);
        for (std::size_t i = 0; i < 5; ++i) {
            EXPECT_EQ(f.grads[i].defined(), needs[i]) << kNames[i];
        }
        ExpectSameBits(f, a);
    }
}

// ---- where the adds run -------------------------------------------------------------------------------------------

constexpr std::string_view kCountingAdd = "residual-counting-add";
int g_adds = 0;
kernels::AddOp::Fn g_add = nullptr;
void CountAdd(const kernels::AddArgs &args) {
    ++g_adds;
    g_add(args);
}

// The Add kernel served by a counting wrapper around the CPU's default one: at tp 1 the fused block runs none (the
// residual is fc2's GEMM's C, x's pass-through gradient fc1's dgrad GEMM's C, and x's two gradients are never summed),
// where Add(x, ParallelMLP(x)) runs two (the forward add and the engine's sum of x's gradients); at tp > 1 it runs one
// after fc2's all-reduce and one after fc1's dx all-reduce.
TEST(ParallelMlpResidualTest, AtTpOneTheGemmsAddTheResidualAndNoAddKernelRuns) {
    kernels::ResetProviderSelection();
    g_add = kernels::OpTable<kernels::AddOp>::Resolve(DeviceType::kCPU).fn;
    kernels::Register<kernels::AddOp>(DeviceType::kCPU, kCountingAdd, &CountAdd);
    kernels::SetProvider(kCountingAdd);
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32, kBatch, kSeed);
    Leaves fused = MakeLeaves(p, mesh, false);
    Leaves apart = MakeLeaves(p, mesh, false);
    g_adds = 0;
    const Result a = Step([&](Leaves &v) { return Apart(v, tp, false); }, apart, p.dy);
    const int apart_adds = g_adds;
    g_adds = 0;
    const Result f = Step([&](Leaves &v) { return Fused(v, tp, false); }, fused, p.dy);
    const int fused_adds = g_adds;
    kernels::UnregisterProviderEverywhere(kCountingAdd);
    kernels::ResetProviderSelection();
    ExpectSameBits(f, a);
    EXPECT_EQ(apart_adds, 2) << "Add(x, MLP(x)): the forward add and the sum of x's two gradients";
    EXPECT_EQ(fused_adds, w == 1 ? 0 : 2) << "tp " << w;
}

// A block whose output is not x's size cannot add x: every rank raises the same error before any collective.
TEST(ParallelMlpResidualTest, ABlockThatChangesTheHiddenSizeIsRejectedBeforeAnyCollective) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32, kBatch, kSeed);
    Leaves l = MakeLeaves(p, mesh, false);
    const Tensor w2_narrow = Full({kHidden - 2, kFfn}, "w2", DType::kFloat32, kSeed);
    const Tensor b2_narrow = Full({kHidden - 2}, "b2", DType::kFloat32, kSeed);
    const Variable w2(DistTensor::Sharded(w2_narrow, mesh, {{.dim = 1, .over = {"tp"}}}), true);
    const Variable b2(DistTensor::Replicated(b2_narrow, mesh), true);
    RowParallelLinearOptions fc2 = Fc2(false);
    fc2.out_features = kHidden - 2;
    ResetCounts(mesh);
    try {
        (void)autograd::ParallelMLPWithResidual(l.x, l.w1, l.b1, w2, b2, Fc1(false), fc2, tp);
        ADD_FAILURE() << "no error for a block of 8 -> 6 features";
    } catch (const ShapeError &e) {
        EXPECT_THAT(e.what(),
                    ::testing::AllOf(::testing::HasSubstr("autograd::ParallelMLPWithResidual"),
                                     ::testing::HasSubstr("fc2's out_features (6) to be fc1's in_features (8)")));
    }
    EXPECT_EQ(mesh.group("tp").Counts().TotalCalls(), 0);
}

} // namespace
} // namespace shardline
