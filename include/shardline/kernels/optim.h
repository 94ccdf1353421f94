#pragma once

// Optimizer steps on one local shard, elementwise (each rank updates its own shard of every parameter; the gradients
// were reduced before). The master parameter and its state are float32 (CPU: float32 or float64, all of one dtype);
// `model_param`, when given, receives the updated master rounded to its own dtype (the bf16/fp16 copy a
// half-precision model computes with, or a float32 copy), in the same pass.
//
// The Multi forms update a list of tensors with shared hyper-parameters in few launches (torch's fused / _foreach
// optimizers, multi_tensor_apply): each entry carries what differs between parameters (its tensors, its model copy
// and its own step count), and the result is bit for bit that of the single-tensor op run on each entry in turn. The
// CPU provider is that loop; CUDA packs up to 110 tensors and 2560 chunks of 64 Ki elements into one launch (a pointer
// table passed as the kernel's argument, up to CUDA 12.1's 32 KB) and runs the same per-element fp32 math as the
// single-tensor op, which is the one-entry case of the same kernel. 16-byte loads where a tensor's pointers allow (the
// tail of a size that is not a multiple of 4 element by element), scalars otherwise.

#include <cstdint>
#include <span>
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

/// One tensor of SgdStepMulti: SgdStepArgs's per-tensor fields.
struct SgdStepTensor {
    Tensor& param;                     ///< float32 master (or float64 on the CPU)
    const Tensor& grad;                ///< same shape and dtype
    Tensor* momentum_buffer = nullptr; ///< same shape and dtype; required when momentum != 0
    bool first_step = false;           ///< this tensor's first update (its buffer starts as g)
    Tensor* model_param = nullptr;     ///< optional copy to refresh from the updated master, any kernel dtype
};
struct SgdStepMultiArgs {
    std::span<const SgdStepTensor> tensors = {}; ///< at least one; all on one device; no two entries share memory
    double lr = 0;
    double momentum = 0;
    double dampening = 0;
    double weight_decay = 0;
    bool nesterov = false;
    /// CUDA: at most this many tensors / 64 Ki-element chunks in one launch (0, or more than the kernel's table holds:
    /// 110 and 2560). Only the launch count changes, never a value; tests use small limits to run the continuation.
    int max_tensors_per_launch = 0;
    int max_chunks_per_launch = 0;
};
struct SgdStepMultiOp {
    static constexpr std::string_view kName = "SgdStepMulti";
    using Fn = void (*)(const SgdStepMultiArgs&);
};
/// SgdStep on every entry (bitwise the same), in few launches on CUDA.
void SgdStepMulti(const SgdStepMultiArgs& args);

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

/// One tensor of AdamWStepMulti: AdamWStepArgs's per-tensor fields.
struct AdamWStepTensor {
    Tensor& param;                 ///< float32 master (or float64 on the CPU)
    const Tensor& grad;            ///< same shape and dtype
    Tensor& exp_avg;               ///< m, same shape and dtype
    Tensor& exp_avg_sq;            ///< v, same shape and dtype
    std::int64_t step = 1;         ///< this tensor's own 1-based step count (entries may differ)
    Tensor* model_param = nullptr; ///< optional copy to refresh from the updated master, any kernel dtype
};
struct AdamWStepMultiArgs {
    std::span<const AdamWStepTensor> tensors = {}; ///< at least one; all on one device; no two entries share memory
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.01;
    /// CUDA: at most this many tensors / 64 Ki-element chunks in one launch (0, or more than the kernel's table holds:
    /// 110 and 2560). Only the launch count changes, never a value; tests use small limits to run the continuation.
    int max_tensors_per_launch = 0;
    int max_chunks_per_launch = 0;
};
struct AdamWStepMultiOp {
    static constexpr std::string_view kName = "AdamWStepMulti";
    using Fn = void (*)(const AdamWStepMultiArgs&);
};
/// AdamWStep on every entry (bitwise the same), in few launches on CUDA.
void AdamWStepMulti(const AdamWStepMultiArgs& args);

} // namespace shardline::kernels
