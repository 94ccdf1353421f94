#pragma once

// Launchers for the optimizer steps (optim_kernels.cu). Declarations only: host code includes this without nvcc. The
// master parameter, its gradient and states are float32; the model copy, when not null, is float32, float16 or
// bfloat16. One launch per step: 4-float vectors when every pointer and n allow, scalars otherwise.

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

struct SgdHyper {
    float lr = 0;
    float momentum = 0;
    float one_minus_dampening = 1; ///< from the double on the host, like AdamW's 1 - beta
    float weight_decay = 0;
    bool use_momentum = false;
    bool nesterov = false;
    bool first_step = false;
};
/// torch.optim.SGD on n elements (momentum_buffer may be null without momentum; model may be null).
cudaError_t LaunchSgdStep(float *param, const float *grad, float *momentum_buffer, void *model, DType model_dtype,
                          std::int64_t n, const SgdHyper &hyper, cudaStream_t stream);

struct AdamWHyper {
    float decay = 1; ///< 1 - lr·weight_decay
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    /// 1 - beta, rounded once from the double on the host: 1.0f - 0.999f loses 1.3e-5 to cancellation, which torch
    /// (and the CPU kernel) do not.
    float one_minus_beta1 = 0.1f;
    float one_minus_beta2 = 0.001f;
    float step_size = 0;             ///< lr / (1 - beta1^t)
    float bias_correction2_sqrt = 1; ///< sqrt(1 - beta2^t)
    float eps = 1e-8f;
};
/// torch.optim.AdamW on n elements (model may be null).
cudaError_t LaunchAdamWStep(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, void *model,
                            DType model_dtype, std::int64_t n, const AdamWHyper &hyper, cudaStream_t stream);

} // namespace shardline::kernels::cuda
