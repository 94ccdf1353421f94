// The default provider's LinearBackward on CUDA: dX, dW and db together (and, for a layer after a GELU, the GELU's
// gradient and the previous layer's bias grad).
//
// The bias grad is fused into the wgrad GEMM (BGRADB) where that measured faster for the shape (the Gemm plan's
// decision, gemm_tuning.h); otherwise it is the separate column sum of dY, which then runs on a side stream of the
// device while the dgrad and wgrad GEMMs run on the compute stream: all three only read dY. Likewise the previous
// layer's bias grad rides in the dgrad GEMM (DGELU_BGRAD) where that measured faster and it is overwritten; otherwise
// it is the column sum of dX after the dgrad GEMM (whose epilogue still applies the GELU grad, DGELU), on the side
// stream while the wgrad GEMM runs. The side stream forks from the compute stream after everything queued so far
// (before the GEMMs, and again after the dgrad GEMM) and joins it before the call returns, so the caller sees one
// stream, and a CUDA graph capture of the compute stream takes the side branch in. A sum of a small tensor stays on
// the compute stream (SideStreamPays).

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

#include "cuda_ops.h"
#include "epilogue_kernels.h"
#include "gemm_common.h"
#include "gemm_lt_plan.h"
#include "kernels/linear_gemm.h"
#include "side_stream.h"

namespace shardline::kernels::cuda {
namespace {

/// True when the ops this kernel would otherwise reach through the dispatcher are served by the default provider
/// for the provider chosen for LinearBackward: then calling them directly (and the column sum on a side stream)
/// changes nothing but the schedule. Any override (SetOpProvider("Gemm", ...), a provider with its own
/// LinearBackwardWeight ...) sends the call to the composition, which honours it.
/// The answer is kept per thread for the dispatcher's selection generation and the caller's provider: resolving four
/// ops costs four cache searches and copies of their provider names per call, the check one atomic load.
bool NestedOpsAreDefault() {
    thread_local std::uint64_t cached_generation = 0;
    thread_local std::string cached_caller;
    thread_local bool cached = false;
    const std::string_view caller = detail::CurrentProvider();
    const std::uint64_t generation = detail::SelectionGeneration();
    if (generation == cached_generation && caller == cached_caller) {
        return cached;
    }
    constexpr DeviceType kCuda = DeviceType::kCUDA;
    cached = OpTable<GemmOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
             OpTable<LinearBackwardInputOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
             OpTable<LinearBackwardWeightOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
             OpTable<LinearBackwardBiasOp>::Resolve(kCuda, caller).provider == kDefaultProvider;
    // Read the generation before resolving: a change during the resolution makes the next call resolve again.
    cached_generation = generation;
    cached_caller = std::string(caller);
    return cached;
}

/// The column sum out (+)= Σ_rows t of a row-major [..., cols] tensor, and its plan (for the scratch it needs).
struct BiasGradSum {
    const Tensor *t = nullptr;
    Tensor *out = nullptr;
    std::int64_t rows = 0;
    std::int64_t cols = 0;

    BiasGradSum() = default;
    BiasGradSum(const Tensor &from, Tensor &into)
        : t(&from), out(&into), rows(from.shape().back() == 0 ? 0 : from.numel() / from.shape().back()),
          cols(from.shape().back()) {}
    explicit operator bool() const { return t != nullptr; }
    std::int64_t Partials(const CudaContext &ctx) const {
        return PlanColumnSum(t->data(), t->dtype(), rows, cols, cols, ctx.multiprocessors(), true).partial_elems;
    }
    void On(CudaContext &ctx, cudaStream_t stream, bool accumulate) const {
        ColumnSumOn(ctx, stream, t->data(), t->dtype(), rows, cols, cols, out->data(), out->dtype(), accumulate,
                    ReduceImpl::kVectorized);
    }
};

/// Whether a column sum of `t` is worth a side stream on `stream`. Below 2^15 elements (64 KiB of bf16) the sum is a
/// few µs of GPU time (1.45 µs at one token, N = 256, beside GEMMs of 1.4–2.4 µs), so an eager step is paced by the
/// host, to which the fork and join cost two event records and two stream waits (0.4–1 µs a pair on the H100 hosts,
/// docs/PERFORMANCE.md). Under a capture they are paid once, and the replay keeps the overlap.
bool SideStreamPays(const Tensor &t, cudaStream_t stream) {
    return t.numel() >= (std::int64_t{1} << 15) || lt::StreamCapturing(stream);
}

} // namespace

void CudaLinearBackward(const LinearBackwardArgs &args) {
    if (!NestedOpsAreDefault()) {
        detail::CompositeLinearBackward(args);
        return;
    }
    const Tensor &dy = args.dy;
    CudaContext &ctx = CudaContext::Get(dy.device().index);

    // The wgrad GEMM, with the bias grad fused where the plan measured that faster (BGRADB cannot accumulate).
    GemmParams wgrad;
    bool fused_bias = false;
    if (args.dweight != nullptr) {
        const bool can_fuse = args.dbias != nullptr && !args.accumulate;
        wgrad = detail::LinearWgradGemm(dy, *args.x, *args.dweight, can_fuse ? args.dbias : nullptr, args.accumulate);
        fused_bias = can_fuse && EpilogueRunsFused(wgrad);
        if (can_fuse && !fused_bias) {
            wgrad = detail::LinearWgradGemm(dy, *args.x, *args.dweight, nullptr, args.accumulate);
        }
    }
    // The dgrad GEMM, with the previous layer's GELU grad in its epilogue (DGELU) and that layer's bias grad too
    // (DGELU_BGRAD) where the plan measured that faster; DGELU_BGRAD cannot accumulate and writes dx's dtype.
    GemmParams dgrad;
    bool fused_pre_bias = false;
    Tensor *pre_dbias = args.dx != nullptr ? args.pre_activation_dbias : nullptr;
    if (args.dx != nullptr) {
        const Tensor *pre = args.input_activation == LinearActivation::kGeluTanh ? args.pre_activation : nullptr;
        const bool can_fuse =
            pre_dbias != nullptr && detail::DgradCanFuseBiasGrad(*args.dx, *pre_dbias, args.accumulate);
        // A dx_residual (checked: no activation) is the GEMM's separate C, beta = 1.
        dgrad =
            detail::LinearDgradGemm(dy, *args.weight, *args.dx, pre, can_fuse ? pre_dbias : nullptr, args.dx_residual);
        fused_pre_bias = can_fuse && EpilogueRunsFused(dgrad);
        if (can_fuse && !fused_pre_bias) {
            dgrad = detail::LinearDgradGemm(dy, *args.weight, *args.dx, pre, nullptr, args.dx_residual);
        }
    }
    // The bias grads that run as column sums: db of dy (any time), and the previous layer's of dx (after the dgrad).
    const BiasGradSum bias_sum = args.dbias != nullptr && !fused_bias ? BiasGradSum(dy, *args.dbias) : BiasGradSum();
    const BiasGradSum pre_sum =
        pre_dbias != nullptr && !fused_pre_bias ? BiasGradSum(*args.dx, *pre_dbias) : BiasGradSum();
    // On the side stream they overlap the GEMMs: db all of them, the previous bias grad the wgrad GEMM. Not, outside a
    // capture, for a sum of a small tensor, where the fork and join cost the host more than the overlap saves the GPU
    // (a capture pays them once, and its replays keep the overlap).
    const bool bias_may = bias_sum && (args.dx != nullptr || args.dweight != nullptr);
    const bool pre_may = pre_sum && args.dweight != nullptr;
    const bool bias_beside = bias_may && SideStreamPays(dy, ctx.stream());
    const bool pre_beside = pre_may && SideStreamPays(*args.dx, ctx.stream());
    SideStream *side = bias_beside || pre_beside ? &SideStreamOf(ctx.device()) : nullptr;
    // The side stream's reduction scratch must be large enough for every sum that may run there: it cannot grow while
    // the compute stream is captured (and a graph allocation on the compute stream would not be ordered before the
    // side branch), so a sum kept on the compute stream grows it too, for a later capture of the step (once per larger
    // shape; a one-row sum needs none). Where it is too small in a capture, the sums stay on the compute stream.
    const std::int64_t partials = std::max(bias_may ? bias_sum.Partials(ctx) : std::int64_t{0},
                                           pre_may ? pre_sum.Partials(ctx) : std::int64_t{0});
    if (partials > 0 &&
        ReduceScratch(ctx, SideStreamOf(ctx.device()).stream, static_cast<std::size_t>(partials)) == nullptr) {
        side = nullptr;
    }
    const cudaStream_t main = ctx.stream();
    if (bias_sum && (side == nullptr || !bias_beside)) {
        bias_sum.On(ctx, main, args.accumulate);
    }
    std::unique_lock<std::mutex> side_lock;
    bool forked = false;
    // Forks the side stream from everything queued on the compute stream so far.
    auto fork = [&] {
        forked = true;
        ForkSideStream(*side, main);
    };
    if (side != nullptr) {
        side_lock = std::unique_lock(side->mutex);
    }
    try {
        if (side != nullptr && bias_beside) {
            fork();
            bias_sum.On(ctx, side->stream, args.accumulate);
        }
        if (args.dx != nullptr) {
            Gemm(dgrad);
        }
        if (pre_sum) {
            if (side != nullptr && pre_beside) {
                fork(); // after the dgrad GEMM: the sum reads dx
                pre_sum.On(ctx, side->stream, args.accumulate);
            } else {
                pre_sum.On(ctx, main, args.accumulate);
            }
        }
        if (args.dweight != nullptr) {
            Gemm(wgrad);
        }
    } catch (...) {
        if (forked) {
            JoinSideStream(*side, main, /*on_error=*/true);
        }
        throw;
    }
    if (forked) {
        JoinSideStream(*side, main);
    }
}

} // namespace shardline::kernels::cuda
