#pragma once

// Mixture-of-experts routing on local Variables (no communication): the router (scores, top-k, load-balancing and z
// losses), the permutation of token copies into expert order and the weighted combine back. A MoE layer composes them:
//   gate Linear → Router → Permute → (EP all-to-all-v) → grouped MLP → (all-to-all-v back) → Unpermute.
// Each is a Function over the kernels of kernels/moe.h (CPU and CUDA); all are deterministic (bitwise the same output
// and gradients for the same input).

#include <cstdint>
#include <vector>

#include <shardline/autograd/variable.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/moe.h>

namespace shardline::autograd {

using kernels::MoEScoreFunction; // kSoftmax, kSigmoid

struct RouterOptions {
    int num_experts = 0;
    int topk = 1;
    MoEScoreFunction score_function = MoEScoreFunction::kSoftmax;
    bool normalize_topk = true;  // renormalise the k chosen scores to sum 1 (always for sigmoid when topk > 1)
    double aux_loss_coeff = 0.0; // Switch/GShard load-balancing loss: coeff * E * sum_e f_e * P_e
    double z_loss_coeff = 0.0;   // coeff * mean_t (logsumexp_e logits[t, e])^2
};

struct RouterOutput {
    Variable weights;         // [T, topk] float32, differentiable w.r.t. logits (through the chosen scores)
    Tensor indices;           // [T, topk] int64 expert ids; ties broken deterministically (lower id wins);
                              // order within a row: descending score, then lower id
    Variable aux_loss;        // scalar [] float32, coeff applied; a 0-valued Variable without grad_fn
    Variable z_loss;          //   when its coeff is 0
    Tensor tokens_per_expert; // [E] int64 on the logits' device (counts of (t, j) copies per expert)
};

/// Top-k routing of logits [T, E] float32 (the gate Linear's output; float64 on the CPU for references, which gives
/// float64 outputs): s = softmax or sigmoid of each row, the topk experts of the largest logits, weights = their scores
/// (renormalised to sum 1 when normalize_topk, and always for sigmoid with topk > 1). aux_loss = coeff·E·Σ_e f_e·P_e
/// with f_e = tokens_per_expert[e] / (T·topk) (no gradient) and P_e = mean_t p[t, e] (p = softmax, or for sigmoid the
/// row-normalised sigmoid scores); z_loss = coeff·mean_t logsumexp(logits[t])². ShapeError/Error naming "Router" for
/// topk > E, topk < 1, E != num_experts, logits not [T, E].
RouterOutput Router(const Variable& logits, const RouterOptions& options);

struct PermuteOutput {
    Variable tokens;    // [R, H]: the kept (t, j) copies of x's rows in expert order, stable in (t, j) order
    Tensor group_sizes; // [E] int64 on x's device: rows of tokens per expert (sum = R, or <= R without host_sizes)
    Tensor row_map;     // [T, topk] int64 on x's device: row of copy (t, j) in tokens, -1 when dropped
    std::vector<std::int64_t> host_group_sizes; // the same sizes on the host (the EP dispatcher needs them for
                                                // all-to-all-v counts; reading them back is the layer's one host sync);
                                                // empty without host_sizes
    std::int64_t dropped = 0;                   // copies dropped by the capacity
};

/// x [T, H] (any float dtype of its device), indices [T, topk] int64 < num_experts on x's device. capacity < 0:
/// dropless (R = T*topk); otherwise each expert keeps its first `capacity` copies in (t, j) order and the others are
/// dropped. Backward: dx[t] = sum over j of dtokens[row_map[t, j]] (fixed j order, no atomics: bitwise deterministic).
/// host_sizes = false skips the read-back of the group sizes (no host sync: the caller passes the device group_sizes
/// on, e.g. to the grouped GEMMs): dropless only (a capacity's R is known only on the device; Error naming "Permute"
/// otherwise), R = T*topk, host_group_sizes empty. Copies whose id is out of range (the CUDA kernels drop them: a NaN
/// router row's) then leave rows past sum(group_sizes) unwritten, which no grouped GEMM, combine or backward reads.
PermuteOutput Permute(const Variable& x, const Tensor& indices, int num_experts, std::int64_t capacity = -1,
                      bool host_sizes = true);

/// The combine: y[t] = sum_j weights[t, j] * tokens[row_map[t, j]] (dropped copies contribute zero), y [T, H] in
/// tokens' dtype, accumulated in fp32, fixed j order. weights [T, topk] float32 (or tokens' dtype). The non-negative
/// entries of row_map must be distinct rows of tokens covering all of them (as Permute gives). Backward:
/// dtokens[row_map[t,j]] = weights[t,j] * dy[t], dweights[t, j] = <dy[t], tokens[row_map[t, j]]> (fp32 accumulation),
/// both deterministic.
Variable Unpermute(const Variable& tokens, const Tensor& row_map, const Variable& weights);

} // namespace shardline::autograd
