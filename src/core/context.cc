#include <shardline/core/context.h>

#include "cuda_backend.h"

namespace shardline {

void Synchronize(Device device) {
#if SHARDLINE_HAVE_CUDA
    if (device.is_cuda()) {
        detail::CudaSynchronize(device.index);
    }
#endif
}

} // namespace shardline
