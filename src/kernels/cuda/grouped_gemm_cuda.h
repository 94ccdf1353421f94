#pragma once

// Private to src/kernels/cuda: the CUDA GroupedGemm provider's (grouped_gemm.cc) pieces that GroupedLinearBackward's
// concurrent path (grouped_linear_backward.cc) needs to run a grouped GEMM on the side stream.

#include <cstddef>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include <shardline/core/tensor.h>
#include <shardline/kernels/grouped_gemm.h>

#include "cutlass/grouped_cutlass.h"

namespace shardline::kernels::cuda {

/// A CUTLASS grouped GEMM made ready on the compute stream (host sizes checked and uploaded, the scratch allocated from
/// the stream-ordered pool), to be enqueued on a stream that is ordered after that point. The tensors must outlive
/// the enqueued work: keep this until that stream has been joined back into the compute stream (their frees are
/// queued on it).
struct PreparedGroupedGemm {
    GroupedGemmParams params{};
    cutlass_grouped::Args args{};
    Tensor sizes{};   ///< the group sizes on the device
    Tensor scratch{}; ///< the per-group arrays and CUTLASS's workspace
    std::size_t bytes = 0;
    std::string path{}; ///< what runs, in GroupedGemmPath's words
};

/// Whether the default provider's GroupedGemm would time candidates for `p` if called now (an untuned shape class of
/// the auto choice where timing is allowed): the timing synchronises and must not share the device with other work.
bool GroupedGemmWouldTune(const GroupedGemmParams& p);

/// `p` made ready for the CUTLASS kernel that the default provider would run for it now, or nothing when that is not
/// the CUTLASS kernel (the loop, ineligible, host sizes under a capture) or when the call would first tune.
std::optional<PreparedGroupedGemm> PrepareCutlassGroupedGemm(const GroupedGemmParams& p);

/// Enqueues the prepared GEMM (and a forward's bias add) on `stream`; false when CUTLASS's can_implement refused the
/// arguments (only the setup kernel ran: run the problem through GroupedGemm instead). Throws on a launch failure.
bool LaunchPreparedGroupedGemm(const PreparedGroupedGemm& call, cudaStream_t stream);

} // namespace shardline::kernels::cuda
