// GroupedGemm: the problem's checks, the host copy of the group sizes, and the loop provider — one Gemm per non-empty
// group, each dispatched (OpenBLAS on the CPU, the cached cuBLASLt plans on CUDA; a provider that supplies only Gemm
// serves the grouped ops too).

#include <algorithm>
#include <atomic>
#include <string>

#include <shardline/config.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm_tuning.h>
#include <shardline/kernels/grouped_gemm.h>

#include "grouped_internal.h"
#include "register.h"

namespace shardline::kernels {
namespace {

void CheckOperand(const GroupedOperand& o, std::string_view op, std::string_view name) {
    SHARDLINE_CHECK_AS(ShapeError, o.ld >= 1 && o.group_stride >= 0 && o.row_stride >= 0, op,
                       "operand {} needs ld >= 1 and non-negative strides, got ld={} group_stride={} row_stride={}",
                       name, o.ld, o.group_stride, o.row_stride);
}

const char* OffsetBy(const void* base, std::int64_t elements, DType dtype) {
    return static_cast<const char*>(base) + elements * static_cast<std::int64_t>(ElementSize(dtype));
}

} // namespace

void ValidateGroupedGemmParams(const GroupedGemmParams& p, std::string_view op) {
    SHARDLINE_CHECK_AS(ShapeError, p.group_count >= 1, op, "needs at least one group, got group_count={}",
                       p.group_count);
    SHARDLINE_CHECK(p.sizes != nullptr, op, "the group sizes pointer is null (group_count={})", p.group_count);
    SHARDLINE_CHECK_AS(DeviceError, p.sizes_device.is_cpu() || p.sizes_device == p.device, op,
                       "the group sizes must be on the host or on the GEMM's device {}, got {}", ToString(p.device),
                       ToString(p.sizes_device));
    SHARDLINE_CHECK_AS(ShapeError, p.total >= 0 && p.m >= 0, op, "total rows and m must be >= 0, got total={} m={}",
                       p.total, p.m);
    if (p.grouped_dim == GroupedDim::kN) {
        SHARDLINE_CHECK_AS(ShapeError, p.k >= 0, op, "k must be >= 0, got {}", p.k);
    } else {
        SHARDLINE_CHECK_AS(ShapeError, p.n >= 0, op, "n must be >= 0, got {}", p.n);
    }
    CheckOperand(p.a, op, "A");
    CheckOperand(p.b, op, "B");
    CheckOperand(p.c, op, "C");
    SHARDLINE_CHECK(p.beta == 0.0 || p.beta == 1.0, op, "beta must be 0 (overwrite) or 1 (accumulate), got {}", p.beta);
    SHARDLINE_CHECK(p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kBias ||
                        p.epilogue == GemmEpilogue::kDGelu,
                    op, "takes the epilogues none, bias and dgelu, got {}", GemmEpilogueName(p.epilogue));
    if (p.epilogue == GemmEpilogue::kDGelu) {
        SHARDLINE_CHECK(p.grouped_dim == GroupedDim::kN && p.beta == 0.0, op,
                        "epilogue dgelu is a dgrad's (grouped_dim n, beta 0), got grouped_dim {} and beta {}",
                        p.grouped_dim == GroupedDim::kN ? "n" : "k", p.beta);
        auto packed = [&](const GroupedOperand& o) {
            return o.group_stride == 0 && o.ld == p.m && o.row_stride == p.m;
        };
        SHARDLINE_CHECK_AS(ShapeError, packed(p.c) && packed(p.aux), op,
                           "epilogue dgelu needs D and the pre-activation Z packed by the grouped rows ([total, m] = "
                           "[{}, {}]: group_stride 0, row_stride = ld = m), got D ld={} group_stride={} row_stride={} "
                           "and Z ld={} group_stride={} row_stride={}",
                           p.total, p.m, p.c.ld, p.c.group_stride, p.c.row_stride, p.aux.ld, p.aux.group_stride,
                           p.aux.row_stride);
        SHARDLINE_CHECK(p.total == 0 || p.m == 0 || (p.aux.data != nullptr && p.aux.data != p.c.data), op,
                        "epilogue dgelu needs the pre-activation Z (non-null, apart from D) for {} grouped rows",
                        p.total);
    }
    SHARDLINE_CHECK(p.epilogue != GemmEpilogue::kBias || p.bias != nullptr, op, "epilogue bias needs a bias pointer");
    SHARDLINE_CHECK(p.total == 0 || (p.a.data != nullptr && p.b.data != nullptr && p.c.data != nullptr), op,
                    "A, B and C must be non-null for {} grouped rows", p.total);
}

std::vector<std::int64_t> HostGroupSizes(const std::int64_t* sizes, std::int64_t group_count, Device sizes_device,
                                         std::int64_t total, std::string_view op) {
    std::vector<std::int64_t> host(static_cast<std::size_t>(group_count));
    if (sizes_device.is_cpu()) {
        std::copy(sizes, sizes + group_count, host.begin());
    } else {
#if SHARDLINE_HAVE_CUDA
        SHARDLINE_CHECK(!detail::ComputeStreamCapturing(sizes_device), op,
                        "device-resident group sizes are read on the host by this provider, which a CUDA graph "
                        "capture cannot do; pass host sizes or capture with the grouped-kernel provider");
#endif
        const Tensor view =
            Tensor::FromBlob(const_cast<std::int64_t*>(sizes), Shape{group_count}, DType::kInt64, sizes_device);
        const Tensor copy = view.To(Device::CPU());
        const auto* data = copy.data_as<std::int64_t>();
        std::copy(data, data + group_count, host.begin());
    }
    std::int64_t sum = 0;
    for (std::int64_t e = 0; e < group_count; ++e) {
        const std::int64_t s = host[static_cast<std::size_t>(e)];
        SHARDLINE_CHECK_AS(ShapeError, s >= 0, op, "group sizes must be >= 0, got sizes[{}] = {}", e, s);
        sum += s;
    }
    SHARDLINE_CHECK_AS(ShapeError, sum == total, op, "group sizes must sum to the {} grouped rows, got a sum of {}",
                       total, sum);
    return host;
}

GemmParams GroupGemmParams(const GroupedGemmParams& p, std::int64_t group, std::int64_t size, std::int64_t offset) {
    auto at = [&](const GroupedOperand& o, DType t) {
        return OffsetBy(o.data, group * o.group_stride + offset * o.row_stride, t);
    };
    const bool by_n = p.grouped_dim == GroupedDim::kN;
    return GemmParams{.trans_a = p.trans_a,
                      .trans_b = p.trans_b,
                      .m = p.m,
                      .n = by_n ? size : p.n,
                      .k = by_n ? p.k : size,
                      .a = at(p.a, p.a_type),
                      .lda = p.a.ld,
                      .a_type = p.a_type,
                      .b = at(p.b, p.b_type),
                      .ldb = p.b.ld,
                      .b_type = p.b_type,
                      .c = const_cast<char*>(at(p.c, p.c_type)),
                      .ldc = p.c.ld,
                      .c_type = p.c_type,
                      .alpha = p.alpha,
                      .beta = p.beta,
                      .compute = p.compute,
                      .epilogue = p.epilogue,
                      .bias = p.epilogue == GemmEpilogue::kBias
                                  ? const_cast<char*>(OffsetBy(p.bias, group * p.bias_group_stride, p.bias_type))
                                  : nullptr,
                      .bias_type = p.bias_type,
                      .aux = p.epilogue == GemmEpilogue::kDGelu ? const_cast<char*>(at(p.aux, p.c_type)) : nullptr,
                      .ldaux = p.epilogue == GemmEpilogue::kDGelu ? p.aux.ld : 0,
                      .device = p.device};
}

namespace {
GroupedGemmChoice InitialChoice() {
    GroupedGemmChoice c;
    const std::string impl = env::GetChoice("SHARDLINE_GROUPED_GEMM", "auto", {"auto", "cutlass", "loop"});
    c.impl = impl == "cutlass" ? GroupedGemmImpl::kCutlass
                               : (impl == "loop" ? GroupedGemmImpl::kLoop : GroupedGemmImpl::kAuto);
    const std::string tile =
        env::GetChoice("SHARDLINE_GROUPED_GEMM_TILE", "auto",
                       {"auto", "256x128", "128x128", "pingpong128x128", "pingpong128x64", "128x256"});
    c.tile = tile == "256x128"           ? GroupedGemmTile::k256x128
             : tile == "128x128"         ? GroupedGemmTile::k128x128
             : tile == "pingpong128x128" ? GroupedGemmTile::kPingpong128x128
             : tile == "pingpong128x64"  ? GroupedGemmTile::kPingpong128x64
             : tile == "128x256"         ? GroupedGemmTile::k128x256
                                         : GroupedGemmTile::kAuto;
    const std::string raster = env::GetChoice("SHARDLINE_GROUPED_GEMM_RASTER", "auto", {"auto", "m", "n"});
    c.raster = raster == "m"   ? GroupedGemmRaster::kAlongM
               : raster == "n" ? GroupedGemmRaster::kAlongN
                               : GroupedGemmRaster::kAuto;
    return c;
}
/// The choice in one word (impl, tile, raster: a byte each), so that a reader never sees half of a Set.
std::uint32_t ChoiceBits(const GroupedGemmChoice& c) {
    return static_cast<std::uint32_t>(c.impl) | (static_cast<std::uint32_t>(c.tile) << 8) |
           (static_cast<std::uint32_t>(c.raster) << 16);
}
std::atomic<std::uint32_t>& ChoiceWord() {
    static std::atomic<std::uint32_t> word{ChoiceBits(InitialChoice())};
    return word;
}
} // namespace

GroupedGemmChoice GetGroupedGemmChoice() {
    const std::uint32_t w = ChoiceWord().load(std::memory_order_relaxed);
    return {.impl = static_cast<GroupedGemmImpl>(w & 0xff),
            .tile = static_cast<GroupedGemmTile>((w >> 8) & 0xff),
            .raster = static_cast<GroupedGemmRaster>((w >> 16) & 0xff)};
}

void SetGroupedGemmChoice(const GroupedGemmChoice& c) { ChoiceWord().store(ChoiceBits(c), std::memory_order_relaxed); }

#if !SHARDLINE_HAVE_CUDA
std::string GroupedGemmPath(const GroupedGemmParams&) { return "loop (a CPU build)"; }
#endif

void GroupedGemm(const GroupedGemmParams& params) {
    ValidateGroupedGemmParams(params, GroupedGemmOp::kName);
    Dispatch<GroupedGemmOp>(params.device.type, params);
}

namespace detail {
/// The default provider: one Gemm per group. A kN group of size 0 has nothing to compute; a kK group of size 0 still
/// runs (Gemm with k = 0 writes beta·C: zeros, or nothing with beta = 1).
void LoopGroupedGemm(const GroupedGemmParams& p) {
    const std::vector<std::int64_t> sizes =
        HostGroupSizes(p.sizes, p.group_count, p.sizes_device, p.total, GroupedGemmOp::kName);
    // The groups' rows follow the routing, so nearly every call brings new GEMM shapes: plans from the heuristic
    // alone. Timing each new shape's candidates made a MoE char-LM step take 0.7-1.4 s of host time on 4xH200.
    const GemmTuningPause pause;
    std::int64_t offset = 0;
    for (std::int64_t e = 0; e < p.group_count; ++e) {
        const std::int64_t size = sizes[static_cast<std::size_t>(e)];
        if (size > 0 || p.grouped_dim == GroupedDim::kK) {
            Gemm(GroupGemmParams(p, e, size, offset));
        }
        offset += size;
    }
}

void RegisterGroupedLinearCompositions(); // grouped_linear.cc

void RegisterGroupedCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<GroupedGemmOp>(d, kDefaultProvider, &LoopGroupedGemm);
    }
    RegisterGroupedLinearCompositions();
}
} // namespace detail

} // namespace shardline::kernels
