// nn::MoEMLP (issue 16) on (dp, ep, tp) meshes — every ep in {1, 2, 4} and tp (= etp) in {1, 2} that divides the
// world — against the single-rank float64 dense reference (moe_reference.h): the output and every gradient (x, the
// gate, the experts' weights and biases, the routing weights), fp32 rtol 1e-5 through the router and bitwise with
// integer-valued operands for the expert path at a given routing; routings with zero-token experts, every token on one
// expert, topk 1 and 2, capacity drops; the exact all-to-all counts forward and backward (none at ep = 1); two runs
// bitwise equal; GradSync's Megatron reduction (router over dp and ep, experts over dp); errors on every rank before
// any collective.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/moe.h>

#include "moe_reference.h"
#include "moe_test_util.h"

namespace shardline {
namespace {

using namespace moe_test;

constexpr std::int64_t kT = 16; ///< global tokens: 4, 8 or 16 per data-parallel rank
constexpr std::int64_t kH = 8;
constexpr std::int64_t kF = 8;
constexpr std::int64_t kE = 4;

enum class Routing { kRouter, kOneExpert, kGiven };

struct MoeCase {
    std::int64_t ep = 1;
    std::int64_t tp = 1;
    int topk = 2;
    double capacity_factor = -1.0;
    Routing routing = Routing::kRouter;
};

std::string CaseName(const MoeCase &c) {
    const char *routing = c.routing == Routing::kRouter ? "router" : c.routing == Routing::kOneExpert ? "one" : "given";
    return fmt::format("ep{}_tp{}_top{}_{}_{}", c.ep, c.tp, c.topk, c.capacity_factor < 0 ? "dropless" : "capacity",
                       routing);
}

/// The problem's full tensors (the same on every rank) and the layer set to them.
struct MoeSetup {
    MoeProblem problem;
    Tensor x, wg, w1, b1, w2, b2, dy;
};

MoeSetup MakeSetup(const MoeCase &c, std::int64_t chunks, std::int64_t capacity) {
    const Data data = c.routing == Routing::kGiven ? Data::kInteger : Data::kRandom;
    const DType f32 = DType::kFloat32;
    MoeSetup s;
    s.x = MakeFull({kT, kH}, "moe.x", data, f32, 5);
    s.wg = MakeFull({kH, kE}, "moe.wg", Data::kRandom, f32, 5);
    if (c.routing == Routing::kOneExpert) {
        // A constant feature and a gate that reads it for expert 2 alone, the other features' gate weights scaled
        // down: every token's top choice is expert 2 (with topk 1 experts 0, 1 and 3 get no token), and the softmax is
        // not saturated (the gate's gradient stays well inside float32's range).
        std::vector<double> x = s.x.ToDoubleVector();
        std::vector<double> wg = s.wg.ToDoubleVector();
        for (std::int64_t t = 0; t < kT; ++t) {
            x[static_cast<std::size_t>(t * kH)] = 4.0;
        }
        for (double &w : wg) {
            w *= 0.05;
        }
        for (std::int64_t e = 0; e < kE; ++e) {
            wg[static_cast<std::size_t>(e)] = e == 2 ? 1.0 : 0.0;
        }
        s.x = Tensor::FromVector(x, {kT, kH}, f32).To(TestDevice());
        s.wg = Tensor::FromVector(wg, {kH, kE}, f32).To(TestDevice());
    }
    s.w1 = MakeFull({kE, kF, kH}, "moe.w1", data, f32, 5);
    s.b1 = MakeFull({kE, kF}, "moe.b1", data, f32, 5);
    s.w2 = MakeFull({kE, kH, kF}, "moe.w2", data, f32, 5);
    s.b2 = MakeFull({kE, kH}, "moe.b2", data, f32, 5);
    s.dy = MakeFull({kT, kH}, "moe.dy", data, f32, 5);
    MoeProblem &p = s.problem;
    p.tokens = kT;
    p.hidden = kH;
    p.ffn = kF;
    p.experts = kE;
    p.topk = c.topk;
    p.chunks = static_cast<int>(chunks);
    p.capacity = capacity;
    p.gelu = c.routing != Routing::kGiven;
    p.x = s.x.ToDoubleVector();
    p.wg = s.wg.ToDoubleVector();
    p.w1 = s.w1.ToDoubleVector();
    p.b1 = s.b1.ToDoubleVector();
    p.w2 = s.w2.ToDoubleVector();
    p.b2 = s.b2.ToDoubleVector();
    if (c.routing == Routing::kGiven) {
        // Expert 3 gets no token; weights 1/2 and 1/4 keep every product exact.
        for (std::int64_t t = 0; t < kT; ++t) {
            const std::int64_t first = t % 3;
            p.indices.push_back(first);
            p.weights.push_back(0.5);
            if (c.topk == 2) {
                p.indices.push_back((first + 1 + t % 2) % 3);
                p.weights.push_back(0.25);
            }
        }
    }
    return s;
}

struct LayerRun {
    Tensor y, dx, dwg, dw1, db1, dw2, db2, dweights;
    nn::MoEStats stats;
    double aux = 0.0;
};

/// One forward and backward of the layer on `mesh` (x sharded over dp and ep), with the exact all-to-all counts.
LayerRun RunLayer(const MoeCase &c, DeviceMesh &mesh, const MoeSetup &s, double aux_coeff = 0.0, double z_coeff = 0.0) {
    const bool given = c.routing == Routing::kGiven;
    nn::MoEMLP layer({.hidden = kH,
                      .ffn = kF,
                      .num_experts = kE,
                      .topk = c.topk,
                      .ep = c.ep,
                      .etp = c.tp,
                      .capacity_factor = c.capacity_factor,
                      .aux_loss_coeff = aux_coeff,
                      .z_loss_coeff = z_coeff,
                      .activation = !given},
                     mesh, WithName(Param(DType::kFloat32), "moe"));
    SetFull(layer.router_weight, s.wg);
    SetFull(layer.fc1_weight, s.w1);
    SetFull(layer.fc1_bias, s.b1);
    SetFull(layer.fc2_weight, s.w2);
    SetFull(layer.fc2_bias, s.b2);
    // The gradients stay Partial over the data-parallel dims (as under GradSync): backward issues only the layer's own
    // collectives; FullGrad reduces them afterwards.
    const int dp = mesh.dim_index("dp"), ep = mesh.dim_index("ep");
    layer.router_weight.set_deferred_partial({dp, ep});
    for (Variable *p : {&layer.fc1_weight, &layer.fc1_bias, &layer.fc2_weight, &layer.fc2_bias}) {
        p->set_deferred_partial({dp});
    }
    Variable x(DistTensor::Sharded(s.x, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), true);

    // This rank's tokens of a given routing.
    const std::int64_t chunk = mesh.coordinate()[0] * c.ep + mesh.coordinate()[1];
    const std::int64_t per = x.local().shape()[0];
    Variable weights;
    Tensor indices;
    if (given) {
        const auto &p = s.problem;
        std::vector<double> idx(p.indices.begin() + chunk * per * c.topk,
                                p.indices.begin() + (chunk + 1) * per * c.topk);
        std::vector<double> w(p.weights.begin() + chunk * per * c.topk, p.weights.begin() + (chunk + 1) * per * c.topk);
        indices = Tensor::FromVector(idx, {per, c.topk}, DType::kInt64).To(TestDevice());
        weights = Variable(Tensor::FromVector(w, {per, c.topk}, DType::kFloat32).To(TestDevice()), true);
    }

    ResetCounts(mesh);
    const nn::MoEOutput out = given ? layer.ForwardRouted(x, indices, weights) : layer.Forward(x);
    ExpectAllToAll(mesh, c.ep > 1 ? 3 : 0, c.tp > 1 ? 1 : 0, "forward: counts, rows, rows back; fc2's all-reduce");
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(s.dy, out.output.value().layout(), mesh);
    out.output.Backward(&dy);
    ExpectAllToAll(mesh, c.ep > 1 ? 2 : 0, c.tp > 1 ? 1 : 0, "backward: rows, rows back; fc1's dx all-reduce");

    LayerRun r;
    r.stats = out.stats;
    r.y = out.output.value().FullTensor();
    r.dx = FullGrad(x);
    r.dwg = given ? Tensor() : FullGrad(layer.router_weight);
    r.dw1 = FullGrad(layer.fc1_weight);
    r.db1 = FullGrad(layer.fc1_bias);
    r.dw2 = FullGrad(layer.fc2_weight);
    r.db2 = FullGrad(layer.fc2_bias);
    if (given) {
        r.dweights = weights.grad().local();
    }
    return r;
}

class MoELayerTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoELayerTest, OutputAndEveryGradientMatchTheDenseReferenceWithExactAllToAllCounts) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MoeCase &c = GetParam();
    if (World().size() % (c.ep * c.tp) != 0) {
        GTEST_SKIP() << "ep·tp does not divide the world";
    }
    DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
    const std::int64_t chunks = World().size() / c.tp;
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
    const std::int64_t chunk = mesh.coordinate()[0] * c.ep + mesh.coordinate()[1];
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
        EXPECT_EQ(got.stats.load_min, 0) << "zero-token experts";
        EXPECT_EQ(got.stats.load_max, capacity < 0 ? per : std::min(per, capacity));
    }
}

std::vector<MoeCase> Cases() {
    std::vector<MoeCase> cases;
    for (std::int64_t ep : {1, 2, 4}) {
        for (std::int64_t tp : {1, 2}) {
            if (ep * tp > 4) {
                continue;
            }
            cases.push_back({.ep = ep, .tp = tp, .topk = 2});
            cases.push_back({.ep = ep, .tp = tp, .topk = 1, .routing = Routing::kGiven});
            cases.push_back({.ep = ep, .tp = tp, .topk = 2, .routing = Routing::kGiven});
            cases.push_back({.ep = ep, .tp = tp, .topk = 2, .capacity_factor = 0.5, .routing = Routing::kGiven});
            cases.push_back({.ep = ep, .tp = tp, .topk = 1, .routing = Routing::kOneExpert});
            cases.push_back({.ep = ep, .tp = tp, .topk = 2, .capacity_factor = 1.0, .routing = Routing::kOneExpert});
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
    }
    for (const MoeCase &c : cases) {
        DeviceMesh &mesh = MoeMesh(c.ep, c.tp);
        const MoeSetup s = MakeSetup(c, World().size() / c.tp, -1);
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
template <class Make> std::string RefusedBeforeAnyCollective(DeviceMesh &mesh, Make make) {
    ResetCounts(mesh);
    std::string message = "threw nothing";
    try {
        make();
    } catch (const Error &e) {
        message = e.what();
    }
    ExpectAllToAll(mesh, 0, 0, "a refused configuration");
    return message;
}

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
