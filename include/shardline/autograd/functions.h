#pragma once

// Differentiable ops on Variables. Each is a Function over the dist op of the same name (dist/ops.h) — or, for the
// parallel Linear layers, over the functional core (functional/parallel_linear.h): the SPMD rules decide the layouts
// and the communication; the Function decides which backward kernels run (needs_input_grad) and saves only what they
// need.

#include <optional>
#include <vector>

#include <shardline/autograd/function.h>
#include <shardline/dist/ops.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>

namespace shardline::autograd {

/// y = x·weightᵀ + bias on local (undistributed) Variables. Saves x only if the weight needs a grad and the weight
/// only if x does; backward computes exactly the gradients needed (kernels::LinearBackward, which fuses the bias grad
/// into the weight-grad GEMM where that measures faster). An undefined bias: none.
Variable Linear(const Variable& x, const Variable& weight, const Variable& bias = {});

/// Megatron's column-parallel y = x·weightᵀ + bias on the tensor-parallel group `tp`, through the functional core
/// (functional::ColumnParallelLinearForward / Backward: the linear rule's plans, the split kernels, the collectives).
/// weight [out, in] is sharded on dim 0 over tp (bias [out] too). x [..., in] is on tp's mesh; it is first moved to
/// the layer's input layout when it is not in it (replicated over tp, or with sequence_parallel sharded on dim 0 over
/// tp as the minor shard; other mesh dims, e.g. dp, may shard its leading dims). y [..., out] keeps x's leading-dim
/// layout, sharded on its last dim over tp (replicated with gather_output). The bias is used when
/// options.adds_bias(). Backward computes only the gradients needed; dweight and dbias are Partial over the mesh dims
/// that shard x's rows (a GradSync or the engine reduces them). out need not divide by tp: the shards are torch.chunk
/// parts (uneven; ShapeError, before any collective, when a rank would get none).
Variable ColumnParallelLinear(const Variable& x, const Variable& weight, const Variable& bias,
                              const functional::ColumnParallelLinearOptions& options,
                              const functional::TensorParallelGroup& tp);
/// Megatron's row-parallel y = Σ_tp x_r·weight_rᵀ + bias (the bias added once, after the reduction). weight [out, in]
/// is sharded on dim 1 over tp, bias [out] replicated. x [..., in] is moved to the layer's input layout when it is not
/// in it (sharded on its last dim over tp with input_is_parallel, else replicated over tp). y [..., out] is replicated
/// over tp, or with sequence_parallel sharded on dim 0 over tp. in need not divide by tp (torch.chunk parts, none
/// empty), as for ColumnParallelLinear.
Variable RowParallelLinear(const Variable& x, const Variable& weight, const Variable& bias,
                           const functional::RowParallelLinearOptions& options,
                           const functional::TensorParallelGroup& tp);

/// Megatron's ParallelMLP (TransformerEngine's LayerNormMLP without the norm) as one Function:
/// y = gelu_tanh(x·W1ᵀ + b1)·W2ᵀ + b2 with fc1 column-parallel — bias and GELU in its GEMM epilogue — and fc2
/// row-parallel on fc1's split output (input_is_parallel), whose dgrad GEMM applies GELU's gradient and yields fc1's
/// bias grad (functional::ColumnParallelLinearForward with `activation`, RowParallelLinearBackward with
/// `input_activation`). Layouts, collectives, parameter and main-grad handling as ColumnParallelLinear →
/// RowParallelLinear; fc1 may not gather its output or skip its bias add, and fc1 and fc2 agree on sequence_parallel.
/// The graph saves only what the requested gradients need — x (or the gathered x), the pre-activation, the activation
/// h for fc2's dweight, and the weights — and has no separate GELU node.
Variable ParallelMLP(const Variable& x, const Variable& fc1_weight, const Variable& fc1_bias,
                     const Variable& fc2_weight, const Variable& fc2_bias,
                     const functional::ColumnParallelLinearOptions& fc1,
                     const functional::RowParallelLinearOptions& fc2, const functional::TensorParallelGroup& tp);
/// x + ParallelMLP(x) as the same one Function, the residual add fused into the GEMMs: forward, x is fc2's residual
/// (y = h·W2ᵀ + b2 + x, the GEMM's C with beta = 1); backward, x's gradient dy + (fc1's dgrad) is one dgrad GEMM with
/// C = dy. At tp > 1 the adds run after fc2's reduction and fc1's dx collective instead (functional/parallel_linear.h).
/// Needs fc2.out_features == fc1.in_features and the output in x's layout (as ParallelMLP gives it). The same values
/// as Add(x, ParallelMLP(x)) up to the order of the bias and residual roundings (bit for bit on the CPU), with no
/// Add node.
Variable ParallelMLPWithResidual(const Variable& x, const Variable& fc1_weight, const Variable& fc1_bias,
                                 const Variable& fc2_weight, const Variable& fc2_bias,
                                 const functional::ColumnParallelLinearOptions& fc1,
                                 const functional::RowParallelLinearOptions& fc2,
                                 const functional::TensorParallelGroup& tp);

/// Mixture-of-experts experts on local Variables: y_e = x_e·W_eᵀ + b_e for every expert e, where x [T, in] has its
/// rows grouped by expert (group e owns group_sizes[e] consecutive rows; group_sizes int64 [E] on the host or x's
/// device), weight [E, out, in], bias [E, out] (undefined: none). Strided inputs are copied contiguous for the
/// kernels. Backward runs only the kernels of the gradients needed (kernels::GroupedLinearBackward*): frozen experts
/// skip dW, an x without grad skips dx; saves x only for dW and W only for dx.
Variable GroupedLinear(const Variable& x, const Variable& weight, const Variable& bias, const Tensor& group_sizes);
/// GroupedLinear(Gelu(pre_activation), ...) (tanh) as one Function, without a GELU node: the GELU kernel forward, and
/// backward the grouped dgrad's dGELU epilogue gives pre_activation's gradient (kernels::GroupedLinearBackward's
/// input_activation). Saves h = gelu(pre_activation) only for W's grad and pre_activation only for its own. The local
/// form of GeluRowParallelGroupedLinear.
Variable GeluGroupedLinear(const Variable& pre_activation, const Variable& weight, const Variable& bias,
                           const Tensor& group_sizes);
/// ColumnParallelLinear over E experts (expert tensor parallelism): weight [E, out, in] sharded on out (dim 1) over
/// tp, bias [E, out] too; x [T, in] replicated over tp with its rows grouped by expert. options.num_experts = E;
/// no sequence_parallel. Expert parallelism: when one mesh dim other than tp (ep, of size P) shards the weight's and
/// the bias's dim 0, they are [E·P, ...] and this rank computes its E experts (x holds their rows); the parameter
/// gradients keep that sharding (Partial, as always, over the mesh dims that shard x's rows).
Variable ColumnParallelGroupedLinear(const Variable& x, const Variable& weight, const Variable& bias,
                                     const Tensor& group_sizes, const functional::ColumnParallelLinearOptions& options,
                                     const functional::TensorParallelGroup& tp);
/// RowParallelLinear over E experts: weight [E, out, in] sharded on in (dim 2) over tp, bias [E, out] replicated and
/// added per expert once, after the all-reduce. options.num_experts = E; no sequence_parallel. Expert parallelism as
/// ColumnParallelGroupedLinear's (the bias [E·P, out] sharded on dim 0 over ep too).
Variable RowParallelGroupedLinear(const Variable& x, const Variable& weight, const Variable& bias,
                                  const Tensor& group_sizes, const functional::RowParallelLinearOptions& options,
                                  const functional::TensorParallelGroup& tp);
/// RowParallelGroupedLinear(Gelu(pre_activation)) (tanh approximation) as one Function, without a GELU node: an expert
/// MLP's fc1 → GELU → fc2 with fc1 a ColumnParallelGroupedLinear whose output is pre_activation. Forward: the GELU
/// kernel, then the row grouped layer on h = gelu_tanh(pre_activation). Backward: the grouped dgrad applies GELU's
/// gradient in its epilogue (RowParallelLinearBackwardArgs::input_activation; the CUTLASS kernel's EVT on CUDA), so
/// pre_activation's gradient comes out of one GEMM and fc1's backward takes it as its dy; no GeluBackward kernel.
/// Saves h only for the weight's gradient and pre_activation only for its own. options.input_is_parallel. The same
/// values as the unfused pair (bit for bit on the CPU; on CUDA within one rounding of the gradient's dtype: the fused
/// epilogue multiplies the fp32 accumulator instead of the rounded dgrad).
Variable GeluRowParallelGroupedLinear(const Variable& pre_activation, const Variable& weight, const Variable& bias,
                                      const Tensor& group_sizes, const functional::RowParallelLinearOptions& options,
                                      const functional::TensorParallelGroup& tp);
Variable Gelu(const Variable& x, kernels::GeluApproximation approximation = kernels::GeluApproximation::kTanh);
/// a + alpha·b (same shape).
Variable Add(const Variable& a, const Variable& b, double alpha = 1.0);
/// x + bias broadcast over the rows of x.
Variable BiasAdd(const Variable& x, const Variable& bias);
Variable Scale(const Variable& x, double alpha);
/// x's values in `dtype` (the same layout; x itself when it has that dtype); the gradient goes back in x's dtype.
Variable Cast(const Variable& x, DType dtype);
/// Σ over dims (empty: all), which must be a prefix or a suffix of x's dims.
Variable Sum(const Variable& x, const std::vector<int>& dims = {}, bool keepdim = false);
Variable Mean(const Variable& x, const std::vector<int>& dims = {}, bool keepdim = false);
/// torch.matmul with batch broadcasting (rank ≥ 2).
Variable Matmul(const Variable& a, const Variable& b);
/// out[i, j] = x[i]·y[j].
Variable Outer(const Variable& x, const Variable& y);
/// weight[ids] (ids int64, no gradient).
Variable Embedding(const Variable& ids, const Variable& weight);
/// Σ_t weight[ids[t, ...]]: torch.nn.EmbeddingBag(mode="sum") with bags along ids' dim 0 (ids int64 [T, ...], no
/// gradient; out [..., H]). One fused gather-sum: neither the forward nor the backward makes the [T, ..., H] lookup
/// that Sum(Embedding(ids, weight), {0}) would. Layouts as Embedding's (dist::EmbeddingBagForward); saves the ids
/// only when the table needs a gradient.
Variable EmbeddingBag(const Variable& ids, const Variable& weight);
/// Cross-entropy of logits [..., C] against int64 labels [...] (no gradient for labels).
Variable CrossEntropy(const Variable& logits, const Variable& labels, const dist::CrossEntropyOptions& options = {});
/// The same value in another layout (the planner's collectives); backward moves the gradient back.
Variable Redistribute(const Variable& x, const spmd::Layout& layout);

} // namespace shardline::autograd
