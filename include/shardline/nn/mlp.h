#pragma once

#include <memory>

#include <shardline/kernels/elementwise.h>
#include <shardline/nn/linear.h>

namespace shardline::nn {

struct ParallelMLPOptions {
    std::int64_t hidden = 0;
    std::int64_t ffn_hidden = 0; ///< must divide by tp
    bool bias = true;
    bool sequence_parallel = false;
    kernels::GeluApproximation approximation = kernels::GeluApproximation::kTanh;
};

/// Megatron's ParallelMLP: ColumnParallelLinear(hidden → ffn) → GELU → RowParallelLinear(ffn → hidden). Without
/// sequence parallelism: forward one all-reduce, backward one all-reduce of dX (if the input needs a grad). With it:
/// all-gather + reduce-scatter forward, all-gather + reduce-scatter backward.
class ParallelMLP : public Module {
public:
    /// Parameters "<param.name or 'mlp'>.fc1.weight", ... .
    ParallelMLP(const ParallelMLPOptions& options, const TensorParallelGroup& tp, const ParameterOptions& param = {});
    Variable Forward(const Variable& x) const;
    std::shared_ptr<ColumnParallelLinear> fc1;
    std::shared_ptr<RowParallelLinear> fc2;

private:
    ParallelMLPOptions options_;
};

} // namespace shardline::nn
