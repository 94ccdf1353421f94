// Every redistribute transition, executed on real ranks: each rank builds the full tensor from the counter-based
// RNG, takes its source shard (FromFull, or per-rank parts for Partial sources), redistributes, and compares its
// local tensor with the slice of the full tensor the destination layout gives its coordinate, and FullTensor()
// with the full tensor. The planner's steps are asserted against the table, and the collectives each mesh dim's
// communicator ran against the plan, exactly.

#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/spmd/redistribute.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

constexpr std::int64_t kWorld = -1; ///< a mesh dim as large as the world

struct Transition {
    const char *name;
    std::vector<std::int64_t> mesh; ///< kWorld stands for the world size
    Shape shape;
    const char *src; ///< placements, one per mesh dim
    const char *dst;
    const char *steps; ///< the plan, "collective@mesh_dim(tensor dims)[op]; ..."
};

void PrintTo(const Transition &t, std::ostream *os) { *os << t.name << " [" << t.src << "] -> [" << t.dst << "]"; }

std::string FormatStep(const spmd::RedistributeStep &s) {
    std::string text = fmt::format("{}@{}", spmd::ToString(s.collective), s.mesh_dim);
    switch (s.collective) {
    case spmd::Collective::kAllGather:
    case spmd::Collective::kLocalSlice:
        return text + fmt::format("({})", s.tensor_dim);
    case spmd::Collective::kReduceScatter:
        return text + fmt::format("({})[{}]", s.tensor_dim, spmd::ToString(s.reduce_op));
    case spmd::Collective::kAllToAll:
        return text + fmt::format("({}->{})", s.tensor_dim, s.to_tensor_dim);
    case spmd::Collective::kAllReduce:
    case spmd::Collective::kLocalPartialize:
        return text + fmt::format("[{}]", spmd::ToString(s.reduce_op));
    }
    return text;
}

std::string FormatPlan(const spmd::RedistributePlan &plan) {
    std::vector<std::string> steps;
    for (const auto &s : plan.steps) {
        steps.push_back(FormatStep(s));
    }
    return fmt::format("{}", fmt::join(steps, "; "));
}

/// The communicator calls a plan makes on mesh dim `d`, per collective kind.
std::map<CollectiveKind, std::int64_t> PlannedCalls(const spmd::RedistributePlan &plan, int d) {
    std::map<CollectiveKind, std::int64_t> calls;
    for (const auto &s : plan.steps) {
        if (s.mesh_dim != d) {
            continue;
        }
        switch (s.collective) {
        case spmd::Collective::kAllReduce:
            ++calls[CollectiveKind::kAllReduce];
            break;
        case spmd::Collective::kAllGather:
            ++calls[CollectiveKind::kAllGather];
            break;
        case spmd::Collective::kReduceScatter:
            ++calls[CollectiveKind::kReduceScatter];
            break;
        case spmd::Collective::kAllToAll:
            ++calls[CollectiveKind::kAllToAll];
            break;
        case spmd::Collective::kLocalSlice:
        case spmd::Collective::kLocalPartialize:
            break;
        }
    }
    return calls;
}

/// op over `parts`, elementwise, in double (exact for the integer data of these tests), as a float32 tensor.
Tensor ReduceParts(const std::vector<Tensor> &parts, spmd::ReduceOp op) {
    std::vector<double> acc = parts.front().ToDoubleVector();
    for (std::size_t p = 1; p < parts.size(); ++p) {
        const std::vector<double> v = parts[p].ToDoubleVector();
        for (std::size_t i = 0; i < acc.size(); ++i) {
            switch (op) {
            case spmd::ReduceOp::kSum:
            case spmd::ReduceOp::kAvg:
                acc[i] += v[i];
                break;
            case spmd::ReduceOp::kMax:
                acc[i] = std::max(acc[i], v[i]);
                break;
            case spmd::ReduceOp::kMin:
                acc[i] = std::min(acc[i], v[i]);
                break;
            }
        }
    }
    if (op == spmd::ReduceOp::kAvg) {
        for (double &x : acc) {
            x /= static_cast<double>(parts.size());
        }
    }
    return Tensor::FromVector(acc, parts.front().shape(), DType::kFloat32).To(TestDevice());
}

class RedistributeTest : public ::testing::TestWithParam<Transition> {};

TEST_P(RedistributeTest, LocalShardsAndCollectiveCountsMatchThePlan) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const Transition &p = GetParam();
    std::vector<std::int64_t> mesh_shape = p.mesh;
    std::int64_t product = 1;
    for (auto &s : mesh_shape) {
        s = s == kWorld ? World().size() : s;
        product *= s;
    }
    if (product != World().size()) {
        GTEST_SKIP() << "mesh [" << fmt::format("{}", fmt::join(mesh_shape, "x")) << "] needs " << product
                     << " ranks, the world has " << World().size();
    }
    DeviceMesh mesh(World(), mesh_shape);
    const spmd::ProcessMesh pm(mesh_shape);
    const int rank = static_cast<int>(p.shape.size());
    const spmd::Layout src = ParsePlacements(p.src, rank);
    const spmd::Layout dst = ParsePlacements(p.dst, rank);

    // The planner's answer is the table's.
    const spmd::RedistributePlan plan = spmd::PlanRedistribute(pm, p.shape, src, dst);
    EXPECT_EQ(FormatPlan(plan), p.steps) << src.ToString() << " -> " << dst.ToString() << " on mesh " << pm.ToString()
                                         << " shape " << spmd::ShapeToString(p.shape);

    // The full tensor, and the source: a Partial source holds one random part per coordinate of its Partial
    // mesh dims (the full tensor is op over the parts), anything else is FromFull's shard.
    Tensor full;
    DistTensor x;
    bool reduced = false;
    if (src.IsPartial()) {
        const spmd::ReduceOp op = src.Partial().begin()->second;
        std::vector<int> partial_dims;
        for (const auto &[d, o] : src.Partial()) {
            ASSERT_EQ(o, op) << "one reduce op per tensor";
            partial_dims.push_back(d);
        }
        std::int64_t num_parts = 1;
        std::int64_t my_part = 0;
        for (int d : partial_dims) {
            num_parts *= mesh_shape[d];
            my_part = my_part * mesh_shape[d] + mesh.coordinate()[d];
        }
        std::vector<Tensor> parts;
        for (std::int64_t k = 0; k < num_parts; ++k) {
            parts.push_back(RandomFull(p.shape, fmt::format("x/part{}", k)));
        }
        full = ReduceParts(parts, op);
        const DistTensor shard = DistTensor::FromFull(parts[my_part], src.WithoutPartial(), mesh);
        x = DistTensor(shard.local(), p.shape, src, mesh);
        reduced = true;
    } else {
        full = RandomFull(p.shape, "x");
        x = DistTensor::FromFull(full, src, mesh);
    }
    const std::vector<double> src_before = x.local().ToDoubleVector();

    // Create every group first (a collective Split), then count only the redistribution.
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
    const std::int64_t world_calls = World().Counts().TotalCalls();
    const DistTensor y = x.Redistribute(dst);
    for (int d = 0; d < mesh.ndim(); ++d) {
        const comm::CollectiveCounts counts = mesh.group(d).Counts();
        const auto planned = PlannedCalls(plan, d);
        for (int k = 0; k < comm::kNumCollectiveKinds; ++k) {
            const auto kind = static_cast<CollectiveKind>(k);
            const auto it = planned.find(kind);
            EXPECT_EQ(counts.Calls(kind), it == planned.end() ? 0 : it->second)
                << comm::CollectiveName(kind) << " calls on mesh dim " << d << " (" << mesh.group(d).name() << ")";
        }
    }
    EXPECT_EQ(World().Counts().TotalCalls(), world_calls) << "nothing runs on the world communicator";

    EXPECT_EQ(y.layout(), dst);
    EXPECT_EQ(y.global_shape(), p.shape);
    EXPECT_EQ(x.local().ToDoubleVector(), src_before) << "the source is left unchanged";

    // The local shard: what FromFull gives the destination (for a destination that keeps a source Partial, the
    // split between ranks is the source's, so only the full value is checked).
    bool keeps_partial = false;
    for (const auto &[d, op] : dst.Partial()) {
        const auto it = src.Partial().find(d);
        keeps_partial = keeps_partial || (it != src.Partial().end() && it->second == op);
    }
    if (plan.steps.empty()) {
        EXPECT_EQ(y.local().ToDoubleVector(), src_before) << "an empty plan keeps the local shard";
    }
    if (!keeps_partial) {
        const Tensor want = DistTensor::FromFull(full, dst, mesh).local();
        if (reduced) {
            EXPECT_TRUE(CloseValues(y.local(), want)) << "local shard of " << dst.ToString();
        } else {
            EXPECT_TRUE(SameValues(y.local(), want)) << "local shard of " << dst.ToString();
        }
    }
    const Tensor gathered = y.FullTensor();
    if (reduced || dst.IsPartial()) {
        EXPECT_TRUE(CloseValues(gathered, full)) << "FullTensor() of " << dst.ToString();
    } else {
        EXPECT_TRUE(SameValues(gathered, full)) << "FullTensor() of " << dst.ToString();
    }

    // RedistributeAsync: the same collectives (calls and bytes on every mesh dim), the same local shard bit for bit,
    // the source unchanged; the last collective is finished by Wait.
    std::vector<comm::CollectiveCounts> sync_counts;
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
    const DistTensor again = x.Redistribute(dst, plan);
    for (int d = 0; d < mesh.ndim(); ++d) {
        sync_counts.push_back(mesh.group(d).Counts());
        mesh.group(d).ResetCounts();
    }
    dist::PendingRedistribute pending = x.RedistributeAsync(dst, plan);
    ASSERT_TRUE(pending.valid());
    const DistTensor async = pending.Wait();
    EXPECT_FALSE(pending.valid()) << "waited once";
    for (int d = 0; d < mesh.ndim(); ++d) {
        const comm::CollectiveCounts counts = mesh.group(d).Counts();
        for (int k = 0; k < comm::kNumCollectiveKinds; ++k) {
            const auto kind = static_cast<CollectiveKind>(k);
            EXPECT_EQ(counts.Calls(kind), sync_counts[d].Calls(kind)) << "async " << comm::CollectiveName(kind);
            EXPECT_EQ(counts.Bytes(kind), sync_counts[d].Bytes(kind)) << "async " << comm::CollectiveName(kind);
        }
    }
    EXPECT_EQ(async.layout(), dst);
    EXPECT_EQ(async.global_shape(), p.shape);
    EXPECT_TRUE(SameValues(async.local(), again.local())) << "RedistributeAsync's local shard is Redistribute's";
    EXPECT_EQ(x.local().ToDoubleVector(), src_before) << "the source is left unchanged by RedistributeAsync";

    // consume_local (a buffer of the caller's own): the same values; an all-reduce runs in place on it, no copy.
    const DistTensor own(x.local().Clone(), p.shape, src, mesh);
    const DistTensor consumed = own.RedistributeAsync(dst, plan, /*consume_local=*/true).Wait();
    EXPECT_TRUE(SameValues(consumed.local(), again.local())) << "consume_local gives Redistribute's local shard";
    if (plan.steps.size() == 1 && plan.steps[0].collective == spmd::Collective::kAllReduce) {
        EXPECT_EQ(consumed.local().data(), own.local().data()) << "the all-reduce ran in place on the consumed local";
    }
}

// clang-format off
const Transition kTransitions[] = {
    // ---- 1-D mesh over the world (np 2 and 4) ----------------------------------------------------------------------
    {"RToS0",            {kWorld}, {8, 6},    "R",      "S(0)",   "local_slice@0(0)"},
    {"RToS1",            {kWorld}, {8, 6},    "R",      "S(1)",   "local_slice@0(1)"},
    {"S0ToR",            {kWorld}, {8, 6},    "S(0)",   "R",      "all_gather@0(0)"},
    {"S1ToR",            {kWorld}, {8, 6},    "S(1)",   "R",      "all_gather@0(1)"},
    {"S0ToS1",           {kWorld}, {8, 6},    "S(0)",   "S(1)",   "all_to_all@0(0->1)"},
    {"S1ToS0",           {kWorld}, {8, 6},    "S(1)",   "S(0)",   "all_to_all@0(1->0)"},
    {"PSumToR",          {kWorld}, {8, 6},    "P(sum)", "R",      "all_reduce@0[sum]"},
    {"PAvgToR",          {kWorld}, {8, 6},    "P(avg)", "R",      "all_reduce@0[avg]"},
    {"PMaxToR",          {kWorld}, {8, 6},    "P(max)", "R",      "all_reduce@0[max]"},
    {"PMinToR",          {kWorld}, {8, 6},    "P(min)", "R",      "all_reduce@0[min]"},
    {"PSumToS0",         {kWorld}, {8, 6},    "P(sum)", "S(0)",   "reduce_scatter@0(0)[sum]"},
    {"PSumToS1",         {kWorld}, {8, 6},    "P(sum)", "S(1)",   "reduce_scatter@0(1)[sum]"},
    {"PAvgToS0",         {kWorld}, {8, 6},    "P(avg)", "S(0)",   "reduce_scatter@0(0)[avg]"},
    {"PMaxToS1",         {kWorld}, {8, 6},    "P(max)", "S(1)",   "reduce_scatter@0(1)[max]"},
    {"PMinToS0",         {kWorld}, {8, 6},    "P(min)", "S(0)",   "reduce_scatter@0(0)[min]"},
    {"RToPSum",          {kWorld}, {8, 6},    "R",      "P(sum)", "local_partialize@0[sum]"},
    {"RToPAvg",          {kWorld}, {8, 6},    "R",      "P(avg)", "local_partialize@0[avg]"},
    {"RToPMax",          {kWorld}, {8, 6},    "R",      "P(max)", "local_partialize@0[max]"},
    {"S0ToPSum",         {kWorld}, {8, 6},    "S(0)",   "P(sum)", "all_gather@0(0); local_partialize@0[sum]"},
    {"PSumToPMax",       {kWorld}, {8, 6},    "P(sum)", "P(max)", "all_reduce@0[sum]; local_partialize@0[max]"},
    {"PSumToPSum",       {kWorld}, {8, 6},    "P(sum)", "P(sum)", ""},
    {"RToR",             {kWorld}, {8, 6},    "R",      "R",      ""},
    {"S1ToS1",           {kWorld}, {8, 6},    "S(1)",   "S(1)",   ""},
    // uneven: 5 on 4 is 2,2,1,0 (on 2: 3,2); 3 on 4 is 1,1,1,0 (an empty shard); 7 on 4 is 2,2,2,1
    {"UnevenRToS0",      {kWorld}, {5, 6},    "R",      "S(0)",   "local_slice@0(0)"},
    {"UnevenS0ToR",      {kWorld}, {5, 6},    "S(0)",   "R",      "all_gather@0(0)"},
    {"UnevenS1ToR",      {kWorld}, {4, 5},    "S(1)",   "R",      "all_gather@0(1)"},
    {"UnevenEmptyS0ToR", {kWorld}, {3, 4},    "S(0)",   "R",      "all_gather@0(0)"},
    {"UnevenS0ToS1",     {kWorld}, {5, 3},    "S(0)",   "S(1)",   "all_to_all@0(0->1)"},
    {"UnevenS1ToS0",     {kWorld}, {5, 3},    "S(1)",   "S(0)",   "all_to_all@0(1->0)"},
    {"UnevenPSumToS0",   {kWorld}, {5, 3},    "P(sum)", "S(0)",   "reduce_scatter@0(0)[sum]"},
    {"UnevenPSumToS1",   {kWorld}, {5, 3},    "P(sum)", "S(1)",   "reduce_scatter@0(1)[sum]"},
    {"UnevenPMaxToS1",   {kWorld}, {2, 3},    "P(max)", "S(1)",   "reduce_scatter@0(1)[max]"},
    {"Vector1DS0ToR",    {kWorld}, {7},       "S(0)",   "R",      "all_gather@0(0)"},
    {"Vector1DPSumToS0", {kWorld}, {7},       "P(sum)", "S(0)",   "reduce_scatter@0(0)[sum]"},
    {"ThreeDS1ToS2",     {kWorld}, {2, 5, 3}, "S(1)",   "S(2)",   "all_to_all@0(1->2)"},
    {"ThreeDS2ToS0",     {kWorld}, {3, 2, 5}, "S(2)",   "S(0)",   "all_to_all@0(2->0)"},
    {"ThreeDS2ToR",      {kWorld}, {2, 3, 5}, "S(2)",   "R",      "all_gather@0(2)"},
    {"ThreeDPSumToS1",   {kWorld}, {2, 5, 3}, "P(sum)", "S(1)",   "reduce_scatter@0(1)[sum]"},
    // ---- size-1 mesh dims (np 2 and 4): they shard nothing and need no communication --------------------------------
    {"OneByWS0ToR",      {1, kWorld}, {6, 4}, "R,S(0)",           "R,R",    "all_gather@1(0)"},
    {"OneByWSize1Dim",   {1, kWorld}, {6, 4}, "S(0),R",           "R,R",    ""},
    {"WByOnePSumBoth",   {kWorld, 1}, {6, 4}, "P(sum),P(sum)",    "R,R",    "all_reduce@0[sum]"},
    {"WByOneS1ToS0",     {kWorld, 1}, {5, 3}, "S(1),R",           "S(0),R", "all_to_all@0(1->0)"},
    // ---- 2x2 mesh (np 4), mesh dims (d0, d1) = (dp, tp) -------------------------------------------------------------
    {"Mesh2dRRToS0R",    {2, 2}, {8, 6}, "R,R",             "S(0),R",          "local_slice@0(0)"},
    {"Mesh2dRRToRS1",    {2, 2}, {8, 6}, "R,R",             "R,S(1)",          "local_slice@1(1)"},
    {"Mesh2dRRToS0S1",   {2, 2}, {8, 6}, "R,R",             "S(0),S(1)",       "local_slice@0(0); local_slice@1(1)"},
    {"Mesh2dS0S1ToRR",   {2, 2}, {8, 6}, "S(0),S(1)",       "R,R",             "all_gather@0(0); all_gather@1(1)"},
    {"Mesh2dS0RToRS0",   {2, 2}, {8, 6}, "S(0),R",          "R,S(0)",          "all_gather@0(0); local_slice@1(0)"},
    {"Mesh2dSwapShards", {2, 2}, {8, 6}, "S(0),S(1)",       "S(1),S(0)",
                                                          "all_gather@0(0); all_to_all@1(1->0); local_slice@0(1)"},
    {"Mesh2dSwapUneven", {2, 2}, {5, 3}, "S(1),S(0)",       "S(0),S(1)",
                                                          "all_gather@1(0); all_to_all@0(1->0); local_slice@1(1)"},
    {"Mesh2dS0ToS1OnD0", {2, 2}, {4, 6, 5}, "S(0),S(2)",    "S(1),S(2)",       "all_to_all@0(0->1)"},
    {"Mesh2dCoShardFromR",   {2, 2}, {8, 4}, "R,R",         "S(0),S(0)",       "local_slice@0(0); local_slice@1(0)"},
    {"Mesh2dCoShardToR",     {2, 2}, {8, 4}, "S(0),S(0)",   "R,R",             "all_gather@1(0); all_gather@0(0)"},
    {"Mesh2dCoShardUneven",  {2, 2}, {5, 3}, "S(0),S(0)",   "R,R",             "all_gather@1(0); all_gather@0(0)"},
    {"Mesh2dCoShardEmpty",   {2, 2}, {3, 2}, "S(0),S(0)",   "S(1),R",          "all_gather@1(0); all_to_all@0(0->1)"},
    {"Mesh2dCoShardToS1",    {2, 2}, {8, 4}, "S(0),S(0)",   "S(1),S(1)",
                                                          "all_gather@1(0); all_to_all@0(0->1); local_slice@1(1)"},
    {"Mesh2dS0RToCoShard",   {2, 2}, {8, 4}, "S(0),R",      "S(0),S(0)",       "local_slice@1(0)"},
    {"Mesh2dRS0ToCoShard",   {2, 2}, {8, 4}, "R,S(0)",      "S(0),S(0)",
                                                          "all_gather@1(0); local_slice@0(0); local_slice@1(0)"},
    {"Mesh2dCoShardMinorMajor", {2, 2}, {8, 4}, "S(0)[1],S(0)[0]", "R,R",     "all_gather@0(0); all_gather@1(0)"},
    {"Mesh2dPSumRToRR",  {2, 2}, {8, 6}, "P(sum),R",        "R,R",             "all_reduce@0[sum]"},
    {"Mesh2dDpGradAllReduce", {2, 2}, {5, 3}, "P(sum),S(0)", "R,S(0)",         "all_reduce@0[sum]"},
    {"Mesh2dRowParallelSp",   {2, 2}, {8, 6}, "R,P(sum)",   "R,S(0)",          "reduce_scatter@1(0)[sum]"},
    {"Mesh2dPPToRR",     {2, 2}, {8, 6}, "P(sum),P(sum)",   "R,R",             "all_reduce@0[sum]; all_reduce@1[sum]"},
    {"Mesh2dPPToS0S1",   {2, 2}, {8, 6}, "P(sum),P(sum)",   "S(0),S(1)",
                                                          "reduce_scatter@0(0)[sum]; reduce_scatter@1(1)[sum]"},
    {"Mesh2dPPAvgToS1R", {2, 2}, {5, 6}, "P(avg),P(avg)",   "S(1),R",
                                                          "reduce_scatter@0(1)[avg]; all_reduce@1[avg]"},
    {"Mesh2dPRToCoShard",    {2, 2}, {8, 4}, "P(sum),R",    "S(0),S(0)",
                                                          "reduce_scatter@0(0)[sum]; local_slice@1(0)"},
    {"Mesh2dRPToCoShard",    {2, 2}, {8, 4}, "R,P(sum)",    "S(0),S(0)",
                                                          "local_slice@0(0); reduce_scatter@1(0)[sum]"},
    {"Mesh2dPMaxS0ToS1R",    {2, 2}, {5, 3}, "P(max),S(0)", "S(1),R",
                                                          "reduce_scatter@0(1)[max]; all_gather@1(0)"},
    {"Mesh2dRRToPP",     {2, 2}, {8, 6}, "R,R",             "P(sum),P(sum)",
                                                          "local_partialize@0[sum]; local_partialize@1[sum]"},
    {"Mesh2dS0RToRPAvg", {2, 2}, {8, 6}, "S(0),R",          "R,P(avg)",
                                                          "all_gather@0(0); local_partialize@1[avg]"},
    {"Mesh2dPSumToPOther",   {2, 2}, {8, 6}, "P(sum),R",    "R,P(sum)",
                                                          "all_reduce@0[sum]; local_partialize@1[sum]"},
};
// clang-format on

INSTANTIATE_TEST_SUITE_P(Transitions, RedistributeTest, ::testing::ValuesIn(kTransitions),
                         [](const ::testing::TestParamInfo<Transition> &info) { return std::string(info.param.name); });

} // namespace
} // namespace shardline
