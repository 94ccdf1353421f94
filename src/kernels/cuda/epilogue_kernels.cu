// Separate epilogue kernels and the column/row reductions (see epilogue_kernels.h). No fmt/spdlog here: nvcc 13
// rejects fmt 9's consteval format strings, so launchers return a cudaError_t and the host side checks it.

#include <algorithm>

#include "device_utils.cuh"
#include "epilogue_kernels.h"

namespace shardline::kernels::cuda {
namespace {

// Column-major m×n walks: threads run down a column (contiguous i), blocks stride over columns, so every warp
// touches one contiguous segment and the per-row vectors (bias) are read once per thread and column.
constexpr int kMatrixBlocksX = 32;
constexpr int kMatrixBlocksY = 65535;

dim3 MatrixGrid(std::int64_t m, std::int64_t n) {
    const std::int64_t bx = std::min<std::int64_t>((m + kThreads - 1) / kThreads, kMatrixBlocksX);
    const std::int64_t by = std::min<std::int64_t>(n, kMatrixBlocksY);
    return dim3(static_cast<unsigned>(std::max<std::int64_t>(bx, 1)),
                static_cast<unsigned>(std::max<std::int64_t>(by, 1)));
}

#define SHARDLINE_MATRIX_LOOP(m, n)                                                                                    \
    for (std::int64_t j = blockIdx.y; j < (n); j += gridDim.y)                                                         \
        for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (m);               \
             i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

template <class T>
__global__ void ScaleMatrixKernel(T *d, std::int64_t m, std::int64_t n, std::int64_t ld, float beta) {
    SHARDLINE_MATRIX_LOOP(m, n) {
        T *p = d + i + j * ld;
        *p = beta == 0.0f ? FromFloat<T>(0.0f) : FromFloat<T>(beta * ToFloat(*p));
    }
}

template <class T, class B>
__global__ void BiasAddKernel(T *d, std::int64_t m, std::int64_t n, std::int64_t ld, const B *__restrict__ bias) {
    SHARDLINE_MATRIX_LOOP(m, n) {
        T *p = d + i + j * ld;
        *p = FromFloat<T>(ToFloat(*p) + ToFloat(bias[i]));
    }
}

template <class T, class B>
__global__ void BiasGeluAuxKernel(T *d, std::int64_t m, std::int64_t n, std::int64_t ld, const B *__restrict__ bias,
                                  T *__restrict__ aux, std::int64_t ldaux) {
    SHARDLINE_MATRIX_LOOP(m, n) {
        T *p = d + i + j * ld;
        const float v = ToFloat(*p) + (bias != nullptr ? ToFloat(bias[i]) : 0.0f);
        aux[i + j * ldaux] = FromFloat<T>(v);
        *p = FromFloat<T>(GeluTanh(v));
    }
}

template <class T>
__global__ void GeluFromAuxKernel(T *d, std::int64_t m, std::int64_t n, std::int64_t ld, const T *__restrict__ aux,
                                  std::int64_t ldaux) {
    SHARDLINE_MATRIX_LOOP(m, n) { d[i + j * ld] = FromFloat<T>(GeluTanh(ToFloat(aux[i + j * ldaux]))); }
}

template <class T>
__global__ void DGeluKernel(T *d, std::int64_t m, std::int64_t n, std::int64_t ld, const T *__restrict__ aux,
                            std::int64_t ldaux) {
    SHARDLINE_MATRIX_LOOP(m, n) {
        T *p = d + i + j * ld;
        *p = FromFloat<T>(ToFloat(*p) * GeluTanhGrad(ToFloat(aux[i + j * ldaux])));
    }
}

#undef SHARDLINE_MATRIX_LOOP

// ---------------------------------------------------------------------------------------------------------------------
// Column sum (bias gradient): a block owns 32·VEC adjacent columns and one chunk of rows. Its 32×8 threads read
// 16-byte vectors (a warp covers 512 contiguous bytes of one row), accumulate in fp32 registers down the rows, then
// the 8 row-groups are added in a fixed order through shared memory. With several chunks each writes fp32 partials
// and a second kernel adds the chunks in order: the result never depends on scheduling.

constexpr int kSumWarpsY = 8;

template <class T, int VEC> struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

/// This thread's column of the block's tile (-1 when it holds none) and, in `sum`, that column's sum over the block's
/// chunk of rows.
template <class T, int VEC>
__device__ __forceinline__ std::int64_t ColumnChunkSum(const T *__restrict__ x, std::int64_t rows, std::int64_t cols,
                                                       std::int64_t ld, std::int64_t rows_per_split,
                                                       float (&smem)[kSumWarpsY][32 * VEC], float &sum) {
    const std::int64_t col0 = (static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
    const std::int64_t r_begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_split;
    const std::int64_t r_end = std::min(rows, r_begin + rows_per_split);
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
        acc[v] = 0.0f;
    }
    if (col0 < cols) {
        for (std::int64_t r = r_begin + threadIdx.y; r < r_end; r += kSumWarpsY) {
            const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC> *>(x + r * ld + col0);
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
                acc[v] += ToFloat(p.v[v]);
            }
        }
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
        smem[threadIdx.y][threadIdx.x * VEC + v] = acc[v];
    }
    __syncthreads();
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 * VEC + tid;
    if (tid >= 32 * VEC || col >= cols) {
        return -1;
    }
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < kSumWarpsY; ++y) {
        s += smem[y][tid];
    }
    sum = s;
    return col;
}

/// One chunk (splits == 1): writes out directly.
template <class T, int VEC, class O>
__global__ void __launch_bounds__(32 * kSumWarpsY)
    ColumnSumDirectKernel(const T *__restrict__ x, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                          std::int64_t rows_per_split, O *__restrict__ out, bool accumulate) {
    __shared__ float smem[kSumWarpsY][32 * VEC];
    float s = 0.0f;
    const std::int64_t col = ColumnChunkSum<T, VEC>(x, rows, cols, ld, rows_per_split, smem, s);
    if (col >= 0) {
        out[col] = FromFloat<O>(accumulate ? s + ToFloat(out[col]) : s);
    }
}

/// Several chunks: chunk blockIdx.y writes partials[blockIdx.y·cols + col].
template <class T, int VEC>
__global__ void __launch_bounds__(32 * kSumWarpsY)
    ColumnSumPartialKernel(const T *__restrict__ x, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                           std::int64_t rows_per_split, float *__restrict__ partials) {
    __shared__ float smem[kSumWarpsY][32 * VEC];
    float s = 0.0f;
    const std::int64_t col = ColumnChunkSum<T, VEC>(x, rows, cols, ld, rows_per_split, smem, s);
    if (col >= 0) {
        partials[static_cast<std::int64_t>(blockIdx.y) * cols + col] = s;
    }
}

template <class O>
__global__ void ColumnSumFinalizeKernel(const float *__restrict__ partials, std::int64_t splits, std::int64_t cols,
                                        O *__restrict__ out, bool accumulate) {
    for (std::int64_t c = GlobalThread(); c < cols; c += GridThreads()) {
        float s = 0.0f;
        for (std::int64_t k = 0; k < splits; ++k) {
            s += partials[k * cols + c];
        }
        if (accumulate) {
            s += ToFloat(out[c]);
        }
        out[c] = FromFloat<O>(s);
    }
}

template <class T, class O>
__global__ void __launch_bounds__(kThreads) RowSumKernel(const T *__restrict__ x, std::int64_t rows, std::int64_t cols,
                                                         std::int64_t ld, O *__restrict__ out, bool accumulate) {
    __shared__ float smem[kThreads];
    for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *row = x + r * ld;
        float s = 0.0f;
        for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
            s += ToFloat(row[c]);
        }
        smem[threadIdx.x] = s;
        __syncthreads();
        for (int width = kThreads / 2; width > 0; width /= 2) {
            if (static_cast<int>(threadIdx.x) < width) {
                smem[threadIdx.x] += smem[threadIdx.x + width];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            float total = smem[0];
            if (accumulate) {
                total += ToFloat(out[r]);
            }
            out[r] = FromFloat<O>(total);
        }
        __syncthreads(); // smem is reused by the next row
    }
}

template <class T, int VEC, class O>
cudaError_t RunColumnSum(const ColumnSumPlan &plan, const T *x, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         O *out, bool accumulate, float *partials, cudaStream_t stream) {
    const std::int64_t tiles = (cols + 32 * VEC - 1) / (32 * VEC);
    const dim3 block(32, kSumWarpsY);
    if (plan.splits <= 1) {
        const std::int64_t rows_per_split = std::max<std::int64_t>(rows, 1);
        ColumnSumDirectKernel<T, VEC, O><<<dim3(static_cast<unsigned>(tiles), 1), block, 0, stream>>>(
            x, rows, cols, ld, rows_per_split, out, accumulate);
        return cudaGetLastError();
    }
    if (partials == nullptr) {
        return cudaErrorInvalidValue;
    }
    ColumnSumPartialKernel<T, VEC>
        <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(plan.splits)), block, 0, stream>>>(
            x, rows, cols, ld, plan.rows_per_split, partials);
    if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) {
        return status;
    }
    ColumnSumFinalizeKernel<O><<<BlocksFor(cols), kThreads, 0, stream>>>(partials, plan.splits, cols, out, accumulate);
    return cudaGetLastError();
}

} // namespace

cudaError_t LaunchScaleMatrix(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, float beta,
                              cudaStream_t stream) {
    if (m <= 0 || n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        ScaleMatrixKernel<T><<<MatrixGrid(m, n), kThreads, 0, stream>>>(static_cast<T *>(d), m, n, ld, beta);
        return cudaGetLastError();
    });
}

cudaError_t LaunchBiasAdd(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *bias,
                          DType bias_dtype, cudaStream_t stream) {
    if (m <= 0 || n <= 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, bias_dtype, [&](auto tag, auto bias_tag) {
        using T = decltype(tag);
        using B = decltype(bias_tag);
        BiasAddKernel<T, B>
            <<<MatrixGrid(m, n), kThreads, 0, stream>>>(static_cast<T *>(d), m, n, ld, static_cast<const B *>(bias));
        return cudaGetLastError();
    });
}

cudaError_t LaunchBiasGeluAux(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *bias,
                              DType bias_dtype, void *aux, std::int64_t ldaux, cudaStream_t stream) {
    if (m <= 0 || n <= 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, bias_dtype, [&](auto tag, auto bias_tag) {
        using T = decltype(tag);
        using B = decltype(bias_tag);
        BiasGeluAuxKernel<T, B><<<MatrixGrid(m, n), kThreads, 0, stream>>>(
            static_cast<T *>(d), m, n, ld, static_cast<const B *>(bias), static_cast<T *>(aux), ldaux);
        return cudaGetLastError();
    });
}

cudaError_t LaunchGeluFromAux(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *aux,
                              std::int64_t ldaux, cudaStream_t stream) {
    if (m <= 0 || n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        GeluFromAuxKernel<T><<<MatrixGrid(m, n), kThreads, 0, stream>>>(static_cast<T *>(d), m, n, ld,
                                                                        static_cast<const T *>(aux), ldaux);
        return cudaGetLastError();
    });
}

cudaError_t LaunchDGelu(void *d, DType dtype, std::int64_t m, std::int64_t n, std::int64_t ld, const void *aux,
                        std::int64_t ldaux, cudaStream_t stream) {
    if (m <= 0 || n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        DGeluKernel<T><<<MatrixGrid(m, n), kThreads, 0, stream>>>(static_cast<T *>(d), m, n, ld,
                                                                  static_cast<const T *>(aux), ldaux);
        return cudaGetLastError();
    });
}

ColumnSumPlan PlanColumnSum(const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                            int multiprocessors, bool vectorize) {
    ColumnSumPlan plan;
    const std::int64_t es = static_cast<std::int64_t>(ElementSize(dtype));
    const std::int64_t vec = es > 0 ? 16 / es : 1;
    const bool aligned = reinterpret_cast<std::uintptr_t>(x) % 16 == 0;
    plan.vec = (vectorize && aligned && cols % vec == 0 && ld % vec == 0) ? static_cast<int>(vec) : 1;
    const std::int64_t tiles = std::max<std::int64_t>((cols + 32 * plan.vec - 1) / (32 * plan.vec), 1);
    // About four blocks per SM in total, and at least 64 rows per chunk so that a chunk amortises its partial write.
    const std::int64_t target_blocks = 4 * static_cast<std::int64_t>(std::max(multiprocessors, 1));
    std::int64_t splits = std::max<std::int64_t>(1, (target_blocks + tiles - 1) / tiles);
    splits = std::min(splits, std::max<std::int64_t>(1, rows / 64));
    splits = std::min<std::int64_t>(splits, 65535);
    std::int64_t rows_per_split = (rows + splits - 1) / std::max<std::int64_t>(splits, 1);
    rows_per_split = std::max<std::int64_t>((rows_per_split + kSumWarpsY - 1) / kSumWarpsY * kSumWarpsY, kSumWarpsY);
    plan.splits = std::max<std::int64_t>(1, (rows + rows_per_split - 1) / rows_per_split);
    plan.rows_per_split = rows_per_split;
    plan.partial_elems = plan.splits > 1 ? plan.splits * cols : 0;
    return plan;
}

cudaError_t LaunchColumnSum(const ColumnSumPlan &plan, const void *x, DType dtype, std::int64_t rows, std::int64_t cols,
                            std::int64_t ld, void *out, DType out_dtype, bool accumulate, float *partials,
                            cudaStream_t stream) {
    if (cols <= 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, out_dtype, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        const T *xt = static_cast<const T *>(x);
        O *ot = static_cast<O *>(out);
        constexpr int kVec = static_cast<int>(16 / sizeof(T));
        if (plan.vec == kVec) {
            return RunColumnSum<T, kVec, O>(plan, xt, rows, cols, ld, ot, accumulate, partials, stream);
        }
        if (plan.vec != 1) {
            return cudaErrorInvalidValue;
        }
        return RunColumnSum<T, 1, O>(plan, xt, rows, cols, ld, ot, accumulate, partials, stream);
    });
}

cudaError_t LaunchRowSum(const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld, void *out,
                         DType out_dtype, bool accumulate, cudaStream_t stream) {
    if (rows <= 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, out_dtype, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(rows, 65535));
        RowSumKernel<T, O><<<blocks, kThreads, 0, stream>>>(static_cast<const T *>(x), rows, cols, ld,
                                                            static_cast<O *>(out), accumulate);
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
