#include <gtest/gtest.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/mesh.h>

namespace shardline::spmd {
namespace {

TEST(ProcessMeshTest, DpTimesTpRanksAreRowMajorWithTpFastest) {
    const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    EXPECT_EQ(mesh.Size(), 8);
    EXPECT_EQ(mesh.ProcessIdAt({1, 2}), 1 * 4 + 2);
    EXPECT_EQ(mesh.CoordinateOf(6), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(mesh.DimIndex("tp"), 1);
}

TEST(ProcessMeshTest, GroupAlongTpHoldsConsecutiveRanks) {
    const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    EXPECT_EQ(mesh.Group({1, 0}, 1), (std::vector<int64_t>{4, 5, 6, 7}));
    EXPECT_EQ(mesh.Group({0, 3}, 0), (std::vector<int64_t>{3, 7}));
}

TEST(ProcessMeshTest, CustomProcessIdsMapCoordinates) {
    const ProcessMesh mesh({2, 2}, {}, {10, 11, 20, 21});
    EXPECT_EQ(mesh.DimNames(), (std::vector<std::string>{"d0", "d1"}));
    EXPECT_EQ(mesh.CoordinateOf(20), (std::vector<int64_t>{1, 0}));
    EXPECT_EQ(mesh.ProcessIdAt({0, 1}), 11);
}

TEST(ProcessMeshTest, ThreeDimensionalMeshCoordinates) {
    const ProcessMesh mesh({2, 3, 2});
    EXPECT_EQ(mesh.CoordinateOfIndex(7), (std::vector<int64_t>{1, 0, 1}));
    EXPECT_EQ(mesh.LinearIndex({1, 2, 1}), 11);
}

TEST(ProcessMeshTest, InvalidMeshesAreErrors) {
    EXPECT_THROW(ProcessMesh(std::vector<int64_t>{}), SpmdError);
    EXPECT_THROW(ProcessMesh({2, 0}), SpmdError);
    EXPECT_THROW(ProcessMesh({2, 2}, {"a"}), SpmdError);
    EXPECT_THROW(ProcessMesh({2, 2}, {"a", "a"}), SpmdError);
    EXPECT_THROW(ProcessMesh({2}, {}, {0, 0}), SpmdError);
    EXPECT_THROW(ProcessMesh({2}, {}, {0, 1, 2}), SpmdError);
}

TEST(ProcessMeshTest, LookupErrorsNameTheValue) {
    const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    try {
        mesh.DimIndex("pp");
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("no mesh dim named 'pp'"), std::string::npos) << e.what();
    }
    EXPECT_THROW(mesh.CoordinateOf(8), SpmdError);
    EXPECT_THROW(mesh.DimSize(2), SpmdError);
    EXPECT_THROW(mesh.LinearIndex({2, 0}), SpmdError);
}

} // namespace
} // namespace shardline::spmd
