// The default provider's CUDA ops for training beyond the Linear layers: embedding, cross-entropy stages, optimizer
// steps. The op wrappers in src/kernels have validated shapes, dtypes, devices and contiguity (and settled the empty
// cases); these pick a kernel and launch it on the context stream.

#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

#include "cross_entropy_kernels.h"
#include "cuda_ops.h"
#include "embedding_kernels.h"
#include "optim_kernels.h"

namespace shardline::kernels::cuda {
namespace {

const float *F32(const Tensor &t) { return static_cast<const float *>(t.data()); }
float *F32(Tensor &t) { return static_cast<float *>(t.data()); }
const std::int64_t *I64(const Tensor &t) { return static_cast<const std::int64_t *>(t.data()); }

/// logits [..., c] as n rows of c (the wrappers guarantee c > 0).
std::int64_t RowsOf(const Tensor &logits) { return logits.numel() / logits.shape().back(); }

CudaContext &ContextOf(const Tensor &t) { return CudaContext::Get(t.device().index); }

// The optimizer steps' hyper-parameters in fp32, each rounded once from the double (1 - dampening, 1 - beta too).
template <class Args> SgdHyper SgdHyperOf(const Args &args) {
    return {.lr = static_cast<float>(args.lr),
            .momentum = static_cast<float>(args.momentum),
            .one_minus_dampening = static_cast<float>(1.0 - args.dampening),
            .weight_decay = static_cast<float>(args.weight_decay),
            .use_momentum = args.momentum != 0.0,
            .nesterov = args.nesterov};
}

SgdTensor SgdTensorOf(Tensor &param, const Tensor &grad, Tensor *momentum_buffer, bool first_step, Tensor *model_param,
                      double momentum) {
    return {.param = F32(param),
            .grad = F32(grad),
            .momentum_buffer = momentum != 0.0 ? F32(*momentum_buffer) : nullptr,
            .model = model_param != nullptr ? model_param->data() : nullptr,
            .model_dtype = model_param != nullptr ? model_param->dtype() : DType::kFloat32,
            .n = param.numel(),
            .first_step = first_step};
}

template <class Args> AdamWHyper AdamWHyperOf(const Args &args) {
    return {.decay = static_cast<float>(1.0 - args.lr * args.weight_decay),
            .beta1 = static_cast<float>(args.beta1),
            .beta2 = static_cast<float>(args.beta2),
            .one_minus_beta1 = static_cast<float>(1.0 - args.beta1),
            .one_minus_beta2 = static_cast<float>(1.0 - args.beta2),
            .eps = static_cast<float>(args.eps)};
}

/// The bias corrections of step t in fp64 on the host, as torch computes them (Python floats), then rounded once.
template <class Args>
AdamWTensor AdamWTensorOf(Tensor &param, const Tensor &grad, Tensor &exp_avg, Tensor &exp_avg_sq, Tensor *model_param,
                          std::int64_t step, const Args &args) {
    const double t = static_cast<double>(step);
    return {.param = F32(param),
            .grad = F32(grad),
            .exp_avg = F32(exp_avg),
            .exp_avg_sq = F32(exp_avg_sq),
            .model = model_param != nullptr ? model_param->data() : nullptr,
            .model_dtype = model_param != nullptr ? model_param->dtype() : DType::kFloat32,
            .n = param.numel(),
            .step_size = static_cast<float>(args.lr / (1.0 - std::pow(args.beta1, t))),
            .bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(args.beta2, t)))};
}

} // namespace

void CudaEmbeddingForward(const EmbeddingForwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.out.device().index);
    SHARDLINE_CHECK_CUDA(LaunchEmbeddingForward(I64(args.ids), args.ids.numel(), args.vocab_start, args.weight.data(),
                                                args.weight.size(0), args.weight.size(1), args.weight.dtype(),
                                                args.out.data(), ctx.stream()));
}

void CudaEmbeddingBagForward(const EmbeddingBagForwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.out.device().index);
    const std::int64_t bag = args.ids.size(0);
    SHARDLINE_CHECK_CUDA(LaunchEmbeddingBagForward(
        I64(args.ids), bag, bag == 0 ? 0 : args.ids.numel() / bag, args.vocab_start, args.weight.data(),
        args.weight.size(0), args.weight.size(1), args.weight.dtype(), args.out.data(), ctx.stream()));
}

namespace {

/// The sorted segment-sum backward shared by EmbeddingBackward and EmbeddingBagBackward: position i of ids reads dout
/// row i mod dout_rows.
void SortedEmbeddingBackward(std::string_view op, const Tensor &ids, const Tensor &dout, std::int64_t dout_rows,
                             Tensor &dweight, std::int64_t vocab_start, bool accumulate) {
    const std::int64_t n = ids.numel();
    const std::int64_t rows = dweight.size(0);
    // The deterministic backward radix-sorts 32-bit (row, dout row) keys and values.
    constexpr std::int64_t kLimit = (std::int64_t{1} << 31) - 1;
    SHARDLINE_CHECK_AS(ShapeError, n < kLimit && rows < kLimit, op,
                       "the CUDA kernel takes fewer than 2^31 - 1 ids and table rows, got ids {} and dweight {}",
                       ids.ToString(), dweight.ToString());
    CudaContext &ctx = CudaContext::Get(dweight.device().index);
    std::size_t bytes = 0;
    SHARDLINE_CHECK_CUDA(EmbeddingBackwardWorkspace(n, rows, &bytes));
    // Stream-ordered scratch from the device's pool (O(ids), never O(dout)); freed (stream-ordered) after the kernels
    // are queued, so the pool hands the same bytes to the next step.
    const std::shared_ptr<Storage> workspace = Storage::Allocate(bytes, dweight.device());
    SHARDLINE_CHECK_CUDA(LaunchEmbeddingBackward(I64(ids), n, vocab_start, dout.data(), dout_rows, dout.dtype(),
                                                 dweight.data(), dweight.dtype(), rows, dweight.size(1), accumulate,
                                                 workspace->data(), bytes, ctx.stream()));
}

} // namespace

void CudaEmbeddingBackward(const EmbeddingBackwardArgs &args) {
    SortedEmbeddingBackward(EmbeddingBackwardOp::kName, args.ids, args.dout, args.ids.numel(), args.dweight,
                            args.vocab_start, args.accumulate);
}

void CudaEmbeddingBagBackward(const EmbeddingBagBackwardArgs &args) {
    // The wrapper has settled T = 0 and N = 0 (no ids): here every bag is non-empty and N = numel / T > 0.
    SortedEmbeddingBackward(EmbeddingBagBackwardOp::kName, args.ids, args.dout, args.ids.numel() / args.ids.size(0),
                            args.dweight, args.vocab_start, args.accumulate);
}

void CudaCrossEntropyRowMax(const CrossEntropyRowMaxArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.logits.device().index);
    SHARDLINE_CHECK_CUDA(LaunchCrossEntropyRowMax(args.logits.data(), args.logits.dtype(), RowsOf(args.logits),
                                                  args.logits.shape().back(), F32(args.row_max), ctx.stream()));
}

void CudaCrossEntropyStats(const CrossEntropyStatsArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.logits.device().index);
    SHARDLINE_CHECK_CUDA(LaunchCrossEntropyStats(
        args.logits.data(), args.logits.dtype(), RowsOf(args.logits), args.logits.shape().back(), F32(args.row_max),
        I64(args.labels), args.class_start, F32(args.sum_exp), F32(args.target_logit), ctx.stream()));
}

void CudaCrossEntropyLoss(const CrossEntropyLossArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.loss.device().index);
    SHARDLINE_CHECK_CUDA(LaunchCrossEntropyLoss(F32(args.row_max), F32(args.sum_exp), F32(args.target_logit),
                                                F32(args.loss), args.loss.numel(), ctx.stream()));
}

void CudaCrossEntropyBackward(const CrossEntropyBackwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.logits.device().index);
    SHARDLINE_CHECK_CUDA(LaunchCrossEntropyBackward(
        args.logits.data(), args.logits.dtype(), RowsOf(args.logits), args.logits.shape().back(), F32(args.row_max),
        F32(args.sum_exp), I64(args.labels), args.class_start, F32(args.dloss), args.dloss.numel() == 1,
        static_cast<float>(args.scale), args.dlogits.data(), ctx.stream()));
}

// The optimizer steps: the single-tensor ops are lists of one for the same launchers as the Multi ops.

void CudaSgdStep(const SgdStepArgs &args) {
    const SgdTensor tensor =
        SgdTensorOf(args.param, args.grad, args.momentum_buffer, args.first_step, args.model_param, args.momentum);
    SHARDLINE_CHECK_CUDA(LaunchSgdStep({&tensor, 1}, SgdHyperOf(args), ContextOf(args.param).stream()));
}

void CudaSgdStepMulti(const SgdStepMultiArgs &args) {
    std::vector<SgdTensor> tensors;
    tensors.reserve(args.tensors.size());
    for (const SgdStepTensor &t : args.tensors) {
        tensors.push_back(SgdTensorOf(t.param, t.grad, t.momentum_buffer, t.first_step, t.model_param, args.momentum));
    }
    SHARDLINE_CHECK_CUDA(LaunchSgdStep(tensors, SgdHyperOf(args), ContextOf(args.tensors[0].param).stream(),
                                       {args.max_tensors_per_launch, args.max_chunks_per_launch}));
}

void CudaAdamWStep(const AdamWStepArgs &args) {
    const AdamWTensor tensor =
        AdamWTensorOf(args.param, args.grad, args.exp_avg, args.exp_avg_sq, args.model_param, args.step, args);
    SHARDLINE_CHECK_CUDA(LaunchAdamWStep({&tensor, 1}, AdamWHyperOf(args), ContextOf(args.param).stream()));
}

void CudaAdamWStepMulti(const AdamWStepMultiArgs &args) {
    std::vector<AdamWTensor> tensors;
    tensors.reserve(args.tensors.size());
    for (const AdamWStepTensor &t : args.tensors) {
        tensors.push_back(AdamWTensorOf(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.model_param, t.step, args));
    }
    SHARDLINE_CHECK_CUDA(LaunchAdamWStep(tensors, AdamWHyperOf(args), ContextOf(args.tensors[0].param).stream(),
                                         {args.max_tensors_per_launch, args.max_chunks_per_launch}));
}

} // namespace shardline::kernels::cuda
