// CUTLASS's row-major GEMV for bf16 and fp16 (sm_90a object, with the grouped GEMM's units): one warp per row of A
// (kThreadsPerRow 32), eight rows per block, 16-byte loads, fp32 accumulation, the warp's partial sums reduced by
// shuffles and the epilogue alpha·acc + beta·c in fp32. The configuration is the fastest of eight timed on an H100 at
// the Llama decode shapes (8–32 threads per row, 64–512 threads per block; docs/PERFORMANCE.md): fewer threads per row
// keep too few loads in flight at K ≤ 8192.

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemv.h>
#include <cutlass/gemm/kernel/gemv.h>
#include <cutlass/numeric_types.h>

#include "gemv_cutlass.h"

namespace shardline::kernels::cuda::cutlass_gemv::detail {
namespace {

constexpr int kElementsPerAccess = 8; // 16 bytes of bf16/fp16
constexpr int kThreadCount = 256;
constexpr int kThreadsPerRow = 32;

template <class T> cudaError_t RunT(const Args &args) {
    using Epilogue = cutlass::epilogue::thread::LinearCombination<T, 1, float, float>;
    using Kernel = cutlass::gemm::kernel::Gemv<T, cutlass::layout::RowMajor, T, T, float, Epilogue, kElementsPerAccess,
                                               kThreadCount, kThreadsPerRow>;
    using Device = cutlass::gemm::device::Gemv<Kernel>;
    const int rows = static_cast<int>(args.rows);
    const int cols = static_cast<int>(args.cols);
    typename Device::Arguments arguments(cutlass::MatrixCoord(rows, cols), {args.alpha, args.beta},
                                         {static_cast<T *>(const_cast<void *>(args.a)), cols}, args.x, args.c, args.d);
    if (Device::can_implement(arguments) != cutlass::Status::kSuccess) {
        return cudaErrorInvalidValue;
    }
    // Launched here rather than through Device::run, which calls cudaGetLastError itself and returns only a status.
    // (The kernel's Params are its Arguments.)
    const dim3 block = Device::get_block_shape();
    const dim3 grid = Device::get_grid_shape(arguments, block);
    cutlass::Kernel<Kernel><<<grid, block, 0, args.stream>>>(arguments);
    return cudaGetLastError();
}

} // namespace

cudaError_t RunBFloat16(const Args &args) { return RunT<cutlass::bfloat16_t>(args); }
cudaError_t RunFloat16(const Args &args) { return RunT<cutlass::half_t>(args); }

} // namespace shardline::kernels::cuda::cutlass_gemv::detail
