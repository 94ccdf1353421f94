// The uneven collectives as the modules use them (issue 19): all_gather_v and reduce_scatter_v with the counts of
// torch.chunk row blocks (a [rows, cols] tensor sharded on dim 0, the first ranks ceil(rows/p) rows, trailing ones
// short or empty), on 2, 3 and 4 ranks, against a float64 reference built from every rank's counter-RNG input, with
// exact collective counts (calls and this rank's bytes). BACKEND cpu (MPI_Iallgatherv / MPI_Ireduce_scatter) and
// BACKEND cuda (NCCL: grouped ncclBroadcast / ncclReduce, one launch; SHARDLINE_DIST_TENSOR_TEST_CUDA adds bf16 and
// fp16) build this file (tests/dist/CMakeLists.txt).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/error.h>
#include <shardline/spmd/layout.h>

#include "dist_tensor_test_util.h"
#include "reference.h"

namespace shardline {
namespace {

using comm::CollectiveKind;
using comm::ReduceOp;
using dist_test::World;
using testing::RankInput;
using testing::RankValues;

/// Rows of the sharded dim: even for some p, uneven, with an empty trailing part at p 3 and 4 (4 = 2 + 2 + 0; 5 =
/// 2 + 2 + 1 + 0), fewer rows than ranks (1), and the modules' 22 (8, 8, 6 at p 3).
const std::vector<std::int64_t> kRows = {1, 4, 5, 12, 22};
const std::vector<std::int64_t> kCols = {1, 5};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

std::vector<DType> DTypes() {
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    return {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
#else
    return {DType::kFloat32, DType::kFloat64};
#endif
}

/// Element counts of rank r's torch.chunk block of a [rows, cols] tensor sharded on dim 0 over p ranks.
std::vector<std::int64_t> ChunkCounts(std::int64_t rows, std::int64_t cols, int p) {
    std::vector<std::int64_t> counts;
    for (int r = 0; r < p; ++r) {
        counts.push_back(spmd::ChunkRange(rows, p, r).second * cols);
    }
    return counts;
}

/// Rank r's input of n elements on this rank's device: integers in [-8, 8] (exact in every dtype).
Tensor Input(int r, std::int64_t n, DType dtype, std::uint64_t salt) {
    return RankInput(r, n, dtype, salt).To(dist_test::TestDevice());
}

/// op over the ranks' inputs, element by element, in float64.
std::vector<double> Reduced(ReduceOp op, int p, std::int64_t n, DType dtype, std::uint64_t salt) {
    std::vector<double> out = RankValues(0, n, dtype, salt);
    for (int r = 1; r < p; ++r) {
        const std::vector<double> v = RankValues(r, n, dtype, salt);
        for (std::size_t i = 0; i < out.size(); ++i) {
            out[i] = op == ReduceOp::kMax   ? std::max(out[i], v[i])
                     : op == ReduceOp::kMin ? std::min(out[i], v[i])
                                            : out[i] + v[i];
        }
    }
    if (op == ReduceOp::kAvg) {
        for (double &x : out) {
            x /= p;
        }
    }
    return out;
}

/// Exact, except an average, which rounds once (in the dtype) per division: the dtype's rtol.
/// `input_scale`: the largest |input| of any rank. avg may round: NCCL scales each rank's value by 1/p in the dtype
/// before summing (premulsum), so a half-precision average of values that cancel is off by a few ulps of the
/// inputs, not of the (zero) result; hence an absolute term rtol·input_scale as well.
::testing::AssertionResult Same(const std::vector<double> &got, const std::vector<double> &want, ReduceOp op,
                                DType dtype, double input_scale = 0.0) {
    if (got.size() != want.size()) {
        return ::testing::AssertionFailure() << got.size() << " elements, expected " << want.size();
    }
    const double rtol = op == ReduceOp::kAvg ? testing::RelativeTolerance(dtype) : 0.0;
    const std::string diff = testing::CompareValues(got, want, rtol, rtol * input_scale);
    return diff.empty() ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << diff;
}

// Every rank gathers every rank's uneven block in rank order; one all_gather call each, counted with this rank's own
// bytes (its block, which differs per rank).
TEST(UnevenCollectivesTest, AllGatherVOfTorchChunkRowBlocksConcatenatesThemWithExactCounts) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    comm::Communicator &world = World();
    const int p = world.size();
    const int me = world.rank();
    for (DType dtype : DTypes()) {
        for (std::int64_t rows : kRows) {
            for (std::int64_t cols : kCols) {
                SCOPED_TRACE(fmt::format("{} rows {} cols {} over {} ranks", DTypeName(dtype), rows, cols, p));
                const std::vector<std::int64_t> counts = ChunkCounts(rows, cols, p);
                const std::uint64_t salt = static_cast<std::uint64_t>(rows * 10 + cols);
                const Tensor in = Input(me, counts[me], dtype, salt);
                Tensor out = Tensor::Full({rows * cols}, -100.0, dtype, dist_test::TestDevice());
                world.ResetCounts();
                world.AllGatherV(in, out, counts)->Wait(true);
                const comm::CollectiveCounts c = world.Counts();
                EXPECT_EQ(c.Calls(CollectiveKind::kAllGather), 1);
                EXPECT_EQ(c.Bytes(CollectiveKind::kAllGather),
                          counts[me] * static_cast<std::int64_t>(ElementSize(dtype)));
                EXPECT_EQ(c.TotalCalls(), 1);
                std::vector<double> want;
                for (int r = 0; r < p; ++r) {
                    const std::vector<double> v = RankValues(r, counts[r], dtype, salt);
                    want.insert(want.end(), v.begin(), v.end());
                }
                EXPECT_TRUE(Same(out.ToDoubleVector(), want, ReduceOp::kSum, dtype));
            }
        }
    }
}

// Every rank gets op over the ranks of its own uneven block (empty for a trailing rank with no rows); one
// reduce_scatter call each, counted with the whole input's bytes.
TEST(UnevenCollectivesTest, ReduceScatterVOfTorchChunkRowBlocksReducesEachRanksBlockWithExactCounts) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    comm::Communicator &world = World();
    const int p = world.size();
    const int me = world.rank();
    for (DType dtype : DTypes()) {
        for (ReduceOp op : kOps) {
            for (std::int64_t rows : kRows) {
                for (std::int64_t cols : kCols) {
                    SCOPED_TRACE(fmt::format("{} {} rows {} cols {} over {} ranks", DTypeName(dtype),
                                             comm::ReduceOpName(op), rows, cols, p));
                    const std::vector<std::int64_t> counts = ChunkCounts(rows, cols, p);
                    const std::int64_t total = rows * cols;
                    const std::int64_t offset = std::accumulate(counts.begin(), counts.begin() + me, std::int64_t{0});
                    const std::uint64_t salt = static_cast<std::uint64_t>(500 + rows * 10 + cols);
                    const Tensor in = Input(me, total, dtype, salt);
                    Tensor out = Tensor::Full({counts[me]}, -100.0, dtype, dist_test::TestDevice());
                    world.ResetCounts();
                    world.ReduceScatterV(in, out, counts, op)->Wait(true);
                    const comm::CollectiveCounts c = world.Counts();
                    EXPECT_EQ(c.Calls(CollectiveKind::kReduceScatter), 1);
                    EXPECT_EQ(c.Bytes(CollectiveKind::kReduceScatter),
                              total * static_cast<std::int64_t>(ElementSize(dtype)));
                    EXPECT_EQ(c.TotalCalls(), 1);
                    const std::vector<double> full = Reduced(op, p, total, dtype, salt);
                    const std::vector<double> want(full.begin() + offset, full.begin() + offset + counts[me]);
                    double input_scale = 0.0;
                    for (int r = 0; r < p; ++r) {
                        for (const double v : RankValues(r, total, dtype, salt)) {
                            input_scale = std::max(input_scale, std::abs(v));
                        }
                    }
                    EXPECT_TRUE(Same(out.ToDoubleVector(), want, op, dtype, input_scale));
                }
            }
        }
    }
}

// Counts that do not describe the call (a missing rank, this rank's block of the wrong size) raise ShapeError on the
// calling rank before anything is issued or counted; the communicator stays usable.
TEST(UnevenCollectivesTest, CountsThatDoNotFitRaiseBeforeAnythingIsCounted) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    comm::Communicator &world = World();
    const int p = world.size();
    const int me = world.rank();
    const std::vector<std::int64_t> counts = ChunkCounts(22, 1, p);
    const Tensor in = Input(me, counts[me], DType::kFloat32, 1);
    Tensor out = Tensor::Empty({22}, DType::kFloat32, dist_test::TestDevice());
    world.ResetCounts();
    const std::vector<std::int64_t> short_counts(counts.begin(), counts.end() - 1);
    EXPECT_THROW(world.AllGatherV(in, out, short_counts), ShapeError);
    const Tensor wrong = Input(me, counts[me] + 1, DType::kFloat32, 1);
    EXPECT_THROW(world.AllGatherV(wrong, out, counts), ShapeError);
    Tensor wrong_out = Tensor::Empty({counts[me] + 1}, DType::kFloat32, dist_test::TestDevice());
    const Tensor full = Input(me, 22, DType::kFloat32, 1);
    EXPECT_THROW(world.ReduceScatterV(full, wrong_out, counts, ReduceOp::kSum), ShapeError);
    EXPECT_EQ(world.Counts().TotalCalls(), 0);
    world.AllGatherV(in, out, counts)->Wait(true);
    EXPECT_EQ(world.Counts().Calls(CollectiveKind::kAllGather), 1);
}

} // namespace
} // namespace shardline
