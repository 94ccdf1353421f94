// Runs the built shardline-spmd on JSON requests and checks the answers' values and exit codes.
//
// Exit-code convention (tools/shardline_spmd.cc): 0 answered; 2 the request was wrong, stdout is one JSON object
// {"error": "<field>: <what>"}; 1 the command line was wrong, stdout is empty and the usage goes to stderr.

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "spmd_cli_util.h"

namespace {

using namespace shardline::spmd::cli_testing;

// ---- answers --------------------------------------------------------------------------------------------------------

// linear x[-1,0], W[-1,0], b[-1] on tp=4, output wanted [0,-1]: y P(sum) -> reduce_scatter
TEST(ShardlineSpmdCliTest, RuleRequestAnswersRowParallelLinear) {
    const Result r = RunTool(R"j({"op":"linear","mesh":{"shape":[4],"dim_names":["tp"]},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":[-1,0]},{"name":"weight","shape":[48,32],"dims_mapping":[-1,0]},
                  {"name":"bias","shape":[48],"dims_mapping":[-1]}],
        "outputs":[{"shape":[64,48],"dims_mapping":[0,-1]}]})j",
                             "row");
    ASSERT_EQ(r.exit_code, kExitAnswered);
    EXPECT_EQ(r.answer["bias_after_reduction"], true);
    const auto &y = r.answer["outputs"][0];
    EXPECT_EQ(y["placements"], json::parse(R"j(["P(sum)"])j"));
    const auto &steps = y["redistribute_to"]["plan"]["steps"];
    ASSERT_EQ(steps.size(), 1u);
    EXPECT_EQ(steps[0]["collective"], "reduce_scatter");
    EXPECT_EQ(steps[0]["mesh_dim_name"], "tp");
    EXPECT_EQ(steps[0]["bytes_per_rank"], 3 * 16 * 48 * 4);
}

// grouped_linear x[-1,-1], W[0,-1,-1] (experts over ep), W[.,.,tp] (in over tp) on ep=2 x tp=2: x needs [0,1], y is
// [0,-1] Partial over tp only, the bias after the reduction
TEST(ShardlineSpmdCliTest, RuleRequestAnswersGroupedLinearWithExpertAndRowParallelism) {
    const Result r = RunTool(R"j({"op":"grouped_linear","mesh":{"shape":[2,2],"dim_names":["ep","tp"]},
        "inputs":[{"name":"x","shape":[64,32],"dims_mapping":[-1,-1]},
                  {"name":"weight","shape":[8,48,32],"dims_mapping":["ep",-1,"tp"]},
                  {"name":"bias","shape":[8,48],"dims_mapping":["ep",-1]}]})j",
                             "grouped");
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["bias_after_reduction"], true);
    EXPECT_EQ(r.answer["inputs"][0]["dims_mapping"], json::parse("[0,1]"));
    EXPECT_EQ(r.answer["outputs"][0]["dims_mapping"], json::parse("[0,-1]"));
    EXPECT_EQ(r.answer["outputs"][0]["placements"], json::parse(R"j(["S(0)","P(sum)"])j"));
}

// [0,1] -> R,R on 2x4, 8x8 fp32: gather dp off dim 0 (1 * 4*2*4 B), then tp off dim 1 (3 * 8*2*4 B)
TEST(ShardlineSpmdCliTest, RedistributeRequestAnswersPlan) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2,4]},"shape":[8,8],
        "src":{"dims_mapping":[0,1]},"dst":{"placements":["R","R"]}})j",
                             "redistribute");
    ASSERT_EQ(r.exit_code, kExitAnswered);
    ASSERT_EQ(r.answer["steps"].size(), 2u);
    EXPECT_EQ(r.answer["steps"][0]["collective"], "all_gather");
    EXPECT_EQ(r.answer["steps"][0]["bytes_per_rank"], 32);
    EXPECT_EQ(r.answer["steps"][1]["bytes_per_rank"], 192);
    EXPECT_EQ(r.answer["bytes_per_rank"], 224);
}

TEST(ShardlineSpmdCliTest, RequestFileArgumentIsRead) {
    const std::string path = WriteRequest(
        R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"name":"x","shape":[4],"dims_mapping":[0]}]})j", "file");
    const Result r = RunCommand(path);
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["outputs"][0]["dims_mapping"], json::parse("[0]"));
}

TEST(ShardlineSpmdCliTest, DashReadsStdin) {
    const std::string path = WriteRequest(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[4],
        "src":{"dims_mapping":[0]},"dst":{"dims_mapping":[-1]}})j",
                                          "dash");
    const Result r = RunCommand("- < " + path);
    ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
    EXPECT_EQ(r.answer["steps"][0]["collective"], "all_gather");
}

// ---- command line: exit 1, nothing on stdout ------------------------------------------------------------------------

TEST(ShardlineSpmdCliTest, UnknownFlagIsAUsageErrorWithExitOne) {
    const Result r = RunCommand("--bogus < /dev/null");
    EXPECT_EQ(r.exit_code, kExitUsage);
    EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(ShardlineSpmdCliTest, TwoRequestFilesAreAUsageError) {
    const Result r = RunCommand("a.json b.json");
    EXPECT_EQ(r.exit_code, kExitUsage);
    EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(ShardlineSpmdCliTest, HelpPrintsUsageAndExitsZero) {
    const Result r = RunCommand("--help");
    EXPECT_EQ(r.exit_code, kExitAnswered);
    EXPECT_NE(r.out.find("usage: shardline-spmd"), std::string::npos);
}

// ---- request errors: exit 2 and {"error": "<field>: ..."} ---------------------------------------------------------

TEST(ShardlineSpmdCliTest, MissingRequestFileIsAnError) {
    const Result r = RunCommand(::testing::TempDir() + "spmd_cli_no_such_file.json");
    EXPECT_TRUE(IsError(r, "request", "cannot open"));
}

TEST(ShardlineSpmdCliTest, MalformedJsonIsAnErrorObjectWithExitTwo) {
    EXPECT_TRUE(IsError(RunTool("{\"op\": ", "malformed"), "request", "invalid JSON"));
}

TEST(ShardlineSpmdCliTest, EmptyInputIsAnError) {
    EXPECT_TRUE(IsError(RunTool("", "empty"), "request", "invalid JSON"));
}

TEST(ShardlineSpmdCliTest, NonObjectRequestIsAnError) {
    EXPECT_TRUE(IsError(RunTool("[1, 2, 3]", "array"), "request", "expected a JSON object, got array"));
}

TEST(ShardlineSpmdCliTest, MissingOpIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"mesh":{"shape":[2]},"inputs":[]})j", "noop"), "request", "'op'"));
}

TEST(ShardlineSpmdCliTest, NonStringOpIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":3,"mesh":{"shape":[2]},"inputs":[]})j", "intop"), "op", "string"));
}

TEST(ShardlineSpmdCliTest, UnknownOpIsAnErrorListingTheKnownOps) {
    const Result r = RunTool(R"j({"op":"conv2d","mesh":{"shape":[2]},"inputs":[]})j", "unknown");
    EXPECT_TRUE(IsError(r, "op", "unknown op 'conv2d'"));
    EXPECT_TRUE(IsError(r, "op", "matmul"));
    EXPECT_TRUE(IsError(r, "op", "redistribute"));
}

TEST(ShardlineSpmdCliTest, MissingMeshIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"relu","inputs":[{"shape":[4]}]})j", "nomesh"), "request", "'mesh'"));
}

TEST(ShardlineSpmdCliTest, BadMeshShapeIsAnError) {
    EXPECT_TRUE(
        IsError(RunTool(R"j({"op":"relu","mesh":{"shape":[2,0]},"inputs":[{"shape":[4]}]})j", "mesh0"), "mesh"));
    EXPECT_TRUE(
        IsError(RunTool(R"j({"op":"relu","mesh":{"shape":"2"},"inputs":[{"shape":[4]}]})j", "meshstr"), "mesh.shape"));
}

TEST(ShardlineSpmdCliTest, BadDirectionIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","direction":"backward","mesh":{"shape":[2]},"inputs":[{"shape":[4]}]})j", "direction");
    EXPECT_TRUE(IsError(r, "direction", "expected forward, reverse, grad or enumerate, got 'backward'"));
}

TEST(ShardlineSpmdCliTest, BadModeIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mode":"greedy","mesh":{"shape":[2]},"inputs":[{"shape":[4]}]})j", "mode");
    EXPECT_TRUE(IsError(r, "mode", "expected deterministic or cost, got 'greedy'"));
}

TEST(ShardlineSpmdCliTest, UnknownAttrIsAnErrorListingTheKnownAttrs) {
    const Result r = RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]},{"shape":[4,4]}],
        "attrs":{"transpose_x":true}})j",
                             "unknownattr");
    EXPECT_TRUE(IsError(r, "attrs.transpose_x", "unknown attribute for matmul (known: [trans_x,trans_y])"));
}

TEST(ShardlineSpmdCliTest, AttrOfAnOpWithoutAttrsIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],"attrs":{"axis":0}})j", "reluattr");
    EXPECT_TRUE(IsError(r, "attrs.axis", "unknown attribute for relu"));
}

TEST(ShardlineSpmdCliTest, NonObjectAttrsIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],"attrs":[1]})j", "attrsarray");
    EXPECT_TRUE(IsError(r, "attrs", "expected an object, got array"));
}

TEST(ShardlineSpmdCliTest, WronglyTypedBoolAttrIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]},{"shape":[4,4]}],
        "attrs":{"trans_x":"yes"}})j",
                             "boolattr");
    EXPECT_TRUE(IsError(r, "attrs.trans_x", "expected true or false, got string"));
}

TEST(ShardlineSpmdCliTest, WronglyTypedIntListAttrIsAnError) {
    const Result r =
        RunTool(R"j({"op":"sum","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}],"attrs":{"axes":[0,"1"]}})j", "axes");
    EXPECT_TRUE(IsError(r, "attrs.axes[1]", "expected an integer, got string"));
}

TEST(ShardlineSpmdCliTest, WronglyTypedIntAttrIsAnError) {
    const Result r =
        RunTool(R"j({"op":"softmax","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}],"attrs":{"axis":1.5}})j", "axis");
    EXPECT_TRUE(IsError(r, "attrs.axis", "expected an integer"));
}

TEST(ShardlineSpmdCliTest, UnknownCrossEntropyReductionIsAnError) {
    const Result r = RunTool(R"j({"op":"cross_entropy","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,8]},{"shape":[4]}],"attrs":{"reduction":"avg"}})j",
                             "reduction");
    EXPECT_TRUE(IsError(r, "attrs.reduction", "expected none, mean or sum, got 'avg'"));
}

TEST(ShardlineSpmdCliTest, TransposeWithoutPermIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"transpose","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}]})j", "noperm"),
                        "attrs.perm", "permutation"));
}

TEST(ShardlineSpmdCliTest, ReshapeWithoutShapeIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"reshape","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}]})j", "noshape"),
                        "attrs.shape", "target shape"));
}

TEST(ShardlineSpmdCliTest, EinsumWithoutEquationIsAnError) {
    const Result r =
        RunTool(R"j({"op":"einsum","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]},{"shape":[4,4]}]})j", "noeq");
    EXPECT_TRUE(IsError(r, "attrs.equation", "equation"));
}

TEST(ShardlineSpmdCliTest, WrongInputCountIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}]})j", "count");
    EXPECT_TRUE(IsError(r, "inputs", "matmul expects 2 input(s) (x, y), got 1"));
}

TEST(ShardlineSpmdCliTest, WrongInputCountForABinaryElementwiseOpIsAnError) {
    const Result r = RunTool(R"j({"op":"add","mesh":{"shape":[2]},"inputs":[{"shape":[4]}]})j", "addcount");
    EXPECT_TRUE(IsError(r, "inputs", "add expects 2 input(s) (x, y), got 1"));
}

TEST(ShardlineSpmdCliTest, TooManyLinearInputsIsAnError) {
    const Result r = RunTool(R"j({"op":"linear","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,4]},{"shape":[4,4]},{"shape":[4]},{"shape":[4]}]})j",
                             "linearcount");
    EXPECT_TRUE(IsError(r, "inputs", "linear expects 2 to 3 input(s)"));
}

TEST(ShardlineSpmdCliTest, MissingInputsIsAnError) {
    EXPECT_TRUE(IsError(RunTool(R"j({"op":"relu","mesh":{"shape":[2]}})j", "noinputs"), "request", "'inputs'"));
}

TEST(ShardlineSpmdCliTest, InputWithoutShapeIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"dims_mapping":[0]}]})j", "noshapeinput");
    EXPECT_TRUE(IsError(r, "inputs[0]", "'shape'"));
}

TEST(ShardlineSpmdCliTest, NegativeShapeIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4,-1]}]})j", "negshape");
    EXPECT_TRUE(IsError(r, "inputs[0].shape", "dims must be >= 0"));
}

TEST(ShardlineSpmdCliTest, GradWithoutOutGradIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","direction":"grad","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,4]},{"shape":[4,4]}]})j",
                             "nooutgrad");
    EXPECT_TRUE(IsError(r, "request", "missing required field 'out_grad'"));
}

TEST(ShardlineSpmdCliTest, ReverseWithoutOutputsIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","direction":"reverse","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,4]},{"shape":[4,4]}]})j",
                             "nooutputs");
    EXPECT_TRUE(IsError(r, "outputs", "reverse request needs"));
}

TEST(ShardlineSpmdCliTest, TwoOutputsIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "outputs":[{"shape":[4]},{"shape":[4]}]})j",
                             "twooutputs");
    EXPECT_TRUE(IsError(r, "outputs", "one output, got 2"));
}

TEST(ShardlineSpmdCliTest, OutputTargetWithoutShapeIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mode":"cost","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "output_target":{"dims_mapping":[0]}})j",
                             "targetnoshape");
    EXPECT_TRUE(IsError(r, "output_target", "expected an object with the output's shape"));
}

TEST(ShardlineSpmdCliTest, OutputTargetWithBadLayoutIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mode":"cost","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "output_target":{"shape":[4],"dims_mapping":[3]}})j",
                             "targetbad");
    EXPECT_TRUE(IsError(r, "output_target.dims_mapping"));
}

TEST(ShardlineSpmdCliTest, OutputTargetOnAReverseRequestIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","direction":"reverse","mode":"cost","mesh":{"shape":[2]},
        "inputs":[{"shape":[4]}],"outputs":[{"shape":[4]}],"output_target":{"shape":[4],"dims_mapping":[0]}})j",
                             "targetreverse");
    EXPECT_EQ(r.exit_code, kExitRequestError) << r.out;
    ASSERT_TRUE(r.answer.is_object()) << r.out;
    EXPECT_NE(r.answer["error"].get<std::string>().find("output_target"), std::string::npos) << r.out;
}

TEST(ShardlineSpmdCliTest, UnknownDtypeIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","dtype":"float8","mesh":{"shape":[2]},"inputs":[{"shape":[4]}]})j", "dtype");
    EXPECT_TRUE(IsError(r, "dtype", "got 'float8'"));
}

TEST(ShardlineSpmdCliTest, DtypeAndElementSizeTogetherIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","dtype":"float32","element_size":4,"mesh":{"shape":[2]},
        "inputs":[{"shape":[4]}]})j",
                             "dtypeandsize");
    EXPECT_TRUE(IsError(r, "element_size", "not both"));
}

TEST(ShardlineSpmdCliTest, NonPositiveElementSizeIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","element_size":0,"mesh":{"shape":[2]},"inputs":[{"shape":[4]}]})j", "size0");
    EXPECT_TRUE(IsError(r, "element_size", "must be >= 1, got 0"));
}

TEST(ShardlineSpmdCliTest, UnknownCostModelFieldIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "cost_model":{"beta":1}})j",
                             "costfield");
    EXPECT_TRUE(IsError(r, "cost_model.beta", "unknown field"));
}

TEST(ShardlineSpmdCliTest, WronglyTypedCostModelFieldIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "cost_model":{"alpha_us_per_dim":[1,"x"]}})j",
                             "costtype");
    EXPECT_TRUE(IsError(r, "cost_model.alpha_us_per_dim[1]", "expected a number"));
}

TEST(ShardlineSpmdCliTest, NonPositiveBandwidthIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "cost_model":{"bandwidth_gb_per_s":0}})j",
                             "bandwidth");
    EXPECT_TRUE(IsError(r, "cost_model.bandwidth_gb_per_s", "must be > 0"));
}

TEST(ShardlineSpmdCliTest, NonObjectCostModelIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],"cost_model":7})j", "costnum");
    EXPECT_TRUE(IsError(r, "cost_model", "expected an object"));
}

TEST(ShardlineSpmdCliTest, DimsMappingAndPlacementsTogetherIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},
        "inputs":[{"shape":[4],"dims_mapping":[0],"placements":["S(0)"]}]})j",
                             "both");
    EXPECT_TRUE(IsError(r, "inputs[0]", "give one of dims_mapping, placements or layout, not several"));
}

TEST(ShardlineSpmdCliTest, PlacementsWithAPartialFieldIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},
        "inputs":[{"shape":[4],"placements":["R"],"partial":[0]}]})j",
                             "placementspartial");
    EXPECT_TRUE(IsError(r, "inputs[0].partial", "write Partial as P(op)"));
}

TEST(ShardlineSpmdCliTest, PlacementCountNotMeshRankIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2,2]},"inputs":[{"shape":[4],"placements":["S(0)"]}]})j",
                             "placecount");
    EXPECT_TRUE(IsError(r, "inputs[0].placements", "one placement per mesh dim (2), got 1"));
}

TEST(ShardlineSpmdCliTest, UnparsablePlacementIsAnError) {
    const Result r = RunTool(
        R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"placements":["Shard(0)"]}]})j", "placebad");
    EXPECT_TRUE(IsError(r, "inputs[0].placements"));
}

TEST(ShardlineSpmdCliTest, PlacementShardingADimBeyondTheRankIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"placements":["S(1)"]}]})j", "placerank");
    EXPECT_TRUE(IsError(r, "inputs[0].placements"));
}

TEST(ShardlineSpmdCliTest, MeshDimOutOfRangeIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4,4],"dims_mapping":[1,-1]}]})j", "range");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping", "1"));
}

TEST(ShardlineSpmdCliTest, UnknownMeshDimNameIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2],"dim_names":["tp"]},
        "inputs":[{"shape":[4],"dims_mapping":["dp"]}]})j",
                             "name");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping[0]", "dp"));
}

TEST(ShardlineSpmdCliTest, DimsMappingBelowMinusOneIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"dims_mapping":[-2]}]})j", "minus2");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping[0]", "-2"));
}

TEST(ShardlineSpmdCliTest, MeshDimUsedTwiceIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,4],"dims_mapping":[0,0]},
        {"shape":[4,4]}]})j",
                             "badlayout");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping", "mesh dim 0 is used twice"));
}

TEST(ShardlineSpmdCliTest, MeshDimShardingAndPartialIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},
        "inputs":[{"shape":[4],"dims_mapping":[0],"partial":[0]}]})j",
                             "shardpartial");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping", "0"));
}

TEST(ShardlineSpmdCliTest, UnknownPartialReduceOpIsAnError) {
    const Result r = RunTool(R"j({"op":"relu","mesh":{"shape":[2]},
        "inputs":[{"shape":[4],"dims_mapping":[-1],"partial":{"0":"xor"}}]})j",
                             "partialop");
    EXPECT_TRUE(IsError(r, "inputs[0].partial.0", "expected one of sum, avg, max, min, prod, got 'xor'"));
}

TEST(ShardlineSpmdCliTest, DimsMappingRankMismatchIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4,4],"dims_mapping":[0]}]})j", "rank");
    EXPECT_TRUE(IsError(r, "inputs[0].dims_mapping", "rank"));
}

TEST(ShardlineSpmdCliTest, LayoutTextRankMismatchIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4,4],"layout":"[0]"}]})j", "textrank");
    EXPECT_TRUE(IsError(r, "inputs[0].layout", "rank"));
}

TEST(ShardlineSpmdCliTest, UnparsableLayoutTextIsAnError) {
    const Result r =
        RunTool(R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"layout":"[0"}]})j", "textbad");
    EXPECT_TRUE(IsError(r, "inputs[0].layout"));
}

TEST(ShardlineSpmdCliTest, OutGradRankMismatchNamesOutGrad) {
    const Result r = RunTool(R"j({"op":"relu","direction":"grad","mesh":{"shape":[2]},"inputs":[{"shape":[4]}],
        "out_grad":{"shape":[4],"dims_mapping":[0,-1]}})j",
                             "outgradrank");
    EXPECT_TRUE(IsError(r, "out_grad.dims_mapping", "rank"));
}

TEST(ShardlineSpmdCliTest, MatmulContractedDimMismatchIsAnError) {
    const Result r =
        RunTool(R"j({"op":"matmul","mesh":{"shape":[2]},"inputs":[{"shape":[4,3]},{"shape":[4,4]}]})j", "shapes");
    EXPECT_EQ(r.exit_code, kExitRequestError);
    ASSERT_TRUE(r.answer.is_object()) << r.out;
    EXPECT_NE(r.answer["error"].get<std::string>().find("contracted dim"), std::string::npos) << r.out;
}

TEST(ShardlineSpmdCliTest, ElementwiseBroadcastMismatchIsAnError) {
    const Result r =
        RunTool(R"j({"op":"add","mesh":{"shape":[2]},"inputs":[{"shape":[4,3]},{"shape":[4,5]}]})j", "broadcast");
    EXPECT_EQ(r.exit_code, kExitRequestError);
    ASSERT_TRUE(r.answer.is_object()) << r.out;
    EXPECT_TRUE(r.answer.contains("error"));
}

TEST(ShardlineSpmdCliTest, GradOutGradShapeMismatchIsAnError) {
    const Result r = RunTool(R"j({"op":"matmul","direction":"grad","mesh":{"shape":[2]},
        "inputs":[{"shape":[4,3]},{"shape":[3,5]}],"out_grad":{"shape":[4,4]}})j",
                             "outgradshape");
    EXPECT_EQ(r.exit_code, kExitRequestError);
    ASSERT_TRUE(r.answer.is_object()) << r.out;
    EXPECT_TRUE(r.answer.contains("error"));
}

TEST(ShardlineSpmdCliTest, ReshapeElementCountMismatchIsAnError) {
    const Result r = RunTool(
        R"j({"op":"reshape","mesh":{"shape":[2]},"inputs":[{"shape":[4,4]}],"attrs":{"shape":[5,3]}})j", "reshape");
    EXPECT_EQ(r.exit_code, kExitRequestError);
    ASSERT_TRUE(r.answer.is_object()) << r.out;
    EXPECT_TRUE(r.answer.contains("error"));
}

TEST(ShardlineSpmdCliTest, RedistributeWithoutShapeIsAnError) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2]},"src":{"dims_mapping":[0]},
        "dst":{"dims_mapping":[-1]}})j",
                             "rdnoshape");
    EXPECT_TRUE(IsError(r, "shape", "missing"));
}

TEST(ShardlineSpmdCliTest, RedistributeWithoutDstIsAnError) {
    const Result r =
        RunTool(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[4],"src":{"dims_mapping":[0]}})j", "rdnodst");
    EXPECT_TRUE(IsError(r, "request", "'dst'"));
}

TEST(ShardlineSpmdCliTest, RedistributeDstShapeMismatchIsAnError) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[4],"src":{"dims_mapping":[0]},
        "dst":{"shape":[8],"dims_mapping":[-1]}})j",
                             "rdshape");
    EXPECT_TRUE(IsError(r, "dst.shape", "must equal the source shape"));
}

TEST(ShardlineSpmdCliTest, RedistributeSrcRankMismatchIsAnError) {
    const Result r = RunTool(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[4,4],"src":{"dims_mapping":[0]},
        "dst":{"dims_mapping":[-1,-1]}})j",
                             "rdrank");
    EXPECT_TRUE(IsError(r, "src.dims_mapping", "rank"));
}

// ---- round trips ----------------------------------------------------------------------------------------------------

/// The tensor in one notation, from an answer's tensor (which carries all three).
enum class Notation { kDimsMapping, kPlacements, kText };

json Rewrite(const json &tensor, Notation notation) {
    json out{{"name", tensor["name"]}, {"shape", tensor["shape"]}};
    switch (notation) {
    case Notation::kDimsMapping:
        out["dims_mapping"] = tensor["dims_mapping"];
        out["partial"] = tensor["partial"];
        break;
    case Notation::kPlacements:
        out["placements"] = tensor["placements"];
        break;
    case Notation::kText:
        out["layout"] = tensor["text"];
        break;
    }
    return out;
}

/// The layout of an answer's tensor, all three notations, for comparisons.
json LayoutOf(const json &tensor) {
    return json{{"shape", tensor["shape"]},
                {"dims_mapping", tensor["dims_mapping"]},
                {"partial", tensor["partial"]},
                {"placements", tensor["placements"]},
                {"text", tensor["text"]}};
}

json Layouts(const json &tensors) {
    json out = json::array();
    for (const json &t : tensors) {
        out.push_back(LayoutOf(t));
    }
    return out;
}

struct RoundTripCase {
    std::string name;
    std::string request;
};

void PrintTo(const RoundTripCase &c, std::ostream *os) { *os << c.name; }

class ShardlineSpmdRoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

// Forward and grad: the answer's required layouts, fed back in each notation, are a fixpoint (same answer, every
// input plan empty). Reverse (deterministic): the answer's input layouts, fed to the forward rule, give the reverse
// answer's outputs.
TEST_P(ShardlineSpmdRoundTripTest, AnswerLayoutsFedBackAgree) {
    const json request = json::parse(GetParam().request);
    const Result first = RunJson(request, GetParam().name + "_0");
    ASSERT_EQ(first.exit_code, kExitAnswered) << first.out;
    const json &answer = first.answer;
    const std::string direction = request.value("direction", "forward");
    const size_t n_inputs = request["inputs"].size();
    ASSERT_GE(answer["inputs"].size(), n_inputs);

    // The three notations of each answer tensor describe one layout: the text round-trips to the same fields.
    for (const json &t : answer["inputs"]) {
        for (Notation n : {Notation::kDimsMapping, Notation::kPlacements, Notation::kText}) {
            const json single = {{"op", "redistribute"},
                                 {"mesh", request["mesh"]},
                                 {"src", Rewrite(t, n)},
                                 {"dst", Rewrite(t, Notation::kText)}};
            const Result r = RunJson(single, GetParam().name + "_same");
            ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
            EXPECT_TRUE(r.answer["steps"].empty()) << t.dump() << " notation " << static_cast<int>(n);
            EXPECT_EQ(LayoutOf(r.answer["src"]), LayoutOf(t));
        }
    }

    for (Notation n : {Notation::kDimsMapping, Notation::kPlacements, Notation::kText}) {
        const std::string tag = GetParam().name + "_" + std::to_string(static_cast<int>(n));
        json again = request;
        if (direction == "reverse" && request.value("mode", "deterministic") == "cost") {
            // Cost mode prices reverse and forward differently (a forward may slice a Replicate input for free), so
            // the round trip is the output in each notation giving the same answer.
            again["outputs"] = json::array({Rewrite(answer["outputs"][0], n)});
            const Result r = RunJson(again, tag);
            ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
            EXPECT_EQ(Layouts(r.answer["inputs"]), Layouts(answer["inputs"])) << again.dump();
            EXPECT_EQ(Layouts(r.answer["outputs"]), Layouts(answer["outputs"])) << again.dump();
            continue;
        }
        if (direction == "reverse") {
            again["direction"] = "forward";
            again.erase("outputs");
            json inputs = json::array();
            for (size_t i = 0; i < n_inputs; ++i) {
                inputs.push_back(Rewrite(answer["inputs"][i], n));
            }
            again["inputs"] = inputs;
            const Result r = RunJson(again, tag);
            ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
            EXPECT_EQ(Layouts(r.answer["outputs"]), Layouts(answer["outputs"])) << again.dump();
            EXPECT_EQ(Layouts(r.answer["inputs"]), Layouts(answer["inputs"])) << again.dump();
            continue;
        }
        json inputs = json::array();
        for (size_t i = 0; i < n_inputs; ++i) {
            inputs.push_back(Rewrite(answer["inputs"][i], n));
        }
        again["inputs"] = inputs;
        if (direction == "grad") {
            for (const json &t : answer["inputs"]) {
                if (t["name"] == "out_grad" || t["name"] == "loss_grad") {
                    again["out_grad"] = Rewrite(t, n);
                }
            }
        }
        const Result r = RunJson(again, tag);
        ASSERT_EQ(r.exit_code, kExitAnswered) << r.out;
        EXPECT_EQ(Layouts(r.answer["inputs"]), Layouts(answer["inputs"])) << again.dump();
        EXPECT_EQ(Layouts(r.answer["outputs"]), Layouts(answer["outputs"])) << again.dump();
        for (const json &t : r.answer["inputs"]) {
            if (t.contains("redistribute")) {
                EXPECT_TRUE(t["redistribute"]["steps"].empty()) << t.dump();
            }
        }
    }
}

std::vector<RoundTripCase> RoundTripCases() {
    const std::string m1 = R"j("mesh":{"shape":[2],"dim_names":["tp"]})j";
    const std::string m2 = R"j("mesh":{"shape":[2,2],"dim_names":["dp","tp"]})j";
    const std::string m3 = R"j("mesh":{"shape":[2,2,2]})j";
    std::vector<RoundTripCase> cases;
    auto add = [&](const std::string &name, const std::string &mesh, const std::string &body,
                   const std::string &out_grad) {
        for (const char *dir : {"forward", "reverse", "grad"}) {
            std::string request = std::string(R"j({"direction":")j") + dir + "\"," + mesh + "," + body;
            if (std::string(dir) == "grad") {
                request += R"j(,"out_grad":)j" + out_grad;
            }
            if (std::string(dir) == "reverse") {
                request += R"j(,"outputs":[)j" + out_grad + "]";
            }
            cases.push_back({name + "_" + dir, request + "}"});
        }
    };
    add("matmul", m2,
        R"j("op":"matmul","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]},
           {"name":"y","shape":[6,4],"dims_mapping":[1,-1]}])j",
        R"j({"shape":[8,4],"dims_mapping":[0,1]})j");
    add("matmul_trans", m1,
        R"j("op":"matmul","attrs":{"trans_y":true},"inputs":[{"name":"x","shape":[4,8,6],"dims_mapping":[-1,-1,0]},
           {"name":"y","shape":[5,6],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[4,8,5],"dims_mapping":[0,-1,-1]})j");
    add("linear", m2,
        R"j("op":"linear","inputs":[{"name":"x","shape":[8,6],"dims_mapping":["dp",-1]},
           {"name":"weight","shape":[4,6],"dims_mapping":["tp",-1]},{"name":"bias","shape":[4],"dims_mapping":[-1]}])j",
        R"j({"shape":[8,4],"placements":["S(0)","S(1)"]})j");
    add("linear_row", m1,
        R"j("op":"linear","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[-1,0]},
           {"name":"weight","shape":[4,6],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[8,4],"dims_mapping":[-1,-1],"partial":[0]})j");
    add("grouped_linear", m2,
        R"j("op":"grouped_linear","inputs":[{"name":"x","shape":[8,6],"dims_mapping":["dp",-1]},
           {"name":"weight","shape":[4,5,6],"dims_mapping":[-1,"tp",-1]},
           {"name":"bias","shape":[4,5],"dims_mapping":[-1,"tp"]}])j",
        R"j({"shape":[8,5],"dims_mapping":[0,1]})j");
    add("grouped_linear_expert_parallel", m2,
        R"j("op":"grouped_linear","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]},
           {"name":"weight","shape":[4,5,6],"dims_mapping":[0,-1,1]}])j",
        R"j({"shape":[8,5],"dims_mapping":[0,-1],"partial":[1]})j");
    const std::string m_ep = R"j("mesh":{"shape":[2,2],"dim_names":["dp","ep"]})j";
    add("moe_dispatch", m_ep,
        R"j("op":"moe_dispatch","attrs":{"num_experts":4,"topk":2},
           "inputs":[{"name":"x","shape":[8,6],"dims_mapping":[["dp","ep"],-1]}])j",
        R"j({"shape":[16,6],"dims_mapping":[["ep","dp"],-1]})j");
    add("moe_combine", m_ep,
        R"j("op":"moe_combine","attrs":{"num_experts":4,"topk":2},
           "inputs":[{"name":"x","shape":[16,6],"dims_mapping":[["ep","dp"],-1]}])j",
        R"j({"shape":[8,6],"dims_mapping":[["dp","ep"],-1]})j");
    add("embedding", m2,
        R"j("op":"embedding","inputs":[{"name":"ids","shape":[4,5],"dims_mapping":[0,-1]},
           {"name":"weight","shape":[16,8],"dims_mapping":[1,-1]}])j",
        R"j({"shape":[4,5,8],"dims_mapping":[0,-1,-1]})j");
    add("embedding_bag", m2,
        R"j("op":"embedding_bag","inputs":[{"name":"ids","shape":[4,5],"dims_mapping":[-1,0]},
           {"name":"weight","shape":[16,8],"dims_mapping":[1,-1]}])j",
        R"j({"shape":[5,8],"dims_mapping":[0,-1]})j");
    add("softmax", m2,
        R"j("op":"softmax","attrs":{"axis":-1},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]}])j",
        R"j({"shape":[8,6],"dims_mapping":[0,-1]})j");
    add("log_softmax_vp", m1,
        R"j("op":"log_softmax","attrs":{"vocab_parallel":true},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[8,6],"dims_mapping":[-1,0]})j");
    add("cross_entropy", m2,
        R"j("op":"cross_entropy","attrs":{"vocab_parallel":true},"inputs":[{"name":"logits","shape":[8,6],"dims_mapping":[0,1]},
           {"name":"labels","shape":[8],"dims_mapping":[0]}])j",
        R"j({"shape":[8],"dims_mapping":[0]})j");
    add("transpose", m3,
        R"j("op":"transpose","attrs":{"perm":[2,0,1]},"inputs":[{"name":"x","shape":[4,6,8],"dims_mapping":[[0,2],-1,1]}])j",
        R"j({"shape":[8,4,6],"dims_mapping":[1,[0,2],-1]})j");
    add("reshape", m1,
        R"j("op":"reshape","attrs":{"shape":[8,3,2]},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,-1]}])j",
        R"j({"shape":[8,3,2],"dims_mapping":[0,-1,-1]})j");
    add("einsum", m2,
        R"j("op":"einsum","attrs":{"equation":"bk,kn->bn"},"inputs":[{"name":"a","shape":[8,6],"dims_mapping":[0,1]},
           {"name":"b","shape":[6,4],"dims_mapping":[1,-1]}])j",
        R"j({"shape":[8,4],"dims_mapping":[0,-1],"partial":[1]})j");
    add("sum", m2,
        R"j("op":"sum","attrs":{"axes":[1],"keepdim":true},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]}])j",
        R"j({"shape":[8,1],"dims_mapping":[0,-1]})j");
    add("mean", m1, R"j("op":"mean","attrs":{"axes":[0]},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,-1]}])j",
        R"j({"shape":[6],"dims_mapping":[-1]})j");
    add("max", m2, R"j("op":"max","attrs":{"axes":[1]},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]}])j",
        R"j({"shape":[8],"dims_mapping":[0]})j");
    add("min", m1, R"j("op":"min","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[],"dims_mapping":[]})j");
    add("add_broadcast", m2,
        R"j("op":"add","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1],"partial":[]},
           {"name":"y","shape":[6],"dims_mapping":[1]}])j",
        R"j({"shape":[8,6],"dims_mapping":[0,1]})j");
    add("multiply_partial", m2,
        R"j("op":"multiply","inputs":[{"name":"x","shape":[8,6],"placements":["P(sum)","S(1)"]},
           {"name":"y","shape":[8,6],"dims_mapping":[-1,1]}])j",
        R"j({"shape":[8,6],"dims_mapping":[-1,1]})j");
    add("gelu_coshard", m3,
        R"j("op":"gelu","inputs":[{"name":"x","shape":[8,6],"placements":["S(0)[1]","R","S(0)[0]"]}])j",
        R"j({"shape":[8,6],"dims_mapping":[[2,0],-1]})j");
    add("relu_max_partial", m1,
        R"j("op":"relu","inputs":[{"name":"x","shape":[8,6],"dims_mapping":[-1,-1],"partial":{"0":"max"}}])j",
        R"j({"shape":[8,6],"dims_mapping":[0,-1]})j");
    // Issue 19's attributes: linear's trans_x / trans_y, sparse embedding, Partial(prod) and the prod reduction.
    add("linear_trans", m2,
        R"j("op":"linear","attrs":{"trans_x":true,"trans_y":false},"inputs":[{"name":"x","shape":[6,8],
           "dims_mapping":[-1,"dp"]},{"name":"weight","shape":[6,4],"dims_mapping":[-1,"tp"]}])j",
        R"j({"shape":[8,4],"dims_mapping":[0,1]})j");
    add("embedding_sparse", m1,
        R"j("op":"embedding","attrs":{"sparse":true},"inputs":[{"name":"ids","shape":[4,5]},
           {"name":"weight","shape":[16,8],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[4,5,8],"dims_mapping":[-1,-1,0]})j");
    add("prod", m2, R"j("op":"prod","attrs":{"axes":[1]},"inputs":[{"name":"x","shape":[8,6],"dims_mapping":[0,1]}])j",
        R"j({"shape":[8],"dims_mapping":[0]})j");
    add("multiply_prod", m2,
        R"j("op":"multiply","inputs":[{"name":"x","shape":[8,6],"placements":["P(prod)","S(1)"]},
           {"name":"y","shape":[8,6],"placements":["P(prod)","S(1)"]}])j",
        R"j({"shape":[8,6],"dims_mapping":[-1,1]})j");
    // Cost mode answers are fixpoints too: a required layout costs nothing more to reach.
    add("matmul_cost", m2,
        R"j("op":"matmul","mode":"cost","inputs":[{"name":"x","shape":[64,16],"dims_mapping":[0,1]},
           {"name":"y","shape":[16,32],"dims_mapping":[-1,0]}])j",
        R"j({"shape":[64,32],"dims_mapping":[0,-1]})j");
    return cases;
}

INSTANTIATE_TEST_SUITE_P(AllOpsAndDirections, ShardlineSpmdRoundTripTest, ::testing::ValuesIn(RoundTripCases()),
                         [](const ::testing::TestParamInfo<RoundTripCase> &info) { return info.param.name; });

} // namespace
