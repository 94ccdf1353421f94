#include <shardline/autograd/functions.h>
#include <shardline/nn/mlp.h>

namespace shardline::nn {

ParallelMLP::ParallelMLP(const ParallelMLPOptions &options, const TensorParallelGroup &tp,
                         const ParameterOptions &param)
    : options_(options) {
    ParameterOptions p = param;
    const std::string name = p.name.empty() ? "mlp" : p.name;
    p.name = name + ".fc1";
    fc1 = RegisterModule("fc1", std::make_shared<ColumnParallelLinear>(
                                    ColumnParallelLinearOptions{.in_features = options.hidden,
                                                                .out_features = options.ffn_hidden,
                                                                .bias = options.bias,
                                                                .gather_output = false,
                                                                .sequence_parallel = options.sequence_parallel},
                                    tp, p));
    p.name = name + ".fc2";
    fc2 = RegisterModule("fc2", std::make_shared<RowParallelLinear>(
                                    RowParallelLinearOptions{.in_features = options.ffn_hidden,
                                                             .out_features = options.hidden,
                                                             .bias = options.bias,
                                                             .input_is_parallel = true,
                                                             .sequence_parallel = options.sequence_parallel},
                                    tp, p));
}

Variable ParallelMLP::Forward(const Variable &x) const {
    Variable h = fc1->Forward(x).output;
    h = autograd::Gelu(h, options_.approximation);
    return fc2->Forward(h).output;
}

} // namespace shardline::nn
