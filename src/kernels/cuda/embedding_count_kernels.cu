// The count matrix of EmbeddingBag's count-GEMM path (see embedding_kernels.h). No fmt/spdlog here: the launcher
// returns a cudaError_t.

#include <cstdint>

#include "device_utils.cuh"
#include "embedding_kernels.h"

namespace shardline::kernels::cuda {
namespace {

constexpr int kCountThreads = 256;
/// Columns of one histogram pass: 32 KiB of shared ints, a multiple of every vector width below. The README's char-LM
/// shard (2752 rows) takes one pass.
constexpr std::int64_t kCountTile = 8192;
/// Elements per 16-byte store; the leading dimension is a multiple of 8, so of every kVec.
constexpr std::int64_t kLdMultiple = 8;

/// Block b owns bag rows b, b + gridDim.x, ...: for each tile of columns it zeroes a shared histogram, adds one per id
/// of the row that falls in the tile (integer atomics: the counts do not depend on their order), and writes the tile
/// converted to T with 16-byte stores. Columns rows..ld-1 are never hit, so they are written as zeros.
template <class T>
__global__ void __launch_bounds__(kCountThreads)
    EmbeddingBagCountsKernel(const std::int64_t *__restrict__ ids, std::int64_t bag, std::int64_t count,
                             std::int64_t vocab_start, std::int64_t rows, std::int64_t ld, T *__restrict__ counts) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    using Vec = AlignedVector<T, kVec>;
    __shared__ int histogram[kCountTile];
    for (std::int64_t n = blockIdx.x; n < count; n += gridDim.x) {
        T *row = counts + n * ld;
        for (std::int64_t v0 = 0; v0 < ld; v0 += kCountTile) {
            const std::int64_t width = ld - v0 < kCountTile ? ld - v0 : kCountTile; // a multiple of kVec
            for (std::int64_t c = threadIdx.x; c < width; c += blockDim.x) {
                histogram[c] = 0;
            }
            __syncthreads();
            for (std::int64_t t = threadIdx.x; t < bag; t += blockDim.x) {
                const std::int64_t id = ids[t * count + n];
                // Compare before subtracting: ids are arbitrary int64 values (see InShard in embedding_kernels.cu).
                if (id >= vocab_start && id - vocab_start < rows) {
                    const std::int64_t c = id - vocab_start - v0;
                    if (c >= 0 && c < width) {
                        atomicAdd(&histogram[c], 1);
                    }
                }
            }
            __syncthreads();
            Vec *out = reinterpret_cast<Vec *>(row + v0);
            for (std::int64_t c = threadIdx.x; c < width / kVec; c += blockDim.x) {
                Vec v;
#pragma unroll
                for (int k = 0; k < kVec; ++k) {
                    v.val[k] = FromFloat<T>(static_cast<float>(histogram[c * kVec + k]));
                }
                out[c] = v;
            }
            __syncthreads(); // the histogram is zeroed again by the next pass or row
        }
    }
}

} // namespace

std::int64_t EmbeddingBagCountsLd(std::int64_t rows) { return (rows + kLdMultiple - 1) / kLdMultiple * kLdMultiple; }

cudaError_t LaunchEmbeddingBagCounts(const std::int64_t *ids, std::int64_t bag, std::int64_t count,
                                     std::int64_t vocab_start, std::int64_t rows, DType dtype, void *counts,
                                     cudaStream_t stream) {
    if (count <= 0 || rows <= 0) {
        return cudaSuccess;
    }
    if (!IsAligned(counts, 16) || bag < 0) {
        return cudaErrorInvalidValue;
    }
    const std::int64_t ld = EmbeddingBagCountsLd(rows);
    constexpr std::int64_t kMaxGrid = std::int64_t{1} << 20;
    const auto blocks = static_cast<unsigned>(count < kMaxGrid ? count : kMaxGrid);
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        EmbeddingBagCountsKernel<T>
            <<<blocks, kCountThreads, 0, stream>>>(ids, bag, count, vocab_start, rows, ld, static_cast<T *>(counts));
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
