#include <fmt/format.h>

#include <shardline/core/device.h>

#include "cuda_backend.h"

namespace shardline {

std::string_view DeviceTypeName(DeviceType type) { return type == DeviceType::kCPU ? "cpu" : "cuda"; }

std::string ToString(const Device& device) {
    return device.is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", device.index);
}

int CudaDeviceCount() {
#if SHARDLINE_HAVE_CUDA
    static const int count = detail::CudaDeviceCountImpl();
    return count;
#else
    return 0;
#endif
}

} // namespace shardline
