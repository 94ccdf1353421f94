#pragma once

// Batched matrix products with torch.matmul's batch broadcasting: a [..., m, k] · b [..., k, n] → [..., m, n],
// where the batch dims broadcast (size-1 or missing dims stretch). Both operands have rank ≥ 2.
// trans_a / trans_b take the last two dims of an operand transposed (a is then [..., k, m]).

#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

/// How the allocating MatmulForward and MatmulOutputShape read the operands (the Args structs carry the same fields):
/// MatmulForward(a, b, {.trans_b = true}) is a·bᵀ over the last two dims.
struct MatmulOptions {
    bool trans_a = false; ///< op(a) = aᵀ: a is [..., k, m]
    bool trans_b = false; ///< op(b) = bᵀ: b is [..., n, k]
};

struct MatmulForwardArgs {
    const Tensor& a;
    const Tensor& b;
    Tensor& out;
    bool trans_a = false;
    bool trans_b = false;
};
struct MatmulForwardOp {
    static constexpr std::string_view kName = "MatmulForward";
    using Fn = void (*)(const MatmulForwardArgs&);
};
/// out = op(a)·op(b), batch dims broadcast.
void MatmulForward(const MatmulForwardArgs& args);
/// out = op(a)·op(b) into a new tensor.
Tensor MatmulForward(const Tensor& a, const Tensor& b, MatmulOptions options = {});

/// The shape of op(a)·op(b); throws ShapeError naming `op` when the operands do not fit.
Shape MatmulOutputShape(const Shape& a, const Shape& b, MatmulOptions options, std::string_view op);

struct MatmulBackwardInputArgs {
    const Tensor& dout;
    const Tensor& b;
    Tensor& da; ///< shape of a; summed over the batch dims a was broadcast along
    bool trans_a = false;
    bool trans_b = false;
};
struct MatmulBackwardInputOp {
    static constexpr std::string_view kName = "MatmulBackwardInput";
    using Fn = void (*)(const MatmulBackwardInputArgs&);
};
/// da = dout·op(b)ᵀ (transposed back when trans_a), reduced to a's shape.
void MatmulBackwardInput(const MatmulBackwardInputArgs& args);

struct MatmulBackwardOtherArgs {
    const Tensor& a;
    const Tensor& dout;
    Tensor& db; ///< shape of b; summed over the batch dims b was broadcast along
    bool trans_a = false;
    bool trans_b = false;
};
struct MatmulBackwardOtherOp {
    static constexpr std::string_view kName = "MatmulBackwardOther";
    using Fn = void (*)(const MatmulBackwardOtherArgs&);
};
/// db = op(a)ᵀ·dout (transposed back when trans_b), reduced to b's shape.
void MatmulBackwardOther(const MatmulBackwardOtherArgs& args);

} // namespace shardline::kernels
