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

/// Registers GroupedGemm's loop provider and the GroupedLinear* compositions as "default" for every device type.
void RegisterGroupedCompositions();

} // namespace shardline::kernels::detail
