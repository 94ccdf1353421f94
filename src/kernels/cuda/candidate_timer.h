#pragma once

// Timing tuning candidates with CUDA events on one stream: the cuBLASLt plans' algorithms (gemm_lt_tuning.cc) and the
// grouped GEMM's CUTLASS configs and loop (grouped_gemm.cc). Never inside a graph capture (the callers check).

#include <algorithm>
#include <cstddef>

#include <cuda_runtime_api.h>

#include <shardline/core/error.h>

namespace shardline::kernels::cuda {

// Each candidate runs once to warm up, then reps times between two events; reps targets ~kTuningBudgetUs per
// candidate and pass, within [kMinReps, kMaxReps].
inline constexpr double kTuningBudgetUs = 1000.0;
inline constexpr int kMinReps = 2;
inline constexpr int kMaxReps = 20;

/// Times launches of tuning candidates on one stream. Warm: `reps` launches back to back between two events (the
/// operands stay in L2 when they fit, as they do when a large GEMM repeats). Cold (a flush buffer given, for problems
/// whose operands fit in L2): before each launch a write of twice the L2 size evicts them, and only the launch is
/// timed, as a decode step meets its weights coming from device memory.
class CandidateTimer {
public:
    CandidateTimer(cudaStream_t stream, void *flush, std::size_t flush_bytes)
        : stream_(stream), flush_(flush), flush_bytes_(flush_bytes) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&start_));
        if (cudaEventCreate(&stop_) != cudaSuccess) {
            cudaEventDestroy(start_);
            SHARDLINE_THROW(CudaError, "CandidateTimer", "cudaEventCreate failed while tuning");
        }
    }
    ~CandidateTimer() {
        cudaEventDestroy(start_);
        cudaEventDestroy(stop_);
    }
    CandidateTimer(const CandidateTimer &) = delete;
    CandidateTimer &operator=(const CandidateTimer &) = delete;

    /// Mean µs of `reps` runs of launch(); a negative value when launch() reported a failure.
    template <class F> double Time(int reps, F &&launch) {
        if (flush_ == nullptr) {
            SHARDLINE_CHECK_CUDA(cudaEventRecord(start_, stream_));
            bool ok = true;
            for (int r = 0; r < reps && ok; ++r) {
                ok = launch();
            }
            return Stop(ok) / reps;
        }
        double total = 0.0;
        for (int r = 0; r < reps; ++r) {
            SHARDLINE_CHECK_CUDA(cudaMemsetAsync(flush_, r & 0xff, flush_bytes_, stream_));
            SHARDLINE_CHECK_CUDA(cudaEventRecord(start_, stream_));
            const double us = Stop(launch());
            if (us < 0.0) {
                return -1.0;
            }
            total += us;
        }
        return total / reps;
    }

private:
    double Stop(bool ok) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(stop_, stream_));
        SHARDLINE_CHECK_CUDA(cudaEventSynchronize(stop_));
        if (!ok) {
            return -1.0;
        }
        float ms = 0.0f;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
        return 1000.0 * static_cast<double>(ms);
    }

    cudaStream_t stream_ = nullptr;
    void *flush_ = nullptr;
    std::size_t flush_bytes_ = 0;
    cudaEvent_t start_ = nullptr;
    cudaEvent_t stop_ = nullptr;
};

/// The reps that fill about kTuningBudgetUs given one run's µs.
inline int RepsFor(double single_us) {
    if (single_us <= 0.0) {
        return kMaxReps;
    }
    return std::clamp(static_cast<int>(kTuningBudgetUs / single_us), kMinReps, kMaxReps);
}

} // namespace shardline::kernels::cuda
