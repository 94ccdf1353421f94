#pragma once

// Optimizer steps on one local shard, elementwise (each rank updates its own shard of every parameter; the gradients
// were reduced before). The master parameter and its state are float32 (CPU: float32 or float64, all of one dtype);
// `model_param`, when given, receives the updated master rounded to its own dtype (the bf16/fp16 copy a
// half-precision model computes with, or a float32 copy), in the same pass. CUDA: one kernel launch per step, 16-byte
// loads where the pointers and the element count allow, fp32 math.

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

struct SgdStepArgs {
    Tensor& param;                     ///< float32 master (or float64 on the CPU)
    const Tensor& grad;                ///< same shape and dtype
    Tensor* momentum_buffer = nullptr; ///< same shape and dtype; required when momentum != 0
    double lr = 0;
    double momentum = 0;
    double dampening = 0;
    double weight_decay = 0;
    bool nesterov = false;         ///< needs momentum > 0 and dampening == 0 (as torch)
    bool first_step = false;       ///< torch: buf = g on the first step (the buffer's contents are not read)
    Tensor* model_param = nullptr; ///< optional copy to refresh from the updated master, any kernel dtype
};
struct SgdStepOp {
    static constexpr std::string_view kName = "SgdStep";
    using Fn = void (*)(const SgdStepArgs&);
};
/// torch.optim.SGD: g = grad + wd·param; if momentum != 0: buf = first_step ? g : momentum·buf + (1 - dampening)·g,
/// g = nesterov ? g + momentum·buf : buf; param -= lr·g; model_param = param.
void SgdStep(const SgdStepArgs& args);

struct AdamWStepArgs {
    Tensor& param;      ///< float32 master (or float64 on the CPU)
    const Tensor& grad; ///< same shape and dtype
    Tensor& exp_avg;    ///< m, same shape and dtype (zeros before the first step)
    Tensor& exp_avg_sq; ///< v, same shape and dtype (zeros before the first step)
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.01;
    std::int64_t step = 1;         ///< 1-based, for the bias corrections
    Tensor* model_param = nullptr; ///< optional copy to refresh from the updated master, any kernel dtype
};
struct AdamWStepOp {
    static constexpr std::string_view kName = "AdamWStep";
    using Fn = void (*)(const AdamWStepArgs&);
};
/// torch.optim.AdamW (amsgrad off): param *= 1 - lr·wd; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
/// param -= lr·(m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps); model_param = param.
void AdamWStep(const AdamWStepArgs& args);

} // namespace shardline::kernels
