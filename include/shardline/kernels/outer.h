#pragma once

#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

struct OuterForwardArgs {
    const Tensor& x; ///< [m]
    const Tensor& y; ///< [n]
    Tensor& out;     ///< [m, n]
};
struct OuterForwardOp {
    static constexpr std::string_view kName = "OuterForward";
    using Fn = void (*)(const OuterForwardArgs&);
};
/// out[i, j] = x[i]·y[j].
void OuterForward(const OuterForwardArgs& args);
Tensor OuterForward(const Tensor& x, const Tensor& y);

struct OuterBackwardArgs {
    const Tensor& dout;   ///< [m, n]
    const Tensor& x;      ///< [m]
    const Tensor& y;      ///< [n]
    Tensor* dx = nullptr; ///< [m] = dout·y (skipped when null)
    Tensor* dy = nullptr; ///< [n] = doutᵀ·x (skipped when null)
};
struct OuterBackwardOp {
    static constexpr std::string_view kName = "OuterBackward";
    using Fn = void (*)(const OuterBackwardArgs&);
};
void OuterBackward(const OuterBackwardArgs& args);

} // namespace shardline::kernels
