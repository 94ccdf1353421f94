#pragma once

#include <cstdint>
#include <string_view>

#include <shardline/core/device.h>
#include <shardline/core/dtype.h>

namespace shardline::kernels {

/// What the GEMM does after the product. GELU here is the tanh approximation (cuBLASLt's).
enum class GemmEpilogue : std::uint8_t {
    kNone,
    kBias,        ///< D += bias[i] per row i of D (bias has m entries)
    kGeluAuxBias, ///< aux = D + bias[i] (no bias: aux = D); D = gelu_tanh(aux)
    kBGradB,      ///< also bias[j] = Σ_k op(B)[k, j] (n entries): the bias grad of a wgrad GEMM
    kDGeluBGrad,  ///< D = D ⊙ gelu_tanh'(aux); bias[i] = Σ_j D[i, j] (m entries)
    kDGelu,       ///< D = D ⊙ gelu_tanh'(aux) (no bias grad: kDGeluBGrad's when the bias grad must accumulate)
};
std::string_view GemmEpilogueName(GemmEpilogue epilogue);
/// Whether the epilogue reads or writes the aux matrix (the GELU pre-activation): kGeluAuxBias, kDGeluBGrad, kDGelu.
bool GemmEpilogueHasAux(GemmEpilogue epilogue);

/// Accumulation: fp32 for fp32/fp16/bf16 inputs (TF32 tensor cores for fp32 only when the context allows it),
/// fp64 for fp64.
enum class GemmCompute : std::uint8_t { kDefault, kFloat32, kFloat64 };

/// A pure description of one (strided-batched) GEMM in cuBLAS's column-major convention:
///     D[b] = alpha · op(A[b]) · op(B[b]) + beta · C[b],   op(A) m×k, op(B) k×n, C and D m×n,
/// where X[b] = X + b · stride_x (elements). A stride of 0 broadcasts that operand over the batch. D is `c` (ldc,
/// stride_c). C is D itself (D written over C, the default) or, with `c_in`, a separate matrix that is only read:
/// D = alpha·op(A)·op(B) + bias + beta·C_in, e.g. a residual connection's x added by the GEMM that makes the block's
/// output (beta = 1). A separate C takes the epilogues none and bias only, never overlaps D (the same pointer with the
/// same layout means in place) and has D's dtype; where the bias and C are added in one pass, the order of the two
/// roundings is the provider's (the CPU adds C last, cuBLASLt in its epilogue).
/// Precision with beta != 0 into a float16/bfloat16 D: with a separate C, the fp32 sum of C and the product is rounded
/// once. Written over C (in place), cuBLASLt rounds the product to D's dtype before adding C on the shapes measured
/// (tests/cuda/kernels_gemm_accumulate_precision_test.cc): the precision of an unfused GEMM + Add, not of a fused one.
/// A k = 1 problem on CUDA's default provider (the rank-1 kernel, docs/kernels.md) rounds once.
/// Accumulate into an fp32 D (a main grad) where that matters; the CPU provider rounds once either way.
/// Row-major callers derive the operands in a comment at every call site (a row-major R×C matrix is a
/// column-major C×R matrix with the same leading dimension).
struct GemmParams {
    bool trans_a = false;
    bool trans_b = false;
    std::int64_t m = 0;
    std::int64_t n = 0;
    std::int64_t k = 0;

    const void* a = nullptr;
    std::int64_t lda = 0;
    DType a_type = DType::kFloat32;
    const void* b = nullptr;
    std::int64_t ldb = 0;
    DType b_type = DType::kFloat32;
    void* c = nullptr; ///< D (written), and C unless c_in is given
    std::int64_t ldc = 0;
    DType c_type = DType::kFloat32; ///< D's and C's
    /// A separate C (read when beta != 0; null: C is D): m×n column-major with leading dimension ldc_in, batch stride
    /// stride_c_in.
    const void* c_in = nullptr;
    std::int64_t ldc_in = 0;

    std::int64_t batch_count = 1;
    std::int64_t stride_a = 0;
    std::int64_t stride_b = 0;
    std::int64_t stride_c = 0;
    std::int64_t stride_c_in = 0;

    double alpha = 1.0;
    double beta = 0.0;
    GemmCompute compute = GemmCompute::kDefault;

    GemmEpilogue epilogue = GemmEpilogue::kNone;
    void* bias = nullptr; ///< read (kBias, kGeluAuxBias) or written (kBGradB, kDGeluBGrad); unused by kDGelu
    DType bias_type = DType::kFloat32;
    void* aux = nullptr; ///< GELU pre-activation, m×n column-major with leading dimension ldaux
    std::int64_t ldaux = 0;

    Device device;
};

/// Whether the problem reads a C apart from D: c_in given, beta != 0, and c_in not D itself (the same pointer).
bool GemmHasSeparateC(const GemmParams& params);

/// Whether the problem's epilogue reads or writes its bias vector: kBias, kBGradB, kDGeluBGrad, and kGeluAuxBias with
/// a bias (a stray bias pointer of another epilogue is ignored).
bool GemmUsesBias(const GemmParams& params);

struct GemmOp {
    static constexpr std::string_view kName = "Gemm";
    using Fn = void (*)(const GemmParams&);
};

/// Runs a GEMM through the dispatcher. Called inside another op's kernel, it inherits that op's provider, so a
/// provider that supplies Gemm serves the Linear/Matmul/Outer compositions too.
void Gemm(const GemmParams& params);

/// Checks the description (sizes, leading dims, pointers, epilogue operands); throws ShapeError naming `op`.
void ValidateGemmParams(const GemmParams& params, std::string_view op);

} // namespace shardline::kernels
