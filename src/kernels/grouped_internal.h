#pragma once

// Private to src/kernels: the pieces the grouped ops share between the device-agnostic compositions
// (grouped_gemm.cc, grouped_linear.cc) and the CUDA provider (cuda/grouped_gemm.cc).

#include <shardline/config.h>
#include <shardline/core/device.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

namespace shardline::kernels::detail {

#if SHARDLINE_HAVE_CUDA
/// Whether `device`'s compute stream is being captured into a CUDA graph (cuda/grouped_gemm.cc).
bool ComputeStreamCapturing(Device device);
#endif

/// GroupedGemm as one dispatched Gemm per group (reads device sizes on the host): the default provider on the CPU,
/// and the CUDA provider's choice for few large experts and its fallback.
void LoopGroupedGemm(const GroupedGemmParams& params);

/// GroupedLinearBackwardBias as one LinearBackwardBias per group (host sizes): the default on the CPU, and CUDA's
/// under a graph capture with host sizes.
void DefaultGroupedLinearBackwardBias(const GroupedLinearBackwardBiasArgs& args);

/// GroupedBiasAdd as one BiasAdd per group (host sizes): the default on the CPU, and CUDA's under a graph capture with
/// host sizes.
void DefaultGroupedBiasAdd(const GroupedBiasAddArgs& args);

/// The GroupedGemm problems of GroupedLinearBackwardInput (dx_e = dy_e·W_e) and GroupedLinearBackwardWeight's GEMM
/// (dW_e (+)= dy_eᵀ·x_e; its dbias is not part of it), as the default kernels run them.
GroupedGemmParams GroupedDgradProblem(const GroupedLinearBackwardInputArgs& args);
GroupedGemmParams GroupedWgradProblem(const GroupedLinearBackwardWeightArgs& args);

/// GroupedLinearBackward as the split ops one after another (dbias with dweight when they share a dtype): the default
/// on every device, and the CUDA provider's serial path.
void CompositeGroupedLinearBackward(const GroupedLinearBackwardArgs& args);
/// Counts a GroupedLinearBackward whose parameter grads ran beside the dgrad (GroupedConcurrentBackwardRuns).
void CountGroupedConcurrentBackward();

/// Registers GroupedGemm's loop provider and the GroupedLinear* compositions as "default" for every device type.
void RegisterGroupedCompositions();

} // namespace shardline::kernels::detail
