// Host-to-device uploads (Tensor::To from the CPU): the host does not wait for the work queued on the device's stream,
// and the host tensor may be changed as soon as To() returns. The stream is held by a host function that waits on a
// flag (or gives up after kGateTimeout), so an upload that waited for the stream would take the whole timeout.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kGateTimeout = std::chrono::seconds(5);

/// Holds the device's compute stream until Open() (or kGateTimeout) from a host function queued on it.
class StreamGate {
public:
    explicit StreamGate(const Device &device) {
        CudaContext &ctx = CudaContext::Get(device.index);
        launched_ = cudaLaunchHostFunc(ctx.stream(), &StreamGate::Wait, this) == cudaSuccess;
        EXPECT_TRUE(launched_) << "cudaLaunchHostFunc failed";
    }
    /// Opens the gate and waits until the host function has let go of this object.
    ~StreamGate() {
        Open();
        while (launched_ && !released_.load()) {
            std::this_thread::yield();
        }
    }
    void Open() { open_.store(true); }

private:
    static void Wait(void *self) {
        auto *gate = static_cast<StreamGate *>(self);
        const auto deadline = Clock::now() + kGateTimeout;
        while (!gate->open_.load() && Clock::now() < deadline) {
            std::this_thread::yield();
        }
        gate->released_.store(true);
    }
    bool launched_ = false;
    std::atomic<bool> open_{false};
    std::atomic<bool> released_{false};
};

Tensor RandomHost(std::int64_t n, std::uint64_t seed) {
    Tensor t = Tensor::Empty(Shape{n}, DType::kFloat32, Device::CPU());
    FillRandom(t, {.seed = seed, .name = "upload", .distribution = RandomDistribution::kUniform, .a = -1, .b = 1});
    return t;
}

class CudaUploadTest : public CudaTest {};

TEST_F(CudaUploadTest, UploadDoesNotWaitForTheStreamAndTheSourceMayChangeAtOnce) {
    const std::int64_t n = 262144 * 3 + 5; // 3 MiB and a bit: beyond the driver's own small-copy staging
    Tensor host = RandomHost(n, 1);
    const std::vector<double> expected = host.ToDoubleVector();
    Tensor device;
    double upload_s = 0;
    {
        StreamGate gate(Gpu());
        const auto t0 = Clock::now();
        device = host.To(Gpu());
        upload_s = std::chrono::duration<double>(Clock::now() - t0).count();
        host.Fill(0.0); // the caller's buffer, free to change now
        gate.Open();
    }
    EXPECT_LT(upload_s, 1.0) << "Tensor::To(cuda) waited for the work queued on the stream (" << upload_s << " s)";
    EXPECT_EQ(device.ToDoubleVector(), expected);
}

TEST_F(CudaUploadTest, ManyUploadsBehindABusyStreamEachKeepTheirOwnValues) {
    // One host tensor rewritten before every upload, 40 uploads queued behind the held stream: every upload must
    // have taken its own copy of the bytes (sizes from 1 element to 4 MiB, a staging block reused only once free).
    const std::vector<std::int64_t> sizes = {1, 3, 1000, 65537, 262144, 1048576};
    std::vector<Tensor> uploaded;
    std::vector<std::vector<double>> expected;
    {
        StreamGate gate(Gpu());
        const auto t0 = Clock::now();
        for (int i = 0; i < 40; ++i) {
            Tensor host = RandomHost(sizes[static_cast<std::size_t>(i) % sizes.size()], 100 + i);
            expected.push_back(host.ToDoubleVector());
            uploaded.push_back(host.To(Gpu()));
        }
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0)
            << "40 uploads behind a held stream took as long as the stream was held";
        gate.Open();
    }
    for (std::size_t i = 0; i < uploaded.size(); ++i) {
        EXPECT_EQ(uploaded[i].ToDoubleVector(), expected[i]) << "upload " << i;
    }
}

TEST_F(CudaUploadTest, LargeUploadsAndPinnedSourcesStayCorrect) {
    // Beyond the staging size (64 MiB) the copy goes the plain way; the values must arrive all the same.
    Tensor big = RandomHost(16777216 + 7, 7);
    EXPECT_EQ(big.To(Gpu()).ToDoubleVector(), big.ToDoubleVector());
    // A pinned source is copied directly and waited for before To() returns.
    const std::int64_t n = 4099;
    void *pinned_bytes = nullptr;
    ASSERT_EQ(cudaMallocHost(&pinned_bytes, sizeof(float) * n), cudaSuccess);
    auto *pinned = static_cast<float *>(pinned_bytes);
    std::vector<float> values(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
        values[static_cast<std::size_t>(i)] = static_cast<float>(i) * 0.25f - 17.0f;
    }
    std::copy(values.begin(), values.end(), pinned);
    Tensor device = Tensor::FromBlob(pinned, Shape{n}, DType::kFloat32, Device::CPU()).To(Gpu());
    std::fill(pinned, pinned + n, 0.0f);
    const std::vector<double> got = device.ToDoubleVector();
    for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[static_cast<std::size_t>(i)], static_cast<double>(values[static_cast<std::size_t>(i)])) << i;
    }
    ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

} // namespace
} // namespace shardline::testing
