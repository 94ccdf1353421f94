#pragma once

// Launchers for the optimizer steps (optim_kernels.cu). Declarations only: host code includes this without nvcc. The
// master parameter, its gradient and states are float32; the model copy, when not null, is float32, float16 or
// bfloat16. A launcher takes a list of tensors with shared hyper-parameters (the single-tensor ops pass a list of
// one) and updates them in few launches (multi_tensor_apply.cuh): 4-float vectors where a tensor's pointers allow,
// scalars otherwise, the same fp32 math per element either way.

#include <cstdint>
#include <span>

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
};
/// One tensor of an SGD step (momentum_buffer may be null without momentum; model may be null).
struct SgdTensor {
    float *param = nullptr;
    const float *grad = nullptr;
    float *momentum_buffer = nullptr;
    void *model = nullptr;
    DType model_dtype = DType::kFloat32;
    std::int64_t n = 0;
    bool first_step = false; ///< buf = g (the buffer is not read)
};
/// A launch's capacity (multi_tensor::Limits): 0 = the table's own (110 tensors, 2560 blocks of 64 Ki elements).
struct MultiTensorLimits {
    int max_tensors = 0;
    int max_blocks = 0;
};

/// torch.optim.SGD on every tensor.
cudaError_t LaunchSgdStep(std::span<const SgdTensor> tensors, const SgdHyper &hyper, cudaStream_t stream,
                          MultiTensorLimits limits = {});

struct AdamWHyper {
    float decay = 1; ///< 1 - lr·weight_decay
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    /// 1 - beta, rounded once from the double on the host: 1.0f - 0.999f loses 1.3e-5 to cancellation, which torch
    /// (and the CPU kernel) do not.
    float one_minus_beta1 = 0.1f;
    float one_minus_beta2 = 0.001f;
    float eps = 1e-8f;
};
/// One tensor of an AdamW step, with its own bias corrections (its own step count t), computed in fp64 on the host.
struct AdamWTensor {
    float *param = nullptr;
    const float *grad = nullptr;
    float *exp_avg = nullptr;
    float *exp_avg_sq = nullptr;
    void *model = nullptr;
    DType model_dtype = DType::kFloat32;
    std::int64_t n = 0;
    float step_size = 0;             ///< lr / (1 - beta1^t)
    float bias_correction2_sqrt = 1; ///< sqrt(1 - beta2^t)
};
/// torch.optim.AdamW on every tensor.
cudaError_t LaunchAdamWStep(std::span<const AdamWTensor> tensors, const AdamWHyper &hyper, cudaStream_t stream,
                            MultiTensorLimits limits = {});

} // namespace shardline::kernels::cuda
