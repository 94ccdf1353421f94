// The CUDA allocator: tensors come from the device's stream-ordered pool, which keeps its memory (release threshold
// "never"), so a steady-state loop of allocations makes no cudaMalloc: the pool's reserved memory and the device's
// free memory do not move. Reads device-wide free memory, so CMake runs this executable alone (RUN_SERIAL).

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

struct PoolState {
    std::uint64_t reserved_current = 0;
    std::uint64_t reserved_high = 0;
    std::uint64_t used_current = 0;
    std::size_t device_free = 0;
};

class CudaMemoryPoolTest : public CudaTest {
protected:
    cudaMemPool_t Pool() {
        cudaMemPool_t pool = nullptr;
        EXPECT_EQ(cudaDeviceGetMemPool(&pool, 0), cudaSuccess);
        return pool;
    }

    /// The pool's counters and the device's free memory once all queued work (and stream-ordered frees) is done.
    PoolState Read() {
        Synchronize(Gpu());
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cudaMemPool_t pool = Pool();
        PoolState s;
        EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &s.reserved_current), cudaSuccess);
        EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &s.reserved_high), cudaSuccess);
        EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &s.used_current), cudaSuccess);
        std::size_t total = 0;
        EXPECT_EQ(cudaMemGetInfo(&s.device_free, &total), cudaSuccess);
        return s;
    }
};

/// Sizes in float32 elements: from a few bytes to 64 MiB, none a multiple of the pool's granularity.
const std::vector<std::int64_t> kSizes = {1, 65, 262144 + 3, 786433, 4194304, 16777216 + 5};

/// One training-step-like round: allocate every size, touch it with a kernel, drop it (stream-ordered free).
void OneRound() {
    std::vector<Tensor> live;
    live.reserve(kSizes.size());
    for (std::int64_t n : kSizes) {
        live.push_back(Tensor::Empty(Shape{n}, DType::kFloat32, Gpu()));
        live.back().Fill(1.5);
    }
}

TEST_F(CudaMemoryPoolTest, TensorsComeFromTheDevicePool) {
    const PoolState before = Read();
    std::uint64_t used_with_tensor = 0;
    {
        Tensor big = Tensor::Empty(Shape{16777216}, DType::kFloat32, Gpu()); // 64 MiB
        big.Fill(2.0);
        used_with_tensor = Read().used_current;
    }
    EXPECT_GE(used_with_tensor, before.used_current + 64ull * 1024 * 1024)
        << "a 64 MiB CUDA tensor did not come from the device's current memory pool (cudaMallocAsync)";
    EXPECT_EQ(Read().used_current, before.used_current) << "the tensor's memory did not go back to the pool";

    std::uint64_t threshold = 0;
    ASSERT_EQ(cudaMemPoolGetAttribute(Pool(), cudaMemPoolAttrReleaseThreshold, &threshold), cudaSuccess);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    EXPECT_GE(threshold, static_cast<std::uint64_t>(total_bytes))
        << "the pool's release threshold must keep memory (\"never\" release), got " << threshold << " bytes";
}

TEST_F(CudaMemoryPoolTest, SteadyStateLoopDoesNotGrowThePoolOrTheDeviceFootprint) {
    for (int i = 0; i < 3; ++i) {
        OneRound();
    }
    const PoolState warm = Read();
    ASSERT_GT(warm.reserved_high, 0u) << "the warm-up allocated nothing from the device pool";
    for (int i = 0; i < 100; ++i) {
        OneRound();
        if (i % 10 == 9) {
            // A synchronisation is where a pool with a low release threshold would hand memory back to the driver.
            Synchronize(Gpu());
        }
    }
    const PoolState after = Read();
    EXPECT_EQ(after.reserved_high, warm.reserved_high) << "the pool grew during the steady-state loop";
    EXPECT_EQ(after.reserved_current, warm.reserved_current)
        << "the pool released or reserved memory during the steady-state loop";
    EXPECT_EQ(after.used_current, warm.used_current) << "memory leaked from the pool during the loop";
    EXPECT_EQ(after.device_free, warm.device_free)
        << "cudaMemGetInfo's free memory moved during the loop: the allocator went to the driver";
}

TEST_F(CudaMemoryPoolTest, DeviceMemoryStatsAreThePoolsCounters) {
    ResetPeakDeviceMemory(Gpu());
    const PoolState before = Read();
    const DeviceMemoryStats at_start = GetDeviceMemoryStats(Gpu());
    EXPECT_EQ(at_start.allocated, before.used_current);
    EXPECT_EQ(at_start.reserved, before.reserved_current);
    EXPECT_EQ(at_start.peak_allocated, at_start.allocated) << "ResetPeakDeviceMemory did not restart the peak";
    constexpr std::uint64_t kBytes = 96ull << 20;
    {
        Tensor big = Tensor::Empty(Shape{static_cast<std::int64_t>(kBytes / 4)}, DType::kFloat32, Gpu());
        big.Fill(3.0);
        const PoolState with = Read();
        const DeviceMemoryStats s = GetDeviceMemoryStats(Gpu());
        EXPECT_EQ(s.allocated, with.used_current);
        EXPECT_GE(s.allocated, at_start.allocated + kBytes);
        EXPECT_GE(s.reserved, s.allocated);
    }
    Read(); // the free has executed
    const DeviceMemoryStats after = GetDeviceMemoryStats(Gpu());
    EXPECT_EQ(after.allocated, at_start.allocated) << "the tensor's memory did not go back to the pool";
    EXPECT_GE(after.peak_allocated, at_start.allocated + kBytes) << "the peak forgot the 96 MiB tensor";
    EXPECT_GE(after.peak_reserved, after.peak_allocated);
    ResetPeakDeviceMemory(Gpu());
    EXPECT_EQ(GetDeviceMemoryStats(Gpu()).peak_allocated, after.allocated);
}

TEST(DeviceMemoryStatsTest, TheCpuHasNone) {
    const DeviceMemoryStats s = GetDeviceMemoryStats(Device::CPU());
    EXPECT_EQ(s.allocated + s.peak_allocated + s.reserved + s.peak_reserved, 0u);
    ResetPeakDeviceMemory(Device::CPU()); // a no-op, not an error
}

} // namespace
} // namespace shardline::testing
