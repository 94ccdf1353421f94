// Elementwise ops and reductions: checks, allocating wrappers, dispatch. The kernels live in cpu/ and cuda/.

#include <algorithm>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

void CheckUnary(const Tensor& x, std::string_view x_name, const Tensor& out, std::string_view out_name,
                std::string_view op) {
    CheckOperands(x, x_name, out, out_name, op);
    CheckShape(out, x.shape(), op, out_name);
}

} // namespace

void GeluForward(const GeluForwardArgs& args) {
    CheckUnary(args.x, "x", args.y, "y", GeluForwardOp::kName);
    if (args.x.numel() > 0) {
        Dispatch<GeluForwardOp>(args.x.device().type, args);
    }
}

Tensor GeluForward(const Tensor& x, GeluApproximation approximation) {
    CheckTensor(x, GeluForwardOp::kName, "x");
    Tensor y = Tensor::Empty(x.shape(), x.dtype(), x.device());
    GeluForward(GeluForwardArgs{.x = x, .y = y, .approximation = approximation});
    return y;
}

void GeluBackward(const GeluBackwardArgs& args) {
    CheckUnary(args.x, "x", args.dx, "dx", GeluBackwardOp::kName);
    CheckUnary(args.x, "x", args.dy, "dy", GeluBackwardOp::kName);
    if (args.x.numel() > 0) {
        Dispatch<GeluBackwardOp>(args.x.device().type, args);
    }
}

Tensor GeluBackward(const Tensor& dy, const Tensor& x, GeluApproximation approximation) {
    CheckTensor(x, GeluBackwardOp::kName, "x");
    Tensor dx = Tensor::Empty(x.shape(), x.dtype(), x.device());
    GeluBackward(GeluBackwardArgs{.dy = dy, .x = x, .dx = dx, .approximation = approximation});
    return dx;
}

void Add(const AddArgs& args) {
    CheckUnary(args.a, "a", args.out, "out", AddOp::kName);
    CheckUnary(args.a, "a", args.b, "b", AddOp::kName);
    if (args.a.numel() > 0) {
        Dispatch<AddOp>(args.a.device().type, args);
    }
}

Tensor Add(const Tensor& a, const Tensor& b, double alpha) {
    CheckTensor(a, AddOp::kName, "a");
    Tensor out = Tensor::Empty(a.shape(), a.dtype(), a.device());
    Add(AddArgs{.a = a, .b = b, .out = out, .alpha = alpha});
    return out;
}

void Scale(const ScaleArgs& args) {
    CheckUnary(args.x, "x", args.out, "out", ScaleOp::kName);
    if (args.x.numel() > 0) {
        Dispatch<ScaleOp>(args.x.device().type, args);
    }
}

Tensor Scale(const Tensor& x, double alpha) {
    CheckTensor(x, ScaleOp::kName, "x");
    Tensor out = Tensor::Empty(x.shape(), x.dtype(), x.device());
    Scale(ScaleArgs{.x = x, .out = out, .alpha = alpha});
    return out;
}

void BiasAdd(const BiasAddArgs& args) {
    constexpr std::string_view kOp = BiasAddOp::kName;
    CheckUnary(args.x, "x", args.out, "out", kOp);
    CheckLike(args.bias, "bias", args.x, "x", kOp);
    SHARDLINE_CHECK_AS(ShapeError, args.x.rank() >= 1, kOp, "x must have rank >= 1 ([..., n]), got {}",
                       args.x.ToString());
    CheckShape(args.bias, Shape{args.x.shape().back()}, kOp, "bias");
    if (args.x.numel() > 0) {
        Dispatch<BiasAddOp>(args.x.device().type, args);
    }
}

Tensor BiasAdd(const Tensor& x, const Tensor& bias) {
    CheckTensor(x, BiasAddOp::kName, "x");
    Tensor out = Tensor::Empty(x.shape(), x.dtype(), x.device());
    BiasAdd(BiasAddArgs{.x = x, .bias = bias, .out = out});
    return out;
}

Shape SumOutputShape(const Shape& x, const SumOptions& options, std::string_view op) {
    const std::vector<int>& dims = options.dims;
    const int rank = static_cast<int>(x.size());
    std::vector<bool> reduced(x.size(), dims.empty());
    for (int d : dims) {
        const int nd = d < 0 ? d + rank : d;
        SHARDLINE_CHECK_AS(ShapeError, nd >= 0 && nd < rank, op, "dim {} out of range for shape {}", d,
                           ShapeToString(x));
        SHARDLINE_CHECK_AS(ShapeError, !reduced[nd] || dims.empty(), op, "dim {} listed twice in the reduction", d);
        reduced[nd] = true;
    }
    Shape out;
    for (int d = 0; d < rank; ++d) {
        if (!reduced[d]) {
            out.push_back(x[d]);
        } else if (options.keepdim) {
            out.push_back(1);
        }
    }
    return out;
}

void Sum(const SumArgs& args) {
    constexpr std::string_view kOp = SumOp::kName;
    CheckTensor(args.x, kOp, "x");
    CheckTensor(args.out, kOp, "out");
    CheckDeviceDType(args.x, kOp, "x");
    CheckDeviceDType(args.out, kOp, "out");
    CheckSameDevice(args.x, "x", args.out, "out", kOp);
    CheckShape(args.out, SumOutputShape(args.x.shape(), {.dims = args.dims, .keepdim = args.keepdim}, kOp), kOp, "out");
    if (args.out.numel() > 0) {
        Dispatch<SumOp>(args.x.device().type, args);
    }
}

Tensor Sum(const Tensor& x, SumOptions options) {
    CheckTensor(x, SumOp::kName, "x");
    Tensor out = Tensor::Empty(SumOutputShape(x.shape(), options, SumOp::kName), x.dtype(), x.device());
    Sum(SumArgs{.x = x, .out = out, .dims = std::move(options.dims), .keepdim = options.keepdim});
    return out;
}

} // namespace shardline::kernels
