// autograd::ParallelMLP — column → GELU → row as one Function, the GELU in fc1's GEMM epilogue and its gradient (with
// fc1's bias grad) in fc2's dgrad — on the CPU over MPI at np 1, 2, 4: float64 gradients against central finite
// differences of the distributed forward; values and gradients equal to the unfused composition
// (ColumnParallelLinear → Gelu → RowParallelLinear) bit for bit in float32 and float64, also on a dp×tp mesh and into
// main grads; needs_input_grad decides which backward kernels run (a counting kernel provider), which collectives are
// issued and what the graph keeps (storage holders); bad combinations raise before any collective.

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
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

Variable Fused(Leaves &l, const TensorParallelGroup &tp, bool sp) {
    return autograd::ParallelMLP(l.x, l.w1, l.b1, l.w2, l.b2, Fc1(sp), Fc2(sp), tp);
}
Variable Unfused(Leaves &l, const TensorParallelGroup &tp, bool sp) {
    const Variable h = autograd::ColumnParallelLinear(l.x, l.w1, l.b1, Fc1(sp), tp);
    return autograd::RowParallelLinear(autograd::Gelu(h), l.w2, l.b2, Fc2(sp), tp);
}

std::int64_t TpCalls(DeviceMesh &mesh, CollectiveKind kind) { return mesh.group("tp").Counts().Calls(kind); }

// ---- gradients against finite differences ------------------------------------------------------------------------

class ParallelMlpGradTest : public ::testing::TestWithParam<bool> {};

// L = Σ y ⊙ r with y the distributed fused MLP in float64: autograd's gradients of every input against central
// differences of L (each evaluation runs the forward with its collectives on every rank alike).
TEST_P(ParallelMlpGradTest, Float64GradientsMatchCentralDifferences) {
    const bool sp = GetParam();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat64, 1);
    Leaves l = MakeLeaves(p, mesh, sp);
    const Result got = Step([&](Leaves &v) { return Fused(v, tp, sp); }, l, p.dy);
    ExpectGradsMatchCentralDifferences(got, p, mesh, sp, [&](Leaves &v) { return Fused(v, tp, sp); });
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, ParallelMlpGradTest, ::testing::Bool(),
                         [](const auto &info) { return info.param ? "sequenceparallel" : "tensorparallel"; });

// ---- the unfused composition, bit for bit -------------------------------------------------------------------------

// On the CPU the fused kernels compute exactly what the separate ones do, so the whole step agrees bit for bit with
// ColumnParallelLinear → Gelu → RowParallelLinear: on a tp mesh and on dp×tp (parameter gradients Partial over dp,
// reduced by the engine), with and without sequence parallelism, in float32 and float64.
TEST(ParallelMlpTest, MatchesTheUnfusedCompositionBitForBit) {
    ExpectSameBitsAndCollectivesOnEveryMesh(Fused, Unfused, 41, "the fused MLP issues the unfused one's collectives");
}

TEST(ParallelMlpTest, MainGradsAccumulateAsTheUnfusedOnesDo) {
    // Every parameter has a float32 main grad; two backward passes accumulate into it (beta = 1, fc1's bias grad too).
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32);
    Leaves fused = MakeLeaves(p, mesh, false);
    Leaves apart = MakeLeaves(p, mesh, false);
    for (Leaves *l : {&fused, &apart}) {
        for (std::size_t i = 1; i < 5; ++i) {
            l->all()[i]->AllocateMainGrad();
        }
    }
    Result f, a;
    for (int pass = 0; pass < 2; ++pass) {
        a = Step([&](Leaves &v) { return Unfused(v, tp, false); }, apart, p.dy);
        f = Step([&](Leaves &v) { return Fused(v, tp, false); }, fused, p.dy);
    }
    ExpectSameBits(f, a);
    for (std::size_t i = 1; i < 5; ++i) {
        Variable &v = *fused.all()[i];
        EXPECT_EQ(v.grad().local().data(), v.impl()->main_grad.data()) << kNames[i] << " lives in its main grad";
    }
}

// ---- needs_input_grad: the kernels, the collectives and the saved tensors ----------------------------------------

constexpr std::string_view kCounting = "mlp-counting";

struct KernelCalls {
    int input = 0;            ///< LinearBackwardInput (a dgrad)
    int input_with_gelu = 0;  ///< ... that undid the GELU (fc2's)
    int input_with_db1 = 0;   ///< ... that also gave fc1's bias grad
    int weight = 0;           ///< LinearBackwardWeight (a wgrad)
    int weight_with_bias = 0; ///< ... with its bias grad fused
    int bias = 0;             ///< LinearBackwardBias (a separate column sum)
};
KernelCalls g_calls;
kernels::LinearBackwardInputOp::Fn g_input = nullptr;
kernels::LinearBackwardWeightOp::Fn g_weight = nullptr;
kernels::LinearBackwardBiasOp::Fn g_bias = nullptr;

void CountInput(const kernels::LinearBackwardInputArgs &args) {
    ++g_calls.input;
    g_calls.input_with_gelu += args.input_activation == kernels::LinearActivation::kGeluTanh ? 1 : 0;
    g_calls.input_with_db1 += args.pre_activation_dbias != nullptr ? 1 : 0;
    g_input(args);
}
void CountWeight(const kernels::LinearBackwardWeightArgs &args) {
    ++g_calls.weight;
    g_calls.weight_with_bias += args.dbias != nullptr ? 1 : 0;
    g_weight(args);
}
void CountBias(const kernels::LinearBackwardBiasArgs &args) {
    ++g_calls.bias;
    g_bias(args);
}

std::string NeedsName(const ::testing::TestParamInfo<int> &info) {
    std::string s;
    for (std::size_t i = 0; i < 5; ++i) {
        if ((info.param >> i) & 1) {
            s += std::string(kNames[i]).substr(1);
        }
    }
    return s;
}

/// The backward kernels served by counting wrappers around the CPU's default ones (the Gemm underneath stays default).
class ParallelMlpNeedsTest : public ::testing::TestWithParam<int> {
protected:
    void SetUp() override {
        kernels::ResetProviderSelection();
        g_input = kernels::OpTable<kernels::LinearBackwardInputOp>::Resolve(DeviceType::kCPU).fn;
        g_weight = kernels::OpTable<kernels::LinearBackwardWeightOp>::Resolve(DeviceType::kCPU).fn;
        g_bias = kernels::OpTable<kernels::LinearBackwardBiasOp>::Resolve(DeviceType::kCPU).fn;
        kernels::Register<kernels::LinearBackwardInputOp>(DeviceType::kCPU, kCounting, &CountInput);
        kernels::Register<kernels::LinearBackwardWeightOp>(DeviceType::kCPU, kCounting, &CountWeight);
        kernels::Register<kernels::LinearBackwardBiasOp>(DeviceType::kCPU, kCounting, &CountBias);
    }
    void TearDown() override {
        kernels::UnregisterProviderEverywhere(kCounting);
        kernels::ResetProviderSelection();
    }
};

// Each input requires a gradient or not (a frozen weight, an input without grad): only the gradients needed are
// computed, with exactly their kernels — fc2's dgrad (undoing the GELU, with fc1's bias grad when b1 needs one) only
// for something below fc2, fc1's backward only for x or W1 — the dx all-reduce only when x needs a gradient, and the
// graph keeps x only for dW1, W1 only for dx and W2 only for something below fc2.
TEST_P(ParallelMlpNeedsTest, RunsSavesAndCommunicatesOnlyForTheGradientsNeeded) {
    Needs needs{};
    for (std::size_t i = 0; i < 5; ++i) {
        needs[i] = ((GetParam() >> i) & 1) != 0;
    }
    const bool x = needs[0], w1 = needs[1], b1 = needs[2], w2 = needs[3], b2 = needs[4];
    const bool below_fc2 = x || w1 || b1;
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32);
    Leaves apart = MakeLeaves(p, mesh, false, needs);
    const Result want = Step([&](Leaves &v) { return Unfused(v, tp, false); }, apart, p.dy);

    Leaves l = MakeLeaves(p, mesh, false, needs);
    const long x_holders = l.x.local().storage().use_count();
    const long w1_holders = l.w1.local().storage().use_count();
    const long w2_holders = l.w2.local().storage().use_count();
    Variable y = Fused(l, tp, false);
    EXPECT_EQ(l.x.local().storage().use_count(), x_holders + (w1 ? 1 : 0)) << "x kept only for dW1";
    EXPECT_EQ(l.w1.local().storage().use_count(), w1_holders + (x ? 1 : 0)) << "W1 kept only for dx";
    EXPECT_EQ(l.w2.local().storage().use_count(), w2_holders + (below_fc2 ? 1 : 0)) << "W2 kept only below fc2";

    kernels::SetProvider(kCounting);
    g_calls = {};
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(p.dy, y.value().layout(), mesh);
    y.Backward(&dy);
    kernels::ResetProviderSelection();
    EXPECT_EQ(g_calls.input, (below_fc2 ? 1 : 0) + (x ? 1 : 0)) << "dgrads";
    EXPECT_EQ(g_calls.input_with_gelu, below_fc2 ? 1 : 0) << "fc2's dgrad undoes the GELU";
    EXPECT_EQ(g_calls.input_with_db1, b1 ? 1 : 0) << "fc1's bias grad rides in fc2's dgrad";
    EXPECT_EQ(g_calls.weight, (w1 ? 1 : 0) + (w2 ? 1 : 0)) << "wgrads";
    EXPECT_EQ(g_calls.weight_with_bias, w2 && b2 ? 1 : 0) << "fc2's bias grad in its wgrad";
    EXPECT_EQ(g_calls.bias, b2 && !w2 ? 1 : 0) << "fc2's bias grad alone";
    EXPECT_EQ(TpCalls(mesh, CollectiveKind::kAllReduce), x && w > 1 ? 1 : 0) << "dx all-reduced only when wanted";
    EXPECT_EQ(mesh.group("tp").Counts().TotalCalls(), x && w > 1 ? 1 : 0);

    Result got{.y = y.value().FullTensor(), .grads = {}};
    for (Variable *v : l.all()) {
        got.grads.push_back(v->grad().defined() ? v->grad().FullTensor() : Tensor());
    }
    ExpectSameBits(got, want);
    for (std::size_t i = 0; i < 5; ++i) {
        EXPECT_EQ(got.grads[i].defined(), needs[i]) << kNames[i];
    }
}

INSTANTIATE_TEST_SUITE_P(EverySubset, ParallelMlpNeedsTest, ::testing::Range(1, 32), NeedsName);

// ---- errors -------------------------------------------------------------------------------------------------------

TEST(ParallelMlpTest, LayersThatDoNotMakeAnMlpRaiseBeforeAnyCollective) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    const Problem p = MakeProblem(DType::kFloat32);
    Leaves l = MakeLeaves(p, mesh, false);
    auto expect_error = [&](ColumnParallelLinearOptions fc1, RowParallelLinearOptions fc2, const std::string &part) {
        ResetCounts(mesh);
        try {
            (void)autograd::ParallelMLP(l.x, l.w1, l.b1, l.w2, l.b2, fc1, fc2, tp);
            ADD_FAILURE() << "no error; expected: " << part;
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find("autograd::ParallelMLP"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
        EXPECT_EQ(mesh.group("tp").Counts().TotalCalls(), 0) << part;
    };
    ColumnParallelLinearOptions gather = Fc1(false);
    gather.gather_output = true;
    expect_error(gather, Fc2(false), "gather_output must be false");
    ColumnParallelLinearOptions skip = Fc1(false);
    skip.skip_bias_add = true;
    expect_error(skip, Fc2(false), "skip_bias_add must be false");
    RowParallelLinearOptions replicated = Fc2(false);
    replicated.input_is_parallel = false;
    expect_error(Fc1(false), replicated, "input_is_parallel must be true");
    expect_error(Fc1(true), Fc2(false), "must agree on sequence_parallel");
    RowParallelLinearOptions wider = Fc2(false);
    wider.in_features = 2 * kFfn;
    expect_error(Fc1(false), wider,
                 fmt::format("fc1's out_features ({}) must be fc2's in_features ({})", kFfn, 2 * kFfn));
    // fc2's weight of the wrong shape, and (tp > 1) in fc1's layout.
    std::vector<std::pair<Variable, std::string>> wrong = {
        {Variable(DistTensor::Replicated(Full({kHidden, kFfn + 1}, "w2", DType::kFloat32), mesh), true),
         fmt::format("weight must be [{}, {}]", kHidden, kFfn)}};
    if (w > 1) {
        wrong.emplace_back(Variable(DistTensor::Sharded(p.w2, mesh, {{.dim = 0, .over = {"tp"}}}), true),
                           "weight must have layout");
    }
    for (const auto &[w2, part] : wrong) {
        ResetCounts(mesh);
        try {
            (void)autograd::ParallelMLP(l.x, l.w1, l.b1, w2, l.b2, Fc1(false), Fc2(false), tp);
            ADD_FAILURE() << "no error; expected: " << part;
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
        EXPECT_EQ(mesh.group("tp").Counts().TotalCalls(), 0) << part;
    }
}

} // namespace
} // namespace shardline
