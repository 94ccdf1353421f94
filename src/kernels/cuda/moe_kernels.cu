// Mixture-of-experts permutation kernels: the map, the gather, the combine and the combine's weight gradient (see
// moe_kernels.h). No fmt/spdlog here: launchers return a cudaError_t.

#include <algorithm>
#include <climits>

#include <cub/device/device_radix_sort.cuh>

#include "device_utils.cuh"
#include "moe_common.cuh"
#include "moe_kernels.h"

namespace shardline::kernels::cuda {
namespace {

using moe::AlignUp;
using moe::WarpSum;

// ---- the permutation map -------------------------------------------------------------------------------------------

/// Bits of the sort keys: enough for 0 .. experts (experts is the key of an out-of-range id).
int KeyBits(int experts) {
    int bits = 1;
    while (bits < 32 && (std::int64_t{1} << bits) <= experts) {
        ++bits;
    }
    return bits;
}

/// The keys (the expert, `experts` for an out-of-range id), the values (the copy index) and the per-expert counts.
__global__ void PermuteKeysKernel(const std::int64_t *__restrict__ ids, std::int64_t copies, int experts,
                                  std::uint32_t *__restrict__ keys, std::int32_t *__restrict__ values,
                                  unsigned long long *__restrict__ counts) {
    moe::CountExperts(copies, experts, counts, [&](std::int64_t i) {
        const std::int64_t id = ids[i];
        const bool valid = id >= 0 && id < experts;
        keys[i] = valid ? static_cast<std::uint32_t>(id) : static_cast<std::uint32_t>(experts);
        values[i] = static_cast<std::int32_t>(i);
        return valid ? static_cast<int>(id) : -1;
    });
}

/// One thread: the experts' first sorted positions (exclusive scan of the counts), their first rows (exclusive scan
/// of the kept sizes) and the kept sizes. E is small (the experts of a layer): a sequential loop.
__global__ void PermuteScanKernel(const unsigned long long *__restrict__ counts, int experts, std::int64_t capacity,
                                  std::int64_t *__restrict__ group_sizes, std::int64_t *__restrict__ starts,
                                  std::int64_t *__restrict__ offsets) {
    if (threadIdx.x != 0 || blockIdx.x != 0) {
        return;
    }
    std::int64_t start = 0;
    std::int64_t offset = 0;
    for (int e = 0; e < experts; ++e) {
        const auto c = static_cast<std::int64_t>(counts[e]);
        const std::int64_t kept = capacity < 0 || c < capacity ? c : capacity;
        group_sizes[e] = kept;
        starts[e] = start;
        offsets[e] = offset;
        start += c;
        offset += kept;
    }
}

__global__ void PermuteRowMapKernel(const std::uint32_t *__restrict__ sorted_keys,
                                    const std::int32_t *__restrict__ sorted_values, std::int64_t copies, int experts,
                                    std::int64_t capacity, const std::int64_t *__restrict__ starts,
                                    const std::int64_t *__restrict__ offsets, std::int64_t *__restrict__ row_map) {
    for (std::int64_t p = GlobalThread(); p < copies; p += GridThreads()) {
        const auto e = static_cast<int>(sorted_keys[p]);
        const std::int32_t i = sorted_values[p];
        if (e >= experts) {
            row_map[i] = -1;
            continue;
        }
        const std::int64_t rank = p - starts[e]; // the stable sort keeps each expert's copies in (t, j) order
        row_map[i] = capacity < 0 || rank < capacity ? offsets[e] + rank : -1;
    }
}

struct MapWorkspace {
    unsigned long long *counts;
    std::int64_t *starts, *offsets;
    std::uint32_t *keys_a, *keys_b;
    std::int32_t *values_a, *values_b;
    void *temp;
    std::size_t temp_bytes, total;
};

MapWorkspace LayOutMap(char *base, std::int64_t copies, int experts, std::size_t temp_bytes) {
    MapWorkspace w{};
    std::size_t at = 0;
    auto take = [&](std::size_t bytes) {
        char *p = base == nullptr ? nullptr : base + at;
        at += AlignUp(bytes);
        return p;
    };
    const auto e = static_cast<std::size_t>(experts);
    const auto n = static_cast<std::size_t>(copies);
    w.counts = reinterpret_cast<unsigned long long *>(take(e * sizeof(unsigned long long)));
    w.starts = reinterpret_cast<std::int64_t *>(take(e * sizeof(std::int64_t)));
    w.offsets = reinterpret_cast<std::int64_t *>(take(e * sizeof(std::int64_t)));
    w.keys_a = reinterpret_cast<std::uint32_t *>(take(n * sizeof(std::uint32_t)));
    w.keys_b = reinterpret_cast<std::uint32_t *>(take(n * sizeof(std::uint32_t)));
    w.values_a = reinterpret_cast<std::int32_t *>(take(n * sizeof(std::int32_t)));
    w.values_b = reinterpret_cast<std::int32_t *>(take(n * sizeof(std::int32_t)));
    w.temp_bytes = temp_bytes;
    w.temp = take(temp_bytes);
    w.total = at;
    return w;
}

cudaError_t SortTempBytes(std::int64_t copies, int experts, std::size_t *bytes) {
    cub::DoubleBuffer<std::uint32_t> keys(nullptr, nullptr);
    cub::DoubleBuffer<std::int32_t> values(nullptr, nullptr);
    return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, keys, values, static_cast<int>(copies), 0, KeyBits(experts),
                                           cudaStream_t{nullptr});
}

// ---- the gather, the combine and the combine's weight gradient ---------------------------------------------------

// The gather and the combine are token-major, one warp per token: the token's row map and weights sit in lanes
// 0 .. topk-1 (read once, shuffled out per slot), and each lane moves a chunk of 16-byte vectors per step, every load
// of the chunk issued before its first store. The earlier forms (one block per copy or token, one vector per thread)
// read the row map before every row and kept little in flight: on an H100 the deepseek-64e step's two gathers took
// 201 µs and now 164, the two combines 175 and now 166, against ~156 µs of DRAM bytes each at 3.0 TB/s (a gather
// reads x's 33 MB and writes the 201 MB of copies; a combine the reverse). Per element the float math and its order are
// the same as before (the gather w·x, the combine Σ_j w_j·x_j in slot order), so the bits are.
constexpr int kRowWarps = 8; ///< tokens per block

/// Slot j's row and weight from the lanes that hold them (lane j < topk).
struct Slots {
    std::int64_t row = -1;
    float weight = 1.0f;

    template <class W>
    __device__ __forceinline__ Slots(const std::int64_t *__restrict__ row_map, const W *__restrict__ weights,
                                     std::int64_t t, int topk, int lane) {
        if (lane < topk) {
            row = row_map[t * topk + lane];
            weight = weights != nullptr ? ToFloat(weights[t * topk + lane]) : 1.0f;
        }
    }
    __device__ __forceinline__ std::int64_t Row(int j) const { return __shfl_sync(moe::kFullMask, row, j); }
    __device__ __forceinline__ float Weight(int j) const { return __shfl_sync(moe::kFullMask, weight, j); }
};

__device__ __forceinline__ std::int64_t WarpToken() {
    return static_cast<std::int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
}

/// out[row_map[t, j]] = w[t, j] · x[t] (or x[t] without weights) for every slot with a row: x's row is read once.
template <class T, class W, int kVec>
__global__ void __launch_bounds__(32 * kRowWarps)
    PermuteRowsKernel(const T *__restrict__ x, std::int64_t tokens, int topk, std::int64_t vecs_per_row,
                      const std::int64_t *__restrict__ row_map, const W *__restrict__ weights, T *__restrict__ out) {
    constexpr int kChunk = 8;
    using V = AlignedVector<T, kVec>;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t t = WarpToken();
    if (t >= tokens) {
        return; // the whole warp
    }
    const Slots slots(row_map, weights, t, topk, lane);
    const V *src = reinterpret_cast<const V *>(x) + t * vecs_per_row;
    for (std::int64_t base = lane; base - lane < vecs_per_row; base += 32 * kChunk) { // warp-uniform trip count
        V val[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
            if (base + 32 * u < vecs_per_row) {
                val[u] = src[base + 32 * u];
            }
        }
        for (int j = 0; j < topk; ++j) {
            const std::int64_t r = slots.Row(j);
            const float w = slots.Weight(j);
            if (r < 0) {
                continue; // warp-uniform
            }
            V *dst = reinterpret_cast<V *>(out) + r * vecs_per_row;
#pragma unroll
            for (int u = 0; u < kChunk; ++u) {
                if (base + 32 * u < vecs_per_row) {
                    V o = val[u];
                    if (weights != nullptr) {
#pragma unroll
                        for (int q = 0; q < kVec; ++q) {
                            o.val[q] = FromFloat<T>(w * ToFloat(o.val[q]));
                        }
                    }
                    dst[base + 32 * u] = o;
                }
            }
        }
    }
}

/// y[t] = Σ_j w[t, j] · tokens[row_map[t, j]] in slot order (the dropped slots add nothing).
template <class T, class W, int kVec>
__global__ void __launch_bounds__(32 * kRowWarps)
    UnpermuteRowsKernel(const T *__restrict__ tokens, std::int64_t vecs_per_row,
                        const std::int64_t *__restrict__ row_map, std::int64_t num_tokens, int topk,
                        const W *__restrict__ weights, T *__restrict__ y) {
    constexpr int kChunk = 4;
    using V = AlignedVector<T, kVec>;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t t = WarpToken();
    if (t >= num_tokens) {
        return;
    }
    const Slots slots(row_map, weights, t, topk, lane);
    for (std::int64_t base = lane; base - lane < vecs_per_row; base += 32 * kChunk) { // warp-uniform trip count
        float acc[kChunk][kVec];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
#pragma unroll
            for (int q = 0; q < kVec; ++q) {
                acc[u][q] = 0.0f;
            }
        }
        for (int j = 0; j < topk; ++j) { // slot order: fixed
            const std::int64_t r = slots.Row(j);
            const float w = slots.Weight(j);
            if (r < 0) {
                continue;
            }
            const V *src = reinterpret_cast<const V *>(tokens) + r * vecs_per_row;
            V val[kChunk];
#pragma unroll
            for (int u = 0; u < kChunk; ++u) {
                if (base + 32 * u < vecs_per_row) {
                    val[u] = src[base + 32 * u];
                }
            }
#pragma unroll
            for (int u = 0; u < kChunk; ++u) {
                if (base + 32 * u < vecs_per_row) {
#pragma unroll
                    for (int q = 0; q < kVec; ++q) {
                        acc[u][q] += w * ToFloat(val[u].val[q]);
                    }
                }
            }
        }
        V *dst = reinterpret_cast<V *>(y) + t * vecs_per_row;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
            if (base + 32 * u < vecs_per_row) {
                V o;
#pragma unroll
                for (int q = 0; q < kVec; ++q) {
                    o.val[q] = FromFloat<T>(acc[u][q]);
                }
                dst[base + 32 * u] = o;
            }
        }
    }
}

/// dweights[i] = dy[i / topk] · tokens[row_map[i]] (0 for a dropped copy): one warp per copy, each lane summing its
/// vectors in increasing index, then the butterfly. Copy-major (kDotWarps copies per block) measured faster than the
/// token-major form of the kernels above, which walks a token's slots one after another (H100, deepseek-64e: 88
/// against 94 µs per step).
constexpr int kDotWarps = 8;

template <class T, class Out, int kVec>
__global__ void __launch_bounds__(32 * kDotWarps)
    UnpermuteWeightsGradKernel(const T *__restrict__ dy, const T *__restrict__ tokens, std::int64_t vecs_per_row,
                               const std::int64_t *__restrict__ row_map, std::int64_t copies, int topk,
                               Out *__restrict__ dweights) {
    using V = AlignedVector<T, kVec>;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kDotWarps + (threadIdx.x >> 5);
    if (i >= copies) {
        return; // the whole warp
    }
    const std::int64_t r = row_map[i];
    float acc = 0.0f;
    if (r >= 0) {
        const V *a = reinterpret_cast<const V *>(dy) + (i / topk) * vecs_per_row;
        const V *b = reinterpret_cast<const V *>(tokens) + r * vecs_per_row;
        for (std::int64_t v = lane; v < vecs_per_row; v += 32) { // each lane in increasing v, then the butterfly
            const V av = a[v];
            const V bv = b[v];
#pragma unroll
            for (int q = 0; q < kVec; ++q) {
                acc += ToFloat(av.val[q]) * ToFloat(bv.val[q]);
            }
        }
    }
    acc = WarpSum(acc);
    if (lane == 0) {
        dweights[i] = FromFloat<Out>(acc);
    }
}

/// The launch of the token-major kernels: kRowWarps tokens per block (0 when the grid would exceed CUDA's limit).
unsigned TokenBlocks(std::int64_t tokens) {
    const std::int64_t blocks = (tokens + kRowWarps - 1) / kRowWarps;
    return blocks > INT_MAX ? 0U : static_cast<unsigned>(blocks);
}

/// Elements per 16-byte vector when the rows and both pointers allow it, else 1.
template <class T> int VectorWidth(std::int64_t hidden, const void *a, const void *b) {
    constexpr int kWide = 16 / static_cast<int>(sizeof(T));
    return hidden % kWide == 0 && IsAligned(a, 16) && IsAligned(b, 16) ? kWide : 1;
}

} // namespace

cudaError_t MoEPermuteMapWorkspace(std::int64_t copies, int experts, std::size_t *bytes) {
    std::size_t temp = 0;
    const cudaError_t status = SortTempBytes(copies, experts, &temp);
    *bytes = LayOutMap(nullptr, copies, experts, temp).total;
    return status;
}

cudaError_t LaunchMoEPermuteMap(const std::int64_t *ids, std::int64_t copies, int experts, std::int64_t capacity,
                                std::int64_t *row_map, std::int64_t *group_sizes, void *workspace,
                                std::size_t workspace_bytes, cudaStream_t stream) {
    if (experts < 1 || copies < 0 || copies >= INT_MAX) {
        return cudaErrorInvalidValue;
    }
    std::size_t temp = 0;
    cudaError_t status = SortTempBytes(copies, experts, &temp);
    if (status != cudaSuccess) {
        return status;
    }
    const MapWorkspace w = LayOutMap(static_cast<char *>(workspace), copies, experts, temp);
    if (workspace == nullptr || workspace_bytes < w.total) {
        return cudaErrorInvalidValue;
    }
    if ((status = cudaMemsetAsync(w.counts, 0, static_cast<std::size_t>(experts) * sizeof(unsigned long long),
                                  stream)) != cudaSuccess) {
        return status;
    }
    if (copies > 0) {
        PermuteKeysKernel<<<std::min(BlocksFor(copies), moe::kHistogramBlocks), kThreads, 0, stream>>>(
            ids, copies, experts, w.keys_a, w.values_a, w.counts);
        if ((status = cudaGetLastError()) != cudaSuccess) {
            return status;
        }
    }
    PermuteScanKernel<<<1, 32, 0, stream>>>(w.counts, experts, capacity, group_sizes, w.starts, w.offsets);
    if ((status = cudaGetLastError()) != cudaSuccess || copies == 0) {
        return status;
    }
    // Stable radix sort of the copies by expert, the copy index as the value: each expert's copies stay in (t, j)
    // order. Double-buffered: CUB alternates between our two buffers, Current() is the sorted one.
    cub::DoubleBuffer<std::uint32_t> keys(w.keys_a, w.keys_b);
    cub::DoubleBuffer<std::int32_t> values(w.values_a, w.values_b);
    std::size_t temp_bytes = w.temp_bytes;
    if ((status = cub::DeviceRadixSort::SortPairs(w.temp, temp_bytes, keys, values, static_cast<int>(copies), 0,
                                                  KeyBits(experts), stream)) != cudaSuccess) {
        return status;
    }
    PermuteRowMapKernel<<<BlocksFor(copies), kThreads, 0, stream>>>(keys.Current(), values.Current(), copies, experts,
                                                                    capacity, w.starts, w.offsets, row_map);
    return cudaGetLastError();
}

cudaError_t LaunchMoEPermuteRows(const void *x, std::int64_t tokens, int topk, std::int64_t hidden, DType dtype,
                                 const std::int64_t *row_map, const void *weights, DType weights_dtype, void *out,
                                 cudaStream_t stream) {
    if (topk < 1 || topk > kMoEMaxRowTopk || (TokenBlocks(tokens) == 0 && tokens > 0)) {
        return cudaErrorInvalidValue;
    }
    if (tokens == 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, weights_dtype, [&](auto t_tag, auto w_tag) -> cudaError_t {
        using T = decltype(t_tag);
        using W = decltype(w_tag);
        const auto *w = static_cast<const W *>(weights);
        if (VectorWidth<T>(hidden, x, out) > 1) {
            constexpr int kVec = 16 / sizeof(T);
            PermuteRowsKernel<T, W, kVec><<<TokenBlocks(tokens), 32 * kRowWarps, 0, stream>>>(
                static_cast<const T *>(x), tokens, topk, hidden / kVec, row_map, w, static_cast<T *>(out));
        } else {
            PermuteRowsKernel<T, W, 1><<<TokenBlocks(tokens), 32 * kRowWarps, 0, stream>>>(
                static_cast<const T *>(x), tokens, topk, hidden, row_map, w, static_cast<T *>(out));
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchMoEUnpermuteRows(const void *tokens, std::int64_t hidden, DType dtype, const std::int64_t *row_map,
                                   std::int64_t num_tokens, int topk, const void *weights, DType weights_dtype, void *y,
                                   cudaStream_t stream) {
    if (topk < 1 || topk > kMoEMaxRowTopk || (TokenBlocks(num_tokens) == 0 && num_tokens > 0)) {
        return cudaErrorInvalidValue;
    }
    if (num_tokens == 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, weights_dtype, [&](auto t_tag, auto w_tag) -> cudaError_t {
        using T = decltype(t_tag);
        using W = decltype(w_tag);
        const auto *w = static_cast<const W *>(weights);
        if (VectorWidth<T>(hidden, tokens, y) > 1) {
            constexpr int kVec = 16 / sizeof(T);
            UnpermuteRowsKernel<T, W, kVec><<<TokenBlocks(num_tokens), 32 * kRowWarps, 0, stream>>>(
                static_cast<const T *>(tokens), hidden / kVec, row_map, num_tokens, topk, w, static_cast<T *>(y));
        } else {
            UnpermuteRowsKernel<T, W, 1><<<TokenBlocks(num_tokens), 32 * kRowWarps, 0, stream>>>(
                static_cast<const T *>(tokens), hidden, row_map, num_tokens, topk, w, static_cast<T *>(y));
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchMoEUnpermuteWeightsGrad(const void *dy, const void *tokens, std::int64_t hidden, DType dtype,
                                          const std::int64_t *row_map, std::int64_t num_tokens, int topk,
                                          void *dweights, DType dweights_dtype, cudaStream_t stream) {
    const std::int64_t copies = num_tokens * topk;
    if (copies == 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, dweights_dtype, [&](auto t_tag, auto o_tag) -> cudaError_t {
        using T = decltype(t_tag);
        using Out = decltype(o_tag);
        const auto blocks = static_cast<unsigned>((copies + kDotWarps - 1) / kDotWarps);
        if (VectorWidth<T>(hidden, dy, tokens) > 1) {
            constexpr int kVec = 16 / sizeof(T);
            UnpermuteWeightsGradKernel<T, Out, kVec><<<blocks, 32 * kDotWarps, 0, stream>>>(
                static_cast<const T *>(dy), static_cast<const T *>(tokens), hidden / kVec, row_map, copies, topk,
                static_cast<Out *>(dweights));
        } else {
            UnpermuteWeightsGradKernel<T, Out, 1>
                <<<blocks, 32 * kDotWarps, 0, stream>>>(static_cast<const T *>(dy), static_cast<const T *>(tokens),
                                                        hidden, row_map, copies, topk, static_cast<Out *>(dweights));
        }
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
