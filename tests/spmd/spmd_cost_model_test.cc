// The cost model: a per-call latency, per-step latency and bandwidth (CostModel), the built-in JSON profiles
// (spmd/profiles) and the ways to load another (docs/spmd.md 7).

#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <shardline/spmd/json.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using nlohmann::json;
using testing::L;

void ExpectSameModel(const CostModel &a, const CostModel &b) {
    EXPECT_EQ(a.call_us, b.call_us);
    EXPECT_EQ(a.alpha_us, b.alpha_us);
    EXPECT_EQ(a.bandwidth_gb_per_s, b.bandwidth_gb_per_s);
    EXPECT_EQ(a.flops_per_us, b.flops_per_us);
    EXPECT_EQ(a.call_us_per_dim, b.call_us_per_dim);
    EXPECT_EQ(a.alpha_us_per_dim, b.alpha_us_per_dim);
    EXPECT_EQ(a.bandwidth_gb_per_s_per_dim, b.bandwidth_gb_per_s_per_dim);
    EXPECT_EQ(a.name, b.name);
}

// CostModel{} == spmd/profiles/nccl_h200.json (the JSON file is the source; the header repeats it)
TEST(CostModelTest, TheDefaultModelIsTheNcclH200Profile) {
    ExpectSameModel(CostModel{}, CostProfile("nccl_h200"));
    EXPECT_EQ(CostProfileNames(), (std::vector<std::string>{"mpi_cpu", "nccl_h200"}));
}

// mpi_cpu: measured on this project's CI-class host (2 ranks, shardline-spmd-mpi-probe)
TEST(CostModelTest, TheMpiCpuProfileLoads) {
    const CostModel mpi = CostProfile("mpi_cpu");
    EXPECT_EQ(mpi.name, "mpi_cpu");
    EXPECT_DOUBLE_EQ(mpi.call_us, 0.477);
    EXPECT_DOUBLE_EQ(mpi.alpha_us, 0.139);
    EXPECT_DOUBLE_EQ(mpi.bandwidth_gb_per_s, 5.73);
    EXPECT_THROW(CostProfile("nccl_h100"), SpmdError);
}

// P(sum) -> R on 4 ranks, 16 MiB: one all_reduce (1 call, 6 steps) < reduce_scatter + all_gather (2 calls, 3 + 3)
TEST(CostModelTest, OneAllReduceCostsLessThanAReduceScatterAndAnAllGather) {
    const ProcessMesh mesh({4});
    const std::vector<int64_t> shape = {4096, 1024};
    const RedistributePlan all_reduce = PlanRedistribute(mesh, shape, L("[-1,-1] partial{0}"), L("[-1,-1]"));
    ASSERT_EQ(all_reduce.steps.size(), 1u);
    EXPECT_EQ(all_reduce.steps[0].collective, Collective::kAllReduce);
    const RedistributePlan rs = PlanRedistribute(mesh, shape, L("[-1,-1] partial{0}"), L("[0,-1]"));
    const RedistributePlan ag = PlanRedistribute(mesh, shape, L("[0,-1]"), L("[-1,-1]"));
    EXPECT_EQ(all_reduce.bytes_per_rank, rs.bytes_per_rank + ag.bytes_per_rank); // the same bus bytes
    const CostModel m;
    EXPECT_DOUBLE_EQ(rs.cost_us + ag.cost_us - all_reduce.cost_us, m.call_us);
    EXPECT_LT(all_reduce.cost_us, rs.cost_us + ag.cost_us);
}

// call_us_per_dim {100, 1}: an all_gather over mesh dim 0 pays 100 us, over mesh dim 1 pays 1 us
TEST(CostModelTest, PerDimCallLatencyOverridesTheDefault) {
    PlanOptions options;
    options.cost.call_us_per_dim = {100.0, 1.0};
    options.cost.alpha_us = 0.0;
    const ProcessMesh mesh({2, 2});
    const RedistributePlan d0 = PlanRedistribute(mesh, {4}, L("[0]"), L("[-1]"), options);
    const RedistributePlan d1 = PlanRedistribute(mesh, {4}, L("[1]"), L("[-1]"), options);
    EXPECT_DOUBLE_EQ(d0.cost_us, 100.0 + 8.0 / (options.cost.bandwidth_gb_per_s * 1e3));
    EXPECT_DOUBLE_EQ(d1.cost_us, 1.0 + 8.0 / (options.cost.bandwidth_gb_per_s * 1e3));
}

// {"cost_profile": "mpi_cpu", "cost_model": {"call_us": 5}}: the profile, then the overrides
TEST(CostModelTest, RequestProfileThenOverrides) {
    const json answer = HandleRequest(json::parse(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[8],
        "src":{"partial":[0]},"dst":{},"cost_profile":"mpi_cpu","cost_model":{"call_us":5}})j"));
    const CostModel mpi = CostProfile("mpi_cpu");
    EXPECT_DOUBLE_EQ(answer["cost_us"].get<double>(), 5.0 + 2 * mpi.alpha_us + 32.0 / (mpi.bandwidth_gb_per_s * 1e3));
}

// {"cost_profile": {...}}: an inline profile; absent fields are the default's
TEST(CostModelTest, RequestInlineProfile) {
    const json answer = HandleRequest(json::parse(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[8],
        "src":{"partial":[0]},"dst":{},"cost_profile":{"name":"slow","call_us":1000,"alpha_us":0}})j"));
    EXPECT_DOUBLE_EQ(answer["cost_us"].get<double>(), 1000.0 + 32.0 / (CostModel{}.bandwidth_gb_per_s * 1e3));
}

// {"cost_profile": "h100"}, {"cost_profile": 3}, a profile with a negative latency
TEST(CostModelTest, BadProfilesAreErrorsNamingTheField) {
    auto error = [](const std::string &profile) {
        const RequestAnswer a = AnswerRequestText(R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[8],
            "src":{},"dst":{},"cost_profile":)j" + profile +
                                                  "}");
        EXPECT_EQ(a.exit_code, 2);
        return a.answer["error"].get<std::string>();
    };
    EXPECT_EQ(error(R"j("h100")j").rfind("cost_profile: cost profile: unknown profile 'h100'", 0), 0u);
    EXPECT_EQ(error("3").rfind("cost_profile: expected a profile name ([mpi_cpu,nccl_h200])", 0), 0u);
    EXPECT_EQ(error(R"j({"call_us":-1})j"), "cost_profile.call_us: must be >= 0 (a finite number), got -1");
    EXPECT_EQ(error(R"j({"fast":true})j").rfind("cost_profile.fast: unknown field", 0), 0u);
}

// LoadCostProfile(file): what shardline-spmd-mpi-probe prints (with its measurements) loads
TEST(CostModelTest, LoadCostProfileReadsAProbeOutput) {
    const std::string path = ::testing::TempDir() + "spmd_cost_profile.json";
    std::ofstream(path) << R"j({"name":"probe","description":"2 ranks","call_us":0.5,"alpha_us":0.1,
        "bandwidth_gb_per_s":6,"flops_per_us":1e5,"measurements":[{"op":"all_reduce","bytes":64,"us":0.6}]})j";
    const CostModel m = LoadCostProfile(path);
    EXPECT_EQ(m.name, "probe");
    EXPECT_DOUBLE_EQ(m.call_us, 0.5);
    EXPECT_DOUBLE_EQ(m.bandwidth_gb_per_s, 6.0);
    std::remove(path.c_str());
    EXPECT_THROW(LoadCostProfile(path), SpmdError);
}

// CostModelToJson -> CostModelFromJson: the same model
TEST(CostModelTest, JsonRoundTrip) {
    CostModel m = CostProfile("mpi_cpu");
    m.bandwidth_gb_per_s_per_dim = {1.0, 2.0};
    ExpectSameModel(CostModelFromJson(CostModelToJson(m), CostModel{}, "m"), m);
}

} // namespace
} // namespace shardline::spmd
