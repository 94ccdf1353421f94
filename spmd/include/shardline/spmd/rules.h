#pragma once

#include <optional>
#include <string>
#include <vector>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::spmd {

/// A collective an op runs inside its own kernel sequence (vocab-parallel softmax / cross-entropy, the MoE token
/// exchange): not a redistribution of an input or output, but part of the op's cost.
struct InternalCollective {
    Collective collective = Collective::kAllReduce;
    int mesh_dim = -1;
    ReduceOp reduce_op = ReduceOp::kSum; ///< all_reduce only
    std::string what;
    /// The MoE exchange only (0 elsewhere): bytes each rank sends, an upper bound where the routing decides it
    /// (docs/spmd.md 2.7), and its price under the request's cost model (CostModel::Cost, n - 1 ring steps).
    int64_t bytes_per_rank = 0;
    double cost_us = 0.0;
    bool operator==(const InternalCollective &other) const = default;
};

/// The answer of a rule. forward / reverse: inputs are the required input layouts, outputs the output layouts.
/// grad: inputs are the required forward inputs followed by the required output gradient(s), outputs the input
/// gradients (only for differentiable inputs, named "<input>_grad").
struct SpmdInfo {
    std::vector<std::string> input_names;
    std::vector<TensorSpec> inputs;
    std::vector<std::string> output_names;
    std::vector<TensorSpec> outputs;
    std::vector<InternalCollective> internal;
    /// linear: the output is Partial, so the bias is added once, after the reduction (not by every rank).
    bool bias_after_reduction = false;
    double cost_us = 0.0; ///< RuleMode::kCostBased only

    const TensorSpec &Input(const std::string &name) const;
    const TensorSpec &Output(const std::string &name) const;
};

// ---- matmul: out = op(x) @ op(y), op = transpose of the last two dims when trans_*; batch dims broadcast. --------
struct MatmulAttrs {
    bool trans_x = false;
    bool trans_y = false;
};
/// x [..., m, k] (trans_x: [..., k, m]), y [..., k, n] (trans_y: [..., n, k]) -> out [..., m, n]; a 1-D x is [k],
/// a 1-D y is [k] (their m / n dim is dropped from the output, as torch.matmul).
SpmdInfo InferMatmulForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y,
                            const MatmulAttrs &attrs = {}, const RuleOptions &options = {});
SpmdInfo InferMatmulReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, const TensorSpec &out,
                            const MatmulAttrs &attrs = {}, const RuleOptions &options = {});
SpmdInfo InferMatmulGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, const TensorSpec &out_grad,
                         const MatmulAttrs &attrs = {}, const RuleOptions &options = {});

// ---- linear: y = x @ weight^T + bias, x [..., in], weight [out, in], bias [out]. ---------------------------------
// Conflicts go to the parameters: weight, then bias, then x ("parameters never move"), so column / row parallel
// give Megatron's communication (docs/spmd.md).
/// Paddle's fused_gemm_epilogue: out = op(x) @ op(weight) + bias, op = transpose of the last two dims when set.
/// trans_y defaults to true because linear's weight is [out, in] (torch); trans_y = false takes Paddle's [in, out].
/// trans_x: x is [..., in, m] (rank >= 2) and out [..., m, out].
struct LinearAttrs {
    bool trans_x = false;
    bool trans_y = true;
};
SpmdInfo InferLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const RuleOptions &options = {});
SpmdInfo InferLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const TensorSpec &out,
                            const RuleOptions &options = {});
SpmdInfo InferLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                         const std::optional<TensorSpec> &bias, const TensorSpec &out_grad,
                         const RuleOptions &options = {});
SpmdInfo InferLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const LinearAttrs &attrs,
                            const RuleOptions &options = {});
SpmdInfo InferLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const TensorSpec &out, const LinearAttrs &attrs,
                            const RuleOptions &options = {});
SpmdInfo InferLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                         const std::optional<TensorSpec> &bias, const TensorSpec &out_grad, const LinearAttrs &attrs,
                         const RuleOptions &options = {});

// ---- grouped_linear: mixture-of-experts experts, y[t] = x[t] @ weight[e(t)]^T + bias[e(t)] over rows grouped by
// expert.
/// x [tokens, in] (rows grouped by expert), weight [E, out, in], bias [E, out] -> out [tokens, out]. The expert dim of
/// weight and bias is its own label: the mesh dims sharding it are expert parallelism (the rows of x, out and their
/// gradients are sharded on them as the major shards; the parameter gradients stay sharded on the experts, never
/// Partial over them). Within an expert it is linear's rule: out sharded -> column parallel, in sharded -> Partial
/// output with the bias added once after the reduction (bias_after_reduction).
SpmdInfo InferGroupedLinearForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                   const std::optional<TensorSpec> &bias, const RuleOptions &options = {});
SpmdInfo InferGroupedLinearReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                   const std::optional<TensorSpec> &bias, const TensorSpec &out,
                                   const RuleOptions &options = {});
SpmdInfo InferGroupedLinearGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                                const std::optional<TensorSpec> &bias, const TensorSpec &out_grad,
                                const RuleOptions &options = {});

// ---- moe_dispatch / moe_combine: expert parallelism's token exchange (docs/spmd.md 2.7). -------------------------
/// The routing-independent facts of the exchange. The op name picks the direction (as softmax / log_softmax).
struct MoEDispatchAttrs {
    int64_t num_experts = 0; ///< E (global): > 0, divisible by the size of the ep mesh dim
    int64_t topk = 1;        ///< copies of each token, in [1, E]
    /// Rows each source rank may send per expert (moe_expert_capacity_factor's ceil(cf * T * k / E)); -1: dropless.
    /// Only the byte bound depends on it.
    int64_t capacity = -1;
    std::string ep_dim = "ep"; ///< the name of the expert-parallel mesh dim
};
/// moe_dispatch: x [T, H] token rows, sharded on dim 0 over the data-parallel mesh dims (dp, ep, ...) -> out [T*topk,
/// H], the token copies each rank's experts receive, grouped by local expert: rows sharded on ep as the major shard
/// (the expert dim, as grouped_linear's x; then x's other row mesh dims), H as x's. x must hold different tokens on
/// the ep ranks (rows sharded on ep: a free local slice otherwise), no Partial; H must not be sharded on ep. Internal
/// (ep size > 1): forward an all_to_all of the E per-expert counts (int64) and an all_to_all_v of the rows on ep;
/// grad (dx in x's layout) the reverse all_to_all_v. None when the ep dim has size 1. The global row count T*topk is
/// the dropless number of copies: each rank really holds a routing-dependent number of rows.
/// moe_combine: the inverse, x [T*topk, H] expert rows (ep the major row shard) -> out [T, H] token rows (ep back
/// among the data dims at its mesh-dim position); internal forward and grad: one all_to_all_v each (the counts were
/// exchanged by the dispatch). Throws SpmdError naming the op for a mesh without ep_dim, E not divisible by its size,
/// topk out of [1, E], H sharded on ep, a row count not divisible by topk (combine).
SpmdInfo InferMoEDispatchForward(const ProcessMesh &mesh, const TensorSpec &x, const MoEDispatchAttrs &attrs,
                                 const RuleOptions &options = {});
SpmdInfo InferMoEDispatchReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                                 const MoEDispatchAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferMoEDispatchGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                              const MoEDispatchAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferMoECombineForward(const ProcessMesh &mesh, const TensorSpec &x, const MoEDispatchAttrs &attrs,
                                const RuleOptions &options = {});
SpmdInfo InferMoECombineReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                                const MoEDispatchAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferMoECombineGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                             const MoEDispatchAttrs &attrs, const RuleOptions &options = {});

// ---- elementwise: unary and n-ary with numpy broadcasting. -----------------------------------------------------
/// Known ops: binary add, subtract, multiply, divide, maximum, minimum, pow; unary relu, gelu, silu, tanh, sigmoid,
/// exp, log, sqrt, abs, neg, scale, cast, identity. Throws SpmdError for others.
bool IsElementwiseOp(const std::string &op);
/// The known elementwise op names, sorted.
std::vector<std::string> ElementwiseOpNames();
int ElementwiseArity(const std::string &op);
SpmdInfo InferElementwiseForward(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                                 const RuleOptions &options = {});
SpmdInfo InferElementwiseReverse(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                                 const TensorSpec &out, const RuleOptions &options = {});
SpmdInfo InferElementwiseGrad(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                              const TensorSpec &out_grad, const RuleOptions &options = {});

// ---- reductions: sum, mean, max, min over axes. ---------------------------------------------------------------
enum class ReductionKind { kSum, kMean, kMax, kMin, kProd };
struct ReductionAttrs {
    ReductionKind kind = ReductionKind::kSum;
    std::vector<int> axes; ///< empty = all; negative counts from the end
    bool keepdim = false;
};
/// A sharded reduced dim makes the output Partial: sum and mean give P(sum) (a mean's local kernel divides by the
/// global count, so uneven shards stay exact), max P(max), min P(min), prod P(prod). The grad of max, min and prod
/// also requires the forward output (`out`), reduced.
SpmdInfo InferReductionForward(const ProcessMesh &mesh, const TensorSpec &x, const ReductionAttrs &attrs,
                               const RuleOptions &options = {});
SpmdInfo InferReductionReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                               const ReductionAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferReductionGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                            const ReductionAttrs &attrs, const RuleOptions &options = {});

// ---- embedding: out[..., h] = weight[ids[...], h]; weight [vocab, hidden]. -----------------------------------------
/// A vocab-sharded table gives a P(sum) output (each rank looks up its rows, zeros elsewhere: Megatron's
/// VocabParallelEmbedding); a hidden-sharded table a hidden-sharded output.
/// sparse: the weight gradient is row-sparse (the looked-up rows and their values; its layout is that of the dense
/// gradient it stands for). As Paddle, a vocab-sharded table is refused with sparse (forward and grad); the grad
/// also refuses layouts whose dense weight gradient would be Partial (ids or out_grad sharded on a batch dim, or
/// out_grad Partial): the planner reduces dense tensors only, and a sparse sum is a concatenation.
struct EmbeddingAttrs {
    bool sparse = false;
};
SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const RuleOptions &options = {});
SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const RuleOptions &options = {});
SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const RuleOptions &options = {});
SpmdInfo InferEmbeddingForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const EmbeddingAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferEmbeddingReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out, const EmbeddingAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferEmbeddingGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                            const TensorSpec &out_grad, const EmbeddingAttrs &attrs, const RuleOptions &options = {});

// ---- embedding_bag: out[..., h] = Σ_t weight[ids[t, ...], h]; ids [bag, ...], weight [vocab, hidden]. -------------
/// The embedding rule with the bag dim summed away: a vocab-sharded table, or ids sharded on their bag dim, give a
/// P(sum) output; the gradient of the table is Partial(sum) over the mesh dims that shard the ids.
SpmdInfo InferEmbeddingBagForward(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                                  const RuleOptions &options = {});
SpmdInfo InferEmbeddingBagReverse(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                                  const TensorSpec &out, const RuleOptions &options = {});
SpmdInfo InferEmbeddingBagGrad(const ProcessMesh &mesh, const TensorSpec &ids, const TensorSpec &weight,
                               const TensorSpec &out_grad, const RuleOptions &options = {});

// ---- softmax / log_softmax along an axis. ---------------------------------------------------------------------
struct SoftmaxAttrs {
    int axis = -1;
    bool log = false;
    /// Allow the axis to stay sharded: the op then all-reduces the max and the sum of exponentials (internal).
    bool vocab_parallel = false;
};
SpmdInfo InferSoftmaxForward(const ProcessMesh &mesh, const TensorSpec &x, const SoftmaxAttrs &attrs,
                             const RuleOptions &options = {});
SpmdInfo InferSoftmaxReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                             const SoftmaxAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferSoftmaxGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                          const SoftmaxAttrs &attrs, const RuleOptions &options = {});

// ---- cross-entropy: loss[...] = logsumexp(logits[..., :]) - logits[..., label[...]]. --------------------------------
enum class LossReduction { kNone, kMean, kSum };
struct CrossEntropyAttrs {
    LossReduction reduction = LossReduction::kNone;
    /// Megatron's vocab-parallel cross-entropy: logits stay sharded on the class dim; the op all-reduces the max,
    /// the sum of exponentials and the target logit (internal) and its loss is Replicate on that mesh dim.
    bool vocab_parallel = false;
};
/// logits [..., C], labels [...] (integers, no gradient) -> loss [...] (none) or [] (mean / sum: P(sum) over the
/// mesh dims sharding the batch dims; mean's local kernel divides by the global count).
SpmdInfo InferCrossEntropyForward(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                                  const CrossEntropyAttrs &attrs, const RuleOptions &options = {});
SpmdInfo InferCrossEntropyReverse(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                                  const TensorSpec &loss, const CrossEntropyAttrs &attrs,
                                  const RuleOptions &options = {});
SpmdInfo InferCrossEntropyGrad(const ProcessMesh &mesh, const TensorSpec &logits, const TensorSpec &labels,
                               const TensorSpec &loss_grad, const CrossEntropyAttrs &attrs,
                               const RuleOptions &options = {});

// ---- transpose: out.shape[i] = x.shape[perm[i]]. ------------------------------------------------------------------
SpmdInfo InferTransposeForward(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int> &perm,
                               const RuleOptions &options = {});
SpmdInfo InferTransposeReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                               const std::vector<int> &perm, const RuleOptions &options = {});
SpmdInfo InferTransposeGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                            const std::vector<int> &perm, const RuleOptions &options = {});

// ---- reshape (row-major view; one -1 allowed in the target shape). -----------------------------------------------
/// Dims are grouped into runs whose products match. Within a run only the first dim of size > 1 may be sharded,
/// and only when its size and the first output dim's size of the run are divisible by the shard count (so the
/// torch.chunk shards of both sides hold the same elements); the sharding moves to that output dim. Everything
/// else in a run must be Replicate. Partials pass through.
SpmdInfo InferReshapeForward(const ProcessMesh &mesh, const TensorSpec &x, const std::vector<int64_t> &shape,
                             const RuleOptions &options = {});
SpmdInfo InferReshapeReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out,
                             const RuleOptions &options = {});
SpmdInfo InferReshapeGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &out_grad,
                          const std::vector<int64_t> &shape, const RuleOptions &options = {});

// ---- generic einsum ("mk,kn->mn"), the engine as an op. ---------------------------------------------------------
SpmdInfo InferEinsumOpForward(const ProcessMesh &mesh, const std::string &equation,
                              const std::vector<TensorSpec> &inputs, const RuleOptions &options = {});
SpmdInfo InferEinsumOpReverse(const ProcessMesh &mesh, const std::string &equation,
                              const std::vector<TensorSpec> &inputs, const TensorSpec &out,
                              const RuleOptions &options = {});
SpmdInfo InferEinsumOpGrad(const ProcessMesh &mesh, const std::string &equation, const std::vector<TensorSpec> &inputs,
                           const TensorSpec &out_grad, const RuleOptions &options = {});

} // namespace shardline::spmd
