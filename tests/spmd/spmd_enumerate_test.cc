// The strategy enumeration (EnumerateEinsumStrategies, EnumerateRuleStrategies): DTensor's gen_einsum_strategies on
// 1-D and N-D meshes, one case per TEST, and the property that every enumerated strategy, executed on the virtual mesh
// (spmd_test_util.h), computes the dense result. Notation: "x layout, y layout -> out layout" per strategy.

#include <random>

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::Dense;
using testing::L;
using testing::S;
using testing::T;

EinsumProblem Problem(const std::string &equation, const std::vector<TensorSpec> &inputs) {
    const auto arrow = equation.find("->");
    EinsumProblem problem;
    problem.op = "einsum";
    size_t start = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
        const size_t end = std::min(equation.find(',', start), arrow);
        problem.inputs.push_back({.name = "in" + std::to_string(i),
                                  .labels = equation.substr(start, end - start),
                                  .shape = inputs[i].shape,
                                  .layout = inputs[i].layout});
        start = end + 1;
    }
    problem.output = equation.substr(arrow + 2);
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

std::vector<std::string> Texts(const EinsumStrategy &s) {
    std::vector<std::string> out;
    for (const TensorSpec &t : s.inputs) {
        out.push_back(S(t));
    }
    out.push_back(S(s.output));
    return out;
}

// mk,kn->mn on [4]: R,R->R | k: [-1,0],[0,-1]->partial{0} | m: [0,-1],R->[0,-1] | n: R,[-1,0]->[-1,0]
TEST(EnumerateTest, MatmulOnAOneDimMeshFollowsDTensorsOrder) {
    const EinsumStrategies e = EnumerateEinsumStrategies(
        ProcessMesh({4}), Problem("mk,kn->mn", {T({64, 32}, "[-1,-1]"), T({32, 48}, "[-1,-1]")}));
    ASSERT_EQ(e.strategies.size(), 4u);
    EXPECT_EQ(Texts(e.strategies[0]), (std::vector<std::string>{"[-1,-1]", "[-1,-1]", "[-1,-1]"}));
    EXPECT_EQ(Texts(e.strategies[1]), (std::vector<std::string>{"[-1,0]", "[0,-1]", "[-1,-1] partial{0}"}));
    EXPECT_EQ(Texts(e.strategies[2]), (std::vector<std::string>{"[0,-1]", "[-1,-1]", "[0,-1]"}));
    EXPECT_EQ(Texts(e.strategies[3]), (std::vector<std::string>{"[-1,-1]", "[-1,0]", "[-1,0]"}));
}

// bmk,bkn->bmn on 2x2: (1 + 4 labels)^2 = 25; batch first: the 2nd strategy shards b on mesh dim 1
TEST(EnumerateTest, BatchedMatmulOnATwoDimMeshIsTheProductOverMeshDims) {
    const EinsumStrategies e = EnumerateEinsumStrategies(
        ProcessMesh({2, 2}), Problem("bmk,bkn->bmn", {T({4, 8, 6}, "[-1,-1,-1]"), T({4, 6, 5}, "[-1,-1,-1]")}));
    ASSERT_EQ(e.strategies.size(), 25u);
    EXPECT_EQ(Texts(e.strategies[1]), (std::vector<std::string>{"[1,-1,-1]", "[1,-1,-1]", "[1,-1,-1]"}));
    EXPECT_EQ(Texts(e.strategies[5]), (std::vector<std::string>{"[0,-1,-1]", "[0,-1,-1]", "[0,-1,-1]"}));
}

// b on both mesh dims: co-sharded in ascending order, [[0,1],-1,-1]
TEST(EnumerateTest, ALabelChosenOnTwoMeshDimsIsCoSharded) {
    const EinsumStrategies e = EnumerateEinsumStrategies(
        ProcessMesh({2, 2}), Problem("bmk,bkn->bmn", {T({4, 8, 6}, "[-1,-1,-1]"), T({4, 6, 5}, "[-1,-1,-1]")}));
    EXPECT_EQ(Texts(e.strategies[6]), (std::vector<std::string>{"[[0,1],-1,-1]", "[[0,1],-1,-1]", "[[0,1],-1,-1]"}));
}

// mk,kn->mn on [1,4]: the size-1 mesh dim only replicates: 4 strategies, not 16
TEST(EnumerateTest, SizeOneMeshDimsOnlyReplicate) {
    const EinsumStrategies e = EnumerateEinsumStrategies(
        ProcessMesh({1, 4}), Problem("mk,kn->mn", {T({8, 8}, "[-1,-1]"), T({8, 8}, "[-1,-1]")}));
    EXPECT_EQ(e.strategies.size(), 4u);
}

// given x[-1,-1], y[-1,0]: n on mesh 0 needs no redistribution and the least compute: chosen (index 3)
TEST(EnumerateTest, TheChosenStrategyIsTheCheapest) {
    const ProcessMesh mesh({4});
    const EinsumStrategies e =
        EnumerateEinsumStrategies(mesh, Problem("mk,kn->mn", {T({64, 32}, "[-1,-1]"), T({32, 48}, "[-1,0]")}));
    EXPECT_EQ(e.chosen, 3u);
    EXPECT_EQ(e.strategies[3].redistribute_us, 0.0);
    PlanOptions ordered;
    ordered.search = false;
    EXPECT_DOUBLE_EQ(e.strategies[0].redistribute_us,
                     PlanRedistribute(mesh, {32, 48}, L("[-1,0]"), L("[-1,-1]"), ordered).cost_us);
    for (const EinsumStrategy &s : e.strategies) {
        EXPECT_GE(s.cost_us, e.strategies[e.chosen].cost_us);
        EXPECT_DOUBLE_EQ(s.cost_us, s.redistribute_us + s.compute_us);
    }
    EXPECT_DOUBLE_EQ(e.strategies[0].compute_us, 2.0 * 64 * 32 * 48 / CostModel{}.flops_per_us);
    EXPECT_DOUBLE_EQ(e.strategies[3].compute_us, e.strategies[0].compute_us / 4);
}

// linear x[..,k] w[n,k] b[n] on [4]: n shards weight, bias and output; k makes the output Partial
TEST(EnumerateTest, LinearStrategiesShardTheBiasWithTheOutputFeatures) {
    RuleRequest request{.op = "linear",
                        .mesh = ProcessMesh({4}),
                        .inputs = {T({8, 16}, "[-1,-1]"), T({12, 16}, "[-1,-1]"), T({12}, "[-1]")}};
    const RuleStrategies r = EnumerateRuleStrategies(request);
    EXPECT_EQ(r.input_names, (std::vector<std::string>{"x", "weight", "bias"}));
    EXPECT_TRUE(r.bias_after_reduction_if_partial);
    // labels: a (batch of x only: free), k (contracted), n (free): R, k, a, n
    ASSERT_EQ(r.enumeration.strategies.size(), 4u);
    EXPECT_EQ(Texts(r.enumeration.strategies[1]),
              (std::vector<std::string>{"[-1,0]", "[-1,0]", "[-1]", "[-1,-1] partial{0}"}));
    EXPECT_EQ(Texts(r.enumeration.strategies[3]), (std::vector<std::string>{"[-1,-1]", "[0,-1]", "[0]", "[-1,0]"}));
}

// matmul with trans_y on [2]: the problem of the op, its attrs included
TEST(EnumerateTest, MatmulAttrsShapeTheStrategies) {
    RuleRequest request{.op = "matmul",
                        .mesh = ProcessMesh({2}),
                        .inputs = {T({8, 16}, "[-1,-1]"), T({12, 16}, "[-1,-1]")},
                        .attrs = MatmulAttrs{.trans_y = true}};
    const RuleStrategies r = EnumerateRuleStrategies(request);
    ASSERT_EQ(r.enumeration.strategies.size(), 4u);
    EXPECT_EQ(Texts(r.enumeration.strategies[1]), (std::vector<std::string>{"[-1,0]", "[-1,0]", "[-1,-1] partial{0}"}));
}

// softmax is not einsum-style: an error naming the direction
TEST(EnumerateTest, OpsThatAreNotEinsumStyleAreErrors) {
    RuleRequest request{.op = "softmax", .mesh = ProcessMesh({2}), .inputs = {T({8, 16}, "[-1,-1]")}};
    try {
        EnumerateRuleStrategies(request);
        FAIL() << "no error";
    } catch (const SpmdError &e) {
        EXPECT_EQ(std::string(e.what()), "direction: enumerate takes an einsum-style op (einsum, linear, matmul), got "
                                         "'softmax'");
    }
}

// abc,cd->abd on six mesh dims of 2: 5^6 strategies > 1024: refused before any is priced
TEST(EnumerateTest, MoreStrategiesThanTheLimitIsAnError) {
    const ProcessMesh mesh({2, 2, 2, 2, 2, 2});
    EXPECT_THROW(
        EnumerateEinsumStrategies(mesh, Problem("abc,cd->abd", {T({4, 4, 4}, "[-1,-1,-1]"), T({4, 4}, "[-1,-1]")})),
        SpmdError);
}

// ---- property: every strategy computes the dense result ---------------------------------------------------------

/// A random einsum of 2 or 3 operands over labels "abcd" (sizes 1-4, some operand dims broadcast at size 1).
struct RandomEinsum {
    std::vector<std::string> labels;
    std::vector<std::vector<int64_t>> shapes;
    std::string output;
};

RandomEinsum DrawEinsum(std::mt19937 &rng) {
    RandomEinsum e;
    std::map<char, int64_t> size;
    for (char l : std::string("abcd")) {
        size[l] = std::uniform_int_distribution<int64_t>(1, 4)(rng);
    }
    const int operands = std::uniform_int_distribution<int>(2, 3)(rng);
    std::string used;
    for (int i = 0; i < operands; ++i) {
        std::string labels;
        for (char l : std::string("abcd")) {
            if (rng() % 2 == 0) {
                labels.push_back(l);
            }
        }
        if (labels.empty()) {
            labels = "a";
        }
        std::vector<int64_t> shape;
        for (char l : labels) {
            shape.push_back(rng() % 6 == 0 ? 1 : size[l]); // now and then a broadcast dim
            if (used.find(l) == std::string::npos) {
                used.push_back(l);
            }
        }
        e.labels.push_back(labels);
        e.shapes.push_back(shape);
    }
    for (char l : used) {
        if (rng() % 2 == 0) {
            e.output.push_back(l);
        }
    }
    return e;
}

TEST(EnumeratePropertyTest, EveryStrategyComputesTheDenseResult) {
    std::mt19937 rng(2024);
    int executed = 0;
    for (int c = 0; c < 300; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const RandomEinsum r = DrawEinsum(rng);
        std::vector<TensorSpec> inputs;
        std::vector<Dense> dense;
        std::string equation;
        for (size_t i = 0; i < r.labels.size(); ++i) {
            inputs.push_back(
                {r.shapes[i], testing::RandomLayout(mesh, static_cast<int>(r.shapes[i].size()), rng, true)});
            dense.push_back(testing::RandomDense(r.shapes[i], rng));
            equation += (i > 0 ? "," : "") + r.labels[i];
        }
        equation += "->" + r.output;
        SCOPED_TRACE(::testing::Message() << equation << " on " << mesh.ToString());
        EinsumProblem problem;
        try {
            problem = Problem(equation, inputs);
            EinsumLabelSizes(problem);
        } catch (const SpmdError &) {
            continue; // sizes that do not broadcast
        }
        const EinsumStrategies e = EnumerateEinsumStrategies(mesh, problem);
        const Dense want = testing::DenseEinsum(r.labels, dense, r.output);
        for (size_t s = 0; s < e.strategies.size(); ++s) {
            const EinsumStrategy &strategy = e.strategies[s];
            SCOPED_TRACE(::testing::Message() << "strategy " << s << " -> " << S(strategy.output));
            std::vector<testing::Shards> shards;
            for (size_t i = 0; i < inputs.size(); ++i) {
                ASSERT_FALSE(strategy.inputs[i].layout.IsPartial());
                shards.push_back(testing::Distribute(mesh, dense[i], strategy.inputs[i].layout, rng));
            }
            testing::Shards out(mesh.Size());
            for (int64_t rank = 0; rank < mesh.Size(); ++rank) {
                std::vector<Dense> local;
                for (const auto &sh : shards) {
                    local.push_back(sh[rank]);
                }
                out[rank] = testing::DenseEinsum(r.labels, local, r.output);
            }
            ASSERT_TRUE(testing::ShardsMatch(mesh, out, want, strategy.output.layout));
            ++executed;
        }
    }
    EXPECT_GT(executed, 2000);
}

} // namespace
} // namespace shardline::spmd
