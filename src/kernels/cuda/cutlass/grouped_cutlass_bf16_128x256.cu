// The CUTLASS grouped GEMM kernels for bf16 operands with the 128x256 tile (sm_90a): one translation unit per (type,
// tile) so that a 2-core build compiles them in parallel and none takes more than a few minutes.

#include "grouped_cutlass.cuh"

namespace shardline::kernels::cuda::cutlass_grouped::detail {

int Run_bf16_128x256(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    return RunConfig<cutlass::bfloat16_t, Config::kCooperative128x256>(args, scratch, scratch_bytes, needed);
}

} // namespace shardline::kernels::cuda::cutlass_grouped::detail
