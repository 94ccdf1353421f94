#pragma once

// Private to src/kernels: what the cuBLASLt provider needs from the tuning module (options, counters, the loaded
// tuning-cache file), and what the tuning module needs from the provider (its plan cache).

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <shardline/config.h>

#include "gemm_tuning.h"

namespace shardline::kernels::detail {

struct GemmStatCounters {
    std::atomic<std::uint64_t> plans_built{0};
    std::atomic<std::uint64_t> heuristic_queries{0};
    std::atomic<std::uint64_t> tuned{0};
    std::atomic<std::uint64_t> file_hits{0};
    std::atomic<std::uint64_t> file_rejected{0};
    std::atomic<std::uint64_t> epilogue_fused{0};
    std::atomic<std::uint64_t> epilogue_separate{0};
    std::atomic<std::uint64_t> algo_reused{0};
    std::atomic<std::uint64_t> gemv{0};
    std::atomic<std::uint64_t> rank_one{0};
};
GemmStatCounters& GemmCounters();

/// Whether a GemmTuningPause is open on this thread: the shapes of these calls change from call to call, so the
/// cuBLASLt provider keeps their plans apart (gemm_lt_plan.cc, TransientPlan).
bool GemmTuningPaused();

/// The record for (gpu, version, key) in the tuning-cache file in force, if one is configured and has it. The file is
/// read once (at the first lookup after the options changed).
std::optional<GemmTuningRecord> FindTuningRecord(const std::string& gpu, std::int64_t cublaslt_version,
                                                 const std::string& key);
/// Adds a newly tuned record to the file in force (merged and written at once); nothing when no file is configured.
/// Write failures are logged once, never thrown: tuning still applies to this process.
void StoreTuningRecord(const GemmTuningRecord& record);

} // namespace shardline::kernels::detail

#if SHARDLINE_HAVE_CUDA
namespace shardline::kernels::cuda {
/// gemm_lt_plan.cc: the plan cache behind ClearGemmPlanCache / GemmPlanInfos.
void ClearPlanCache();
std::vector<GemmPlanInfo> PlanInfos();
} // namespace shardline::kernels::cuda
#endif
