// Linear, ColumnParallelLinear, RowParallelLinear. The modules own their parameters' shards and Megatron's contract
// (which layout they accept and promise); the computation is autograd::Linear (local) and autograd::Column/
// RowParallelLinear, which run the functional core.

#include <cmath>
#include <utility>

#include <fmt/format.h>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/nn/linear.h>

namespace shardline::nn {
namespace {

/// The parameter options with the module's name filled in (empty: `default_name`).
ParameterOptions Named(ParameterOptions param, const char *default_name) {
    if (param.name.empty()) {
        param.name = default_name;
    }
    return param;
}

void CheckFeatures(const char *layer, const std::string &name, std::int64_t in, std::int64_t out) {
    SHARDLINE_CHECK_AS(ShapeError, in > 0 && out > 0, layer,
                       "'{}': in_features ({}) and out_features ({}) must be positive", name, in, out);
}

/// A parallel layer's sizes: positive features, and `dim` (the sharded one: out_features or in_features) split over
/// the tp group as torch.chunk with no rank left empty (uneven is fine: 22 over tp 3 gives 8, 8, 6); returns tp.
std::int64_t CheckParallelSizes(const char *layer, const std::string &name, std::int64_t in, std::int64_t out,
                                const TensorParallelGroup &tp, const char *dim, std::int64_t size) {
    CheckFeatures(layer, name, in, out);
    SHARDLINE_CHECK(tp.mesh != nullptr, layer, "'{}' needs a mesh (TensorParallelGroup.mesh is null)", name);
    const std::int64_t tp_size = tp.size();
    functional::CheckShardsNotEmpty(layer, fmt::format("'{}': {}", name, dim), size, tp_size);
    return tp_size;
}

void CheckInput(const char *layer, const std::string &name, const Variable &x, std::int64_t in_features) {
    SHARDLINE_CHECK_AS(ShapeError, x.defined() && !x.shape().empty() && x.shape().back() == in_features, layer,
                       "'{}': the input must be [..., {}], got {}", name, in_features,
                       x.defined() ? ShapeToString(x.shape()) : std::string("undefined"));
}

/// A parallel layer's result: the output, and the bias when skip_bias_add leaves adding it to the caller.
template <class Options> LinearOutput WithSkippedBias(Variable output, const Options &o, const Variable &bias) {
    LinearOutput out;
    out.output = std::move(output);
    if (o.bias && o.skip_bias_add) {
        out.bias = bias;
    }
    return out;
}

/// torch.nn.Linear's default: U(-1/√in, 1/√in) for weight and bias.
RandomSpec Uniform(const std::string &name, std::int64_t in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    return {.seed = 0, .name = name, .distribution = RandomDistribution::kUniform, .a = -bound, .b = bound};
}

/// The weight [out, in] and, with `with_bias`, the bias [out] of a Linear layer on `mesh` (null: local) in the given
/// layouts, initialised as torch.nn.Linear; the bias is undefined without one.
/// experts > 0: E experts' parameters in one tensor each, weight [E, out, in] and bias [E, out] (the layouts then
/// have the experts dim in front). Expert e's values are those of global indices e·out·in + … of the one stream, so
/// they depend neither on tp nor on how experts are placed.
std::pair<Variable, Variable> MakeLinearParameters(std::int64_t in, std::int64_t out, bool with_bias,
                                                   comm::DeviceMesh *mesh, const spmd::Layout &weight_layout,
                                                   const spmd::Layout &bias_layout, const ParameterOptions &p,
                                                   std::int64_t experts = 0) {
    Shape weight_shape{out, in};
    Shape bias_shape{out};
    if (experts > 0) {
        weight_shape.insert(weight_shape.begin(), experts);
        bias_shape.insert(bias_shape.begin(), experts);
    }
    Variable weight = MakeParameter(weight_shape, weight_layout, mesh, p, Uniform(p.name + ".weight", in));
    Variable bias;
    if (with_bias) {
        bias = MakeParameter(bias_shape, bias_layout, mesh, p, Uniform(p.name + ".bias", in));
    }
    return {std::move(weight), std::move(bias)};
}

/// A grouped layer's input: [tokens, in_features] with rows grouped by expert, and int64 [experts] group sizes.
void CheckGroupedInput(const char *layer, const std::string &name, const Variable &x, std::int64_t in_features,
                       const Tensor &group_sizes, std::int64_t experts) {
    SHARDLINE_CHECK_AS(ShapeError, x.defined() && x.shape().size() == 2 && x.shape().back() == in_features, layer,
                       "'{}': the input must be [tokens, {}] (rows grouped by expert), got {}", name, in_features,
                       x.defined() ? ShapeToString(x.shape()) : std::string("undefined"));
    SHARDLINE_CHECK_AS(ShapeError,
                       group_sizes.defined() && group_sizes.dtype() == DType::kInt64 &&
                           group_sizes.shape() == Shape{experts},
                       layer, "'{}': group_sizes must be int64 [num_experts] = [{}], got {}", name, experts,
                       group_sizes.defined() ? group_sizes.ToString() : std::string("undefined"));
}

} // namespace

Linear::Linear(const LinearOptions &options, const ParameterOptions &param) : options_(options) {
    const ParameterOptions p = Named(param, "linear");
    CheckFeatures("Linear", p.name, options.in_features, options.out_features);
    auto [w, b] = MakeLinearParameters(options.in_features, options.out_features, options.bias, nullptr, {}, {}, p);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

Variable Linear::Forward(const Variable &x) const { return autograd::Linear(x, weight, bias); }

ColumnParallelLinear::ColumnParallelLinear(const ColumnParallelLinearOptions &options, const TensorParallelGroup &tp,
                                           const ParameterOptions &param)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "ColumnParallelLinear";
    const ParameterOptions p = Named(param, "column");
    name_ = p.name;
    CheckParallelSizes(kLayer, name_, options.in_features, options.out_features, tp, "out_features",
                       options.out_features);
    SHARDLINE_CHECK(!(options.gather_output && options.sequence_parallel), kLayer,
                    "'{}': gather_output and sequence_parallel exclude each other (Megatron), got both", name_);
    const int t = tp.tp_dim;
    auto [w, b] = MakeLinearParameters(options.in_features, options.out_features, options.bias, tp.mesh,
                                       spmd::Layout(std::vector<std::vector<int>>{{t}, {}}),
                                       spmd::Layout(std::vector<std::vector<int>>{{t}}), p);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

LinearOutput ColumnParallelLinear::Forward(const Variable &x) const {
    CheckInput("ColumnParallelLinear", name_, x, options_.in_features);
    return WithSkippedBias(autograd::ColumnParallelLinear(x, weight, bias, options_, tp_), options_, bias);
}

RowParallelLinear::RowParallelLinear(const RowParallelLinearOptions &options, const TensorParallelGroup &tp,
                                     const ParameterOptions &param)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "RowParallelLinear";
    const ParameterOptions p = Named(param, "row");
    name_ = p.name;
    CheckParallelSizes(kLayer, name_, options.in_features, options.out_features, tp, "in_features",
                       options.in_features);
    // As in Megatron (and the functional layer): a sequence-parallel row layer follows a column layer whose output is
    // already sharded on the features; a replicated input would be sharded here only to be reduce-scattered.
    SHARDLINE_CHECK(!options.sequence_parallel || options.input_is_parallel, kLayer,
                    "'{}': sequence_parallel needs input_is_parallel (the input of a sequence-parallel row layer is "
                    "the tp-sharded output of a column layer), got input_is_parallel=false",
                    name_);
    const int t = tp.tp_dim;
    auto [w, b] =
        MakeLinearParameters(options.in_features, options.out_features, options.bias, tp.mesh,
                             spmd::Layout(std::vector<std::vector<int>>{{}, {t}}), spmd::Layout::Replicated(1), p);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

LinearOutput RowParallelLinear::Forward(const Variable &x) const {
    CheckInput("RowParallelLinear", name_, x, options_.in_features);
    if (options_.input_is_parallel && tp_.size() > 1) {
        const spmd::Layout &layout = x.value().layout();
        SHARDLINE_CHECK(layout.MeshDims(layout.TensorRank() - 1) == std::vector<int>{tp_.tp_dim}, "RowParallelLinear",
                        "'{}': input_is_parallel expects the input sharded on its last dim over tp (mesh dim {}), "
                        "got layout {}",
                        name_, tp_.tp_dim, layout.ToString());
    }
    return WithSkippedBias(autograd::RowParallelLinear(x, weight, bias, options_, tp_), options_, bias);
}

// ---- Mixture-of-experts --------------------------------------------------------------------------------------------

GroupedLinear::GroupedLinear(const GroupedLinearOptions &options, const ParameterOptions &param) : options_(options) {
    const ParameterOptions p = Named(param, "grouped");
    name_ = p.name;
    CheckFeatures("GroupedLinear", p.name, options.in_features, options.out_features);
    SHARDLINE_CHECK_AS(ShapeError, options.num_experts > 0, "GroupedLinear", "'{}': num_experts must be > 0, got {}",
                       name_, options.num_experts);
    auto [w, b] = MakeLinearParameters(options.in_features, options.out_features, options.bias, nullptr, {}, {}, p,
                                       options.num_experts);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

Variable GroupedLinear::Forward(const Variable &x, const Tensor &group_sizes) const {
    CheckGroupedInput("GroupedLinear", name_, x, options_.in_features, group_sizes, options_.num_experts);
    return autograd::GroupedLinear(x, weight, bias, group_sizes);
}

ColumnParallelGroupedLinear::ColumnParallelGroupedLinear(const ColumnParallelLinearOptions &options,
                                                         const TensorParallelGroup &tp, const ParameterOptions &param)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "ColumnParallelGroupedLinear";
    const ParameterOptions p = Named(param, "column_grouped");
    name_ = p.name;
    CheckParallelSizes(kLayer, name_, options.in_features, options.out_features, tp, "out_features",
                       options.out_features);
    SHARDLINE_CHECK_AS(ShapeError, options.num_experts > 0 && !options.sequence_parallel, kLayer,
                       "'{}': needs num_experts > 0 (got {}) and no sequence_parallel", name_, options.num_experts);
    const int t = tp.tp_dim;
    auto [w, b] = MakeLinearParameters(options.in_features, options.out_features, options.bias, tp.mesh,
                                       spmd::Layout(std::vector<std::vector<int>>{{}, {t}, {}}),
                                       spmd::Layout(std::vector<std::vector<int>>{{}, {t}}), p, options.num_experts);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

LinearOutput ColumnParallelGroupedLinear::Forward(const Variable &x, const Tensor &group_sizes) const {
    CheckGroupedInput("ColumnParallelGroupedLinear", name_, x, options_.in_features, group_sizes, options_.num_experts);
    return WithSkippedBias(autograd::ColumnParallelGroupedLinear(x, weight, bias, group_sizes, options_, tp_), options_,
                           bias);
}

RowParallelGroupedLinear::RowParallelGroupedLinear(const RowParallelLinearOptions &options,
                                                   const TensorParallelGroup &tp, const ParameterOptions &param)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "RowParallelGroupedLinear";
    const ParameterOptions p = Named(param, "row_grouped");
    name_ = p.name;
    CheckParallelSizes(kLayer, name_, options.in_features, options.out_features, tp, "in_features",
                       options.in_features);
    SHARDLINE_CHECK_AS(ShapeError, options.num_experts > 0 && !options.sequence_parallel, kLayer,
                       "'{}': needs num_experts > 0 (got {}) and no sequence_parallel", name_, options.num_experts);
    const int t = tp.tp_dim;
    auto [w, b] = MakeLinearParameters(options.in_features, options.out_features, options.bias, tp.mesh,
                                       spmd::Layout(std::vector<std::vector<int>>{{}, {}, {t}}),
                                       spmd::Layout::Replicated(2), p, options.num_experts);
    weight = RegisterParameter("weight", std::move(w));
    bias = RegisterOptionalParameter("bias", std::move(b));
}

LinearOutput RowParallelGroupedLinear::Forward(const Variable &x, const Tensor &group_sizes) const {
    CheckGroupedInput("RowParallelGroupedLinear", name_, x, options_.in_features, group_sizes, options_.num_experts);
    return WithSkippedBias(autograd::RowParallelGroupedLinear(x, weight, bias, group_sizes, options_, tp_), options_,
                           bias);
}

} // namespace shardline::nn
