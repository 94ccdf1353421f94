#pragma once

// The MoE layer cases of nn_moe_test.cc and nn_moe_etp_test.cc: the problem (the same full tensors on every rank, a
// float64 dense reference of it) and one forward and backward of nn::MoEMLP on a (dp, ep, tp) mesh with the exact
// collective counts of each phase.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/nn/moe.h>

#include "moe_reference.h"
#include "moe_test_util.h"

namespace shardline::moe_test {

constexpr std::int64_t kT = 16; ///< global tokens: 4, 8 or 16 per data-parallel rank
constexpr std::int64_t kH = 8;
constexpr std::int64_t kF = 8;
constexpr std::int64_t kE = 4;

enum class Routing { kRouter, kOneExpert, kGiven };

struct MoeCase {
    std::int64_t ep = 1;
    std::int64_t tp = 1;
    int topk = 2;
    std::int64_t etp = 0; ///< expert tensor parallelism: 0 (= tp) or 1 (whole experts, the tp ranks split the tokens)
    double capacity_factor = -1.0;
    Routing routing = Routing::kRouter;
    /// x sharded over tp as well (sequence parallel; etp 1 below tp only): the layer then moves no token over tp.
    bool x_over_tp = false;
};

/// gtest prints a case by its name (not its bytes).
inline std::string CaseName(const MoeCase &c);
inline void PrintTo(const MoeCase &c, std::ostream *os) { *os << CaseName(c); }

/// etp 1 below tp: the tp ranks split the tokens.
inline bool SplitTokens(const MoeCase &c) { return c.etp == 1 && c.tp > 1; }

/// The token chunks the world routes separately: one per data-parallel rank, or per rank when tp splits the tokens.
inline std::int64_t Chunks(const MoeCase &c) { return World().size() / (SplitTokens(c) ? 1 : c.tp); }

/// This rank's chunk: x's dim 0 over (dp, ep), and over tp as the minor shard when tp splits the tokens.
inline std::int64_t ChunkOf(const MoeCase &c, const DeviceMesh &mesh) {
    const std::int64_t data = mesh.coordinate()[0] * c.ep + mesh.coordinate()[1];
    return SplitTokens(c) ? data * c.tp + mesh.coordinate()[2] : data;
}

inline std::string CaseName(const MoeCase &c) {
    const char *routing = c.routing == Routing::kRouter ? "router" : c.routing == Routing::kOneExpert ? "one" : "given";
    return fmt::format("ep{}_tp{}{}{}_top{}_{}_{}", c.ep, c.tp, SplitTokens(c) ? "_etp1" : "",
                       c.x_over_tp ? "_xtp" : "", c.topk, c.capacity_factor < 0 ? "dropless" : "capacity", routing);
}

/// The problem's full tensors (the same on every rank) and the layer set to them.
struct MoeSetup {
    MoeProblem problem;
    Tensor x, wg, w1, b1, w2, b2, dy;
};

inline MoeSetup MakeSetup(const MoeCase &c, std::int64_t chunks, std::int64_t capacity) {
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

/// One forward and backward of the layer on `mesh` (x sharded over dp and ep), with the exact collective counts;
/// gelu_fusion: MoEMLPOptions's (the dGELU in fc2's grouped dgrad, or the GELU node).
inline LayerRun RunLayer(const MoeCase &c, DeviceMesh &mesh, const MoeSetup &s, double aux_coeff = 0.0,
                         double z_coeff = 0.0, bool gelu_fusion = true) {
    const bool given = c.routing == Routing::kGiven;
    nn::MoEMLP layer({.hidden = kH,
                      .ffn = kF,
                      .num_experts = kE,
                      .topk = c.topk,
                      .ep = c.ep,
                      .etp = c.etp == 0 ? c.tp : c.etp,
                      .capacity_factor = c.capacity_factor,
                      .aux_loss_coeff = aux_coeff,
                      .z_loss_coeff = z_coeff,
                      .activation = !given,
                      .gelu_fusion = gelu_fusion},
                     mesh, WithName(Param(DType::kFloat32), "moe"));
    SetFull(layer.router_weight, s.wg);
    SetFull(layer.fc1_weight, s.w1);
    SetFull(layer.fc1_bias, s.b1);
    SetFull(layer.fc2_weight, s.w2);
    SetFull(layer.fc2_bias, s.b2);
    // The gradients stay Partial over the data-parallel dims (as under GradSync): backward issues only the layer's own
    // collectives; FullGrad reduces them afterwards.
    // With etp 1 below tp, tp is one more data-parallel dim of the router and of the (replicated) experts.
    const int dp = mesh.dim_index("dp"), ep = mesh.dim_index("ep"), tp = mesh.dim_index("tp");
    const bool split = SplitTokens(c);
    layer.router_weight.set_deferred_partial(split ? std::vector<int>{dp, ep, tp} : std::vector<int>{dp, ep});
    for (Variable *p : {&layer.fc1_weight, &layer.fc1_bias, &layer.fc2_weight, &layer.fc2_bias}) {
        p->set_deferred_partial(split ? std::vector<int>{dp, tp} : std::vector<int>{dp});
    }
    const std::vector<std::string> x_over =
        c.x_over_tp ? std::vector<std::string>{"dp", "ep", "tp"} : std::vector<std::string>{"dp", "ep"};
    Variable x(DistTensor::Sharded(s.x, mesh, {{.dim = 0, .over = x_over}}), true);

    // This rank's tokens of a given routing.
    const std::int64_t chunk = ChunkOf(c, mesh);
    const std::int64_t per = kT / Chunks(c);
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
    // etp = tp: fc2's all-reduce over tp forward, fc1's dx all-reduce backward. etp 1 < tp: the output's all-gather
    // over tp forward (the slice of x is free), dx's all-gather backward (the slice of dy is free).
    const std::int64_t tp_reduce = c.tp > 1 && !split ? 1 : 0;
    const std::int64_t tp_gather = split && !c.x_over_tp ? 1 : 0;
    ExpectAllToAll(mesh, c.ep > 1 ? 3 : 0, tp_reduce, "forward: counts, rows, rows back; fc2's all-reduce", tp_gather);
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(s.dy, out.output.value().layout(), mesh);
    out.output.Backward(&dy);
    ExpectAllToAll(mesh, c.ep > 1 ? 2 : 0, tp_reduce, "backward: rows, rows back; fc1's dx all-reduce", tp_gather);

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

} // namespace shardline::moe_test
