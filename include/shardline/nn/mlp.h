#pragma once

#include <memory>

#include <shardline/kernels/elementwise.h>
#include <shardline/nn/linear.h>

namespace shardline::nn {

struct ParallelMLPOptions {
    std::int64_t hidden = 0;
    std::int64_t ffn_hidden =
        0; ///< split over tp as torch.chunk: uneven allowed (22 over tp 3: 8, 8, 6), no rank empty
    bool bias = true;
    bool sequence_parallel = false;
    kernels::GeluApproximation approximation = kernels::GeluApproximation::kTanh;
    /// The tanh GELU in fc1's GEMM epilogue and its gradient (with fc1's bias grad) in fc2's dgrad epilogue, one
    /// autograd node for the block (autograd::ParallelMLP; Megatron's bias_gelu_fusion). false, or the erf GELU: fc1,
    /// a separate GELU node, fc2.
    bool gelu_fusion = true;
    /// fc1's and fc2's overlap_grad_comm (functional/parallel_linear.h): the backward's dx collective beside the
    /// parameter grads. Bitwise the same results and collectives either way; off only to measure the difference.
    bool overlap_grad_comm = true;
    /// fc1's and fc2's comm_chunks (functional/parallel_linear.h): C > 1 runs every collective of the block in C chunks
    /// of rows, each overlapping the GEMM of another chunk (forward: fc1's x all-gather under sequence parallelism,
    /// fc2's all-reduce / reduce-scatter; backward: fc2's dy all-gather, fc1's dx all-reduce / reduce-scatter). The
    /// same results (bitwise for integer-valued operands), C times the collectives with the same bytes. 0 or 1: off.
    int comm_chunks = 0;
};

/// Megatron's ParallelMLP: ColumnParallelLinear(hidden → ffn) → GELU → RowParallelLinear(ffn → hidden). Without
/// sequence parallelism: forward one all-reduce, backward one all-reduce of dX (if the input needs a grad). With it:
/// all-gather + reduce-scatter forward, all-gather + reduce-scatter backward. With the tanh GELU (and gelu_fusion) the
/// block is one autograd::ParallelMLP: the GELU runs in fc1's GEMM epilogue, its gradient and fc1's bias grad in fc2's
/// dgrad GEMM, each fused where that measures faster on CUDA; fc1 and fc2 keep the parameters either way.
class ParallelMLP : public Module {
public:
    /// Parameters "<param.name or 'mlp'>.fc1.weight", ... .
    ParallelMLP(const ParallelMLPOptions& options, const TensorParallelGroup& tp, const ParameterOptions& param = {});
    Variable Forward(const Variable& x) const;
    /// x + Forward(x): a residual block. With the fused tanh GELU (autograd::ParallelMLPWithResidual) the add rides in
    /// the GEMMs — fc2's forward adds x (C, beta = 1) and fc1's dgrad adds x's pass-through gradient — with no Add
    /// node; otherwise Add(x, Forward(x)).
    Variable ResidualForward(const Variable& x) const;
    std::shared_ptr<ColumnParallelLinear> fc1;
    std::shared_ptr<RowParallelLinear> fc2;

private:
    ParallelMLPOptions options_;
    TensorParallelGroup tp_;
};

} // namespace shardline::nn
