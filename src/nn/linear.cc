// Linear, ColumnParallelLinear, RowParallelLinear. The modules only place their parameters and name the output
// layout they promise (Megatron's contract); autograd::Linear and the linear rule do the rest.

#include <shardline/nn/linear.h>

#include <cmath>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>

namespace shardline::nn {
namespace {

/// Validates the tp group and returns the tp mesh dim.
int TpDim(const TensorParallel &tp, const char *layer, const std::string &name) {
    SHARDLINE_CHECK(tp.mesh != nullptr, layer, "'{}' needs a mesh (TensorParallel.mesh is null)", name);
    return tp.mesh->dim_index(tp.tp_dim);
}

void CheckFeatures(const char *layer, const std::string &name, std::int64_t in, std::int64_t out) {
    SHARDLINE_CHECK_AS(ShapeError, in > 0 && out > 0, layer,
                       "'{}': in_features ({}) and out_features ({}) must be positive", name, in, out);
}

void CheckDivisible(const char *layer, const std::string &name, const char *dim, std::int64_t size, std::int64_t tp) {
    SHARDLINE_CHECK_AS(ShapeError, size % tp == 0, layer, "'{}': {} ({}) must be divisible by tp ({})", name, dim,
                       size, tp);
}

/// torch.nn.Linear's default: U(-1/√in, 1/√in) for weight and bias.
RandomSpec Uniform(const std::string &name, std::int64_t in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    return {.seed = 0, .name = name, .distribution = RandomDistribution::kUniform, .a = -bound, .b = bound};
}

/// Layout of x [..., in] as given, with the last dim (features) replaced by `last`, tp removed elsewhere, and, with
/// sequence parallelism, tp added as the minor shard of dim 0.
spmd::Layout OutputLayout(const Variable &x, int tp_dim, std::vector<int> last, bool sequence_parallel) {
    std::vector<std::vector<int>> dims = x.value().layout().DimsMeshDims();
    for (auto &d : dims) {
        std::erase(d, tp_dim);
    }
    dims.back() = std::move(last);
    if (sequence_parallel) {
        dims.front().push_back(tp_dim);
    }
    return spmd::Layout(std::move(dims));
}

} // namespace

Linear::Linear(const LinearOptions &options) : options_(options) {
    CheckFeatures("Linear", options.name, options.in_features, options.out_features);
    const std::string wname = options.name + ".weight";
    weight = RegisterParameter("weight", MakeParameter({options.out_features, options.in_features}, {}, nullptr,
                                                       options.param, Uniform(wname, options.in_features)));
    if (options.bias) {
        const std::string bname = options.name + ".bias";
        bias = RegisterParameter(
            "bias", MakeParameter({options.out_features}, {}, nullptr, options.param, Uniform(bname, options.in_features)));
    }
}

Variable Linear::Forward(const Variable &x) const { return autograd::Linear(x, weight, bias); }

ColumnParallelLinear::ColumnParallelLinear(const ColumnParallelLinearOptions &options, const TensorParallel &tp)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "ColumnParallelLinear";
    tp_dim_ = TpDim(tp, kLayer, options.name);
    CheckFeatures(kLayer, options.name, options.in_features, options.out_features);
    const std::int64_t size = tp.mesh->shape()[static_cast<std::size_t>(tp_dim_)];
    CheckDivisible(kLayer, options.name, "out_features", options.out_features, size);
    SHARDLINE_CHECK(!(options.gather_output && options.sequence_parallel), kLayer,
                    "'{}': gather_output and sequence_parallel exclude each other (Megatron), got both", options.name);
    const std::string wname = options.name + ".weight";
    weight = RegisterParameter("weight", MakeParameter({options.out_features, options.in_features},
                                                       spmd::Layout(std::vector<std::vector<int>>{{tp_dim_}, {}}), tp.mesh, options.param,
                                                       Uniform(wname, options.in_features)));
    if (options.bias) {
        const std::string bname = options.name + ".bias";
        bias = RegisterParameter("bias", MakeParameter({options.out_features}, spmd::Layout(std::vector<std::vector<int>>{{tp_dim_}}), tp.mesh,
                                                       options.param, Uniform(bname, options.in_features)));
    }
}

LinearOutput ColumnParallelLinear::Forward(const Variable &x) const {
    SHARDLINE_CHECK_AS(ShapeError, x.defined() && !x.shape().empty() && x.shape().back() == options_.in_features,
                       "ColumnParallelLinear", "'{}': the input must be [..., {}], got {}", options_.name,
                       options_.in_features, x.defined() ? ShapeToString(x.shape()) : std::string("undefined"));
    autograd::LinearOptions lo{.skip_bias = options_.skip_bias_add};
    if (options_.gather_output) {
        lo.output_layout = OutputLayout(x, tp_dim_, {}, false);
    }
    LinearOutput out;
    out.output = autograd::Linear(x, weight, bias, lo);
    if (options_.skip_bias_add) {
        out.bias = bias;
    }
    return out;
}

RowParallelLinear::RowParallelLinear(const RowParallelLinearOptions &options, const TensorParallel &tp)
    : options_(options), tp_(tp) {
    constexpr const char *kLayer = "RowParallelLinear";
    tp_dim_ = TpDim(tp, kLayer, options.name);
    CheckFeatures(kLayer, options.name, options.in_features, options.out_features);
    const std::int64_t size = tp.mesh->shape()[static_cast<std::size_t>(tp_dim_)];
    CheckDivisible(kLayer, options.name, "in_features", options.in_features, size);
    // As in Megatron (and the functional layer): a sequence-parallel row layer follows a column layer whose output is
    // already sharded on the features; a replicated input would be sharded here only to be reduce-scattered.
    SHARDLINE_CHECK(!options.sequence_parallel || options.input_is_parallel, kLayer,
                    "'{}': sequence_parallel needs input_is_parallel (the input of a sequence-parallel row layer is "
                    "the tp-sharded output of a column layer), got input_is_parallel=false",
                    options.name);
    const std::string wname = options.name + ".weight";
    weight = RegisterParameter("weight", MakeParameter({options.out_features, options.in_features},
                                                       spmd::Layout(std::vector<std::vector<int>>{{}, {tp_dim_}}), tp.mesh, options.param,
                                                       Uniform(wname, options.in_features)));
    if (options.bias) {
        const std::string bname = options.name + ".bias";
        bias = RegisterParameter("bias", MakeParameter({options.out_features}, spmd::Layout(std::vector<std::vector<int>>{{}}), tp.mesh,
                                                       options.param, Uniform(bname, options.in_features)));
    }
}

LinearOutput RowParallelLinear::Forward(const Variable &x) const {
    SHARDLINE_CHECK_AS(ShapeError, x.defined() && !x.shape().empty() && x.shape().back() == options_.in_features,
                       "RowParallelLinear", "'{}': the input must be [..., {}], got {}", options_.name,
                       options_.in_features, x.defined() ? ShapeToString(x.shape()) : std::string("undefined"));
    const bool tp_sharded = tp_.mesh->shape()[static_cast<std::size_t>(tp_dim_)] > 1;
    if (options_.input_is_parallel && tp_sharded) {
        SHARDLINE_CHECK(x.value().layout().MeshDims(x.value().layout().TensorRank() - 1) == std::vector<int>{tp_dim_},
                        "RowParallelLinear",
                        "'{}': input_is_parallel expects the input sharded on its last dim over tp (mesh dim {}), "
                        "got layout {}",
                        options_.name, tp_dim_, x.value().layout().ToString());
    }
    // The GEMM gives a Partial(sum) over tp; the promised layout reduces it (all-reduce, or reduce-scatter on the
    // sequence dim), and the bias is added once, after that.
    autograd::LinearOptions lo{.output_layout = OutputLayout(x, tp_dim_, {}, options_.sequence_parallel),
                               .skip_bias = options_.skip_bias_add};
    LinearOutput out;
    out.output = autograd::Linear(x, weight, bias, lo);
    if (options_.skip_bias_add) {
        out.bias = bias;
    }
    return out;
}

} // namespace shardline::nn
