// The default provider's non-GEMM CUDA ops: bias grad, GELU, Add, Scale, BiasAdd, Sum. The op wrappers in src/kernels
// have validated shapes, dtypes, devices and contiguity; these pick a kernel and launch it on the context stream.

#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

#include "cuda_ops.h"
#include "elementwise_kernels.h"
#include "epilogue_kernels.h"
#include "gemm_common.h"

namespace shardline::kernels::cuda {

void DefaultLinearBackwardBias(const LinearBackwardBiasArgs &args) {
    BiasGradColumnSum(args, ReduceImpl::kVectorized); // vectorised two-pass column sum
}

void CudaGeluForward(const GeluForwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.x.device().index);
    SHARDLINE_CHECK_CUDA(LaunchGeluForward(args.x.data(), args.y.data(), args.x.dtype(), args.x.numel(),
                                           args.approximation == GeluApproximation::kErf, ctx.stream()));
}

void CudaGeluBackward(const GeluBackwardArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.x.device().index);
    SHARDLINE_CHECK_CUDA(LaunchGeluBackward(args.dy.data(), args.x.data(), args.dx.data(), args.x.dtype(),
                                            args.x.numel(), args.approximation == GeluApproximation::kErf,
                                            ctx.stream()));
}

void CudaAdd(const AddArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.a.device().index);
    SHARDLINE_CHECK_CUDA(LaunchAdd(args.a.data(), args.b.data(), args.out.data(), args.a.dtype(), args.a.numel(),
                                   static_cast<float>(args.alpha), ctx.stream()));
}

void CudaScale(const ScaleArgs &args) {
    CudaContext &ctx = CudaContext::Get(args.x.device().index);
    SHARDLINE_CHECK_CUDA(LaunchScale(args.x.data(), args.out.data(), args.x.dtype(), args.x.numel(),
                                     static_cast<float>(args.alpha), ctx.stream()));
}

void CudaBiasAdd(const BiasAddArgs &args) {
    // x [..., n] is a row-major rows×n matrix; out[r, j] = x[r, j] + bias[j] in one launch.
    const std::int64_t cols = args.bias.numel();
    CudaContext &ctx = CudaContext::Get(args.x.device().index);
    SHARDLINE_CHECK_CUDA(LaunchBiasAddRows(args.x.data(), args.bias.data(), args.out.data(), args.x.dtype(),
                                           args.x.numel() / cols, cols, ctx.stream()));
}

void CudaSum(const SumArgs &args) {
    constexpr std::string_view kOp = SumOp::kName;
    const Tensor &x = args.x;
    CudaContext &ctx = CudaContext::Get(x.device().index);
    if (x.numel() == 0) {
        // An empty reduction: zeros (all-zero bits are 0.0 in every float dtype).
        SHARDLINE_CHECK_CUDA(cudaMemsetAsync(args.out.data(), 0, args.out.nbytes(), ctx.stream()));
        return;
    }
    const int rank = x.rank();
    std::vector<bool> reduced(static_cast<std::size_t>(rank), args.dims.empty());
    for (int d : args.dims) {
        reduced[static_cast<std::size_t>(d < 0 ? d + rank : d)] = true;
    }
    // Canonical form: drop size-1 dims (they change no index) and merge neighbours of the same kind (adjacent dims
    // of a contiguous tensor are one dim of their product). What remains alternates kept (K) and reduced (R).
    std::vector<std::pair<std::int64_t, bool>> groups;
    for (int d = 0; d < rank; ++d) {
        const std::int64_t size = x.shape()[static_cast<std::size_t>(d)];
        if (size == 1) {
            continue;
        }
        const bool r = reduced[static_cast<std::size_t>(d)];
        if (!groups.empty() && groups.back().second == r) {
            groups.back().first *= size;
        } else {
            groups.emplace_back(size, r);
        }
    }
    const DType xt = x.dtype();
    const DType ot = args.out.dtype();
    const cudaStream_t stream = ctx.stream();
    const std::size_t g = groups.size();
    auto is = [&](std::initializer_list<bool> pattern) {
        if (pattern.size() != g) {
            return false;
        }
        std::size_t i = 0;
        for (bool r : pattern) {
            if (groups[i++].second != r) {
                return false;
            }
        }
        return true;
    };
    if (g == 0) { // a single element
        SHARDLINE_CHECK_CUDA(LaunchMiddleSum(x.data(), xt, 1, 1, 1, args.out.data(), ot, stream));
    } else if (is({false})) { // nothing reduced: a cast
        SHARDLINE_CHECK_CUDA(LaunchMiddleSum(x.data(), xt, groups[0].first, 1, 1, args.out.data(), ot, stream));
    } else if (is({true})) {
        SHARDLINE_CHECK_CUDA(
            LaunchRowSum(x.data(), xt, 1, groups[0].first, groups[0].first, args.out.data(), ot, false, stream));
    } else if (is({false, true})) { // reduce trailing dims: row sums
        SHARDLINE_CHECK_CUDA(LaunchRowSum(x.data(), xt, groups[0].first, groups[1].first, groups[1].first,
                                          args.out.data(), ot, false, stream));
    } else if (is({true, false})) { // reduce leading dims: the bias-grad column sum
        ColumnSum(ctx, x.data(), xt, groups[0].first, groups[1].first, groups[1].first, args.out.data(), ot, false,
                  ReduceImpl::kVectorized);
    } else if (is({false, true, false})) {
        SHARDLINE_CHECK_CUDA(LaunchMiddleSum(x.data(), xt, groups[0].first, groups[1].first, groups[2].first,
                                             args.out.data(), ot, stream));
    } else {
        SumDesc desc;
        std::int64_t stride = 1;
        std::vector<std::int64_t> strides(g);
        for (std::size_t i = g; i-- > 0;) {
            strides[i] = stride;
            stride *= groups[i].first;
        }
        desc.out_numel = 1;
        desc.reduced_numel = 1;
        // Appends group i to the kept or the reduced dims of desc.
        auto append = [&](std::size_t i, int &rank, std::int64_t *shape, std::int64_t *stride_of, std::int64_t &numel,
                          std::string_view which) {
            SHARDLINE_CHECK_AS(ShapeError, rank < kMaxSumRank, kOp,
                               "CUDA Sum supports at most {} separate {} dim groups, x is {}", kMaxSumRank, which,
                               x.ToString());
            shape[rank] = groups[i].first;
            stride_of[rank] = strides[i];
            numel *= groups[i].first;
            ++rank;
        };
        for (std::size_t i = 0; i < g; ++i) {
            if (groups[i].second) {
                append(i, desc.reduced_rank, desc.reduced_shape, desc.reduced_stride, desc.reduced_numel, "reduced");
            } else {
                append(i, desc.kept_rank, desc.kept_shape, desc.kept_stride, desc.out_numel, "kept");
            }
        }
        SHARDLINE_CHECK_CUDA(LaunchGenericSum(x.data(), xt, desc, args.out.data(), ot, stream));
    }
}

} // namespace shardline::kernels::cuda
