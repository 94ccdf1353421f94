// The default provider's CUDA ops for training beyond the Linear layers: embedding, cross-entropy stages, optimizer
// steps. The op wrappers in src/kernels have validated shapes, dtypes, devices and contiguity (and settled the empty
// cases); these pick a kernel and launch it on the context stream. EmbeddingBag picks between its gather kernels and
// the count matrix + one Gemm (ChooseEmbeddingBagImpl, include/shardline/kernels/embedding.h).

#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/gemm.h>

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

namespace {

/// The bag ops' problem for ChooseEmbeddingBagImpl: ids [T, N] over a [rows, hidden] shard, counts in `dtype`.
EmbeddingBagProblem BagProblem(const Tensor &ids, std::int64_t rows, std::int64_t hidden, DType dtype,
                               const CudaContext &ctx, bool half_accumulate = false) {
    const std::int64_t bag = ids.size(0);
    return {.bag = bag,
            .count = bag == 0 ? 0 : ids.numel() / bag,
            .rows = rows,
            .hidden = hidden,
            .dtype = dtype,
            .tf32 = ctx.allow_tf32(),
            .half_accumulate = half_accumulate};
}

/// The count matrix C [N, ld] (row-major, ld = EmbeddingBagCountsLd(rows), columns rows..ld-1 zero) of the problem's
/// ids, in its dtype: stream-ordered scratch from the device's pool, freed (stream-ordered) when the caller drops it
/// after queuing the GEMM that reads it, so the pool hands the same bytes to the next step.
std::shared_ptr<Storage> CountMatrix(const Tensor &ids, const EmbeddingBagProblem &p, std::int64_t vocab_start,
                                     CudaContext &ctx) {
    const std::int64_t ld = EmbeddingBagCountsLd(p.rows);
    const std::shared_ptr<Storage> counts =
        Storage::Allocate(static_cast<std::size_t>(p.count * ld) * ElementSize(p.dtype), ids.device());
    SHARDLINE_CHECK_CUDA(
        LaunchEmbeddingBagCounts(I64(ids), p.bag, p.count, vocab_start, p.rows, p.dtype, counts->data(), ctx.stream()));
    return counts;
}

} // namespace

void CudaEmbeddingBagForward(const EmbeddingBagForwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.out.device().index);
    const Tensor &weight = args.weight;
    const EmbeddingBagProblem p = BagProblem(args.ids, weight.size(0), weight.size(1), weight.dtype(), ctx);
    if (ChooseEmbeddingBagImpl(p, GetEmbeddingBagImpl(), EmbeddingBagForwardOp::kName) == EmbeddingBagImpl::kGather) {
        SHARDLINE_CHECK_CUDA(LaunchEmbeddingBagForward(I64(args.ids), p.bag, p.count, args.vocab_start, weight.data(),
                                                       p.rows, p.hidden, weight.dtype(), args.out.data(),
                                                       ctx.stream()));
        return;
    }
    const std::shared_ptr<Storage> counts = CountMatrix(args.ids, p, args.vocab_start, ctx);
    // out [N, H] = C [N, V] · W [V, H] (row-major). Column-major: outᵀ (H×N, ld H) = Wᵀ (H×V: W row-major [V, H] with
    // ld H) · Cᵀ (V×N: C row-major [N, ld] is column-major ld×N, whose first V rows are read), so m = H, n = N, k = V,
    // no transposes. beta = 0: out is overwritten.
    Gemm(GemmParams{.m = p.hidden,
                    .n = p.count,
                    .k = p.rows,
                    .a = weight.data(),
                    .lda = p.hidden,
                    .a_type = weight.dtype(),
                    .b = counts->data(),
                    .ldb = EmbeddingBagCountsLd(p.rows),
                    .b_type = weight.dtype(),
                    .c = args.out.data(),
                    .ldc = p.hidden,
                    .c_type = args.out.dtype(),
                    .beta = 0.0,
                    .device = args.out.device()});
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
    CudaContext &ctx = CudaContext::Get(args.dweight.device().index);
    const Tensor &dout = args.dout;
    Tensor &dweight = args.dweight;
    const EmbeddingBagProblem p = BagProblem(args.ids, dweight.size(0), dweight.size(1), dout.dtype(), ctx,
                                             args.accumulate && dweight.dtype() != DType::kFloat32);
    if (ChooseEmbeddingBagImpl(p, GetEmbeddingBagImpl(), EmbeddingBagBackwardOp::kName) == EmbeddingBagImpl::kGather) {
        SortedEmbeddingBackward(EmbeddingBagBackwardOp::kName, args.ids, dout, p.count, dweight, args.vocab_start,
                                args.accumulate);
        return;
    }
    const std::shared_ptr<Storage> counts = CountMatrix(args.ids, p, args.vocab_start, ctx);
    // dW [V, H] (+)= Cᵀ [V, N] · dout [N, H] (row-major), i.e. dWᵀ = doutᵀ · C. Column-major: dWᵀ (H×V, ld H) =
    // doutᵀ (H×N: dout row-major [N, H] with ld H) · op(B) (N×V), where B is the column-major V×N view of C
    // (row-major [N, ld], its first V rows read) and op(B) = Bᵀ = C: m = H, n = V, k = N, trans_b. beta = 1 adds into
    // dweight (its own dtype: a float32 main grad for half dout), beta = 0 overwrites it, rows no id hits included.
    Gemm(GemmParams{.trans_b = true,
                    .m = p.hidden,
                    .n = p.rows,
                    .k = p.count,
                    .a = dout.data(),
                    .lda = p.hidden,
                    .a_type = dout.dtype(),
                    .b = counts->data(),
                    .ldb = EmbeddingBagCountsLd(p.rows),
                    .b_type = dout.dtype(),
                    .c = dweight.data(),
                    .ldc = p.hidden,
                    .c_type = dweight.dtype(),
                    .beta = args.accumulate ? 1.0 : 0.0,
                    .device = dweight.device()});
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
