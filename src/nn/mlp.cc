#include <shardline/nn/mlp.h>

#include <shardline/autograd/functions.h>

namespace shardline::nn {

ParallelMLP::ParallelMLP(const ParallelMLPOptions &options, const TensorParallel &tp) : options_(options) {
    fc1 = RegisterModule("fc1", std::make_shared<ColumnParallelLinear>(
                                    ColumnParallelLinearOptions{.in_features = options.hidden,
                                                                .out_features = options.ffn_hidden,
                                                                .bias = options.bias,
                                                                .gather_output = false,
                                                                .sequence_parallel = options.sequence_parallel,
                                                                .skip_bias_add = false,
                                                                .param = options.param,
                                                                .name = options.name + ".fc1"},
                                    tp));
    fc2 = RegisterModule("fc2", std::make_shared<RowParallelLinear>(
                                    RowParallelLinearOptions{.in_features = options.ffn_hidden,
                                                             .out_features = options.hidden,
                                                             .bias = options.bias,
                                                             .input_is_parallel = true,
                                                             .sequence_parallel = options.sequence_parallel,
                                                             .skip_bias_add = false,
                                                             .param = options.param,
                                                             .name = options.name + ".fc2"},
                                    tp));
}

Variable ParallelMLP::Forward(const Variable &x) const {
    Variable h = fc1->Forward(x).output;
    h = autograd::Gelu(h, options_.approximation);
    return fc2->Forward(h).output;
}

} // namespace shardline::nn
