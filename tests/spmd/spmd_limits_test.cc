// Robustness: a query's cost depends on the mesh's dims, not its rank count; sizes are bounded and validated before
// anything is allocated; every bad request is a JSON error (limits.h, docs/spmd.md 8).

#include <chrono>
#include <climits>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <shardline/spmd/json.h>
#include <shardline/spmd/limits.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using nlohmann::json;
using testing::L;
using testing::T;

/// The error message of `fn`, or "" when it does not throw SpmdError.
template <typename F> std::string ErrorOf(F fn) {
    try {
        fn();
    } catch (const SpmdError &e) {
        return e.what();
    }
    return "";
}

double SecondsOf(const std::function<void()> &fn) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// mesh [2^31]: no per-rank storage; coordinates and ids by arithmetic
TEST(LimitsTest, AMeshOfTwoToThe31RanksStoresNoProcessIds) {
    const ProcessMesh mesh({int64_t{1} << 31});
    EXPECT_EQ(mesh.Size(), int64_t{1} << 31);
    EXPECT_TRUE(mesh.HasDefaultProcessIds());
    EXPECT_EQ(mesh.CoordinateOf((int64_t{1} << 31) - 1), std::vector<int64_t>{(int64_t{1} << 31) - 1});
    EXPECT_EQ(mesh.ProcessIdAt({12345}), 12345);
    EXPECT_EQ(ProcessMesh({2, 2}, {}, {0, 1, 2, 3}), ProcessMesh({2, 2})); // given identity ids: the same mesh
    EXPECT_FALSE(ProcessMesh({2}, {}, {1, 0}).HasDefaultProcessIds());
}

// linear x[-1,-1], W[0,-1] on [2^31] and on [2^40]: answered in about the time of mesh [4]
TEST(LimitsTest, ALinearRuleOnTwoToThe31RanksCostsWhatItCostsOnFour) {
    const TensorSpec x = T({64, 32}, "[-1,-1]");
    const TensorSpec w = T({48, 32}, "[0,-1]");
    SpmdInfo small;
    SpmdInfo huge;
    const double t_small = SecondsOf([&] { small = InferLinearForward(ProcessMesh({4}), x, w, std::nullopt); });
    const double t_huge =
        SecondsOf([&] { huge = InferLinearForward(ProcessMesh({int64_t{1} << 31}), x, w, std::nullopt); });
    EXPECT_EQ(testing::S(huge.outputs[0]), "[-1,0]");
    EXPECT_EQ(testing::S(small.outputs[0]), "[-1,0]");
    EXPECT_LT(t_huge, 0.05 + 20 * t_small);
    const SpmdInfo largest = InferLinearForward(ProcessMesh({kMaxMeshSize}), x, w, std::nullopt);
    EXPECT_EQ(MaxLocalShape(ProcessMesh({kMaxMeshSize}), w.shape, largest.inputs[1].layout),
              (std::vector<int64_t>{1, 32}));
}

// mesh [2^20, 2^20, 2]: more than 2^40 ranks
TEST(LimitsTest, AMeshOfMoreThanTwoToThe40RanksIsAnError) {
    EXPECT_NE(
        ErrorOf([] { ProcessMesh({int64_t{1} << 20, int64_t{1} << 20, 2}); }).find("more than 1099511627776 ranks"),
        std::string::npos);
    EXPECT_NE(ErrorOf([] { ProcessMesh({INT64_MAX, INT64_MAX}); }).find("ranks"), std::string::npos);
}

// mesh of 17 dims
TEST(LimitsTest, AMeshOfMoreThan16DimsIsAnError) {
    EXPECT_NE(ErrorOf([] { ProcessMesh(std::vector<int64_t>(17, 1)); }).find("1 to 16 dims"), std::string::npos);
}

// shape [2^40, 2^20] (2^60 elements), [0, 2^40, 2^20] (a 0-size dim counts as 1), 65 dims
TEST(LimitsTest, ShapesBeyondTwoToThe50ElementsOr64DimsAreErrors) {
    EXPECT_NO_THROW(CheckShape({int64_t{1} << 25, int64_t{1} << 25}, "x"));
    EXPECT_NE(ErrorOf([] { CheckShape({int64_t{1} << 40, int64_t{1} << 20}, "x.shape"); }).find("x.shape: "),
              std::string::npos);
    EXPECT_NE(ErrorOf([] { CheckShape({0, int64_t{1} << 40, int64_t{1} << 20}, "x"); }).find("more than"),
              std::string::npos);
    EXPECT_NE(ErrorOf([] { CheckShape({INT64_MAX, INT64_MAX}, "x"); }).find("more than"), std::string::npos);
    EXPECT_NE(ErrorOf([] { CheckShape(std::vector<int64_t>(65, 1), "x"); }).find("at most 64 dims"), std::string::npos);
    EXPECT_NE(ErrorOf([] { CheckShape({4, -1}, "x"); }).find(">= 0"), std::string::npos);
}

// all_gather of [1, 2^50] sharded [0,-1] on 2^20 ranks: (2^20 - 1) * 2^50 * 4 bytes per rank overflow int64
TEST(LimitsTest, BytesPerRankBeyondInt64AreAnErrorNotAWrapAround) {
    const ProcessMesh mesh({int64_t{1} << 20});
    const std::string error =
        ErrorOf([&] { PlanRedistribute(mesh, {1, int64_t{1} << 50}, L("[0,-1]"), L("[-1,-1]")); });
    EXPECT_NE(error.find("all_gather on mesh dim 0"), std::string::npos) << error;
    EXPECT_NE(error.find("exceeds the int64 range"), std::string::npos) << error;
}

// ChunkRange(INT64_MAX, 3, 2), ChunkRange(2^62, 2^62 - 1, last): no overflow
TEST(LimitsTest, ChunkRangeNeverOverflows) {
    const auto [begin, length] = ChunkRange(INT64_MAX, 3, 2);
    EXPECT_EQ(begin + length, INT64_MAX);
    EXPECT_EQ(length, INT64_MAX - 2 * (INT64_MAX / 3 + 1));
    const int64_t big = int64_t{1} << 62;
    const auto last = ChunkRange(big, big - 1, big - 2);
    EXPECT_EQ(last.first, big);
    EXPECT_EQ(last.second, 0);
    EXPECT_NE(ErrorOf([] { ChunkRange(4, 2, 2); }).find("index < parts"), std::string::npos);
}

// cost mode on a 6-dim mesh of size-2 dims, linear grad: 4^6 candidates > 1024
TEST(LimitsTest, CostModeBeyondTheCandidateLimitIsAnErrorNotAHang) {
    RuleOptions options;
    options.mode = RuleMode::kCostBased;
    const ProcessMesh mesh({2, 2, 2, 2, 2, 2});
    const std::string error = ErrorOf([&] {
        InferLinearGrad(mesh, T({64, 32}, "[0,-1]"), T({48, 32}, "[1,-1]"), std::nullopt, T({64, 48}, "[0,1]"),
                        options);
    });
    EXPECT_NE(error.find("more than 1024 candidates"), std::string::npos) << error;
    EXPECT_NO_THROW(InferLinearGrad(ProcessMesh({2, 2, 2, 2}), T({64, 32}, "[0,-1]"), T({48, 32}, "[1,-1]"),
                                    std::nullopt, T({64, 48}, "[0,1]"), options));
}

// a cost model with a negative latency, a zero bandwidth, a NaN
TEST(LimitsTest, InvalidCostModelsAreErrors) {
    CostModel m;
    m.alpha_us = -1.0;
    EXPECT_NE(ErrorOf([&] { m.Validate("cost_model"); }).find("cost_model.alpha_us: must be >= 0"), std::string::npos);
    m = CostModel{};
    m.bandwidth_gb_per_s_per_dim = {1.0, 0.0};
    EXPECT_NE(ErrorOf([&] { m.Validate("cost_model"); }).find("bandwidth_gb_per_s_per_dim[1]: must be > 0"),
              std::string::npos);
    m = CostModel{};
    m.flops_per_us = std::nan("");
    EXPECT_NE(ErrorOf([&] { m.Validate("c"); }).find("c.flops_per_us"), std::string::npos);
    PlanOptions options;
    options.cost.call_us = -3.0;
    EXPECT_NE(ErrorOf([&] {
                  PlanRedistribute(ProcessMesh({2}), {4}, L("[0]"), L("[-1]"), options);
              }).find("call_us: must be >= 0"),
              std::string::npos);
}

// {"attrs": {"axis": 2^32 - 1}} and dims_mapping [2^32]: never narrowed to -1 / 0
TEST(LimitsTest, IntegersBeyondTheIntRangeAreErrorsNotWrapArounds) {
    const RequestAnswer axis = AnswerRequestText(
        R"j({"op":"softmax","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],"attrs":{"axis":4294967295}})j");
    EXPECT_EQ(axis.exit_code, 2);
    EXPECT_EQ(axis.answer["error"], "attrs.axis: expected an integer in the int range, got 4294967295");
    const RequestAnswer dim = AnswerRequestText(
        R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"dims_mapping":[4294967296]}]})j");
    EXPECT_EQ(dim.answer["error"], "inputs[0].dims_mapping[0]: expected an integer in the int range, got 4294967296");
}

// 33 nested arrays; a request over 64 MiB
TEST(LimitsTest, DeepOrHugeRequestsAreErrorsBeforeTheyAreParsed) {
    std::string deep = R"j({"op":"relu","mesh":{"shape":[2]},"inputs":)j";
    deep += std::string(40, '[') + std::string(40, ']') + "}";
    const RequestAnswer a = AnswerRequestText(deep);
    EXPECT_EQ(a.exit_code, 2);
    EXPECT_EQ(a.answer["error"], "request: nests arrays and objects more than 32 deep");
    json nested = 1;
    for (int i = 0; i < 40; ++i) {
        nested = json::array({nested});
    }
    EXPECT_NE(ErrorOf([&] { HandleRequest(json{{"op", "relu"}, {"inputs", nested}}); }).find("more than 32 deep"),
              std::string::npos);
    const std::string huge(static_cast<size_t>(kMaxRequestBytes) + 1, ' ');
    EXPECT_EQ(AnswerRequestText(huge).answer["error"], "request: larger than 67108864 bytes (67108865)");
}

// an unknown attribute named "\u0000shape": the message keeps its field (what() is a C string)
TEST(LimitsTest, ANulByteInAFieldNameDoesNotCutTheMessage) {
    const RequestAnswer a = AnswerRequestText(
        R"j({"op":"reshape","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],"attrs":{"\u0000shape":[-1]}})j");
    EXPECT_EQ(a.exit_code, 2);
    const std::string message = a.answer["error"];
    EXPECT_EQ(message.rfind("attrs.\\u0000shape: unknown attribute for reshape", 0), 0u) << message;
}

// a number beyond a double ("1e999") is invalid JSON, not an internal error
TEST(LimitsTest, ANumberBeyondADoubleIsInvalidJson) {
    const RequestAnswer a = AnswerRequestText(R"j({"op":"relu","mesh":{"shape":[1e999]}})j");
    EXPECT_EQ(a.exit_code, 2);
    EXPECT_EQ(a.answer["error"].get<std::string>().rfind("request: invalid JSON: ", 0), 0u);
}

// element_size 65
TEST(LimitsTest, ElementSizeAbove64BytesIsAnError) {
    const RequestAnswer a = AnswerRequestText(
        R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[4],"src":{},"dst":{},"element_size":65})j");
    EXPECT_EQ(a.answer["error"], "element_size: must be <= 64 bytes, got 65");
}

} // namespace
} // namespace shardline::spmd
