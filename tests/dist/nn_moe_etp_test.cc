// nn::MoEMLP with etp 1 below tp (issue 16; Megatron's expert_tensor_parallel_size 1): what the layer matrix of
// nn_moe_test.cc does not cover — an input already sharded over tp (sequence parallel: no token moves over tp),
// GradSync's reduction when tp is one more data-parallel dim of the router and of the replicated experts, and the
// refused etp values and shapes, on every rank before any collective.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/moe.h>

#include "moe_layer_case.h"

namespace shardline {
namespace {

using namespace moe_test;

/// The (ep, tp = 2) meshes of the world with etp 1: ep 1 (dp = world / 2) and, on 4 ranks, ep 2.
std::vector<MoeCase> EtpOneCases(Routing routing, bool x_over_tp) {
    std::vector<MoeCase> cases;
    for (std::int64_t ep : {1, 2}) {
        if (World().size() % (2 * ep) == 0) {
            cases.push_back({.ep = ep, .tp = 2, .topk = 2, .etp = 1, .routing = routing, .x_over_tp = x_over_tp});
        }
    }
    return cases;
}

/// The layer's output and gradients against the float64 dense reference (bitwise for integer data).
void ExpectMatchesReference(const MoeCase &c, DeviceMesh &mesh, const MoeSetup &s, const LayerRun &got) {
    const MoeResult want = ReferenceMoe(s.problem, s.dy.ToDoubleVector(), 0.0);
    const bool given = c.routing == Routing::kGiven;
    const Data data = given ? Data::kInteger : Data::kRandom;
    const DType f32 = DType::kFloat32;
    const std::string name = CaseName(c);
    EXPECT_TRUE(Matches(got.y, {kT, kH}, want.y, data, f32)) << "y at " << name;
    EXPECT_TRUE(Matches(got.dx, {kT, kH}, want.dx, data, f32)) << "dx at " << name;
    EXPECT_TRUE(Matches(got.dw1, {kE, kF, kH}, want.dw1, data, f32)) << "fc1 dW at " << name;
    EXPECT_TRUE(Matches(got.db1, {kE, kF}, want.db1, data, f32)) << "fc1 db at " << name;
    EXPECT_TRUE(Matches(got.dw2, {kE, kH, kF}, want.dw2, data, f32)) << "fc2 dW at " << name;
    EXPECT_TRUE(Matches(got.db2, {kE, kH}, want.db2, data, f32)) << "fc2 db at " << name;
    const std::int64_t per = kT / Chunks(c);
    const std::int64_t chunk = ChunkOf(c, mesh);
    if (given) {
        const Values dw(want.dweights.begin() + chunk * per * c.topk,
                        want.dweights.begin() + (chunk + 1) * per * c.topk);
        EXPECT_TRUE(Matches(got.dweights, {per, c.topk}, dw, data, f32)) << "d weights at " << name;
    } else {
        EXPECT_TRUE(Matches(got.dwg, {kH, kE}, want.dwg, data, f32)) << "gate dW at " << name;
    }
    EXPECT_EQ(got.stats.tokens, per) << name;
}

// x sharded over (dp, ep, tp) on its tokens: the tp ranks already hold different tokens, so the layer neither slices
// nor gathers; the output stays in x's layout and no collective runs on tp (RunLayer counts them).
TEST(MoELayerEtpTest, InputShardedOverTpMovesNoTokenOverTpAndMatchesTheReference) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs tp 2";
    }
    for (const Routing routing : {Routing::kRouter, Routing::kGiven}) {
        for (const MoeCase &c : EtpOneCases(routing, true)) {
            DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
            const MoeSetup s = MakeSetup(c, Chunks(c), -1);
            const LayerRun got = RunLayer(c, mesh, s);
            ExpectMatchesReference(c, mesh, s, got);
        }
    }
}

// Megatron's reduction with tp as a data-parallel dim of the MoE layer. GradSync (dp_dims {dp, ep}) buckets the router
// over dp and ep and the experts over dp; their gradients are Partial over tp as well. Given the layer's
// ExtraDataParallelDims, GradSync reduces tp inside the same buckets (router {dp, ep, tp}, experts {dp, tp}: Megatron's
// expert-data-parallel group); without them backward all-reduces each parameter's tp part as it completes (5: router,
// fc1 W and b, fc2 W and b). Either way every gradient ends reduced and equal to the reference.
TEST(MoELayerEtpTest, GradSyncReducesTheRouterAndTheExpertsOverTpAsWell) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs tp 2";
    }
    for (const bool extra : {true, false}) {
        for (const MoeCase &c : EtpOneCases(Routing::kRouter, false)) {
            DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
            const MoeSetup s = MakeSetup(c, Chunks(c), -1);
            nn::MoEMLP layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = c.topk, .etp = 1}, mesh,
                             WithName(Param(DType::kFloat32), "moe"));
            SetFull(layer.router_weight, s.wg);
            SetFull(layer.fc1_weight, s.w1);
            SetFull(layer.fc1_bias, s.b1);
            SetFull(layer.fc2_weight, s.w2);
            SetFull(layer.fc2_bias, s.b2);
            EXPECT_EQ(layer.fc1_weight.local().shape(), (Shape{kE / c.ep, kF, kH})) << "whole experts on every tp rank";
            EXPECT_EQ(layer.fc2_weight.local().shape(), (Shape{kE / c.ep, kH, kF})) << "whole experts on every tp rank";
            EXPECT_EQ(layer.ExtraDataParallelDims().size(), 5U) << "the router and the experts' weights and biases";
            nn::GradSync sync(layer.Parameters(), mesh,
                              {.dp_dims = {"dp", "ep"},
                               .extra_dp_dims = extra ? layer.ExtraDataParallelDims()
                                                      : std::vector<std::pair<Variable, std::vector<std::string>>>{}});
            const int dp = mesh.dim_index("dp"), ep = mesh.dim_index("ep"), tp = mesh.dim_index("tp");
            const auto live = [&](std::vector<int> dims) {
                std::erase_if(dims, [&](int d) { return mesh.shape()[static_cast<std::size_t>(d)] == 1; });
                return dims;
            };
            const std::vector<std::vector<int>> want_buckets =
                extra ? std::vector<std::vector<int>>{live({dp, tp}), live({dp, ep, tp})}
                      : std::vector<std::vector<int>>{live({dp}), live({dp, ep})};
            EXPECT_EQ(sync.BucketDims(), want_buckets)
                << CaseName(c) << (extra ? " with" : " without") << " extra dims";
            sync.ZeroGrad();
            Variable x(DistTensor::Sharded(s.x, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), true);
            const nn::MoEOutput out = layer.Forward(x);
            ResetCounts(mesh);
            const DistTensor dy = DistTensor::FromFull(s.dy, out.output.value().layout(), mesh);
            out.output.Backward(&dy);
            sync.Finish();
            const std::vector<std::vector<int>> buckets = sync.BucketDims();
            const auto reduces_over = [&](int d) {
                std::int64_t n = 0;
                for (const auto &dims : buckets) {
                    n += std::count(dims.begin(), dims.end(), d);
                }
                return mesh.shape()[static_cast<std::size_t>(d)] > 1 ? n : 0;
            };
            EXPECT_EQ(mesh.group(tp).Counts().Calls(CollectiveKind::kAllReduce), extra ? reduces_over(tp) : 5)
                << CaseName(c)
                << (extra ? ": one per bucket" : ": the router's and the four expert parameters' tp Partials");
            EXPECT_EQ(mesh.group(tp).Counts().Calls(CollectiveKind::kAllGather), 1) << CaseName(c) << ": dx over tp";
            EXPECT_EQ(mesh.group(dp).Counts().Calls(CollectiveKind::kAllReduce), reduces_over(dp)) << CaseName(c);
            EXPECT_EQ(mesh.group(ep).Counts().Calls(CollectiveKind::kAllReduce), reduces_over(ep)) << CaseName(c);
            const MoeResult want = ReferenceMoe(s.problem, s.dy.ToDoubleVector(), 0.0);
            const DType f32 = DType::kFloat32;
            for (const Variable *p :
                 {&layer.router_weight, &layer.fc1_weight, &layer.fc1_bias, &layer.fc2_weight, &layer.fc2_bias}) {
                EXPECT_FALSE(p->grad().layout().IsPartial()) << p->name() << " reduced at " << CaseName(c);
            }
            EXPECT_TRUE(Matches(FullGrad(layer.router_weight), {kH, kE}, want.dwg, Data::kRandom, f32)) << "gate dW";
            EXPECT_TRUE(Matches(FullGrad(layer.fc1_weight), {kE, kF, kH}, want.dw1, Data::kRandom, f32)) << "fc1 dW";
            EXPECT_TRUE(Matches(FullGrad(layer.fc1_bias), {kE, kF}, want.db1, Data::kRandom, f32)) << "fc1 db";
            EXPECT_TRUE(Matches(FullGrad(layer.fc2_weight), {kE, kH, kF}, want.dw2, Data::kRandom, f32)) << "fc2 dW";
            EXPECT_TRUE(Matches(FullGrad(layer.fc2_bias), {kE, kH}, want.db2, Data::kRandom, f32)) << "fc2 db";
            EXPECT_TRUE(Matches(FullGrad(x), {kT, kH}, want.dx, Data::kRandom, f32)) << "dx";
        }
    }
}

// The auxiliary losses with tp as a token dim: each rank's losses over its slice, averaged over every rank (dp, ep and
// tp), and their gradient into the gate.
TEST(MoELayerEtpTest, AuxLossAveragesOverTheTpRanksToo) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs tp 2";
    }
    for (const MoeCase &c : EtpOneCases(Routing::kRouter, false)) {
        DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
        MoeSetup s = MakeSetup(c, Chunks(c), -1);
        s.problem.aux_coeff = 0.01;
        s.problem.z_coeff = 0.001;
        nn::MoEMLP layer({.hidden = kH,
                          .ffn = kF,
                          .num_experts = kE,
                          .topk = c.topk,
                          .etp = 1,
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
        EXPECT_TRUE(Matches(aux, aux.shape(), {want.aux}, Data::kRandom, DType::kFloat32))
            << "aux + z loss at " << CaseName(c);
        EXPECT_TRUE(Matches(FullGrad(layer.router_weight), {kH, kE}, want.dwg, Data::kRandom, DType::kFloat32))
            << "gate dW of the auxiliary losses at " << CaseName(c);
        EXPECT_TRUE(Matches(FullGrad(x), {kT, kH}, want.dx, Data::kRandom, DType::kFloat32)) << "dx at " << CaseName(c);
    }
}

/// The message of `make()`'s error (or "threw nothing"), with no collective issued on any group.
TEST(MoELayerEtpTest, EtpOtherThanOneOrTpAndUnevenTokenSlicesAreRefusedOnEveryRankBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs tp 2";
    }
    const nn::ParameterOptions param = Param(DType::kFloat32);
    DeviceMesh &mesh = MoeMesh(1, 2);
    for (const std::int64_t etp : {3, 4, -1}) {
        const std::string m = RefusedBeforeAnyCollective(mesh, [&] {
            nn::MoEMLP({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2, .etp = etp}, mesh, param);
        });
        EXPECT_NE(m.find(fmt::format("MoEMLP: 'moe': etp ({}) must be 1 or the size of mesh dim 'tp' (2) (supported: "
                                     "{{1, 2}}",
                                     etp)),
                  std::string::npos)
            << m;
    }
    if (World().size() >= 4) {
        // 1 < etp < tp: an expert-tp group inside each tp group, which one mesh dim cannot be.
        DeviceMesh &wide = MoeMesh(1, 4);
        const std::string m = RefusedBeforeAnyCollective(
            wide, [&] { nn::MoEMLP({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2, .etp = 2}, wide, param); });
        EXPECT_NE(m.find("MoEMLP: 'moe': etp (2) must be 1 or the size of mesh dim 'tp' (4) (supported: {1, 4}"),
                  std::string::npos)
            << m;
    }
    // The tp ranks split x's dim 0 evenly: 2·world + 1 rows cannot be.
    const nn::MoEMLP layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2, .etp = 1}, mesh, param);
    const std::int64_t rows = 2 * World().size() + 1;
    const Tensor odd = MakeFull({rows, kH}, "moe.odd", Data::kRandom, DType::kFloat32, 1);
    const Variable x(DistTensor::Sharded(odd, mesh, {{.dim = 0, .over = {"dp", "ep"}}}));
    std::string m = RefusedBeforeAnyCollective(mesh, [&] { (void)layer.Forward(x); });
    EXPECT_NE(m.find(fmt::format("MoEMLP: 'moe': with etp 1 below tp (2) the tp ranks split x's dim 0 among them: "
                                 "x.shape[0] ({}) must be divisible by the {} ranks",
                                 rows, World().size())),
              std::string::npos)
        << m;
    // The features stay whole.
    const Variable split_features(DistTensor::Sharded(MakeFull({kT, kH}, "moe.x", Data::kRandom, DType::kFloat32, 1),
                                                      mesh,
                                                      {{.dim = 0, .over = {"dp", "ep"}}, {.dim = 1, .over = {"tp"}}}));
    m = RefusedBeforeAnyCollective(mesh, [&] { (void)layer.Forward(split_features); });
    EXPECT_NE(m.find("MoEMLP: 'moe': x must have whole features and no Partial"), std::string::npos) << m;
}

} // namespace
} // namespace shardline
