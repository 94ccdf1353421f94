// DistTensor itself: FromFull's shards and Partial convention, the constructor's shape check, errors raised on
// every rank before any collective, and redistribution in the backend's other dtypes.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

/// Total collective calls on the world and on every group of `mesh` (creating the groups).
std::int64_t AllCalls(DeviceMesh &mesh) {
    std::int64_t calls = mesh.world().Counts().TotalCalls();
    for (int d = 0; d < mesh.ndim(); ++d) {
        calls += mesh.group(d).Counts().TotalCalls();
    }
    return calls;
}

TEST(DistTensorTest, FromFullKeepsTheTorchChunkOfThisRank) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    // 5 rows on 4 ranks: 2,2,1,0 (on 2 ranks: 3,2).
    const int w = World().size();
    DeviceMesh mesh(World(), {w});
    const Tensor full = RandomFull({5, 3}, "x");
    const DistTensor x = DistTensor::FromFull(full, ParsePlacements("S(0)", 2), mesh);
    const std::int64_t chunk = (5 + w - 1) / w;
    const std::int64_t begin = std::min<std::int64_t>(5, chunk * World().rank());
    const std::int64_t end = std::min<std::int64_t>(5, begin + chunk);
    const std::vector<double> all = full.ToDoubleVector();
    const std::vector<double> want(all.begin() + begin * 3, all.begin() + end * 3);
    EXPECT_EQ(x.local().shape(), (Shape{end - begin, 3}));
    EXPECT_EQ(x.local().ToDoubleVector(), want);
    EXPECT_EQ(x.local().device(), TestDevice());
    EXPECT_NE(x.local().storage(), full.storage()) << "the shard does not alias the caller's tensor";
}

TEST(DistTensorTest, FromFullPartialSumKeepsTheValueAtCoordinateZeroOnly) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh mesh(World(), {World().size()});
    const Tensor full = RandomFull({4, 3}, "x");
    const DistTensor x = DistTensor::FromFull(full, ParsePlacements("P(sum)", 2), mesh);
    if (mesh.coordinate()[0] == 0) {
        EXPECT_TRUE(SameValues(x.local(), full));
    } else {
        EXPECT_EQ(x.local().ToDoubleVector(), std::vector<double>(12, 0.0));
    }
    EXPECT_TRUE(SameValues(x.FullTensor(), full));
}

TEST(DistTensorTest, FromFullPartialMaxAvgMinKeepTheValueEverywhere) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh mesh(World(), {World().size()});
    const Tensor full = RandomFull({4, 3}, "x");
    for (const char *placement : {"P(max)", "P(avg)", "P(min)"}) {
        SCOPED_TRACE(placement);
        const DistTensor x = DistTensor::FromFull(full, ParsePlacements(placement, 2), mesh);
        EXPECT_TRUE(SameValues(x.local(), full));
        EXPECT_TRUE(SameValues(x.FullTensor(), full));
    }
}

TEST(DistTensorTest, ConstructorRejectsALocalShapeTheLayoutDoesNotGive) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh mesh(World(), {World().size()});
    const spmd::Layout s0 = ParsePlacements("S(0)", 2);
    // 8 rows on w ranks: every rank holds 8/w rows, never 8 (w >= 2).
    const Tensor wrong = Tensor::Zeros({8, 3}, DType::kFloat32, TestDevice());
    try {
        DistTensor x(wrong, {8, 3}, s0, mesh);
        FAIL() << "a local shape [8, 3] for S(0) must throw";
    } catch (const ShapeError &e) {
        EXPECT_NE(std::string(e.what()).find("DistTensor"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("[8, 3]"), std::string::npos) << e.what();
    }
}

TEST(DistTensorTest, LayoutMismatchRaisesBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh mesh(World(), {1, World().size()});
    const Tensor full = RandomFull({6, 4}, "x");
    const DistTensor x = DistTensor::FromFull(full, ParsePlacements("R,S(0)", 2), mesh);
    const std::int64_t before = AllCalls(mesh);
    // Mesh dim 2 does not exist; a rank-3 layout does not fit a rank-2 tensor.
    EXPECT_THROW((void)x.Redistribute(spmd::Layout::FromDimsMapping({2, -1})), Error);
    EXPECT_THROW((void)x.Redistribute(spmd::Layout::Replicated(3)), Error);
    EXPECT_THROW((void)DistTensor::FromFull(full, spmd::Layout::FromDimsMapping({-1, -1, 0}), mesh), Error);
    EXPECT_EQ(AllCalls(mesh), before) << "no collective ran";
    // The ranks are still in step.
    EXPECT_TRUE(SameValues(x.FullTensor(), full));
}

TEST(DistTensorTest, ALocalTensorReportsItsOwnShapeAndTheReplicatedLayoutOfItsRank) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    // A local DistTensor stores neither its global shape nor its layout: both are read off the tensor. Ranks past the
    // shared table's 16 take the other path.
    for (int rank : {0, 1, 2, 3, 15, 16, 17, 20}) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        Shape shape(static_cast<std::size_t>(rank), 1);
        if (rank >= 2) {
            shape[0] = 3;
            shape[static_cast<std::size_t>(rank) - 1] = 2;
        }
        // Random values are drawn up to rank 8: a higher rank views a vector of them.
        const auto random = [&](std::string_view name) {
            return rank <= 8 ? RandomFull(shape, name) : RandomFull({Numel(shape)}, name).View(shape);
        };
        const Tensor t = random("local");
        const DistTensor d = DistTensor::Local(t);
        const DistTensor copy = d; // NOLINT(performance-unnecessary-copy-initialization): a copy must report the same
        for (const DistTensor *x : {&d, &copy}) {
            EXPECT_TRUE(x->is_local());
            EXPECT_EQ(x->global_shape(), shape);
            EXPECT_EQ(x->layout(), spmd::Layout::Replicated(rank));
            EXPECT_EQ(x->spec(), (spmd::TensorSpec{shape, spmd::Layout::Replicated(rank)}));
            EXPECT_TRUE(SameValues(x->local(), t));
        }
        // The layout is one object per rank, at a stable address.
        EXPECT_EQ(&d.layout(), &DistTensor::Local(random("other")).layout());
        EXPECT_TRUE(SameValues(d.FullTensor(), t));
        EXPECT_TRUE(SameValues(d.Redistribute(spmd::Layout::Replicated(rank)).local(), t));
        // An empty plan (replicated to replicated) returns the value, at once or through the pending handle.
        const spmd::RedistributePlan empty;
        const DistTensor planned = d.Redistribute(spmd::Layout::Replicated(rank), empty);
        EXPECT_EQ(planned.global_shape(), shape);
        EXPECT_TRUE(SameValues(planned.local(), t));
        const DistTensor waited = d.RedistributeAsync(spmd::Layout::Replicated(rank), empty).Wait();
        EXPECT_EQ(waited.layout(), spmd::Layout::Replicated(rank));
        EXPECT_TRUE(SameValues(waited.local(), t));
        const Tensor other = random("with");
        const DistTensor with = d.WithLocal(other);
        EXPECT_TRUE(SameValues(with.local(), other));
        EXPECT_TRUE(with.is_local());
        EXPECT_EQ(with.global_shape(), shape);
        EXPECT_EQ(with.layout(), spmd::Layout::Replicated(rank));
        const DistTensor trusted = DistTensor::FromTrustedShard(t, shape, spmd::Layout::Replicated(rank), nullptr);
        EXPECT_EQ(trusted.global_shape(), shape);
        EXPECT_EQ(trusted.layout(), spmd::Layout::Replicated(rank));
        EXPECT_TRUE(SameValues(trusted.local(), t));
    }
    const DistTensor undefined;
    EXPECT_TRUE(undefined.global_shape().empty());
    EXPECT_EQ(undefined.layout(), spmd::Layout());
}

TEST(DistTensorTest, FromTrustedShardWithoutAMeshRejectsAnotherShapeOrANonReplicatedLayout) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const Tensor t = RandomFull({3, 2}, "local");
    const auto expect_error = [&](const Shape &shape, const spmd::Layout &layout, const std::string &names) {
        try {
            (void)DistTensor::FromTrustedShard(t, shape, layout, nullptr);
            FAIL() << "global shape " << ShapeToString(shape) << " with layout " << layout.ToString() << " must throw";
        } catch (const Error &e) {
            const std::string what = e.what();
            EXPECT_NE(what.find("DistTensor::FromTrustedShard"), std::string::npos) << what;
            EXPECT_NE(what.find(names), std::string::npos) << what;
        }
    };
    expect_error({6, 2}, spmd::Layout::Replicated(2), "global shape [6, 2]");
    expect_error({3, 2}, spmd::Layout::Replicated(3), "layout [-1,-1,-1]");
    expect_error({3, 2}, spmd::Layout::Replicated(2).WithPartial({{0, spmd::ReduceOp::kSum}}),
                 "layout [-1,-1] partial{0}");
    expect_error({3, 2}, spmd::Layout::FromDimsMapping({0, -1}), "layout [0,-1]");
    // A plan's overloads refuse a non-replicated target for a local tensor, naming Redistribute, before running it.
    const DistTensor d = DistTensor::Local(t);
    const spmd::RedistributePlan empty;
    for (const spmd::Layout &dst :
         {spmd::Layout::FromDimsMapping({0, -1}), spmd::Layout::Replicated(2).WithPartial({{0, spmd::ReduceOp::kSum}}),
          spmd::Layout::Replicated(3)}) {
        SCOPED_TRACE(dst.ToString());
        try {
            (void)d.Redistribute(dst, empty);
            FAIL() << "a local tensor cannot take " << dst.ToString();
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find("DistTensor::Redistribute"), std::string::npos) << e.what();
        }
        EXPECT_THROW((void)d.RedistributeAsync(dst, empty), Error);
    }
}

TEST(DistTensorTest, TensorOnAnotherDeviceThanTheCommunicatorsRaisesBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    // A CPU shard on an NCCL mesh, or a CUDA shard on an MPI mesh (where this host has a GPU).
    Device other = Device::CPU();
    if (TestDevice().is_cpu()) {
        if (CudaDeviceCount() == 0) {
            GTEST_SKIP() << "an MPI mesh needs a CUDA tensor for this check, and no GPU is visible";
        }
        other = Device::CUDA(0);
    }
    DeviceMesh mesh(World(), {World().size()});
    const Tensor full = RandomFull({4, 3}, "x").To(other);
    const DistTensor x = DistTensor::FromFull(full, ParsePlacements("S(0)", 2), mesh);
    EXPECT_EQ(x.local().device(), other) << "FromFull keeps the full tensor's device";
    const std::int64_t before = AllCalls(mesh);
    try {
        (void)x.Redistribute(ParsePlacements("R", 2));
        FAIL() << "a " << ToString(other) << " shard on a " << mesh.world().backend() << " mesh must throw";
    } catch (const DeviceError &e) {
        EXPECT_NE(std::string(e.what()).find("DistTensor::Redistribute"), std::string::npos) << e.what();
    }
    EXPECT_EQ(AllCalls(mesh), before) << "no collective ran";
    // A plan of local steps needs no communicator: it runs on any device.
    const DistTensor r = DistTensor::FromFull(full, ParsePlacements("R", 2), mesh);
    EXPECT_TRUE(SameValues(r.Redistribute(ParsePlacements("S(0)", 2)).local(), x.local()));
    EXPECT_EQ(AllCalls(mesh), before);
}

TEST(DistTensorTest, DefaultConstructedRedistributeIsAnError) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const DistTensor x;
    EXPECT_THROW((void)x.Redistribute(spmd::Layout::Replicated(1)), Error);
    EXPECT_THROW((void)x.FullTensor(), Error);
}

TEST(DistTensorTest, RedistributesTheBackendsOtherDtypeBitwise) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    // MPI moves float64 as well, NCCL bfloat16 and float16; integers in [-8, 8] are exact in all of them.
    const std::vector<DType> dtypes = TestDevice().is_cpu() ? std::vector<DType>{DType::kFloat64}
                                                            : std::vector<DType>{DType::kBFloat16, DType::kFloat16};
    DeviceMesh mesh(World(), {World().size()});
    for (DType dtype : dtypes) {
        SCOPED_TRACE(DTypeName(dtype));
        const Tensor full = RandomFull({5, 3}, "x", dtype);
        const DistTensor x = DistTensor::FromFull(full, ParsePlacements("S(0)", 2), mesh);
        const DistTensor y = x.Redistribute(ParsePlacements("S(1)", 2));
        EXPECT_EQ(y.local().dtype(), dtype);
        EXPECT_TRUE(SameValues(y.local(), DistTensor::FromFull(full, ParsePlacements("S(1)", 2), mesh).local()));
        EXPECT_TRUE(SameValues(y.FullTensor(), full));
    }
}

TEST(DistTensorTest, RepeatedRoundTripsReturnTheSameTensor) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    // R -> S(0) -> S(1) -> P(sum) -> S(0) -> R on a dp x tp mesh when the world is even, else 1-D.
    const int w = World().size();
    const std::vector<std::int64_t> shape =
        w % 2 == 0 && w > 2 ? std::vector<std::int64_t>{2, w / 2} : std::vector<std::int64_t>{w};
    DeviceMesh mesh(World(), shape);
    const Tensor full = RandomFull({6, 10}, "x");
    const int n = mesh.ndim();
    DistTensor x = DistTensor::FromFull(full, spmd::Layout::Replicated(2), mesh);
    for (const char *dims : {"S(0)", "S(1)", "P(sum)", "S(0)", "R"}) {
        std::string placements = dims;
        for (int d = 1; d < n; ++d) {
            placements += std::string(",") + dims;
        }
        if (std::string(dims) == "S(1)" && n == 2) {
            placements = "S(1),S(0)";
        }
        SCOPED_TRACE(placements);
        x = x.Redistribute(ParsePlacements(placements, 2));
        EXPECT_TRUE(SameValues(x.FullTensor(), full));
    }
    EXPECT_TRUE(SameValues(x.local(), full));
}

// The named helpers spell layouts without spmd::Layout: they give exactly the layouts and shards FromFull gives.
TEST(DistTensorTest, NamedHelpersGiveTheLayoutsAndShardsOfFromFull) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    const std::int64_t dp = w >= 2 ? 2 : 1;
    DeviceMesh mesh(World(), {dp, w / dp}, {"dp", "tp"});
    const Tensor full = RandomFull({8, 4, 6}, "x");

    const spmd::Layout seq_tp_batch_dp(std::vector<std::vector<int>>{{1}, {0}, {}});
    EXPECT_EQ(dist::ShardedLayout(mesh, 3, {{.dim = 0, .over = {"tp"}}, {.dim = 1, .over = {"dp"}}}), seq_tp_batch_dp);
    EXPECT_EQ(dist::ShardedLayout(mesh, 3, {{.dim = -1, .over = {"dp", "tp"}}}),
              spmd::Layout(std::vector<std::vector<int>>{{}, {}, {0, 1}}));

    const DistTensor sharded =
        DistTensor::Sharded(full, mesh, {{.dim = 0, .over = {"tp"}}, {.dim = 1, .over = {"dp"}}});
    const DistTensor reference = DistTensor::FromFull(full, seq_tp_batch_dp, mesh);
    EXPECT_EQ(sharded.layout(), seq_tp_batch_dp);
    EXPECT_TRUE(SameValues(sharded.local(), reference.local()));
    EXPECT_TRUE(SameValues(sharded.FullTensor(), full));

    const DistTensor replicated = DistTensor::Replicated(full, mesh);
    EXPECT_TRUE(replicated.layout().IsReplicated());
    EXPECT_TRUE(SameValues(replicated.local(), full));

    // Each rank passes only its shard: the global shape is the local one times the shards.
    const DistTensor from_local = DistTensor::FromLocalShard(reference.local().Clone(), mesh,
                                                             {{.dim = 0, .over = {"tp"}}, {.dim = 1, .over = {"dp"}}});
    EXPECT_EQ(from_local.global_shape(), full.shape());
    EXPECT_EQ(from_local.layout(), seq_tp_batch_dp);
    EXPECT_TRUE(SameValues(from_local.FullTensor(), full));
}

TEST(DistTensorTest, NamedHelpersRejectUnknownMeshDimsAndDimsOutOfRangeBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh mesh(World(), {World().size()}, {"tp"});
    const Tensor full = RandomFull({4, 2}, "x");
    const std::int64_t before = AllCalls(mesh);
    try {
        (void)DistTensor::Sharded(full, mesh, {{.dim = 0, .over = {"dp"}}});
        ADD_FAILURE() << "an unknown mesh dim was accepted";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("dp"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("tp"), std::string::npos) << "names the mesh's dims: " << e.what();
    }
    try {
        (void)dist::ShardedLayout(mesh, 2, {{.dim = 2, .over = {"tp"}}});
        ADD_FAILURE() << "a dim out of range was accepted";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("dim 2 is out of range for a tensor of rank 2"), std::string::npos)
            << e.what();
    }
    EXPECT_EQ(AllCalls(mesh), before);
}

} // namespace
} // namespace shardline
