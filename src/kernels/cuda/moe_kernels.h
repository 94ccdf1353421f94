#pragma once

// Launchers for the mixture-of-experts kernels (moe_router_kernels.cu: the router; moe_kernels.cu: the permutation).
// Declarations only: host code includes this without nvcc. Each returns the launch status for SHARDLINE_CHECK_CUDA.
// Every kernel is deterministic: sums run in a fixed order (warp butterflies, fixed row chunks, sequential loops), and
// the only atomics are integer counts.

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// The router kernels keep a row's scores in registers: one warp per token, 8 experts per lane.
inline constexpr int kMoEMaxExperts = 256;
inline constexpr int kMoEMaxTopk = 8;
/// The gather and the combine hold a token's slots in its warp's lanes: their launchers return cudaErrorInvalidValue
/// for topk > kMoEMaxRowTopk (kernels/moe.cc raises a ShapeError first).
inline constexpr int kMoEMaxRowTopk = 32;

struct MoERouterShape {
    std::int64_t tokens = 0;
    int experts = 0; ///< <= kMoEMaxExperts
    int topk = 1;    ///< <= kMoEMaxTopk, <= experts
    bool sigmoid = false;
    bool normalize = true; ///< renormalise the chosen scores (NormalizesTopk)
};

/// Scratch of LaunchMoERouterForward: with losses, the per-row statistics [T, E + 1] (p[t, :] and lse_t²) and the
/// per-chunk column sums; none without.
std::size_t MoERouterForwardWorkspace(const MoERouterShape &shape, bool losses);

/// weights [T, k] fp32, indices [T, k] int64 (descending logits, ties to the lower id), counts [E] int64; with `aux`
/// and/or `z` (device fp32 scalars) the losses: aux = aux_scale·Σ_e count_e·Σ_t p[t, e] with aux_scale = coeff·E /
/// (T²·k), z = z_scale·Σ_t lse_t² with z_scale = coeff / T. Handles T = 0 (zero counts and losses).
cudaError_t LaunchMoERouterForward(const float *logits, const MoERouterShape &shape, float *weights,
                                   std::int64_t *indices, std::int64_t *counts, float *aux, float aux_scale, float *z,
                                   float z_scale, void *workspace, std::size_t workspace_bytes, cudaStream_t stream);

/// dlogits [T, E] fp32 = the gradient of <dweights, weights> (dweights may be null) + daux·aux + dz·z (device scalars,
/// either may be null), recomputed per row from the logits. aux_scale as in the forward; z_scale = coeff·2 / T.
cudaError_t LaunchMoERouterBackward(const float *logits, const MoERouterShape &shape, const std::int64_t *indices,
                                    const std::int64_t *counts, const float *dweights, const float *daux,
                                    float aux_scale, const float *dz, float z_scale, float *dlogits,
                                    cudaStream_t stream);

/// Scratch of LaunchMoEPermuteMap for `copies` = T·k copies over E experts (fewer than 2^31 copies).
cudaError_t MoEPermuteMapWorkspace(std::int64_t copies, int experts, std::size_t *bytes);

/// row_map [copies] and group_sizes [E] (int64): the copies radix-sorted stably by expert (CUB, copy index as the
/// value), each copy's rank within its expert, kept when rank < capacity (capacity < 0: all). Ids outside [0, E) sort
/// after every expert and get row -1 (dropped, counted in no group).
cudaError_t LaunchMoEPermuteMap(const std::int64_t *ids, std::int64_t copies, int experts, std::int64_t capacity,
                                std::int64_t *row_map, std::int64_t *group_sizes, void *workspace,
                                std::size_t workspace_bytes, cudaStream_t stream);

/// out[row_map[i]] = x[i / k] for every copy i < T·k with row_map[i] >= 0, times weights[i] (fp32 math, one
/// rounding) when weights is given. x/out of `dtype`, weights of `weights_dtype` (fp32 or dtype).
cudaError_t LaunchMoEPermuteRows(const void *x, std::int64_t tokens, int topk, std::int64_t hidden, DType dtype,
                                 const std::int64_t *row_map, const void *weights, DType weights_dtype, void *out,
                                 cudaStream_t stream);

/// y[t] = Σ_{j < k, row_map[t, j] >= 0} weights[t, j]·tokens[row_map[t, j]] (weights null: ones), j in increasing
/// order, fp32 accumulation, one rounding.
cudaError_t LaunchMoEUnpermuteRows(const void *tokens, std::int64_t hidden, DType dtype, const std::int64_t *row_map,
                                   std::int64_t num_tokens, int topk, const void *weights, DType weights_dtype, void *y,
                                   cudaStream_t stream);

/// dweights[i] = Σ_h dy[i / k, h]·tokens[row_map[i], h] (0 when row_map[i] < 0): one warp per copy, 16-byte loads where
/// the width and both pointers allow, fp32 partial sums per lane in increasing h, then a fixed butterfly.
cudaError_t LaunchMoEUnpermuteWeightsGrad(const void *dy, const void *tokens, std::int64_t hidden, DType dtype,
                                          const std::int64_t *row_map, std::int64_t num_tokens, int topk,
                                          void *dweights, DType dweights_dtype, cudaStream_t stream);

} // namespace shardline::kernels::cuda
