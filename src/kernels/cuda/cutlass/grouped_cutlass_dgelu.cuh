#pragma once

// The grouped dgrad through a GELU, fused into the CUTLASS epilogue: per group e, D_e = acc_e ⊙ gelu_tanh'(Z_e), where
// acc_e = A_e·B_e (Layout::kNN, fp32 accumulation) and Z_e, the GELU's pre-activation, is the epilogue's source C.
// The SM90 pointer-array epilogue already loads C from a per-group pointer array (the setup kernel writes it), so the
// fusion is an EVT over the accumulator and the source: Sm90EVT<Sm90Compute<DGeluTanhMul>, Sm90AccFetch,
// Sm90SrcFetch>. Sm90SrcFetch::is_C_load_needed() is true for a non-void C, so the collective loads Z for every tile
// whatever beta is (there is no beta: the fusion has no scalar). D gets its own pointer array (Args::d).
//
// Only the dgrad layout, D in the operands' type and the cooperative 256x128 config are instantiated (one translation
// unit per type, grouped_cutlass_dgelu_<type>_256x128.cu): each CUTLASS kernel costs about a minute of a 2-core
// build. The forward's GELU is not fused the same way: its pre-activation is a second output, and the SM90 aux store
// (Sm90AuxStore) takes one pointer, not a per-group array (docs/kernels.md).

#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "../device_utils.cuh"
#include "grouped_cutlass.cuh"

namespace shardline::kernels::cuda::cutlass_grouped::detail {

/// dy ⊙ gelu_tanh'(z) in fp32: the formula of the unfused dGELU kernel (device_utils.cuh's GeluTanhGrad), applied to
/// the fp32 accumulator instead of D rounded to its dtype. Sm90Compute converts both inputs to float arrays and calls
/// the Array form.
template <class T> struct DGeluTanhMul {
    CUTLASS_DEVICE T operator()(T const &dy, T const &z) const { return dy * GeluTanhGrad(z); }
};
template <class T, int N> struct DGeluTanhMul<cutlass::Array<T, N>> {
    CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const &dy,
                                                   cutlass::Array<T, N> const &z) const {
        cutlass::Array<T, N> out;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < N; ++i) {
            out[i] = dy[i] * GeluTanhGrad(z[i]);
        }
        return out;
    }
};

/// D = acc ⊙ gelu_tanh'(C), computed in fp32, rounded once to D's type.
template <class AB>
using DGeluFusion = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<DGeluTanhMul, AB, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch, cutlass::epilogue::fusion::Sm90SrcFetch<AB>>;

/// GroupedGemm's kernel (the same mainloop, schedule, tile and cluster) for Layout::kNN with the dGELU epilogue.
template <class AB, Config kConfig> using GroupedDGeluGemm = GroupedGemm<AB, AB, Layout::kNN, kConfig, DGeluFusion<AB>>;

/// The EVT's arguments: none (the accumulator and the source fetches and the compute node take no parameters).
template <class AB, Config kConfig> struct FusionArguments<GroupedGemm<AB, AB, Layout::kNN, kConfig, DGeluFusion<AB>>> {
    template <class Fusion> static Fusion Make(const Args &) { return Fusion{}; }
};

/// Run (or ScratchBytes) of the dgelu kernel: args.c is Z (read as the source), args.d is D.
template <class AB, Config kConfig>
int RunDGeluConfig(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    if (!args.dgelu || args.layout != Layout::kNN || args.cd != args.ab || args.d.data == nullptr) {
        return kNotBuilt;
    }
    return RunKernel<AB, AB, Layout::kNN, kConfig, GroupedDGeluGemm<AB, kConfig>>(args, scratch, scratch_bytes, needed);
}

} // namespace shardline::kernels::cuda::cutlass_grouped::detail
