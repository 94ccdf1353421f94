// nn::MoEMLP (issue 16) on (dp, ep, tp) meshes — every ep in {1, 2, 4} and tp in {1, 2} that divides the world, with
// etp = tp and etp 1 below tp (the tp ranks split the tokens) — against the single-rank float64 dense reference
// (moe_reference.h): the output and every gradient (x, the gate, the experts' weights and biases, the routing weights),
// fp32 rtol 1e-5 through the router and bitwise with integer-valued operands for the expert path at a given routing;
// routings with zero-token experts, every token on one expert, topk 1 and 2, capacity drops; the exact all-to-all
// counts forward and backward (none at ep = 1); two runs bitwise equal; GradSync's Megatron reduction (router over dp
// and ep, experts over dp); errors on every rank before any collective.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/moe.h>

#include "moe_layer_case.h"

namespace shardline {
namespace {

using namespace moe_test;

class MoELayerTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoELayerTest, OutputAndEveryGradientMatchTheDenseReferenceWithExactAllToAllCounts) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MoeCase &c = GetParam();
    if (World().size() % (c.ep * c.tp) != 0) {
        GTEST_SKIP() << "ep·tp does not divide the world";
    }
    DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
    const std::int64_t chunks = Chunks(c);
    const std::int64_t per = kT / chunks;
    const std::int64_t capacity =
        c.capacity_factor < 0 ? -1 : static_cast<std::int64_t>(std::ceil(c.capacity_factor * per * c.topk / kE));
    const MoeSetup s = MakeSetup(c, chunks, capacity);
    const LayerRun got = RunLayer(c, mesh, s);
    const MoeResult want = ReferenceMoe(s.problem, s.dy.ToDoubleVector(), 0.0);

    const Data data = c.routing == Routing::kGiven ? Data::kInteger : Data::kRandom;
    const DType f32 = DType::kFloat32;
    EXPECT_TRUE(Matches(got.y, {kT, kH}, want.y, data, f32)) << "y";
    EXPECT_TRUE(Matches(got.dx, {kT, kH}, want.dx, data, f32)) << "dx";
    EXPECT_TRUE(Matches(got.dw1, {kE, kF, kH}, want.dw1, data, f32)) << "fc1 dW";
    EXPECT_TRUE(Matches(got.db1, {kE, kF}, want.db1, data, f32)) << "fc1 db";
    EXPECT_TRUE(Matches(got.dw2, {kE, kH, kF}, want.dw2, data, f32)) << "fc2 dW";
    EXPECT_TRUE(Matches(got.db2, {kE, kH}, want.db2, data, f32)) << "fc2 db";
    const std::int64_t chunk = ChunkOf(c, mesh);
    if (c.routing == Routing::kGiven) {
        const Values dw(want.dweights.begin() + chunk * per * c.topk,
                        want.dweights.begin() + (chunk + 1) * per * c.topk);
        EXPECT_TRUE(Matches(got.dweights, {per, c.topk}, dw, data, f32)) << "d weights";
    } else {
        EXPECT_TRUE(Matches(got.dwg, {kH, kE}, want.dwg, data, f32)) << "gate dW";
    }
    EXPECT_EQ(got.stats.tokens, per);
    EXPECT_EQ(got.stats.dropped, want.dropped[static_cast<std::size_t>(chunk)]);
    if (c.capacity_factor > 0) {
        EXPECT_GT(got.stats.dropped, 0) << "the capacity drops copies in every capacity case";
    }
    if (c.routing == Routing::kOneExpert && c.topk == 1) {
        EXPECT_EQ(got.stats.load_min(), 0) << "zero-token experts";
        EXPECT_EQ(got.stats.load_max(), capacity < 0 ? per : std::min(per, capacity));
    }
}

std::vector<MoeCase> Cases() {
    std::vector<MoeCase> cases;
    for (std::int64_t ep : {1, 2, 4}) {
        for (std::int64_t tp : {1, 2}) {
            if (ep * tp > 4) {
                continue;
            }
            // etp = tp (the experts split over tp), and etp 1 below tp (the tp ranks split the tokens).
            for (std::int64_t etp : tp > 1 ? std::vector<std::int64_t>{tp, 1} : std::vector<std::int64_t>{tp}) {
                cases.push_back({.ep = ep, .tp = tp, .topk = 2, .etp = etp});
                cases.push_back({.ep = ep, .tp = tp, .topk = 1, .etp = etp, .routing = Routing::kGiven});
                cases.push_back({.ep = ep, .tp = tp, .topk = 2, .etp = etp, .routing = Routing::kGiven});
                cases.push_back(
                    {.ep = ep, .tp = tp, .topk = 2, .etp = etp, .capacity_factor = 0.5, .routing = Routing::kGiven});
                cases.push_back({.ep = ep, .tp = tp, .topk = 1, .etp = etp, .routing = Routing::kOneExpert});
                cases.push_back({.ep = ep,
                                 .tp = tp,
                                 .topk = 2,
                                 .etp = etp,
                                 .capacity_factor = 1.0,
                                 .routing = Routing::kOneExpert});
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, MoELayerTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<MoeCase> &info) { return CaseName(info.param); });

/// The ep·tp of the world's largest expert-parallel mesh (ep as large as it goes, tp 1).
MoeCase WidestCase(Routing routing) {
    const std::int64_t ep = World().size() >= 4 ? 4 : World().size();
    return {.ep = ep, .tp = 1, .topk = 2, .routing = routing};
}

TEST(MoELayerDeterminismTest, TwoRunsGiveBitwiseTheSameOutputAndGradients) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    std::vector<MoeCase> cases = {WidestCase(Routing::kRouter)};
    if (World().size() >= 2) {
        cases.push_back({.ep = 2, .tp = World().size() / 2, .topk = 2});
        cases.push_back({.ep = 1, .tp = 2, .topk = 2, .etp = 1});
    }
    for (const MoeCase &c : cases) {
        DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
        const MoeSetup s = MakeSetup(c, Chunks(c), -1);
        const LayerRun a = RunLayer(c, mesh, s);
        const LayerRun b = RunLayer(c, mesh, s);
        const std::vector<std::pair<const char *, std::pair<Tensor, Tensor>>> pairs = {
            {"y", {a.y, b.y}},          {"dx", {a.dx, b.dx}},       {"gate dW", {a.dwg, b.dwg}},
            {"fc1 dW", {a.dw1, b.dw1}}, {"fc1 db", {a.db1, b.db1}}, {"fc2 dW", {a.dw2, b.dw2}},
            {"fc2 db", {a.db2, b.db2}}};
        for (const auto &[what, t] : pairs) {
            EXPECT_EQ(t.first.ToDoubleVector(), t.second.ToDoubleVector()) << what << " at " << CaseName(c);
        }
    }
}

// The experts' GELU with its gradient in fc2's grouped dgrad epilogue (gelu_fusion, the default) and as a separate
// GELU node give the same output and gradients: bit for bit on the CPU, where the same kernels run (on CUDA this fp32
// layer takes the GELU node either way).
TEST(MoELayerGeluFusionTest, FusedDGeluGivesTheGeluNodesOutputAndGradients) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    std::vector<MoeCase> cases = {WidestCase(Routing::kRouter),
                                  {.ep = 1, .tp = 1, .topk = 1, .routing = Routing::kOneExpert}};
    if (World().size() >= 2) {
        cases.push_back({.ep = 1, .tp = 2, .topk = 2});
        cases.push_back({.ep = 1, .tp = 2, .topk = 2, .etp = 1});
    }
    for (const MoeCase &c : cases) {
        DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
        const MoeSetup s = MakeSetup(c, Chunks(c), -1);
        const LayerRun fused = RunLayer(c, mesh, s);
        const LayerRun node = RunLayer(c, mesh, s, 0.0, 0.0, /*gelu_fusion=*/false);
        const std::vector<std::pair<const char *, std::pair<Tensor, Tensor>>> pairs = {
            {"y", {fused.y, node.y}},          {"dx", {fused.dx, node.dx}},       {"gate dW", {fused.dwg, node.dwg}},
            {"fc1 dW", {fused.dw1, node.dw1}}, {"fc1 db", {fused.db1, node.db1}}, {"fc2 dW", {fused.dw2, node.dw2}},
            {"fc2 db", {fused.db2, node.db2}}};
        for (const auto &[what, t] : pairs) {
            ASSERT_TRUE(t.first.defined() && t.second.defined()) << what << " at " << CaseName(c);
            EXPECT_EQ(t.first.ToDoubleVector(), t.second.ToDoubleVector()) << what << " at " << CaseName(c);
        }
    }
}

// The load-balancing and z losses: their mean over the data-parallel ranks, and their gradient into the gate.
TEST(MoELayerAuxLossTest, AuxAndZLossAndTheirGateGradientMatchTheReference) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MoeCase c = WidestCase(Routing::kRouter);
    DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
    const std::int64_t chunks = World().size() / c.tp;
    MoeSetup s = MakeSetup(c, chunks, -1);
    s.problem.aux_coeff = 0.01;
    s.problem.z_coeff = 0.001;
    nn::MoEMLP layer({.hidden = kH,
                      .ffn = kF,
                      .num_experts = kE,
                      .topk = c.topk,
                      .aux_loss_coeff = s.problem.aux_coeff,
                      .z_loss_coeff = s.problem.z_coeff},
                     mesh, WithName(Param(DType::kFloat32), "moe"));
    SetFull(layer.router_weight, s.wg);
    SetFull(layer.fc1_weight, s.w1);
    SetFull(layer.fc1_bias, s.b1);
    SetFull(layer.fc2_weight, s.w2);
    SetFull(layer.fc2_bias, s.b2);
    Variable x(DistTensor::Sharded(s.x, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), true);
    const nn::MoEOutput out = layer.Forward(x);
    ASSERT_TRUE(out.aux_loss.defined());
    out.aux_loss.Backward();
    const MoeResult want = ReferenceMoe(s.problem, Values(static_cast<std::size_t>(kT * kH), 0.0), 1.0);
    const Tensor aux = out.aux_loss.value().FullTensor();
    EXPECT_TRUE(Matches(aux, aux.shape(), {want.aux}, Data::kRandom, DType::kFloat32)) << "aux + z loss";
    EXPECT_TRUE(Matches(FullGrad(layer.router_weight), {kH, kE}, want.dwg, Data::kRandom, DType::kFloat32))
        << "gate dW of the auxiliary losses";
    EXPECT_TRUE(Matches(FullGrad(x), {kT, kH}, want.dx, Data::kRandom, DType::kFloat32)) << "dx";
}

// Megatron's reduction: the router's gradient over every data-parallel rank (dp and ep), the experts' over dp only.
TEST(MoELayerGradSyncTest, RouterReducesOverDpAndEpExpertsOverDpOnly) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 4) {
        GTEST_SKIP() << "needs dp 2 x ep 2";
    }
    const MoeCase c{.ep = 2, .tp = 1, .topk = 2};
    DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
    const MoeSetup s = MakeSetup(c, World().size(), -1);
    nn::MoEMLP layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = c.topk}, mesh,
                     WithName(Param(DType::kFloat32), "moe"));
    SetFull(layer.router_weight, s.wg);
    SetFull(layer.fc1_weight, s.w1);
    SetFull(layer.fc1_bias, s.b1);
    SetFull(layer.fc2_weight, s.w2);
    SetFull(layer.fc2_bias, s.b2);
    nn::GradSync sync(layer.Parameters(), mesh, {.dp_dims = {"dp", "ep"}});
    const int dp = mesh.dim_index("dp"), ep = mesh.dim_index("ep");
    EXPECT_EQ(sync.BucketDims(), (std::vector<std::vector<int>>{{dp}, {dp, ep}}))
        << "reverse registration order: the experts' bucket, then the router's";
    sync.ZeroGrad();
    Variable x(DistTensor::Sharded(s.x, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), true);
    const nn::MoEOutput out = layer.Forward(x);
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(s.dy, out.output.value().layout(), mesh);
    out.output.Backward(&dy);
    sync.Finish();
    EXPECT_EQ(mesh.group(dp).Counts().Calls(CollectiveKind::kAllReduce), 2) << "one per bucket over dp";
    EXPECT_EQ(mesh.group(ep).Counts().Calls(CollectiveKind::kAllReduce), 1) << "the router's bucket over ep";
    const MoeResult want = ReferenceMoe(s.problem, s.dy.ToDoubleVector(), 0.0);
    const DType f32 = DType::kFloat32;
    EXPECT_TRUE(Matches(FullGrad(layer.router_weight), {kH, kE}, want.dwg, Data::kRandom, f32)) << "gate dW";
    EXPECT_TRUE(Matches(FullGrad(layer.fc1_weight), {kE, kF, kH}, want.dw1, Data::kRandom, f32)) << "fc1 dW";
    EXPECT_TRUE(Matches(FullGrad(layer.fc2_bias), {kE, kH}, want.db2, Data::kRandom, f32)) << "fc2 db";
    EXPECT_FALSE(layer.fc1_weight.grad().layout().IsPartial()) << "reduced";
}

/// The message of `make()`'s error (or "threw nothing"), with no collective issued on any group.
TEST(MoELayerErrorTest, BadOptionsAndInputsAreRefusedOnEveryRankBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs an ep of 2";
    }
    const std::int64_t ep = World().size() >= 4 ? 4 : 2;
    DeviceMesh &mesh = MoeMesh(ep, 1);
    const nn::ParameterOptions param = Param(DType::kFloat32);
    std::string m = RefusedBeforeAnyCollective(
        mesh, [&] { nn::MoEMLP({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 5}, mesh, param); });
    EXPECT_NE(m.find("MoEMLP: 'moe': topk (5) must be in [1, num_experts] = [1, 4]"), std::string::npos) << m;
    m = RefusedBeforeAnyCollective(
        mesh, [&] { nn::MoEMLP({.hidden = kH, .ffn = kF, .num_experts = 5, .topk = 2}, mesh, param); });
    EXPECT_NE(m.find(fmt::format("MoEMLP: 'moe': num_experts (5) must be divisible by ep ({})", ep)), std::string::npos)
        << m;
    m = RefusedBeforeAnyCollective(mesh, [&] {
        nn::MoEMLP({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2, .ep_dim = "expert"}, mesh, param);
    });
    EXPECT_NE(m.find("MoEMLP: 'moe': the mesh has no dim named 'expert' (its dims are [dp, ep, tp]"), std::string::npos)
        << m;
    const nn::MoEMLP layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2}, mesh, param);
    const Tensor wide = MakeFull({kT, kH + 1}, "moe.wide", Data::kRandom, DType::kFloat32, 1);
    const Variable x(DistTensor::Sharded(wide, mesh, {{.dim = 0, .over = {"dp", "ep"}}}));
    m = RefusedBeforeAnyCollective(mesh, [&] { (void)layer.Forward(x); });
    EXPECT_NE(m.find("MoEMLP: 'moe': x must be [..., hidden] = [..., 8], got"), std::string::npos) << m;
    const Variable replicated(
        DistTensor::Replicated(MakeFull({kT, kH}, "moe.x", Data::kRandom, DType::kFloat32, 1), mesh));
    m = RefusedBeforeAnyCollective(mesh, [&] { (void)layer.Forward(replicated); });
    EXPECT_NE(m.find("must hold different tokens"), std::string::npos) << m;
}

} // namespace
} // namespace shardline
