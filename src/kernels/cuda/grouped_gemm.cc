// The CUDA GroupedGemm provider: per call, the CUTLASS SM90 pointer-array grouped GEMM or the loop of cached cuBLASLt
// plans (the loop provider of grouped_gemm.cc), and the device-size grouped bias grad. The CUTLASS path reads the sizes
// on the device only (a setup kernel writes each group's shape and pointers), so with device-resident sizes no host
// code waits and a CUDA graph captures it.
//
// Which runs (CutlassChoice): SHARDLINE_GROUPED_GEMM = auto (default) | cutlass | loop. auto, until the GPU
// measurements of bench/grouped replace it with a per-shape table: CUTLASS for device-resident sizes (the only path
// without a host synchronisation) and for many small experts (≥ kManyExperts groups, or fewer than kSmallGroupRows
// rows per group on average), the loop for few large experts. The tile: SHARDLINE_GROUPED_GEMM_TILE = auto | 256x128 |
// 128x128; auto takes 128×128 below kSmallGroupRows rows per group.

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "cuda_ops.h"
#include "cutlass/grouped_cutlass.h"
#include "grouped_kernels.h"
#include "kernels/grouped_internal.h"

namespace shardline::kernels::cuda {
namespace {

namespace cg = cutlass_grouped;

constexpr std::int64_t kManyExperts = 16;
constexpr std::int64_t kSmallGroupRows = 1024;

bool Aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// The one eligibility predicate of the CUTLASS path, with the reason when it is not: this build has the kernels and
/// the device is an sm_90 (the kernels are sm_90a code); bf16/fp16 operands, D in their dtype (or float32 for a wgrad
/// into a main grad); alpha 1, beta 0 or 1; one of the three Linear layouts with packed leading dimensions; every
/// group's operands 16-byte aligned (pointers, leading dims and group/row strides); sizes within int32.
const char* CutlassIneligible(const GroupedGemmParams& p, cg::Args& args) {
    if (!cg::Built()) {
        return "this build has no CUTLASS grouped GEMM (SHARDLINE_WITH_CUTLASS off, or sm_90 not among its archs)";
    }
    CudaContext& ctx = CudaContext::Get(p.device.index);
    if (ctx.compute_capability() != 90) {
        return "the CUTLASS kernels are sm_90a code; this device is not an sm_90";
    }
    if (p.a_type != p.b_type || (p.a_type != DType::kBFloat16 && p.a_type != DType::kFloat16)) {
        return "operands are not bf16/fp16";
    }
    if (p.alpha != 1.0 || p.compute != GemmCompute::kDefault) {
        return "alpha != 1 or a non-default compute type";
    }
    const bool by_n = p.grouped_dim == GroupedDim::kN;
    if (p.trans_a && !p.trans_b && by_n) {
        args.layout = cg::Layout::kTN;
    } else if (!p.trans_a && !p.trans_b && by_n) {
        args.layout = cg::Layout::kNN;
    } else if (!p.trans_a && p.trans_b && !by_n) {
        args.layout = cg::Layout::kNT;
    } else {
        return "not one of the Linear layouts (forward TN, dgrad NN, wgrad NT)";
    }
    if (p.c_type != p.a_type && !(p.c_type == DType::kFloat32 && args.layout == cg::Layout::kNT)) {
        return "D is neither the operands' dtype nor a float32 wgrad";
    }
    if (p.epilogue != GemmEpilogue::kNone && !(p.epilogue == GemmEpilogue::kBias && by_n)) {
        return "an epilogue other than a forward bias";
    }
    // Packed leading dims: the shared dims of column-major op(A) m×k, op(B) k×n, D m×n.
    const bool packed = args.layout == cg::Layout::kTN   ? p.a.ld == p.k && p.b.ld == p.k
                        : args.layout == cg::Layout::kNN ? p.a.ld == p.m && p.b.ld == p.k
                                                         : p.a.ld == p.m && p.b.ld == p.n;
    if (!packed || p.c.ld != p.m) {
        return "leading dimensions are not packed";
    }
    const auto ab = static_cast<std::int64_t>(ElementSize(p.a_type));
    const auto cd = static_cast<std::int64_t>(ElementSize(p.c_type));
    auto operand_aligned = [](const GroupedOperand& o, std::int64_t bytes) {
        return Aligned16(o.data) && (o.ld * bytes) % 16 == 0 && (o.group_stride * bytes) % 16 == 0 &&
               (o.row_stride * bytes) % 16 == 0;
    };
    if (!operand_aligned(p.a, ab) || !operand_aligned(p.b, ab) || !operand_aligned(p.c, cd)) {
        return "an operand is not 16-byte aligned for every group";
    }
    constexpr std::int64_t kInt32Max = 2147483647;
    if (p.m > kInt32Max || p.n > kInt32Max || p.k > kInt32Max || p.total > kInt32Max || p.group_count > 65535) {
        return "sizes beyond int32 (or more than 65535 groups)";
    }
    args.ab = p.a_type == DType::kBFloat16 ? cg::Element::kBFloat16 : cg::Element::kFloat16;
    args.cd = p.c_type == DType::kFloat32 ? cg::Element::kFloat32 : args.ab;
    return nullptr;
}

bool ChooseCutlass(const GroupedGemmParams& p) {
    switch (GetGroupedGemmChoice().impl) {
    case GroupedGemmImpl::kCutlass:
        return true;
    case GroupedGemmImpl::kLoop:
        return false;
    case GroupedGemmImpl::kAuto:
        break;
    }
    if (!p.sizes_device.is_cpu()) {
        return true; // the only path without a host synchronisation
    }
    return p.group_count >= kManyExperts || p.total < kSmallGroupRows * p.group_count;
}

cg::Tile ChooseTile(const GroupedGemmParams& p) {
    switch (GetGroupedGemmChoice().tile) {
    case GroupedGemmTile::k256x128:
        return cg::Tile::k256x128;
    case GroupedGemmTile::k128x128:
        return cg::Tile::k128x128;
    case GroupedGemmTile::kAuto:
        break;
    }
    return p.total < kSmallGroupRows * p.group_count ? cg::Tile::k128x128 : cg::Tile::k256x128;
}

/// The sizes on the device: as given, or host sizes uploaded on the compute stream (the host does not wait).
Tensor DeviceSizes(const GroupedGemmParams& p) {
    const Tensor view =
        Tensor::FromBlob(const_cast<std::int64_t*>(p.sizes), Shape{p.group_count}, DType::kInt64, p.sizes_device);
    return p.sizes_device.is_cpu() ? view.To(p.device) : view;
}

/// Runs the CUTLASS grouped GEMM; false when CUTLASS refuses the arguments (only the setup kernel, which writes the
/// scratch, has run then).
bool RunCutlass(const GroupedGemmParams& p, cg::Args args) {
    CudaContext& ctx = CudaContext::Get(p.device.index);
    if (p.sizes_device.is_cpu()) {
        // Host sizes are checked (each >= 0, Σ = total) as the loop checks them; device sizes are clamped on the
        // device.
        HostGroupSizes(p.sizes, p.group_count, p.sizes_device, p.total, GroupedGemmOp::kName);
    }
    const Tensor sizes = DeviceSizes(p);
    args.tile = ChooseTile(p);
    args.groups = static_cast<int>(p.group_count);
    args.sizes = sizes.data_as<std::int64_t>();
    args.grouped_k = p.grouped_dim == GroupedDim::kK;
    args.m = p.m;
    args.n = p.n;
    args.k = p.k;
    args.total = p.total;
    args.a = {.data = p.a.data, .ld = p.a.ld, .group_stride = p.a.group_stride, .row_stride = p.a.row_stride};
    args.b = {.data = p.b.data, .ld = p.b.ld, .group_stride = p.b.group_stride, .row_stride = p.b.row_stride};
    args.c = {.data = p.c.data, .ld = p.c.ld, .group_stride = p.c.group_stride, .row_stride = p.c.row_stride};
    args.beta = static_cast<float>(p.beta);
    args.device = p.device.index;
    args.sm_count = ctx.multiprocessors();
    args.stream = ctx.stream();
    std::size_t bytes = 0;
    if (cg::ScratchBytes(args, &bytes) != cg::kOk) {
        return false;
    }
    // Stream-ordered scratch from the device pool (a graph capture records it as a memory node).
    const Tensor scratch = Tensor::Empty(Shape{static_cast<std::int64_t>((bytes + 7) / 8)}, DType::kInt64, p.device);
    const int status = cg::Run(args, scratch.data(), bytes);
    if (status == cg::kCannotImplement) {
        return false;
    }
    SHARDLINE_CHECK(status == cg::kOk, GroupedGemmOp::kName,
                    "the CUTLASS grouped GEMM failed (status {}: {}), groups={} m={} n={} k={} total={}", status,
                    cudaGetErrorString(cudaGetLastError()), p.group_count, p.m, p.n, p.k, p.total);
    if (p.epilogue == GemmEpilogue::kBias) {
        // D (column-major m × total, ld m) is the row-major [total, m] output: each group's bias on its rows.
        SHARDLINE_CHECK_CUDA(LaunchGroupedBiasAdd(const_cast<void*>(p.c.data), p.c_type, p.total, p.m, p.c.ld, p.bias,
                                                  p.bias_type, p.bias_group_stride, sizes.data_as<std::int64_t>(),
                                                  args.groups, args.stream));
    }
    return true;
}

void CudaGroupedGemm(const GroupedGemmParams& p) {
    cg::Args args;
    const char* why_not = CutlassIneligible(p, args);
    // Host sizes inside a graph capture: the loop bakes them into the graph (an upload would capture a host pointer).
    if (why_not == nullptr && p.sizes_device.is_cpu() && detail::ComputeStreamCapturing(p.device)) {
        detail::LoopGroupedGemm(p);
        return;
    }
    if (why_not == nullptr && ChooseCutlass(p)) {
        if (RunCutlass(p, args)) {
            return;
        }
        why_not = "CUTLASS's can_implement refused the arguments";
    }
    if (why_not != nullptr && (!p.sizes_device.is_cpu() || GetGroupedGemmChoice().impl == GroupedGemmImpl::kCutlass)) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            SHARDLINE_LOG_WARN(
                "GroupedGemm: the CUTLASS grouped GEMM does not serve this problem ({}); the loop of cuBLASLt "
                "GEMMs runs instead{}",
                why_not, p.sizes_device.is_cpu() ? "" : " and reads the device sizes on the host");
        }
    }
    detail::LoopGroupedGemm(p);
}

/// db_e (+)= Σ rows of dy_e in one launch, the sizes read on the device (host sizes uploaded first).
void CudaGroupedLinearBackwardBias(const GroupedLinearBackwardBiasArgs& args) {
    if (args.group_sizes.device().is_cpu() && detail::ComputeStreamCapturing(args.dbias.device())) {
        detail::DefaultGroupedLinearBackwardBias(args);
        return;
    }
    CudaContext& ctx = CudaContext::Get(args.dbias.device().index);
    const Tensor sizes =
        args.group_sizes.device().is_cpu() ? args.group_sizes.To(args.dbias.device()) : args.group_sizes;
    SHARDLINE_CHECK_CUDA(LaunchGroupedColumnSum(args.dy.data(), args.dy.dtype(), args.dy.size(0), args.dy.size(1),
                                                sizes.data_as<std::int64_t>(), static_cast<int>(sizes.numel()),
                                                args.dbias.data(), args.dbias.dtype(), args.accumulate, ctx.stream()));
}

} // namespace

} // namespace shardline::kernels::cuda

namespace shardline::kernels {

std::string GroupedGemmPath(const GroupedGemmParams& p) {
    if (!p.device.is_cuda()) {
        return "loop (the CPU)";
    }
    cuda::cutlass_grouped::Args args;
    if (const char* why_not = cuda::CutlassIneligible(p, args); why_not != nullptr) {
        return std::string("loop (") + why_not + ")";
    }
    if (!cuda::ChooseCutlass(p)) {
        return "loop (chosen for few large experts with host sizes)";
    }
    return cuda::ChooseTile(p) == cuda::cutlass_grouped::Tile::k256x128 ? "cutlass 256x128" : "cutlass 128x128";
}

} // namespace shardline::kernels

namespace shardline::kernels::cuda {

void RegisterCudaGroupedKernels() {
    Register<GroupedGemmOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedGemm);
    Register<GroupedLinearBackwardBiasOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedLinearBackwardBias);
    // legacy: the loop, each group's Gemm from cublasGemmEx (the rollback path).
    Register<GroupedGemmOp>(DeviceType::kCUDA, kLegacyProvider, &detail::LoopGroupedGemm);
}

} // namespace shardline::kernels::cuda

namespace shardline::kernels::detail {

bool ComputeStreamCapturing(Device device) {
    CudaContext& ctx = CudaContext::Get(device.index);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(ctx.stream(), &status));
    return status != cudaStreamCaptureStatusNone;
}

} // namespace shardline::kernels::detail
