// The CUTLASS grouped dgrad with the dGELU epilogue for fp16 operands, cooperative 256x128 (sm_90a): its own
// translation unit, so that the per-config GEMM units do not grow (grouped_cutlass_dgelu.cuh).

#include "grouped_cutlass_dgelu.cuh"

namespace shardline::kernels::cuda::cutlass_grouped::detail {

int RunDGelu_fp16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    return RunDGeluConfig<cutlass::half_t, Config::kCooperative256x128>(args, scratch, scratch_bytes, needed);
}

} // namespace shardline::kernels::cuda::cutlass_grouped::detail
