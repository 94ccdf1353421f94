// nn::MoEMLP: the gate, the router and the permutation run on this rank's tokens as local Variables (autograd/moe.h);
// the expert-parallel exchange (autograd/moe_dispatch.h) brings the local experts their rows; the experts are the
// grouped column → GELU → row layers over tp, on the mesh, so that their parameter gradients carry the right layouts
// (sharded over ep, Partial over the expert-data-parallel dims) for GradSync. With etp 1 below tp the tp ranks split
// the tokens instead (a free Replicate → Shard redistribute in, an all-gather out) and run whole experts on their
// slice: the same grouped layers with a group of one rank, whose parameter gradients are then Partial over tp too.

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe_dispatch.h>
#include <shardline/core/error.h>
#include <shardline/dist/ops.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/nn/moe.h>

namespace shardline::nn {
namespace {

constexpr const char *kLayer = "MoEMLP";

RandomSpec Uniform(const std::string &name, std::int64_t in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    return {.seed = 0, .name = name, .distribution = RandomDistribution::kUniform, .a = -bound, .b = bound};
}

std::int64_t DimSize(const comm::DeviceMesh &mesh, int d) { return mesh.shape()[static_cast<std::size_t>(d)]; }

/// The mesh dims that shard x's leading (token) dims: the data-parallel dims of this input.
std::vector<int> TokenDims(const spmd::Layout &x) {
    std::vector<int> dims;
    for (int t = 0; t + 1 < x.TensorRank(); ++t) {
        for (int d : x.MeshDims(t)) {
            dims.push_back(d);
        }
    }
    std::sort(dims.begin(), dims.end());
    return dims;
}

} // namespace

MoEMLP::MoEMLP(const MoEMLPOptions &options, comm::DeviceMesh &mesh, const ParameterOptions &param)
    : options_(options), mesh_(mesh) {
    name_ = param.name.empty() ? std::string("moe") : param.name;
    const auto &names = mesh.dim_names();
    for (const std::string *dim : {&options.ep_dim, &options.tp_dim}) {
        SHARDLINE_CHECK(std::find(names.begin(), names.end(), *dim) != names.end(), kLayer,
                        "'{}': the mesh has no dim named '{}' (its dims are [{}]; a (dp, ep, tp) mesh is expected, "
                        "dims of size 1 allowed)",
                        name_, *dim, fmt::join(names, ", "));
    }
    ep_dim_ = mesh.dim_index(options.ep_dim);
    tp_dim_ = mesh.dim_index(options.tp_dim);
    SHARDLINE_CHECK(ep_dim_ != tp_dim_, kLayer, "'{}': ep_dim and tp_dim must differ, both are '{}'", name_,
                    options.ep_dim);
    ep_ = DimSize(mesh, ep_dim_);
    const std::int64_t tp = DimSize(mesh, tp_dim_);
    const std::int64_t e = options.num_experts;
    SHARDLINE_CHECK_AS(ShapeError, options.hidden > 0 && options.ffn > 0 && e > 0, kLayer,
                       "'{}': hidden ({}), ffn ({}) and num_experts ({}) must be positive", name_, options.hidden,
                       options.ffn, e);
    SHARDLINE_CHECK(options.topk >= 1 && options.topk <= e, kLayer,
                    "'{}': topk ({}) must be in [1, num_experts] = [1, {}]", name_, options.topk, e);
    SHARDLINE_CHECK(options.ep == 0 || options.ep == ep_, kLayer,
                    "'{}': ep ({}) must equal the size of mesh dim '{}' ({})", name_, options.ep, options.ep_dim, ep_);
    SHARDLINE_CHECK(e % ep_ == 0, kLayer, "'{}': num_experts ({}) must be divisible by ep ({})", name_, e, ep_);
    // etp 1 < tp: the tp ranks split the tokens and hold whole experts. 1 < etp < tp would split the tp dim in two (an
    // expert-tp group inside each tp group), which a mesh dim cannot be.
    SHARDLINE_CHECK(options.etp == 0 || options.etp == tp || options.etp == 1, kLayer,
                    "'{}': etp ({}) must be 1 or the size of mesh dim '{}' ({}) (supported: {{1, {}}}; 0 means {}): "
                    "the experts are tensor-parallel over the whole tp dim or not at all",
                    name_, options.etp, options.tp_dim, tp, tp, tp);
    split_tokens_ = options.etp == 1 && tp > 1;
    functional::CheckShardsNotEmpty(kLayer, fmt::format("'{}': ffn", name_), options.ffn, split_tokens_ ? 1 : tp);

    const std::int64_t h = options.hidden;
    const std::int64_t f = options.ffn;
    const int ep = ep_dim_;
    // The experts' ffn dim over tp (etp = tp), or whole on every tp rank (etp 1 < tp).
    const std::vector<int> t = split_tokens_ ? std::vector<int>{} : std::vector<int>{tp_dim_};
    using Dims = std::vector<std::vector<int>>;
    ParameterOptions fp32 = param;
    fp32.dtype = DType::kFloat32;
    router_weight = RegisterParameter("router.weight", MakeParameter({h, e}, spmd::Layout::Replicated(2), &mesh, fp32,
                                                                     Uniform(name_ + ".router.weight", h)));
    fc1_weight =
        RegisterParameter("experts.fc1.weight", MakeParameter({e, f, h}, spmd::Layout(Dims{{ep}, t, {}}), &mesh, param,
                                                              Uniform(name_ + ".experts.fc1.weight", h)));
    fc2_weight =
        RegisterParameter("experts.fc2.weight", MakeParameter({e, h, f}, spmd::Layout(Dims{{ep}, {}, t}), &mesh, param,
                                                              Uniform(name_ + ".experts.fc2.weight", f)));
    if (options.bias) {
        fc1_bias = RegisterParameter("experts.fc1.bias", MakeParameter({e, f}, spmd::Layout(Dims{{ep}, t}), &mesh,
                                                                       param, Uniform(name_ + ".experts.fc1.bias", h)));
        fc2_bias = RegisterParameter("experts.fc2.bias", MakeParameter({e, h}, spmd::Layout(Dims{{ep}, {}}), &mesh,
                                                                       param, Uniform(name_ + ".experts.fc2.bias", f)));
    }
}

std::vector<std::pair<Variable, std::vector<std::string>>> MoEMLP::ExtraDataParallelDims() const {
    std::vector<std::pair<Variable, std::vector<std::string>>> dims;
    if (split_tokens_) {
        for (const Variable *p : {&router_weight, &fc1_weight, &fc1_bias, &fc2_weight, &fc2_bias}) {
            if (p->defined()) {
                dims.emplace_back(*p, std::vector<std::string>{options_.tp_dim});
            }
        }
    }
    return dims;
}

std::int64_t MoEMLP::Capacity(std::int64_t tokens) const {
    if (options_.capacity_factor < 0) {
        return -1;
    }
    return static_cast<std::int64_t>(std::ceil(options_.capacity_factor * static_cast<double>(tokens * options_.topk) /
                                               static_cast<double>(options_.num_experts)));
}

void MoEMLP::CheckInput(const Variable &x) const {
    SHARDLINE_CHECK(x.defined() && !x.value().is_local() && &x.value().mesh() == &mesh_, kLayer,
                    "'{}': x must be on the layer's mesh, got {}", name_,
                    x.defined() ? x.value().ToString() : std::string("undefined"));
    SHARDLINE_CHECK_AS(ShapeError, x.shape().size() >= 2 && x.shape().back() == options_.hidden, kLayer,
                       "'{}': x must be [..., hidden] = [..., {}], got {}", name_, options_.hidden,
                       x.value().ToString());
    const spmd::Layout &layout = x.value().layout();
    const std::vector<int> used = layout.UsedMeshDims();
    const std::vector<int> tokens = TokenDims(layout);
    if (split_tokens_) {
        // etp 1: x replicated over tp (each tp rank then takes its slice of the tokens) or already sharded over it on
        // its leading dims (sequence parallel).
        SHARDLINE_CHECK(!layout.IsPartial() && layout.MeshDims(layout.TensorRank() - 1).empty(), kLayer,
                        "'{}': x must have whole features and no Partial, got {}", name_, x.value().ToString());
    } else {
        SHARDLINE_CHECK(
            !layout.IsPartial() && layout.MeshDims(layout.TensorRank() - 1).empty() &&
                (DimSize(mesh_, tp_dim_) == 1 || std::find(used.begin(), used.end(), tp_dim_) == used.end()),
            kLayer, "'{}': x must be replicated over '{}' with whole features and no Partial, got {}", name_,
            options_.tp_dim, x.value().ToString());
    }
    SHARDLINE_CHECK(ep_ == 1 || std::find(tokens.begin(), tokens.end(), ep_dim_) != tokens.end(), kLayer,
                    "'{}': with ep {} the ranks of '{}' must hold different tokens: x's leading dims must be sharded "
                    "over it, got {}",
                    name_, ep_, options_.ep_dim, x.value().ToString());
}

Variable MoEMLP::TokenSlice(const Variable &x) const {
    const spmd::Layout &layout = x.value().layout();
    if (!split_tokens_ || layout.TensorDimOf(tp_dim_) >= 0) {
        return x;
    }
    // Replicate → Shard over tp on dim 0, as the minor shard under the data-parallel dims: a local slice, no
    // communication (its backward all-gathers dx over tp). Even parts, so that every tp rank has tokens and shapes.
    std::vector<std::vector<int>> dims = layout.DimsMeshDims();
    std::int64_t parts = DimSize(mesh_, tp_dim_);
    for (int d : dims.front()) {
        parts *= DimSize(mesh_, d);
    }
    SHARDLINE_CHECK_AS(ShapeError, x.shape().front() % parts == 0, kLayer,
                       "'{}': with etp 1 below tp ({}) the tp ranks split x's dim 0 among them: x.shape[0] ({}) must "
                       "be divisible by the {} ranks that then shard it (mesh dims [{}] and '{}'), got {}",
                       name_, DimSize(mesh_, tp_dim_), x.shape().front(), parts, fmt::join(dims.front(), ", "),
                       options_.tp_dim, x.value().ToString());
    dims.front().push_back(tp_dim_);
    return autograd::Redistribute(x, spmd::Layout(std::move(dims)));
}

std::shared_ptr<const spmd::CachedRule> MoEMLP::ExchangeRule(const Variable &x, std::int64_t capacity) const {
    ExchangeRuleCache &cache = *exchange_rule_;
    const std::lock_guard<std::mutex> lock(cache.mutex);
    const spmd::Layout &layout = x.value().layout();
    if (cache.rule != nullptr && cache.capacity == capacity && cache.x_shape == x.shape() && cache.x_layout == layout) {
        return cache.rule;
    }
    // x as the rule's token rows [tokens, hidden]: its leading dims flattened, rows on the mesh dims that shard them.
    std::int64_t tokens = 1;
    for (std::size_t d = 0; d + 1 < x.shape().size(); ++d) {
        tokens *= x.shape()[d];
    }
    spmd::RuleRequest request{.op = "moe_dispatch",
                              .inputs = {{.shape = {tokens, options_.hidden},
                                          .layout = spmd::Layout(std::vector<std::vector<int>>{
                                              TokenDims(layout), layout.MeshDims(layout.TensorRank() - 1)})}},
                              .attrs = spmd::MoEDispatchAttrs{.num_experts = options_.num_experts,
                                                              .topk = options_.topk,
                                                              .capacity = capacity,
                                                              .ep_dim = options_.ep_dim}};
    std::shared_ptr<const spmd::CachedRule> rule = dist::LookupRule(kLayer, mesh_, std::move(request));
    // The layer runs the exchange of autograd/moe_dispatch.h: x in place (CheckInput), the counts and the rows over ep
    // when it has more than one rank, nothing otherwise. The rule must say the same.
    const std::vector<spmd::InternalCollective> &internal = rule->info.internal;
    SHARDLINE_CHECK(rule->input_plans.at(0).steps.empty() && internal.size() == (ep_ > 1 ? 2U : 0U) &&
                        std::all_of(internal.begin(), internal.end(),
                                    [&](const spmd::InternalCollective &c) { return c.mesh_dim == ep_dim_; }),
                    kLayer,
                    "'{}': the moe_dispatch rule disagrees with the layer's exchange for x {} (x moved in {} steps, {} "
                    "internal collectives; expected none and {} on mesh dim {})",
                    name_, x.value().ToString(), rule->input_plans.at(0).steps.size(), internal.size(), ep_ > 1 ? 2 : 0,
                    ep_dim_);
    cache.x_shape = x.shape();
    cache.x_layout = layout;
    cache.capacity = capacity;
    cache.rule = rule;
    return rule;
}

MoEOutput MoEMLP::Forward(const Variable &x_in) const {
    CheckInput(x_in);
    // etp 1 < tp: this rank's slice of the tokens (gate, router, experts all on it); otherwise x itself.
    const Variable x = TokenSlice(x_in);
    const std::int64_t h = options_.hidden;
    const std::int64_t tokens = x.local().numel() / h;
    // The gate: float32 logits [..., E] on the mesh (its gradient Partial over the token dims, reduced by GradSync).
    const Variable logits = autograd::Matmul(autograd::Cast(x, DType::kFloat32), router_weight);
    const autograd::RouterOutput routed = autograd::Router(autograd::LocalPart(logits, {tokens, options_.num_experts}),
                                                           {.num_experts = static_cast<int>(options_.num_experts),
                                                            .topk = options_.topk,
                                                            .score_function = options_.score_function,
                                                            .normalize_topk = options_.normalize_topk,
                                                            .aux_loss_coeff = options_.aux_loss_coeff,
                                                            .z_loss_coeff = options_.z_loss_coeff});
    MoEOutput out = RunExperts(x, routed.indices, routed.weights);
    out.output = Restore(out.output, x_in);

    // Each rank's auxiliary loss over its tokens, averaged over the data-parallel ranks: Partial(sum) of value / n.
    const std::vector<int> token_dims = TokenDims(x.value().layout());
    std::int64_t n = 1;
    std::map<int, spmd::ReduceOp> partial;
    for (int d : token_dims) {
        n *= DimSize(mesh_, d);
        partial[d] = spmd::ReduceOp::kSum;
    }
    const Variable aux = autograd::Scale(autograd::Add(routed.aux_loss, routed.z_loss), 1.0 / static_cast<double>(n));
    const Shape &shape = aux.shape();
    out.aux_loss = autograd::AsShard(
        aux, shape, shape,
        spmd::Layout(std::vector<std::vector<int>>(static_cast<std::size_t>(shape.size())), std::move(partial)), mesh_);
    return out;
}

Variable MoEMLP::Restore(const Variable &y, const Variable &x) const {
    // The slice's output back to x's layout: an all-gather over tp (its backward a free slice of dy).
    return y.value().layout() == x.value().layout() ? y : autograd::Redistribute(y, x.value().layout());
}

MoEOutput MoEMLP::ForwardRouted(const Variable &x, const Tensor &indices, const Variable &weights) const {
    CheckInput(x);
    MoEOutput out = RunExperts(TokenSlice(x), indices, weights);
    out.output = Restore(out.output, x);
    return out;
}

MoEOutput MoEMLP::RunExperts(const Variable &x, const Tensor &indices, const Variable &weights) const {
    const std::int64_t h = options_.hidden;
    const std::int64_t e = options_.num_experts;
    const std::int64_t tokens = x.local().numel() / h;
    const Shape routing{tokens, options_.topk};
    SHARDLINE_CHECK_AS(ShapeError,
                       indices.defined() && indices.dtype() == DType::kInt64 && indices.shape() == routing &&
                           weights.defined() && weights.shape() == routing,
                       kLayer,
                       "'{}': the routing must be indices int64 and weights [tokens, topk] = [{}, {}], got {} "
                       "and {}",
                       name_, tokens, options_.topk, indices.defined() ? indices.ToString() : "undefined",
                       weights.defined() ? weights.value().ToString() : "undefined");

    // On CUDA at ep 1 without a capacity nothing on the host needs the group sizes: the grouped GEMMs read them on
    // the device, the row count is T·topk, and the statistics keep them on the device (MoEStats::expert_load). The
    // layer then makes no host sync, so the host can queue the rest of the step while the routing runs (the read-back
    // left the GPU idle for 36-132 µs per deepseek-64e layer step on H100 hosts, docs/PERFORMANCE.md).
    const std::int64_t capacity = Capacity(tokens);
    const bool device_sizes = ep_ == 1 && capacity < 0 && tokens > 0 && !x.local().device().is_cpu();
    const autograd::PermuteOutput perm =
        autograd::Permute(autograd::LocalPart(x, {tokens, h}), indices, static_cast<int>(e), capacity, !device_sizes);
    comm::Communicator *ep = ep_ > 1 ? &mesh_.group(ep_dim_) : nullptr;
    autograd::ExpertExchangePlan plan;
    Variable rows = perm.tokens;
    Tensor sizes = perm.group_sizes;
    std::int64_t r = tokens * options_.topk;
    if (!device_sizes) {
        plan = autograd::PlanExpertExchange(perm.host_group_sizes, ep);
        rows = autograd::ExpertDispatch(perm.tokens, plan, ep);
        r = plan.expert_rows(); // received(), or the pad row when none arrives
        const std::vector<std::int64_t> group_sizes = plan.expert_group_sizes();
        sizes = Tensor::FromVector(std::vector<double>(group_sizes.begin(), group_sizes.end()),
                                   Shape{plan.local_experts}, DType::kInt64);
    }
    const std::int64_t local_experts = device_sizes ? e : plan.local_experts;

    // The local experts' rows on the mesh: the moe_dispatch rule's expert rows (ep the major shard, then the other
    // token dims) without ep, which the local experts' grouped layers do not see: sharded over the expert-data-parallel
    // dims (over which the experts' gradients are Partial; tp among them at etp 1 < tp, where the tp ranks hold
    // different tokens), else replicated over tp. The global row count is nominal: each
    // rank holds a different number of rows, and only the local shards are ever read.
    const std::shared_ptr<const spmd::CachedRule> exchange = ExchangeRule(x, capacity);
    std::vector<int> expert_data_dims = exchange->info.outputs.at(0).layout.MeshDims(0);
    std::erase(expert_data_dims, ep_dim_);
    std::int64_t parts = 1;
    for (int d : expert_data_dims) {
        parts *= DimSize(mesh_, d);
    }
    const Variable rows_on_mesh = autograd::AsShard(
        rows, {r, h}, {r * parts, h}, spmd::Layout(std::vector<std::vector<int>>{expert_data_dims, {}}), mesh_);
    // etp = tp: fc1 column- and fc2 row-parallel over tp. etp 1 < tp: whole experts, a group of one rank (the rows are
    // sharded over tp like over dp, so the parameter gradients come out Partial over tp as well).
    const functional::TensorParallelGroup tp{
        .mesh = &mesh_, .tp_dim = split_tokens_ ? functional::TensorParallelGroup::kNoTensorParallel : tp_dim_};
    Variable hidden = autograd::ColumnParallelGroupedLinear(
        rows_on_mesh, fc1_weight, fc1_bias, sizes,
        {.in_features = h, .out_features = options_.ffn, .bias = options_.bias, .num_experts = local_experts}, tp);
    const functional::RowParallelLinearOptions fc2{.in_features = options_.ffn,
                                                   .out_features = h,
                                                   .bias = options_.bias,
                                                   .input_is_parallel = true,
                                                   .num_experts = local_experts};
    // The tanh GELU with gelu_fusion: fc2's Function runs the GELU and its dgrad yields fc1's output gradient (the
    // dGELU in the grouped dgrad's epilogue): no GELU node, no GeluBackward kernel. On CUDA only for bf16/fp16, the
    // dtypes of the CUTLASS kernel with the fused epilogue (fp32 would take cuBLASLt's DGELU per expert, whose gelu'
    // approximation is coarser than the GELU kernels'); on the CPU the same ops either way. Otherwise the GELU node.
    const Tensor &w1 = fc1_weight.local();
    const bool fused_dtype = w1.device().is_cpu() || w1.dtype() == DType::kBFloat16 || w1.dtype() == DType::kFloat16;
    Variable y;
    if (options_.activation && options_.gelu_fusion && options_.approximation == kernels::GeluApproximation::kTanh &&
        fused_dtype) {
        y = autograd::GeluRowParallelGroupedLinear(hidden, fc2_weight, fc2_bias, sizes, fc2, tp);
    } else {
        if (options_.activation) {
            hidden = autograd::Gelu(hidden, options_.approximation);
        }
        y = autograd::RowParallelGroupedLinear(hidden, fc2_weight, fc2_bias, sizes, fc2, tp);
    }
    const Variable back = device_sizes ? autograd::LocalPart(y, {r, h})
                                       : autograd::ExpertCombine(autograd::LocalPart(y, {r, h}), plan, ep);
    const Variable combined = autograd::Unpermute(back, perm.row_map, weights);

    MoEOutput out;
    out.output = autograd::AsShard(combined, x.local().shape(), x.shape(), x.value().layout(), mesh_);
    out.stats.tokens = tokens;
    out.stats.dropped = perm.dropped;
    out.stats.expert_load =
        device_sizes
            ? perm.group_sizes
            : Tensor::FromVector(std::vector<double>(perm.host_group_sizes.begin(), perm.host_group_sizes.end()),
                                 Shape{e}, DType::kInt64);
    return out;
}

namespace {

/// The experts' loads on the host (one read-back when they are on a device).
std::vector<double> HostLoads(const Tensor &expert_load) {
    SHARDLINE_CHECK(expert_load.defined(), "MoEStats", "expert_load is undefined (no forward filled these statistics)");
    return expert_load.ToDoubleVector();
}

} // namespace

std::int64_t MoEStats::load_min() const {
    const std::vector<double> loads = HostLoads(expert_load);
    return loads.empty() ? 0 : static_cast<std::int64_t>(*std::min_element(loads.begin(), loads.end()));
}

std::int64_t MoEStats::load_max() const {
    const std::vector<double> loads = HostLoads(expert_load);
    return loads.empty() ? 0 : static_cast<std::int64_t>(*std::max_element(loads.begin(), loads.end()));
}

} // namespace shardline::nn
