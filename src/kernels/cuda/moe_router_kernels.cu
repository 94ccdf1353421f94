// Mixture-of-experts router kernels (see moe_kernels.h). No fmt/spdlog here: launchers return a cudaError_t.

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "device_utils.cuh"
#include "moe_common.cuh"
#include "moe_kernels.h"

namespace shardline::kernels::cuda {
namespace {

using moe::AlignUp;
using moe::kFullMask;
using moe::WarpSum;

constexpr int kMaxLanes = kMoEMaxExperts / 32; ///< experts per lane of a router warp at the most
constexpr int kRouterWarps = 4;                ///< tokens per router block
constexpr float kSigmoidEps = 1e-20f;          ///< sigmoid's renormalisation guard (Megatron's)
// The loss statistics' column sums: blocks of 32 columns × 8 row lanes over fixed chunks of rows.
constexpr int kColTile = 32;
constexpr int kRowLanes = 8;
constexpr int kChunkRows = 256;

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
    }
    return v;
}

/// The top-k order: larger logit first, then the lower id. A total order on (value, id) for non-NaN values, so the
/// warp's butterfly finds the same winner on every lane as a sequential scan would.
__device__ __forceinline__ bool Better(float v, int e, float bv, int be) { return v > bv || (v == bv && e < be); }

/// One router row in registers: lane owns experts lane, lane + 32, ... (kLanes of them: the kernels are instantiated
/// for 1, 2, 4 and 8, the fewest that hold the layer's experts, so that E = 64 does not loop over 256 slots. A slot
/// past E adds 0.0f to every sum and is never chosen, so every instantiation gives the same bits).
template <int kLanes> struct RouterRow {
    float l[kLanes];
    float s[kLanes];
    float m, sum_exp, lse, s_sum;

    __device__ __forceinline__ void Load(const float *__restrict__ row, int experts, bool sigmoid, int lane) {
        m = -INFINITY;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            const int e = lane + 32 * i;
            l[i] = e < experts ? row[e] : -INFINITY;
            m = e < experts ? fmaxf(m, l[i]) : m;
        }
        m = WarpMax(m);
        float local = 0.0f;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            local += lane + 32 * i < experts ? expf(l[i] - m) : 0.0f;
        }
        sum_exp = WarpSum(local);
        lse = m + logf(sum_exp);
        local = 0.0f;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            const bool valid = lane + 32 * i < experts;
            s[i] = !valid ? 0.0f : (sigmoid ? 1.0f / (1.0f + expf(-l[i])) : expf(l[i] - m) / sum_exp);
            local += s[i];
        }
        s_sum = WarpSum(local);
    }
    /// The score of expert e from its logit (the same formula as Load, so the same bits).
    __device__ __forceinline__ float ScoreOf(float logit, bool sigmoid) const {
        return sigmoid ? 1.0f / (1.0f + expf(-logit)) : expf(logit - m) / sum_exp;
    }
};

template <int kLanes>
__global__ void __launch_bounds__(32 * kRouterWarps)
    RouterForwardKernel(const float *__restrict__ logits, std::int64_t tokens, int experts, int topk, bool sigmoid,
                        bool normalize, float *__restrict__ weights, std::int64_t *__restrict__ indices,
                        float *__restrict__ stats) {
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kRouterWarps + (threadIdx.x >> 5);
    if (t >= tokens) {
        return; // the whole warp: t is the warp's
    }
    RouterRow<kLanes> row;
    row.Load(logits + t * experts, experts, sigmoid, lane);
    unsigned taken = 0; // bit i: this lane's expert lane + 32·i is chosen
    float chosen_sum = sigmoid ? kSigmoidEps : 0.0f;
    float sel_s[kMoEMaxTopk];
    int sel_e[kMoEMaxTopk];
#pragma unroll
    for (int j = 0; j < kMoEMaxTopk; ++j) {
        if (j >= topk) {
            break;
        }
        float bv = -INFINITY;
        int be = INT_MAX;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            const int e = lane + 32 * i;
            if (e < experts && ((taken >> i) & 1u) == 0 && Better(row.l[i], e, bv, be)) {
                bv = row.l[i];
                be = e;
            }
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) {
            const float ov = __shfl_xor_sync(kFullMask, bv, m);
            const int oe = __shfl_xor_sync(kFullMask, be, m);
            if (Better(ov, oe, bv, be)) {
                bv = ov;
                be = oe;
            }
        }
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            if (be == lane + 32 * i) {
                mine = row.s[i];
                taken |= 1u << i;
            }
        }
        const float sj = __shfl_sync(kFullMask, mine, be < experts ? (be & 31) : 0);
        sel_s[j] = sj;
        sel_e[j] = be < experts ? be : -1; // only NaN rows leave a slot without a winner
        chosen_sum += sj;                  // in slot order, the same on every lane
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < kMoEMaxTopk; ++j) {
            if (j >= topk) {
                break;
            }
            weights[t * topk + j] = normalize ? sel_s[j] / chosen_sum : sel_s[j];
            indices[t * topk + j] = sel_e[j];
        }
    }
    if (stats != nullptr) {
        float *srow = stats + t * (experts + 1);
        const float d = row.s_sum + kSigmoidEps;
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            const int e = lane + 32 * i;
            if (e < experts) {
                srow[e] = sigmoid ? row.s[i] / d : row.s[i];
            }
        }
        if (lane == 0) {
            srow[experts] = row.lse * row.lse;
        }
    }
}

/// The tokens per expert from the chosen ids (-1: an empty slot of a NaN row).
__global__ void CountIndicesKernel(const std::int64_t *__restrict__ indices, std::int64_t n, int experts,
                                   unsigned long long *__restrict__ counts) {
    moe::CountExperts(n, experts, counts, [&](std::int64_t i) {
        const std::int64_t e = indices[i];
        return e >= 0 && e < experts ? static_cast<int>(e) : -1;
    });
}

/// partial[chunk, col] = Σ over the chunk's rows of stats[row, col]: 8 row lanes each sum every 8th row in order,
/// then the lanes in order.
__global__ void __launch_bounds__(kColTile *kRowLanes)
    ColumnPartialKernel(const float *__restrict__ stats, std::int64_t rows, int cols, float *__restrict__ partial) {
    __shared__ float lanes[kRowLanes][kColTile];
    const int col = static_cast<int>(blockIdx.x) * kColTile + static_cast<int>(threadIdx.x);
    const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * kChunkRows;
    float acc = 0.0f;
    if (col < cols) {
        for (int r = static_cast<int>(threadIdx.y); r < kChunkRows; r += kRowLanes) {
            if (first + r < rows) {
                acc += stats[(first + r) * cols + col];
            }
        }
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        float total = 0.0f;
        for (int y = 0; y < kRowLanes; ++y) {
            total += lanes[y][threadIdx.x];
        }
        partial[static_cast<std::int64_t>(blockIdx.y) * cols + col] = total;
    }
}

/// The column totals over the chunks in order, then aux = aux_scale·Σ_e count_e·P_sum_e and z = z_scale·Σ lse² (fp64
/// for the last sums).
__global__ void RouterLossesKernel(const float *__restrict__ partial, std::int64_t chunks, int experts,
                                   const unsigned long long *__restrict__ counts, double aux_scale,
                                   float *__restrict__ aux, double z_scale, float *__restrict__ z) {
    __shared__ float totals[kMoEMaxExperts + 1];
    const int cols = experts + 1;
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += static_cast<int>(blockDim.x)) {
        float acc = 0.0f;
        for (std::int64_t k = 0; k < chunks; ++k) {
            acc += partial[k * cols + c];
        }
        totals[c] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0;
        for (int e = 0; e < experts; ++e) {
            a += static_cast<double>(totals[e]) * static_cast<double>(counts[e]);
        }
        if (aux != nullptr) {
            *aux = static_cast<float>(a * aux_scale);
        }
        if (z != nullptr) {
            *z = static_cast<float>(static_cast<double>(totals[experts]) * z_scale);
        }
    }
}

template <int kLanes>
__global__ void __launch_bounds__(32 * kRouterWarps)
    RouterBackwardKernel(const float *__restrict__ logits, std::int64_t tokens, int experts, int topk, bool sigmoid,
                         bool normalize, const std::int64_t *__restrict__ indices,
                         const std::int64_t *__restrict__ counts, const float *__restrict__ dweights,
                         const float *__restrict__ daux, float aux_scale, const float *__restrict__ dz, float z_scale,
                         float *__restrict__ dlogits) {
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kRouterWarps + (threadIdx.x >> 5);
    if (t >= tokens) {
        return;
    }
    const float *lrow = logits + t * experts;
    RouterRow<kLanes> row;
    row.Load(lrow, experts, sigmoid, lane);
    // g: the gradient w.r.t. the scores s (then through softmax/sigmoid); direct: w.r.t. the logits themselves.
    float g[kLanes], direct[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
        g[i] = 0.0f;
        direct[i] = 0.0f;
    }
    if (dweights != nullptr) {
        // w_j = s_j / S (normalised) or s_j: ds_j = (dw_j - Σ_i w_i·dw_i) / S, or dw_j.
        float sj[kMoEMaxTopk], dwj[kMoEMaxTopk];
        int ej[kMoEMaxTopk];
        float chosen = sigmoid ? kSigmoidEps : 0.0f;
#pragma unroll
        for (int j = 0; j < kMoEMaxTopk; ++j) {
            ej[j] = -1;
            sj[j] = 0.0f;
            dwj[j] = 0.0f;
            if (j < topk) {
                const std::int64_t e = indices[t * topk + j];
                ej[j] = e >= 0 && e < experts ? static_cast<int>(e) : -1;
                dwj[j] = dweights[t * topk + j];
                sj[j] = ej[j] >= 0 ? row.ScoreOf(lrow[ej[j]], sigmoid) : 0.0f;
                chosen += sj[j];
            }
        }
        float w_dot_dw = 0.0f;
#pragma unroll
        for (int j = 0; j < kMoEMaxTopk; ++j) {
            w_dot_dw += j < topk ? sj[j] / chosen * dwj[j] : 0.0f;
        }
        // Normalised softmax top-k: w = softmax over the chosen logits alone, so d l_j = w_j·(dw_j − Σ_i w_i·dw_i) for
        // a chosen j and exactly 0 for the others. Written directly: through the full softmax's backward the others'
        // zero is a cancellation (Σ_e s_e·g_e = 0 in exact arithmetic), which left fp32 noise of ~1e-6 on every
        // unchosen logit (measured on an H200).
        const bool direct_softmax = normalize && !sigmoid;
#pragma unroll
        for (int j = 0; j < kMoEMaxTopk; ++j) {
            if (j < topk) {
                const float d = direct_softmax ? sj[j] / chosen * (dwj[j] - w_dot_dw)
                                : normalize    ? (dwj[j] - w_dot_dw) / chosen
                                               : dwj[j];
#pragma unroll
                for (int i = 0; i < kLanes; ++i) {
                    const bool mine = ej[j] == lane + 32 * i;
                    (direct_softmax ? direct[i] : g[i]) += mine ? d : 0.0f;
                }
            }
        }
    }
    if (daux != nullptr) {
        // d aux / d p[t, e] = a_e = daux·aux_scale·count_e; p = s (softmax) or s / D (sigmoid).
        const float da = *daux * aux_scale;
        const float d = row.s_sum + kSigmoidEps;
        float p_dot_a = 0.0f;
        if (sigmoid) {
#pragma unroll
            for (int i = 0; i < kLanes; ++i) {
                const int e = lane + 32 * i;
                p_dot_a += e < experts ? row.s[i] / d * (da * static_cast<float>(counts[e])) : 0.0f;
            }
            p_dot_a = WarpSum(p_dot_a);
        }
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            const int e = lane + 32 * i;
            if (e < experts) {
                const float a = da * static_cast<float>(counts[e]);
                g[i] += sigmoid ? (a - p_dot_a) / d : a;
            }
        }
    }
    float s_dot_g = 0.0f;
    if (!sigmoid) {
#pragma unroll
        for (int i = 0; i < kLanes; ++i) {
            s_dot_g += row.s[i] * g[i]; // zero for the padding slots
        }
        s_dot_g = WarpSum(s_dot_g);
    }
    const float zc = dz != nullptr ? *dz * z_scale * row.lse : 0.0f;
    float *out = dlogits + t * experts;
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
        const int e = lane + 32 * i;
        if (e < experts) {
            float d = (sigmoid ? g[i] * row.s[i] * (1.0f - row.s[i]) : row.s[i] * (g[i] - s_dot_g)) + direct[i];
            if (dz != nullptr) {
                d += zc * expf(row.l[i] - row.lse); // d lse / d logit = softmax
            }
            out[e] = d;
        }
    }
}

/// f(std::integral_constant<int, kLanes>) with the fewest experts per lane that hold `experts` (<= kMoEMaxExperts).
template <class F> cudaError_t WithLanes(int experts, F &&f) {
    static_assert(kMaxLanes == 8);
    if (experts <= 32) {
        return f(std::integral_constant<int, 1>{});
    }
    if (experts <= 64) {
        return f(std::integral_constant<int, 2>{});
    }
    if (experts <= 128) {
        return f(std::integral_constant<int, 4>{});
    }
    return f(std::integral_constant<int, 8>{});
}

} // namespace

std::size_t MoERouterForwardWorkspace(const MoERouterShape &shape, bool losses) {
    if (!losses || shape.tokens == 0) {
        return 0;
    }
    const auto cols = static_cast<std::size_t>(shape.experts + 1);
    const auto chunks = static_cast<std::size_t>((shape.tokens + kChunkRows - 1) / kChunkRows);
    return AlignUp(static_cast<std::size_t>(shape.tokens) * cols * sizeof(float)) +
           AlignUp(chunks * cols * sizeof(float));
}

cudaError_t LaunchMoERouterForward(const float *logits, const MoERouterShape &shape, float *weights,
                                   std::int64_t *indices, std::int64_t *counts, float *aux, float aux_scale, float *z,
                                   float z_scale, void *workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    if (shape.experts < 1 || shape.experts > kMoEMaxExperts || shape.topk < 1 || shape.topk > kMoEMaxTopk ||
        shape.topk > shape.experts) {
        return cudaErrorInvalidValue;
    }
    auto *ucounts = reinterpret_cast<unsigned long long *>(counts);
    static_assert(sizeof(unsigned long long) == sizeof(std::int64_t));
    cudaError_t status =
        cudaMemsetAsync(counts, 0, static_cast<std::size_t>(shape.experts) * sizeof(std::int64_t), stream);
    if (status != cudaSuccess) {
        return status;
    }
    const bool losses = aux != nullptr || z != nullptr;
    if (shape.tokens == 0) { // no rows: zero counts and losses (all-zero bits are 0.0f)
        for (float *loss : {aux, z}) {
            if (loss != nullptr && (status = cudaMemsetAsync(loss, 0, sizeof(float), stream)) != cudaSuccess) {
                return status;
            }
        }
        return cudaSuccess;
    }
    const std::int64_t chunks = (shape.tokens + kChunkRows - 1) / kChunkRows;
    if (losses &&
        (workspace == nullptr || workspace_bytes < MoERouterForwardWorkspace(shape, true) || chunks > 65535)) {
        return cudaErrorInvalidValue;
    }
    float *stats = losses ? static_cast<float *>(workspace) : nullptr;
    const auto blocks = static_cast<unsigned>((shape.tokens + kRouterWarps - 1) / kRouterWarps);
    status = WithLanes(shape.experts, [&](auto lanes) {
        RouterForwardKernel<decltype(lanes)::value><<<blocks, 32 * kRouterWarps, 0, stream>>>(
            logits, shape.tokens, shape.experts, shape.topk, shape.sigmoid, shape.normalize, weights, indices, stats);
        return cudaGetLastError();
    });
    if (status != cudaSuccess) {
        return status;
    }
    // The counts from the chosen ids in a second pass: the router's lane 0 adding its topk ids to E global words made
    // the forward's cost grow with topk (H100, deepseek-64e: 31 µs).
    const std::int64_t copies = shape.tokens * shape.topk;
    CountIndicesKernel<<<std::min(BlocksFor(copies), moe::kHistogramBlocks), kThreads, 0, stream>>>(
        indices, copies, shape.experts, ucounts);
    status = cudaGetLastError();
    if (status != cudaSuccess || !losses) {
        return status;
    }
    const int cols = shape.experts + 1;
    float *partial = reinterpret_cast<float *>(
        static_cast<char *>(workspace) +
        AlignUp(static_cast<std::size_t>(shape.tokens) * static_cast<std::size_t>(cols) * sizeof(float)));
    const dim3 grid(static_cast<unsigned>((cols + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
    ColumnPartialKernel<<<grid, dim3(kColTile, kRowLanes), 0, stream>>>(stats, shape.tokens, cols, partial);
    if ((status = cudaGetLastError()) != cudaSuccess) {
        return status;
    }
    RouterLossesKernel<<<1, 256, 0, stream>>>(partial, chunks, shape.experts, ucounts, static_cast<double>(aux_scale),
                                              aux, static_cast<double>(z_scale), z);
    return cudaGetLastError();
}

cudaError_t LaunchMoERouterBackward(const float *logits, const MoERouterShape &shape, const std::int64_t *indices,
                                    const std::int64_t *counts, const float *dweights, const float *daux,
                                    float aux_scale, const float *dz, float z_scale, float *dlogits,
                                    cudaStream_t stream) {
    if (shape.experts < 1 || shape.experts > kMoEMaxExperts || shape.topk < 1 || shape.topk > kMoEMaxTopk) {
        return cudaErrorInvalidValue;
    }
    if (shape.tokens == 0) {
        return cudaSuccess;
    }
    const auto blocks = static_cast<unsigned>((shape.tokens + kRouterWarps - 1) / kRouterWarps);
    return WithLanes(shape.experts, [&](auto lanes) {
        RouterBackwardKernel<decltype(lanes)::value><<<blocks, 32 * kRouterWarps, 0, stream>>>(
            logits, shape.tokens, shape.experts, shape.topk, shape.sigmoid, shape.normalize, indices, counts, dweights,
            daux, aux_scale, dz, z_scale, dlogits);
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
