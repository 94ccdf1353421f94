#pragma once

// Grouped GEMM: one GEMM per group (a mixture-of-experts expert), the groups differing in one dimension — the number
// of rows routed to the expert. GroupedGemmParams is to GroupedGemm what GemmParams is to Gemm: a pure problem
// description, built with designated initializers at each call site, and one dispatch.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/kernels/gemm.h>

namespace shardline::kernels {

/// Which GEMM dimension (cuBLAS's column-major m, n, k) is the group's size. The other two are shared by all groups.
enum class GroupedDim : std::uint8_t {
    kN, ///< n_e = sizes[e]: a Linear forward or dgrad, the group's rows are D's columns (column-major)
    kK, ///< k_e = sizes[e]: a Linear wgrad, the group's rows are the reduction
};

/// One operand of every group, in elements: group e's matrix starts at
///     data + e·group_stride + offset_e·row_stride,   offset_e = sizes[0] + … + sizes[e-1],
/// and has leading dimension `ld`. A per-group weight [E, out, in] has group_stride = out·in and row_stride = 0; a
/// matrix packed by the grouped rows ([T, features], the groups' rows one after another) has group_stride = 0 and
/// row_stride = features.
struct GroupedOperand {
    const void* data = nullptr;
    std::int64_t ld = 0;
    std::int64_t group_stride = 0;
    std::int64_t row_stride = 0;
};

/// A pure description of E GEMMs in cuBLAS's column-major convention, one per group e:
///     D_e = alpha · op(A_e) · op(B_e) + beta · C_e  (+ bias_e per row of D_e with kBias),
///     D_e = (alpha · op(A_e) · op(B_e)) ⊙ gelu_tanh'(Z_e)  with kDGelu (a grouped dgrad through a GELU, beta 0),
/// op(A_e) m×k, op(B_e) k×n, D_e m×n written over C_e, with n (kN) or k (kK) = sizes[e]. A group of size 0 launches
/// nothing with kN (D_e has no columns) and gives D_e = beta·C_e with kK (zero, or untouched with beta = 1).
/// `sizes` (E int64 entries, each >= 0, Σ = total) lives on the host (sizes_device = CPU) or on `device`.
struct GroupedGemmParams {
    bool trans_a = false;
    bool trans_b = false;
    GroupedDim grouped_dim = GroupedDim::kN;
    std::int64_t m = 0;
    std::int64_t n = 0; ///< ignored with kN
    std::int64_t k = 0; ///< ignored with kK

    std::int64_t group_count = 0;
    const std::int64_t* sizes = nullptr;
    Device sizes_device;    ///< Device::CPU() (host sizes) or `device`
    std::int64_t total = 0; ///< Σ sizes: the grouped rows the packed operands hold

    GroupedOperand a;
    DType a_type = DType::kFloat32;
    GroupedOperand b;
    DType b_type = DType::kFloat32;
    GroupedOperand c; ///< written (D over C); its `data` must be writable memory
    DType c_type = DType::kFloat32;

    double alpha = 1.0;
    double beta = 0.0; ///< 0 or 1 (1: accumulate into C, e.g. an fp32 main grad)
    GemmCompute compute = GemmCompute::kDefault;

    GemmEpilogue epilogue = GemmEpilogue::kNone; ///< kNone, kBias (m entries per group) or kDGelu
    const void* bias = nullptr;
    DType bias_type = DType::kFloat32;
    std::int64_t bias_group_stride = 0; ///< elements between the groups' bias vectors

    /// kDGelu: Z, the GELU's pre-activation (tanh approximation, as GemmEpilogue::kDGelu), only read, in C's dtype.
    /// kDGelu needs grouped_dim kN, beta 0, and D and Z both packed by the grouped rows with the same leading dimension
    /// m (group_stride 0, row_stride = ld = m: a [total, m] row-major matrix each), not overlapping.
    GroupedOperand aux{};

    Device device;
};

struct GroupedGemmOp {
    static constexpr std::string_view kName = "GroupedGemm";
    using Fn = void (*)(const GroupedGemmParams&);
};

/// Runs the grouped GEMM through the dispatcher (like Gemm, a nested call inherits its caller's provider). Default
/// provider: a loop of Gemm over the non-empty groups (OpenBLAS on the CPU, the cached cuBLASLt plans on CUDA), which
/// reads device-resident sizes on the host first (one synchronisation; refused while a CUDA graph is captured).
/// kDGelu: the loop passes each group's Gemm the kDGelu epilogue (the CPU: the GEMM, then D ⊙ gelu_tanh'(Z) in
/// double, as GeluBackward; CUDA: cuBLASLt's DGELU epilogue, or the GEMM and the dGELU kernel); the CUDA CUTLASS path
/// fuses it into the cooperative 256×128 kernel's epilogue (bf16/fp16; an EVT reading Z as the source C), and for its
/// other configs runs the GEMM, then one dGELU kernel over the packed [total, m] D (docs/kernels.md).
void GroupedGemm(const GroupedGemmParams& params);

/// The CUDA provider's implementation choice. kAuto: per shape class, by measurement (the first call of a class times
/// every candidate — the CUTLASS configs built for its dtype, and the loop of cached cuBLASLt GEMMs when the sizes are
/// on the host — and keeps the fastest; see GroupedGemmTuningInfos); where timing is not allowed (a CUDA graph
/// capture, GemmTuningPause, SHARDLINE_GEMM_TUNING=0) and the class has no winner yet, the heuristic: CUTLASS for
/// device-resident sizes (the path without a host synchronisation) and for many small experts, the loop for few large
/// ones (docs/kernels.md). kCutlass / kLoop force one (kCutlass where it is eligible).
///
/// The CUTLASS config (schedule, CTA tile m×n×k of the column-major D, cluster): kAuto chooses as above (under
/// kCutlass: by the rows per group); the others force one where this build has it for the dtype (bf16: all four;
/// fp16: the two cooperative ones; otherwise the heuristic's):
///   k256x128          cooperative 256×128×64, cluster 1×2 (torch._grouped_mm's large config, transposed)
///   k128x128          cooperative 128×128×64, no cluster
///   kPingpong128x128  pingpong 128×128×64, cluster 2×1
///   kPingpong128x64   pingpong 128×64×128, cluster 1×2 (torch._grouped_mm's small config, transposed)
///   k128x256          cooperative 128×256×64, cluster 2×1 (bf16 only; CUTLASS example 57's config, transposed)
/// and the order in which the kernel walks a group's output tiles (the raster): along m (D's rows, CUTLASS's default
/// for grouped problems) or along n (D's columns: for a forward or dgrad, the grouped rows), which decides what the
/// CTAs in flight share in L2. kAuto: the tuning times both for every config; the heuristic and a forced tile without
/// a forced raster take along m.
/// Start: SHARDLINE_GROUPED_GEMM (auto|cutlass|loop), SHARDLINE_GROUPED_GEMM_TILE (auto|256x128|128x128|
/// pingpong128x128|pingpong128x64|128x256) and SHARDLINE_GROUPED_GEMM_RASTER (auto|m|n).
enum class GroupedGemmImpl : std::uint8_t { kAuto, kCutlass, kLoop };
enum class GroupedGemmTile : std::uint8_t { kAuto, k256x128, k128x128, kPingpong128x128, kPingpong128x64, k128x256 };
enum class GroupedGemmRaster : std::uint8_t { kAuto, kAlongM, kAlongN };
struct GroupedGemmChoice {
    GroupedGemmImpl impl = GroupedGemmImpl::kAuto;
    GroupedGemmTile tile = GroupedGemmTile::kAuto;
    GroupedGemmRaster raster = GroupedGemmRaster::kAuto;
};
GroupedGemmChoice GetGroupedGemmChoice();
void SetGroupedGemmChoice(const GroupedGemmChoice& choice);
/// What the default provider runs for this problem now: "cutlass <config> (tuned)" (the class's winner), "loop
/// (tuned)", "cutlass <config> (forced)", or, before the class is tuned, the heuristic's pick: "cutlass <config>
/// (heuristic)" / "loop (<why>)". <config>: cooperative256x128, cooperative128x128, pingpong128x128, pingpong128x64,
/// cooperative128x256, each followed by " along-n" when the raster is along n. A kDGelu problem on CUTLASS adds
/// " dgelu-epilogue" (fused in the kernel) or " dgelu-kernel" (a kernel after).
std::string GroupedGemmPath(const GroupedGemmParams& params);
/// The path the CUDA default provider took on this thread's last GroupedGemm, in GroupedGemmPath's words (a first
/// call of a class says "(tuned)": it ran the winner last); empty before the first.
std::string LastGroupedGemmPath();

/// What the per-shape tuning did since the process started (or ClearGroupedGemmTuning).
struct GroupedGemmTuningStats {
    std::uint64_t tuned = 0;   ///< shape classes whose candidates were timed
    std::uint64_t hits = 0;    ///< calls served by a class's cached winner
    std::uint64_t untuned = 0; ///< calls of an untuned class served by the heuristic (capture, pause, tuning off)
};
GroupedGemmTuningStats GetGroupedGemmTuningStats();
/// One tuned shape class: its key text, the winner and every candidate's measured µs per call (negative: it could
/// not run the problem).
struct GroupedGemmTuningInfo {
    std::string key = {};
    std::string winner = {};
    std::vector<std::pair<std::string, double>> candidates_us = {};
};
std::vector<GroupedGemmTuningInfo> GroupedGemmTuningInfos();
/// Forgets every winner and zeroes the stats (tests, benches).
void ClearGroupedGemmTuning();

/// Checks the description (sizes, leading dims, pointers, dtypes, epilogue); throws ShapeError naming `op`.
void ValidateGroupedGemmParams(const GroupedGemmParams& params, std::string_view op);

/// The group sizes on the host: a copy of host sizes, or device sizes read back (waits for the device's compute
/// stream). Throws, naming `op`, for a negative size or a sum other than `total`, and for device sizes while the
/// device's compute stream is being captured into a CUDA graph (which cannot wait for the host).
std::vector<std::int64_t> HostGroupSizes(const std::int64_t* sizes, std::int64_t group_count, Device sizes_device,
                                         std::int64_t total, std::string_view op);

/// The GEMM of group e as a GemmParams (the loop provider's call), given the groups' host offsets.
GemmParams GroupGemmParams(const GroupedGemmParams& params, std::int64_t group, std::int64_t size, std::int64_t offset);

} // namespace shardline::kernels
