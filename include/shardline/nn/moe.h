#pragma once

// Megatron-Core's MoE MLP (docs/moe.md "Layer"): a gate Linear with fp32 logits, the top-k Router, Permute, the
// expert-parallel exchange over the mesh dim `ep` (autograd/moe_dispatch.h), the experts' grouped MLP (fc1 column-
// then fc2 row-parallel over the tp dim: expert tensor parallelism), the exchange back and the weighted Unpermute.
//
// Mesh (dp, ep, tp), tp fastest: the layer's input x [..., hidden] is replicated over tp and sharded on its leading
// dims over the data-parallel dims (dp and ep: the ep ranks must hold different tokens). The E experts are split
// evenly over ep (rank r holds experts [r·E/ep, (r+1)·E/ep)); each expert's fc1/fc2 over tp (etp = the tp dim's size).
// etp 1 below tp (Megatron's expert_tensor_parallel_size 1): the experts are whole on every tp rank and the tp ranks
// split the tokens instead — x (replicated over tp, or already sharded over it on its leading dims) is taken as
// sharded over tp on dim 0 (a free slice), each rank routes and runs its slice, and the output is all-gathered over tp
// back to x's layout. tp is then one more expert-data-parallel dim: the experts' gradients are Partial over it too.
//
// Parameters (names under ParameterOptions::name, default "moe"):
//   router.weight      [hidden, E] float32, replicated: logits = x·W (x cast to float32 first)
//   experts.fc1.weight [E, ffn, hidden] sharded on E over ep and on ffn over tp; experts.fc1.bias [E, ffn] too
//   experts.fc2.weight [E, hidden, ffn] sharded on E over ep and on ffn over tp; experts.fc2.bias [E, hidden] on E
//   (etp 1 below tp: the experts' parameters are sharded on E over ep only, replicated over tp)
// Initialised as torch.nn.Linear from the counter-based RNG: the global values depend on neither ep nor tp.
// Gradient reduction (nn::GradSync with dp_dims {dp, ep}): the router's over dp and ep, the experts' over dp only.
// With etp 1 below tp the gradients of the router and of the experts are Partial over tp as well: pass
// ExtraDataParallelDims() as GradSyncOptions::extra_dp_dims to reduce it in their buckets (else backward all-reduces
// it per parameter; docs/moe.md "Gradient reduction").

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <shardline/autograd/moe.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/nn/init.h>
#include <shardline/nn/module.h>
#include <shardline/spmd/rule_cache.h>

namespace shardline::nn {

/// Megatron's MoE options (names as TransformerConfig's moe_*).
struct MoEMLPOptions {
    std::int64_t hidden = 0;      ///< hidden_size
    std::int64_t ffn = 0;         ///< moe_ffn_hidden_size: each expert's inner size, split over etp
    std::int64_t num_experts = 0; ///< num_moe_experts
    int topk = 1;                 ///< moe_router_topk
    std::string ep_dim = "ep";    ///< the mesh dim of expert parallelism (expert_model_parallel_size = its size)
    std::int64_t ep = 0;          ///< expected ep size; 0: the mesh dim's size
    std::string tp_dim = "tp";    ///< the mesh dim of expert tensor parallelism
    std::int64_t etp = 0; ///< expert_tensor_parallel_size: 0 or the tp dim's size (experts split over tp), or 1 (whole
                          ///< experts, the tp ranks split the tokens); 1 < etp < tp is refused
    double capacity_factor = -1.0; ///< moe_expert_capacity_factor; < 0: dropless
    double aux_loss_coeff = 0.0;   ///< moe_aux_loss_coeff (Switch/GShard load balancing)
    double z_loss_coeff = 0.0;     ///< moe_z_loss_coeff
    autograd::MoEScoreFunction score_function = autograd::MoEScoreFunction::kSoftmax;
    bool normalize_topk = true; ///< renormalise the k chosen scores (Megatron's moe_router_topk_scaling / pre-softmax)
    bool bias = true;           ///< biases on the experts' fc1 and fc2
    kernels::GeluApproximation approximation = kernels::GeluApproximation::kTanh;
    /// The GELU between fc1 and fc2; false makes each expert linear (fc2·fc1: exact integer arithmetic in tests).
    bool activation = true;
    /// The tanh GELU's gradient in fc2's grouped dgrad epilogue (autograd::GeluRowParallelGroupedLinear: no GELU node,
    /// no GeluBackward kernel; the forward GELU stays a kernel, docs/moe.md), on the CPU and for bf16/fp16 experts on
    /// CUDA. false, the erf GELU or fp32 experts on CUDA: the separate GELU node (ParallelMLPOptions::gelu_fusion's
    /// switch for the experts).
    bool gelu_fusion = true;
};

/// One forward's routing statistics (this rank's tokens; no communication).
struct MoEStats {
    std::int64_t tokens = 0;  ///< T, this rank's tokens
    std::int64_t dropped = 0; ///< copies dropped by the capacity
    /// [E] int64: the copies of this rank's tokens kept per expert (after the capacity). On the layer's device where
    /// the layer did not read the routing back to the host (CUDA at ep 1 without a capacity: the layer makes no host
    /// sync), on the host otherwise.
    Tensor expert_load;
    /// min / max over the experts of expert_load: reads it back to the host when it is on a device (a sync: call it
    /// where the step is logged, not in the forward).
    std::int64_t load_min() const;
    std::int64_t load_max() const;
};

struct MoEOutput {
    Variable output; ///< x's shape and layout
    /// The auxiliary loss to add to the model's loss: load balancing + z-loss, each rank's value divided by the number
    /// of data-parallel ranks, as a scalar Partial(sum) over them (its full value is the mean over the ranks). A
    /// zero Variable without gradient when both coefficients are 0.
    Variable aux_loss;
    MoEStats stats;
};

class MoEMLP : public Module {
public:
    /// Checks the options against the mesh (every rank alike, before any collective): topk in [1, E], E divisible by
    /// ep, ffn split over etp with no rank empty, etp 0, 1 or the tp size, the named dims present.
    MoEMLP(const MoEMLPOptions& options, comm::DeviceMesh& mesh, const ParameterOptions& param = {});

    /// x [..., hidden] as described above.
    MoEOutput Forward(const Variable& x) const;

    /// The expert path at a given routing (no gate, no router): indices int64 [T, topk] < E and weights [T, topk]
    /// float32 (a local Variable) for this rank's T tokens of x (with etp 1 below tp: this tp rank's slice of them, the
    /// tp-th of x's local dim-0 rows). What Forward runs after the router; for tests and for callers with their own
    /// router. The output as Forward's; aux_loss undefined.
    MoEOutput ForwardRouted(const Variable& x, const Tensor& indices, const Variable& weights) const;

    const MoEMLPOptions& options() const { return options_; }
    /// GradSyncOptions::extra_dp_dims for this layer: with etp 1 below tp, the router and the experts are data-parallel
    /// over the tp dim too (its ranks split the tokens); empty otherwise.
    std::vector<std::pair<Variable, std::vector<std::string>>> ExtraDataParallelDims() const;
    /// The expert capacity for T tokens (capacity_factor ≥ 0): ceil(capacity_factor · T · topk / E); -1 when dropless.
    std::int64_t Capacity(std::int64_t tokens) const;

    Variable router_weight;
    Variable fc1_weight, fc1_bias, fc2_weight, fc2_bias;

private:
    /// x on the mesh, [..., hidden], replicated over tp (etp 1 < tp: or sharded over it on its leading dims) and not
    /// Partial, its leading dims sharded over ep when ep > 1.
    void CheckInput(const Variable& x) const;
    /// The tokens this rank computes on: x itself, or with etp 1 below tp x redistributed (a free slice) to be sharded
    /// over tp on dim 0 as well (x.shape[0] must split evenly; checked before any collective).
    Variable TokenSlice(const Variable& x) const;
    /// The output y of TokenSlice(x)'s tokens in x's layout (an all-gather over tp when TokenSlice sliced).
    Variable Restore(const Variable& y, const Variable& x) const;
    /// The expert path on the tokens x (TokenSlice's) at a given routing; the output in x's layout.
    MoEOutput RunExperts(const Variable& x, const Tensor& indices, const Variable& weights) const;
    /// The moe_dispatch rule's answer for x (docs/spmd.md 2.7: x's token rows -> the experts' rows, the exchange's
    /// internal collectives), checked against the exchange the layer runs. Asked once per x shape and layout (and
    /// capacity); later calls compare them with the last ones and allocate nothing.
    std::shared_ptr<const spmd::CachedRule> ExchangeRule(const Variable& x, std::int64_t capacity) const;

    /// The last ExchangeRule answer and what it was asked for (behind a pointer: the module stays movable).
    struct ExchangeRuleCache {
        std::mutex mutex;
        Shape x_shape;
        spmd::Layout x_layout;
        std::int64_t capacity = 0;
        std::shared_ptr<const spmd::CachedRule> rule;
    };
    std::unique_ptr<ExchangeRuleCache> exchange_rule_ = std::make_unique<ExchangeRuleCache>();

    MoEMLPOptions options_;
    comm::DeviceMesh& mesh_;
    std::string name_;
    int ep_dim_ = 0;
    int tp_dim_ = 0;
    std::int64_t ep_ = 1;
    bool split_tokens_ = false; ///< etp 1 < tp: whole experts, the tp ranks split the tokens
};

} // namespace shardline::nn
