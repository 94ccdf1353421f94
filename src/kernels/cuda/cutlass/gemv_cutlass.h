#pragma once

// CUTLASS's GEMV (cutlass::gemm::kernel::Gemv, row-major A) for the cuBLASLt provider's matrix-vector products: a
// Linear forward of one token (decode at batch 1), y = W·x (+ b), where cuBLASLt's GEMM kernels stream the weights at
// 1.4–2.8 TB/s on an H100 and this kernel, one warp per row, at 1.7–2.9 (docs/PERFORMANCE.md). Plain C++ like
// grouped_cutlass.h: the .cu that instantiates the kernel includes CUTLASS, the provider includes only this.

#include <cstdint>

#include <cuda_runtime_api.h>

namespace shardline::kernels::cuda::cutlass_gemv {

enum class Element : int { kBFloat16 = 0, kFloat16 = 1 };

/// d = alpha · A·x + beta · c, in fp32, rounded once to the element type. A is rows × cols row-major and packed
/// (leading dimension cols); x has cols elements, c and d rows. A and x 16-byte aligned, cols a multiple of 8, rows ·
/// cols below 2^31 (the kernel's row offsets are int). c is read only when beta != 0 (a bias: beta = 1).
struct Args {
    Element element = Element::kBFloat16;
    std::int64_t rows = 0;
    std::int64_t cols = 0;
    const void* a = nullptr;
    const void* x = nullptr;
    const void* c = nullptr;
    void* d = nullptr;
    float alpha = 1.0f;
    float beta = 0.0f;
    cudaStream_t stream = nullptr;
};

/// Whether this build compiled the kernel (SHARDLINE_HAVE_CUTLASS; sm_90a code, like the grouped GEMM).
bool Built();
/// Null when the kernel can run `args` (the rules above), else which rule it breaks.
const char* Unsupported(const Args& args);
/// Launches the GEMV; cudaErrorNotSupported when not built, cudaErrorInvalidValue when Unsupported(args).
cudaError_t Run(const Args& args);

} // namespace shardline::kernels::cuda::cutlass_gemv
