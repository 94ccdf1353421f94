#pragma once

// GEMM algorithm tuning for the CUDA default provider (cuBLASLt), and the tuning-cache file that lets a process start
// tuned.
//
// The first call of a plan key (see GemmPlanKey) asks cuBLASLt's heuristic for its top-k algorithms (under the
// context's workspace cap, and again under a 1 MiB cap, which ranks other kernels first), times each once on the call's
// own operands (after evicting L2 when they would fit in it) and keeps the fastest (the heuristic's first pick unless
// another beats it by 1 % on two passes). For a BGRADB wgrad (the bias grad fused in the GEMM) it also times the plain GEMM plus the separate
// column sum and keeps whichever is faster: the bias grad is fused only where that measures faster.
//
// The tuning-cache file (JSON, SHARDLINE_GEMM_TUNING_FILE) holds one record per (GPU name, cuBLASLt version, key):
// the winning algorithm (cuBLASLt's opaque algo struct, which may be stored and reused with the same library
// version), the BGRADB decision and the measured times. A key found there builds its plan from the record (checked
// with cublasLtMatmulAlgoCheck) without a heuristic query and without timing; every newly tuned key is merged into the
// file (written to a temporary file, then renamed).
//
// Environment (read once, at the first use; SetGemmTuningOptions replaces it):
//   SHARDLINE_GEMM_TUNING=0|1        time the top-k candidates (default 1)
//   SHARDLINE_GEMM_TUNING_TOP_K=N    candidates asked of the heuristic (default 8, 1..64)
//   SHARDLINE_GEMM_TUNING_FILE=PATH  the tuning-cache file (default: none)

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/core/dtype.h>
#include <shardline/kernels/gemm.h>

namespace shardline::kernels {

struct GemmTuningOptions {
    bool enabled = true; ///< time the heuristic's top_k candidates on a plan's first call
    int top_k = 8;       ///< 1..64
    std::string file = {}; ///< tuning-cache file; empty: none
};

/// The options the environment gives (SHARDLINE_GEMM_TUNING, _TOP_K, _FILE); throws shardline::Error naming the
/// variable on a malformed value.
GemmTuningOptions GemmTuningOptionsFromEnv();
/// The options in force (the environment's until SetGemmTuningOptions).
GemmTuningOptions CurrentGemmTuningOptions();
/// Replaces the options for this process, drops every cached plan (they are rebuilt under the new options) and
/// forgets the loaded tuning-cache file (the new file is read at the next plan build).
void SetGemmTuningOptions(const GemmTuningOptions& options);
/// Drops every cached GEMM plan (tests; a new tuning file). Plans in use by a running call stay valid.
void ClearGemmPlanCache();

/// What the plan cache did since the process started (or ResetGemmPlanStats): tests assert on it.
struct GemmPlanStats {
    std::uint64_t plans_built = 0;       ///< plan-cache misses
    std::uint64_t heuristic_queries = 0; ///< cublasLtMatmulAlgoGetHeuristic calls
    std::uint64_t tuned = 0;             ///< plans whose candidates were timed
    std::uint64_t file_hits = 0;         ///< plans built from a tuning-cache record
    std::uint64_t file_rejected = 0;     ///< records found but refused by cublasLtMatmulAlgoCheck
    std::uint64_t bgradb_fused = 0;      ///< BGRADB plans that keep the fused epilogue
    std::uint64_t bgradb_separate = 0;   ///< BGRADB plans that run the plain GEMM + column sum (measured faster)
};
GemmPlanStats GetGemmPlanStats();
void ResetGemmPlanStats();

/// How a cached plan runs, for benchmarks and tools.
struct GemmPlanInfo {
    std::string key = {};       ///< GemmPlanKeyString
    bool usable = false;        ///< false: the unfused fallback (no cuBLASLt algorithm, or not eligible)
    bool tuned = false;         ///< the algorithm was chosen by timing (or read from the tuning file)
    bool from_file = false;
    int candidates = 0;         ///< algorithms the heuristic returned (and were timed)
    int chosen = 0;             ///< index of the kept one in the heuristic's order (0: its first pick)
    double chosen_us = 0.0;     ///< tuning measurement of the kept algorithm (0 when untuned)
    double first_us = 0.0;      ///< tuning measurement of the heuristic's first pick
    bool bgradb_separate = false;
    double bgradb_fused_us = 0.0;    ///< BGRADB keys: fused GEMM, best algorithm
    double bgradb_separate_us = 0.0; ///< BGRADB keys: plain GEMM + column sum
    bool chosen_small_workspace = false; ///< the kept candidate came from the 1 MiB-workspace heuristic query
};
std::vector<GemmPlanInfo> GemmPlanInfos();

// ---------------------------------------------------------------------------------------------------------------------
// Plan keys and the tuning-cache file (host-only logic, no CUDA needed)

/// Everything a cuBLASLt plan depends on. The device is not part of the file key: records are keyed by GPU name.
struct GemmPlanKey {
    int device = 0;
    bool tf32 = false; ///< fp32 operands on TF32 tensor cores
    bool trans_a = false;
    bool trans_b = false;
    bool has_bias = false;
    GemmEpilogue epilogue = GemmEpilogue::kNone;
    DType a_type = DType::kFloat32;
    DType b_type = DType::kFloat32;
    DType c_type = DType::kFloat32;
    DType bias_type = DType::kFloat32;
    bool beta_zero = true; ///< beta == 0 (C is not read); beta's value is not part of the key
    std::uint16_t align_a = 0;
    std::uint16_t align_b = 0;
    std::uint16_t align_c = 0;
    std::uint16_t align_bias = 0;
    std::uint16_t align_aux = 0;
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;
    std::int64_t lda = 0;
    std::int64_t ldb = 0;
    std::int64_t ldc = 0;
    std::int64_t ldaux = 0;
    std::int64_t batch = 1;
    std::int64_t stride_a = 0;
    std::int64_t stride_b = 0;
    std::int64_t stride_c = 0;
    /// cuBLASLt workspace bytes the plan may use (the context's, or a caller's override). Not in the key string: a
    /// tuning-file record is checked against the workspace at hand instead.
    std::uint64_t workspace = 0;

    bool operator==(const GemmPlanKey&) const = default;
};
struct GemmPlanKeyHash {
    std::size_t operator()(const GemmPlanKey& key) const noexcept;
};

/// The largest power of two ≤ 256 dividing the address (and, when batched, the batch stride in bytes). cuBLASLt
/// excludes algorithms that need more alignment than a preference allows (some Hopper kernels want more than 16
/// bytes), so the class is passed as the preference and is part of the key.
inline constexpr std::uint16_t kMaxAlignmentClass = 256;
std::uint16_t GemmAlignmentClass(const void* ptr, std::int64_t batch, std::int64_t stride_elems, DType dtype);
/// The key of a problem (`tf32`: whether the device's context allows TF32 for fp32 operands; `workspace`: the
/// cuBLASLt workspace bytes at hand).
GemmPlanKey MakeGemmPlanKey(const GemmParams& params, bool tf32, std::uint64_t workspace = 0);
/// A stable, readable text form of the key without the device index, e.g.
/// "tn m=4096 n=8192 k=4096 ld=4096,4096,4096 bf16,bf16->bf16 compute=fp32 epilogue=bias(bf16) beta=0
///  align=256,256,256,256,0 batch=1". Distinct keys (devices aside) give distinct strings.
std::string GemmPlanKeyString(const GemmPlanKey& key);

/// One record of the tuning-cache file.
struct GemmTuningRecord {
    std::string gpu;               ///< cudaDeviceProp::name
    std::int64_t cublaslt_version = 0; ///< cublasLtGetVersion()
    std::string key;               ///< GemmPlanKeyString
    std::array<std::uint64_t, 8> algo{}; ///< cublasLtMatmulAlgo_t, stored as is
    int candidates = 0;
    int chosen = 0;
    double chosen_us = 0.0;
    double first_us = 0.0;
    bool bgradb_separate = false;
    double bgradb_fused_us = 0.0;
    double bgradb_separate_us = 0.0;

    bool operator==(const GemmTuningRecord&) const = default;
};

/// The records of a tuning-cache file, one per (gpu, cublaslt_version, key).
class GemmTuningTable {
public:
    /// Parses the file's JSON text; throws shardline::Error naming `source` (and the record) when malformed.
    static GemmTuningTable Parse(std::string_view text, std::string_view source = "tuning file");
    /// Reads a file; a missing file is an empty table, an unreadable or malformed one throws.
    static GemmTuningTable Load(const std::string& path);

    std::string ToJson() const;
    /// Writes the table (with the records already in the file at `path` merged in, ours winning) to a temporary file
    /// beside it and renames it over `path`, so a reader never sees half a file.
    void Save(const std::string& path) const;

    const GemmTuningRecord* Find(std::string_view gpu, std::int64_t cublaslt_version, std::string_view key) const;
    /// Adds or replaces the record with the same (gpu, cublaslt_version, key).
    void Upsert(const GemmTuningRecord& record);
    const std::vector<GemmTuningRecord>& records() const { return records_; }
    std::size_t size() const { return records_.size(); }

private:
    std::vector<GemmTuningRecord> records_;
};

inline constexpr std::string_view kGemmTuningFormat = "shardline-gemm-tuning";
inline constexpr int kGemmTuningFormatVersion = 1;

} // namespace shardline::kernels
