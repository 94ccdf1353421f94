// Host cost of the SPMD rules: what a parallel module pays per step (a cached lookup) and once per layer
// configuration (fresh inference, plans). Shapes: Llama-8B-like column-parallel linear on a dp x tp = 2 x 4 mesh,
// x [8192, 4096] S(0) on dp, weight [14336, 4096] S(0) on tp.
//
//   shardline_spmd_rule_cache_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true

#include <benchmark/benchmark.h>

#include <shardline/spmd/spmd.h>

namespace shardline::spmd {
namespace {

const ProcessMesh &Mesh() {
    static const ProcessMesh mesh({2, 4}, {"dp", "tp"});
    return mesh;
}

RuleRequest LinearRequest(RuleDirection direction, RuleMode mode) {
    RuleRequest r;
    r.op = "linear";
    r.direction = direction;
    r.mesh = Mesh();
    r.inputs = {{{8192, 4096}, Layout::Parse("[0,-1]")}, {{14336, 4096}, Layout::Parse("[1,-1]")}};
    if (direction == RuleDirection::kGrad) {
        r.out_grad = TensorSpec{{8192, 14336}, Layout::Parse("[0,1]")};
    }
    r.options.mode = mode;
    return r;
}

/// The hot path: the module built its key at init; each step looks the answer up.
void BM_CachedLookupHit(benchmark::State &state) {
    RuleCache cache;
    const RuleKey key(LinearRequest(RuleDirection::kForward, RuleMode::kDeterministic));
    cache.GetOrInfer(key);
    for (auto _ : state) {
        auto rule = cache.Lookup(key);
        benchmark::DoNotOptimize(rule.get());
    }
}
BENCHMARK(BM_CachedLookupHit);

/// The same lookup from 2 threads at once (shared lock, shared counters).
BENCHMARK(BM_CachedLookupHit)->Threads(2);

/// Building a key (encode + hash the request): once per layer, not per step.
void BM_BuildKey(benchmark::State &state) {
    const RuleRequest request = LinearRequest(RuleDirection::kForward, RuleMode::kDeterministic);
    for (auto _ : state) {
        RuleKey key(request);
        benchmark::DoNotOptimize(key.Hash());
    }
}
BENCHMARK(BM_BuildKey);

void BM_InferLinear(benchmark::State &state, RuleDirection direction, RuleMode mode) {
    const RuleRequest request = LinearRequest(direction, mode);
    for (auto _ : state) {
        SpmdInfo info = InferRule(request);
        benchmark::DoNotOptimize(info.outputs.data());
    }
}
BENCHMARK_CAPTURE(BM_InferLinear, forward_deterministic, RuleDirection::kForward, RuleMode::kDeterministic);
BENCHMARK_CAPTURE(BM_InferLinear, grad_deterministic, RuleDirection::kGrad, RuleMode::kDeterministic);
BENCHMARK_CAPTURE(BM_InferLinear, forward_cost, RuleDirection::kForward, RuleMode::kCostBased);
BENCHMARK_CAPTURE(BM_InferLinear, grad_cost, RuleDirection::kGrad, RuleMode::kCostBased);

/// A miss: inference plus every plan (what GetOrInfer does the first time).
void BM_InferWithPlansGrad(benchmark::State &state) {
    const RuleRequest request = LinearRequest(RuleDirection::kGrad, RuleMode::kDeterministic);
    for (auto _ : state) {
        CachedRule rule = InferRuleWithPlans(request);
        benchmark::DoNotOptimize(rule.output_plans.data());
    }
}
BENCHMARK(BM_InferWithPlansGrad);

/// A sequence-parallel boundary plan: [0,1] partial -> [[0,1],-1] on dp x tp (reduce_scatter + all_to_all ...).
void BM_PlanRedistribute(benchmark::State &state) {
    const Layout src = Layout::Parse("[-1,1] partial{0}");
    const Layout dst = Layout::Parse("[0,-1]");
    for (auto _ : state) {
        RedistributePlan plan = PlanRedistribute(Mesh(), {8192, 14336}, src, dst, {.element_size = 2, .cost = {}});
        benchmark::DoNotOptimize(plan.steps.data());
    }
}
BENCHMARK(BM_PlanRedistribute);

} // namespace
} // namespace shardline::spmd

BENCHMARK_MAIN();
