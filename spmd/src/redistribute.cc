#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::spmd {

double CostModel::Alpha(int mesh_dim) const {
    if (mesh_dim >= 0 && mesh_dim < static_cast<int>(alpha_us_per_dim.size())) {
        return alpha_us_per_dim[mesh_dim];
    }
    return alpha_us;
}

double CostModel::Bandwidth(int mesh_dim) const {
    if (mesh_dim >= 0 && mesh_dim < static_cast<int>(bandwidth_gb_per_s_per_dim.size())) {
        return bandwidth_gb_per_s_per_dim[mesh_dim];
    }
    return bandwidth_gb_per_s;
}

double CostModel::Cost(int mesh_dim, int64_t ring_steps, int64_t bytes) const {
    // GB/s = 1e9 B / 1e6 us = 1e3 B/us.
    return static_cast<double>(ring_steps) * Alpha(mesh_dim) + static_cast<double>(bytes) / (Bandwidth(mesh_dim) * 1e3);
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
    }
    return "?";
}

int RedistributePlan::NumCollectives() const {
    return static_cast<int>(std::count_if(steps.begin(), steps.end(), [](const RedistributeStep &s) {
        return s.collective != Collective::kLocalSlice && s.collective != Collective::kLocalPartialize;
    }));
}

namespace {

int64_t Product(const std::vector<int64_t> &v) {
    return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<>());
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
        RedistributeStep step;
        step.collective = c;
        step.mesh_dim = d;
        step.tensor_dim = t;
        step.to_tensor_dim = t2;
        step.reduce_op = op;
        step.before = Current();
        const int64_t n = mesh_.DimSize(d);
        const int64_t elem = options_.element_size;
        const std::vector<int64_t> before_shape = MaxLocalShape(mesh_, shape_, step.before);
        switch (c) {
        case Collective::kAllReduce:
            partial_.erase(d);
            break;
        case Collective::kAllGather:
            dims_[t].pop_back();
            break;
        case Collective::kReduceScatter:
            partial_.erase(d);
            dims_[t].push_back(d);
            break;
        case Collective::kAllToAll:
            dims_[t].pop_back();
            dims_[t2].push_back(d);
            break;
        case Collective::kLocalSlice:
            dims_[t].push_back(d);
            break;
        case Collective::kLocalPartialize:
            partial_[d] = op;
            break;
        }
        step.after = Current();
        const std::vector<int64_t> after_shape = MaxLocalShape(mesh_, shape_, step.after);
        switch (c) {
        case Collective::kAllReduce: {
            const int64_t chunk = (Product(before_shape) + n - 1) / n * elem;
            step.bytes_per_rank = 2 * (n - 1) * chunk;
            step.cost_us = options_.cost.Cost(d, 2 * (n - 1), step.bytes_per_rank);
            break;
        }
        case Collective::kAllGather:
            step.bytes_per_rank = (n - 1) * Product(before_shape) * elem;
            step.cost_us = options_.cost.Cost(d, n - 1, step.bytes_per_rank);
            break;
        case Collective::kReduceScatter:
            step.bytes_per_rank = (n - 1) * Product(after_shape) * elem;
            step.cost_us = options_.cost.Cost(d, n - 1, step.bytes_per_rank);
            break;
        case Collective::kAllToAll: {
            std::vector<int64_t> block = before_shape;
            block[t2] = ChunkRange(before_shape[t2], n, 0).second;
            step.bytes_per_rank = (n - 1) * Product(block) * elem;
            step.cost_us = options_.cost.Cost(d, n - 1, step.bytes_per_rank);
            break;
        }
        case Collective::kLocalSlice:
        case Collective::kLocalPartialize:
            break;
        }
        plan_.cost_us += step.cost_us;
        plan_.bytes_per_rank += step.bytes_per_rank;
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
    if (options.element_size < 1) {
        throw SpmdError(fmt::format("redistribute: element_size must be >= 1, got {}", options.element_size));
    }
    Planner planner(mesh, global_shape, src.Canonical(mesh), dst.Canonical(mesh), options);
    return planner.Run();
}

double RedistributeCost(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &src,
                        const Layout &dst, const PlanOptions &options) {
    return PlanRedistribute(mesh, global_shape, src, dst, options).cost_us;
}

} // namespace shardline::spmd
