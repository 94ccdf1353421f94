#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <queue>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::spmd {

namespace {

double PerDim(const std::vector<double> &per_dim, double fallback, int mesh_dim) {
    return mesh_dim >= 0 && mesh_dim < static_cast<int>(per_dim.size()) ? per_dim[mesh_dim] : fallback;
}

} // namespace

double CostModel::Call(int mesh_dim) const { return PerDim(call_us_per_dim, call_us, mesh_dim); }

double CostModel::Alpha(int mesh_dim) const { return PerDim(alpha_us_per_dim, alpha_us, mesh_dim); }

double CostModel::Bandwidth(int mesh_dim) const {
    return PerDim(bandwidth_gb_per_s_per_dim, bandwidth_gb_per_s, mesh_dim);
}

double CostModel::Cost(int mesh_dim, int64_t ring_steps, int64_t bytes) const {
    // GB/s = 1e9 B / 1e6 us = 1e3 B/us.
    return Call(mesh_dim) + static_cast<double>(ring_steps) * Alpha(mesh_dim) +
           static_cast<double>(bytes) / (Bandwidth(mesh_dim) * 1e3);
}

void CostModel::Validate(std::string_view what) const {
    auto check = [&](std::string_view field, double value, bool positive) {
        if (!std::isfinite(value) || value < 0.0 || (positive && value <= 0.0)) {
            throw SpmdError(fmt::format("{}.{}: must be {} 0 (a finite number), got {}", what, field,
                                        positive ? ">" : ">=", value));
        }
    };
    auto check_list = [&](std::string_view field, const std::vector<double> &values, bool positive) {
        if (values.size() > static_cast<size_t>(kMaxMeshDims)) {
            throw SpmdError(
                fmt::format("{}.{}: {} entries; a mesh has at most {} dims", what, field, values.size(), kMaxMeshDims));
        }
        for (size_t i = 0; i < values.size(); ++i) {
            check(fmt::format("{}[{}]", field, i), values[i], positive);
        }
    };
    check("call_us", call_us, false);
    check("alpha_us", alpha_us, false);
    check("bandwidth_gb_per_s", bandwidth_gb_per_s, true);
    check("flops_per_us", flops_per_us, true);
    check_list("call_us_per_dim", call_us_per_dim, false);
    check_list("alpha_us_per_dim", alpha_us_per_dim, false);
    check_list("bandwidth_gb_per_s_per_dim", bandwidth_gb_per_s_per_dim, true);
}

std::string_view ToString(Collective collective) {
    switch (collective) {
    case Collective::kAllReduce:
        return "all_reduce";
    case Collective::kAllGather:
        return "all_gather";
    case Collective::kReduceScatter:
        return "reduce_scatter";
    case Collective::kAllToAll:
        return "all_to_all";
    case Collective::kLocalSlice:
        return "local_slice";
    case Collective::kLocalPartialize:
        return "local_partialize";
    case Collective::kAllToAllV:
        return "all_to_all_v";
    }
    return "?";
}

int RedistributePlan::NumCollectives() const {
    return static_cast<int>(std::count_if(steps.begin(), steps.end(), [](const RedistributeStep &s) {
        return s.collective != Collective::kLocalSlice && s.collective != Collective::kLocalPartialize;
    }));
}

namespace {

/// Bytes of a local block: its element count (bounded by the tensor's, CheckShape) times the element size.
int64_t BlockBytes(const std::vector<int64_t> &shape, int64_t element_size) {
    return CheckedMul(CheckedProduct(shape, "redistribute"), element_size, "redistribute: bytes of a block");
}

/// A layout under redistribution: per tensor dim its mesh dims (major -> minor), and the Partial mesh dims.
struct PlanState {
    std::vector<std::vector<int>> dims;
    std::map<int, ReduceOp> partial;

    Layout ToLayout() const { return Layout(dims, partial); }
    bool operator==(const PlanState &other) const = default;
};

/// Applies one step to `state` and prices it (RedistributeStep documents the byte counts). Every step acts on the
/// minor end of a tensor dim's shard list: that is what a collective on one mesh dim can do to nested chunks.
RedistributeStep ApplyStep(const ProcessMesh &mesh, const std::vector<int64_t> &shape, const PlanOptions &options,
                           PlanState &state, Collective c, int d, int t, int t2, ReduceOp op) {
    RedistributeStep step;
    step.collective = c;
    step.mesh_dim = d;
    step.tensor_dim = t;
    step.to_tensor_dim = t2;
    step.reduce_op = op;
    step.before = state.ToLayout();
    const int64_t n = mesh.DimSize(d);
    const int64_t elem = options.element_size;
    const std::string what = fmt::format("redistribute: {} on mesh dim {} ({} ranks) moves more bytes per rank than an "
                                         "int64 holds",
                                         ToString(c), d, n);
    const std::vector<int64_t> before_shape = MaxLocalShape(mesh, shape, step.before);
    switch (c) {
    case Collective::kAllReduce:
        state.partial.erase(d);
        break;
    case Collective::kAllGather:
        state.dims[t].pop_back();
        break;
    case Collective::kReduceScatter:
        state.partial.erase(d);
        state.dims[t].push_back(d);
        break;
    case Collective::kAllToAll:
        state.dims[t].pop_back();
        state.dims[t2].push_back(d);
        break;
    case Collective::kLocalSlice:
        state.dims[t].push_back(d);
        break;
    case Collective::kLocalPartialize:
        state.partial[d] = op;
        break;
    case Collective::kAllToAllV:
        throw SpmdError("redistribute: all_to_all_v is an op's internal collective, never a planner step");
    }
    step.after = state.ToLayout();
    const std::vector<int64_t> after_shape = MaxLocalShape(mesh, shape, step.after);
    switch (c) {
    case Collective::kAllReduce: {
        const int64_t numel = CheckedProduct(before_shape, what);
        const int64_t chunk = CheckedMul(numel / n + (numel % n != 0 ? 1 : 0), elem, what);
        step.bytes_per_rank = CheckedMul(CheckedMul(2, n - 1, what), chunk, what);
        step.cost_us = options.cost.Cost(d, 2 * (n - 1), step.bytes_per_rank);
        break;
    }
    case Collective::kAllGather:
        step.bytes_per_rank = CheckedMul(n - 1, BlockBytes(before_shape, elem), what);
        step.cost_us = options.cost.Cost(d, n - 1, step.bytes_per_rank);
        break;
    case Collective::kReduceScatter:
        step.bytes_per_rank = CheckedMul(n - 1, BlockBytes(after_shape, elem), what);
        step.cost_us = options.cost.Cost(d, n - 1, step.bytes_per_rank);
        break;
    case Collective::kAllToAll: {
        std::vector<int64_t> block = before_shape;
        block[t2] = ChunkRange(before_shape[t2], n, 0).second;
        step.bytes_per_rank = CheckedMul(n - 1, BlockBytes(block, elem), what);
        step.cost_us = options.cost.Cost(d, n - 1, step.bytes_per_rank);
        break;
    }
    case Collective::kLocalSlice:
    case Collective::kLocalPartialize:
    case Collective::kAllToAllV:
        break;
    }
    return step;
}

class Planner {
public:
    Planner(const ProcessMesh &mesh, const std::vector<int64_t> &shape, const Layout &src, const Layout &dst,
            const PlanOptions &options)
        : mesh_(mesh), shape_(shape), options_(options), dims_(src.DimsMeshDims()), partial_(src.Partial()), dst_(dst) {
    }

    RedistributePlan Run() {
        const int rank = static_cast<int>(shape_.size());
        // 1. Free slices and ready reduce-scatters first: they shrink every later collective.
        for (int t = 0; t < rank; ++t) {
            AddReady(t, /*only_free=*/false, /*stop_when_blocked=*/true);
        }
        // 2. All-reduce partials that dst neither keeps nor scatters, while the tensor is smallest.
        for (auto [d, op] : std::map<int, ReduceOp>(partial_)) {
            if (!KeepsPartial(d, op) && dst_.TensorDimOf(d) < 0) {
                Emit(Collective::kAllReduce, d, -1, -1, op);
            }
        }
        // 3. Un-shard what dst shards differently, minor-most first; all_to_all when the target dim is ready.
        bool pending = true;
        while (pending) {
            pending = false;
            bool progressed = false;
            int first_blocked = -1;
            for (int t = 0; t < rank; ++t) {
                while (Extra(t)) {
                    const int d = dims_[t].back();
                    const int t2 = dst_.TensorDimOf(d);
                    if (t2 >= 0 && t2 != t) {
                        if (Ready(t2, d)) {
                            Emit(Collective::kAllToAll, d, t, t2, ReduceOp::kSum);
                            progressed = true;
                            continue;
                        }
                        // Another removal may make t2 ready: defer.
                        if (first_blocked < 0) {
                            first_blocked = t;
                        }
                        pending = true;
                        break;
                    }
                    Emit(Collective::kAllGather, d, t, -1, ReduceOp::kSum);
                    progressed = true;
                }
            }
            if (pending && !progressed) {
                // Nothing else can move: gather the first blocked mesh dim (deterministic tie break).
                Emit(Collective::kAllGather, dims_[first_blocked].back(), first_blocked, -1, ReduceOp::kSum);
            }
        }
        // 4. Shard in dst order: reduce_scatter for a partial mesh dim, local slice for a free one.
        for (int t = 0; t < rank; ++t) {
            AddReady(t, /*only_free=*/false, /*stop_when_blocked=*/false);
        }
        // 5. Remaining partials (reduce op changes) are reduced.
        for (auto [d, op] : std::map<int, ReduceOp>(partial_)) {
            if (!KeepsPartial(d, op)) {
                Emit(Collective::kAllReduce, d, -1, -1, op);
            }
        }
        // 6. New partials are made locally.
        for (auto [d, op] : dst_.Partial()) {
            if (partial_.count(d) == 0) {
                Emit(Collective::kLocalPartialize, d, -1, -1, op);
            }
        }
        if (Current() != dst_) {
            throw SpmdError(fmt::format("PlanRedistribute: internal error, reached {} instead of {}",
                                        Current().ToString(), dst_.ToString()));
        }
        return std::move(plan_);
    }

private:
    Layout Current() const { return Layout(dims_, partial_); }

    bool KeepsPartial(int d, ReduceOp op) const {
        auto it = dst_.Partial().find(d);
        return it != dst_.Partial().end() && it->second == op;
    }
    bool IsPrefix(int t) const {
        const auto &want = dst_.MeshDims(t);
        return dims_[t].size() <= want.size() && std::equal(dims_[t].begin(), dims_[t].end(), want.begin());
    }
    bool Ready(int t, int d) const {
        return IsPrefix(t) && dims_[t].size() < dst_.MeshDims(t).size() && dst_.MeshDims(t)[dims_[t].size()] == d;
    }
    bool Extra(int t) const { return !IsPrefix(t); }
    bool Free(int d) const {
        if (partial_.count(d) != 0) {
            return false;
        }
        return std::none_of(dims_.begin(), dims_.end(),
                            [d](const auto &v) { return std::find(v.begin(), v.end(), d) != v.end(); });
    }

    void AddReady(int t, bool only_free, bool stop_when_blocked) {
        while (IsPrefix(t) && dims_[t].size() < dst_.MeshDims(t).size()) {
            const int d = dst_.MeshDims(t)[dims_[t].size()];
            auto it = partial_.find(d);
            if (it != partial_.end() && !only_free) {
                Emit(Collective::kReduceScatter, d, t, -1, it->second);
            } else if (Free(d)) {
                Emit(Collective::kLocalSlice, d, t, -1, ReduceOp::kSum);
            } else if (stop_when_blocked) {
                return;
            } else {
                throw SpmdError(fmt::format("PlanRedistribute: internal error, mesh dim {} is busy in {} while "
                                            "sharding tensor dim {} towards {}",
                                            d, Current().ToString(), t, dst_.ToString()));
            }
        }
    }

    void Emit(Collective c, int d, int t, int t2, ReduceOp op) {
        PlanState state{std::move(dims_), std::move(partial_)};
        RedistributeStep step = ApplyStep(mesh_, shape_, options_, state, c, d, t, t2, op);
        dims_ = std::move(state.dims);
        partial_ = std::move(state.partial);
        plan_.cost_us += step.cost_us;
        plan_.bytes_per_rank = CheckedAdd(plan_.bytes_per_rank, step.bytes_per_rank, "redistribute: bytes per rank");
        plan_.steps.push_back(std::move(step));
    }

    const ProcessMesh &mesh_;
    const std::vector<int64_t> &shape_;
    const PlanOptions &options_;
    std::vector<std::vector<int>> dims_;
    std::map<int, ReduceOp> partial_;
    Layout dst_;
    RedistributePlan plan_;
};

/// The cheapest plan from src to dst over every sequence of single-mesh-dim steps (Dijkstra on layouts), or nullopt
/// when more than `max_states` layouts would be expanded or `max_edges` steps priced. Edges: all_reduce /
/// reduce_scatter of a Partial mesh dim dst does not keep with that op; all_gather of a tensor dim's minor mesh dim, or
/// all_to_all of it onto the minor end of another tensor dim; local_slice of a free mesh dim onto the minor end of a
/// tensor dim; local_partialize of a free mesh dim dst wants Partial. Ties go to fewer steps, then to the first found
/// (deterministic).
std::optional<RedistributePlan> SearchPlan(const ProcessMesh &mesh, const std::vector<int64_t> &shape,
                                           const Layout &src, const Layout &dst, const PlanOptions &options,
                                           size_t max_states, size_t max_edges) {
    struct Node {
        PlanState state;
        int64_t parent = -1;
        RedistributeStep step;
        double cost = 0.0;
        int64_t steps = 0;
    };
    auto key_of = [](const PlanState &state) {
        std::vector<int> key;
        for (const auto &dims : state.dims) {
            key.push_back(static_cast<int>(dims.size()));
            key.insert(key.end(), dims.begin(), dims.end());
        }
        for (const auto &[d, op] : state.partial) {
            key.push_back(d);
            key.push_back(static_cast<int>(op));
        }
        return key;
    };
    const PlanState goal{dst.DimsMeshDims(), dst.Partial()};
    const int rank = static_cast<int>(shape.size());
    std::vector<Node> nodes;
    nodes.push_back({PlanState{src.DimsMeshDims(), src.Partial()}, -1, {}, 0.0, 0});
    std::map<std::vector<int>, double> best;
    best[key_of(nodes[0].state)] = 0.0;
    using Entry = std::tuple<double, int64_t, int64_t>; // cost, steps, node
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
    queue.emplace(0.0, 0, 0);
    size_t expanded = 0;
    size_t edges = 0;
    while (!queue.empty()) {
        const double cost = std::get<0>(queue.top());
        const int64_t steps = std::get<1>(queue.top());
        const int64_t index = std::get<2>(queue.top());
        queue.pop();
        const PlanState state = nodes[index].state;
        if (cost > best[key_of(state)]) {
            continue;
        }
        if (state == goal) {
            RedistributePlan plan;
            for (int64_t i = index; nodes[i].parent >= 0; i = nodes[i].parent) {
                plan.steps.push_back(nodes[i].step);
            }
            std::reverse(plan.steps.begin(), plan.steps.end());
            for (const RedistributeStep &step : plan.steps) {
                plan.cost_us += step.cost_us;
                plan.bytes_per_rank =
                    CheckedAdd(plan.bytes_per_rank, step.bytes_per_rank, "redistribute: bytes per rank");
            }
            return plan;
        }
        if (++expanded > max_states || edges > max_edges) {
            return std::nullopt;
        }
        auto relax = [&](Collective c, int d, int t, int t2, ReduceOp op) {
            if (++edges > max_edges) {
                return;
            }
            PlanState next = state;
            RedistributeStep step = ApplyStep(mesh, shape, options, next, c, d, t, t2, op);
            const double next_cost = cost + step.cost_us;
            const std::vector<int> key = key_of(next);
            auto it = best.find(key);
            if (it != best.end() && it->second <= next_cost) {
                return;
            }
            best[key] = next_cost;
            nodes.push_back({std::move(next), index, std::move(step), next_cost, steps + 1});
            queue.emplace(next_cost, steps + 1, static_cast<int64_t>(nodes.size() - 1));
        };
        for (const auto &[d, op] : state.partial) {
            auto kept = goal.partial.find(d);
            if (kept != goal.partial.end() && kept->second == op) {
                continue;
            }
            relax(Collective::kAllReduce, d, -1, -1, op);
            for (int t = 0; t < rank; ++t) {
                relax(Collective::kReduceScatter, d, t, -1, op);
            }
        }
        std::vector<bool> busy(mesh.NDim(), false);
        for (const auto &[d, op] : state.partial) {
            busy[d] = true;
        }
        for (int t = 0; t < rank; ++t) {
            for (int d : state.dims[t]) {
                busy[d] = true;
            }
            if (state.dims[t].empty()) {
                continue;
            }
            const int d = state.dims[t].back();
            relax(Collective::kAllGather, d, t, -1, ReduceOp::kSum);
            for (int t2 = 0; t2 < rank; ++t2) {
                if (t2 != t) {
                    relax(Collective::kAllToAll, d, t, t2, ReduceOp::kSum);
                }
            }
        }
        for (int d = 0; d < mesh.NDim(); ++d) {
            if (busy[d] || mesh.DimSize(d) == 1) {
                continue;
            }
            for (int t = 0; t < rank; ++t) {
                relax(Collective::kLocalSlice, d, t, -1, ReduceOp::kSum);
            }
            auto wanted = goal.partial.find(d);
            if (wanted != goal.partial.end()) {
                relax(Collective::kLocalPartialize, d, -1, -1, wanted->second);
            }
        }
    }
    return std::nullopt;
}

/// True when the plan gathers a mesh dim that dst shards again: the case where moving it with all_to_alls instead
/// (possibly through another tensor dim) can be cheaper, so the search is worth its time.
bool GathersAndReshards(const RedistributePlan &plan, const Layout &dst) {
    return std::any_of(plan.steps.begin(), plan.steps.end(), [&dst](const RedistributeStep &step) {
        return step.collective == Collective::kAllGather && dst.TensorDimOf(step.mesh_dim) >= 0;
    });
}

/// Layouts the search may expand, and steps it may price, before it gives up and the ordered plan stands (a 3-d mesh
/// on a rank-4 tensor has a few thousand layouts; the step budget bounds high-rank tensors, whose every layout has
/// rank^2 neighbours).
constexpr size_t kMaxSearchStates = 20000;
constexpr size_t kMaxSearchEdges = 5000;

} // namespace

RedistributePlan PlanRedistribute(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &src,
                                  const Layout &dst, const PlanOptions &options) {
    const int rank = static_cast<int>(global_shape.size());
    src.Validate(mesh, rank, "redistribute src");
    dst.Validate(mesh, rank, "redistribute dst");
    for (size_t t = 0; t < global_shape.size(); ++t) {
        if (global_shape[t] < 0) {
            throw SpmdError(fmt::format("redistribute: shape {} has a negative dim", ShapeToString(global_shape)));
        }
    }
    CheckShape(global_shape, "redistribute: shape");
    if (options.element_size < 1 || options.element_size > kMaxElementSize) {
        throw SpmdError(fmt::format("redistribute: element_size must be in [1, {}], got {}", kMaxElementSize,
                                    options.element_size));
    }
    options.cost.Validate("redistribute: cost model");
    const Layout from = src.Canonical(mesh);
    const Layout to = dst.Canonical(mesh);
    RedistributePlan plan = Planner(mesh, global_shape, from, to, options).Run();
    if (options.search && GathersAndReshards(plan, to)) {
        std::optional<RedistributePlan> searched =
            SearchPlan(mesh, global_shape, from, to, options, kMaxSearchStates, kMaxSearchEdges);
        // Strictly cheaper only: the ordered plan is the documented default and wins ties.
        if (searched && searched->cost_us < plan.cost_us - 1e-9 * std::max(1.0, plan.cost_us)) {
            return std::move(*searched);
        }
    }
    return plan;
}

double RedistributeCost(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &src,
                        const Layout &dst, const PlanOptions &options) {
    return PlanRedistribute(mesh, global_shape, src, dst, options).cost_us;
}

} // namespace shardline::spmd
