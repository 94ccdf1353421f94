// The default provider's LinearBackward on CUDA: dX, dW and db together.
//
// The bias grad is fused into the wgrad GEMM (BGRADB) where that measured faster for the shape (the Gemm plan's
// decision, gemm_tuning.h); otherwise it is the separate column sum of dY, which then runs on a side stream of the
// device while the dgrad and wgrad GEMMs run on the compute stream: all three only read dY. The side stream forks from
// the compute stream after everything queued so far and joins it before the call returns (an event each way), so the
// caller sees one stream, and a CUDA graph capture of the compute stream takes the side branch in.

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

#include "cuda_ops.h"
#include "epilogue_kernels.h"
#include "gemm_common.h"
#include "kernels/linear_gemm.h"

namespace shardline::kernels::cuda {
namespace {

/// A device's side stream (highest priority, so the short reduction is scheduled as soon as SMs free up) and the two
/// events that fork it from and join it to the compute stream. Created on first use, never destroyed.
struct SideStream {
    std::mutex mutex; ///< one fork/join at a time per device: the events are reused
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;
};

SideStream &SideStreamOf(int device) {
    static std::mutex mutex;
    static auto *sides = new std::unordered_map<int, SideStream>();
    std::lock_guard lock(mutex);
    SideStream &side = (*sides)[device];
    if (side.stream == nullptr) {
        int least = 0;
        int greatest = 0;
        SHARDLINE_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        SHARDLINE_CHECK_CUDA(cudaStreamCreateWithPriority(&side.stream, cudaStreamNonBlocking, greatest));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming));
    }
    return side;
}

/// True when the ops this kernel would otherwise reach through the dispatcher are served by the default provider
/// for the provider chosen for LinearBackward: then calling them directly (and the column sum on a side stream)
/// changes nothing but the schedule. Any override (SetOpProvider("Gemm", ...), a provider with its own
/// LinearBackwardWeight ...) sends the call to the composition, which honours it.
/// The answer is kept per thread for the dispatcher's selection generation and the caller's provider: resolving four
/// ops costs four locks per call, the check one atomic load.
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
        fused_bias = can_fuse && BGradBFused(wgrad);
        if (can_fuse && !fused_bias) {
            wgrad = detail::LinearWgradGemm(dy, *args.x, *args.dweight, nullptr, args.accumulate);
        }
    }
    const bool separate_bias = args.dbias != nullptr && !fused_bias;
    const bool gemms = args.dx != nullptr || args.dweight != nullptr;
    // dy [..., out] is a row-major rows×out matrix; db[j] (+)= Σ_rows dy[row, j].
    const std::int64_t cols = dy.shape().back();
    const std::int64_t rows = dy.numel() / cols;

    SideStream *side = separate_bias && gemms ? &SideStreamOf(ctx.device()) : nullptr;
    if (side != nullptr) {
        // The side stream's reduction scratch must already be large enough when the compute stream is being
        // captured (it cannot grow then, and a graph allocation on the compute stream would not be ordered before
        // the side branch): otherwise the column sum stays on the compute stream.
        const ColumnSumPlan plan = PlanColumnSum(dy.data(), dy.dtype(), rows, cols, cols, ctx.multiprocessors(), true);
        if (plan.partial_elems > 0 &&
            ReduceScratch(ctx, side->stream, static_cast<std::size_t>(plan.partial_elems)) == nullptr) {
            side = nullptr;
        }
    }
    if (separate_bias && side == nullptr) {
        ColumnSum(ctx, dy.data(), dy.dtype(), rows, cols, cols, args.dbias->data(), args.dbias->dtype(),
                  args.accumulate, ReduceImpl::kVectorized);
    }
    std::unique_lock<std::mutex> side_lock;
    const cudaStream_t main = ctx.stream();
    if (side != nullptr) {
        side_lock = std::unique_lock(side->mutex);
        SHARDLINE_CHECK_CUDA(cudaEventRecord(side->fork, main));
        SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(side->stream, side->fork, 0));
        ColumnSumOn(ctx, side->stream, dy.data(), dy.dtype(), rows, cols, cols, args.dbias->data(), args.dbias->dtype(),
                    args.accumulate, ReduceImpl::kVectorized);
    }
    try {
        if (args.dx != nullptr) {
            Gemm(detail::LinearDgradGemm(dy, *args.weight, *args.dx));
        }
        if (args.dweight != nullptr) {
            Gemm(wgrad);
        }
    } catch (...) {
        if (side != nullptr) {
            // Join anyway: a capture must not be left with an unjoined branch, and db's writer must precede reuse.
            (void)cudaEventRecord(side->join, side->stream);
            (void)cudaStreamWaitEvent(main, side->join, 0);
        }
        throw;
    }
    if (side != nullptr) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(side->join, side->stream));
        SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(main, side->join, 0));
    }
}

} // namespace shardline::kernels::cuda
