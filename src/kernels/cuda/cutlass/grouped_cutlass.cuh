#pragma once

// The grouped GEMM kernels of one (element type, config) and the device-side setup of their arguments. Included by the
// grouped_cutlass_<type>_<config>.cu files only (each compiles for sm_90a), which instantiate RunConfig for their pair.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include <cub/block/block_scan.cuh>
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
template <> struct ConfigTraits<Config::kCooperative128x256> {
    using Shape = cute::Shape<cute::_128, cute::_256, cute::_64>;
    using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
    using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
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

/// The TMA warp-specialized pointer-array grouped GEMM of one Config, fp32 accumulation, D = alpha·acc + beta·C, or
/// another epilogue `Fusion` (the dgelu kernels of grouped_cutlass_dgelu.cuh; FusionArguments gives its arguments).
template <class AB, class CD, Layout kLayout, Config kConfig,
          class Fusion = cutlass::epilogue::fusion::LinearCombination<CD, float>>
struct GroupedGemm {
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
        typename ConfigTraits<kConfig>::Epilogue, Fusion>::CollectiveOp;
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
                stride_d = 0, workspace = 0;

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
    Operand d = {}; ///< D apart from C (Args::d with dgelu); data null: D is C
};

constexpr int kSetupThreads = 256;

/// D_e = 0 (all bytes zero: 0.0 in every float type) for a group's m×n column-major D with ld m (the eligibility asks
/// for packed leading dims: m·n contiguous elements), spread over `threads` threads of which this is `thread`.
__device__ inline void ZeroGroup(char *d, std::int64_t bytes, std::int64_t thread, std::int64_t threads) {
    std::int64_t done = 0;
    if (reinterpret_cast<std::uintptr_t>(d) % 16 == 0) {
        const std::int64_t vectors = bytes / 16;
        uint4 *v = reinterpret_cast<uint4 *>(d);
        for (std::int64_t i = thread; i < vectors; i += threads) {
            v[i] = make_uint4(0u, 0u, 0u, 0u);
        }
        done = vectors * 16;
    }
    for (std::int64_t i = done + thread; i < bytes; i += threads) {
        d[i] = 0;
    }
}

/// The grouped kernel's arguments from the sizes on the device. Every block computes each group's clamped size and
/// row offset (a block-wide exclusive scan of the sizes, kSetupThreads groups per round); block 0 writes each group's
/// problem shape, operand pointers and strides; with `zero_empty` (a kK GEMM with beta = 0) the other blocks zero the
/// D of every group of size 0, which gets m = 0 so that no tile of it runs (a tile with k = 0 would store accumulators
/// that no MMA cleared). One launch instead of a setup and a zeroing kernel: the zeroing blocks fill the SMs that the
/// one setup block leaves idle, and the GEMM after waits for both anyway.
template <class G>
__global__ void __launch_bounds__(kSetupThreads)
    SetupKernel(SetupParams p, GroupShape *shapes, const void **ptr_a, const void **ptr_b, const void **ptr_c,
                void **ptr_d, typename G::StrideA *stride_a, typename G::StrideB *stride_b,
                typename G::StrideC *stride_c, typename G::StrideD *stride_d, typename G::StrideA sa,
                typename G::StrideB sb, typename G::StrideC sc) {
    using Scan = cub::BlockScan<std::int64_t, kSetupThreads>;
    __shared__ typename Scan::TempStorage scan;
    __shared__ int empty_count;
    __shared__ int empty_group[kSetupThreads];
    __shared__ std::int64_t empty_first[kSetupThreads];
    const int t = static_cast<int>(threadIdx.x);
    const bool writer = blockIdx.x == 0;
    std::int64_t carry = 0; // Σ sizes of the groups of the rounds before
    for (int base = 0; base < p.groups; base += kSetupThreads) {
        const int e = base + t;
        const std::int64_t raw = e < p.groups ? max(p.sizes[e], std::int64_t{0}) : std::int64_t{0};
        std::int64_t before = 0;
        std::int64_t round = 0;
        Scan(scan).ExclusiveSum(raw, before, round);
        const std::int64_t offset = carry + before;
        carry += round;
        // Rows beyond `total` belong to no group: nothing reads or writes past the packed operands.
        const std::int64_t first = min(offset, p.total);
        const std::int64_t size = min(offset + raw, p.total) - first;
        auto at = [&](const Operand &o, int bytes, int group, std::int64_t row) {
            return static_cast<const char *>(o.data) + (group * o.group_stride + row * o.row_stride) * bytes;
        };
        if (writer) {
            if (e < p.groups) {
                const int s = static_cast<int>(size);
                shapes[e] = p.grouped_k
                                ? cute::make_shape(size > 0 ? static_cast<int>(p.m) : 0, static_cast<int>(p.n), s)
                                : cute::make_shape(static_cast<int>(p.m), s, static_cast<int>(p.k));
                ptr_a[e] = at(p.a, p.ab_bytes, e, first);
                ptr_b[e] = at(p.b, p.ab_bytes, e, first);
                ptr_c[e] = at(p.c, p.cd_bytes, e, first);
                ptr_d[e] = const_cast<char *>(at(p.d.data != nullptr ? p.d : p.c, p.cd_bytes, e, first));
                stride_a[e] = sa;
                stride_b[e] = sb;
                stride_c[e] = sc;
                stride_d[e] = sc;
            }
        } else {
            // This round's empty groups, then each zeroed by all the zeroing blocks together.
            if (t == 0) {
                empty_count = 0;
            }
            __syncthreads();
            if (e < p.groups && size == 0) {
                const int slot = atomicAdd(&empty_count, 1);
                empty_group[slot] = e;
                empty_first[slot] = first;
            }
            __syncthreads();
            const int count = empty_count;
            const std::int64_t threads = static_cast<std::int64_t>(gridDim.x - 1) * kSetupThreads;
            const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x - 1) * kSetupThreads + t;
            for (int i = 0; i < count; ++i) {
                ZeroGroup(const_cast<char *>(at(p.c, p.cd_bytes, empty_group[i], empty_first[i])),
                          p.m * p.n * p.cd_bytes, thread, threads);
            }
        }
        __syncthreads(); // the scan's storage and the empty list are reused by the next round
    }
}
/// The epilogue's fusion arguments of a GEMM type: LinearCombination's alpha = 1 and beta (a GEMM type with another
/// fusion specialises this, e.g. the dgelu kernels of grouped_cutlass_dgelu.cuh).
template <class G> struct FusionArguments {
    template <class Fusion> static Fusion Make(const Args &args) {
        Fusion fusion{};
        fusion.alpha = 1.0f;
        fusion.beta = args.beta;
        fusion.alpha_ptr = nullptr;
        fusion.beta_ptr = nullptr;
        fusion.alpha_ptr_array = nullptr;
        fusion.beta_ptr_array = nullptr;
        fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
        fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
        return fusion;
    }
};

template <class G, class CD> typename G::Device::Arguments MakeArguments(const Args &args, void *scratch) {
    const ScratchLayout<G> s(args.groups);
    using ElementAB = typename G::Mainloop::ElementA;
    typename G::Device::Arguments arguments;
    using Fusion = decltype(arguments.epilogue.thread);
    const Fusion fusion = FusionArguments<G>::template Make<Fusion>(args);
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
    using Raster = decltype(arguments.scheduler.raster_order);
    arguments.scheduler.raster_order = args.raster_along_n ? Raster::AlongN : Raster::AlongM;
    return arguments;
}

/// The kernel Params of one GEMM type, kept for the arguments they were built from. GemmUniversalAdapter::initialize
/// rebuilds them on every call (host work: the TMA descriptors, the scheduler's grid, and a cudaFuncSetAttribute), yet
/// they depend only on where the scratch is (the per-group arrays and the workspace are at fixed offsets in it), the
/// group count, beta, the raster order and the device: the problem shapes and operand pointers are read on the device,
/// from the arrays the setup kernel writes. Nothing in the workspace needs initialising for these kernels
/// (initialize_workspace is a no-op for the grouped scheduler, the pointer-array collectives and LinearCombination), so
/// a hit launches the cached Params directly. The scratch comes from the stream-ordered pool, which hands the same
/// address back to a steady stream of same-sized calls; a few entries cover the forward, dgrad and wgrad of a layer
/// sharing one kernel type.
template <class G> class ParamsCache {
public:
    using Params = typename G::Device::Params;
    struct Key {
        const void *scratch = nullptr;
        int groups = 0;
        float beta = 0.0f;
        bool raster_along_n = false;
        int device = -1;
        int sm_count = 0;
        std::uint64_t generation = 0; ///< CachedParamsGeneration() when built
        bool operator==(const Key &o) const {
            return scratch == o.scratch && groups == o.groups && beta == o.beta && raster_along_n == o.raster_along_n &&
                   device == o.device && sm_count == o.sm_count && generation == o.generation;
        }
    };
    static ParamsCache &Get() {
        static auto *cache = new ParamsCache(); // never destroyed (static teardown vs the CUDA runtime)
        return *cache;
    }
    bool Find(const Key &key, Params *params) {
        std::lock_guard lock(mutex_);
        for (const Entry &e : entries_) {
            if (e.used && e.key == key) {
                *params = e.params;
                return true;
            }
        }
        return false;
    }
    void Store(const Key &key, const Params &params) {
        std::lock_guard lock(mutex_);
        Entry &e = entries_[next_];
        next_ = (next_ + 1) % kEntries;
        e.used = true;
        e.key = key;
        e.params = params;
    }

private:
    static constexpr int kEntries = 8;
    struct Entry {
        bool used = false;
        Key key{};
        Params params{};
    };
    std::mutex mutex_;
    Entry entries_[kEntries];
    int next_ = 0;
};

/// The zeroing blocks of the setup kernel for a D of `bytes` per group: about eight 16-byte stores per thread for one
/// empty group, at most one block per SM.
inline int ZeroBlocks(std::int64_t bytes, int sm_count) {
    const std::int64_t per_block = std::int64_t{kSetupThreads} * 16 * 8;
    return static_cast<int>(std::clamp<std::int64_t>((bytes + per_block - 1) / per_block, 1, std::max(sm_count, 1)));
}

/// ScratchBytes (scratch == nullptr: *needed) or Run for one kernel (G: the GEMM type, GroupedGemm's unless another
/// fusion's, e.g. the dgelu kernels).
template <class AB, class CD, Layout kLayout, Config kConfig, class G = GroupedGemm<AB, CD, kLayout, kConfig>>
int RunKernel(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
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
                        .cd_bytes = static_cast<int>(sizeof(CD)),
                        .d = args.dgelu ? args.d : Operand{}};
    // beta = 0 zeroes the empty groups' D; beta = 1 leaves it (D = C).
    const bool zero_empty = args.grouped_k && args.beta == 0.0f;
    const int blocks =
        zero_empty ? 1 + ZeroBlocks(args.m * args.n * static_cast<std::int64_t>(sizeof(CD)), args.sm_count) : 1;
    SetupKernel<G><<<blocks, kSetupThreads, 0, args.stream>>>(
        p, layout.template At<GroupShape>(scratch, layout.shapes),
        layout.template At<const void *>(scratch, layout.ptr_a),
        layout.template At<const void *>(scratch, layout.ptr_b),
        layout.template At<const void *>(scratch, layout.ptr_c), layout.template At<void *>(scratch, layout.ptr_d),
        layout.template At<typename G::StrideA>(scratch, layout.stride_a),
        layout.template At<typename G::StrideB>(scratch, layout.stride_b),
        layout.template At<typename G::StrideC>(scratch, layout.stride_c),
        layout.template At<typename G::StrideD>(scratch, layout.stride_d),
        LeadingStride<typename G::StrideA>(args.a.ld), LeadingStride<typename G::StrideB>(args.b.ld),
        LeadingStride<typename G::StrideC>(args.c.ld));
    if (cudaGetLastError() != cudaSuccess) {
        return kRunFailed;
    }
    const typename ParamsCache<G>::Key key{.scratch = scratch,
                                           .groups = args.groups,
                                           .beta = args.beta,
                                           .raster_along_n = args.raster_along_n,
                                           .device = args.device,
                                           .sm_count = args.sm_count,
                                           .generation = CachedParamsGeneration()};
    typename ParamsCache<G>::Params params;
    const bool hit = ParamsCache<G>::Get().Find(key, &params);
    CountCachedParams(hit);
    if (!hit) {
        typename G::Device gemm;
        if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
            return kCannotImplement;
        }
        // initialize also sets the kernel's shared-memory attribute (on this device: the key names it).
        if (gemm.initialize(arguments, static_cast<char *>(scratch) + layout.workspace, args.stream) !=
            cutlass::Status::kSuccess) {
            return kInitFailed;
        }
        params = gemm.params();
        ParamsCache<G>::Get().Store(key, params);
    }
    if (G::Device::run(params, args.stream) != cutlass::Status::kSuccess) {
        return kRunFailed;
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
