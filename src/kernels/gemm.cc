#include <algorithm>
#include <cstdint>
#include <utility>

#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>

namespace shardline::kernels {

std::string_view GemmEpilogueName(GemmEpilogue epilogue) {
    switch (epilogue) {
    case GemmEpilogue::kNone:
        return "none";
    case GemmEpilogue::kBias:
        return "bias";
    case GemmEpilogue::kGeluAuxBias:
        return "gelu_aux_bias";
    case GemmEpilogue::kBGradB:
        return "bgradb";
    case GemmEpilogue::kDGeluBGrad:
        return "dgelu_bgrad";
    case GemmEpilogue::kDGelu:
        return "dgelu";
    }
    return "unknown";
}

bool GemmUsesBias(const GemmParams& p) {
    switch (p.epilogue) {
    case GemmEpilogue::kBias:
    case GemmEpilogue::kBGradB:
    case GemmEpilogue::kDGeluBGrad:
        return true;
    case GemmEpilogue::kGeluAuxBias:
        return p.bias != nullptr;
    case GemmEpilogue::kNone:
    case GemmEpilogue::kDGelu:
        break;
    }
    return false;
}

bool GemmHasSeparateC(const GemmParams& p) { return p.c_in != nullptr && p.beta != 0.0 && p.c_in != p.c; }

namespace {

/// A separate C (c_in): epilogue none or bias, a leading dim >= m, and no byte of it inside D's span unless it is D
/// itself (same pointer and layout: in place). Spans are [first, last] bytes of the column-major, strided-batched
/// matrices; disjoint spans cannot alias.
void ValidateSeparateC(const GemmParams& p, std::string_view op) {
    if (p.c_in == nullptr || p.beta == 0.0) {
        return;
    }
    if (p.c_in == p.c) {
        SHARDLINE_CHECK_AS(ShapeError, p.ldc_in == p.ldc && (p.batch_count == 1 || p.stride_c_in == p.stride_c), op,
                           "c_in is D's pointer but not its layout (ldc_in {} vs ldc {}, stride_c_in {} vs stride_c "
                           "{}): C would alias D partially",
                           p.ldc_in, p.ldc, p.stride_c_in, p.stride_c);
        return;
    }
    SHARDLINE_CHECK(p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kBias, op,
                    "a separate C (c_in) takes epilogue none or bias, got {}", GemmEpilogueName(p.epilogue));
    SHARDLINE_CHECK_AS(ShapeError, p.ldc_in >= std::max<std::int64_t>(1, p.m), op, "ldc_in {} must be >= m {}",
                       p.ldc_in, p.m);
    if (p.m == 0 || p.n == 0) {
        return;
    }
    const auto span = [&](const void* base, std::int64_t ld, std::int64_t stride) {
        const std::int64_t last_elem = (p.n - 1) * ld + (p.m - 1) + (p.batch_count - 1) * stride;
        const auto first = reinterpret_cast<std::uintptr_t>(base);
        return std::pair{first, first + static_cast<std::uintptr_t>(last_elem + 1) * ElementSize(p.c_type) - 1};
    };
    const auto [c_first, c_last] = span(p.c_in, p.ldc_in, p.stride_c_in);
    const auto [d_first, d_last] = span(p.c, p.ldc, p.stride_c);
    SHARDLINE_CHECK_AS(ShapeError, c_last < d_first || d_last < c_first, op,
                       "the separate C (c_in, bytes [{:#x}, {:#x}]) overlaps D (bytes [{:#x}, {:#x}]): C must be D "
                       "itself or apart from it (m={} n={} ldc_in={} ldc={})",
                       c_first, c_last, d_first, d_last, p.m, p.n, p.ldc_in, p.ldc);
}

} // namespace

bool GemmEpilogueHasAux(GemmEpilogue epilogue) {
    return epilogue == GemmEpilogue::kGeluAuxBias || epilogue == GemmEpilogue::kDGeluBGrad ||
           epilogue == GemmEpilogue::kDGelu;
}

void ValidateGemmParams(const GemmParams& p, std::string_view op) {
    SHARDLINE_CHECK_AS(ShapeError, p.m >= 0 && p.n >= 0 && p.k >= 0 && p.batch_count >= 1, op,
                       "GEMM sizes must be m, n, k >= 0 and batch >= 1, got m={} n={} k={} batch={}", p.m, p.n, p.k,
                       p.batch_count);
    const std::int64_t a_rows = p.trans_a ? p.k : p.m; // column-major rows of A as stored
    const std::int64_t b_rows = p.trans_b ? p.n : p.k;
    SHARDLINE_CHECK_AS(ShapeError, p.lda >= std::max<std::int64_t>(1, a_rows), op,
                       "lda {} must be >= {} (rows of A as stored, trans_a={})", p.lda,
                       std::max<std::int64_t>(1, a_rows), p.trans_a);
    SHARDLINE_CHECK_AS(ShapeError, p.ldb >= std::max<std::int64_t>(1, b_rows), op,
                       "ldb {} must be >= {} (rows of B as stored, trans_b={})", p.ldb,
                       std::max<std::int64_t>(1, b_rows), p.trans_b);
    SHARDLINE_CHECK_AS(ShapeError, p.ldc >= std::max<std::int64_t>(1, p.m), op, "ldc {} must be >= m {}", p.ldc, p.m);
    const bool empty = p.m == 0 || p.n == 0;
    SHARDLINE_CHECK(empty || p.c != nullptr, op, "C/D pointer is null (m={} n={})", p.m, p.n);
    SHARDLINE_CHECK(empty || p.k == 0 || (p.a != nullptr && p.b != nullptr), op, "A or B pointer is null (k={})", p.k);
    SHARDLINE_CHECK_AS(DTypeError, IsFloatingPoint(p.a_type) && IsFloatingPoint(p.c_type), op,
                       "GEMM operands must be float dtypes, got A {} and C {}", DTypeName(p.a_type),
                       DTypeName(p.c_type));
    SHARDLINE_CHECK_AS(DTypeError, p.a_type == p.b_type, op, "A and B dtypes must match, got {} and {}",
                       DTypeName(p.a_type), DTypeName(p.b_type));
    SHARDLINE_CHECK_AS(DTypeError, p.c_type == p.a_type || p.c_type == DType::kFloat32, op,
                       "C dtype must be A's ({}) or float32, got {}", DTypeName(p.a_type), DTypeName(p.c_type));
    ValidateSeparateC(p, op);
    switch (p.epilogue) {
    case GemmEpilogue::kNone:
        break;
    case GemmEpilogue::kBias:
        SHARDLINE_CHECK(p.bias != nullptr, op, "epilogue bias needs a bias pointer");
        break;
    case GemmEpilogue::kGeluAuxBias:
        SHARDLINE_CHECK(p.aux != nullptr && p.ldaux >= p.m, op,
                        "epilogue gelu_aux_bias needs an aux pointer with ldaux >= m ({}), got ldaux={}", p.m, p.ldaux);
        break;
    case GemmEpilogue::kBGradB:
        SHARDLINE_CHECK(p.bias != nullptr, op, "epilogue bgradb needs a bias-grad pointer");
        SHARDLINE_CHECK(p.beta == 0.0, op, "epilogue bgradb writes D (beta must be 0), got beta={}", p.beta);
        break;
    case GemmEpilogue::kDGeluBGrad:
        SHARDLINE_CHECK(p.bias != nullptr && p.aux != nullptr && p.ldaux >= p.m, op,
                        "epilogue dgelu_bgrad needs bias-grad and aux pointers with ldaux >= m ({})", p.m);
        break;
    case GemmEpilogue::kDGelu:
        SHARDLINE_CHECK(p.aux != nullptr && p.ldaux >= p.m, op,
                        "epilogue dgelu needs an aux pointer with ldaux >= m ({}), got ldaux={}", p.m, p.ldaux);
        break;
    }
}

void Gemm(const GemmParams& params) {
    ValidateGemmParams(params, GemmOp::kName);
    Dispatch<GemmOp>(params.device.type, params);
}

} // namespace shardline::kernels
