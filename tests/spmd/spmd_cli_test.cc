// Runs the built shardline-spmd on JSON requests and checks the answers' values and exit codes.

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

namespace {

struct Result {
    int exit_code = -1;
    nlohmann::json answer;
};

Result RunTool(const std::string &request, const std::string &name) {
    const std::string path = ::testing::TempDir() + name + ".json";
    std::ofstream(path) << request;
    const std::string command = std::string(SHARDLINE_SPMD_TOOL) + " --compact < " + path;
    FILE *pipe = popen(command.c_str(), "r");
    std::string out;
    char buffer[4096];
    while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) {
        out += buffer;
    }
    const int status = pipe != nullptr ? pclose(pipe) : -1;
    Result result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.answer = nlohmann::json::parse(out, nullptr, false);
    return result;
}

TEST(ShardlineSpmdCliTest, RuleRequestAnswersRowParallelLinear) {
    const Result r = RunTool(R"j({"op":"linear","mesh":{"shape":[4],"dim_names":["tp"]},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":[-1,0]},{"name":"weight","shape":[48,32],"dims_mapping":[-1,0]},
                  {"name":"bias","shape":[48],"dims_mapping":[-1]}],
        "outputs":[{"shape":[64,48],"dims_mapping":[0,-1]}]})j",
                             "row");
    ASSERT_EQ(r.exit_code, 0);
    EXPECT_EQ(r.answer["bias_after_reduction"], true);
    const auto &y = r.answer["outputs"][0];
    EXPECT_EQ(y["placements"], nlohmann::json::parse(R"j(["P(sum)"])j"));
    const auto &steps = y["redistribute_to"]["plan"]["steps"];
    ASSERT_EQ(steps.size(), 1u);
    EXPECT_EQ(steps[0]["collective"], "reduce_scatter");
    EXPECT_EQ(steps[0]["mesh_dim_name"], "tp");
    EXPECT_EQ(steps[0]["bytes_per_rank"], 3 * 16 * 48 * 4);
}

TEST(ShardlineSpmdCliTest, RedistributeRequestAnswersPlan) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2,4]},"shape":[8,8],
        "src":{"dims_mapping":[0,1]},"dst":{"placements":["R","R"]}})j",
                             "redistribute");
    ASSERT_EQ(r.exit_code, 0);
    ASSERT_EQ(r.answer["steps"].size(), 2u);
    EXPECT_EQ(r.answer["steps"][0]["collective"], "all_gather");
    EXPECT_EQ(r.answer["steps"][0]["bytes_per_rank"], 32);
    EXPECT_EQ(r.answer["steps"][1]["bytes_per_rank"], 192);
    EXPECT_EQ(r.answer["bytes_per_rank"], 224);
}

TEST(ShardlineSpmdCliTest, MalformedJsonIsAnErrorObjectWithExitTwo) {
    const Result r = RunTool("{\"op\": ", "malformed");
    EXPECT_EQ(r.exit_code, 2);
    ASSERT_TRUE(r.answer.is_object());
    EXPECT_NE(r.answer["error"].get<std::string>().find("invalid JSON"), std::string::npos);
}

TEST(ShardlineSpmdCliTest, BadLayoutIsAnErrorNamingTheField) {
    const Result r = RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,4],"dims_mapping":[0,0]},
        {"shape":[4,4]}]})j",
                             "badlayout");
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.answer["error"].get<std::string>().find("inputs[0].dims_mapping"), std::string::npos);
}

TEST(ShardlineSpmdCliTest, UnknownOpAndInconsistentShapesAreErrors) {
    EXPECT_EQ(RunTool(R"j({"op":"conv2d","mesh":{"shape":[2]},"inputs":[]})j", "unknown").exit_code, 2);
    const Result r =
        RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,3]},{"shape":[4,4]}]})j", "shapes");
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.answer["error"].get<std::string>().find("contracted dim"), std::string::npos);
}

TEST(ShardlineSpmdCliTest, NonObjectRequestIsAnError) {
    const Result r = RunTool("[1, 2, 3]", "array");
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_TRUE(r.answer.contains("error"));
}

} // namespace
