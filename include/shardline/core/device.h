#pragma once

#include <compare>
#include <cstdint>
#include <string>

namespace shardline {

enum class DeviceType : std::uint8_t { kCPU, kCUDA };
inline constexpr int kNumDeviceTypes = 2;

/// Where a tensor lives: the host, or one CUDA device by ordinal.
struct Device {
    DeviceType type = DeviceType::kCPU;
    int index = 0;

    static constexpr Device CPU() { return Device{DeviceType::kCPU, 0}; }
    static constexpr Device CUDA(int index = 0) { return Device{DeviceType::kCUDA, index}; }

    constexpr bool is_cpu() const { return type == DeviceType::kCPU; }
    constexpr bool is_cuda() const { return type == DeviceType::kCUDA; }
    friend constexpr bool operator==(const Device&, const Device&) = default;
};

std::string_view DeviceTypeName(DeviceType type);
/// "cpu" or "cuda:N".
std::string ToString(const Device& device);

/// Number of CUDA devices visible to this process; 0 when CUDA is not built or no GPU/driver is present.
int CudaDeviceCount();

} // namespace shardline
