#pragma once

// Private to src/kernels and its tests: the grouped GEMM's per-shape choice by measurement (host-only logic: the shape
// classes, the cache of winners, the counters; the CUDA provider, cuda/grouped_gemm.cc, does the timing). The public
// side — the stats, the winners, LastGroupedGemmPath — is in include/shardline/kernels/grouped_gemm.h.
//
// A shape class (GroupedTuningKey) is what the kernel's speed depends on and a MoE step keeps: the layout, dtypes,
// epilogue, where the sizes live, the group count, the shared dims, and the mean rows per group rounded to a power of
// two — not the per-group sizes, which the routing changes every step. Its first call (outside a graph capture and
// GemmTuningPause) times each candidate — the CUTLASS configs built for its dtype, and the cuBLASLt loop when the sizes
// are on the host — and keeps the fastest; later calls of the class run the winner without timing.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <shardline/core/dtype.h>
#include <shardline/kernels/grouped_gemm.h>

namespace shardline::kernels::detail {

struct GroupedTuningKey {
    int device = 0;
    bool trans_a = false;
    bool trans_b = false;
    GroupedDim grouped_dim = GroupedDim::kN;
    DType a_type = DType::kFloat32;
    DType c_type = DType::kFloat32;
    bool bias = false;
    bool dgelu = false; ///< the kDGelu epilogue (a grouped dgrad through a GELU)
    bool host_sizes = false;
    std::int64_t groups = 0;
    std::int64_t m = 0;
    std::int64_t n = 0;      ///< 0 with kN (the grouped dim)
    std::int64_t k = 0;      ///< 0 with kK
    int mean_rows_class = 0; ///< bit width of total / groups: 0 (< 1 row), 1 (1), 2 (2–3), … 10 (512–1023), …

    bool operator==(const GroupedTuningKey&) const = default;
};

/// The shape class of a problem. beta is not part of it (a wgrad accumulating into a main grad runs the kernel of
/// its overwriting twin), nor are the per-group sizes and the pointers.
GroupedTuningKey MakeGroupedTuningKey(const GroupedGemmParams& params);
/// Readable and distinct per key, e.g.
///     "tn grouped=n groups=64 m=1408 k=2048 rows~512-1023 bfloat16->bfloat16 host-sizes cuda:0".
std::string GroupedTuningKeyString(const GroupedTuningKey& key);

/// A candidate: a CUTLASS config (a GroupedGemmTile other than kAuto, as an int, with kRasterAlongN added when its tile
/// scheduler walks along n) or the loop of cuBLASLt GEMMs.
inline constexpr int kLoopCandidate = 0;
inline constexpr int kRasterAlongN = 16;
/// Candidate ids are below this (one slot each, e.g. for per-candidate repetition counts).
inline constexpr int kCandidateSlots = 2 * kRasterAlongN;
inline constexpr GroupedGemmTile CandidateTile(int candidate) {
    return static_cast<GroupedGemmTile>(candidate % kRasterAlongN);
}
inline constexpr bool CandidateAlongN(int candidate) { return candidate >= kRasterAlongN; }
/// "loop", "cooperative256x128", "cooperative128x128", "pingpong128x128", "pingpong128x64", "cooperative128x256", the
/// CUTLASS ones followed by " along-n" with kRasterAlongN.
std::string GroupedCandidateName(int candidate);

/// Whether this thread may time candidates now: GEMM tuning enabled (SHARDLINE_GEMM_TUNING, and no GemmTuningPause
/// open on this thread: CurrentGemmTuningOptions().enabled) and `capturing` false (no timing inside a graph capture).
bool GroupedTuningAllowed(bool capturing);

/// The cached winner of a shape class, or nothing; `count_hit`: a call served by it (GetGroupedGemmTuningStats().hits).
std::optional<int> FindGroupedWinner(const GroupedTuningKey& key, bool count_hit = true);

/// Times the candidates (each through `time_us`, which returns microseconds per call, or a negative value when the
/// candidate cannot run the problem) in two passes, and caches and returns the fastest that ran — `preferred` (the
/// heuristic's pick) unless another beats it by more than 1 % — or nothing when none ran (nothing is cached then).
/// `candidates` must not be empty; a key already cached is timed again and replaced.
std::optional<int> TuneGroupedGemm(const GroupedTuningKey& key, const std::vector<int>& candidates, int preferred,
                                   const std::function<double(int)>& time_us);

/// Counts a first call of a shape class served by the heuristic because timing was not allowed.
void CountGroupedUntuned();

/// The path of this thread's last CUDA grouped GEMM (LastGroupedGemmPath).
void SetLastGroupedGemmPath(std::string path);

} // namespace shardline::kernels::detail
