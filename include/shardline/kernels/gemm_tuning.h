#pragma once

// GEMM algorithm tuning for the CUDA default provider (cuBLASLt), and the tuning-cache file that lets a process start
// tuned.
//
// The first call of a plan key (the problem's shape, dtypes, layouts, epilogue, alignment and batch) asks cuBLASLt's
// heuristic for its top-k algorithms (under the context's workspace cap, and again under a 1 MiB cap, which ranks other
// kernels first), times each once on the call's own operands (after evicting L2 when they would fit in it) and keeps
// the fastest (the heuristic's first pick unless another beats it by 1 % on two passes). For a measured epilogue it
// also times the same work run apart and keeps whichever is faster, so an epilogue is fused only where that measures
// faster:
//   BGRADB (a wgrad with the bias grad)          vs the plain GEMM + the column sum of dY
//   GELU_AUX(_BIAS) (GEMM + bias + GELU)          vs the bias GEMM into the pre-activation + a GELU kernel
//   DGELU (a dgrad times gelu'(pre-activation))   vs the plain GEMM + a GELU-grad kernel
//   DGELU_BGRAD (DGELU + the previous bias grad)  vs the DGELU GEMM (itself measured) + the column sum of D
// (beta = 0 only: timing repeats the call; a bias epilogue costs the GEMM nothing and is always fused).
//
// The tuning-cache file (JSON, SHARDLINE_GEMM_TUNING_FILE) holds one record per (GPU name, cuBLASLt version, key):
// the winning algorithm (cuBLASLt's opaque algo struct, which may be stored and reused with the same library
// version), the epilogue decision and the measured times. A key found there builds its plan from the record (checked
// by cuBLASLt's algorithm check) without a heuristic query and without timing; every newly tuned key is merged into
// the file (written to a temporary file, then renamed).
//
// A matrix-vector product (a Linear forward of one token, the decode step at batch 1: n = 1, A transposed and packed,
// bf16/fp16, beta 0, no epilogue or a bias) may run CUTLASS's GEMV instead of cuBLASLt (GemmGemv below): tuning times
// it against the cuBLASLt algorithm it kept, cold, and keeps the faster by the same margin.
//
// Environment (read once, at the first use; SetGemmTuningOptions replaces it):
//   SHARDLINE_GEMM_TUNING=0|1        time the top-k candidates (default 1)
//   SHARDLINE_GEMM_TUNING_TOP_K=N    candidates asked of the heuristic (default 8, 1..64)
//   SHARDLINE_GEMM_TUNING_FILE=PATH  the tuning-cache file (default: none)
//   SHARDLINE_GEMM_GEMV=auto|off|always  CUTLASS's GEMV for matrix-vector products (default auto)

#include <cstdint>
#include <string>
#include <vector>

namespace shardline::kernels {

/// Where a matrix-vector product runs. Eligible: n = 1 and one batch, op(A) = Aᵀ with lda = k (a row-major weight),
/// B not transposed, A, B and D of one dtype, bf16 or fp16, alpha any, beta 0, epilogue none or bias (in D's dtype), k
/// a multiple of 8, A and B 16-byte aligned, m·k < 2^31, an sm_90 device and a build with CUTLASS.
enum class GemmGemv : std::uint8_t {
    kAuto,   ///< tuning times the GEMV against the cuBLASLt algorithm it kept and runs the faster; untuned plans:
             ///< cuBLASLt
    kOff,    ///< cuBLASLt only
    kAlways, ///< every eligible plan runs the GEMV, tuned or not (still timed when tuning, for GemmPlanInfo)
};

struct GemmTuningOptions {
    bool enabled = true;             ///< time the heuristic's top_k candidates on a plan's first call
    int top_k = 8;                   ///< 1..64
    std::string file = {};           ///< tuning-cache file; empty: none
    GemmGemv gemv = GemmGemv::kAuto; ///< matrix-vector products: CUTLASS's GEMV or cuBLASLt
};

/// The options the environment gives (SHARDLINE_GEMM_TUNING, _TOP_K, _FILE, SHARDLINE_GEMM_GEMV); throws
/// shardline::Error naming the variable on a malformed value.
GemmTuningOptions GemmTuningOptionsFromEnv();
/// The options in force (the environment's until SetGemmTuningOptions).
GemmTuningOptions CurrentGemmTuningOptions();
/// Within its scope this thread builds new GEMM plans from cuBLASLt's heuristic alone, without timing candidates
/// (CurrentGemmTuningOptions().enabled reads false): for GEMMs whose shapes change from call to call — the grouped
/// GEMM's loop over experts, whose rows follow the routing — where timing every new shape would cost milliseconds
/// each step. Nests. Plans already built keep what they were built with. Such plans are also cheap to build: the
/// heuristic is asked once per shape class (m, n and k each rounded up to a quarter of their power of two) and its
/// algorithm reused, after cuBLASLt's check, by every other shape of the class; and they are kept in a bounded cache
/// of their own, so that a long MoE run does not grow the plan cache with every routing.
class GemmTuningPause {
public:
    GemmTuningPause();
    ~GemmTuningPause();
    GemmTuningPause(const GemmTuningPause&) = delete;
    GemmTuningPause& operator=(const GemmTuningPause&) = delete;
};
/// Replaces the options for this process, drops every cached plan (they are rebuilt under the new options) and
/// forgets the loaded tuning-cache file (the new file is read at the next plan build).
void SetGemmTuningOptions(const GemmTuningOptions& options);
/// Drops every cached GEMM plan (tests; a new tuning file). Plans in use by a running call stay valid.
void ClearGemmPlanCache();

/// What the plan cache did since the process started (or ResetGemmPlanStats): tests assert on it.
struct GemmPlanStats {
    std::uint64_t plans_built = 0;       ///< plan-cache misses
    std::uint64_t heuristic_queries = 0; ///< cuBLASLt heuristic queries
    std::uint64_t tuned = 0;             ///< plans whose candidates were timed
    std::uint64_t file_hits = 0;         ///< plans built from a tuning-cache record
    std::uint64_t file_rejected = 0;     ///< records found but refused by cuBLASLt's algorithm check
    std::uint64_t epilogue_fused = 0;    ///< measured-epilogue plans that keep the fused epilogue
    std::uint64_t epilogue_separate = 0; ///< measured-epilogue plans that run it apart (measured faster)
    std::uint64_t algo_reused = 0;       ///< plans under a GemmTuningPause that took the algorithm of a similar shape
    std::uint64_t gemv = 0;     ///< plan builds that chose CUTLASS's GEMV (one built inside a capture: when tuned)
    std::uint64_t rank_one = 0; ///< calls (not plans) run as the rank-1 kernel: k = 1, no cuBLASLt plan (CUDA)
};
GemmPlanStats GetGemmPlanStats();
void ResetGemmPlanStats();

/// How a cached plan runs, for benchmarks and tools.
struct GemmPlanInfo {
    std::string key = {}; ///< the plan key's text, e.g. "tn m=4096 n=8192 k=4096 ... batch=1"
    bool usable = false;  ///< false: the unfused fallback (no cuBLASLt algorithm, or not eligible)
    bool tuned = false;   ///< the algorithm was chosen by timing (or read from the tuning file)
    bool from_file = false;
    int candidates = 0;                  ///< algorithms the heuristic returned (and were timed)
    int chosen = 0;                      ///< index of the kept one in the heuristic's order (0: its first pick)
    double chosen_us = 0.0;              ///< tuning measurement of the kept algorithm (0 when untuned)
    double first_us = 0.0;               ///< tuning measurement of the heuristic's first pick
    bool epilogue_separate = false;      ///< a measured epilogue runs apart (measured faster)
    double epilogue_fused_us = 0.0;      ///< measured epilogues: the fused GEMM, best algorithm (0: not measured)
    double epilogue_separate_us = 0.0;   ///< measured epilogues: the apart GEMM + its kernels
    bool chosen_small_workspace = false; ///< the kept candidate came from the 1 MiB-workspace heuristic query
    bool gemv = false;                   ///< runs CUTLASS's GEMV (GemmGemv) instead of the cuBLASLt algorithm
    double gemv_us = 0.0; ///< tuning measurement of the GEMV, cold like chosen_us (0: not eligible or not timed)
    double gemv_cublaslt_us = 0.0; ///< the kept cuBLASLt algorithm in the same passes: what gemv_us was compared with
};
std::vector<GemmPlanInfo> GemmPlanInfos();

} // namespace shardline::kernels
