#include "linear_plan.h"

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include <shardline/core/error.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/rules.h>

namespace shardline::functional {
namespace detail {
namespace {

struct PlanCache {
    std::shared_mutex mutex;
    std::unordered_map<LinearConfig, std::shared_ptr<const LinearPlan>, LinearConfigHash> plans;
    std::atomic<std::uint64_t> hits{0};
    std::atomic<std::uint64_t> misses{0};
    /// Where the rule answers come from: two layers with one configuration share one inference.
    spmd::RuleCache rules;
};

PlanCache &ThePlanCache() {
    static PlanCache cache;
    return cache;
}

/// dims_mapping of a rank-`rank` tensor whose dim `tensor_dim` is split over mesh dim `tp_dim` (-1: replicated).
spmd::Layout SplitOn(int rank, int tensor_dim, int tp_dim) {
    std::vector<int> mapping(static_cast<std::size_t>(rank), -1);
    if (tensor_dim >= 0) {
        mapping[static_cast<std::size_t>(tensor_dim)] = tp_dim;
    }
    return spmd::Layout::FromDimsMapping(mapping);
}

int IndexOf(const std::vector<std::string> &names, std::string_view name) {
    for (std::size_t i = 0; i < names.size(); ++i) {
        if (names[i] == name) {
            return static_cast<int>(i);
        }
    }
    return -1;
}

/// Parameters never move (the linear rule gives conflicts to them): a plan that would move a weight or a bias, or its
/// gradient, means the layouts given to the rule are not a column or row parallel layer. Checked once per
/// configuration, before any collective.
void CheckStill(const spmd::RedistributePlan &plan, std::string_view op, std::string_view what,
                const spmd::Layout &layout) {
    SHARDLINE_CHECK(plan.steps.empty(), op,
                    "the linear rule would move the {} (layout {}, {} steps); the functional layer keeps parameters "
                    "and their gradients in place",
                    what, layout.ToString(), plan.steps.size());
}

std::shared_ptr<const LinearPlan> BuildPlan(const LinearConfig &c, spmd::RuleCache &rules, std::string_view op) {
    auto plan = std::make_shared<LinearPlan>();
    const int rank = c.x_ndim;
    plan->x_shape.assign(c.x_shape.begin(), c.x_shape.begin() + rank);
    const std::int64_t in = plan->x_shape.back();
    const std::int64_t out = c.out_features;
    plan->weight_shape = {out, in};
    plan->bias_shape = {out};
    plan->y_shape = plan->x_shape;
    plan->y_shape.back() = out;

    // The caller's layouts (DESIGN.md §6): column W S(0), row W S(1); the activations as the flags say.
    const int tp = c.tp_dim;
    if (c.kind == LinearKind::kColumn) {
        plan->x_layout = SplitOn(rank, c.sequence_parallel ? 0 : -1, tp);
        plan->weight_layout = SplitOn(2, 0, tp);
        plan->bias_layout = SplitOn(1, 0, tp);
        plan->y_layout = SplitOn(rank, c.gather_output ? -1 : rank - 1, tp);
    } else {
        plan->x_layout = SplitOn(rank, c.input_is_parallel ? rank - 1 : -1, tp);
        plan->weight_layout = SplitOn(2, 1, tp);
        plan->bias_layout = SplitOn(1, -1, tp);
        plan->y_layout = SplitOn(rank, c.sequence_parallel ? 0 : -1, tp);
    }

    spmd::RuleRequest request;
    request.op = "linear";
    request.mesh =
        spmd::ProcessMesh(std::vector<std::int64_t>(c.mesh_shape.begin(), c.mesh_shape.begin() + c.mesh_ndim));
    request.inputs = {{plan->x_shape, plan->x_layout}, {plan->weight_shape, plan->weight_layout}};
    if (c.bias) {
        request.inputs.push_back({plan->bias_shape, plan->bias_layout});
    }
    request.options.plan.element_size = static_cast<std::int64_t>(ElementSize(c.dtype));

    spmd::RuleRequest forward = request;
    forward.direction = spmd::RuleDirection::kForward;
    forward.options.output_target = plan->y_layout;
    spmd::RuleRequest grad = request;
    grad.direction = spmd::RuleDirection::kGrad;
    grad.out_grad = spmd::TensorSpec{plan->y_shape, plan->y_layout};
    try {
        plan->forward = rules.GetOrInfer(spmd::RuleKey(std::move(forward)));
        plan->grad = rules.GetOrInfer(spmd::RuleKey(std::move(grad)));
    } catch (const spmd::SpmdError &e) {
        throw Error(shardline::detail::FormatError(__FILE__, __LINE__, op, e.what()));
    }

    const spmd::SpmdInfo &f = plan->forward->info;
    const spmd::SpmdInfo &g = plan->grad->info;
    plan->forward_x = IndexOf(f.input_names, "x");
    plan->grad_x = IndexOf(g.input_names, "x");
    plan->grad_weight = IndexOf(g.input_names, "weight");
    plan->grad_out_grad = IndexOf(g.input_names, "out_grad");
    plan->grad_x_grad = IndexOf(g.output_names, "x_grad");
    plan->grad_weight_grad = IndexOf(g.output_names, "weight_grad");
    plan->grad_bias_grad = IndexOf(g.output_names, "bias_grad");
    SHARDLINE_CHECK(
        plan->forward_x >= 0 && plan->grad_x >= 0 && plan->grad_weight >= 0 && plan->grad_out_grad >= 0 &&
            plan->grad_x_grad >= 0 && plan->grad_weight_grad >= 0 && (plan->grad_bias_grad >= 0) == c.bias,
        op, "the linear rule's answer lacks a tensor (forward inputs [{}], grad inputs [{}], grad outputs [{}])",
        fmt::join(f.input_names, ", "), fmt::join(g.input_names, ", "), fmt::join(g.output_names, ", "));

    CheckStill(plan->forward->input_plans[static_cast<std::size_t>(IndexOf(f.input_names, "weight"))], op, "weight",
               plan->weight_layout);
    CheckStill(plan->grad->input_plans[static_cast<std::size_t>(plan->grad_weight)], op, "weight", plan->weight_layout);
    CheckStill(plan->grad->output_plans[static_cast<std::size_t>(plan->grad_weight_grad)], op, "weight gradient",
               plan->weight_layout);
    if (c.bias) {
        CheckStill(plan->forward->input_plans[static_cast<std::size_t>(IndexOf(f.input_names, "bias"))], op, "bias",
                   plan->bias_layout);
        CheckStill(plan->grad->output_plans[static_cast<std::size_t>(plan->grad_bias_grad)], op, "bias gradient",
                   plan->bias_layout);
    }
    return plan;
}

} // namespace

std::size_t LinearConfigHash::operator()(const LinearConfig &c) const noexcept {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(c.kind) | (static_cast<std::uint64_t>(c.dtype) << 8) |
        (static_cast<std::uint64_t>(c.bias) << 16) | (static_cast<std::uint64_t>(c.gather_output) << 17) |
        (static_cast<std::uint64_t>(c.input_is_parallel) << 18) |
        (static_cast<std::uint64_t>(c.sequence_parallel) << 19) | (static_cast<std::uint64_t>(c.tp_dim) << 24) |
        (static_cast<std::uint64_t>(c.mesh_ndim) << 32) | (static_cast<std::uint64_t>(c.x_ndim) << 40));
    for (int d = 0; d < c.mesh_ndim; ++d) {
        mix(static_cast<std::uint64_t>(c.mesh_shape[static_cast<std::size_t>(d)]));
    }
    for (int d = 0; d < c.x_ndim; ++d) {
        mix(static_cast<std::uint64_t>(c.x_shape[static_cast<std::size_t>(d)]));
    }
    mix(static_cast<std::uint64_t>(c.out_features));
    return static_cast<std::size_t>(h);
}

std::shared_ptr<const LinearPlan> GetLinearPlan(const LinearConfig &config, std::string_view op) {
    PlanCache &cache = ThePlanCache();
    {
        std::shared_lock lock(cache.mutex);
        if (auto it = cache.plans.find(config); it != cache.plans.end()) {
            cache.hits.fetch_add(1, std::memory_order_relaxed);
            return it->second;
        }
    }
    // Inferred outside the lock; two threads missing on one configuration both infer and the first insertion wins.
    std::shared_ptr<const LinearPlan> plan = BuildPlan(config, cache.rules, op);
    cache.misses.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock lock(cache.mutex);
    return cache.plans.emplace(config, std::move(plan)).first->second;
}

} // namespace detail

PlanCacheStats GetPlanCacheStats() {
    detail::PlanCache &cache = detail::ThePlanCache();
    std::shared_lock lock(cache.mutex);
    return PlanCacheStats{.hits = cache.hits.load(), .misses = cache.misses.load(), .size = cache.plans.size()};
}

void ClearPlanCache() {
    detail::PlanCache &cache = detail::ThePlanCache();
    std::unique_lock lock(cache.mutex);
    cache.plans.clear();
    cache.rules.Clear();
    cache.hits = 0;
    cache.misses = 0;
}

} // namespace shardline::functional
