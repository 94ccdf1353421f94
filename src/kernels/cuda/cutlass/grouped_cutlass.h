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
/// The kernel configurations: schedule, CTA tile (m × n × k, in the column-major D's terms: m = D's rows, n = the
/// grouped rows of a forward/dgrad) and cluster. bf16 builds all five; fp16 the cooperative 256×128 and 128×128.
///   kCooperative256x128  cooperative, 256×128×64, cluster 1×2: torch._grouped_mm's large config (its 128×256, cluster
///                        2×1, transposed to our column-major D); the measured best on 8 large experts
///   kCooperative128x128  cooperative, 128×128×64, no cluster: less padding of many small experts
///   kPingpong128x128     pingpong, 128×128×64, cluster 2×1 (CUTLASS example 57's pingpong): one warp group's epilogue
///                        overlaps the other's mainloop, for short k (a wgrad over few rows per expert)
///   kPingpong128x64      pingpong, 128×64×128, cluster 1×2: torch._grouped_mm's small config (its 64×128×128,
///                        transposed): few rows per group
///   kCooperative128x256  cooperative, 128×256×64, cluster 2×1 (bf16 only): CUTLASS example 57's 256×128 cluster 1×2
///                        with the tokens as its M, transposed — 256 grouped rows per tile, the cluster along D's rows
enum class Config : int {
    kCooperative256x128 = 0,
    kCooperative128x128 = 1,
    kPingpong128x128 = 2,
    kPingpong128x64 = 3,
    kCooperative128x256 = 4
};
inline constexpr int kConfigCount = 5;
/// "cooperative256x128", ... (the names of SHARDLINE_GROUPED_GEMM_TILE and of the bench's JSON).
const char* ConfigName(Config config);

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
    Config config = Config::kCooperative256x128;
    /// The order in which the persistent tile scheduler walks a group's output tiles: along m (D's rows: for a forward,
    /// consecutive CTAs take different weight rows of one block of grouped rows; CUTLASS's default for grouped
    /// problems) or along n (consecutive CTAs share one weight tile, the grouped rows vary). Which keeps the operands
    /// that the CTAs in flight share in L2 depends on the shape, so the tuning times both.
    bool raster_along_n = false;
    int groups = 0;
    const std::int64_t* sizes = nullptr; ///< device memory, `groups` entries (negative read as 0; clamped to total)
    bool grouped_k = false;              ///< the sizes are k (a wgrad) instead of n
    std::int64_t m = 0, n = 0, k = 0;    ///< the shared dims (the grouped one is ignored)
    std::int64_t total = 0;              ///< rows the packed operands hold
    Operand a, b;
    Operand c;         ///< written: D over C (with dgelu: only read, the pre-activation Z)
    float beta = 0.0f; ///< 0 or 1
    int device = 0;
    int sm_count = 0;
    cudaStream_t stream = nullptr;
    /// D = acc ⊙ gelu_tanh'(C): the grouped dgrad through a GELU, C = the pre-activation Z read as the epilogue's
    /// source (beta ignored), D written to `d`. Built for Layout::kNN, D in AB, bf16/fp16, kCooperative256x128 only
    /// (BuiltDGelu); Run answers kNotBuilt otherwise.
    bool dgelu = false;
    Operand d{}; ///< written, with dgelu (data null: D is C)
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
/// Whether this build has the kernels of `config` for operands of `ab` (Run answers kNotBuilt otherwise).
bool Built(Element ab, Config config);
/// Whether this build has the dgelu kernel (Args::dgelu) of `config` for operands of `ab`.
bool BuiltDGelu(Element ab, Config config);
/// The device scratch `Run` needs for `args` (the per-group arrays and CUTLASS's workspace), in `*bytes`.
int ScratchBytes(const Args& args, std::size_t* bytes);
/// Enqueues the grouped GEMM on args.stream: the setup kernel, then the grouped kernel (two launches). `scratch` is
/// device memory of at least ScratchBytes, used by nothing else until both have run (stream order). For grouped_k with
/// beta = 0 the setup kernel also zeroes D of the groups of size 0; with beta = 1 they are left untouched. The kernel's
/// Params are built once per (scratch address, groups, beta, raster order, device) and reused: no per-call host
/// initialisation.
int Run(const Args& args, void* scratch, std::size_t scratch_bytes);

/// Drops every cached kernel Params (Run's per-call host work is then done again once per key): tests compare a
/// freshly initialised call with a cached one.
void ForgetCachedParams();
/// The generation ForgetCachedParams advances (a cached entry of an older one is not used).
std::uint64_t CachedParamsGeneration();
/// Run's launches since the start: with cached Params (hits) and after building them (misses).
struct CachedParamsStats {
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;
};
CachedParamsStats GetCachedParamsStats();
void CountCachedParams(bool hit);

} // namespace shardline::kernels::cuda::cutlass_grouped
