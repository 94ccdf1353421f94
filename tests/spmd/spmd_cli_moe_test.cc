// shardline-spmd on the MoE token exchange (moe_dispatch / moe_combine, docs/spmd.md 2.7): the answers' layouts, the
// internal collectives with their byte bounds, and the errors. The round trips are in spmd_cli_test.cc.

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "spmd_cli_util.h"

namespace {

using namespace shardline::spmd::cli_testing;

const std::string kMesh = R"j("mesh":{"shape":[2,2,2],"dim_names":["dp","ep","tp"]})j";

// x [64,32] bf16 [[dp,ep],-1], E 8, topk 2 -> out [128,32] [[ep,dp],-1]; internal: counts all_to_all (1 * 4 * 8 B),
// rows all_to_all_v (16 local tokens * 2 copies * 32 * 2 B = 2048 B, the dropless bound)
TEST(ShardlineSpmdCliMoETest, DispatchAnswersTheExpertRowsAndTheExchange) {
    const Result r = RunTool(R"j({"op":"moe_dispatch",)j" + kMesh + R"j(,"dtype":"bfloat16",
        "attrs":{"num_experts":8,"topk":2},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":[["dp","ep"],-1]}]})j",
                             "moe_dispatch");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["inputs"][0]["text"], "[[0,1],-1]");
    EXPECT_TRUE(r.answer["inputs"][0]["redistribute"]["steps"].empty());
    const json &out = r.answer["outputs"][0];
    EXPECT_EQ(out["shape"], json::parse("[128,32]"));
    EXPECT_EQ(out["text"], "[[1,0],-1]");
    EXPECT_EQ(out["placements"], json::parse(R"j(["S(0)[1]","S(0)[0]","R"])j"));
    const json &internal = r.answer["internal"];
    ASSERT_EQ(internal.size(), 2u) << internal.dump();
    EXPECT_EQ(internal[0]["collective"], "all_to_all");
    EXPECT_EQ(internal[0]["mesh_dim_name"], "ep");
    EXPECT_EQ(internal[0]["bytes_per_rank"], 32);
    EXPECT_FALSE(internal[0].contains("reduce_op"));
    EXPECT_EQ(internal[1]["collective"], "all_to_all_v");
    EXPECT_EQ(internal[1]["mesh_dim"], 1);
    EXPECT_EQ(internal[1]["bytes_per_rank"], 2048);
    EXPECT_NEAR(internal[1]["cost_us"].get<double>(), 63.9 + 1.78 + 2048 / 341.6e3, 1e-9);
    EXPECT_FALSE(r.answer.contains("bias_after_reduction"));
}

// combine grad: out_grad [64,32] [[dp,ep],-1] -> x_grad [[ep,dp],-1], back to x's layout with no step; one
// all_to_all_v (the gradient rows to the experts' ranks), capacity 3 bounding the rows at 8 * 3 = 24 (< 16 * 2)
TEST(ShardlineSpmdCliMoETest, CombineGradSendsOneExchangeBoundedByTheCapacity) {
    const Result r = RunTool(R"j({"op":"moe_combine","direction":"grad",)j" + kMesh + R"j(,
        "attrs":{"num_experts":8,"topk":2,"capacity":3},
        "inputs":[{"name":"x","shape":[128,32],"dims_mapping":[["ep","dp"],-1]}],
        "out_grad":{"shape":[64,32],"dims_mapping":[["dp","ep"],-1]}})j",
                             "moe_combine_grad");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    const json &dx = r.answer["outputs"][0];
    EXPECT_EQ(dx["name"], "x_grad");
    EXPECT_EQ(dx["text"], "[[1,0],-1]");
    EXPECT_TRUE(dx["redistribute_to"]["plan"]["steps"].empty());
    ASSERT_EQ(r.answer["internal"].size(), 1u);
    EXPECT_EQ(r.answer["internal"][0]["collective"], "all_to_all_v");
    EXPECT_EQ(r.answer["internal"][0]["bytes_per_rank"], 24 * 32 * 4);
}

// ep of one rank: nothing is exchanged, the layouts pass through
TEST(ShardlineSpmdCliMoETest, EpOfOneRankHasNoInternalCollective) {
    const Result r = RunTool(R"j({"op":"moe_dispatch","mesh":{"shape":[4,1],"dim_names":["dp","ep"]},
        "attrs":{"num_experts":8,"topk":2},"inputs":[{"name":"x","shape":[64,32],"dims_mapping":["dp",-1]}]})j",
                             "moe_ep1");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_TRUE(r.answer["internal"].empty());
    EXPECT_EQ(r.answer["outputs"][0]["text"], "[0,-1]");
}

TEST(ShardlineSpmdCliMoETest, BadRequestsAreJsonErrors) {
    const std::string x = R"j("inputs":[{"name":"x","shape":[64,32],"dims_mapping":["dp",-1]}])j";
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"moe_dispatch",)j" + kMesh + "," + x + "}", "moe_no_e"), "attrs.num_experts",
                        "the exchange needs the number of experts"));
    EXPECT_TRUE(IsError(
        RunTool(R"j({"op":"moe_dispatch",)j" + kMesh + R"j(,"attrs":{"num_experts":3},)j" + x + "}", "moe_indivisible"),
        "moe_dispatch", "num_experts (3) must be positive and divisible by the size of mesh dim 'ep' (2)"));
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"moe_combine","mesh":{"shape":[2,2],"dim_names":["dp","tp"]},
        "attrs":{"num_experts":4},)j" +
                                    x + "}",
                                "moe_no_ep"),
                        "moe_combine", "the mesh has no dim named 'ep' (ep_dim; its dims are [dp, tp])"));
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"moe_dispatch",)j" + kMesh + R"j(,"attrs":{"num_experts":4},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":["dp","ep"]}]})j",
                                "moe_hidden_ep"),
                        "moe_dispatch", "x's hidden dim must not be sharded on 'ep' (mesh dim 1)"));
    EXPECT_TRUE(
        IsError(RunTool(R"j({"op":"moe_dispatch",)j" + kMesh + R"j(,"attrs":{"num_experts":4,"bias":true},)j" + x + "}",
                        "moe_unknown_attr"),
                "attrs.bias", "unknown attribute for moe_dispatch"));
}

} // namespace
