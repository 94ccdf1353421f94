// Optimizer step kernels (see optim_kernels.h): fp32 math, one pass over the shard. No fmt/spdlog here: launchers
// return a cudaError_t.

#include "device_utils.cuh"
#include "optim_kernels.h"

namespace shardline::kernels::cuda {
namespace {

constexpr int kVec = 4; // 16 bytes of float32

/// Whether every non-null pointer allows kVec-element vectors (the model copy's vector is kVec of its own elements).
bool Vectorizable(std::int64_t n, std::size_t model_bytes, const void *model, std::initializer_list<const void *> f32) {
    if (n % kVec != 0 || (model != nullptr && !IsAligned(model, kVec * model_bytes))) {
        return false;
    }
    for (const void *p : f32) {
        if (p != nullptr && !IsAligned(p, kVec * sizeof(float))) {
            return false;
        }
    }
    return true;
}

template <class M, int kN>
__global__ void SgdKernel(float *__restrict__ param, const float *__restrict__ grad, float *__restrict__ buf,
                          M *__restrict__ model, std::int64_t n_vec, const SgdHyper h) {
    using F = AlignedVector<float, kN>;
    using MV = AlignedVector<M, kN>;
    for (std::int64_t i = GlobalThread(); i < n_vec; i += GridThreads()) {
        F p = reinterpret_cast<const F *>(param)[i];
        const F g = reinterpret_cast<const F *>(grad)[i];
        F b{};
        if (h.use_momentum && !h.first_step) {
            b = reinterpret_cast<const F *>(buf)[i];
        }
        MV mv;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            float d = g.val[k] + h.weight_decay * p.val[k];
            if (h.use_momentum) {
                b.val[k] = h.first_step ? d : h.momentum * b.val[k] + h.one_minus_dampening * d;
                d = h.nesterov ? d + h.momentum * b.val[k] : b.val[k];
            }
            p.val[k] -= h.lr * d;
            mv.val[k] = FromFloat<M>(p.val[k]);
        }
        reinterpret_cast<F *>(param)[i] = p;
        if (h.use_momentum) {
            reinterpret_cast<F *>(buf)[i] = b;
        }
        if (model != nullptr) {
            reinterpret_cast<MV *>(model)[i] = mv;
        }
    }
}

template <class M, int kN>
__global__ void AdamWKernel(float *__restrict__ param, const float *__restrict__ grad, float *__restrict__ exp_avg,
                            float *__restrict__ exp_avg_sq, M *__restrict__ model, std::int64_t n_vec,
                            const AdamWHyper h) {
    using F = AlignedVector<float, kN>;
    using MV = AlignedVector<M, kN>;
    for (std::int64_t i = GlobalThread(); i < n_vec; i += GridThreads()) {
        F p = reinterpret_cast<const F *>(param)[i];
        const F g = reinterpret_cast<const F *>(grad)[i];
        F m = reinterpret_cast<const F *>(exp_avg)[i];
        F v = reinterpret_cast<const F *>(exp_avg_sq)[i];
        MV mv;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            const float gk = g.val[k];
            m.val[k] = h.beta1 * m.val[k] + h.one_minus_beta1 * gk;
            v.val[k] = h.beta2 * v.val[k] + h.one_minus_beta2 * gk * gk;
            const float denom = sqrtf(v.val[k]) / h.bias_correction2_sqrt + h.eps;
            p.val[k] = p.val[k] * h.decay - h.step_size * m.val[k] / denom;
            mv.val[k] = FromFloat<M>(p.val[k]);
        }
        reinterpret_cast<F *>(param)[i] = p;
        reinterpret_cast<F *>(exp_avg)[i] = m;
        reinterpret_cast<F *>(exp_avg_sq)[i] = v;
        if (model != nullptr) {
            reinterpret_cast<MV *>(model)[i] = mv;
        }
    }
}

/// Calls f(M{}) with the model copy's element type (float when there is none: the kernel then skips the store).
template <class F> cudaError_t WithModelType(const void *model, DType model_dtype, F &&f) {
    return model == nullptr ? f(float{}) : WithFloatType(model_dtype, f);
}

} // namespace

cudaError_t LaunchSgdStep(float *param, const float *grad, float *momentum_buffer, void *model, DType model_dtype,
                          std::int64_t n, const SgdHyper &hyper, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithModelType(model, model_dtype, [&](auto tag) {
        using M = decltype(tag);
        M *m = static_cast<M *>(model);
        float *buf = hyper.use_momentum ? momentum_buffer : nullptr;
        if (Vectorizable(n, sizeof(M), model, {param, grad, buf})) {
            SgdKernel<M, kVec><<<BlocksFor(n / kVec), kThreads, 0, stream>>>(param, grad, buf, m, n / kVec, hyper);
        } else {
            SgdKernel<M, 1><<<BlocksFor(n), kThreads, 0, stream>>>(param, grad, buf, m, n, hyper);
        }
        return cudaGetLastError();
    });
}

cudaError_t LaunchAdamWStep(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, void *model,
                            DType model_dtype, std::int64_t n, const AdamWHyper &hyper, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;
    }
    return WithModelType(model, model_dtype, [&](auto tag) {
        using M = decltype(tag);
        M *m = static_cast<M *>(model);
        if (Vectorizable(n, sizeof(M), model, {param, grad, exp_avg, exp_avg_sq})) {
            AdamWKernel<M, kVec>
                <<<BlocksFor(n / kVec), kThreads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, m, n / kVec, hyper);
        } else {
            AdamWKernel<M, 1><<<BlocksFor(n), kThreads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, m, n, hyper);
        }
        return cudaGetLastError();
    });
}

} // namespace shardline::kernels::cuda
