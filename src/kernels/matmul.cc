// Batched matmul with torch.matmul batch broadcasting, as compositions over Gemm.

#include <algorithm>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/matmul.h>

#include "checks.h"
#include "register.h"

namespace shardline::kernels {
namespace {

Shape BatchDims(const Shape& s) { return Shape(s.begin(), s.end() - 2); }

/// torch broadcasting of two batch shapes (right-aligned; 1 stretches).
Shape BroadcastBatch(const Shape& a, const Shape& b, std::string_view op) {
    const std::size_t r = std::max(a.size(), b.size());
    Shape out(r, 1);
    for (std::size_t i = 0; i < r; ++i) {
        const std::int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
        const std::int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
        SHARDLINE_CHECK_AS(ShapeError, da == db || da == 1 || db == 1, op,
                           "batch dims {} and {} do not broadcast (dim {}: {} vs {})", ShapeToString(a),
                           ShapeToString(b), i, da, db);
        out[i] = da == 1 ? db : da;
    }
    return out;
}

/// Element offset of batch index `flat` (in the broadcast batch shape) within an operand of batch shape `own`.
std::int64_t BatchOffset(std::int64_t flat, const Shape& batch, const Shape& own, std::int64_t matrix_elems) {
    std::int64_t offset = 0;
    std::int64_t stride = matrix_elems;
    const std::size_t pad = batch.size() - own.size();
    for (std::size_t i = batch.size(); i-- > 0;) {
        const std::int64_t idx = flat % batch[i];
        flat /= batch[i];
        if (i >= pad) {
            const std::int64_t size = own[i - pad];
            if (size != 1) {
                offset += idx * stride;
            }
            stride *= size;
        }
    }
    return offset;
}

/// The single stride that walks `own` across the broadcast batch, if one exists: the full matrix size when own
/// covers the whole batch, 0 when it is broadcast over all of it; -1 otherwise.
std::int64_t UniformBatchStride(const Shape& batch, const Shape& own, std::int64_t matrix_elems) {
    if (Numel(own) == 1) {
        return 0;
    }
    Shape padded(batch.size() - own.size(), 1);
    padded.insert(padded.end(), own.begin(), own.end());
    return padded == batch ? matrix_elems : -1;
}

/// out[batch] = op(a)·op(b) for tensors of rank >= 2 whose batch dims broadcast to out's.
void RunMatmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& out) {
    const std::int64_t m = trans_a ? a.size(-1) : a.size(-2);
    const std::int64_t k = trans_a ? a.size(-2) : a.size(-1);
    const std::int64_t n = trans_b ? b.size(-2) : b.size(-1);
    const Shape batch = BatchDims(out.shape());
    const std::int64_t batch_count = Numel(batch);
    const Shape a_batch = BatchDims(a.shape());
    const Shape b_batch = BatchDims(b.shape());
    const std::int64_t a_elems = m * k;
    const std::int64_t b_elems = k * n;
    const std::size_t es = ElementSize(a.dtype());
    // Row-major C[m,n] = op(A)·op(B) is column-major Cᶜ[n,m] = op(B)ᶜ·op(A)ᶜ, where a row-major R×C matrix is a
    // column-major C×R one with ld = C. So GEMM A := B (stored row-major [k,n], or [n,k] when trans_b, giving
    // ld n or k and a transpose iff trans_b), GEMM B := A (stored [m,k] or [k,m]: ld k or m, transposed iff trans_a),
    // m_gemm = n, n_gemm = m, ldc = n.
    GemmParams params{.trans_a = trans_b,
                      .trans_b = trans_a,
                      .m = n,
                      .n = m,
                      .k = k,
                      .a = b.data(),
                      .lda = std::max<std::int64_t>(1, trans_b ? k : n), // BLAS wants ld >= 1 even for k = 0
                      .a_type = b.dtype(),
                      .b = a.data(),
                      .ldb = std::max<std::int64_t>(1, trans_a ? m : k),
                      .b_type = a.dtype(),
                      .c = out.data(),
                      .ldc = n,
                      .c_type = out.dtype(),
                      .device = out.device()};
    const std::int64_t stride_a = UniformBatchStride(batch, a_batch, a_elems);
    const std::int64_t stride_b = UniformBatchStride(batch, b_batch, b_elems);
    if (stride_a >= 0 && stride_b >= 0) {
        params.batch_count = batch_count;
        params.stride_a = stride_b; // GEMM A is our b
        params.stride_b = stride_a;
        params.stride_c = m * n;
        Gemm(params);
        return;
    }
    // Mixed broadcasting ([2,1,m,k]·[1,3,k,n]): one GEMM per batch entry.
    for (std::int64_t i = 0; i < batch_count; ++i) {
        GemmParams p = params;
        p.a = static_cast<const char*>(b.data()) + BatchOffset(i, batch, b_batch, b_elems) * es;
        p.b = static_cast<const char*>(a.data()) + BatchOffset(i, batch, a_batch, a_elems) * es;
        p.c = static_cast<char*>(out.data()) + i * m * n * ElementSize(out.dtype());
        Gemm(p);
    }
}

/// Writes `full` (batch = the broadcast batch) into `grad` (an operand's shape), summing over broadcast dims.
void ReduceToOperand(const Tensor& full, Tensor& grad) {
    if (full.shape() == grad.shape()) {
        grad.CopyFrom(full);
        return;
    }
    const std::size_t pad = full.rank() - grad.rank();
    std::vector<int> dims;
    for (std::size_t i = 0; i + 2 < static_cast<std::size_t>(full.rank()); ++i) {
        if (i < pad || grad.shape()[i - pad] == 1) {
            dims.push_back(static_cast<int>(i));
        }
    }
    Tensor keep = grad.View(SumOutputShape(full.shape(), {.dims = dims}, "Matmul"));
    Sum(SumArgs{.x = full, .out = keep, .dims = dims, .keepdim = false});
}

void DefaultMatmulForward(const MatmulForwardArgs& args) {
    RunMatmul(args.a, args.trans_a, args.b, args.trans_b, args.out);
}

/// Runs op(x)·op(y) over the broadcast batch of `dout` and leaves the result in `grad` (an operand's shape), summed
/// over the batch dims that operand was broadcast along. Writes straight into `grad` when no reduction is needed.
void MatmulIntoOperandGrad(const Tensor& dout, const Tensor& x, bool trans_x, const Tensor& y, bool trans_y,
                           const Tensor& grad) {
    Shape full_shape = BatchDims(dout.shape());
    full_shape.push_back(grad.size(-2));
    full_shape.push_back(grad.size(-1));
    Tensor out = grad;
    if (full_shape == grad.shape()) {
        RunMatmul(x, trans_x, y, trans_y, out);
        return;
    }
    Tensor full = Tensor::Empty(full_shape, grad.dtype(), grad.device());
    RunMatmul(x, trans_x, y, trans_y, full);
    ReduceToOperand(full, out);
}

void DefaultMatmulBackwardInput(const MatmulBackwardInputArgs& args) {
    // d op(A) = dC·op(B)ᵀ, and op(B)ᵀ is b read with the opposite transpose flag. With trans_a,
    // dA = (d op(A))ᵀ = op(B)·dCᵀ.
    if (!args.trans_a) {
        MatmulIntoOperandGrad(args.dout, args.dout, false, args.b, !args.trans_b, args.da);
    } else {
        MatmulIntoOperandGrad(args.dout, args.b, args.trans_b, args.dout, true, args.da);
    }
}

void DefaultMatmulBackwardOther(const MatmulBackwardOtherArgs& args) {
    // d op(B) = op(A)ᵀ·dC; with trans_b, dB = (d op(B))ᵀ = dCᵀ·op(A).
    if (!args.trans_b) {
        MatmulIntoOperandGrad(args.dout, args.a, !args.trans_a, args.dout, false, args.db);
    } else {
        MatmulIntoOperandGrad(args.dout, args.dout, true, args.a, args.trans_a, args.db);
    }
}

template <class Args> MatmulOptions TransposesOf(const Args& args) {
    return {.trans_a = args.trans_a, .trans_b = args.trans_b};
}

} // namespace

Shape MatmulOutputShape(const Shape& a, const Shape& b, MatmulOptions options, std::string_view op) {
    const bool trans_a = options.trans_a;
    const bool trans_b = options.trans_b;
    SHARDLINE_CHECK_AS(ShapeError, a.size() >= 2 && b.size() >= 2, op,
                       "operands must have rank >= 2, got a {} and b {}", ShapeToString(a), ShapeToString(b));
    const std::int64_t m = trans_a ? a.back() : a[a.size() - 2];
    const std::int64_t ka = trans_a ? a[a.size() - 2] : a.back();
    const std::int64_t kb = trans_b ? b.back() : b[b.size() - 2];
    const std::int64_t n = trans_b ? b[b.size() - 2] : b.back();
    SHARDLINE_CHECK_AS(ShapeError, ka == kb, op,
                       "contracted dims differ: a {} (trans_a={}) has k={}, b {} (trans_b={}) has k={}",
                       ShapeToString(a), trans_a, ka, ShapeToString(b), trans_b, kb);
    Shape out = BroadcastBatch(BatchDims(a), BatchDims(b), op);
    out.push_back(m);
    out.push_back(n);
    return out;
}

void MatmulForward(const MatmulForwardArgs& args) {
    constexpr std::string_view kOp = MatmulForwardOp::kName;
    CheckOperands(args.a, "a", args.b, "b", kOp);
    CheckLike(args.out, "out", args.a, "a", kOp);
    CheckShape(args.out, MatmulOutputShape(args.a.shape(), args.b.shape(), TransposesOf(args), kOp), kOp, "out");
    if (args.out.numel() == 0) {
        return;
    }
    Dispatch<MatmulForwardOp>(args.out.device().type, args);
}

Tensor MatmulForward(const Tensor& a, const Tensor& b, MatmulOptions options) {
    CheckOperands(a, "a", b, "b", MatmulForwardOp::kName);
    Tensor out =
        Tensor::Empty(MatmulOutputShape(a.shape(), b.shape(), options, MatmulForwardOp::kName), a.dtype(), a.device());
    MatmulForward(
        MatmulForwardArgs{.a = a, .b = b, .out = out, .trans_a = options.trans_a, .trans_b = options.trans_b});
    return out;
}

void MatmulBackwardInput(const MatmulBackwardInputArgs& args) {
    constexpr std::string_view kOp = MatmulBackwardInputOp::kName;
    CheckOperands(args.dout, "dout", args.b, "b", kOp);
    CheckLike(args.da, "da", args.b, "b", kOp);
    CheckShape(args.dout, MatmulOutputShape(args.da.shape(), args.b.shape(), TransposesOf(args), kOp), kOp, "dout");
    if (args.da.numel() == 0) {
        return;
    }
    Dispatch<MatmulBackwardInputOp>(args.da.device().type, args);
}

void MatmulBackwardOther(const MatmulBackwardOtherArgs& args) {
    constexpr std::string_view kOp = MatmulBackwardOtherOp::kName;
    CheckOperands(args.a, "a", args.dout, "dout", kOp);
    CheckLike(args.db, "db", args.a, "a", kOp);
    CheckShape(args.dout, MatmulOutputShape(args.a.shape(), args.db.shape(), TransposesOf(args), kOp), kOp, "dout");
    if (args.db.numel() == 0) {
        return;
    }
    Dispatch<MatmulBackwardOtherOp>(args.db.device().type, args);
}

namespace detail {
void RegisterMatmulCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<MatmulForwardOp>(d, kDefaultProvider, &DefaultMatmulForward);
        Register<MatmulBackwardInputOp>(d, kDefaultProvider, &DefaultMatmulBackwardInput);
        Register<MatmulBackwardOtherOp>(d, kDefaultProvider, &DefaultMatmulBackwardOther);
    }
}
} // namespace detail

} // namespace shardline::kernels
