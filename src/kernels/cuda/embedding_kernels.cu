// Embedding kernels (see embedding_kernels.h). No fmt/spdlog here: launchers return a cudaError_t.

#include <cub/device/device_radix_sort.cuh>

#include "device_utils.cuh"
#include "embedding_kernels.h"

namespace shardline::kernels::cuda {
namespace {

/// Whether global id `id` falls in the shard [vocab_start, vocab_start + rows). Compares before subtracting: ids are
/// arbitrary int64 values and vocab_start >= 0, so id - vocab_start could overflow for very negative ids.
__device__ __forceinline__ bool InShard(std::int64_t id, std::int64_t vocab_start, std::int64_t rows) {
    return id >= vocab_start && id - vocab_start < rows;
}

template <class W>
__global__ void EmbeddingForwardKernel(const std::int64_t *__restrict__ ids, std::int64_t n, std::int64_t vocab_start,
                                       const W *__restrict__ weight, std::int64_t rows, std::int64_t words_per_row,
                                       W *__restrict__ out) {
    const std::int64_t total = n * words_per_row;
    for (std::int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
        const std::int64_t i = idx / words_per_row;
        const std::int64_t w = idx - i * words_per_row;
        const std::int64_t id = ids[i];
        out[idx] = InShard(id, vocab_start, rows) ? weight[(id - vocab_start) * words_per_row + w] : W{};
    }
}

template <class W>
cudaError_t LaunchCopyRows(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start, const void *weight,
                           std::int64_t rows, std::int64_t row_bytes, void *out, cudaStream_t stream) {
    const std::int64_t words = row_bytes / static_cast<std::int64_t>(sizeof(W));
    EmbeddingForwardKernel<W><<<BlocksFor(n * words), kThreads, 0, stream>>>(
        ids, n, vocab_start, static_cast<const W *>(weight), rows, words, static_cast<W *>(out));
    return cudaGetLastError();
}

// The sort key of position i: its local row, or `rows` (sorting last, skipped) when the id is not in this shard.
__global__ void EmbeddingKeysKernel(const std::int64_t *__restrict__ ids, std::int64_t n, std::int64_t vocab_start,
                                    std::int64_t rows, std::uint32_t *__restrict__ keys,
                                    std::uint32_t *__restrict__ positions) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        const std::int64_t id = ids[i];
        keys[i] = static_cast<std::uint32_t>(InShard(id, vocab_start, rows) ? id - vocab_start : rows);
        positions[i] = static_cast<std::uint32_t>(i);
    }
}

// One block per run of equal sorted keys (a block visits every sorted position and works only at a run's head).
// Each thread owns columns h, h + blockDim.x, ...: it sums the run's dout rows in increasing position order in fp32,
// then rounds once into dweight. The block's control flow depends only on the keys, so it is uniform.
template <class In, class Out>
__global__ void EmbeddingRunSumKernel(const std::uint32_t *__restrict__ keys,
                                      const std::uint32_t *__restrict__ positions, std::int64_t n,
                                      std::uint32_t sentinel, const In *__restrict__ dout, Out *__restrict__ dweight,
                                      std::int64_t hidden, bool accumulate) {
    for (std::int64_t j = blockIdx.x; j < n; j += gridDim.x) {
        const std::uint32_t key = keys[j];
        if (key == sentinel || (j > 0 && keys[j - 1] == key)) {
            continue;
        }
        Out *dst = dweight + static_cast<std::int64_t>(key) * hidden;
        for (std::int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
            float s = 0.0f;
            for (std::int64_t r = j; r < n && keys[r] == key; ++r) {
                s += ToFloat(dout[static_cast<std::int64_t>(positions[r]) * hidden + h]);
            }
            dst[h] = FromFloat<Out>(accumulate ? ToFloat(dst[h]) + s : s);
        }
    }
}

constexpr std::size_t kWorkspaceAlignment = 256;

std::size_t AlignUp(std::size_t bytes) {
    return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

/// Bits of the sort keys: enough for 0 .. rows (rows is the "not in this shard" key).
int KeyBits(std::int64_t rows) {
    int bits = 1;
    while (bits < 32 && (std::int64_t{1} << bits) <= rows) {
        ++bits;
    }
    return bits;
}

cudaError_t SortBytes(std::int64_t n, std::int64_t rows, std::size_t *bytes) {
    *bytes = 0;
    return cub::DeviceRadixSort::SortPairs(
        nullptr, *bytes, static_cast<const std::uint32_t *>(nullptr), static_cast<std::uint32_t *>(nullptr),
        static_cast<const std::uint32_t *>(nullptr), static_cast<std::uint32_t *>(nullptr), static_cast<int>(n), 0,
        KeyBits(rows), cudaStream_t{nullptr});
}

} // namespace

cudaError_t LaunchEmbeddingForward(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start,
                                   const void *weight, std::int64_t rows, std::int64_t hidden, DType dtype, void *out,
                                   cudaStream_t stream) {
    if (n <= 0 || hidden <= 0) {
        return cudaSuccess;
    }
    const std::int64_t row_bytes = hidden * static_cast<std::int64_t>(ElementSize(dtype));
    // The widest word that divides a row and that both tables' rows start on (the row size keeps row r aligned when
    // row 0 is).
    for (const std::int64_t word : {16, 8, 4}) {
        if (row_bytes % word == 0 && IsAligned(out, static_cast<std::size_t>(word)) &&
            (rows == 0 || IsAligned(weight, static_cast<std::size_t>(word)))) {
            switch (word) {
            case 16:
                return LaunchCopyRows<uint4>(ids, n, vocab_start, weight, rows, row_bytes, out, stream);
            case 8:
                return LaunchCopyRows<uint2>(ids, n, vocab_start, weight, rows, row_bytes, out, stream);
            default:
                return LaunchCopyRows<std::uint32_t>(ids, n, vocab_start, weight, rows, row_bytes, out, stream);
            }
        }
    }
    return LaunchCopyRows<std::uint16_t>(ids, n, vocab_start, weight, rows, row_bytes, out, stream);
}

cudaError_t EmbeddingBackwardWorkspace(std::int64_t n, std::int64_t rows, std::size_t *bytes) {
    std::size_t sort_bytes = 0;
    const cudaError_t status = SortBytes(n, rows, &sort_bytes);
    *bytes = 4 * AlignUp(static_cast<std::size_t>(n) * sizeof(std::uint32_t)) + AlignUp(sort_bytes);
    return status;
}

cudaError_t LaunchEmbeddingBackward(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start, const void *dout,
                                    DType dout_dtype, void *dweight, DType dweight_dtype, std::int64_t rows,
                                    std::int64_t hidden, bool accumulate, void *workspace, std::size_t workspace_bytes,
                                    cudaStream_t stream) {
    if (rows <= 0 || hidden <= 0) {
        return cudaSuccess;
    }
    if (n >= (std::int64_t{1} << 31) || rows >= (std::int64_t{1} << 31) - 1) {
        return cudaErrorInvalidValue;
    }
    if (!accumulate) {
        const std::size_t bytes = static_cast<std::size_t>(rows * hidden) * ElementSize(dweight_dtype);
        if (const cudaError_t status = cudaMemsetAsync(dweight, 0, bytes, stream); status != cudaSuccess) {
            return status;
        }
    }
    if (n <= 0) {
        return cudaSuccess;
    }
    std::size_t sort_bytes = 0;
    if (const cudaError_t status = SortBytes(n, rows, &sort_bytes); status != cudaSuccess) {
        return status;
    }
    const std::size_t array_bytes = AlignUp(static_cast<std::size_t>(n) * sizeof(std::uint32_t));
    if (workspace == nullptr || workspace_bytes < 4 * array_bytes + sort_bytes) {
        return cudaErrorInvalidValue;
    }
    char *base = static_cast<char *>(workspace);
    auto *keys_in = reinterpret_cast<std::uint32_t *>(base);
    auto *keys_out = reinterpret_cast<std::uint32_t *>(base + array_bytes);
    auto *pos_in = reinterpret_cast<std::uint32_t *>(base + 2 * array_bytes);
    auto *pos_out = reinterpret_cast<std::uint32_t *>(base + 3 * array_bytes);
    void *sort_temp = base + 4 * array_bytes;

    EmbeddingKeysKernel<<<BlocksFor(n), kThreads, 0, stream>>>(ids, n, vocab_start, rows, keys_in, pos_in);
    if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) {
        return status;
    }
    // LSD radix sort is stable: equal keys keep their positions' increasing order, which fixes the summation order.
    if (const cudaError_t status = cub::DeviceRadixSort::SortPairs(
            sort_temp, sort_bytes, keys_in, keys_out, pos_in, pos_out, static_cast<int>(n), 0, KeyBits(rows), stream);
        status != cudaSuccess) {
        return status;
    }
    constexpr int kRunThreads = 128;
    const int blocks = static_cast<int>(n < (std::int64_t{1} << 20) ? n : (std::int64_t{1} << 20));
    return WithFloatTypes(dout_dtype, dweight_dtype, [&](auto in_tag, auto out_tag) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        EmbeddingRunSumKernel<In, Out><<<blocks, kRunThreads, 0, stream>>>(
            keys_out, pos_out, n, static_cast<std::uint32_t>(rows), static_cast<const In *>(dout),
            static_cast<Out *>(dweight), hidden, accumulate);
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
