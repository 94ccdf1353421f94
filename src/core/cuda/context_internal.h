#pragma once

// Private to src/core/cuda: context lookup without creating a context or switching the current device.

#include <shardline/core/context.h>

namespace shardline::detail {

inline constexpr int kMaxCudaDevices = 64;

/// The context of `device` if one was created, else nullptr. Never throws, never changes the current device.
CudaContext *CudaContextIfCreated(int device);

} // namespace shardline::detail
