#pragma once

// Private to the library (src/kernels) and its tests: the GEMM plan key and the tuning-cache file's records and table
// (host-only logic, no CUDA needed). The options, counters and plan descriptions a program uses are public, in
// include/shardline/kernels/gemm_tuning.h, which also describes the tuning and the file.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/core/dtype.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/gemm_tuning.h>

namespace shardline::kernels {

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
    bool beta_zero = true;   ///< beta == 0 (C is not read); beta's value is not part of the key
    bool separate_c = false; ///< C apart from D (GemmHasSeparateC): its own layout and alignment below
    std::uint16_t align_a = 0;
    std::uint16_t align_b = 0;
    std::uint16_t align_c = 0;
    std::uint16_t align_bias = 0;
    std::uint16_t align_aux = 0;
    std::uint16_t align_c_in = 0; ///< separate_c only
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;
    std::int64_t lda = 0;
    std::int64_t ldb = 0;
    std::int64_t ldc = 0;
    std::int64_t ldaux = 0;
    std::int64_t ldc_in = 0; ///< separate_c only
    std::int64_t batch = 1;
    std::int64_t stride_a = 0;
    std::int64_t stride_b = 0;
    std::int64_t stride_c = 0;
    std::int64_t stride_c_in = 0; ///< separate_c and batched only
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
    std::string gpu;                     ///< cudaDeviceProp::name
    std::int64_t cublaslt_version = 0;   ///< cublasLtGetVersion()
    std::string key;                     ///< GemmPlanKeyString
    std::array<std::uint64_t, 8> algo{}; ///< cublasLtMatmulAlgo_t, stored as is
    int candidates = 0;
    int chosen = 0;
    double chosen_us = 0.0;
    double first_us = 0.0;
    bool epilogue_separate = false; ///< a measured epilogue runs apart (gemm_tuning.h)
    double epilogue_fused_us = 0.0;
    double epilogue_separate_us = 0.0;
    bool gemv = false;             ///< CUTLASS's GEMV measured faster than cuBLASLt (GemmGemv::kAuto then runs it)
    double gemv_us = 0.0;          ///< its measured time (0: not timed)
    double gemv_cublaslt_us = 0.0; ///< the cuBLASLt algorithm's, in the same interleaved passes

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
