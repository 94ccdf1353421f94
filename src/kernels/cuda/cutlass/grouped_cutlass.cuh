#pragma once

// The grouped GEMM kernels of one (element type, config) and the device-side setup of their arguments. Included by the
// grouped_cutlass_<type>_<config>.cu files only (each compiles for sm_90a), which instantiate RunConfig for their pair.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "grouped_cutlass.h"

namespace shardline::kernels::cuda::cutlass_grouped::detail {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

/// The schedule (kernel and epilogue), CTA tile and cluster of each Config (grouped_cutlass.h).
template <Config kConfig> struct ConfigTraits;
template <> struct ConfigTraits<Config::kCooperative256x128> {
    using Shape = cute::Shape<cute::_256, cute::_128, cute::_64>;
    using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct ConfigTraits<Config::kCooperative128x128> {
    using Shape = cute::Shape<cute::_128, cute::_128, cute::_64>;
    using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct ConfigTraits<Config::kPingpong128x128> {
    using Shape = cute::Shape<cute::_128, cute::_128, cute::_64>;
    using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
template <> struct ConfigTraits<Config::kPingpong128x64> {
    using Shape = cute::Shape<cute::_128, cute::_64, cute::_128>;
    using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

/// cuBLAS's column-major (trans_a, trans_b) in CUTLASS's terms, where A is M×K and B is K×N: a transposed
/// column-major A is a row-major M×K (K contiguous); an untransposed B is a column-major K×N (K contiguous).
template <Layout kLayout> struct LayoutTraits;
template <> struct LayoutTraits<Layout::kTN> {
    using A = cutlass::layout::RowMajor;
    using B = cutlass::layout::ColumnMajor;
};
template <> struct LayoutTraits<Layout::kNN> {
    using A = cutlass::layout::ColumnMajor;
    using B = cutlass::layout::ColumnMajor;
};
template <> struct LayoutTraits<Layout::kNT> {
    using A = cutlass::layout::ColumnMajor;
    using B = cutlass::layout::RowMajor;
};

/// The TMA warp-specialized pointer-array grouped GEMM of one Config, fp32 accumulation, D = alpha·acc + beta·C.
template <class AB, class CD, Layout kLayout, Config kConfig> struct GroupedGemm {
    using TileShape = typename ConfigTraits<kConfig>::Shape;
    using ClusterShape = typename ConfigTraits<kConfig>::Cluster;
    using LayoutA = typename LayoutTraits<kLayout>::A;
    using LayoutB = typename LayoutTraits<kLayout>::B;
    using LayoutC = cutlass::layout::ColumnMajor;
    static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<AB>::value;
    static constexpr int kAlignCD = 128 / cutlass::sizeof_bits<CD>::value;

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, CD, LayoutC *, kAlignCD, CD, LayoutC *, kAlignCD,
        typename ConfigTraits<kConfig>::Epilogue,
        cutlass::epilogue::fusion::LinearCombination<CD, float>>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, AB, LayoutA *, kAlignAB, AB, LayoutB *, kAlignAB, float,
        TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        typename ConfigTraits<kConfig>::Kernel>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
    using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideC = typename Kernel::InternalStrideC;
    using StrideD = typename Kernel::InternalStrideD;
};

/// A CUTLASS stride whose one dynamic mode (the leading dimension) is `ld`: every pointer-array stride type is
/// (ld, 1, 0) or (1, ld, 0) with static 1 and 0.
template <class Stride> Stride LeadingStride(std::int64_t ld) {
    Stride s{};
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(cute::get<0>(s))>>, std::int64_t>) {
        cute::get<0>(s) = ld;
    } else {
        cute::get<1>(s) = ld;
    }
    return s;
}

/// The per-group arrays in the scratch, each 256-byte aligned, then CUTLASS's workspace.
template <class G> struct ScratchLayout {
    std::size_t shapes = 0, ptr_a = 0, ptr_b = 0, ptr_c = 0, ptr_d = 0, stride_a = 0, stride_b = 0, stride_c = 0,
                stride_d = 0, sizes = 0, workspace = 0, end = 0;

    explicit ScratchLayout(int groups) {
        std::size_t at = 0;
        auto take = [&](std::size_t bytes) {
            const std::size_t here = at;
            at = (at + bytes + 255) / 256 * 256;
            return here;
        };
        const auto e = static_cast<std::size_t>(groups);
        shapes = take(e * sizeof(GroupShape));
        ptr_a = take(e * sizeof(void *));
        ptr_b = take(e * sizeof(void *));
        ptr_c = take(e * sizeof(void *));
        ptr_d = take(e * sizeof(void *));
        stride_a = take(e * sizeof(typename G::StrideA));
        stride_b = take(e * sizeof(typename G::StrideB));
        stride_c = take(e * sizeof(typename G::StrideC));
        stride_d = take(e * sizeof(typename G::StrideD));
        sizes = take(e * sizeof(std::int64_t));
        workspace = at;
    }
    template <class T> T *At(void *scratch, std::size_t offset) const {
        return reinterpret_cast<T *>(static_cast<char *>(scratch) + offset);
    }
};

struct SetupParams {
    int groups;
    const std::int64_t *sizes;
    bool grouped_k;
    std::int64_t m, n, k, total;
    Operand a, b, c;
    int ab_bytes, cd_bytes;
};

constexpr int kSetupThreads = 256;

/// One block: each group's clamped size and row offset (a block-wide exclusive scan of the sizes), then its problem
/// shape, operand pointers and strides. A kK group of size 0 gets m = 0: no tile of it runs (its D is zeroed apart).
template <class G>
__global__ void __launch_bounds__(kSetupThreads)
    SetupKernel(SetupParams p, GroupShape *shapes, const void **ptr_a, const void **ptr_b, const void **ptr_c,
                void **ptr_d, typename G::StrideA *stride_a, typename G::StrideB *stride_b,
                typename G::StrideC *stride_c, typename G::StrideD *stride_d, std::int64_t *clamped,
                typename G::StrideA sa, typename G::StrideB sb, typename G::StrideC sc) {
    __shared__ std::int64_t partial[kSetupThreads];
    const int t = static_cast<int>(threadIdx.x);
    const int per = (p.groups + kSetupThreads - 1) / kSetupThreads;
    const int begin = min(p.groups, t * per);
    const int end = min(p.groups, begin + per);
    std::int64_t local = 0;
    for (int e = begin; e < end; ++e) {
        local += max(p.sizes[e], std::int64_t{0});
    }
    partial[t] = local;
    __syncthreads();
    if (t == 0) {
        std::int64_t run = 0;
        for (int i = 0; i < kSetupThreads; ++i) {
            const std::int64_t v = partial[i];
            partial[i] = run;
            run += v;
        }
    }
    __syncthreads();
    std::int64_t offset = partial[t];
    for (int e = begin; e < end; ++e) {
        const std::int64_t raw = max(p.sizes[e], std::int64_t{0});
        // Rows beyond `total` belong to no group: nothing reads or writes past the packed operands.
        const std::int64_t first = min(offset, p.total);
        const std::int64_t size = min(offset + raw, p.total) - first;
        offset += raw;
        clamped[e] = size;
        const int s = static_cast<int>(size);
        shapes[e] = p.grouped_k ? cute::make_shape(size > 0 ? static_cast<int>(p.m) : 0, static_cast<int>(p.n), s)
                                : cute::make_shape(static_cast<int>(p.m), s, static_cast<int>(p.k));
        auto at = [&](const Operand &o, int bytes) {
            return static_cast<const char *>(o.data) + (e * o.group_stride + first * o.row_stride) * bytes;
        };
        ptr_a[e] = at(p.a, p.ab_bytes);
        ptr_b[e] = at(p.b, p.ab_bytes);
        ptr_c[e] = at(p.c, p.cd_bytes);
        ptr_d[e] = const_cast<char *>(at(p.c, p.cd_bytes));
        stride_a[e] = sa;
        stride_b[e] = sb;
        stride_c[e] = sc;
        stride_d[e] = sc;
    }
}

/// D_e = 0 for the kK groups of size 0 (D_e is m×n column-major with ld m: m·n contiguous elements).
template <class CD>
__global__ void ZeroEmptyGroupsKernel(const std::int64_t *clamped, void **ptr_d, std::int64_t elements) {
    const int e = static_cast<int>(blockIdx.y);
    if (clamped[e] != 0) {
        return;
    }
    CD *d = static_cast<CD *>(ptr_d[e]);
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < elements;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        d[i] = CD(0.0f);
    }
}

template <class G, class CD> typename G::Device::Arguments MakeArguments(const Args &args, void *scratch) {
    const ScratchLayout<G> s(args.groups);
    using ElementAB = typename G::Mainloop::ElementA;
    typename G::Device::Arguments arguments;
    decltype(arguments.epilogue.thread) fusion{};
    fusion.alpha = 1.0f;
    fusion.beta = args.beta;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    cutlass::KernelHardwareInfo hw;
    hw.device_id = args.device;
    hw.sm_count = args.sm_count;
    arguments = typename G::Device::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {args.groups, s.template At<GroupShape>(scratch, s.shapes), nullptr},
        {s.template At<const ElementAB *>(scratch, s.ptr_a), s.template At<typename G::StrideA>(scratch, s.stride_a),
         s.template At<const ElementAB *>(scratch, s.ptr_b), s.template At<typename G::StrideB>(scratch, s.stride_b)},
        {fusion, s.template At<const CD *>(scratch, s.ptr_c), s.template At<typename G::StrideC>(scratch, s.stride_c),
         s.template At<CD *>(scratch, s.ptr_d), s.template At<typename G::StrideD>(scratch, s.stride_d)},
        hw};
    return arguments;
}

/// ScratchBytes (scratch == nullptr: *needed) or Run for one kernel.
template <class AB, class CD, Layout kLayout, Config kConfig>
int RunKernel(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    using G = GroupedGemm<AB, CD, kLayout, kConfig>;
    const ScratchLayout<G> layout(args.groups);
    // The workspace size depends on the group count and the hardware, not on the pointers.
    typename G::Device::Arguments arguments = MakeArguments<G, CD>(args, nullptr);
    const std::size_t bytes = layout.workspace + G::Device::get_workspace_size(arguments);
    if (needed != nullptr) {
        *needed = bytes;
        return kOk;
    }
    if (scratch == nullptr || scratch_bytes < bytes) {
        return kInitFailed;
    }
    arguments = MakeArguments<G, CD>(args, scratch);
    const SetupParams p{.groups = args.groups,
                        .sizes = args.sizes,
                        .grouped_k = args.grouped_k,
                        .m = args.m,
                        .n = args.n,
                        .k = args.k,
                        .total = args.total,
                        .a = args.a,
                        .b = args.b,
                        .c = args.c,
                        .ab_bytes = static_cast<int>(sizeof(AB)),
                        .cd_bytes = static_cast<int>(sizeof(CD))};
    SetupKernel<G><<<1, kSetupThreads, 0, args.stream>>>(
        p, layout.template At<GroupShape>(scratch, layout.shapes),
        layout.template At<const void *>(scratch, layout.ptr_a),
        layout.template At<const void *>(scratch, layout.ptr_b),
        layout.template At<const void *>(scratch, layout.ptr_c), layout.template At<void *>(scratch, layout.ptr_d),
        layout.template At<typename G::StrideA>(scratch, layout.stride_a),
        layout.template At<typename G::StrideB>(scratch, layout.stride_b),
        layout.template At<typename G::StrideC>(scratch, layout.stride_c),
        layout.template At<typename G::StrideD>(scratch, layout.stride_d),
        layout.template At<std::int64_t>(scratch, layout.sizes), LeadingStride<typename G::StrideA>(args.a.ld),
        LeadingStride<typename G::StrideB>(args.b.ld), LeadingStride<typename G::StrideC>(args.c.ld));
    if (cudaGetLastError() != cudaSuccess) {
        return kRunFailed;
    }
    typename G::Device gemm;
    if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
        return kCannotImplement;
    }
    if (gemm.initialize(arguments, static_cast<char *>(scratch) + layout.workspace, args.stream) !=
        cutlass::Status::kSuccess) {
        return kInitFailed;
    }
    if (gemm.run(args.stream) != cutlass::Status::kSuccess) {
        return kRunFailed;
    }
    if (args.grouped_k && args.beta == 0.0f) {
        const std::int64_t elements = args.m * args.n;
        const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>((elements + 255) / 256, std::int64_t{64})),
                        static_cast<unsigned>(args.groups));
        ZeroEmptyGroupsKernel<CD>
            <<<grid, 256, 0, args.stream>>>(layout.template At<std::int64_t>(scratch, layout.sizes),
                                            layout.template At<void *>(scratch, layout.ptr_d), elements);
    }
    return cudaGetLastError() == cudaSuccess ? kOk : kRunFailed;
}

/// The kernels of one (AB, config): the three layouts with D in AB, and the wgrad layout with D in float32.
template <class AB, Config kConfig>
int RunConfig(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    if (args.cd == Element::kFloat32) {
        if (args.layout != Layout::kNT) {
            return kNotBuilt;
        }
        return RunKernel<AB, float, Layout::kNT, kConfig>(args, scratch, scratch_bytes, needed);
    }
    switch (args.layout) {
    case Layout::kTN:
        return RunKernel<AB, AB, Layout::kTN, kConfig>(args, scratch, scratch_bytes, needed);
    case Layout::kNN:
        return RunKernel<AB, AB, Layout::kNN, kConfig>(args, scratch, scratch_bytes, needed);
    case Layout::kNT:
        return RunKernel<AB, AB, Layout::kNT, kConfig>(args, scratch, scratch_bytes, needed);
    }
    return kNotBuilt;
}

} // namespace shardline::kernels::cuda::cutlass_grouped::detail
