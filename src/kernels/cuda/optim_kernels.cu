// Optimizer step kernels (see optim_kernels.h): fp32 math, one pass over every tensor of the list through
// multi_tensor_apply.cuh. One device function per optimizer holds the per-element math, so the vector and scalar
// paths, and a tensor updated alone or among others, give the same bits. No fmt/spdlog here: launchers return a
// cudaError_t.

#include <cstddef>
#include <initializer_list>

#include "device_utils.cuh"
#include "multi_tensor_apply.cuh"
#include "optim_kernels.h"

namespace shardline::kernels::cuda {
namespace {

using multi_tensor::Chunk;
using multi_tensor::kVec;

// The per-element math. Every rounding is spelled out with the _rn intrinsics, which the compiler never contracts or
// reorders: they are the fused multiply-adds nvcc's default contraction gave the earlier kernels (the same SASS), now
// fixed in the source, so the vector and scalar paths, and any launch a tensor lands in, give the same bits.

/// torch.optim.SGD on one element: param p and, with momentum, its buffer b (not read on the first step).
__device__ __forceinline__ void SgdElement(float &p, float &b, float g, const SgdHyper &h, bool first_step) {
    float d = __fmaf_rn(h.weight_decay, p, g); // g + wd·p
    if (h.use_momentum) {
        b = first_step ? d : __fmaf_rn(h.one_minus_dampening, d, __fmul_rn(h.momentum, b));
        d = h.nesterov ? __fmaf_rn(h.momentum, b, d) : b;
    }
    p = __fmaf_rn(-h.lr, d, p); // p - lr·d
}

/// torch.optim.AdamW (amsgrad off) on one element: param p, moments m and v.
__device__ __forceinline__ void AdamWElement(float &p, float &m, float &v, float g, const AdamWHyper &h,
                                             float step_size, float bias_correction2_sqrt) {
    m = __fmaf_rn(h.one_minus_beta1, g, __fmul_rn(h.beta1, m));               // β1·m + (1-β1)·g
    v = __fmaf_rn(__fmul_rn(h.one_minus_beta2, g), g, __fmul_rn(h.beta2, v)); // β2·v + (1-β2)·g·g
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bias_correction2_sqrt), h.eps);
    p = __fmaf_rn(p, h.decay, -__fdiv_rn(__fmul_rn(step_size, m), denom)); // p·(1 - lr·wd) - step_size·m / denom
}

template <int kN, class T> __device__ __forceinline__ AlignedVector<T, kN> Load(const T *p, std::int64_t i) {
    return *reinterpret_cast<const AlignedVector<T, kN> *>(p + i);
}
template <int kN, class T> __device__ __forceinline__ void Store(T *p, std::int64_t i, const AlignedVector<T, kN> &v) {
    *reinterpret_cast<AlignedVector<T, kN> *>(p + i) = v;
}

/// p + offset, or null for an absent tensor.
template <class T> __device__ __forceinline__ T *At(void *p, std::int64_t offset) {
    return p != nullptr ? static_cast<T *>(p) + offset : nullptr;
}

/// Whether every non-null pointer allows kVec-element vectors (the model copy's vector is kVec of its own elements).
bool Vectorizable(std::size_t model_bytes, const void *model, std::initializer_list<const void *> f32) {
    if (model != nullptr && !IsAligned(model, kVec * model_bytes)) {
        return false;
    }
    for (const void *p : f32) {
        if (p != nullptr && !IsAligned(p, kVec * sizeof(float))) {
            return false;
        }
    }
    return true;
}

/// The launch group of a tensor: its model copy's dtype, float32 when it has none (the kernel then skips the store).
template <class T> DType ModelGroup(const T &t) { return t.model == nullptr ? DType::kFloat32 : t.model_dtype; }

/// Calls launch(M{}, group) once for each model dtype group that has elements to update: one kernel instantiation per
/// model element type, so a list with mixed model copies takes a launch (or more) per dtype.
template <class T, class F> cudaError_t ForEachModelGroup(std::span<const T> tensors, F &&launch) {
    for (const T &t : tensors) {
        if (t.model != nullptr && t.model_dtype != DType::kFloat32 && t.model_dtype != DType::kFloat16 &&
            t.model_dtype != DType::kBFloat16) {
            return cudaErrorInvalidValue;
        }
    }
    for (const DType group : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
        bool any = false;
        for (const T &t : tensors) {
            any = any || (t.n > 0 && ModelGroup(t) == group);
        }
        if (!any) {
            continue;
        }
        const cudaError_t err = WithFloatType(group, [&](auto tag) { return launch(tag, group); });
        if (err != cudaSuccess) {
            return err;
        }
    }
    return cudaSuccess;
}

// ---- SGD: param, grad, momentum_buffer, model ----------------------------------------------------------------------

struct SgdExtra {
    bool first_step;
};
using SgdTable = multi_tensor::Table<4, SgdExtra>;

template <class M> struct SgdOp {
    SgdHyper h;

    struct View {
        float *param;
        const float *grad;
        float *buf;
        M *model;
        bool first_step;
    };
    static __device__ View Bind(const SgdTable &table, const Chunk &c) {
        const int t = c.tensor;
        return {.param = At<float>(table.ptr[0][t], c.start),
                .grad = At<const float>(table.ptr[1][t], c.start),
                .buf = At<float>(table.ptr[2][t], c.start),
                .model = At<M>(table.ptr[3][t], c.start),
                .first_step = table.extra[t].first_step};
    }
    template <int kN> __device__ void Apply(const View &v, std::int64_t i) const {
        AlignedVector<float, kN> p = Load<kN>(v.param, i);
        const AlignedVector<float, kN> g = Load<kN>(v.grad, i);
        AlignedVector<float, kN> b{};
        if (h.use_momentum && !v.first_step) {
            b = Load<kN>(v.buf, i);
        }
        AlignedVector<M, kN> mv;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            SgdElement(p.val[k], b.val[k], g.val[k], h, v.first_step);
            mv.val[k] = FromFloat<M>(p.val[k]);
        }
        Store<kN>(v.param, i, p);
        if (h.use_momentum) {
            Store<kN>(v.buf, i, b);
        }
        if (v.model != nullptr) {
            Store<kN>(v.model, i, mv);
        }
    }
};

// ---- AdamW: param, grad, exp_avg, exp_avg_sq, model ----------------------------------------------------------------

struct AdamWExtra {
    float step_size;
    float bias_correction2_sqrt;
};
using AdamWTable = multi_tensor::Table<5, AdamWExtra>;

template <class M> struct AdamWOp {
    AdamWHyper h;

    struct View {
        float *param;
        const float *grad;
        float *exp_avg;
        float *exp_avg_sq;
        M *model;
        AdamWExtra extra;
    };
    static __device__ View Bind(const AdamWTable &table, const Chunk &c) {
        const int t = c.tensor;
        return {.param = At<float>(table.ptr[0][t], c.start),
                .grad = At<const float>(table.ptr[1][t], c.start),
                .exp_avg = At<float>(table.ptr[2][t], c.start),
                .exp_avg_sq = At<float>(table.ptr[3][t], c.start),
                .model = At<M>(table.ptr[4][t], c.start),
                .extra = table.extra[t]};
    }
    template <int kN> __device__ void Apply(const View &v, std::int64_t i) const {
        AlignedVector<float, kN> p = Load<kN>(v.param, i);
        const AlignedVector<float, kN> g = Load<kN>(v.grad, i);
        AlignedVector<float, kN> m = Load<kN>(v.exp_avg, i);
        AlignedVector<float, kN> s = Load<kN>(v.exp_avg_sq, i);
        AlignedVector<M, kN> mv;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            AdamWElement(p.val[k], m.val[k], s.val[k], g.val[k], h, v.extra.step_size, v.extra.bias_correction2_sqrt);
            mv.val[k] = FromFloat<M>(p.val[k]);
        }
        Store<kN>(v.param, i, p);
        Store<kN>(v.exp_avg, i, m);
        Store<kN>(v.exp_avg_sq, i, s);
        if (v.model != nullptr) {
            Store<kN>(v.model, i, mv);
        }
    }
};

} // namespace

cudaError_t LaunchSgdStep(std::span<const SgdTensor> tensors, const SgdHyper &hyper, cudaStream_t stream,
                          MultiTensorLimits limits) {
    return ForEachModelGroup(tensors, [&](auto tag, DType group) {
        using M = decltype(tag);
        auto fill = [&](std::size_t e, SgdTable &table, int slot) {
            const SgdTensor &t = tensors[e];
            if (t.n <= 0 || ModelGroup(t) != group) {
                return false;
            }
            float *buf = hyper.use_momentum ? t.momentum_buffer : nullptr;
            table.ptr[0][slot] = t.param;
            table.ptr[1][slot] = const_cast<float *>(t.grad); // read only: the table holds one pointer type
            table.ptr[2][slot] = buf;
            table.ptr[3][slot] = t.model;
            table.n[slot] = t.n;
            table.extra[slot] = {.first_step = t.first_step};
            table.vec[slot] = Vectorizable(sizeof(M), t.model, {t.param, t.grad, buf});
            return true;
        };
        return multi_tensor::MultiTensorApply<SgdTable>(tensors.size(), fill, SgdOp<M>{hyper}, stream,
                                                        {limits.max_tensors, limits.max_blocks});
    });
}

cudaError_t LaunchAdamWStep(std::span<const AdamWTensor> tensors, const AdamWHyper &hyper, cudaStream_t stream,
                            MultiTensorLimits limits) {
    return ForEachModelGroup(tensors, [&](auto tag, DType group) {
        using M = decltype(tag);
        auto fill = [&](std::size_t e, AdamWTable &table, int slot) {
            const AdamWTensor &t = tensors[e];
            if (t.n <= 0 || ModelGroup(t) != group) {
                return false;
            }
            table.ptr[0][slot] = t.param;
            table.ptr[1][slot] = const_cast<float *>(t.grad); // read only: the table holds one pointer type
            table.ptr[2][slot] = t.exp_avg;
            table.ptr[3][slot] = t.exp_avg_sq;
            table.ptr[4][slot] = t.model;
            table.n[slot] = t.n;
            table.extra[slot] = {.step_size = t.step_size, .bias_correction2_sqrt = t.bias_correction2_sqrt};
            table.vec[slot] = Vectorizable(sizeof(M), t.model, {t.param, t.grad, t.exp_avg, t.exp_avg_sq});
            return true;
        };
        return multi_tensor::MultiTensorApply<AdamWTable>(tensors.size(), fill, AdamWOp<M>{hyper}, stream,
                                                          {limits.max_tensors, limits.max_blocks});
    });
}

} // namespace shardline::kernels::cuda
