#pragma once

// The GEMM whose inner dimension is 1 (a rank-1 update, D = alpha·a·bᵀ + beta·C), as one plain kernel launch: the
// default provider's Gemm runs it instead of a cuBLASLt plan (gemm_cublaslt.cc). Its use is the wgrad GEMM of one
// token (dW = dyᵀ·x with k = M = 1) and the Outer op. The product is a streaming write of D, which cuBLASLt's k = 1
// kernels took longer to do on every shape measured, and cuBLASLt's call costs the host 2.5–4.7 µs more than a plain
// launch, which paces a one-token step (docs/PERFORMANCE.md, "Host cost, round 6"). BGRADB rides in the same launch
// (the bias grad at k = 1 is op(B) itself). torch computes an outer product the same way, with its elementwise kernel,
// not a GEMM. Declarations only: host code includes this without nvcc.

#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// D = alpha·a·bᵀ + beta·D for column-major m×n D (element (i, j) at d[i + j·ldd]): a has m elements inc_a apart, b
/// n elements inc_b apart, both of dtype ab (float32, float16 or bfloat16); D of dtype d_type. fp32 math,
/// alpha·(a_i·b_j) + beta·D, rounded once to D's dtype (cuBLASLt in place into a half D with beta != 0 rounds the
/// product before adding: gemm.h). beta == 0 reads no D. When bias is not null, also bias[j] = b_j (BGRADB's
/// Σ_k op(B)[k, j] at k = 1, not scaled by alpha, in bias_type). m, n > 0: the launcher does nothing otherwise.
struct RankOneArgs {
    const void *a = nullptr;
    std::int64_t inc_a = 1;
    const void *b = nullptr;
    std::int64_t inc_b = 1;
    DType ab_type = DType::kFloat32;
    void *d = nullptr;
    std::int64_t ldd = 0;
    DType d_type = DType::kFloat32;
    std::int64_t m = 0;
    std::int64_t n = 0;
    float alpha = 1.0f;
    float beta = 0.0f;
    void *bias = nullptr;
    DType bias_type = DType::kFloat32;
};

cudaError_t LaunchRankOne(const RankOneArgs &args, cudaStream_t stream);

} // namespace shardline::kernels::cuda
