#pragma once

// Ops on DistTensors (DESIGN.md §6). Each op asks the SPMD rule (spmd/) for the layouts, redistributes inputs through
// the rule's cached plans when they differ, runs the local kernel and returns outputs in the inferred layouts. A
// backward op computes only the gradients it is asked for and returns them in the grad rule's layouts, possibly
// Partial: the caller (autograd) redistributes a gradient only for an input that needs one. No op here takes autograd
// flags beyond "which gradients"; none hand-writes a collective that a rule and the planner do not give.
//
// Every op also takes local DistTensors (DistTensor::Local): rules are skipped and the kernels run on the tensors.

#include <memory>
#include <optional>
#include <vector>

#include <shardline/dist/dist_tensor.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/spmd/rule_cache.h>

namespace shardline::dist {

/// The process-wide cache of rules and plans (infers on the first request of a configuration, shares afterwards).
spmd::RuleCache& Rules();

/// The answer of `request` on the mesh of `mesh` (request.mesh is filled from it), from Rules(). SpmdErrors become
/// shardline::Error naming `op`.
std::shared_ptr<const spmd::CachedRule> LookupRule(std::string_view op, comm::DeviceMesh& mesh,
                                                   spmd::RuleRequest request);

/// `t` in `layout`: itself (relabelled) when the layouts agree on the mesh, else redistributed by the planner.
DistTensor MoveToLayout(const DistTensor& t, const spmd::Layout& layout);

/// True when `a` and `b` place every element alike on `mesh` (a mesh dim of one rank shards and reduces nothing).
bool SameLayout(comm::DeviceMesh& mesh, const spmd::Layout& a, const spmd::Layout& b);

/// A buffer that a backward op may accumulate a gradient into (beta = 1) instead of returning it, when the gradient
/// it computes has exactly `layout` (e.g. a parameter's fp32 main grad, see autograd). `buffer` is the local shard.
/// `zero_pending`, when set and true, says the buffer holds no value yet and stands for zeros: the op overwrites it
/// (beta = 0) and clears the flag (Written), or fills the zeros first (Materialize) where it must accumulate.
struct GradSink {
    Tensor* buffer = nullptr;
    spmd::Layout layout;
    bool* zero_pending = nullptr;

    /// The buffer, when a gradient in `grad_layout` on `mesh` (nullptr: local) may go into it; else nullptr.
    Tensor* BufferFor(comm::DeviceMesh* mesh, const spmd::Layout& grad_layout) const;
    /// Whether the buffer stands for zeros (its first writer may overwrite it).
    bool fresh() const { return zero_pending != nullptr && *zero_pending; }
    /// The buffer now holds its values (after an overwrite or an accumulation).
    void Written() const;
    /// Fills the zeros a fresh buffer stands for, so that an op can accumulate into it.
    void Materialize() const;
};

/// One gradient: `value` in the grad rule's layout (possibly Partial), or `accumulated` when it went into a GradSink.
struct Grad {
    DistTensor value;
    bool accumulated = false;
    bool defined() const { return value.defined() || accumulated; }
};

// ---- elementwise ---------------------------------------------------------------------------------------------------
DistTensor GeluForward(const DistTensor& x, kernels::GeluApproximation approximation);
/// dx = dy·gelu'(x) in the grad rule's layout.
DistTensor GeluBackward(const DistTensor& dy, const DistTensor& x, kernels::GeluApproximation approximation);

/// out = a + alpha·b (same global shapes).
DistTensor Add(const DistTensor& a, const DistTensor& b, double alpha = 1.0);
struct AddBackwardArgs {
    const DistTensor& dout;
    /// The forward operands' specs (`DistTensor::spec()`, of tensors on dout's mesh: a spec names no mesh): the grad
    /// rule reads their global shapes and layouts, never their values, so a caller keeps these instead of the
    /// operands' memory. Unread when dout is local.
    const spmd::TensorSpec& a;
    const spmd::TensorSpec& b;
    double alpha = 1.0;
    bool need_a = false;
    bool need_b = false;
};
/// The gradients of Add: {da, db} (db scaled by alpha), each only when asked.
std::vector<Grad> AddBackward(const AddBackwardArgs& args);

/// out = x + bias broadcast over the rows of x [..., n] (bias [n]).
DistTensor BiasAdd(const DistTensor& x, const DistTensor& bias);
/// The bias gradient of BiasAdd: db = Σ_rows dout, in the add grad rule's layout (Partial over the mesh dims that
/// shard dout's rows), or accumulated into `bias_sink` when its layout is that one. `x` and `bias` are the forward
/// operands' specs (`DistTensor::spec()`; the values are never read; unread when dout is local).
Grad BiasAddBackward(const DistTensor& dout, const spmd::TensorSpec& x, const spmd::TensorSpec& bias,
                     const GradSink& bias_sink = {});

/// out = alpha·x.
DistTensor Scale(const DistTensor& x, double alpha);

// ---- reductions ----------------------------------------------------------------------------------------------------
struct SumOptions {
    std::vector<int> dims{}; ///< empty: all
    bool keepdim = false;
    bool mean = false; ///< average instead of sum
};
/// Σ (mean: average) of x over `options.dims`. The dims must be a prefix or a suffix of x's dims (what the local
/// kernels broadcast back in backward). A sharded reduced dim gives a Partial(sum) output.
DistTensor Sum(const DistTensor& x, const SumOptions& options = {});
/// dx: dout broadcast back over the reduced dims (÷ count for mean), in the grad rule's layout. `x` is the forward
/// input's spec (`DistTensor::spec()`): only its global shape and layout are read (only the shape when dout is local).
DistTensor SumBackward(const DistTensor& dout, const spmd::TensorSpec& x, const SumOptions& options);

// ---- matmul / outer ------------------------------------------------------------------------------------------------
/// out = a·b with torch.matmul batch broadcasting (both of rank ≥ 2).
DistTensor Matmul(const DistTensor& a, const DistTensor& b);
struct MatmulBackwardArgs {
    const DistTensor& dout;
    const DistTensor& a;
    const DistTensor& b;
    bool need_a = false;
    bool need_b = false;
};
/// {da = dout·bᵀ, db = aᵀ·dout} (summed over broadcast batch dims), each only when asked.
std::vector<Grad> MatmulBackward(const MatmulBackwardArgs& args);
/// out[i, j] = x[i]·y[j].
DistTensor Outer(const DistTensor& x, const DistTensor& y);
struct OuterBackwardArgs {
    const DistTensor& dout;
    const DistTensor& x;
    const DistTensor& y;
    bool need_x = false;
    bool need_y = false;
};
/// {dx = dout·y, dy = doutᵀ·x}, each only when asked.
std::vector<Grad> OuterBackward(const OuterBackwardArgs& args);

// ---- embedding -----------------------------------------------------------------------------------------------------
/// out[..., :] = weight[ids[...], :]; ids int64. A vocab-sharded table (weight S(0)) gives a Partial(sum) output
/// (rows of other shards are zeros), as Megatron's VocabParallelEmbedding before its all-reduce.
DistTensor EmbeddingForward(const DistTensor& ids, const DistTensor& weight);
Grad EmbeddingBackward(const DistTensor& dout, const DistTensor& ids, const DistTensor& weight,
                       const GradSink& weight_sink = {});
/// out[..., :] = Σ_t weight[ids[t, ...], :] (torch.nn.EmbeddingBag, mode sum, bags along ids' dim 0), without the
/// [T, ..., H] lookup. Layouts by the embedding_bag rule: as EmbeddingForward's (a vocab-sharded table gives a
/// Partial(sum) output), and ids sharded on their bag dim give a Partial(sum) output too.
DistTensor EmbeddingBagForward(const DistTensor& ids, const DistTensor& weight);
/// dweight[v] = Σ_{ids[t, n] == v} dout[n] in the grad rule's layout (the table's, Partial over the mesh dims that
/// shard the ids), accumulated into the sink's buffer where it has that layout.
Grad EmbeddingBagBackward(const DistTensor& dout, const DistTensor& ids, const DistTensor& weight,
                          const GradSink& weight_sink = {});

// ---- cross-entropy -------------------------------------------------------------------------------------------------
enum class LossReduction { kNone, kMean, kSum };
struct CrossEntropyOptions {
    LossReduction reduction = LossReduction::kMean;
    /// Logits may stay sharded on the class dim (Megatron's vocab-parallel cross-entropy): the op all-reduces the row
    /// max, the sum of exponentials and the target logit over that mesh dim instead of gathering the logits.
    bool vocab_parallel = true;
};
/// What CrossEntropyBackward needs.
struct CrossEntropySaved {
    DistTensor logits_used; ///< in the layout the local kernels used
    DistTensor labels_used;
    Tensor row_max;               ///< [N] global row max (fp32/fp64)
    Tensor sum_exp;               ///< [N] global Σ exp(logit - max) (a view of `stats`)
    Tensor stats;                 ///< [2, N]: sum_exp and the target logit, all-reduced together
    spmd::TensorSpec logits_spec; ///< as given
    std::int64_t global_rows = 0;
    CrossEntropyOptions options;
};
struct CrossEntropyResult {
    DistTensor loss; ///< [...] (none) or [] (mean, sum: Partial(sum) over the mesh dims sharding the rows)
    CrossEntropySaved saved;
};
/// loss = logsumexp(logits[..., :]) − logits[..., label], labels int64 global class ids.
CrossEntropyResult CrossEntropyForward(const DistTensor& logits, const DistTensor& labels,
                                       const CrossEntropyOptions& options = {});
/// dlogits = dloss·(softmax(logits) − onehot(label)) (÷ rows for mean), in the layout of saved.logits_used.
DistTensor CrossEntropyBackward(const DistTensor& dloss, const CrossEntropySaved& saved);

} // namespace shardline::dist
