// Outer products as compositions over Gemm (k = 1 forward; matrix-vector products backward).

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/outer.h>

#include "checks.h"
#include "register.h"

namespace shardline::kernels {
namespace {

void DefaultOuterForward(const OuterForwardArgs& args) {
    const std::int64_t m = args.x.numel();
    const std::int64_t n = args.y.numel();
    // Row-major out[m,n] = x[m]·y[n]ᵀ is column-major outᶜ[n,m] = y[n,1]·x[1,m]: k = 1, y as an n×1 matrix
    // (ld n) and x as a 1×m matrix (ld 1).
    Gemm(GemmParams{.m = n,
                    .n = m,
                    .k = 1,
                    .a = args.y.data(),
                    .lda = n,
                    .a_type = args.y.dtype(),
                    .b = args.x.data(),
                    .ldb = 1,
                    .b_type = args.x.dtype(),
                    .c = args.out.data(),
                    .ldc = n,
                    .c_type = args.out.dtype(),
                    .device = args.out.device()});
}

void DefaultOuterBackward(const OuterBackwardArgs& args) {
    const std::int64_t m = args.x.numel();
    const std::int64_t n = args.y.numel();
    if (args.dx != nullptr) {
        // dx[m] = dout[m,n]·y[n]. dout read column-major is [n,m] (ld n); transposed it is [m,n]; times y as an
        // n×1 matrix gives dx as an m×1 column (ldc m).
        Gemm(GemmParams{.trans_a = true,
                        .m = m,
                        .n = 1,
                        .k = n,
                        .a = args.dout.data(),
                        .lda = n,
                        .a_type = args.dout.dtype(),
                        .b = args.y.data(),
                        .ldb = n,
                        .b_type = args.y.dtype(),
                        .c = args.dx->data(),
                        .ldc = m,
                        .c_type = args.dx->dtype(),
                        .device = args.dx->device()});
    }
    if (args.dy != nullptr) {
        // dy[n] = dout[m,n]ᵀ·x[m]. dout read column-major is [n,m] (ld n), times x as an m×1 matrix.
        Gemm(GemmParams{.m = n,
                        .n = 1,
                        .k = m,
                        .a = args.dout.data(),
                        .lda = n,
                        .a_type = args.dout.dtype(),
                        .b = args.x.data(),
                        .ldb = m,
                        .b_type = args.x.dtype(),
                        .c = args.dy->data(),
                        .ldc = n,
                        .c_type = args.dy->dtype(),
                        .device = args.dy->device()});
    }
}

void CheckVector(const Tensor& v, const Tensor& like, std::string_view op, std::string_view name) {
    CheckLike(v, name, like, "x", op);
    SHARDLINE_CHECK_AS(ShapeError, v.rank() == 1 && v.numel() > 0, op, "{} must be a non-empty vector, got {}", name,
                       v.ToString());
}

} // namespace

void OuterForward(const OuterForwardArgs& args) {
    constexpr std::string_view kOp = OuterForwardOp::kName;
    CheckDeviceDType(args.x, kOp, "x");
    CheckVector(args.x, args.x, kOp, "x");
    CheckVector(args.y, args.x, kOp, "y");
    CheckLike(args.out, "out", args.x, "x", kOp);
    CheckShape(args.out, Shape{args.x.numel(), args.y.numel()}, kOp, "out");
    Dispatch<OuterForwardOp>(args.out.device().type, args);
}

Tensor OuterForward(const Tensor& x, const Tensor& y) {
    CheckVector(x, x, OuterForwardOp::kName, "x");
    CheckVector(y, x, OuterForwardOp::kName, "y");
    Tensor out = Tensor::Empty(Shape{x.numel(), y.numel()}, x.dtype(), x.device());
    OuterForward(OuterForwardArgs{.x = x, .y = y, .out = out});
    return out;
}

void OuterBackward(const OuterBackwardArgs& args) {
    constexpr std::string_view kOp = OuterBackwardOp::kName;
    CheckDeviceDType(args.x, kOp, "x");
    CheckVector(args.x, args.x, kOp, "x");
    CheckVector(args.y, args.x, kOp, "y");
    CheckLike(args.dout, "dout", args.x, "x", kOp);
    CheckShape(args.dout, Shape{args.x.numel(), args.y.numel()}, kOp, "dout");
    if (args.dx != nullptr) {
        CheckVector(*args.dx, args.x, kOp, "dx");
        CheckShape(*args.dx, args.x.shape(), kOp, "dx");
    }
    if (args.dy != nullptr) {
        CheckVector(*args.dy, args.x, kOp, "dy");
        CheckShape(*args.dy, args.y.shape(), kOp, "dy");
    }
    Dispatch<OuterBackwardOp>(args.x.device().type, args);
}

namespace detail {
void RegisterOuterCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<OuterForwardOp>(d, kDefaultProvider, &DefaultOuterForward);
        Register<OuterBackwardOp>(d, kDefaultProvider, &DefaultOuterBackward);
    }
}
void RegisterLinearCompositions();
void RegisterMatmulCompositions();
void RegisterGroupedCompositions();

void RegisterCompositeKernels() {
    RegisterLinearCompositions();
    RegisterMatmulCompositions();
    RegisterOuterCompositions();
    RegisterGroupedCompositions();
}
} // namespace detail

} // namespace shardline::kernels
