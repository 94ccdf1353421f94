// A communicator the program made itself: an ncclComm_t of one rank (ncclCommInitRank, nranks 1) handed to shardline
// with Communicator::FromNcclComm. An all-reduce of known values, the counters, and non-owning: the test destroys its
// own communicator afterwards; and the watchdog retiring dropped work on such a (blocking) communicator. Skips without
// a GPU.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/device.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

namespace shardline {
namespace {

using comm::CollectiveKind;
using comm::ReduceOp;

bool HaveGpu() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

TEST(NcclFromCommTest, BorrowedSingleRankCommunicatorAllReducesAndStaysTheCallers) {
    if (!HaveGpu()) {
        GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    // NCCL reads this once per process, at its first use: a program that hands shardline its communicator sets it
    // first.
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    ncclComm_t mine = nullptr;
    ASSERT_EQ(ncclCommInitRank(&mine, 1, id, 0), ncclSuccess);
    {
        auto c = comm::Communicator::FromNcclComm(mine, {.name = "borrowed"});
        EXPECT_EQ(c->backend(), "nccl");
        EXPECT_EQ(c->size(), 1);
        EXPECT_EQ(c->rank(), 0);
        EXPECT_EQ(c->device(), Device::CUDA(0));
        const std::vector<double> values = {1, -2, 3, 8, -8, 0.5};
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
            Tensor t = Tensor::FromVector(values, {6}, DType::kFloat32).To(Device::CUDA(0));
            c->AllReduce(t, op)->Wait(/*host=*/true);
            EXPECT_EQ(t.ToDoubleVector(), values) << "one rank: every reduction is the identity";
        }
        // NCCL's in-place reduce_scatter (the output is this rank's block of the input; one rank: all of it) passes
        // the shared overlap check.
        Tensor whole = Tensor::FromVector(values, {6}, DType::kFloat32).To(Device::CUDA(0));
        Tensor block = Tensor::FromBlob(whole.data(), {6}, DType::kFloat32, Device::CUDA(0));
        c->ReduceScatter(whole, block, ReduceOp::kSum)->Wait(/*host=*/true);
        EXPECT_EQ(block.ToDoubleVector(), values);
        EXPECT_EQ(c->Counts().Calls(CollectiveKind::kReduceScatter), 1);
        EXPECT_EQ(c->Counts().Calls(CollectiveKind::kAllReduce), 3);
        EXPECT_EQ(c->Counts().Bytes(CollectiveKind::kAllReduce), 3 * 6 * 4);
        EXPECT_FALSE(c->aborted());
    }
    // Too late to switch NVLink multicast off once NCCL has read the environment: FromNcclComm refuses, naming why.
    ::setenv("NCCL_NVLS_ENABLE", "1", 1);
    try {
        (void)comm::Communicator::FromNcclComm(mine, {.name = "borrowed"});
        ADD_FAILURE() << "FromNcclComm accepted NCCL_NVLS_ENABLE=1";
    } catch (const Error& e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("expected NCCL_NVLS_ENABLE=0"));
        EXPECT_THAT(e.what(), ::testing::HasSubstr("got '1'"));
    }
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    // Non-owning: the communicator is still the test's; a collective on it works, then the test destroys it.
    float* buffer = nullptr;
    ASSERT_EQ(cudaMalloc(&buffer, sizeof(float)), cudaSuccess);
    const float two = 2.0F;
    ASSERT_EQ(cudaMemcpy(buffer, &two, sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, mine, nullptr), ncclSuccess);
    float back = 0.0F;
    ASSERT_EQ(cudaMemcpy(&back, buffer, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, 2.0F);
    EXPECT_EQ(cudaFree(buffer), cudaSuccess);
    EXPECT_EQ(ncclCommDestroy(mine), ncclSuccess);
}

// The watchdog alone retires work whose handles were dropped (no Wait) and releases the tensors it kept: a burst of
// 256 calls, then one call after the watchdog has been idle past its idle polls (100 ms) and sleeps without a deadline
// (watchdog_wake.h: only then does a call wake it; were that wake-up missing, the tensor would stay kept forever). On
// a blocking communicator, so the issue path's no-poll branch (the group returned ncclSuccess) runs too. One rank:
// every all-reduce is the identity, so the values must come back unchanged.
TEST(NcclFromCommTest, DroppedWorkIsRetiredByTheWatchdogInABurstAndAfterIdle) {
    if (!HaveGpu()) {
        GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    ncclComm_t mine = nullptr;
    ASSERT_EQ(ncclCommInitRank(&mine, 1, id, 0), ncclSuccess); // blocking
    {
        auto c = comm::Communicator::FromNcclComm(mine, {.name = "dropped"});
        const auto all_released = [](const std::vector<Tensor>& ts) {
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
            while (std::chrono::steady_clock::now() < deadline) {
                if (std::all_of(ts.begin(), ts.end(), [](const Tensor& t) { return t.storage().use_count() == 1; })) {
                    return true;
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            return false;
        };
        for (const int calls : {256, 1}) {
            std::vector<std::vector<double>> inputs;
            std::vector<Tensor> tensors;
            for (int i = 0; i < calls; ++i) {
                inputs.push_back({0.25 * i + 1, -3.5 - i, 7.0 / (i + 1), 1e3 + i});
                tensors.push_back(Tensor::FromVector(inputs.back(), {4}, DType::kFloat32).To(Device::CUDA(0)));
            }
            for (int i = 0; i < calls; ++i) {
                (void)c->AllReduce(tensors[i], ReduceOp::kSum); // the handle is dropped here
            }
            EXPECT_TRUE(all_released(tensors)) << calls << " dropped call(s) were not retired by the watchdog";
            c->Barrier()->Wait(/*host=*/true); // orders the compute stream after every collective above
            for (int i = 0; i < calls; ++i) {
                std::vector<double> expected;
                for (double v : inputs[i]) {
                    expected.push_back(static_cast<double>(static_cast<float>(v)));
                }
                EXPECT_EQ(tensors[i].ToDoubleVector(), expected) << calls << "/" << i;
            }
            EXPECT_EQ(c->Counts().Calls(CollectiveKind::kAllReduce), calls == 256 ? 256 : 257);
            // Idle past the watchdog's idle polls (100 ms), so that the single call finds it asleep.
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
        }
        EXPECT_FALSE(c->aborted());
    }
    EXPECT_EQ(ncclCommDestroy(mine), ncclSuccess);
}

} // namespace
} // namespace shardline
