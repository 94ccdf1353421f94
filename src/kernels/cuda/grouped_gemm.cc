// The CUDA GroupedGemm provider: per call, the CUTLASS SM90 pointer-array grouped GEMM (one of its configs) or the loop
// of cached cuBLASLt plans (the loop provider of grouped_gemm.cc), and the device-size grouped bias grad. The CUTLASS
// path reads the sizes on the device only (a setup kernel writes each group's shape and pointers), so with
// device-resident sizes no host code waits and a CUDA graph captures it.
//
// Which runs (Choose): SHARDLINE_GROUPED_GEMM = auto (default) | cutlass | loop, SHARDLINE_GROUPED_GEMM_TILE = auto |
// 256x128 | 128x128 | pingpong128x128 | pingpong128x64 | 128x256, SHARDLINE_GROUPED_GEMM_RASTER = auto | m | n.
// auto/auto: by measurement per shape class (grouped_tuning.h): the first call of a class times every candidate — the
// CUTLASS configs built for its dtype, each with its tile scheduler rastering along m and along n (unless one is
// forced), and the loop when the sizes are on the host — with CUDA events on the call's own operands, and caches the
// fastest; later calls of the class run it. No timing inside a graph capture or under GemmTuningPause (or
// SHARDLINE_GEMM_TUNING=0): an untuned class then gets the heuristic — CUTLASS for device-resident sizes (the only path
// without a host synchronisation) and for many small experts (≥ kManyExperts groups, or fewer than kSmallGroupRows rows
// per group on average), the loop for few large experts; the tile 128×128 below kSmallGroupRows rows per group, else
// 256×128.

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "candidate_timer.h"
#include "cuda_ops.h"
#include "cutlass/grouped_cutlass.h"
#include "epilogue_kernels.h"
#include "grouped_gemm_cuda.h"
#include "grouped_kernels.h"
#include "kernels/grouped_internal.h"
#include "kernels/grouped_tuning.h"

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
    if (p.epilogue != GemmEpilogue::kNone && !(p.epilogue == GemmEpilogue::kBias && by_n) &&
        !(p.epilogue == GemmEpilogue::kDGelu && args.layout == cg::Layout::kNN && p.c_type == p.a_type)) {
        return "an epilogue other than a forward bias or a dgrad's dgelu";
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
    if (!operand_aligned(p.a, ab) || !operand_aligned(p.b, ab) || !operand_aligned(p.c, cd) ||
        (p.epilogue == GemmEpilogue::kDGelu && !operand_aligned(p.aux, cd))) {
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

cg::Config ConfigOf(int candidate) {
    switch (detail::CandidateTile(candidate)) {
    case GroupedGemmTile::k128x128:
        return cg::Config::kCooperative128x128;
    case GroupedGemmTile::kPingpong128x128:
        return cg::Config::kPingpong128x128;
    case GroupedGemmTile::kPingpong128x64:
        return cg::Config::kPingpong128x64;
    case GroupedGemmTile::k128x256:
        return cg::Config::kCooperative128x256;
    case GroupedGemmTile::k256x128:
    case GroupedGemmTile::kAuto:
        break;
    }
    return cg::Config::kCooperative256x128;
}

/// The candidates of the tuning, in GroupedGemmTile order: the CUTLASS configs this build has for the dtype, each
/// with both raster orders unless one is forced.
constexpr GroupedGemmTile kCutlassCandidates[] = {GroupedGemmTile::k256x128, GroupedGemmTile::k128x128,
                                                  GroupedGemmTile::kPingpong128x128, GroupedGemmTile::kPingpong128x64,
                                                  GroupedGemmTile::k128x256};

/// The candidate id of a CUTLASS tile with the forced raster (along m unless along n is forced).
int WithForcedRaster(GroupedGemmTile tile) {
    return static_cast<int>(tile) +
           (GetGroupedGemmChoice().raster == GroupedGemmRaster::kAlongN ? detail::kRasterAlongN : 0);
}

/// The heuristic's tile: 128×128 below kSmallGroupRows rows per group, else 256×128 (both cooperative, built for bf16
/// and fp16).
GroupedGemmTile HeuristicTile(const GroupedGemmParams& p) {
    return p.total < kSmallGroupRows * p.group_count ? GroupedGemmTile::k128x128 : GroupedGemmTile::k256x128;
}

/// The heuristic's candidate (kLoopCandidate or a tile), for a problem CUTLASS can serve.
int HeuristicCandidate(const GroupedGemmParams& p) {
    const bool cutlass =
        !p.sizes_device.is_cpu() || p.group_count >= kManyExperts || p.total < kSmallGroupRows * p.group_count;
    return cutlass ? static_cast<int>(HeuristicTile(p)) : detail::kLoopCandidate;
}

/// The forced tile where this build has it for the operands' dtype, else the heuristic's; with the forced raster.
int ForcedTile(const GroupedGemmParams& p, const cg::Args& args) {
    const GroupedGemmTile tile = GetGroupedGemmChoice().tile;
    if (tile != GroupedGemmTile::kAuto && cg::Built(args.ab, ConfigOf(static_cast<int>(tile)))) {
        return WithForcedRaster(tile);
    }
    return WithForcedRaster(HeuristicTile(p));
}

struct Pick {
    int candidate = detail::kLoopCandidate; ///< kLoopCandidate or a GroupedGemmTile (+ kRasterAlongN)
    const char* how = "heuristic";          ///< "forced", "tuned" or "heuristic"
};

/// The sizes on the device: as given, or host sizes uploaded on the compute stream (the host does not wait).
Tensor DeviceSizes(const GroupedGemmParams& p) {
    const Tensor view =
        Tensor::FromBlob(const_cast<std::int64_t*>(p.sizes), Shape{p.group_count}, DType::kInt64, p.sizes_device);
    return p.sizes_device.is_cpu() ? view.To(p.device) : view;
}

/// Makes the CUTLASS grouped GEMM ready on the compute stream: host sizes checked and uploaded, the scratch allocated
/// from the stream-ordered pool (a graph capture records it as a memory node); false when CUTLASS sizes no scratch.
bool PrepareCutlass(const GroupedGemmParams& p, PreparedGroupedGemm& call) {
    CudaContext& ctx = CudaContext::Get(p.device.index);
    if (p.sizes_device.is_cpu()) {
        // Host sizes are checked (each >= 0, Σ = total) as the loop checks them; device sizes are clamped on the
        // device.
        HostGroupSizes(p.sizes, p.group_count, p.sizes_device, p.total, GroupedGemmOp::kName);
    }
    call.params = p;
    call.sizes = DeviceSizes(p);
    cg::Args& args = call.args;
    args.groups = static_cast<int>(p.group_count);
    args.sizes = call.sizes.data_as<std::int64_t>();
    args.grouped_k = p.grouped_dim == GroupedDim::kK;
    args.m = p.m;
    args.n = p.n;
    args.k = p.k;
    args.total = p.total;
    args.a = {.data = p.a.data, .ld = p.a.ld, .group_stride = p.a.group_stride, .row_stride = p.a.row_stride};
    args.b = {.data = p.b.data, .ld = p.b.ld, .group_stride = p.b.group_stride, .row_stride = p.b.row_stride};
    args.c = {.data = p.c.data, .ld = p.c.ld, .group_stride = p.c.group_stride, .row_stride = p.c.row_stride};
    // kDGelu: the fused kernel where this build has it for the config (C = Z as the epilogue's source, D apart); else
    // the config's plain GEMM, and LaunchPreparedGroupedGemm applies the dGELU to D after it.
    args.dgelu = p.epilogue == GemmEpilogue::kDGelu && cg::BuiltDGelu(args.ab, args.config);
    if (args.dgelu) {
        args.d = args.c;
        args.c = {
            .data = p.aux.data, .ld = p.aux.ld, .group_stride = p.aux.group_stride, .row_stride = p.aux.row_stride};
    }
    args.beta = static_cast<float>(p.beta);
    args.device = p.device.index;
    args.sm_count = ctx.multiprocessors();
    if (cg::ScratchBytes(args, &call.bytes) != cg::kOk) {
        return false;
    }
    call.scratch = Tensor::Empty(Shape{static_cast<std::int64_t>((call.bytes + 7) / 8)}, DType::kInt64, p.device);
    return true;
}

/// Runs the CUTLASS grouped GEMM; false when CUTLASS refuses the arguments (only the setup kernel, which writes the
/// scratch, has run then).
bool RunCutlass(const GroupedGemmParams& p, const cg::Args& args) {
    PreparedGroupedGemm call;
    call.args = args;
    if (!PrepareCutlass(p, call)) {
        return false;
    }
    return LaunchPreparedGroupedGemm(call, CudaContext::Get(p.device.index).stream());
}

/// Runs one candidate on p: the loop, or the CUTLASS config (false when CUTLASS refuses the arguments).
bool RunCandidate(const GroupedGemmParams& p, cg::Args args, int candidate) {
    if (candidate == detail::kLoopCandidate) {
        detail::LoopGroupedGemm(p);
        return true;
    }
    args.config = ConfigOf(candidate);
    args.raster_along_n = detail::CandidateAlongN(candidate);
    return RunCutlass(p, args);
}

/// Times the candidates on p's operands (the stream is not capturing) and caches the winner of p's class. D goes to
/// p.c when beta == 0 (the winner's run right after overwrites it; every candidate writes the same elements) and to a
/// scratch copy of C otherwise (an accumulating GEMM must not add twice), as the cuBLASLt tuning does.
std::optional<int> Tune(const GroupedGemmParams& p, const cg::Args& args, const detail::GroupedTuningKey& key) {
    const GroupedGemmRaster raster = GetGroupedGemmChoice().raster;
    std::vector<int> candidates;
    for (const GroupedGemmTile tile : kCutlassCandidates) {
        if (cg::Built(args.ab, ConfigOf(static_cast<int>(tile)))) {
            if (raster != GroupedGemmRaster::kAlongN) {
                candidates.push_back(static_cast<int>(tile));
            }
            if (raster != GroupedGemmRaster::kAlongM) {
                candidates.push_back(static_cast<int>(tile) + detail::kRasterAlongN);
            }
        }
    }
    if (p.sizes_device.is_cpu()) {
        candidates.push_back(detail::kLoopCandidate);
    }
    CudaContext& ctx = CudaContext::Get(p.device.index);
    GroupedGemmParams target = p;
    Tensor scratch;
    if (p.beta != 0.0) {
        // The elements D spans, exactly for the Linear ops' layouts (no more: the copy must not read past C). kN: group
        // e's n_e columns start at offset_e·row_stride, so the last group ends by (total − 1)·max(row_stride, ld) + m.
        // kK: group e's n columns start at e·group_stride (+ offset_e·row_stride, 0 for a per-expert grad).
        const std::int64_t elements = p.grouped_dim == GroupedDim::kN
                                          ? std::abs(p.c.group_stride) * (p.group_count - 1) +
                                                std::max(p.c.row_stride, p.c.ld) * (p.total - 1) + p.m
                                          : std::abs(p.c.group_stride) * (p.group_count - 1) +
                                                p.c.row_stride * p.total + (p.n - 1) * p.c.ld + p.m;
        scratch = Tensor::Empty(Shape{elements}, p.c_type, p.device);
        SHARDLINE_CHECK_CUDA(
            cudaMemcpyAsync(scratch.data(), p.c.data, scratch.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream()));
        target.c.data = scratch.data();
    }
    CandidateTimer timer(ctx.stream(), nullptr, 0);
    std::vector<int> reps(static_cast<std::size_t>(detail::kCandidateSlots), 0);
    auto time_us = [&](int candidate) {
        auto launch = [&] { return RunCandidate(target, args, candidate); };
        int& n = reps[static_cast<std::size_t>(candidate)];
        if (n == 0) {
            const double single = timer.Time(1, launch); // the warm-up, and whether it runs at all
            if (single < 0.0) {
                return -1.0;
            }
            n = RepsFor(single);
        }
        return timer.Time(n, launch);
    };
    return detail::TuneGroupedGemm(key, candidates, HeuristicCandidate(p), time_us);
}

Pick Choose(const GroupedGemmParams& p, const cg::Args& args, bool capturing, bool may_tune) {
    const GroupedGemmChoice choice = GetGroupedGemmChoice();
    if (choice.impl == GroupedGemmImpl::kLoop) {
        return {detail::kLoopCandidate, "forced"};
    }
    if (choice.impl == GroupedGemmImpl::kCutlass) {
        return {ForcedTile(p, args), "forced"};
    }
    if (choice.tile != GroupedGemmTile::kAuto) {
        // auto with a forced tile: the heuristic decides between the loop and CUTLASS, the tile is the forced one.
        const int h = HeuristicCandidate(p);
        return {h == detail::kLoopCandidate ? h : ForcedTile(p, args), "forced"};
    }
    const detail::GroupedTuningKey key = detail::MakeGroupedTuningKey(p);
    if (const std::optional<int> winner = detail::FindGroupedWinner(key, may_tune)) {
        return {*winner, "tuned"};
    }
    if (!may_tune || p.total == 0 || (p.grouped_dim == GroupedDim::kK && p.n == 0)) {
        return {HeuristicCandidate(p), "heuristic"}; // a path query, or nothing to time
    }
    if (!detail::GroupedTuningAllowed(capturing)) {
        detail::CountGroupedUntuned();
        return {HeuristicCandidate(p), "heuristic"};
    }
    if (const std::optional<int> winner = Tune(p, args, key)) {
        return {*winner, "tuned"};
    }
    return {HeuristicCandidate(p), "heuristic"};
}

std::string PathText(const Pick& pick) {
    if (pick.candidate == detail::kLoopCandidate) {
        return fmt::format("loop ({})", std::string_view(pick.how) == "heuristic"
                                            ? "heuristic: few large experts with host sizes"
                                            : pick.how);
    }
    return fmt::format("cutlass {} ({})", detail::GroupedCandidateName(pick.candidate), pick.how);
}

/// PathText, and for a kDGelu problem on CUTLASS whether the dGELU runs in the kernel's epilogue or as a kernel after.
std::string PathText(const GroupedGemmParams& p, const cg::Args& args, const Pick& pick) {
    std::string text = PathText(pick);
    if (p.epilogue == GemmEpilogue::kDGelu && pick.candidate != detail::kLoopCandidate) {
        text += cg::BuiltDGelu(args.ab, ConfigOf(pick.candidate)) ? " dgelu-epilogue" : " dgelu-kernel";
    }
    return text;
}

void CudaGroupedGemm(const GroupedGemmParams& p) {
    cg::Args args;
    const char* why_not = CutlassIneligible(p, args);
    const bool capturing = detail::ComputeStreamCapturing(p.device);
    // Host sizes inside a graph capture: the loop bakes them into the graph (an upload would capture a host pointer).
    if (why_not == nullptr && p.sizes_device.is_cpu() && capturing) {
        detail::SetLastGroupedGemmPath("loop (host sizes under a graph capture)");
        detail::LoopGroupedGemm(p);
        return;
    }
    if (why_not == nullptr) {
        const Pick pick = Choose(p, args, capturing, /*may_tune=*/true);
        detail::SetLastGroupedGemmPath(PathText(p, args, pick));
        if (pick.candidate == detail::kLoopCandidate) {
            detail::LoopGroupedGemm(p);
            return;
        }
        if (RunCandidate(p, args, pick.candidate)) {
            return;
        }
        why_not = "CUTLASS's can_implement refused the arguments";
    }
    if (!p.sizes_device.is_cpu() || GetGroupedGemmChoice().impl == GroupedGemmImpl::kCutlass) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            SHARDLINE_LOG_WARN(
                "GroupedGemm: the CUTLASS grouped GEMM does not serve this problem ({}); the loop of cuBLASLt "
                "GEMMs runs instead{}",
                why_not, p.sizes_device.is_cpu() ? "" : " and reads the device sizes on the host");
        }
    }
    detail::SetLastGroupedGemmPath(std::string("loop (") + why_not + ")");
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

/// y_e += b_e in one launch, the sizes read on the device (host sizes uploaded first).
void CudaGroupedBiasAdd(const GroupedBiasAddArgs& args) {
    if (args.group_sizes.device().is_cpu() && detail::ComputeStreamCapturing(args.y.device())) {
        detail::DefaultGroupedBiasAdd(args); // an upload would capture a host pointer
        return;
    }
    CudaContext& ctx = CudaContext::Get(args.y.device().index);
    const Tensor sizes = args.group_sizes.device().is_cpu() ? args.group_sizes.To(args.y.device()) : args.group_sizes;
    SHARDLINE_CHECK_CUDA(LaunchGroupedBiasAdd(args.y.data(), args.y.dtype(), args.y.size(0), args.y.size(1),
                                              args.y.size(1), args.bias.data(), args.bias.dtype(), args.bias.size(1),
                                              sizes.data_as<std::int64_t>(), static_cast<int>(sizes.numel()),
                                              ctx.stream()));
}

} // namespace

bool LaunchPreparedGroupedGemm(const PreparedGroupedGemm& call, cudaStream_t stream) {
    const GroupedGemmParams& p = call.params;
    cg::Args args = call.args;
    args.stream = stream;
    const int status = cg::Run(args, call.scratch.data(), call.bytes);
    if (status == cg::kCannotImplement) {
        return false;
    }
    SHARDLINE_CHECK(status == cg::kOk, GroupedGemmOp::kName,
                    "the CUTLASS grouped GEMM failed (status {}: {}), groups={} m={} n={} k={} total={}", status,
                    cudaGetErrorString(cudaGetLastError()), p.group_count, p.m, p.n, p.k, p.total);
    if (p.epilogue == GemmEpilogue::kBias) {
        // D (column-major m × total, ld m) is the row-major [total, m] output: each group's bias on its rows.
        SHARDLINE_CHECK_CUDA(LaunchGroupedBiasAdd(const_cast<void*>(p.c.data), p.c_type, p.total, p.m, p.c.ld, p.bias,
                                                  p.bias_type, p.bias_group_stride, args.sizes, args.groups, stream));
    }
    if (p.epilogue == GemmEpilogue::kDGelu && !args.dgelu && p.total > 0 && p.m > 0) {
        // A config without the fused kernel: D ⊙= gelu_tanh'(Z) over the packed column-major m × total D (the
        // validation asks both packed, ld m), whatever the sizes: one launch, no host read.
        SHARDLINE_CHECK_CUDA(
            LaunchDGelu(const_cast<void*>(p.c.data), p.c_type, p.m, p.total, p.c.ld, p.aux.data, p.aux.ld, stream));
    }
    return true;
}

bool GroupedGemmWouldTune(const GroupedGemmParams& p) {
    cg::Args args;
    if (CutlassIneligible(p, args) != nullptr) {
        return false; // the loop, untimed
    }
    const bool capturing = detail::ComputeStreamCapturing(p.device);
    if (p.sizes_device.is_cpu() && capturing) {
        return false;
    }
    const GroupedGemmChoice choice = GetGroupedGemmChoice();
    if (choice.impl != GroupedGemmImpl::kAuto || choice.tile != GroupedGemmTile::kAuto) {
        return false;
    }
    if (detail::FindGroupedWinner(detail::MakeGroupedTuningKey(p), /*count_hit=*/false)) {
        return false;
    }
    if (p.total == 0 || (p.grouped_dim == GroupedDim::kK && p.n == 0)) {
        return false;
    }
    return detail::GroupedTuningAllowed(capturing);
}

std::optional<PreparedGroupedGemm> PrepareCutlassGroupedGemm(const GroupedGemmParams& p) {
    PreparedGroupedGemm call;
    if (CutlassIneligible(p, call.args) != nullptr || GroupedGemmWouldTune(p)) {
        return std::nullopt;
    }
    const bool capturing = detail::ComputeStreamCapturing(p.device);
    if (p.sizes_device.is_cpu() && capturing) {
        return std::nullopt;
    }
    const Pick pick = Choose(p, call.args, capturing, /*may_tune=*/true); // times nothing: GroupedGemmWouldTune
    if (pick.candidate == detail::kLoopCandidate) {
        return std::nullopt;
    }
    call.args.config = ConfigOf(pick.candidate);
    call.args.raster_along_n = detail::CandidateAlongN(pick.candidate);
    call.path = PathText(p, call.args, pick);
    if (!PrepareCutlass(p, call)) {
        return std::nullopt;
    }
    return call;
}

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
    return cuda::PathText(p, args, cuda::Choose(p, args, /*capturing=*/false, /*may_tune=*/false));
}

} // namespace shardline::kernels

namespace shardline::kernels::cuda {

void RegisterCudaGroupedKernels() {
    Register<GroupedGemmOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedGemm);
    Register<GroupedLinearBackwardBiasOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedLinearBackwardBias);
    Register<GroupedBiasAddOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedBiasAdd);
    Register<GroupedLinearBackwardOp>(DeviceType::kCUDA, kDefaultProvider, &CudaGroupedLinearBackward);
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
