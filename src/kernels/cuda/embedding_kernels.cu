// Embedding kernels (see embedding_kernels.h). No fmt/spdlog here: launchers return a cudaError_t.

#include <algorithm>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

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

/// out[n, :] = Σ_t weight[ids[t·count + n] - vocab_start, :] (ids in the shard only). Thread idx owns vector c of
/// output row n (idx = n·vectors_per_row + c): consecutive threads read consecutive vectors of one table row, and a
/// warp's id loads mostly hit one address. kUnroll ids are loaded before their rows, and the rows before any is
/// added, so that kUnroll row reads are in flight at once; the additions still run in increasing t.
template <class T, int kVec>
__global__ void EmbeddingBagForwardKernel(const std::int64_t *__restrict__ ids, std::int64_t bag, std::int64_t count,
                                          std::int64_t vocab_start, const T *__restrict__ weight, std::int64_t rows,
                                          std::int64_t vectors_per_row, T *__restrict__ out) {
    using Vec = AlignedVector<T, kVec>;
    constexpr int kUnroll = 4;
    const Vec *table = reinterpret_cast<const Vec *>(weight);
    const std::int64_t total = count * vectors_per_row;
    for (std::int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
        const std::int64_t n = idx / vectors_per_row;
        const std::int64_t c = idx - n * vectors_per_row;
        const std::int64_t *column = ids + n;
        float acc[kVec] = {};
        std::int64_t t = 0;
        for (; t + kUnroll <= bag; t += kUnroll) {
            std::int64_t id[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                id[u] = column[(t + u) * count];
            }
            bool hit[kUnroll];
            Vec row[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                hit[u] = InShard(id[u], vocab_start, rows);
                if (hit[u]) {
                    row[u] = table[(id[u] - vocab_start) * vectors_per_row + c];
                }
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (hit[u]) {
#pragma unroll
                    for (int k = 0; k < kVec; ++k) {
                        acc[k] += ToFloat(row[u].val[k]);
                    }
                }
            }
        }
        for (; t < bag; ++t) {
            const std::int64_t id = column[t * count];
            if (InShard(id, vocab_start, rows)) {
                const Vec row = table[(id - vocab_start) * vectors_per_row + c];
#pragma unroll
                for (int k = 0; k < kVec; ++k) {
                    acc[k] += ToFloat(row.val[k]);
                }
            }
        }
        Vec result;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            result.val[k] = FromFloat<T>(acc[k]);
        }
        reinterpret_cast<Vec *>(out)[idx] = result;
    }
}

// The sort key of position i: its local row, or `rows` (sorting last, skipped) when the id is not in this shard; its
// value the dout row it reads, i mod dout_rows. The sort is stable, so the values of one key stay in increasing i.
__global__ void EmbeddingKeysKernel(const std::int64_t *__restrict__ ids, std::int64_t n, std::int64_t vocab_start,
                                    std::int64_t rows, std::int64_t dout_rows, std::uint32_t *__restrict__ keys,
                                    std::uint32_t *__restrict__ dout_row_of) {
    for (std::int64_t i = GlobalThread(); i < n; i += GridThreads()) {
        const std::int64_t id = ids[i];
        keys[i] = static_cast<std::uint32_t>(InShard(id, vocab_start, rows) ? id - vocab_start : rows);
        dout_row_of[i] = static_cast<std::uint32_t>(i % dout_rows);
    }
}

// The segment sum. Grid: x = column tiles of kSegmentColumns, y = runs of equal sorted keys (grid-stride).
// Warp w of the block sums the dout rows of the run's entries w, w + kSegmentWarps, w + 2·kSegmentWarps, ... (in
// increasing position) for its lane's kSegmentVec columns in fp32; then the kSegmentWarps partial sums are added in
// warp order and rounded once into dweight. The order of every addition is fixed by the run's length alone, never by
// scheduling, so the result is bitwise reproducible; and a long run (one frequent id) is summed by kSegmentWarps warps
// in each of hidden / kSegmentColumns blocks instead of serially by one block.
constexpr int kSegmentWarps = 4;
constexpr int kSegmentVec = 4;
constexpr int kSegmentColumns = 32 * kSegmentVec;

template <class In, class Out>
__global__ void __launch_bounds__(32 * kSegmentWarps)
    EmbeddingSegmentSumKernel(const std::uint32_t *__restrict__ run_keys, const int *__restrict__ run_lengths,
                              const int *__restrict__ run_offsets, const int *__restrict__ num_runs,
                              std::int64_t max_runs, const std::uint32_t *__restrict__ dout_row_of,
                              std::uint32_t sentinel, const In *__restrict__ dout, Out *__restrict__ dweight,
                              std::int64_t hidden, bool accumulate) {
    __shared__ float partial[kSegmentWarps][kSegmentColumns];
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * kSegmentColumns;
    const std::int64_t runs = *num_runs < max_runs ? *num_runs : max_runs;
    for (std::int64_t r = blockIdx.y; r < runs; r += gridDim.y) {
        const std::uint32_t key = run_keys[r];
        if (key == sentinel) {
            continue; // ids outside this shard sort last; the block's branch is uniform
        }
        const std::int64_t begin = run_offsets[r];
        const std::int64_t end = begin + run_lengths[r];
        float acc[kSegmentVec] = {};
        for (std::int64_t j = begin + warp; j < end; j += kSegmentWarps) { // int64: end may be near 2^31
            const In *row = dout + static_cast<std::int64_t>(dout_row_of[j]) * hidden;
#pragma unroll
            for (int v = 0; v < kSegmentVec; ++v) {
                const std::int64_t h = col0 + v * 32 + lane;
                if (h < hidden) {
                    acc[v] += ToFloat(row[h]);
                }
            }
        }
#pragma unroll
        for (int v = 0; v < kSegmentVec; ++v) {
            partial[warp][v * 32 + lane] = acc[v];
        }
        __syncthreads();
        Out *dst = dweight + static_cast<std::int64_t>(key) * hidden;
        for (int c = static_cast<int>(threadIdx.x); c < kSegmentColumns; c += 32 * kSegmentWarps) {
            const std::int64_t h = col0 + c;
            if (h < hidden) {
                float s = partial[0][c];
#pragma unroll
                for (int w = 1; w < kSegmentWarps; ++w) {
                    s += partial[w][c];
                }
                dst[h] = FromFloat<Out>(accumulate ? ToFloat(dst[h]) + s : s);
            }
        }
        __syncthreads(); // partial is reused by the next run
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

/// At most one run per table row plus the "not in this shard" run, and never more runs than ids.
std::int64_t MaxRuns(std::int64_t n, std::int64_t rows) { return n < rows + 1 ? n : rows + 1; }

/// The scratch CUB needs for the sort, the run-length encoding and the scan (one region: they run one after another).
/// The sort is CUB's double-buffered one: it alternates between our two key and two value buffers instead of
/// allocating its own copies of them, so its scratch is histograms and tile states only.
cudaError_t TempBytes(std::int64_t n, std::int64_t rows, std::size_t *bytes) {
    std::size_t sort = 0;
    std::size_t encode = 0;
    std::size_t scan = 0;
    cub::DoubleBuffer<std::uint32_t> keys(nullptr, nullptr);
    cub::DoubleBuffer<std::uint32_t> values(nullptr, nullptr);
    cudaError_t status = cub::DeviceRadixSort::SortPairs(nullptr, sort, keys, values, static_cast<int>(n), 0,
                                                         KeyBits(rows), cudaStream_t{nullptr});
    if (status == cudaSuccess) {
        status = cub::DeviceRunLengthEncode::Encode(
            nullptr, encode, static_cast<const std::uint32_t *>(nullptr), static_cast<std::uint32_t *>(nullptr),
            static_cast<int *>(nullptr), static_cast<int *>(nullptr), static_cast<int>(n), cudaStream_t{nullptr});
    }
    if (status == cudaSuccess) {
        status =
            cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<const int *>(nullptr), static_cast<int *>(nullptr),
                                          static_cast<int>(MaxRuns(n, rows)), cudaStream_t{nullptr});
    }
    *bytes = std::max({sort, encode, scan});
    return status;
}

/// The workspace's parts: the sort's two key and two value (dout row) buffers, the runs (key, length, offset, count),
/// and CUB's scratch.
struct BackwardWorkspace {
    std::uint32_t *keys_a, *keys_b, *rows_a, *rows_b, *run_keys;
    int *run_lengths, *run_offsets, *num_runs;
    void *temp;
    std::size_t temp_bytes;
    std::size_t total;
};

BackwardWorkspace LayOut(char *base, std::int64_t n, std::int64_t rows, std::size_t temp_bytes) {
    const std::size_t ids = AlignUp(static_cast<std::size_t>(n) * sizeof(std::uint32_t));
    const std::size_t runs = AlignUp(static_cast<std::size_t>(MaxRuns(n, rows)) * sizeof(std::uint32_t));
    static_assert(sizeof(int) == sizeof(std::uint32_t));
    BackwardWorkspace w{};
    std::size_t at = 0;
    auto take = [&](std::size_t bytes) {
        char *p = base == nullptr ? nullptr : base + at;
        at += bytes;
        return p;
    };
    w.keys_a = reinterpret_cast<std::uint32_t *>(take(ids));
    w.keys_b = reinterpret_cast<std::uint32_t *>(take(ids));
    w.rows_a = reinterpret_cast<std::uint32_t *>(take(ids));
    w.rows_b = reinterpret_cast<std::uint32_t *>(take(ids));
    w.run_keys = reinterpret_cast<std::uint32_t *>(take(runs));
    w.run_lengths = reinterpret_cast<int *>(take(runs));
    w.run_offsets = reinterpret_cast<int *>(take(runs));
    w.num_runs = reinterpret_cast<int *>(take(kWorkspaceAlignment));
    w.temp_bytes = temp_bytes;
    w.temp = take(AlignUp(temp_bytes));
    w.total = at;
    return w;
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

cudaError_t LaunchEmbeddingBagForward(const std::int64_t *ids, std::int64_t bag, std::int64_t count,
                                      std::int64_t vocab_start, const void *weight, std::int64_t rows,
                                      std::int64_t hidden, DType dtype, void *out, cudaStream_t stream) {
    if (count <= 0 || hidden <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        // Row r of the table starts on a 16-byte boundary when row 0 does and the row size is a multiple of 16 bytes.
        const bool vectorize = hidden % kVec == 0 && IsAligned(weight, 16) && IsAligned(out, 16);
        const std::int64_t vec = vectorize ? kVec : 1;
        const std::int64_t vectors = count * (hidden / vec);
        if (vectorize) {
            EmbeddingBagForwardKernel<T, kVec><<<BlocksFor(vectors), kThreads, 0, stream>>>(
                ids, bag, count, vocab_start, static_cast<const T *>(weight), rows, hidden / kVec,
                static_cast<T *>(out));
        } else {
            EmbeddingBagForwardKernel<T, 1><<<BlocksFor(vectors), kThreads, 0, stream>>>(
                ids, bag, count, vocab_start, static_cast<const T *>(weight), rows, hidden, static_cast<T *>(out));
        }
        return cudaGetLastError();
    });
}

cudaError_t EmbeddingBackwardWorkspace(std::int64_t n, std::int64_t rows, std::size_t *bytes) {
    std::size_t temp = 0;
    const cudaError_t status = TempBytes(n, rows, &temp);
    *bytes = LayOut(nullptr, n, rows, temp).total;
    return status;
}

cudaError_t LaunchEmbeddingBackward(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start, const void *dout,
                                    std::int64_t dout_rows, DType dout_dtype, void *dweight, DType dweight_dtype,
                                    std::int64_t rows, std::int64_t hidden, bool accumulate, void *workspace,
                                    std::size_t workspace_bytes, cudaStream_t stream) {
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
    if (dout_rows <= 0 || dout_rows > n) {
        return cudaErrorInvalidValue;
    }
    std::size_t temp_bytes = 0;
    if (const cudaError_t status = TempBytes(n, rows, &temp_bytes); status != cudaSuccess) {
        return status;
    }
    const BackwardWorkspace w = LayOut(static_cast<char *>(workspace), n, rows, temp_bytes);
    if (workspace == nullptr || workspace_bytes < w.total) {
        return cudaErrorInvalidValue;
    }
    const int count = static_cast<int>(n);
    const std::int64_t max_runs = MaxRuns(n, rows);

    EmbeddingKeysKernel<<<BlocksFor(n), kThreads, 0, stream>>>(ids, n, vocab_start, rows, dout_rows, w.keys_a,
                                                               w.rows_a);
    cudaError_t status = cudaGetLastError();
    // LSD radix sort is stable: equal keys keep their positions' increasing order, which fixes the summation order.
    // The double-buffered sort leaves its result in either buffer; Current() says which (decided on the host by the
    // number of passes, so nothing waits for the device).
    cub::DoubleBuffer<std::uint32_t> keys(w.keys_a, w.keys_b);
    cub::DoubleBuffer<std::uint32_t> dout_row_of(w.rows_a, w.rows_b);
    if (status == cudaSuccess) {
        std::size_t bytes = w.temp_bytes;
        status = cub::DeviceRadixSort::SortPairs(w.temp, bytes, keys, dout_row_of, count, 0, KeyBits(rows), stream);
    }
    // The runs of equal keys: their keys, lengths and (by an exclusive scan of the lengths) first sorted positions.
    // The run count stays on the device: nothing here waits for the host.
    if (status == cudaSuccess) {
        std::size_t bytes = w.temp_bytes;
        status = cub::DeviceRunLengthEncode::Encode(w.temp, bytes, keys.Current(), w.run_keys, w.run_lengths,
                                                    w.num_runs, count, stream);
    }
    if (status == cudaSuccess) {
        // Entries past the run count are scanned too (the host does not know the count); nothing reads them.
        std::size_t bytes = w.temp_bytes;
        status = cub::DeviceScan::ExclusiveSum(w.temp, bytes, w.run_lengths, w.run_offsets, static_cast<int>(max_runs),
                                               stream);
    }
    if (status != cudaSuccess) {
        return status;
    }
    const dim3 grid(static_cast<unsigned>((hidden + kSegmentColumns - 1) / kSegmentColumns),
                    static_cast<unsigned>(max_runs < 65535 ? max_runs : 65535));
    return WithFloatTypes(dout_dtype, dweight_dtype, [&](auto in_tag, auto out_tag) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        EmbeddingSegmentSumKernel<In, Out><<<grid, 32 * kSegmentWarps, 0, stream>>>(
            w.run_keys, w.run_lengths, w.run_offsets, w.num_runs, max_runs, dout_row_of.Current(),
            static_cast<std::uint32_t>(rows), static_cast<const In *>(dout), static_cast<Out *>(dweight), hidden,
            accumulate);
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
