// autograd::Router, Permute and Unpermute (mixture-of-experts routing) on local CPU Variables: float64 gradient checks
// against finite differences through the router's weights (softmax/sigmoid, renormalised or not, topk 1 and 2), its
// aux and z losses, the permutation (capacity drops, zero-token experts, all tokens on one expert) and the combine
// (tokens and weights), and through the whole Router → Permute → expert → Unpermute pipeline; the outputs' values,
// the zero losses without grad_fn, bitwise determinism of two runs, and the errors on bad input.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe.h>
#include <shardline/core/error.h>

#include "gradcheck.h"
#include "helpers.h"

namespace shardline::autograd {
namespace {

using gradcheck::Data;
using gradcheck::ExpectGradientsMatch;
using gradcheck::Ids;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::MessageOf;
using testing::Values;

/// 6 tokens × 2 slots over 5 experts: expert 0 and 2 get nothing, expert 3 four copies.
Tensor Indices() { return Ids({1, 3, 3, 4, 1, 3, 4, 1, 3, 1, 4, 1}, {6, 2}); }

RouterOptions Options(int experts, int topk, MoEScoreFunction fn, bool normalize) {
    return {.num_experts = experts, .topk = topk, .score_function = fn, .normalize_topk = normalize};
}

TEST(AutogradMoETest, RouterWeightsGradientsSoftmax) {
    for (const int topk : {1, 2, 3}) {
        for (const bool normalize : {false, true}) {
            if (topk == 1 && normalize) {
                continue; // weight ≡ 1: no gradient to check (RouterWeightOfOneChoiceIsOne)
            }
            SCOPED_TRACE(fmt::format("topk {} normalize {}", topk, normalize));
            const RouterOptions o = Options(5, topk, MoEScoreFunction::kSoftmax, normalize);
            ExpectGradientsMatch([&](const auto &v) { return Router(v[0], o).weights; }, {Data({7, 5}, "logits")},
                                 {true});
        }
    }
}

TEST(AutogradMoETest, RouterWeightsGradientsSigmoid) {
    for (const int topk : {1, 2}) {
        for (const bool normalize : {false, true}) {
            if (topk == 1 && normalize) {
                continue;
            }
            SCOPED_TRACE(fmt::format("topk {} normalize {}", topk, normalize));
            const RouterOptions o = Options(6, topk, MoEScoreFunction::kSigmoid, normalize);
            ExpectGradientsMatch([&](const auto &v) { return Router(v[0], o).weights; }, {Data({7, 6}, "logits")},
                                 {true});
        }
    }
}

TEST(AutogradMoETest, RouterAuxAndZLossGradients) {
    for (const auto fn : {MoEScoreFunction::kSoftmax, MoEScoreFunction::kSigmoid}) {
        for (const int topk : {1, 2}) {
            SCOPED_TRACE(fmt::format("sigmoid {} topk {}", fn == MoEScoreFunction::kSigmoid, topk));
            RouterOptions o = Options(4, topk, fn, true);
            o.aux_loss_coeff = 0.3;
            o.z_loss_coeff = 0.05;
            ExpectGradientsMatch([&](const auto &v) { return Router(v[0], o).aux_loss; }, {Data({9, 4}, "logits")},
                                 {true});
            ExpectGradientsMatch([&](const auto &v) { return Router(v[0], o).z_loss; }, {Data({9, 4}, "logits")},
                                 {true});
            // All three outputs into one loss: the Function sums their gradients.
            ExpectGradientsMatch(
                [&](const auto &v) {
                    const RouterOutput r = Router(v[0], o);
                    return Add(Add(Sum(Scale(r.weights, 0.5)), r.aux_loss), r.z_loss, 2.0);
                },
                {Data({9, 4}, "logits")}, {true});
        }
    }
}

TEST(AutogradMoETest, RouterOutputsAndZeroLosses) {
    // logits rows: expert 2 > 0 > 1 (row 0), a tie of 1 and 3 (row 1).
    const Variable logits(Tensor::FromVector({1, 0, 3, -1, 0, 2, -1, 2}, Shape{2, 4}, DType::kFloat32), true);
    const RouterOutput r = Router(logits, Options(4, 2, MoEScoreFunction::kSoftmax, true));
    EXPECT_EQ(r.indices.ToDoubleVector(), (Values{2, 0, 1, 3}));
    EXPECT_EQ(r.indices.dtype(), DType::kInt64);
    EXPECT_EQ(r.tokens_per_expert.ToDoubleVector(), (Values{1, 1, 1, 1}));
    const Values w = r.weights.local().ToDoubleVector();
    EXPECT_NEAR(w[0], 1.0 / (1.0 + std::exp(-2.0)), 1e-6);
    EXPECT_NEAR(w[1], std::exp(-2.0) / (1.0 + std::exp(-2.0)), 1e-6);
    EXPECT_EQ(w[2], 0.5f);
    EXPECT_EQ(w[3], 0.5f);
    EXPECT_NE(r.weights.grad_fn(), nullptr);
    for (const Variable *loss : {&r.aux_loss, &r.z_loss}) {
        EXPECT_EQ(loss->grad_fn(), nullptr) << "a zero coefficient gives a constant";
        EXPECT_FALSE(loss->requires_grad());
        EXPECT_EQ(loss->local().ToDoubleVector(), Values{0.0});
        EXPECT_EQ(loss->dtype(), DType::kFloat32);
        EXPECT_EQ(loss->shape(), Shape{});
    }
}

TEST(AutogradMoETest, RouterWeightOfOneChoiceIsOne) {
    const RouterOutput r =
        Router(Variable(Data({5, 3}, "logits").To(DType::kFloat32)), Options(3, 1, MoEScoreFunction::kSoftmax, true));
    EXPECT_EQ(r.weights.local().ToDoubleVector(), Values(5, 1.0));
}

TEST(AutogradMoETest, PermuteGradientWithZeroTokenExpertsAndCapacityDrops) {
    const Tensor ids = Indices();
    for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{1}, std::int64_t{2}, std::int64_t{3}}) {
        SCOPED_TRACE(fmt::format("capacity {}", capacity));
        ExpectGradientsMatch([&](const auto &v) { return Permute(v[0], ids, 5, capacity).tokens; }, {Data({6, 4}, "x")},
                             {true});
    }
}

TEST(AutogradMoETest, PermuteAllTokensOnOneExpertTopk1) {
    const Tensor ids = Ids({2, 2, 2, 2, 2}, {5, 1});
    ExpectGradientsMatch([&](const auto &v) { return Permute(v[0], ids, 3).tokens; }, {Data({5, 3}, "x")}, {true});
    ExpectGradientsMatch([&](const auto &v) { return Permute(v[0], ids, 3, 2).tokens; }, {Data({5, 3}, "x")}, {true});
}

TEST(AutogradMoETest, PermuteOutputs) {
    const Tensor x = Tensor::FromVector({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, Shape{6, 2}, DType::kFloat32);
    // Copies (t, j) → expert: 1:(0,0)(2,0)(3,1)(4,1)(5,1)  3:(0,1)(1,0)(2,1)(4,0)  4:(1,1)(3,0)(5,0)
    const PermuteOutput p = Permute(Variable(x), Indices(), 5, 3);
    EXPECT_EQ(p.host_group_sizes, (std::vector<std::int64_t>{0, 3, 0, 3, 3}));
    EXPECT_EQ(p.group_sizes.ToDoubleVector(), (Values{0, 3, 0, 3, 3}));
    EXPECT_EQ(p.dropped, 3);
    EXPECT_EQ(p.row_map.ToDoubleVector(), (Values{0, 3, 4, 6, 1, 5, 7, 2, -1, -1, 8, -1}));
    EXPECT_EQ(p.tokens.local().ToDoubleVector(), (Values{0, 1, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 2, 3, 6, 7, 10, 11}));
}

TEST(AutogradMoETest, PermuteWithoutHostSizesGivesTheSameRowsAndLeavesTheSizesOnTheDevice) {
    const Tensor x = Tensor::FromVector({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, Shape{6, 2}, DType::kFloat32);
    const PermuteOutput with = Permute(Variable(x), Indices(), 5);
    const PermuteOutput without = Permute(Variable(x), Indices(), 5, -1, false);
    EXPECT_TRUE(without.host_group_sizes.empty());
    EXPECT_EQ(without.dropped, 0);
    EXPECT_EQ(without.group_sizes.ToDoubleVector(), (Values{0, 5, 0, 4, 3}));
    EXPECT_EQ(without.row_map.ToDoubleVector(), with.row_map.ToDoubleVector());
    EXPECT_EQ(without.tokens.local().ToDoubleVector(), with.tokens.local().ToDoubleVector());
    ExpectGradientsMatch([&](const auto &v) { return Permute(v[0], Indices(), 5, -1, false).tokens; },
                         {Data({6, 4}, "x")}, {true});
    // A capacity's row count is known only after the read-back.
    try {
        Permute(Variable(x), Indices(), 5, 2, false);
        FAIL() << "capacity 2 without host sizes was accepted";
    } catch (const Error &e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("Permute"));
        EXPECT_THAT(e.what(), ::testing::HasSubstr("dropless (capacity < 0, got 2)"));
    }
}

TEST(AutogradMoETest, UnpermuteGradientsOfTokensAndWeights) {
    for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{2}}) {
        const PermuteOutput p = Permute(Variable(Data({6, 3}, "x")), Indices(), 5, capacity);
        const std::int64_t rows = p.tokens.shape()[0];
        for (int mask = 1; mask < 4; ++mask) {
            SCOPED_TRACE(fmt::format("capacity {} tokens {} weights {}", capacity, mask & 1, (mask >> 1) & 1));
            ExpectGradientsMatch([&](const auto &v) { return Unpermute(v[0], p.row_map, v[1]); },
                                 {Data({rows, 3}, "tokens"), Data({6, 2}, "weights")},
                                 {(mask & 1) != 0, (mask & 2) != 0});
        }
    }
}

TEST(AutogradMoETest, UnpermuteOfPermuteWithUnitWeightsIsTopkTimesX) {
    const Tensor x = Data({6, 3}, "x").To(DType::kFloat32);
    const PermuteOutput p = Permute(Variable(x), Indices(), 5);
    const Variable ones(Tensor::Full({6, 2}, 1.0, DType::kFloat32));
    const Values y = Unpermute(p.tokens, p.row_map, ones).local().ToDoubleVector();
    const Values xv = x.ToDoubleVector();
    for (std::size_t i = 0; i < xv.size(); ++i) {
        EXPECT_EQ(y[i], 2 * xv[i]) << i;
    }
}

/// The layer's path: logits → Router; x → Permute → gelu (the "experts") → Unpermute with the router's weights; the
/// loss adds the aux and z losses.
Variable Pipeline(const Variable &x, const Variable &logits, const RouterOptions &o, std::int64_t capacity) {
    const RouterOutput r = Router(logits, o);
    const PermuteOutput p = Permute(x, r.indices, o.num_experts, capacity);
    const Variable y = Unpermute(Gelu(p.tokens), p.row_map, r.weights);
    return Add(Add(Sum(y), r.aux_loss), r.z_loss);
}

TEST(AutogradMoETest, PipelineGradientsThroughXAndLogits) {
    for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{2}}) {
        for (const auto fn : {MoEScoreFunction::kSoftmax, MoEScoreFunction::kSigmoid}) {
            SCOPED_TRACE(fmt::format("capacity {} sigmoid {}", capacity, fn == MoEScoreFunction::kSigmoid));
            RouterOptions o = Options(4, 2, fn, fn == MoEScoreFunction::kSigmoid);
            o.aux_loss_coeff = 0.1;
            o.z_loss_coeff = 0.01;
            ExpectGradientsMatch([&](const auto &v) { return Pipeline(v[0], v[1], o, capacity); },
                                 {Data({8, 3}, "x"), Data({8, 4}, "logits")}, {true, true});
        }
    }
}

TEST(AutogradMoETest, TwoRunsGiveBitwiseTheSameLossAndGradients) {
    RouterOptions o = Options(8, 2, MoEScoreFunction::kSoftmax, true);
    o.aux_loss_coeff = 0.01;
    o.z_loss_coeff = 0.001;
    const Tensor x0 = Data({64, 16}, "x").To(DType::kFloat32);
    const Tensor l0 = Data({64, 8}, "logits").To(DType::kFloat32);
    std::vector<std::vector<unsigned char>> runs[2];
    for (auto &run : runs) {
        Variable x(x0.Clone(), true);
        Variable logits(l0.Clone(), true);
        const Variable loss = Pipeline(x, logits, o, 20);
        loss.Backward();
        run = {testing::HostBytes(loss.local()), testing::HostBytes(x.grad().local()),
               testing::HostBytes(logits.grad().local())};
    }
    EXPECT_EQ(runs[0], runs[1]);
}

TEST(AutogradMoETest, RouterRejectsBadOptions) {
    const Variable logits(Data({4, 3}, "logits").To(DType::kFloat32));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Router(logits, Options(3, 4, MoEScoreFunction::kSoftmax, true)); }),
                AllOf(HasSubstr("Router"), HasSubstr("topk (4)"), HasSubstr("num_experts = 3")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Router(logits, Options(3, 0, MoEScoreFunction::kSoftmax, true)); }),
                AllOf(HasSubstr("Router"), HasSubstr("topk (0)")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Router(logits, Options(5, 1, MoEScoreFunction::kSoftmax, true)); }),
                AllOf(HasSubstr("Router"), HasSubstr("num_experts (5)"), HasSubstr("[4, 3]")));
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    Router(Variable(Data({12}, "l").To(DType::kFloat32)),
                           Options(3, 1, MoEScoreFunction::kSoftmax, true));
                }),
                AllOf(HasSubstr("Router"), HasSubstr("[tokens, experts]")));
    RouterOptions negative = Options(3, 1, MoEScoreFunction::kSoftmax, true);
    negative.aux_loss_coeff = -1.0;
    EXPECT_THAT(MessageOf<Error>([&] { Router(logits, negative); }), HasSubstr("aux_loss_coeff (-1)"));
}

TEST(AutogradMoETest, PermuteAndUnpermuteRejectBadInput) {
    const Variable x(Data({6, 4}, "x").To(DType::kFloat32));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Permute(x, Ids({0, 1, 2}, {3, 1}), 4); }),
                AllOf(HasSubstr("Permute"), HasSubstr("tokens = 6")));
    EXPECT_THAT(MessageOf<DTypeError>([&] { Permute(x, Tensor::Zeros({6, 1}, DType::kFloat32), 4); }),
                AllOf(HasSubstr("Permute"), HasSubstr("int64")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Permute(x, Ids({0, 1, 2, 3, 4, 1}, {6, 1}), 4); }),
                AllOf(HasSubstr("MoEPermuteMap"), HasSubstr("[0, num_experts = 4)"), HasSubstr("got 4")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Permute(x, Ids({0, 1, 2, 3, 0, 1}, {6, 1}), 0); }),
                AllOf(HasSubstr("Permute"), HasSubstr("num_experts must be > 0")));
    const PermuteOutput p = Permute(x, Ids({0, 1, 2, 3, 0, 1}, {6, 1}), 4);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { Unpermute(p.tokens, p.row_map, Variable(Tensor::Zeros({6, 2}, DType::kFloat32))); }),
                AllOf(HasSubstr("Unpermute"), HasSubstr("[6, 2]")));
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    Unpermute(Variable(Tensor::Zeros({3, 4}, DType::kFloat32)), p.row_map,
                              Variable(Tensor::Zeros({6, 1}, DType::kFloat32)));
                }),
                AllOf(HasSubstr("MoEUnpermuteRows"), HasSubstr("[-1, 3)")));
}

} // namespace
} // namespace shardline::autograd
