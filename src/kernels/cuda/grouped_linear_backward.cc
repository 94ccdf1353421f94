// The default provider's GroupedLinearBackward on CUDA: the dgrad on the compute stream and, beside it on the device's
// side stream, the wgrad and the bias grad (all three only read dy). Each grouped GEMM is one persistent CUTLASS kernel
// whose last wave leaves SMs idle; run one after the other, the second cannot start until the first has drained. On
// two streams the second's CTAs take the SMs the first's tail frees. The side stream forks from the compute stream
// after everything queued so far and joins it before the call returns (LinearBackward's pattern, side_stream.h), so
// the caller sees one stream and a CUDA graph capture takes the branch in.
//
// It runs concurrently only where that changes nothing but the schedule: the nested grouped ops are the default
// provider's, SHARDLINE_GROUPED_CONCURRENT_BWD is on, dx and a parameter grad are both wanted, the wgrad takes the
// CUTLASS path (the loop of cuBLASLt GEMMs would share the context's cuBLASLt workspace with the dgrad) and neither
// GEMM's shape class is still to be tuned (the tuning times candidates with the device to itself). Otherwise the split
// ops run one after the other (CompositeGroupedLinearBackward), which is also how the first call of a class tunes.
// Results are bitwise those of the serial path: the same kernels on the same operands, only the order differs.
//
// Memory: every buffer the side work uses — the wgrad's scratch and the device copy of host sizes — is allocated on
// the compute stream before the fork and released after the join (stream-ordered frees on the compute stream), so the
// pool never hands it to other work while the side stream may still use it.

#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "cuda_ops.h"
#include "grouped_gemm_cuda.h"
#include "grouped_kernels.h"
#include "kernels/grouped_internal.h"
#include "kernels/grouped_tuning.h"
#include "side_stream.h"

namespace shardline::kernels::cuda {
namespace {

/// Whether the ops the serial path reaches through the dispatcher are the default provider's for the caller's
/// provider: then running their kernels directly (the wgrad on the side stream) changes nothing but the schedule.
bool NestedGroupedOpsAreDefault() {
    const std::string_view caller = detail::CurrentProvider();
    constexpr DeviceType kCuda = DeviceType::kCUDA;
    return OpTable<GroupedGemmOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
           OpTable<GroupedLinearBackwardInputOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
           OpTable<GroupedLinearBackwardWeightOp>::Resolve(kCuda, caller).provider == kDefaultProvider &&
           OpTable<GroupedLinearBackwardBiasOp>::Resolve(kCuda, caller).provider == kDefaultProvider;
}

} // namespace

void CudaGroupedLinearBackward(const GroupedLinearBackwardArgs& args) {
    const bool side_work = args.dweight != nullptr || args.dbias != nullptr;
    if (!GetGroupedConcurrentBackward() || args.dx == nullptr || args.dx->numel() == 0 || !side_work ||
        !NestedGroupedOpsAreDefault()) {
        detail::CompositeGroupedLinearBackward(args);
        return;
    }
    const GroupedGemmParams dgrad = detail::GroupedDgradProblem({.dy = args.dy,
                                                                 .weight = *args.weight,
                                                                 .group_sizes = args.group_sizes,
                                                                 .dx = *args.dx,
                                                                 .input_activation = args.input_activation,
                                                                 .pre_activation = args.pre_activation});
    if (GroupedGemmWouldTune(dgrad)) {
        detail::CompositeGroupedLinearBackward(args);
        return;
    }
    std::optional<GroupedGemmParams> wgrad;
    std::optional<PreparedGroupedGemm> wgrad_call;
    if (args.dweight != nullptr) {
        wgrad = detail::GroupedWgradProblem({.dy = args.dy,
                                             .x = *args.x,
                                             .group_sizes = args.group_sizes,
                                             .dweight = *args.dweight,
                                             .accumulate = args.accumulate});
        wgrad_call = PrepareCutlassGroupedGemm(*wgrad);
        if (!wgrad_call) {
            detail::CompositeGroupedLinearBackward(args);
            return;
        }
    }
    const bool host_sizes = args.group_sizes.device().is_cpu();
    if (args.dbias != nullptr && host_sizes && detail::ComputeStreamCapturing(args.dy.device())) {
        // The device-size bias grad would upload host memory inside the capture: the split op's per-group loop.
        detail::CompositeGroupedLinearBackward(args);
        return;
    }
    CudaContext& ctx = CudaContext::Get(args.dy.device().index);
    const cudaStream_t main = ctx.stream();
    // The bias grad's device sizes: the wgrad's upload, the caller's device tensor, or an upload now (before the fork).
    Tensor bias_sizes;
    if (args.dbias != nullptr) {
        bias_sizes =
            wgrad_call ? wgrad_call->sizes : (host_sizes ? args.group_sizes.To(args.dy.device()) : args.group_sizes);
    }

    SideStream& side = SideStreamOf(ctx.device());
    std::unique_lock<std::mutex> side_lock(side.mutex);
    bool wgrad_refused = false;
    ForkSideStream(side, main);
    try {
        if (wgrad_call) {
            wgrad_refused = !LaunchPreparedGroupedGemm(*wgrad_call, side.stream);
        }
        if (args.dbias != nullptr) {
            SHARDLINE_CHECK_CUDA(LaunchGroupedColumnSum(args.dy.data(), args.dy.dtype(), args.dy.size(0),
                                                        args.dy.size(1), bias_sizes.data_as<std::int64_t>(),
                                                        static_cast<int>(bias_sizes.numel()), args.dbias->data(),
                                                        args.dbias->dtype(), args.accumulate, side.stream));
        }
        GroupedGemm(dgrad);
    } catch (...) {
        JoinSideStream(side, main, /*on_error=*/true);
        throw;
    }
    JoinSideStream(side, main);
    side_lock.unlock();
    detail::CountGroupedConcurrentBackward();
    if (wgrad_refused) {
        GroupedGemm(*wgrad); // CUTLASS declined after all: the provider's own fallback, on the compute stream
    } else if (wgrad_call) {
        detail::SetLastGroupedGemmPath(wgrad_call->path); // as the serial path leaves it: the wgrad ran last
    }
}

} // namespace shardline::kernels::cuda
