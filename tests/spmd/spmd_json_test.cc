// HandleRequest in process: the JSON schema of shardline-spmd.

#include <gtest/gtest.h>

#include <shardline/spmd/json.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using nlohmann::json;

std::string ErrorOf(const char *text) {
    try {
        HandleRequest(json::parse(text));
    } catch (const SpmdError &e) {
        return e.what();
    }
    return "no error";
}

TEST(RequestTest, MatmulForwardAnswersAllThreeNotations) {
    const json answer = HandleRequest(json::parse(R"j({"op":"matmul","mesh":{"shape":[2,3]},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":[1,0]},{"name":"y","shape":[32,16],"placements":["S(0)","R"]}]})j"));
    const json &out = answer["outputs"][0];
    EXPECT_EQ(out["dims_mapping"], json::parse("[1,-1]"));
    EXPECT_EQ(out["partial"], json::parse(R"j({"0":"sum"})j"));
    EXPECT_EQ(out["placements"], json::parse(R"j(["P(sum)","S(0)"])j"));
    EXPECT_EQ(out["shape"], json::parse("[64,16]"));
    EXPECT_EQ(out["max_local_shape"], json::parse("[22,16]"));
    EXPECT_EQ(answer["inputs"][1]["redistribute"]["steps"].size(), 0u);
}

TEST(RequestTest, LinearGradReportsBackwardCommunication) {
    const json answer = HandleRequest(json::parse(R"j({"op":"linear","direction":"grad","mesh":{"shape":[4]},
        "inputs":[{"shape":[64,32],"dims_mapping":[0,-1]},{"shape":[48,32],"dims_mapping":[0,-1]}],
        "out_grad":{"shape":[64,48],"dims_mapping":[-1,0]}})j"));
    const json &dx = answer["outputs"][0];
    EXPECT_EQ(dx["name"], "x_grad");
    EXPECT_EQ(dx["partial"], json::parse(R"j({"0":"sum"})j"));
    const json &steps = dx["redistribute_to"]["plan"]["steps"];
    ASSERT_EQ(steps.size(), 1u);
    EXPECT_EQ(steps[0]["collective"], "reduce_scatter");
    EXPECT_EQ(steps[0]["bytes_per_rank"], 3 * 16 * 32 * 4);
}

TEST(RequestTest, RedistributeAnswersStepsAndCost) {
    const json answer = HandleRequest(json::parse(R"j({"op":"redistribute","mesh":{"shape":[4]},"shape":[8,8],
        "src":{"dims_mapping":[-1,-1],"partial":[0]},"dst":{"dims_mapping":[0,-1]},"dtype":"bfloat16"})j"));
    ASSERT_EQ(answer["steps"].size(), 1u);
    EXPECT_EQ(answer["steps"][0]["collective"], "reduce_scatter");
    EXPECT_EQ(answer["steps"][0]["tensor_dim"], 0);
    EXPECT_EQ(answer["steps"][0]["bytes_per_rank"], 3 * 2 * 8 * 2);
    const CostModel m; // the default profile, nccl_h200
    EXPECT_DOUBLE_EQ(answer["cost_us"].get<double>(), m.call_us + 3 * m.alpha_us + 96.0 / (m.bandwidth_gb_per_s * 1e3));
}

TEST(RequestTest, CostModeReportsCost) {
    const json answer = HandleRequest(json::parse(R"j({"op":"matmul","mode":"cost","mesh":{"shape":[4]},
        "inputs":[{"shape":[8,32],"dims_mapping":[0,-1]},{"shape":[32,4096],"dims_mapping":[-1,0]}]})j"));
    EXPECT_EQ(answer["outputs"][0]["dims_mapping"], json::parse("[-1,0]"));
    EXPECT_GT(answer["cost_us"].get<double>(), 0.0);
}

TEST(RequestTest, ErrorsNameTheField) {
    EXPECT_NE(ErrorOf(R"j({"mesh":{"shape":[2]},"inputs":[]})j").find("missing required field 'op'"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"conv","mesh":{"shape":[2]},"inputs":[]})j").find("op: unknown op 'conv'"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","inputs":[]})j").find("'mesh'"), std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[2,2]}]})j").find("expects 2 input"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[2,2],"dims_mapping":[1,-1]},
        {"shape":[2,2]}]})j")
                  .find("inputs[0].dims_mapping"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":"x"},{"shape":[2,2]}]})j")
                  .find("inputs[0].shape: expected an array"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","mesh":{"shape":[2]},"direction":"sideways","inputs":[]})j").find("direction"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[2,2]},{"shape":[2,2]}],
        "attrs":{"transpose":true}})j")
                  .find("attrs.transpose: unknown attribute"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"matmul","direction":"grad","mesh":{"shape":[2]},"inputs":[{"shape":[2,2]},
        {"shape":[2,2]}]})j")
                  .find("'out_grad'"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j({"op":"redistribute","mesh":{"shape":[2]},"src":{},"dst":{}})j").find("shape: missing"),
              std::string::npos);
    EXPECT_NE(ErrorOf(R"j([1,2])j").find("expected a JSON object"), std::string::npos);
}

} // namespace
} // namespace shardline::spmd
