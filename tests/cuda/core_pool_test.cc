// The CUDA allocator: tensors come from the device's stream-ordered pool, which keeps its memory (release threshold
// "never"), so a steady-state loop of allocations makes no cudaMalloc: the pool's reserved memory and the device's
// free memory do not move. Small blocks are reused through a cache in front of the pool, never inside a capture. Reads
// device-wide free memory, so CMake runs this executable alone (RUN_SERIAL).

#include <cstdint>
#include <set>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
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

// The small-block cache in front of the pool (core/cuda_backend.h): a freed block of at most 1 MiB is handed to the
// next allocation of its 512-byte size class without going through the pool; a bigger one goes back to the pool.
TEST_F(CudaMemoryPoolTest, SmallBlocksComeBackFromTheCacheAndBigOnesFromThePool) {
    if (!env::GetBool("SHARDLINE_CUDA_BLOCK_CACHE", true)) {
        GTEST_SKIP() << "SHARDLINE_CUDA_BLOCK_CACHE=0 turns the small-block cache off";
    }
    constexpr std::int64_t kN = 1000; // 4000 bytes: the 4096-byte class
    void* first = nullptr;
    {
        Tensor t = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
        t.Fill(1.0);
        first = t.data();
    }
    const PoolState cached = Read();
    {
        Tensor t = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
        EXPECT_EQ(t.data(), first) << "the freed 4000-byte block was not reused";
        EXPECT_EQ(Read().used_current, cached.used_current) << "the second allocation went to the pool";
        t.Fill(2.0);
        for (const double v : t.ToDoubleVector()) {
            ASSERT_EQ(v, 2.0);
        }
    }
    {
        Tensor t = Tensor::Empty(Shape{1024}, DType::kFloat32, Gpu()); // 4096 bytes: the same class
        EXPECT_EQ(t.data(), first) << "a block of the same 512-byte class was not reused";
    }
    {
        Tensor t = Tensor::Empty(Shape{1025}, DType::kFloat32, Gpu()); // 4100 bytes: the next class up
        EXPECT_NE(t.data(), first) << "a 4096-byte block was handed out for 4100 bytes";
    }
    const PoolState before_big = Read();
    {
        Tensor big = Tensor::Empty(Shape{(2 << 20) / 4}, DType::kFloat32, Gpu()); // 2 MiB: not cached
        big.Fill(1.0);
        EXPECT_GE(Read().used_current, before_big.used_current + (2u << 20));
    }
    EXPECT_EQ(Read().used_current, before_big.used_current) << "a 2 MiB block was kept out of the pool";
}

// The cache keeps at most 32 MiB per device: freeing 48 live 1 MiB blocks leaves at most 32 MiB of them out of the
// pool, and the next 1 MiB allocation is one of them.
TEST_F(CudaMemoryPoolTest, TheCacheKeepsAtMost32MiB) {
    if (!env::GetBool("SHARDLINE_CUDA_BLOCK_CACHE", true)) {
        GTEST_SKIP() << "SHARDLINE_CUDA_BLOCK_CACHE=0 turns the small-block cache off";
    }
    constexpr std::int64_t kMiB = std::int64_t{1} << 20;
    const PoolState before = Read();
    std::set<void*> freed;
    {
        std::vector<Tensor> blocks;
        for (int i = 0; i < 48; ++i) {
            blocks.push_back(Tensor::Empty(Shape{kMiB / 4}, DType::kFloat32, Gpu()));
            freed.insert(blocks.back().data());
        }
    }
    EXPECT_LE(Read().used_current, before.used_current + 32 * static_cast<std::uint64_t>(kMiB));
    const Tensor again = Tensor::Empty(Shape{kMiB / 4}, DType::kFloat32, Gpu());
    EXPECT_EQ(freed.count(again.data()), 1u) << "a freed 1 MiB block was not kept";
}

// Under a stream capture the pool makes graph allocations: a capture must neither take a cached block (the graph would
// write it on every replay while eager work reuses it) nor leave one of its blocks in the cache.
TEST_F(CudaMemoryPoolTest, AStreamCaptureNeitherTakesNorLeavesCachedBlocks) {
    if (!env::GetBool("SHARDLINE_CUDA_BLOCK_CACHE", true)) {
        GTEST_SKIP() << "SHARDLINE_CUDA_BLOCK_CACHE=0 turns the small-block cache off";
    }
    constexpr std::int64_t kN = 3000; // the 12288-byte class
    void* cached = nullptr;
    {
        Tensor t = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
        t.Fill(1.0);
        cached = t.data();
    }
    Synchronize(Gpu());
    const cudaStream_t stream = CudaContext::Get(0).stream();
    cudaGraph_t graph = nullptr;
    void* in_graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    {
        Tensor t = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
        t.Fill(3.0);
        in_graph = t.data();
    } // freed inside the capture: a free node of the graph
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_NE(in_graph, cached) << "an allocation inside a capture took a cached block";
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    // The cache still holds the eager block, and only it: the graph's block, had it been cached last, would come first.
    Tensor a = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
    EXPECT_EQ(a.data(), cached) << "the cached block was lost, or the capture's block was cached";
    Tensor b = Tensor::Empty(Shape{kN}, DType::kFloat32, Gpu());
    EXPECT_NE(b.data(), cached);
    b.Fill(4.0);
    a.Fill(5.0);
    for (const double v : b.ToDoubleVector()) {
        ASSERT_EQ(v, 4.0);
    }
}

TEST(DeviceMemoryStatsTest, TheCpuHasNone) {
    const DeviceMemoryStats s = GetDeviceMemoryStats(Device::CPU());
    EXPECT_EQ(s.allocated + s.peak_allocated + s.reserved + s.peak_reserved, 0u);
    ResetPeakDeviceMemory(Device::CPU()); // a no-op, not an error
}

} // namespace
} // namespace shardline::testing
