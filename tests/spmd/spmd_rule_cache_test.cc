// RuleKey / RuleCache / InferRule: a hit returns exactly the fresh answer; any difference in the request misses.

#include <thread>

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;
using testing::S;
using testing::T;

bool SameInfo(const SpmdInfo &a, const SpmdInfo &b) {
    return a.input_names == b.input_names && a.inputs == b.inputs && a.output_names == b.output_names &&
           a.outputs == b.outputs && a.internal == b.internal && a.bias_after_reduction == b.bias_after_reduction &&
           a.cost_us == b.cost_us;
}

bool SamePlans(const std::vector<RedistributePlan> &a, const std::vector<RedistributePlan> &b) {
    if (a.size() != b.size()) {
        return false;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i].steps != b[i].steps || a[i].cost_us != b[i].cost_us || a[i].bytes_per_rank != b[i].bytes_per_rank) {
            return false;
        }
    }
    return true;
}

/// Row-parallel linear on dp x tp: x [0,1], weight [-1,1], bias R.
RuleRequest RowParallel() {
    return {.op = "linear",
            .mesh = ProcessMesh({2, 4}, {"dp", "tp"}),
            .inputs = {T({64, 32}, "[0,1]"), T({48, 32}, "[-1,1]"), T({48}, "[-1]")}};
}

TEST(RuleCacheTest, HitReturnsTheFreshAnswerAndItsPlans) {
    // x[0,1], w[-1,1], b[-1] -> out [0,-1] partial{1}
    RuleCache cache;
    const RuleKey key(RowParallel());
    const auto first = cache.GetOrInfer(key);
    const auto hit = cache.Lookup(key);
    ASSERT_NE(hit, nullptr);
    EXPECT_EQ(hit.get(), first.get());
    const CachedRule fresh = InferRuleWithPlans(RowParallel());
    EXPECT_TRUE(SameInfo(hit->info, fresh.info));
    EXPECT_TRUE(SamePlans(hit->input_plans, fresh.input_plans));
    EXPECT_EQ(S(hit->info.Output("out")), "[0,-1] partial{1}");
    EXPECT_TRUE(hit->info.bias_after_reduction);
    EXPECT_EQ(cache.GetStats().hits, 1u);
    EXPECT_EQ(cache.GetStats().misses, 1u);
    EXPECT_EQ(cache.GetStats().size, 1u);
}

TEST(RuleCacheTest, KeysBuiltSeparatelyFromEqualRequestsAreEqual) {
    // two RuleKey objects of one request: same hash, same words, a hit
    RuleCache cache;
    cache.GetOrInfer(RuleKey(RowParallel()));
    const RuleKey again(RowParallel());
    EXPECT_EQ(RuleKey(RowParallel()), again);
    EXPECT_EQ(RuleKey(RowParallel()).Hash(), again.Hash());
    EXPECT_NE(cache.Lookup(again), nullptr);
    EXPECT_EQ(cache.GetStats().hits, 1u);
}

TEST(RuleCacheTest, MeshNamesAndProcessIdsDoNotChangeTheKey) {
    // the answer refers to mesh dims by index: [2,4] named or not is one key
    RuleRequest unnamed = RowParallel();
    unnamed.mesh = ProcessMesh({2, 4});
    EXPECT_EQ(RuleKey(unnamed), RuleKey(RowParallel()));
}

TEST(RuleCacheTest, DifferentLayoutsShapesAttrsDirectionsAndOptionsMiss) {
    RuleCache cache;
    const RuleKey base(RowParallel());
    cache.GetOrInfer(base);
    std::vector<RuleRequest> variants;
    variants.push_back(RowParallel());
    variants.back().inputs[0] = T({64, 32}, "[1,0]"); // layout
    variants.push_back(RowParallel());
    variants.back().inputs[0].layout = L("[0,-1] partial{1}"); // partial
    variants.push_back(RowParallel());
    variants.back().inputs[0] = T({65, 32}, "[0,1]"); // shape
    variants.push_back(RowParallel());
    variants.back().inputs.pop_back(); // no bias
    variants.push_back(RowParallel());
    variants.back().mesh = ProcessMesh({4, 2}); // mesh shape
    variants.push_back(RowParallel());
    variants.back().direction = RuleDirection::kGrad; // direction
    variants.back().out_grad = T({64, 48}, "[0,-1]");
    variants.push_back(RowParallel());
    variants.back().options.mode = RuleMode::kCostBased; // mode
    variants.push_back(RowParallel());
    variants.back().options.plan.element_size = 2; // dtype (plans change)
    variants.push_back(RowParallel());
    variants.back().options.plan.cost.call_us = 1.0; // per-call latency (plans' costs change)
    variants.push_back(RowParallel());
    variants.back().options.plan.cost.call_us_per_dim = {1.0, 2.0}; // per-dim per-call latency
    variants.push_back(RowParallel());
    variants.back().options.output_target = L("[0,-1]"); // output target
    variants.push_back(RowParallel());
    variants.back().op = "matmul"; // op (never inferred here: a linear weight is not a matmul y)
    for (size_t i = 0; i < variants.size(); ++i) {
        EXPECT_FALSE(RuleKey(variants[i]) == base) << "variant " << i;
        EXPECT_EQ(cache.Lookup(RuleKey(variants[i])), nullptr) << "variant " << i;
    }
    EXPECT_EQ(cache.GetStats().misses, 1u + variants.size());
    EXPECT_EQ(cache.GetStats().hits, 0u);
}

TEST(RuleCacheTest, DifferentAttrsMiss) {
    // mk[1,-1], kn[-1,-1]: trans_x, trans_y and reduction axes / keepdim each give a new key
    const ProcessMesh mesh({2});
    RuleRequest a{.op = "matmul", .mesh = mesh, .inputs = {T({8, 8}, "[0,-1]"), T({8, 8}, "[-1,-1]")}};
    RuleRequest b = a;
    b.attrs = MatmulAttrs{.trans_x = true};
    RuleRequest c = a;
    c.attrs = MatmulAttrs{.trans_y = true};
    RuleRequest d = a;
    d.attrs = MatmulAttrs{}; // explicit defaults are their own key (not the monostate one)
    EXPECT_FALSE(RuleKey(a) == RuleKey(b));
    EXPECT_FALSE(RuleKey(b) == RuleKey(c));
    EXPECT_FALSE(RuleKey(a) == RuleKey(d));
    RuleRequest s1{.op = "sum", .mesh = mesh, .inputs = {T({8, 8}, "[0,-1]")}, .attrs = ReductionAttrs{.axes = {0}}};
    RuleRequest s2 = s1;
    s2.attrs = ReductionAttrs{.axes = {1}};
    RuleRequest s3 = s1;
    s3.attrs = ReductionAttrs{.axes = {0}, .keepdim = true};
    EXPECT_FALSE(RuleKey(s1) == RuleKey(s2));
    EXPECT_FALSE(RuleKey(s1) == RuleKey(s3));
    RuleCache cache;
    EXPECT_EQ(S(cache.GetOrInfer(RuleKey(s1))->info.outputs[0]), "[-1] partial{0}");
    EXPECT_EQ(S(cache.GetOrInfer(RuleKey(s2))->info.outputs[0]), "[0]");
    EXPECT_EQ(cache.GetStats().misses, 2u);
    EXPECT_EQ(cache.GetStats().size, 2u);
}

TEST(RuleCacheTest, GradAnswerCarriesTheBackwardPlans) {
    // column parallel on tp=4, grad: x R, W S(0), dy S(1) -> dX P(sum) -> all_reduce back to R
    RuleRequest request{.op = "linear",
                        .direction = RuleDirection::kGrad,
                        .mesh = ProcessMesh({4}),
                        .inputs = {T({64, 32}, "[-1,-1]"), T({48, 32}, "[0,-1]")},
                        .out_grad = T({64, 48}, "[-1,0]")};
    RuleCache cache;
    const auto rule = cache.GetOrInfer(request);
    ASSERT_EQ(rule->info.output_names, (std::vector<std::string>{"x_grad", "weight_grad"}));
    ASSERT_EQ(rule->output_plans.size(), 2u);
    ASSERT_EQ(rule->output_plans[0].steps.size(), 1u);
    EXPECT_EQ(rule->output_plans[0].steps[0].collective, Collective::kAllReduce);
    EXPECT_TRUE(rule->output_plans[1].steps.empty());
    ASSERT_EQ(rule->input_plans.size(), 3u); // x, weight, out_grad
    for (const RedistributePlan &plan : rule->input_plans) {
        EXPECT_TRUE(plan.steps.empty());
    }
}

TEST(RuleCacheTest, ForwardInputPlanGathersASequenceParallelInput) {
    // column parallel, SP: x [0,-1] -> required R: all_gather; output_target [0,-1] from S(1): all_to_all
    RuleRequest request{
        .op = "linear", .mesh = ProcessMesh({4}), .inputs = {T({64, 32}, "[0,-1]"), T({48, 32}, "[0,-1]")}};
    request.options.output_target = L("[0,-1]");
    const CachedRule rule = InferRuleWithPlans(request);
    ASSERT_EQ(rule.input_plans[0].steps.size(), 1u);
    EXPECT_EQ(rule.input_plans[0].steps[0].collective, Collective::kAllGather);
    ASSERT_EQ(rule.output_plans[0].steps.size(), 1u);
    EXPECT_EQ(rule.output_plans[0].steps[0].collective, Collective::kAllToAll);
}

TEST(RuleCacheTest, InferenceErrorsPropagateAndCacheNothing) {
    // matmul x[4,4], y[5,4]: k mismatch
    RuleCache cache;
    const RuleKey key(
        RuleRequest{.op = "matmul", .mesh = ProcessMesh({2}), .inputs = {T({4, 4}, "[-1,-1]"), T({5, 4}, "[-1,-1]")}});
    EXPECT_THROW(cache.GetOrInfer(key), SpmdError);
    EXPECT_EQ(cache.GetStats().size, 0u);
    EXPECT_EQ(cache.Lookup(key), nullptr);
}

TEST(RuleCacheTest, ClearDropsEntriesButKeepsReturnedAnswersAlive) {
    RuleCache cache;
    const RuleKey key(RowParallel());
    const auto held = cache.GetOrInfer(key);
    cache.Clear();
    EXPECT_EQ(cache.GetStats().size, 0u);
    EXPECT_EQ(cache.GetStats().misses, 0u);
    EXPECT_EQ(cache.Lookup(key), nullptr);
    EXPECT_EQ(S(held->info.Output("out")), "[0,-1] partial{1}");
}

TEST(RuleCacheTest, ConcurrentLookupsAndInsertionsAgree) {
    // 4 threads x 8 configurations (matmul with x sharded on m, k or nothing; several sizes), 200 rounds each
    RuleCache cache;
    std::vector<RuleKey> keys;
    const char *layouts[] = {"[0,-1]", "[-1,0]", "[-1,-1]"};
    for (int i = 0; i < 8; ++i) {
        RuleRequest r{.op = "matmul",
                      .mesh = ProcessMesh({2}),
                      .inputs = {T({8 + i, 16}, layouts[i % 3]), T({16, 4}, "[-1,-1]")}};
        keys.emplace_back(std::move(r));
    }
    std::vector<std::thread> threads;
    std::atomic<int> wrong{0};
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int round = 0; round < 200; ++round) {
                const RuleKey &key = keys[(round + t) % keys.size()];
                const auto rule = cache.GetOrInfer(key);
                if (round % 50 == 0 && !SameInfo(rule->info, InferRule(key.Request()))) {
                    ++wrong;
                }
                if (cache.Lookup(key) != rule) {
                    ++wrong;
                }
            }
        });
    }
    for (auto &thread : threads) {
        thread.join();
    }
    EXPECT_EQ(wrong.load(), 0);
    const RuleCache::Stats stats = cache.GetStats();
    EXPECT_EQ(stats.size, keys.size());
    EXPECT_EQ(stats.hits + stats.misses, 4u * 200u * 2u);
    EXPECT_GE(stats.misses, keys.size());
}

TEST(InferRuleTest, DispatchesEveryOpLikeItsInferFunction) {
    // one request per op family, each compared with the direct call
    const ProcessMesh mesh({2, 2});
    const TensorSpec x = T({4, 6}, "[0,1]");
    EXPECT_EQ(InferRule({.op = "softmax", .mesh = mesh, .inputs = {x}, .attrs = SoftmaxAttrs{.axis = 0}}).inputs,
              InferSoftmaxForward(mesh, x, {.axis = 0}).inputs);
    EXPECT_EQ(InferRule({.op = "log_softmax", .mesh = mesh, .inputs = {x}}).outputs,
              InferSoftmaxForward(mesh, x, {.log = true}).outputs);
    EXPECT_EQ(InferRule({.op = "max", .mesh = mesh, .inputs = {x}, .attrs = ReductionAttrs{.axes = {1}}}).outputs,
              InferReductionForward(mesh, x, {.kind = ReductionKind::kMax, .axes = {1}}).outputs);
    EXPECT_EQ(InferRule({.op = "transpose", .mesh = mesh, .inputs = {x}, .attrs = TransposeAttrs{{1, 0}}}).outputs,
              InferTransposeForward(mesh, x, {1, 0}).outputs);
    EXPECT_EQ(InferRule({.op = "reshape", .mesh = mesh, .inputs = {x}, .attrs = ReshapeAttrs{{24}}}).outputs,
              InferReshapeForward(mesh, x, {24}).outputs);
    EXPECT_EQ(
        InferRule(
            {.op = "einsum", .mesh = mesh, .inputs = {x, T({6, 3}, "[-1,-1]")}, .attrs = EinsumAttrs{"mk,kn->mn"}})
            .outputs,
        InferEinsumOpForward(mesh, "mk,kn->mn", {x, T({6, 3}, "[-1,-1]")}).outputs);
    EXPECT_EQ(InferRule({.op = "gelu", .mesh = mesh, .inputs = {x}}).outputs,
              InferElementwiseForward(mesh, "gelu", {x}).outputs);
    EXPECT_EQ(InferRule({.op = "embedding", .mesh = mesh, .inputs = {T({4}, "[0]"), T({10, 6}, "[1,-1]")}}).outputs,
              InferEmbeddingForward(mesh, T({4}, "[0]"), T({10, 6}, "[1,-1]")).outputs);
    const CrossEntropyAttrs ce{.vocab_parallel = true};
    EXPECT_EQ(InferRule({.op = "cross_entropy", .mesh = mesh, .inputs = {x, T({4}, "[0]")}, .attrs = ce}).internal,
              InferCrossEntropyForward(mesh, x, T({4}, "[0]"), ce).internal);
}

TEST(InferRuleTest, RejectsUnknownOpsWrongAttrsAndMissingTensors) {
    const ProcessMesh mesh({2});
    const TensorSpec x = T({4, 4}, "[0,-1]");
    EXPECT_THROW(InferRule({.op = "conv2d", .mesh = mesh, .inputs = {x}}), SpmdError);
    EXPECT_THROW(InferRule({.op = "matmul", .mesh = mesh, .inputs = {x}}), SpmdError);
    EXPECT_THROW(InferRule({.op = "linear", .mesh = mesh, .inputs = {x, x, T({4}, "[-1]"), x}}), SpmdError);
    EXPECT_THROW(InferRule({.op = "matmul", .mesh = mesh, .inputs = {x, x}, .attrs = SoftmaxAttrs{}}), SpmdError);
    EXPECT_THROW(InferRule({.op = "linear", .mesh = mesh, .inputs = {x, x}, .attrs = MatmulAttrs{}}), SpmdError);
    EXPECT_THROW(InferRule({.op = "matmul", .direction = RuleDirection::kReverse, .mesh = mesh, .inputs = {x, x}}),
                 SpmdError);
    EXPECT_THROW(InferRule({.op = "matmul", .direction = RuleDirection::kGrad, .mesh = mesh, .inputs = {x, x}}),
                 SpmdError);
    try {
        InferRule({.op = "matmul", .mesh = mesh, .inputs = {x, x}, .attrs = SoftmaxAttrs{}});
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("SoftmaxAttrs"), std::string::npos) << e.what();
    }
}

} // namespace
} // namespace shardline::spmd
