// Planner cases: src -> dst on a mesh, the steps and their bytes (fp32 unless said).

#include <algorithm>

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::L;

struct Step {
    Collective collective;
    int mesh_dim;
    int tensor_dim;
    int64_t bytes;
};

std::vector<Step> Steps(const RedistributePlan &plan) {
    std::vector<Step> steps;
    for (const auto &s : plan.steps) {
        steps.push_back({s.collective, s.mesh_dim, s.tensor_dim, s.bytes_per_rank});
    }
    return steps;
}

void ExpectSteps(const RedistributePlan &plan, const std::vector<Step> &want) {
    const auto got = Steps(plan);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(ToString(got[i].collective), ToString(want[i].collective)) << "step " << i;
        EXPECT_EQ(got[i].mesh_dim, want[i].mesh_dim) << "step " << i;
        EXPECT_EQ(got[i].tensor_dim, want[i].tensor_dim) << "step " << i;
        EXPECT_EQ(got[i].bytes, want[i].bytes) << "step " << i;
    }
}

const ProcessMesh k4({4});
const ProcessMesh k2x4({2, 4});

// [0,-1] -> [0,-1]: nothing
TEST(RedistributeTest, SameLayoutIsEmpty) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[0,-1]"), L("[0,-1]"));
    EXPECT_TRUE(plan.steps.empty());
    EXPECT_EQ(plan.cost_us, 0.0);
}

// partial{0} -> [-1,-1]: all_reduce, 2(n-1) * ceil(B/n)
TEST(RedistributeTest, PartialToReplicateIsAllReduce) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[-1,-1] partial{0}"), L("[-1,-1]"));
    ExpectSteps(plan, {{Collective::kAllReduce, 0, -1, 2 * 3 * 64}});
    const CostModel m; // one call, 2(n-1) ring steps, the bytes at the bus bandwidth
    EXPECT_DOUBLE_EQ(plan.cost_us, m.call_us + 6 * m.alpha_us + 384.0 / (m.bandwidth_gb_per_s * 1e3));
}

// partial{0} -> [0,-1]: reduce_scatter, (n-1) * out
TEST(RedistributeTest, PartialToShardIsReduceScatterNotAllReducePlusSlice) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[-1,-1] partial{0}"), L("[0,-1]"));
    ExpectSteps(plan, {{Collective::kReduceScatter, 0, 0, 3 * 2 * 8 * 4}});
    const CostModel m;
    EXPECT_DOUBLE_EQ(plan.cost_us, m.call_us + 3 * m.alpha_us + 192.0 / (m.bandwidth_gb_per_s * 1e3));
}

// [0,-1] -> [-1,-1]: all_gather, (n-1) * in
TEST(RedistributeTest, ShardToReplicateIsAllGather) {
    ExpectSteps(PlanRedistribute(k4, {8, 8}, L("[0,-1]"), L("[-1,-1]")), {{Collective::kAllGather, 0, 0, 3 * 64}});
}

// [0,-1] -> [-1,0]: all_to_all
TEST(RedistributeTest, ShardToOtherDimIsAllToAll) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[0,-1]"), L("[-1,0]"));
    ExpectSteps(plan, {{Collective::kAllToAll, 0, 0, 3 * 2 * 2 * 4}});
    EXPECT_EQ(plan.steps[0].to_tensor_dim, 1);
}

// [-1,-1] -> [-1,0]: local slice, free
TEST(RedistributeTest, ReplicateToShardIsFreeSlice) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[-1,-1]"), L("[-1,0]"));
    ExpectSteps(plan, {{Collective::kLocalSlice, 0, 1, 0}});
    EXPECT_EQ(plan.cost_us, 0.0);
}

// [-1,-1] -> partial{0:max}: local partialize
TEST(RedistributeTest, ReplicateToPartialIsLocal) {
    const auto plan = PlanRedistribute(k4, {8, 8}, L("[-1,-1]"), L("[-1,-1] partial{0:max}"));
    ExpectSteps(plan, {{Collective::kLocalPartialize, 0, -1, 0}});
    EXPECT_EQ(plan.steps[0].reduce_op, ReduceOp::kMax);
}

// partial{0:sum} -> partial{0:max}: reduce then re-partialize
TEST(RedistributeTest, ChangingTheReduceOpReducesFirst) {
    ExpectSteps(PlanRedistribute(k4, {8}, L("[-1] partial{0}"), L("[-1] partial{0:max}")),
                {{Collective::kAllReduce, 0, -1, 2 * 3 * 8}, {Collective::kLocalPartialize, 0, -1, 0}});
}

// [0,-1] -> partial{0}: gather, then partialize
TEST(RedistributeTest, ShardToPartialGathersThenPartializes) {
    ExpectSteps(PlanRedistribute(k4, {8, 8}, L("[0,-1]"), L("[-1,-1] partial{0}")),
                {{Collective::kAllGather, 0, 0, 3 * 64}, {Collective::kLocalPartialize, 0, -1, 0}});
}

// uneven: [10] on 4 ranks (3,3,3,1) -> replicate: padded to the largest shard, 3 * 3 elements
TEST(RedistributeTest, UnevenAllGatherIsPaddedToTheLargestShard) {
    ExpectSteps(PlanRedistribute(k4, {10}, L("[0]"), L("[-1]")), {{Collective::kAllGather, 0, 0, 3 * 3 * 4}});
}

// uneven: partial [10] -> [0]: reduce_scatter of chunks of 3
TEST(RedistributeTest, UnevenReduceScatter) {
    ExpectSteps(PlanRedistribute(k4, {10}, L("[-1] partial{0}"), L("[0]")),
                {{Collective::kReduceScatter, 0, 0, 3 * 3 * 4}});
}

// uneven all_reduce: 10 elements on 4 ranks -> chunk ceil(10/4)=3 -> 2*3*3*4 bytes
TEST(RedistributeTest, UnevenAllReduceUsesPaddedChunks) {
    ExpectSteps(PlanRedistribute(k4, {10}, L("[-1] partial{0}"), L("[-1]")),
                {{Collective::kAllReduce, 0, -1, 2 * 3 * 3 * 4}});
}

// 2-D mesh: [0,1] -> [-1,-1]: gathers, one mesh dim per step
TEST(RedistributeTest, TwoDimMeshGathersEachMeshDim) {
    // local [4, 2]; gather dim 0 over dp (1 * 32 bytes), then dim 1 over tp on [8, 2] (3 * 64)
    ExpectSteps(PlanRedistribute(k2x4, {8, 8}, L("[0,1]"), L("[-1,-1]")),
                {{Collective::kAllGather, 0, 0, 1 * 4 * 2 * 4}, {Collective::kAllGather, 1, 1, 3 * 8 * 2 * 4}});
}

// co-shard [[0,1],-1] -> [-1,-1]: the minor mesh dim (1) is gathered first
TEST(RedistributeTest, CoShardGathersMinorFirst) {
    const auto plan = PlanRedistribute(k2x4, {16, 2}, L("[[0,1],-1]"), L("[-1,-1]"));
    ExpectSteps(plan, {{Collective::kAllGather, 1, 0, 3 * 2 * 2 * 4}, {Collective::kAllGather, 0, 0, 1 * 8 * 2 * 4}});
    EXPECT_EQ(plan.steps[0].after.ToString(), "[0,-1]");
}

// co-shard [[0,1],-1] -> [0,-1]: only the minor mesh dim is gathered
TEST(RedistributeTest, CoShardToMajorPrefixGathersOnlyMinor) {
    ExpectSteps(PlanRedistribute(k2x4, {16, 2}, L("[[0,1],-1]"), L("[0,-1]")),
                {{Collective::kAllGather, 1, 0, 3 * 2 * 2 * 4}});
}

// [0,-1] -> [[0,1],-1]: a free slice adds the minor mesh dim
TEST(RedistributeTest, AddingMinorCoShardIsFreeSlice) {
    ExpectSteps(PlanRedistribute(k2x4, {16, 2}, L("[0,-1]"), L("[[0,1],-1]")), {{Collective::kLocalSlice, 1, 0, 0}});
}

// [1,-1] -> [[0,1],-1]: mesh dim 1 must become minor: gather it, slice 0 then 1
TEST(RedistributeTest, ReorderingCoShardGathersAndReslices) {
    const auto plan = PlanRedistribute(k2x4, {16, 2}, L("[1,-1]"), L("[[0,1],-1]"));
    ExpectSteps(plan, {{Collective::kAllGather, 1, 0, 3 * 4 * 2 * 4},
                       {Collective::kLocalSlice, 0, 0, 0},
                       {Collective::kLocalSlice, 1, 0, 0}});
}

// [-1,-1] partial{0,1} -> [0,1]: two reduce_scatters (no all-reduce)
TEST(RedistributeTest, TwoPartialsBecomeTwoReduceScatters) {
    const auto plan = PlanRedistribute(k2x4, {8, 8}, L("[-1,-1] partial{0,1}"), L("[0,1]"));
    ExpectSteps(plan,
                {{Collective::kReduceScatter, 0, 0, 1 * 4 * 8 * 4}, {Collective::kReduceScatter, 1, 1, 3 * 4 * 2 * 4}});
}

// partial{1} and dst [0,-1]: slice on dp first (free), then all_reduce over tp on the smaller tensor
TEST(RedistributeTest, FreeSliceComesBeforeAllReduce) {
    const auto plan = PlanRedistribute(k2x4, {8, 8}, L("[-1,-1] partial{1}"), L("[0,-1]"));
    ExpectSteps(plan, {{Collective::kLocalSlice, 0, 0, 0}, {Collective::kAllReduce, 1, -1, 2 * 3 * 4 * 8 * 4 / 4}});
}

// partial{0} and [-1,1] -> [0,-1]: all_reduce first? no: dp's partial scatters onto dim 0 after tp is gathered
TEST(RedistributeTest, PartialScattersAfterGatheringOtherMeshDim) {
    const auto plan = PlanRedistribute(k2x4, {8, 8}, L("[-1,1] partial{0}"), L("[0,-1]"));
    ExpectSteps(plan,
                {{Collective::kReduceScatter, 0, 0, 1 * 4 * 2 * 4}, {Collective::kAllGather, 1, 1, 3 * 4 * 2 * 4}});
}

// [0,1] -> [1,0] on 2x4: two all_to_alls would conflict; deterministic fallback gathers one
TEST(RedistributeTest, SwappingTwoMeshDimsIsValid) {
    const auto plan = PlanRedistribute(k2x4, {8, 8}, L("[0,1]"), L("[1,0]"));
    ASSERT_FALSE(plan.steps.empty());
    EXPECT_EQ(plan.steps.back().after, L("[1,0]"));
    EXPECT_GE(plan.NumCollectives(), 2);
}

// [0,1] -> [1,0] on 4x2, 8x8: gather the size-2 mesh dim (32 B), all_to_all the size-4 one (3 * 2x2 * 4 B), slice;
// the ordered plan gathers the size-4 dim first (96 B) and all_to_alls the other (64 B)
TEST(RedistributeTest, SwapGathersTheCheaperMeshDimAndAllToAllsTheOther) {
    const ProcessMesh mesh({4, 2});
    const auto plan = PlanRedistribute(mesh, {8, 8}, L("[0,1]"), L("[1,0]"));
    ExpectSteps(plan, {{Collective::kAllGather, 1, 1, 1 * 2 * 4 * 4},
                       {Collective::kAllToAll, 0, 0, 3 * 2 * 2 * 4},
                       {Collective::kLocalSlice, 1, 0, 0}});
    EXPECT_EQ(plan.steps[1].to_tensor_dim, 1);
    PlanOptions ordered;
    ordered.search = false;
    const auto fixed = PlanRedistribute(mesh, {8, 8}, L("[0,1]"), L("[1,0]"), ordered);
    ExpectSteps(fixed, {{Collective::kAllGather, 0, 0, 3 * 2 * 4 * 4},
                        {Collective::kAllToAll, 1, 1, 1 * 4 * 4 * 4},
                        {Collective::kLocalSlice, 0, 1, 0}});
    EXPECT_LT(plan.cost_us, fixed.cost_us);
}

// [[0,1],-1] -> [[1,0],-1] on 2x2, 4096x1024 fp32 (4 MiB shards): the ordered plan gathers both (4 + 8 MiB);
// moving through dim 1 costs one more latency but 4 + 4 + 2 MiB with two all_to_alls (a bandwidth-bound model:
// no per-call term, 10 us per step, 100 GB/s)
TEST(RedistributeTest, CoShardOrderChangeUsesAllToAllsWhenBandwidthBound) {
    const ProcessMesh mesh({2, 2});
    const int64_t mib = 1 << 20;
    PlanOptions bandwidth_bound;
    bandwidth_bound.cost.call_us = 0.0;
    bandwidth_bound.cost.alpha_us = 10.0;
    bandwidth_bound.cost.bandwidth_gb_per_s = 100.0;
    const auto plan = PlanRedistribute(mesh, {4096, 1024}, L("[[0,1],-1]"), L("[[1,0],-1]"), bandwidth_bound);
    EXPECT_EQ(plan.steps.back().after, L("[[1,0],-1]"));
    EXPECT_EQ(plan.bytes_per_rank, 10 * mib);
    EXPECT_EQ(plan.NumCollectives(), 3);
    EXPECT_EQ(std::count_if(plan.steps.begin(), plan.steps.end(),
                            [](const RedistributeStep &s) { return s.collective == Collective::kAllToAll; }),
              2);
    EXPECT_DOUBLE_EQ(plan.cost_us, 3 * 10.0 + 10.0 * mib / 1e5);
    PlanOptions ordered = bandwidth_bound;
    ordered.search = false;
    const auto fixed = PlanRedistribute(mesh, {4096, 1024}, L("[[0,1],-1]"), L("[[1,0],-1]"), ordered);
    ExpectSteps(fixed, {{Collective::kAllGather, 1, 0, 4 * mib},
                        {Collective::kAllGather, 0, 0, 8 * mib},
                        {Collective::kLocalSlice, 1, 0, 0},
                        {Collective::kLocalSlice, 0, 0, 0}});
}

// the same change on a small tensor is latency-bound: two all-gathers (2 alpha) beat three collectives
TEST(RedistributeTest, CoShardOrderChangeGathersWhenLatencyBound) {
    const ProcessMesh mesh({2, 2});
    const auto plan = PlanRedistribute(mesh, {8, 8}, L("[[0,1],-1]"), L("[[1,0],-1]"));
    ExpectSteps(plan, {{Collective::kAllGather, 1, 0, 2 * 8 * 4},
                       {Collective::kAllGather, 0, 0, 4 * 8 * 4},
                       {Collective::kLocalSlice, 1, 0, 0},
                       {Collective::kLocalSlice, 0, 0, 0}});
}

// 3-D mesh: [[0,2],1] -> [2,[0,1]]
TEST(RedistributeTest, ThreeDimMeshReachesDestination) {
    const ProcessMesh mesh({2, 2, 2});
    const auto plan = PlanRedistribute(mesh, {8, 8}, L("[[0,2],1]"), L("[2,[0,1]]"));
    EXPECT_EQ(plan.steps.back().after, L("[2,[0,1]]"));
    for (size_t i = 1; i < plan.steps.size(); ++i) {
        EXPECT_EQ(plan.steps[i].before, plan.steps[i - 1].after);
    }
}

// size-1 mesh dims are canonicalized away
TEST(RedistributeTest, SizeOneMeshDimNeedsNoStep) {
    const ProcessMesh mesh({1, 4});
    EXPECT_TRUE(PlanRedistribute(mesh, {8}, L("[0] partial{}"), L("[-1]")).steps.empty());
    EXPECT_TRUE(PlanRedistribute(mesh, {8}, L("[-1] partial{0}"), L("[-1]")).steps.empty());
}

TEST(RedistributeTest, ElementSizeAndPerDimCostModel) {
    PlanOptions options;
    options.element_size = 2;
    options.cost.alpha_us_per_dim = {50.0, 5.0};
    options.cost.bandwidth_gb_per_s_per_dim = {25.0, 400.0};
    const auto plan = PlanRedistribute(k2x4, {8, 8}, L("[-1,-1] partial{0}"), L("[-1,-1]"), options);
    ExpectSteps(plan, {{Collective::kAllReduce, 0, -1, 2 * 1 * 32 * 2}});
    EXPECT_DOUBLE_EQ(plan.cost_us, options.cost.call_us + 2 * 50.0 + 128.0 / 25e3);
}

TEST(RedistributeTest, InvalidLayoutsAreErrors) {
    EXPECT_THROW(PlanRedistribute(k4, {8, 8}, L("[1,-1]"), L("[-1,-1]")), SpmdError);
    EXPECT_THROW(PlanRedistribute(k4, {8, 8}, L("[0]"), L("[-1,-1]")), SpmdError);
    PlanOptions bad;
    bad.element_size = 0;
    EXPECT_THROW(PlanRedistribute(k4, {8}, L("[0]"), L("[-1]"), bad), SpmdError);
}

} // namespace
} // namespace shardline::spmd
