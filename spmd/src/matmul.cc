// matmul: out[..., m, n] = sum_k x[..., m, k] * y[..., k, n] as the einsum "...mk,...kn->...mn" (Paddle's
// MatmulInferSpmd): batch labels broadcast, k is contracted (a sharded k makes the output P(sum)), the op is
// linear in each operand (one P(sum) operand may stay Partial).

#include <algorithm>

#include <shardline/spmd/rules.h>

#include "problems.h"
#include "rule_util.h"

namespace shardline::spmd {

namespace detail {

EinsumProblem MatmulProblem(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y,
                            const MatmulAttrs &attrs) {
    detail::CheckSpec(mesh, x, "matmul", "x");
    detail::CheckSpec(mesh, y, "matmul", "y");
    const size_t rx = x.shape.size();
    const size_t ry = y.shape.size();
    if (rx == 0 || ry == 0) {
        throw SpmdError(fmt::format("matmul: x and y must have rank >= 1, got x {} and y {}", ShapeToString(x.shape),
                                    ShapeToString(y.shape)));
    }
    const std::string x_mat = rx == 1 ? "k" : (attrs.trans_x ? "km" : "mk");
    const std::string y_mat = ry == 1 ? "k" : (attrs.trans_y ? "nk" : "kn");
    const size_t xb = rx - x_mat.size();
    const size_t yb = ry - y_mat.size();
    const std::string batch = detail::BatchLabels(std::max(xb, yb), "matmul");
    const int64_t xk = x.shape[rx - 1 - (rx > 1 && attrs.trans_x ? 1 : 0)];
    const int64_t yk = ry == 1 ? y.shape[0] : y.shape[ry - (attrs.trans_y ? 1 : 2)];
    if (xk != yk) {
        throw SpmdError(fmt::format("matmul: the contracted dim of x {} ({}) must equal that of y {} ({}) "
                                    "(trans_x={}, trans_y={})",
                                    ShapeToString(x.shape), xk, ShapeToString(y.shape), yk, attrs.trans_x,
                                    attrs.trans_y));
    }
    EinsumProblem problem;
    problem.op = "matmul";
    problem.inputs.push_back(detail::Operand("x", batch.substr(batch.size() - xb) + x_mat, x, 0));
    problem.inputs.push_back(detail::Operand("y", batch.substr(batch.size() - yb) + y_mat, y, 1));
    problem.output = batch + (rx == 1 ? "" : "m") + (ry == 1 ? "" : "n");
    problem.partial_policy = PartialPolicy::kMultilinear;
    EinsumLabelSizes(problem); // batch broadcast check with a message naming both operands
    return problem;
}

} // namespace detail

using detail::MatmulProblem;

SpmdInfo InferMatmulForward(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, const MatmulAttrs &attrs,
                            const RuleOptions &options) {
    const EinsumProblem problem = MatmulProblem(mesh, x, y, attrs);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferMatmulReverse(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, const TensorSpec &out,
                            const MatmulAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = MatmulProblem(mesh, x, y, attrs);
    detail::CheckSpec(mesh, out, "matmul", "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferMatmulGrad(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y, const TensorSpec &out_grad,
                         const MatmulAttrs &attrs, const RuleOptions &options) {
    const EinsumProblem problem = MatmulProblem(mesh, x, y, attrs);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem, {true, true});
}

} // namespace shardline::spmd
