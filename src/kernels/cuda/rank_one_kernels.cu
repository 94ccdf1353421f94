// The rank-1 GEMM kernel (see rank_one_kernels.h). No fmt/spdlog here: nvcc 13 rejects fmt 9's consteval format
// strings, so the launcher returns a cudaError_t and the host side checks it.

#include <algorithm>

#include "device_utils.cuh"
#include "rank_one_kernels.h"

namespace shardline::kernels::cuda {
namespace {

/// Threads run down D's columns (contiguous i), VEC elements each (16 bytes of D where a, D and ldd allow, else 1),
/// and the y threads and blocks stride over columns; a's VEC values are read once per thread, b_j once per column.
/// The thread with i = 0 of each column also writes the bias grad.
template <class T, class D, class B, int VEC>
__global__ void __launch_bounds__(kThreads)
    RankOneKernel(const T *__restrict__ a, std::int64_t inc_a, const T *__restrict__ b, std::int64_t inc_b,
                  D *__restrict__ d, std::int64_t ldd, std::int64_t m, std::int64_t n, float alpha, float beta,
                  B *__restrict__ bias) {
    const std::int64_t i_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x * VEC;
    const std::int64_t j_first = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
    const std::int64_t j_step = static_cast<std::int64_t>(gridDim.y) * blockDim.y;
    for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < m;
         i += i_step) {
        float av[VEC];
        if constexpr (VEC > 1) {
            const AlignedVector<T, VEC> v = *reinterpret_cast<const AlignedVector<T, VEC> *>(a + i);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                av[e] = ToFloat(v.val[e]);
            }
        } else {
            av[0] = ToFloat(a[i * inc_a]);
        }
        for (std::int64_t j = j_first; j < n; j += j_step) {
            const float bv = ToFloat(b[j * inc_b]);
            if (bias != nullptr && i == 0) {
                bias[j] = FromFloat<B>(bv);
            }
            D *col = d + i + j * ldd;
            AlignedVector<D, VEC> out{};
            if (beta != 0.0f) {
                out = *reinterpret_cast<const AlignedVector<D, VEC> *>(col);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float product = alpha * (av[e] * bv);
                out.val[e] = FromFloat<D>(beta != 0.0f ? product + beta * ToFloat(out.val[e]) : product);
            }
            *reinterpret_cast<AlignedVector<D, VEC> *>(col) = out;
        }
    }
}

template <class T, class D, class B, int VEC> cudaError_t Run(const RankOneArgs &args, cudaStream_t stream) {
    const std::int64_t threads_x = (args.m + VEC - 1) / VEC;
    // A block of kThreads spans as much of a column as it needs (a multiple of a warp) and several columns when the
    // column is short; at most kMaxBlocks blocks, the y threads looping over the remaining columns.
    const std::int64_t bdx = std::min<std::int64_t>(kThreads, (threads_x + 31) / 32 * 32);
    const std::int64_t bdy = kThreads / bdx;
    const std::int64_t gx = std::min<std::int64_t>((threads_x + bdx - 1) / bdx, 65535);
    const std::int64_t gy = std::max<std::int64_t>(
        1, std::min<std::int64_t>({(args.n + bdy - 1) / bdy, 65535, std::max<std::int64_t>(1, kMaxBlocks / gx)}));
    RankOneKernel<T, D, B, VEC><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                                  dim3(static_cast<unsigned>(bdx), static_cast<unsigned>(bdy)), 0, stream>>>(
        static_cast<const T *>(args.a), args.inc_a, static_cast<const T *>(args.b), args.inc_b,
        static_cast<D *>(args.d), args.ldd, args.m, args.n, args.alpha, args.beta, static_cast<B *>(args.bias));
    return cudaGetLastError();
}

} // namespace

cudaError_t LaunchRankOne(const RankOneArgs &args, cudaStream_t stream) {
    if (args.m <= 0 || args.n <= 0) {
        return cudaSuccess;
    }
    const DType bias_type = args.bias != nullptr ? args.bias_type : args.d_type;
    return WithFloatTypes(args.ab_type, args.d_type, [&](auto ab_tag, auto d_tag) {
        return WithFloatType(bias_type, [&](auto bias_tag) {
            using T = decltype(ab_tag);
            using D = decltype(d_tag);
            using B = decltype(bias_tag);
            constexpr int kVec = 16 / static_cast<int>(sizeof(D));
            const bool vector = args.inc_a == 1 && args.m % kVec == 0 && args.ldd % kVec == 0 &&
                                IsAligned(args.d, 16) && IsAligned(args.a, sizeof(T) * kVec);
            return vector ? Run<T, D, B, kVec>(args, stream) : Run<T, D, B, 1>(args, stream);
        });
    });
}

} // namespace shardline::kernels::cuda
