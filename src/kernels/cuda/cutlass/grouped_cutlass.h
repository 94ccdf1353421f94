#pragma once

// The CUTLASS 4 SM90 pointer-array grouped GEMM (the kernel family behind torch._grouped_mm) for the CUDA GroupedGemm
// provider (cuda/grouped_gemm.cc). This header is plain C++ (no CUTLASS, no fmt): the .cu files that instantiate the
// kernels (sm_90a only) include CUTLASS, and the provider includes only this.
//
// Everything runs on the stream without the host: a small kernel reads the group sizes on the device and writes each
// group's problem shape, operand pointers and strides into the scratch; the grouped kernel reads them there. So a
// call with device-resident sizes never synchronises and can be captured in a CUDA graph (replayed with new sizes in
// the same buffer).

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace shardline::kernels::cuda::cutlass_grouped {

/// The operand layouts in cuBLAS's column-major convention: (trans_a, trans_b) = (1, 0) a Linear forward, (0, 0) its
/// dgrad, (0, 1) its wgrad. C/D are column-major.
enum class Layout : int { kTN = 0, kNN = 1, kNT = 2 };
enum class Element : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };
/// The CTA tile (m × n × k) and cluster of the cooperative warp-specialized kernel: 256×128×64 with a 1×2 cluster (the
/// measured best on 8 large experts), and 128×128×64 with no cluster (less padding for many small experts).
enum class Tile : int { k256x128 = 0, k128x128 = 1 };

struct Operand {
    const void* data = nullptr;
    std::int64_t ld = 0;
    std::int64_t group_stride = 0; ///< elements between groups (a per-expert weight)
    std::int64_t row_stride = 0;   ///< elements per grouped row (a matrix packed by grouped rows)
};

/// One grouped GEMM, as GroupedGemmParams describes it (grouped_gemm.h), in the layouts above.
struct Args {
    Layout layout = Layout::kTN;
    Element ab = Element::kBFloat16; ///< A and B
    Element cd = Element::kBFloat16; ///< C and D: ab, or float32 (a wgrad into a main grad)
    Tile tile = Tile::k256x128;
    int groups = 0;
    const std::int64_t* sizes = nullptr; ///< device memory, `groups` entries (negative read as 0; clamped to total)
    bool grouped_k = false;              ///< the sizes are k (a wgrad) instead of n
    std::int64_t m = 0, n = 0, k = 0;    ///< the shared dims (the grouped one is ignored)
    std::int64_t total = 0;              ///< rows the packed operands hold
    Operand a, b;
    Operand c;         ///< written: D over C
    float beta = 0.0f; ///< 0 or 1
    int device = 0;
    int sm_count = 0;
    cudaStream_t stream = nullptr;
};

enum Status : int {
    kOk = 0,
    kNotBuilt = 1,        ///< this build has no kernel for the configuration (no CUTLASS, or not sm_90a)
    kCannotImplement = 2, ///< CUTLASS's can_implement refused the arguments
    kInitFailed = 3,
    kRunFailed = 4,
};

/// Whether this build compiled the kernels (SHARDLINE_WITH_CUTLASS, sm_90a).
bool Built();
/// The device scratch `Run` needs for `args` (the per-group arrays and CUTLASS's workspace), in `*bytes`.
int ScratchBytes(const Args& args, std::size_t* bytes);
/// Enqueues the grouped GEMM on args.stream; `scratch` is device memory of at least ScratchBytes. For grouped_k with
/// beta = 0 the groups of size 0 get D = 0 (a second small kernel); with beta = 1 they are left untouched.
int Run(const Args& args, void* scratch, std::size_t scratch_bytes);

} // namespace shardline::kernels::cuda::cutlass_grouped
