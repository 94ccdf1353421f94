#pragma once

// Mixture-of-experts routing and token permutation kernels (the layer composes them in autograd/moe.h):
//   MoERouterForward / MoERouterBackward   scores, top-k, renormalised weights, tokens per expert, aux and z losses;
//   MoEPermuteMap                          the rows of each (token, slot) copy in expert order, and the group sizes;
//   MoEPermuteRows                         the gather: out[row_map[t, j]] = (w[t, j] ·) x[t];
//   MoEUnpermuteRows                       the combine: y[t] = Σ_j (w[t, j] ·) tokens[row_map[t, j]];
//   MoEUnpermuteWeightsGrad                dw[t, j] = <dy[t], tokens[row_map[t, j]]>.
// T tokens, E experts, k = topk slots per token, H hidden. All are deterministic: every sum runs in a fixed order (no
// float atomics), so the same input gives bitwise the same output on a device. Top-k selects on the logits (softmax and
// sigmoid are monotone), so CPU and CUDA pick the same experts; ties go to the lower expert id.

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

enum class MoEScoreFunction { kSoftmax, kSigmoid };

/// What the router computes (the routing options of autograd::RouterOptions that the kernels read).
struct MoERouterConfig {
    int num_experts = 0;
    int topk = 1;
    MoEScoreFunction score_function = MoEScoreFunction::kSoftmax;
    /// Renormalise the k chosen scores to sum 1. For sigmoid with topk > 1 this is always done (Megatron).
    bool normalize_topk = true;
    double aux_loss_coeff = 0.0; ///< aux = coeff·E·Σ_e f_e·P_e (see MoERouterForward)
    double z_loss_coeff = 0.0;   ///< z = coeff·mean_t (logsumexp_e logits[t, e])²
};

/// Whether the chosen scores are renormalised: normalize_topk, or sigmoid scores with topk > 1.
inline bool NormalizesTopk(const MoERouterConfig& c) {
    return c.normalize_topk || (c.score_function == MoEScoreFunction::kSigmoid && c.topk > 1);
}

struct MoERouterForwardArgs {
    const Tensor& logits;          ///< [T, E] float32 (CPU also float64, for references)
    const MoERouterConfig& config; ///< E == logits.size(1), 1 <= topk <= E (CUDA: E <= 256, topk <= 8)
    Tensor& weights;               ///< [T, topk], logits' dtype
    Tensor& indices;               ///< [T, topk] int64, logits' device
    Tensor& tokens_per_expert;     ///< [E] int64, logits' device: copies (t, j) routed to e
    Tensor* aux_loss = nullptr;    ///< [] logits' dtype; computed when given (with the coefficient applied)
    Tensor* z_loss = nullptr;      ///< [] logits' dtype; computed when given
};
struct MoERouterForwardOp {
    static constexpr std::string_view kName = "MoERouterForward";
    using Fn = void (*)(const MoERouterForwardArgs&);
};
/// s = softmax(logits[t]) or sigmoid(logits[t]); indices[t] = the topk largest logits in descending order (ties: the
/// lower id first); weights[t, j] = s[indices[t, j]], divided by Σ_j s[indices[t, j]] when NormalizesTopk (sigmoid:
/// plus 1e-20). aux = coeff·E·Σ_e f_e·P_e with f_e = tokens_per_expert[e] / (T·topk) and P_e = mean_t p[t, e], where
/// p = softmax(logits) for softmax and p = s / (Σ_e s + 1e-20) for sigmoid (Megatron's switch loss). z = coeff·mean_t
/// (logsumexp_e logits[t, e])². Math in fp64 on the CPU, fp32 on CUDA.
void MoERouterForward(const MoERouterForwardArgs& args);

struct MoERouterBackwardArgs {
    const Tensor& logits;              ///< [T, E] the forward's logits
    const MoERouterConfig& config;     ///< as in the forward
    const Tensor& indices;             ///< [T, topk] int64, the forward's
    const Tensor& tokens_per_expert;   ///< [E] int64, the forward's (for the aux loss's f_e)
    const Tensor* dweights = nullptr;  ///< [T, topk] logits' dtype, or nullptr (no gradient through the weights)
    const Tensor* daux_loss = nullptr; ///< [] or [1] logits' dtype on logits' device, or nullptr
    const Tensor* dz_loss = nullptr;   ///< [] or [1], or nullptr
    Tensor& dlogits;                   ///< [T, E] logits' dtype, overwritten
};
struct MoERouterBackwardOp {
    static constexpr std::string_view kName = "MoERouterBackward";
    using Fn = void (*)(const MoERouterBackwardArgs&);
};
/// dlogits = d/dlogits of <dweights, weights> + daux·aux + dz·z (the terms whose gradients are given), recomputing the
/// scores from the logits. Per row, no cross-row sums: deterministic.
void MoERouterBackward(const MoERouterBackwardArgs& args);

struct MoEPermuteMapArgs {
    const Tensor& indices; ///< [T, topk] int64 expert ids in [0, num_experts)
    int num_experts = 0;
    std::int64_t capacity = -1; ///< < 0: dropless; else each expert keeps its first `capacity` copies in (t, j) order
    Tensor& row_map;            ///< [T, topk] int64 on indices' device: the copy's row in expert order, -1 if dropped
    Tensor& group_sizes;        ///< [E] int64 on indices' device: kept copies per expert
};
struct MoEPermuteMapOp {
    static constexpr std::string_view kName = "MoEPermuteMap";
    using Fn = void (*)(const MoEPermuteMapArgs&);
};
/// The stable expert order of the copies (t, j), flattened i = t·topk + j: copy i of expert e that is the r-th of
/// e's copies in increasing i gets row offset_e + r when r < capacity (or dropless), with offset_e = Σ_{e' < e}
/// group_sizes[e']; the others get -1. Out-of-range ids are an error on the CPU (checked by the wrapper); on CUDA,
/// whose ids the wrapper does not read, they are dropped (row -1, in no group).
void MoEPermuteMap(const MoEPermuteMapArgs& args);

struct MoEPermuteRowsArgs {
    const Tensor& x;                 ///< [T, H] (CPU float32/float64; CUDA float32/float16/bfloat16)
    const Tensor& row_map;           ///< [T, topk] int64: a row of out or -1; the non-negative entries are distinct
    const Tensor* weights = nullptr; ///< [T, topk] float32 or x's dtype: scales each copy when given
    Tensor& out;                     ///< [R, H] x's dtype; rows no copy maps to are left as they are
};
struct MoEPermuteRowsOp {
    static constexpr std::string_view kName = "MoEPermuteRows";
    using Fn = void (*)(const MoEPermuteRowsArgs&);
};
/// out[row_map[t, j]] = x[t] (a copy), or w[t, j]·x[t] computed in fp32 (fp64 for fp64) and rounded once.
void MoEPermuteRows(const MoEPermuteRowsArgs& args);

struct MoEUnpermuteRowsArgs {
    const Tensor& tokens;            ///< [R, H]
    const Tensor& row_map;           ///< [T, topk] int64, entries in [-1, R)
    const Tensor* weights = nullptr; ///< [T, topk] float32 or tokens' dtype, or nullptr (all ones)
    Tensor& y;                       ///< [T, H] tokens' dtype, overwritten
};
struct MoEUnpermuteRowsOp {
    static constexpr std::string_view kName = "MoEUnpermuteRows";
    using Fn = void (*)(const MoEUnpermuteRowsArgs&);
};
/// y[t] = Σ_j w[t, j]·tokens[row_map[t, j]] over the kept copies (row_map >= 0), j in increasing order, accumulated in
/// fp32 (fp64 on the CPU) and rounded once; a token with no kept copy gets zeros.
void MoEUnpermuteRows(const MoEUnpermuteRowsArgs& args);

struct MoEUnpermuteWeightsGradArgs {
    const Tensor& dy;      ///< [T, H]
    const Tensor& tokens;  ///< [R, H], dy's dtype
    const Tensor& row_map; ///< [T, topk] int64
    Tensor& dweights;      ///< [T, topk] float32 or dy's dtype, overwritten
};
struct MoEUnpermuteWeightsGradOp {
    static constexpr std::string_view kName = "MoEUnpermuteWeightsGrad";
    using Fn = void (*)(const MoEUnpermuteWeightsGradArgs&);
};
/// dweights[t, j] = Σ_h dy[t, h]·tokens[row_map[t, j], h] (0 for a dropped copy), accumulated in fp32 (fp64 on the
/// CPU) in a fixed order.
void MoEUnpermuteWeightsGrad(const MoEUnpermuteWeightsGradArgs& args);

} // namespace shardline::kernels
