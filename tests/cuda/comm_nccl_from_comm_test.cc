// A communicator the program made itself: an ncclComm_t of one rank (ncclCommInitRank, nranks 1) handed to shardline
// with Communicator::FromNcclComm. An all-reduce of known values, the counters, and non-owning: the test destroys its
// own communicator afterwards. Skips without a GPU.

#include <cstdlib>
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

} // namespace
} // namespace shardline
