// The CUTLASS grouped GEMM kernels for bf16 operands with the pingpong128x64 config (sm_90a): one translation unit
// per (type, config) so that a 2-core build compiles them in parallel and none takes more than a few minutes.

#include "grouped_cutlass.cuh"

namespace shardline::kernels::cuda::cutlass_grouped::detail {

int Run_bf16_pingpong128x64(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    return RunConfig<cutlass::bfloat16_t, Config::kPingpong128x64>(args, scratch, scratch_bytes, needed);
}

} // namespace shardline::kernels::cuda::cutlass_grouped::detail
