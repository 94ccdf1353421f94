#pragma once

// Private to src/kernels: the pieces the grouped ops share between the device-agnostic compositions
// (grouped_gemm.cc, grouped_linear.cc) and the CUDA provider (cuda/grouped_gemm.cc).

#include <shardline/config.h>
#include <shardline/core/device.h>

namespace shardline::kernels::detail {

#if SHARDLINE_HAVE_CUDA
/// Whether `device`'s compute stream is being captured into a CUDA graph (cuda/grouped_gemm.cc).
bool ComputeStreamCapturing(Device device);
#endif

/// Registers GroupedGemm's loop provider and the GroupedLinear* compositions as "default" for every device type.
void RegisterGroupedCompositions();

} // namespace shardline::kernels::detail
