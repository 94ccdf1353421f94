// Which translation unit serves a grouped GEMM: the (element type, tile) pair, when this build compiled the CUTLASS
// kernels (SHARDLINE_HAVE_CUTLASS in shardline/config.h, the same switch that adds the sm_90a objects in
// src/kernels/cuda/CMakeLists.txt). A source property set in that subdirectory did not reach this file, which
// shardline_kernels (defined in src/) compiles: every CUTLASS test skipped with "not built" on an H200.

#include "grouped_cutlass.h"

#include <shardline/config.h>

namespace shardline::kernels::cuda::cutlass_grouped {

#if SHARDLINE_HAVE_CUTLASS
namespace detail {
int Run_bf16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_bf16_128x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_fp16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_fp16_128x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
} // namespace detail

namespace {
int Dispatch(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    if (args.groups <= 0 || args.groups > 65535) {
        return kCannotImplement;
    }
    const bool large = args.tile == Tile::k256x128;
    switch (args.ab) {
    case Element::kBFloat16:
        return large ? detail::Run_bf16_256x128(args, scratch, scratch_bytes, needed)
                     : detail::Run_bf16_128x128(args, scratch, scratch_bytes, needed);
    case Element::kFloat16:
        return large ? detail::Run_fp16_256x128(args, scratch, scratch_bytes, needed)
                     : detail::Run_fp16_128x128(args, scratch, scratch_bytes, needed);
    case Element::kFloat32:
        break;
    }
    return kNotBuilt;
}
} // namespace

bool Built() { return true; }
int ScratchBytes(const Args &args, std::size_t *bytes) { return Dispatch(args, nullptr, 0, bytes); }
int Run(const Args &args, void *scratch, std::size_t scratch_bytes) {
    return Dispatch(args, scratch, scratch_bytes, nullptr);
}
#else
bool Built() { return false; }
int ScratchBytes(const Args &, std::size_t *bytes) {
    *bytes = 0;
    return kNotBuilt;
}
int Run(const Args &, void *, std::size_t) { return kNotBuilt; }
#endif

} // namespace shardline::kernels::cuda::cutlass_grouped
