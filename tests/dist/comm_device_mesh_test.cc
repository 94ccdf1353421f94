// DeviceMesh on the world of the test main: coordinates (row-major, last dim fastest), one sub-communicator per
// mesh dim with the right members, sizes and order, and the errors raised before any collective.

#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

/// The meshes a world of `world_size` ranks allows among 1xW, Wx1, 2x(W/2) (and W for 1-D).
std::vector<std::vector<std::int64_t>> MeshShapes(int world_size) {
    std::vector<std::vector<std::int64_t>> shapes = {{world_size}, {1, world_size}, {world_size, 1}};
    if (world_size % 2 == 0 && world_size > 2) {
        shapes.push_back({2, world_size / 2});
    }
    return shapes;
}

/// Every rank's coordinate, from its world rank, row-major with the last dim fastest.
std::vector<std::int64_t> ExpectedCoordinate(int rank, const std::vector<std::int64_t> &shape) {
    std::vector<std::int64_t> coord(shape.size());
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
        coord[d] = rank % shape[d];
        rank /= static_cast<int>(shape[d]);
    }
    return coord;
}

TEST(DeviceMeshTest, CoordinateIsRowMajorWithLastDimFastest) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    for (const auto &shape : MeshShapes(World().size())) {
        SCOPED_TRACE(fmt::format("mesh [{}]", fmt::join(shape, "x")));
        DeviceMesh mesh(World(), shape);
        EXPECT_EQ(mesh.coordinate(), ExpectedCoordinate(World().rank(), shape));
        EXPECT_EQ(mesh.RankAt(mesh.coordinate()), World().rank());
        EXPECT_EQ(mesh.ndim(), static_cast<int>(shape.size()));
        for (int d = 0; d < mesh.ndim(); ++d) {
            EXPECT_EQ(mesh.dim_names()[d], fmt::format("d{}", d));
        }
    }
}

TEST(DeviceMeshTest, DpTpRankIsDpTimesTpPlusTp) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    if (w % 2 != 0) {
        GTEST_SKIP() << "needs an even world size, got " << w;
    }
    const std::int64_t tp = w / 2;
    DeviceMesh mesh(World(), {2, tp}, {"dp", "tp"});
    for (std::int64_t dp_coord = 0; dp_coord < 2; ++dp_coord) {
        for (std::int64_t tp_coord = 0; tp_coord < tp; ++tp_coord) {
            EXPECT_EQ(mesh.RankAt({dp_coord, tp_coord}), dp_coord * tp + tp_coord);
        }
    }
    EXPECT_EQ(mesh.dim_index("dp"), 0);
    EXPECT_EQ(mesh.dim_index("tp"), 1);
    EXPECT_EQ(mesh.coordinate()[0], World().rank() / tp);
    EXPECT_EQ(mesh.coordinate()[1], World().rank() % tp);
}

TEST(DeviceMeshTest, GroupsHoldTheRanksSharingEveryOtherCoordinate) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    for (const auto &shape : MeshShapes(World().size())) {
        SCOPED_TRACE(fmt::format("mesh [{}]", fmt::join(shape, "x")));
        std::vector<std::string> names;
        for (std::size_t d = 0; d < shape.size(); ++d) {
            names.push_back(d + 1 == shape.size() ? "tp" : fmt::format("m{}", d));
        }
        DeviceMesh mesh(World(), shape, names);
        for (int d = 0; d < mesh.ndim(); ++d) {
            comm::Communicator &group = mesh.group(d);
            EXPECT_EQ(group.size(), shape[d]);
            EXPECT_EQ(group.rank(), mesh.coordinate()[d]);
            EXPECT_EQ(&mesh.group(names[d]), &group) << "the group is created once and found by name";

            std::vector<std::int64_t> coord = mesh.coordinate();
            std::vector<int> members;
            for (std::int64_t i = 0; i < shape[d]; ++i) {
                coord[d] = i;
                members.push_back(mesh.RankAt(coord));
            }
            EXPECT_EQ(group.name(), fmt::format("mesh dim {} '{}' {{{}}}", d, names[d], fmt::join(members, ",")));

            // A sum over the group is the sum of its members' world ranks + 1 (distinct per group).
            Tensor value = Tensor::Full({3}, World().rank() + 1, DType::kFloat32, TestDevice());
            group.ResetCounts();
            group.AllReduce(value, comm::ReduceOp::kSum)->Wait(/*host=*/true);
            const double want = std::accumulate(members.begin(), members.end(), 0.0) + static_cast<double>(shape[d]);
            EXPECT_EQ(value.ToDoubleVector(), std::vector<double>(3, want));
            EXPECT_EQ(group.Counts().Calls(CollectiveKind::kAllReduce), 1);
            EXPECT_EQ(group.Counts().TotalCalls(), 1);

            // The group order follows the coordinate: an all_gather of the world ranks lists the members.
            Tensor mine = Tensor::Full({1}, World().rank(), DType::kFloat32, TestDevice());
            Tensor all = Tensor::Empty({shape[d]}, DType::kFloat32, TestDevice());
            group.AllGather(mine, all)->Wait(/*host=*/true);
            EXPECT_EQ(all.ToDoubleVector(), std::vector<double>(members.begin(), members.end()));
        }
    }
}

TEST(DeviceMeshTest, WorldSizeMismatchIsAnErrorNamingShapeAndWorldSize) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    const comm::CollectiveCounts before = World().Counts();
    try {
        DeviceMesh mesh(World(), {2, w});
        FAIL() << "a 2x" << w << " mesh over " << w << " ranks must throw";
    } catch (const Error &e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(fmt::format("[2, {}]", w)), std::string::npos) << what;
        EXPECT_NE(what.find(fmt::format("world size ({})", w)), std::string::npos) << what;
    }
    EXPECT_THROW(DeviceMesh(World(), {w + 1}), Error);
    EXPECT_THROW(DeviceMesh(World(), {}), Error);
    EXPECT_THROW(DeviceMesh(World(), {0, w}), Error);
    // No collective was started: the world still agrees on everything.
    EXPECT_EQ(World().Counts().TotalCalls(), before.TotalCalls());
}

TEST(DeviceMeshTest, DimNamesMustBeOnePerDimAndUnique) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    EXPECT_THROW(DeviceMesh(World(), {1, w}, {"tp"}), Error);
    EXPECT_THROW(DeviceMesh(World(), {1, w}, {"tp", "tp"}), Error);
    DeviceMesh mesh(World(), {1, w}, {"dp", "tp"});
    try {
        (void)mesh.dim_index("pp");
        FAIL() << "an unknown dim name must throw";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("dp, tp"), std::string::npos) << e.what();
    }
    EXPECT_THROW(mesh.group(2), Error);
    EXPECT_THROW((void)mesh.RankAt({0, w}), Error);
}

} // namespace
} // namespace shardline
