// The CUDA embedding kernels' temporary memory. The sorted backward's workspace (sort keys and values, runs, CUB's
// scratch) grows with the number of ids and never with dout or the table's width; it comes from the device pool and
// goes back to it when the kernels are queued. EmbeddingBag never makes the [T, N, H] lookup: at the README job's shape
// (ids 32 x 8192, H 2048, bf16) the device pool's high-water mark rises by the output alone in the forward and by the
// workspace alone in the backward; on the count-GEMM path by the count matrix alone in each. The numbers are printed
// for the record.

#include <algorithm>
#include <cstdint>
#include <iostream>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/embedding.h>

#include "embedding_bag_reference.h"
#include "helpers.h"
#include "kernels/cuda/embedding_kernels.h"

namespace shardline::testing {
namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;
// The README job: context 32, batch 8192, hidden 2048, a 128-row padded vocabulary per position (table 32·128 rows).
constexpr std::int64_t kContext = 32;
constexpr std::int64_t kBatch = 8192;
constexpr std::int64_t kHidden = 2048;
constexpr std::int64_t kTableRows = 32 * 128;

std::uint64_t AlignUp(std::uint64_t bytes) { return (bytes + 255) / 256 * 256; }

/// The workspace's own arrays: 2 key and 2 value buffers of n uint32, 3 run arrays of min(n, rows + 1), the run count.
std::uint64_t ArrayBytes(std::int64_t n, std::int64_t rows) {
    const auto runs = static_cast<std::uint64_t>(std::min(n, rows + 1));
    return 4 * AlignUp(4 * static_cast<std::uint64_t>(n)) + 3 * AlignUp(4 * runs) + 256;
}

class CudaEmbeddingMemoryTest : public CudaTest {
protected:
    cudaMemPool_t Pool() {
        cudaMemPool_t pool = nullptr;
        EXPECT_EQ(cudaDeviceGetMemPool(&pool, 0), cudaSuccess);
        return pool;
    }
    std::uint64_t Attribute(cudaMemPoolAttr attr) {
        std::uint64_t value = 0;
        EXPECT_EQ(cudaMemPoolGetAttribute(Pool(), attr, &value), cudaSuccess);
        return value;
    }
    /// Waits for the queued work (and its stream-ordered frees), then starts a new high-water mark at the current use.
    std::uint64_t ResetHighWater() {
        Synchronize(Gpu());
        std::uint64_t zero = 0;
        EXPECT_EQ(cudaMemPoolSetAttribute(Pool(), cudaMemPoolAttrUsedMemHigh, &zero), cudaSuccess);
        return Attribute(cudaMemPoolAttrUsedMemCurrent);
    }
    /// How far the pool's use rose above `before` since ResetHighWater, once the queued work is done. (A reset high
    /// mark restarts at the current use; max() keeps this right should it restart at zero.)
    std::uint64_t RiseAbove(std::uint64_t before) {
        Synchronize(Gpu());
        return std::max(Attribute(cudaMemPoolAttrUsedMemHigh), before) - before;
    }
};

TEST_F(CudaEmbeddingMemoryTest, BackwardWorkspaceIsSizedByTheIdsOnly) {
    struct Shape2 {
        std::int64_t n, rows;
    };
    for (const Shape2 s :
         {Shape2{kContext * kBatch, kTableRows}, Shape2{kContext * kBatch, 50257}, Shape2{4096, 50257}, Shape2{1, 1}}) {
        std::size_t bytes = 0;
        ASSERT_EQ(kernels::cuda::EmbeddingBackwardWorkspace(s.n, s.rows, &bytes), cudaSuccess);
        const std::uint64_t arrays = ArrayBytes(s.n, s.rows);
        std::cout << "[ memory   ] EmbeddingBackward workspace for " << s.n << " ids over " << s.rows
                  << " rows: " << bytes << " bytes (" << arrays << " in its arrays, " << bytes - arrays
                  << " CUB scratch)\n";
        EXPECT_GE(bytes, arrays);
        // CUB's double-buffered sort, run-length encoding and scan keep histograms and tile states, not copies of
        // the keys: well under the arrays' size at the large shapes.
        EXPECT_LE(bytes - arrays, std::max<std::uint64_t>(kMiB, arrays / 4)) << s.n << " ids, " << s.rows << " rows";
    }
}

TEST_F(CudaEmbeddingMemoryTest, BagSumNeverMakesTheLookup) {
    // The gather path (the count-GEMM's count matrix is the next test's).
    const ScopedEmbeddingBagImpl gather(kernels::EmbeddingBagImpl::kGather);
    const Device gpu = Gpu();
    const Tensor ids = RandomTensor({kContext, kBatch}, DType::kInt64, gpu, 7, "ids", RandomDistribution::kInteger, 0,
                                    static_cast<double>(kTableRows - 1));
    const Tensor table = RandomGpu({kTableRows, kHidden}, DType::kBFloat16, 7, "table");
    const Tensor dout = RandomGpu({kBatch, kHidden}, DType::kBFloat16, 7, "dout");
    Tensor main_grad = Tensor::Zeros({kTableRows, kHidden}, DType::kFloat32, gpu);
    Tensor out = Tensor::Empty({kBatch, kHidden}, DType::kBFloat16, gpu);
    auto forward = [&] { kernels::EmbeddingBagForward({.ids = ids, .weight = table, .out = out}); };
    auto backward = [&] {
        kernels::EmbeddingBagBackward({.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
    };
    forward(); // warm-up: the context, its stream and the pool's first blocks
    backward();

    const std::uint64_t lookup = static_cast<std::uint64_t>(kContext * kBatch * kHidden) * 2; // the 1 GiB it avoids
    std::uint64_t before = ResetHighWater();
    forward();
    const std::uint64_t forward_peak = RiseAbove(before);
    std::cout << "[ memory   ] EmbeddingBagForward: pool high-water +" << forward_peak << " bytes (the [T, N, H] "
              << "lookup would be " << lookup << ")\n";
    EXPECT_EQ(forward_peak, 0u) << "the forward into a given output allocates nothing";

    std::size_t workspace = 0;
    ASSERT_EQ(kernels::cuda::EmbeddingBackwardWorkspace(kContext * kBatch, kTableRows, &workspace), cudaSuccess);
    before = ResetHighWater();
    backward();
    const std::uint64_t backward_peak = RiseAbove(before);
    std::cout << "[ memory   ] EmbeddingBagBackward: pool high-water +" << backward_peak << " bytes (workspace "
              << workspace << ")\n";
    EXPECT_GE(backward_peak, workspace);
    EXPECT_LE(backward_peak, workspace + 2 * kMiB) << "more than the workspace (and the pool's rounding)";
    EXPECT_EQ(Attribute(cudaMemPoolAttrUsedMemCurrent), before) << "the workspace did not go back to the pool";
}

TEST_F(CudaEmbeddingMemoryTest, CountGemmTakesItsCountMatrixOnlyAndGivesItBack) {
    // The count-GEMM path at the same shape: the pool rises by the [N, V_local] count matrix (bf16, rows padded to a
    // multiple of 8) in each direction, 64 MiB here against the 1 GiB lookup, and gets it back once the GEMM is queued.
    const ScopedEmbeddingBagImpl gemm(kernels::EmbeddingBagImpl::kGemm);
    const Device gpu = Gpu();
    const Tensor ids = RandomTensor({kContext, kBatch}, DType::kInt64, gpu, 8, "ids", RandomDistribution::kInteger, 0,
                                    static_cast<double>(kTableRows - 1));
    const Tensor table = RandomGpu({kTableRows, kHidden}, DType::kBFloat16, 8, "table");
    const Tensor dout = RandomGpu({kBatch, kHidden}, DType::kBFloat16, 8, "dout");
    Tensor main_grad = Tensor::Zeros({kTableRows, kHidden}, DType::kFloat32, gpu);
    Tensor out = Tensor::Empty({kBatch, kHidden}, DType::kBFloat16, gpu);
    auto forward = [&] { kernels::EmbeddingBagForward({.ids = ids, .weight = table, .out = out}); };
    auto backward = [&] {
        kernels::EmbeddingBagBackward({.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
    };
    forward(); // warm-up: the GEMM plans are tuned (their scratch allocated) at the first call
    backward();
    const std::uint64_t counts =
        static_cast<std::uint64_t>(kBatch) * kernels::cuda::EmbeddingBagCountsLd(kTableRows) * 2;
    for (const bool is_forward : {true, false}) {
        const std::uint64_t before = ResetHighWater();
        is_forward ? forward() : backward();
        const std::uint64_t peak = RiseAbove(before);
        std::cout << "[ memory   ] EmbeddingBag" << (is_forward ? "Forward" : "Backward")
                  << " count-GEMM: pool high-water +" << peak << " bytes (count matrix " << counts << ")\n";
        EXPECT_GE(peak, counts);
        EXPECT_LE(peak, counts + 2 * kMiB) << "more than the count matrix (and the pool's rounding)";
        EXPECT_EQ(Attribute(cudaMemPoolAttrUsedMemCurrent), before) << "the count matrix did not go back to the pool";
    }
}

} // namespace
} // namespace shardline::testing
