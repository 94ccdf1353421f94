#include <string>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/nn/mlp.h>

namespace shardline::nn {

ParallelMLP::ParallelMLP(const ParallelMLPOptions &options, const TensorParallelGroup &tp,
                         const ParameterOptions &param)
    : options_(options), tp_(tp) {
    ParameterOptions p = param;
    const std::string name = p.name.empty() ? "mlp" : p.name;
    p.name = name + ".fc1";
    fc1 = RegisterModule("fc1", std::make_shared<ColumnParallelLinear>(
                                    ColumnParallelLinearOptions{.in_features = options.hidden,
                                                                .out_features = options.ffn_hidden,
                                                                .bias = options.bias,
                                                                .gather_output = false,
                                                                .sequence_parallel = options.sequence_parallel,
                                                                .overlap_grad_comm = options.overlap_grad_comm,
                                                                .comm_chunks = options.comm_chunks},
                                    tp, p));
    p.name = name + ".fc2";
    fc2 = RegisterModule("fc2", std::make_shared<RowParallelLinear>(
                                    RowParallelLinearOptions{.in_features = options.ffn_hidden,
                                                             .out_features = options.hidden,
                                                             .bias = options.bias,
                                                             .input_is_parallel = true,
                                                             .sequence_parallel = options.sequence_parallel,
                                                             .overlap_grad_comm = options.overlap_grad_comm,
                                                             .comm_chunks = options.comm_chunks},
                                    tp, p));
}

namespace {

void CheckInput(const Variable &x, std::int64_t hidden) {
    SHARDLINE_CHECK_AS(ShapeError, x.defined() && !x.shape().empty() && x.shape().back() == hidden, "ParallelMLP",
                       "the input must be [..., hidden] = [..., {}], got {}", hidden,
                       x.defined() ? ShapeToString(x.shape()) : std::string("undefined"));
}

} // namespace

Variable ParallelMLP::Forward(const Variable &x) const {
    if (options_.gelu_fusion && options_.approximation == kernels::GeluApproximation::kTanh) {
        CheckInput(x, options_.hidden);
        return autograd::ParallelMLP(x, fc1->weight, fc1->bias, fc2->weight, fc2->bias, fc1->options(), fc2->options(),
                                     tp_);
    }
    Variable h = fc1->Forward(x).output;
    h = autograd::Gelu(h, options_.approximation);
    return fc2->Forward(h).output;
}

Variable ParallelMLP::ResidualForward(const Variable &x) const {
    if (options_.gelu_fusion && options_.approximation == kernels::GeluApproximation::kTanh) {
        CheckInput(x, options_.hidden);
        return autograd::ParallelMLPWithResidual(x, fc1->weight, fc1->bias, fc2->weight, fc2->bias, fc1->options(),
                                                 fc2->options(), tp_);
    }
    return autograd::Add(x, Forward(x));
}

} // namespace shardline::nn
