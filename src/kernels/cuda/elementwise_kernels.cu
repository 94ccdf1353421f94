// Elementwise kernels and the general reductions (see elementwise_kernels.h). No fmt/spdlog here (nvcc 13 rejects
// fmt 9's consteval format strings): launchers return a cudaError_t for the host side to check.

#include "device_utils.cuh"
#include "elementwise_kernels.h"

namespace shardline::kernels::cuda {
namespace {

// kVec elements per 16-byte access where every pointer is 16-byte aligned (the last n % kVec one by one), as AddKernel:
// the scalar kernels ran at about half the memory bandwidth on an H100 (an MoE layer's [49152, 1408] bf16 GELU: 165 µs
// forward, 200 µs backward, against 82 / 124 µs of DRAM traffic). The same float math per element either way.
template <class T, bool kErf, int kVec>
__global__ void GeluForwardKernel(const T *__restrict__ x, T *__restrict__ y, std::int64_t n) {
    using Vec = AlignedVector<T, kVec>;
    const std::int64_t nv = n / kVec;
    for (std::int64_t i = GlobalThread(); i < nv; i += GridThreads()) {
        const Vec xv = reinterpret_cast<const Vec *>(x)[i];
        Vec yv;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            const float v = ToFloat(xv.val[k]);
            yv.val[k] = FromFloat<T>(kErf ? GeluErf(v) : GeluTanh(v));
        }
        reinterpret_cast<Vec *>(y)[i] = yv;
    }
    for (std::int64_t i = nv * kVec + GlobalThread(); i < n; i += GridThreads()) {
        const float v = ToFloat(x[i]);
        y[i] = FromFloat<T>(kErf ? GeluErf(v) : GeluTanh(v));
    }
}

template <class T, bool kErf, int kVec>
__global__ void GeluBackwardKernel(const T *__restrict__ dy, const T *__restrict__ x, T *__restrict__ dx,
                                   std::int64_t n) {
    using Vec = AlignedVector<T, kVec>;
    const std::int64_t nv = n / kVec;
    for (std::int64_t i = GlobalThread(); i < nv; i += GridThreads()) {
        const Vec xv = reinterpret_cast<const Vec *>(x)[i];
        const Vec dyv = reinterpret_cast<const Vec *>(dy)[i];
        Vec dxv;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            const float v = ToFloat(xv.val[k]);
            dxv.val[k] = FromFloat<T>(ToFloat(dyv.val[k]) * (kErf ? GeluErfGrad(v) : GeluTanhGrad(v)));
        }
        reinterpret_cast<Vec *>(dx)[i] = dxv;
    }
    for (std::int64_t i = nv * kVec + GlobalThread(); i < n; i += GridThreads()) {
        const float v = ToFloat(x[i]);
        dx[i] = FromFloat<T>(ToFloat(dy[i]) * (kErf ? GeluErfGrad(v) : GeluTanhGrad(v)));
    }
}

// No __restrict__: out may alias an input (each element is read before it is written, by the same thread).
// kVec elements per 16-byte access where every pointer is 16-byte aligned (the last n % kVec one by one): a scalar
// bf16 add of the README job's [8192, 2048] residual ran at half the memory bandwidth. The same float math per element
// either way, so the two paths give the same bits.
template <class T, int kVec> __global__ void AddKernel(const T *a, const T *b, T *out, std::int64_t n, float alpha) {
    using Vec = AlignedVector<T, kVec>;
    const std::int64_t nv = n / kVec;
    for (std::int64_t i = GlobalThread(); i < nv; i += GridThreads()) {
        const Vec av = reinterpret_cast<const Vec *>(a)[i];
        const Vec bv = reinterpret_cast<const Vec *>(b)[i];
        Vec ov;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            ov.val[k] = FromFloat<T>(ToFloat(av.val[k]) + alpha * ToFloat(bv.val[k]));
        }
        reinterpret_cast<Vec *>(out)[i] = ov;
    }
    for (std::int64_t i = nv * kVec + GlobalThread(); i < n; i += GridThreads()) {
        out[i] = FromFloat<T>(ToFloat(a[i]) + alpha * ToFloat(b[i]));
    }
}

template <class T, int kVec> __global__ void ScaleKernel(const T *x, T *out, std::int64_t n, float alpha) {
    using Vec = AlignedVector<T, kVec>;
    const std::int64_t nv = n / kVec;
    for (std::int64_t i = GlobalThread(); i < nv; i += GridThreads()) {
        const Vec xv = reinterpret_cast<const Vec *>(x)[i];
        Vec ov;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            ov.val[k] = FromFloat<T>(alpha * ToFloat(xv.val[k]));
        }
        reinterpret_cast<Vec *>(out)[i] = ov;
    }
    for (std::int64_t i = nv * kVec + GlobalThread(); i < n; i += GridThreads()) {
        out[i] = FromFloat<T>(alpha * ToFloat(x[i]));
    }
}

// No __restrict__: out may alias x. kVec elements per load; bias is read with the same vectors (cols % kVec == 0).
template <class T, int kVec>
__global__ void BiasAddRowsKernel(const T *x, const T *bias, T *out, std::int64_t rows, std::int64_t cols) {
    using Vec = AlignedVector<T, kVec>;
    const std::int64_t vcols = cols / kVec;
    const std::int64_t total = rows * vcols;
    for (std::int64_t i = GlobalThread(); i < total; i += GridThreads()) {
        const Vec xv = reinterpret_cast<const Vec *>(x)[i];
        const Vec bv = reinterpret_cast<const Vec *>(bias)[i % vcols];
        Vec ov;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            ov.val[k] = FromFloat<T>(ToFloat(xv.val[k]) + ToFloat(bv.val[k]));
        }
        reinterpret_cast<Vec *>(out)[i] = ov;
    }
}

template <class T, class O>
__global__ void MiddleSumKernel(const T *__restrict__ x, std::int64_t outer, std::int64_t reduce, std::int64_t inner,
                                O *__restrict__ out) {
    const std::int64_t total = outer * inner;
    for (std::int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
        const std::int64_t o = idx / inner;
        const std::int64_t i = idx - o * inner;
        const T *p = x + o * reduce * inner + i;
        float s = 0.0f;
        for (std::int64_t r = 0; r < reduce; ++r) {
            s += ToFloat(p[r * inner]);
        }
        out[idx] = FromFloat<O>(s);
    }
}

template <class T, class O>
__global__ void GenericSumKernel(const T *__restrict__ x, const SumDesc desc, O *__restrict__ out) {
    for (std::int64_t idx = GlobalThread(); idx < desc.out_numel; idx += GridThreads()) {
        std::int64_t rem = idx;
        std::int64_t base = 0;
        for (int d = desc.kept_rank - 1; d >= 0; --d) {
            base += (rem % desc.kept_shape[d]) * desc.kept_stride[d];
            rem /= desc.kept_shape[d];
        }
        float s = 0.0f;
        for (std::int64_t r = 0; r < desc.reduced_numel; ++r) {
            std::int64_t rr = r;
            std::int64_t offset = base;
            for (int d = desc.reduced_rank - 1; d >= 0; --d) {
                offset += (rr % desc.reduced_shape[d]) * desc.reduced_stride[d];
                rr /= desc.reduced_shape[d];
            }
            s += ToFloat(x[offset]);
        }
        out[idx] = FromFloat<O>(s);
    }
}

} // namespace

cudaError_t LaunchGeluForward(const void *x, void *y, DType dtype, std::int64_t n, bool erf, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        const auto *in = static_cast<const T *>(x);
        auto *out = static_cast<T *>(y);
        const bool vec = IsAligned(x, 16) && IsAligned(y, 16);
        const std::int64_t blocks = BlocksFor(vec ? (n + kVec - 1) / kVec : n);
        if (vec) {
            erf ? GeluForwardKernel<T, true, kVec><<<blocks, kThreads, 0, stream>>>(in, out, n)
                : GeluForwardKernel<T, false, kVec><<<blocks, kThreads, 0, stream>>>(in, out, n);
        } else {
            erf ? GeluForwardKernel<T, true, 1><<<blocks, kThreads, 0, stream>>>(in, out, n)
                : GeluForwardKernel<T, false, 1><<<blocks, kThreads, 0, stream>>>(in, out, n);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchGeluBackward(const void *dy, const void *x, void *dx, DType dtype, std::int64_t n, bool erf,
                               cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        const auto *g = static_cast<const T *>(dy);
        const auto *in = static_cast<const T *>(x);
        auto *out = static_cast<T *>(dx);
        const bool vec = IsAligned(dy, 16) && IsAligned(x, 16) && IsAligned(dx, 16);
        const std::int64_t blocks = BlocksFor(vec ? (n + kVec - 1) / kVec : n);
        if (vec) {
            erf ? GeluBackwardKernel<T, true, kVec><<<blocks, kThreads, 0, stream>>>(g, in, out, n)
                : GeluBackwardKernel<T, false, kVec><<<blocks, kThreads, 0, stream>>>(g, in, out, n);
        } else {
            erf ? GeluBackwardKernel<T, true, 1><<<blocks, kThreads, 0, stream>>>(g, in, out, n)
                : GeluBackwardKernel<T, false, 1><<<blocks, kThreads, 0, stream>>>(g, in, out, n);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchAdd(const void *a, const void *b, void *out, DType dtype, std::int64_t n, float alpha,
                      cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        if (IsAligned(a, 16) && IsAligned(b, 16) && IsAligned(out, 16)) {
            AddKernel<T, kVec><<<BlocksFor((n + kVec - 1) / kVec), kThreads, 0, stream>>>(
                static_cast<const T *>(a), static_cast<const T *>(b), static_cast<T *>(out), n, alpha);
        } else {
            AddKernel<T, 1><<<BlocksFor(n), kThreads, 0, stream>>>(static_cast<const T *>(a), static_cast<const T *>(b),
                                                                   static_cast<T *>(out), n, alpha);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchScale(const void *x, void *out, DType dtype, std::int64_t n, float alpha, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        if (IsAligned(x, 16) && IsAligned(out, 16)) {
            ScaleKernel<T, kVec><<<BlocksFor((n + kVec - 1) / kVec), kThreads, 0, stream>>>(
                static_cast<const T *>(x), static_cast<T *>(out), n, alpha);
        } else {
            ScaleKernel<T, 1>
                <<<BlocksFor(n), kThreads, 0, stream>>>(static_cast<const T *>(x), static_cast<T *>(out), n, alpha);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchBiasAddRows(const void *x, const void *bias, void *out, DType dtype, std::int64_t rows,
                              std::int64_t cols, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) {
        return cudaSuccess;
    }
    return WithFloatType(dtype, [&](auto tag) {
        using T = decltype(tag);
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        const bool vectorize = cols % kVec == 0 && IsAligned(x, 16) && IsAligned(bias, 16) && IsAligned(out, 16);
        if (vectorize) {
            BiasAddRowsKernel<T, kVec><<<BlocksFor(rows * cols / kVec), kThreads, 0, stream>>>(
                static_cast<const T *>(x), static_cast<const T *>(bias), static_cast<T *>(out), rows, cols);
        } else {
            BiasAddRowsKernel<T, 1><<<BlocksFor(rows * cols), kThreads, 0, stream>>>(
                static_cast<const T *>(x), static_cast<const T *>(bias), static_cast<T *>(out), rows, cols);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchMiddleSum(const void *x, DType dtype, std::int64_t outer, std::int64_t reduce, std::int64_t inner,
                            void *out, DType out_dtype, cudaStream_t stream) {
    if (outer <= 0 || inner <= 0) {
        return cudaSuccess;
    }
    return WithFloatTypes(dtype, out_dtype, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        MiddleSumKernel<T, O><<<BlocksFor(outer * inner), kThreads, 0, stream>>>(static_cast<const T *>(x), outer,
                                                                                 reduce, inner, static_cast<O *>(out));
        return cudaGetLastError();
    });
}

cudaError_t LaunchGenericSum(const void *x, DType dtype, const SumDesc &desc, void *out, DType out_dtype,
                             cudaStream_t stream) {
    if (desc.out_numel <= 0) {
        return cudaSuccess;
    }
    if (desc.kept_rank < 0 || desc.kept_rank > kMaxSumRank || desc.reduced_rank < 0 ||
        desc.reduced_rank > kMaxSumRank) {
        return cudaErrorInvalidValue;
    }
    return WithFloatTypes(dtype, out_dtype, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        GenericSumKernel<T, O><<<BlocksFor(desc.out_numel), kThreads, 0, stream>>>(static_cast<const T *>(x), desc,
                                                                                   static_cast<O *>(out));
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
