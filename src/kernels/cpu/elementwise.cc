// CPU elementwise kernels and the sum reduction, float32 and float64. Math runs in double and rounds once to the
// output type, so float32 results are correctly rounded transforms of their inputs.

#include <cstdint>
#include <vector>

#include <shardline/core/error.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/math.h"

namespace shardline::kernels::cpu {
namespace {

/// Calls f.template operator()<T>() with T the C++ type of a CPU float dtype (checked by the op wrappers).
template <class F> void WithFloatType(DType dtype, std::string_view op, F &&f) {
    switch (dtype) {
    case DType::kFloat32:
        f.template operator()<float>();
        return;
    case DType::kFloat64:
        f.template operator()<double>();
        return;
    default:
        SHARDLINE_THROW(DTypeError, op, "CPU kernels take float32 or float64, got {}", DTypeName(dtype));
    }
}

template <class T, class F> void Map(const Tensor &x, Tensor &out, F &&f) {
    const T *in = static_cast<const T *>(x.data());
    T *o = static_cast<T *>(out.data());
    const std::int64_t n = x.numel();
    for (std::int64_t i = 0; i < n; ++i) {
        o[i] = static_cast<T>(f(static_cast<double>(in[i])));
    }
}

template <class T, class F> void Map2(const Tensor &a, const Tensor &b, Tensor &out, F &&f) {
    const T *pa = static_cast<const T *>(a.data());
    const T *pb = static_cast<const T *>(b.data());
    T *o = static_cast<T *>(out.data());
    const std::int64_t n = a.numel();
    for (std::int64_t i = 0; i < n; ++i) {
        o[i] = static_cast<T>(f(static_cast<double>(pa[i]), static_cast<double>(pb[i])));
    }
}

/// acc[out index] += x over the whole tensor. Each non-reduced dim of x maps to the output with the stride of the
/// output's contiguous layout; reduced dims map with stride 0. x is read in row-major order, innermost dim in a
/// tight loop.
template <class In> void SumInto(const SumArgs &args, std::vector<double> &acc) {
    const Shape &shape = args.x.shape();
    const In *x = static_cast<const In *>(args.x.data());
    const int rank = static_cast<int>(shape.size());
    if (rank == 0) {
        acc[0] += static_cast<double>(x[0]);
        return;
    }
    std::vector<bool> reduced(shape.size(), args.dims.empty());
    for (int d : args.dims) {
        reduced[d < 0 ? d + rank : d] = true;
    }
    Shape out_stride(shape.size(), 0);
    std::int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
        if (!reduced[d]) {
            out_stride[d] = stride;
            stride *= shape[d];
        }
    }
    const std::int64_t inner = shape.back();
    const std::int64_t inner_stride = out_stride.back();
    const std::int64_t outer = inner == 0 ? 0 : args.x.numel() / inner;
    std::vector<std::int64_t> index(shape.size(), 0); // odometer over dims [0, rank-1)
    std::int64_t base = 0;
    for (std::int64_t o = 0; o < outer; ++o) {
        const In *row = x + o * inner;
        if (inner_stride == 0) {
            double s = 0.0;
            for (std::int64_t i = 0; i < inner; ++i) {
                s += static_cast<double>(row[i]);
            }
            acc[base] += s;
        } else {
            double *dst = acc.data() + base;
            for (std::int64_t i = 0; i < inner; ++i) {
                dst[i] += static_cast<double>(row[i]);
            }
        }
        for (int d = rank - 2; d >= 0; --d) {
            base += out_stride[d];
            if (++index[d] < shape[d]) {
                break;
            }
            base -= out_stride[d] * shape[d];
            index[d] = 0;
        }
    }
}

} // namespace

void GeluForward(const GeluForwardArgs &args) {
    const bool tanh = args.approximation == GeluApproximation::kTanh;
    WithFloatType(args.x.dtype(), GeluForwardOp::kName, [&]<class T>() {
        if (tanh) {
            Map<T>(args.x, args.y, [](double v) { return GeluTanh(v); });
        } else {
            Map<T>(args.x, args.y, [](double v) { return GeluErf(v); });
        }
    });
}

void GeluBackward(const GeluBackwardArgs &args) {
    const bool tanh = args.approximation == GeluApproximation::kTanh;
    WithFloatType(args.x.dtype(), GeluBackwardOp::kName, [&]<class T>() {
        if (tanh) {
            Map2<T>(args.dy, args.x, args.dx, [](double g, double v) { return g * GeluTanhGrad(v); });
        } else {
            Map2<T>(args.dy, args.x, args.dx, [](double g, double v) { return g * GeluErfGrad(v); });
        }
    });
}

void Add(const AddArgs &args) {
    const double alpha = args.alpha;
    WithFloatType(args.a.dtype(), AddOp::kName, [&]<class T>() {
        Map2<T>(args.a, args.b, args.out, [alpha](double a, double b) { return a + alpha * b; });
    });
}

void Scale(const ScaleArgs &args) {
    const double alpha = args.alpha;
    WithFloatType(args.x.dtype(), ScaleOp::kName,
                  [&]<class T>() { Map<T>(args.x, args.out, [alpha](double v) { return alpha * v; }); });
}

void BiasAdd(const BiasAddArgs &args) {
    const std::int64_t cols = args.bias.numel();
    const std::int64_t rows = args.x.numel() / cols; // the wrapper has excluded numel 0
    WithFloatType(args.x.dtype(), BiasAddOp::kName, [&]<class T>() {
        const T *x = static_cast<const T *>(args.x.data());
        const T *bias = static_cast<const T *>(args.bias.data());
        T *out = static_cast<T *>(args.out.data()); // may alias x
        for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t j = 0; j < cols; ++j) {
                out[r * cols + j] = static_cast<T>(static_cast<double>(x[r * cols + j]) + static_cast<double>(bias[j]));
            }
        }
    });
}

void Sum(const SumArgs &args) {
    std::vector<double> acc(static_cast<std::size_t>(args.out.numel()), 0.0);
    WithFloatType(args.x.dtype(), SumOp::kName, [&]<class T>() { SumInto<T>(args, acc); });
    WithFloatType(args.out.dtype(), SumOp::kName, [&]<class T>() {
        T *out = static_cast<T *>(args.out.data());
        for (std::size_t i = 0; i < acc.size(); ++i) {
            out[i] = static_cast<T>(acc[i]);
        }
    });
}

} // namespace shardline::kernels::cpu
