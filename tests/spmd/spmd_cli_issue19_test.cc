// shardline-spmd on the requests of issue 19: a mesh of 2^31 ranks, cost profiles, the enumerate direction, linear's
// trans_x / trans_y, P(prod) and embedding's sparse, through the built tool.

#include <chrono>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "spmd_cli_util.h"

namespace {

using namespace shardline::spmd::cli_testing;

// linear x[-1,-1], W[0,-1] on a mesh of 2^31 ranks (issue 19: the query grew to 21 GB): answered at once; the
// default process ids are not listed
TEST(ShardlineSpmdCliTest, MeshOfTwoToThe31RanksIsAnsweredAtOnce) {
    const auto start = std::chrono::steady_clock::now();
    const Result r = RunTool(R"j({"op":"linear","mesh":{"shape":[2147483648]},"inputs":[{"shape":[64,32]},
        {"shape":[48,32],"dims_mapping":[0,-1]}]})j",
                             "mesh2p31");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_LT(seconds, 5.0);
    EXPECT_EQ(r.answer["outputs"][0]["dims_mapping"], json::parse("[-1,0]"));
    EXPECT_EQ(r.answer["outputs"][0]["max_local_shape"], json::parse("[64,1]"));
    EXPECT_FALSE(r.answer["mesh"].contains("process_ids"));
}

// --cost-profile mpi_cpu: the redistribution is priced with the MPI profile (call 0.477 us, ...)
TEST(ShardlineSpmdCliTest, CostProfileFlagPricesWithTheNamedProfile) {
    const std::string request = R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[8],
        "src":{"partial":[0]},"dst":{}})j";
    const Result nccl = RunTool(request, "profile_default");
    const Result mpi = RunCommand("--cost-profile mpi_cpu < " + WriteRequest(request, "profile_mpi"));
    ASSERT_EQ(mpi.exit_code, kExitAnswered) << mpi.out;
    EXPECT_NEAR(nccl.answer["cost_us"].get<double>(), 63.9 + 2 * 1.78 + 32.0 / 341.6e3, 1e-9);
    EXPECT_NEAR(mpi.answer["cost_us"].get<double>(), 0.477 + 2 * 0.139 + 32.0 / 5.73e3, 1e-9);
}

// --cost-profile FILE.json: a profile file; a missing one is a request error naming it
TEST(ShardlineSpmdCliTest, CostProfileFlagReadsAFile) {
    const std::string profile = WriteRequest(R"j({"name":"mine","call_us":1,"alpha_us":0,
        "bandwidth_gb_per_s":1,"flops_per_us":1})j",
                                             "profile_file");
    const std::string request = WriteRequest(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[8],
        "src":{"partial":[0]},"dst":{}})j",
                                             "profile_request");
    const Result r = RunCommand("--cost-profile " + profile + " " + request);
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_DOUBLE_EQ(r.answer["cost_us"].get<double>(), 1.0 + 32.0 / 1e3);
    EXPECT_TRUE(IsError(RunCommand("--cost-profile /nonexistent/p.json " + request),
                        "cost profile '/nonexistent/p.json'", "cannot open"));
}

// enumerate, mk,kn->mn on [4] with y given [-1,0]: 4 strategies, the free one (n on mesh 0) chosen with no step
TEST(ShardlineSpmdCliTest, EnumerateAnswersEveryStrategyAndTheChosenOne) {
    const Result r = RunTool(R"j({"op":"matmul","direction":"enumerate","mesh":{"shape":[4]},
        "inputs":[{"name":"x","shape":[64,32]},{"name":"y","shape":[32,48],"dims_mapping":[-1,0]}]})j",
                             "enumerate");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["direction"], "enumerate");
    EXPECT_EQ(r.answer["count"], 4);
    ASSERT_EQ(r.answer["strategies"].size(), 4u);
    EXPECT_EQ(r.answer["chosen"], 3);
    EXPECT_EQ(r.answer["strategies"][1]["output"]["text"], "[-1,-1] partial{0}");
    EXPECT_EQ(r.answer["strategies"][1]["inputs"][0]["placements"], json::parse(R"j(["S(1)"])j"));
    const json &chosen = r.answer["chosen_strategy"];
    EXPECT_EQ(chosen["output"]["text"], "[-1,0]");
    EXPECT_EQ(chosen["inputs"][1]["redistribute"]["steps"].size(), 0u);
    EXPECT_EQ(r.answer["cost_model"]["name"], "nccl_h200");
}

// enumerate on a 2-D mesh, an einsum: (1 + 4 labels)^2 = 25 strategies
TEST(ShardlineSpmdCliTest, EnumerateOnATwoDimMesh) {
    const Result r = RunTool(R"j({"op":"einsum","direction":"enumerate","mesh":{"shape":[2,2]},
        "inputs":[{"shape":[4,8,6]},{"shape":[4,6,5]}],"attrs":{"equation":"bmk,bkn->bmn"}})j",
                             "enumerate2d");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["count"], 25);
}

// enumerate of softmax, and with an out_grad: errors naming the field
TEST(ShardlineSpmdCliTest, EnumerateOfANonEinsumOpIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"softmax","direction":"enumerate","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,8]}]})j",
                                "enumerate_softmax"),
                        "direction", "einsum-style op"));
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"matmul","direction":"enumerate","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,8]},{"shape":[8,2]}],"out_grad":{"shape":[4,2]}})j",
                                "enumerate_grad"),
                        "out_grad", "enumerate"));
}

// linear attrs trans_x / trans_y = false: x km[0,-1] (in on mesh 0), w kn[0,-1] -> y mn partial{0}
TEST(ShardlineSpmdCliTest, LinearTransposeAttrs) {
    const Result r = RunTool(R"j({"op":"linear","mesh":{"shape":[2]},"inputs":[{"shape":[32,10],
        "dims_mapping":[0,-1]},{"shape":[32,12],"dims_mapping":[0,-1]}],"attrs":{"trans_x":true,"trans_y":false}})j",
                             "linear_trans");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["outputs"][0]["shape"], json::parse("[10,12]"));
    EXPECT_EQ(r.answer["outputs"][0]["text"], "[-1,-1] partial{0}");
    EXPECT_EQ(r.answer["bias_after_reduction"], false);
}

// linear attrs of the wrong type
TEST(ShardlineSpmdCliTest, LinearAttrOfTheWrongTypeIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"linear","mesh":{"shape":[2]},"inputs":[{"shape":[4,8]},
        {"shape":[2,8]}],"attrs":{"trans_y":1}})j",
                                "linear_badattr"),
                        "attrs.trans_y", "expected true or false"));
}

// P(prod) -> R: all_reduce with reduce_op prod
TEST(ShardlineSpmdCliTest, ProdPartialIsAllReducedWithProd) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[6],
        "src":{"placements":["P(prod)"]},"dst":{"placements":["R"]}})j",
                             "prod");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    ASSERT_EQ(r.answer["steps"].size(), 1u);
    EXPECT_EQ(r.answer["steps"][0]["collective"], "all_reduce");
    EXPECT_EQ(r.answer["steps"][0]["reduce_op"], "prod");
}

// partial {"0":"sum","1":"max"} on 2x2: Partials that do not commute, refused naming the field
TEST(ShardlineSpmdCliTest, PartialsThatDoNotCommuteAreAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"redistribute","mesh":{"shape":[2,2]},"shape":[4],
        "src":{"partial":{"0":"sum","1":"max"}},"dst":{}})j",
                                "noncommuting"),
                        "src.partial", "do not commute"));
}

// embedding sparse grad with ids sharded on the batch: refused naming the op
TEST(ShardlineSpmdCliTest, SparseEmbeddingGradWithShardedIdsIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"embedding","direction":"grad","mesh":{"shape":[2]},
        "inputs":[{"shape":[8,16],"dims_mapping":[0,-1]},{"shape":[1000,64]}],"out_grad":{"shape":[8,16,64]},
        "attrs":{"sparse":true}})j",
                                "sparse_grad"),
                        "embedding", "row-sparse weight gradient would be Partial"));
}

} // namespace
