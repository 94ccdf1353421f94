#include <gtest/gtest.h>

#include <shardline/spmd/json.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;

TEST(LayoutTest, DimsMappingRoundTrip) {
    const Layout layout = Layout::FromDimsMapping({1, -1, 0}, {{2, ReduceOp::kSum}});
    EXPECT_EQ(layout.DimsMapping(), (std::vector<int>{1, -1, 0}));
    EXPECT_EQ(layout.ToString(), "[1,-1,0] partial{2}");
    EXPECT_EQ(layout.TensorDimOf(0), 2);
    EXPECT_EQ(layout.TensorDimOf(2), -1);
}

/// `layout` on a 2-D mesh gives the placements `want` (as text), and they give `layout` back.
void ExpectPlacementsRoundTrip(const Layout &layout, const std::vector<std::string> &want) {
    const auto placements = layout.ToPlacements(2);
    ASSERT_EQ(placements.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(placements[i].ToString(), want[i]) << "mesh dim " << i;
    }
    EXPECT_EQ(Layout::FromPlacements(placements, 2), layout);
}

TEST(LayoutTest, PlacementsRoundTripOnTwoDimMesh) {
    ExpectPlacementsRoundTrip(L("[-1,0] partial{1}"), {"S(1)", "P(sum)"});
}

TEST(LayoutTest, CoShardInAscendingOrderUsesPlainShardPlacements) {
    ExpectPlacementsRoundTrip(L("[[0,1],-1]"), {"S(0)", "S(0)"});
}

TEST(LayoutTest, CoShardInDescendingOrderKeepsTheOrderInPlacements) {
    const Layout layout = L("[[1,0],-1]");
    ExpectPlacementsRoundTrip(layout, {"S(0)[1]", "S(0)[0]"});
    EXPECT_THROW(layout.DimsMapping(), SpmdError);
}

TEST(LayoutTest, PlacementTextParses) {
    EXPECT_EQ(Placement::Parse("R"), Placement::Replicate());
    EXPECT_EQ(Placement::Parse("S(2)"), Placement::Shard(2));
    EXPECT_EQ(Placement::Parse("S(0)[1]"), Placement::Shard(0, 1));
    EXPECT_EQ(Placement::Parse("P(max)"), Placement::Partial(ReduceOp::kMax));
    EXPECT_EQ(Placement::Parse("P"), Placement::Partial(ReduceOp::kSum));
    EXPECT_THROW(Placement::Parse("X(0)"), SpmdError);
    EXPECT_THROW(Placement::Parse("S(-1)"), SpmdError);
    EXPECT_EQ(Placement::Parse("P(prod)"), Placement::Partial(ReduceOp::kProd));
    EXPECT_THROW(Placement::Parse("P(xor)"), SpmdError);
}

TEST(LayoutTest, TextRoundTripWithReduceOps) {
    for (const char *text : {"[-1,-1]", "[0]", "[[2,0],1]", "[-1] partial{0:max,1}", "[] partial{0:avg}", "[]"}) {
        EXPECT_EQ(L(text).ToString(), text);
    }
    EXPECT_EQ(L(" [ 1 , -1 ]  partial{ 0 : min }").ToString(), "[1,-1] partial{0:min}");
}

TEST(LayoutTest, MalformedTextIsAnError) {
    EXPECT_THROW(L("[1,-1"), SpmdError);
    EXPECT_THROW(L("[a]"), SpmdError);
    EXPECT_THROW(L("[0] partial{1"), SpmdError);
    EXPECT_THROW(L("[-2]"), SpmdError);
}

TEST(LayoutTest, MeshDimUsedTwiceIsAnError) {
    EXPECT_THROW(L("[0,0]"), SpmdError);
    EXPECT_THROW(L("[[0,0]]"), SpmdError);
    EXPECT_THROW(L("[0] partial{0}"), SpmdError);
    try {
        Layout::FromDimsMapping({1, 1});
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("mesh dim 1 is used twice"), std::string::npos) << e.what();
    }
}

TEST(LayoutTest, ValidateNamesMeshDimOutOfRangeAndRankMismatch) {
    const ProcessMesh mesh({2, 2});
    try {
        L("[2,-1]").Validate(mesh, 2, "x");
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("uses mesh dim 2, out of range for a mesh of 2 dims"), std::string::npos)
            << e.what();
    }
    try {
        L("[0]").Validate(mesh, 2, "x");
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("has 1 dims, but the tensor has rank 2"), std::string::npos) << e.what();
    }
}

TEST(LayoutTest, PlacementsWithBadOrdersAreErrors) {
    EXPECT_THROW(Layout::FromPlacements({Placement::Shard(0, 0), Placement::Shard(0, 0)}, 1), SpmdError);
    EXPECT_THROW(Layout::FromPlacements({Placement::Shard(0, 1), Placement::Shard(0)}, 1), SpmdError);
    EXPECT_THROW(Layout::FromPlacements({Placement::Shard(3)}, 2), SpmdError);
}

TEST(LayoutTest, CanonicalDropsSizeOneMeshDims) {
    const ProcessMesh mesh({1, 4});
    EXPECT_EQ(L("[0,1] partial{}").Canonical(mesh).ToString(), "[-1,1]");
    EXPECT_EQ(L("[[0,1],-1]").Canonical(mesh).ToString(), "[1,-1]");
    EXPECT_EQ(L("[-1,-1] partial{0}").Canonical(mesh).ToString(), "[-1,-1]");
}

TEST(LayoutTest, ChunkRangeFollowsTorchChunk) {
    // 10 split in 4: ceil = 3 -> 3,3,3,1
    EXPECT_EQ(ChunkRange(10, 4, 0), (std::pair<int64_t, int64_t>{0, 3}));
    EXPECT_EQ(ChunkRange(10, 4, 3), (std::pair<int64_t, int64_t>{9, 1}));
    // 5 split in 4: ceil = 2 -> 2,2,1,0 (the last shard is empty)
    EXPECT_EQ(ChunkRange(5, 4, 2), (std::pair<int64_t, int64_t>{4, 1}));
    EXPECT_EQ(ChunkRange(5, 4, 3), (std::pair<int64_t, int64_t>{5, 0}));
    EXPECT_EQ(ChunkRange(0, 3, 1), (std::pair<int64_t, int64_t>{0, 0}));
}

TEST(LayoutTest, LocalShardWithUnevenSizes) {
    const ProcessMesh mesh({2, 3});
    // [7, 5] with dim 0 on mesh dim 1 (3 ways: 3,3,1) and dim 1 on mesh dim 0 (2 ways: 3,2)
    const Layout layout = L("[1,0]");
    EXPECT_EQ(ComputeLocalShard(mesh, {7, 5}, layout, {0, 0}), (LocalShard{{3, 3}, {0, 0}}));
    EXPECT_EQ(ComputeLocalShard(mesh, {7, 5}, layout, {1, 2}), (LocalShard{{1, 2}, {6, 3}}));
    EXPECT_EQ(ComputeLocalShardOfProcess(mesh, {7, 5}, layout, 4), (LocalShard{{3, 2}, {3, 3}}));
}

TEST(LayoutTest, CoShardedLocalShardIsNestedChunks) {
    const ProcessMesh mesh({2, 2});
    // dim of 5 on [0,1]: mesh dim 0 first (3,2), then mesh dim 1 inside each (2,1 | 1,1)
    EXPECT_EQ(ComputeLocalShard(mesh, {5}, L("[[0,1]]"), {0, 0}), (LocalShard{{2}, {0}}));
    EXPECT_EQ(ComputeLocalShard(mesh, {5}, L("[[0,1]]"), {0, 1}), (LocalShard{{1}, {2}}));
    EXPECT_EQ(ComputeLocalShard(mesh, {5}, L("[[0,1]]"), {1, 0}), (LocalShard{{1}, {3}}));
    EXPECT_EQ(ComputeLocalShard(mesh, {5}, L("[[0,1]]"), {1, 1}), (LocalShard{{1}, {4}}));
    // the other order: mesh dim 1 is major
    EXPECT_EQ(ComputeLocalShard(mesh, {5}, L("[[1,0]]"), {0, 1}), (LocalShard{{1}, {3}}));
    EXPECT_EQ(MaxLocalShape(mesh, {5}, L("[[1,0]]")), (std::vector<int64_t>{2}));
}

TEST(LayoutTest, PartialShardIsTheFullShape) {
    const ProcessMesh mesh({4});
    EXPECT_EQ(ComputeLocalShard(mesh, {6, 2}, L("[-1,-1] partial{0}"), {3}), (LocalShard{{6, 2}, {0, 0}}));
}

TEST(LayoutJsonTest, LayoutToJsonHasAllThreeNotations) {
    const ProcessMesh mesh({2, 2});
    const nlohmann::json j = LayoutToJson(L("[[1,0],-1] "), mesh);
    EXPECT_EQ(j["dims_mapping"], nlohmann::json::parse("[[1,0],-1]"));
    EXPECT_EQ(j["placements"], nlohmann::json::parse(R"j(["S(0)[1]","S(0)[0]"])j"));
    EXPECT_EQ(j["partial"], nlohmann::json::object());
    const nlohmann::json p = LayoutToJson(L("[-1,0] partial{1:max}"), mesh);
    EXPECT_EQ(p["partial"], nlohmann::json::parse(R"j({"1":"max"})j"));
    EXPECT_EQ(p["placements"], nlohmann::json::parse(R"j(["S(1)","P(max)"])j"));
}

TEST(LayoutJsonTest, LayoutFromJsonAcceptsEveryNotation) {
    const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    using nlohmann::json;
    EXPECT_EQ(LayoutFromJson(json::parse(R"j({"dims_mapping":[1,-1],"partial":[0]})j"), mesh, 2, "x"),
              L("[1,-1] partial{0}"));
    EXPECT_EQ(LayoutFromJson(json::parse(R"j({"dims_mapping":[["tp","dp"],-1],"partial":{}})j"), mesh, 2, "x"),
              L("[[1,0],-1]"));
    EXPECT_EQ(LayoutFromJson(json::parse(R"j({"placements":["P(avg)","S(0)"]})j"), mesh, 2, "x"),
              L("[1,-1] partial{0:avg}"));
    EXPECT_EQ(LayoutFromJson(json::parse(R"j({"layout":"[-1,0]"})j"), mesh, 2, "x"), L("[-1,0]"));
    EXPECT_EQ(LayoutFromJson(json::parse(R"j({"partial":{"tp":"max"}})j"), mesh, 2, "x"), L("[-1,-1] partial{1:max}"));
    EXPECT_EQ(LayoutFromJson(json::object(), mesh, 2, "x"), L("[-1,-1]"));
}

TEST(LayoutJsonTest, LayoutFromJsonErrorsNameTheField) {
    const ProcessMesh mesh({2, 4});
    using nlohmann::json;
    auto message = [&](const char *text, int rank) {
        try {
            LayoutFromJson(json::parse(text), mesh, rank, "inputs[1]");
        } catch (const SpmdError &e) {
            return std::string(e.what());
        }
        return std::string("no error");
    };
    EXPECT_NE(message(R"j({"dims_mapping":[2,-1]})j", 2).find("inputs[1].dims_mapping"), std::string::npos);
    EXPECT_NE(message(R"j({"dims_mapping":[0,0]})j", 2).find("used twice"), std::string::npos);
    EXPECT_NE(message(R"j({"dims_mapping":[0]})j", 2).find("rank 2"), std::string::npos);
    EXPECT_NE(message(R"j({"dims_mapping":["x",-1]})j", 2).find("no mesh dim named 'x'"), std::string::npos);
    EXPECT_NE(message(R"j({"placements":["R"]})j", 2).find("one placement per mesh dim"), std::string::npos);
    EXPECT_NE(message(R"j({"dims_mapping":[0,-1],"partial":{"1":"xor"}})j", 2).find("inputs[1].partial.1"),
              std::string::npos);
    EXPECT_NE(message(R"j({"dims_mapping":[0,-1],"placements":["R","R"]})j", 2).find("not several"), std::string::npos);
}

TEST(LayoutJsonTest, MeshJsonRoundTrip) {
    const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    EXPECT_EQ(MeshFromJson(MeshToJson(mesh)), mesh);
    EXPECT_THROW(MeshFromJson(nlohmann::json::parse(R"j({"shape":[2,-1]})j")), SpmdError);
    EXPECT_THROW(MeshFromJson(nlohmann::json::parse(R"j({"dims":[2]})j")), SpmdError);
}

} // namespace
} // namespace shardline::spmd
