// elementwise: unary and binary ops with numpy broadcasting, as the einsum "ab,b->ab". A size-1 broadcast dim is
// never sharded (its label is sharded elsewhere), so its gradient is P(sum) on that label's mesh dims.
// Partial inputs follow what the op preserves: add/subtract keep P(sum|avg) (a non-Partial operand is partialized
// locally), multiply / divide are linear in one operand and keep P(prod) when both operands are, monotone unary ops
// keep P(max|min), linear unary ops P(sum|avg), abs P(prod), everything else reduces first.

#include <algorithm>
#include <map>

#include <shardline/spmd/rules.h>

#include "rule_util.h"

namespace shardline::spmd {

namespace {

struct ElementwiseKind {
    int arity = 1;
    PartialPolicy policy = PartialPolicy::kResolve;
    std::vector<ReduceOp> kept_ops; // kSingle
    std::vector<bool> linear;       // kMultilinear
};

const std::map<std::string, ElementwiseKind> &Kinds() {
    static const std::map<std::string, ElementwiseKind> kinds = [] {
        const std::vector<ReduceOp> monotone = {ReduceOp::kMax, ReduceOp::kMin};
        const std::vector<ReduceOp> linear = {ReduceOp::kSum, ReduceOp::kAvg};
        const std::vector<ReduceOp> all = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                                           ReduceOp::kProd};
        std::map<std::string, ElementwiseKind> k;
        k["add"] = {2, PartialPolicy::kAdditive, {}, {true, true}};
        k["subtract"] = {2, PartialPolicy::kAdditive, {}, {true, true}};
        k["multiply"] = {2, PartialPolicy::kMultilinear, {}, {true, true}};
        k["divide"] = {2, PartialPolicy::kMultilinear, {}, {true, false}};
        for (const char *name : {"maximum", "minimum", "pow"}) {
            k[name] = {2, PartialPolicy::kResolve, {}, {false, false}};
        }
        // Monotone non-decreasing: max_i f(x_i) = f(max_i x_i).
        for (const char *name : {"relu", "sigmoid", "tanh", "exp", "log", "sqrt"}) {
            k[name] = {1, PartialPolicy::kSingle, monotone, {false}};
        }
        for (const char *name : {"gelu", "silu"}) {
            k[name] = {1, PartialPolicy::kResolve, {}, {false}};
        }
        // Multiplicative: |prod_i x_i| = prod_i |x_i|.
        k["abs"] = {1, PartialPolicy::kSingle, {ReduceOp::kProd}, {false}};
        for (const char *name : {"neg", "scale"}) {
            k[name] = {1, PartialPolicy::kSingle, linear, {true}};
        }
        for (const char *name : {"cast", "identity"}) {
            k[name] = {1, PartialPolicy::kSingle, all, {true}};
        }
        return k;
    }();
    return kinds;
}

const ElementwiseKind &Kind(const std::string &op) {
    auto it = Kinds().find(op);
    if (it == Kinds().end()) {
        std::vector<std::string> names;
        for (const auto &[name, kind] : Kinds()) {
            names.push_back(name);
        }
        throw SpmdError(fmt::format("elementwise: unknown op '{}', expected one of [{}]", op, fmt::join(names, ",")));
    }
    return it->second;
}

EinsumProblem ElementwiseProblem(const ProcessMesh &mesh, const std::string &op,
                                 const std::vector<TensorSpec> &inputs) {
    const ElementwiseKind &kind = Kind(op);
    if (static_cast<int>(inputs.size()) != kind.arity) {
        throw SpmdError(fmt::format("{}: expected {} input(s), got {}", op, kind.arity, inputs.size()));
    }
    size_t rank = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
        detail::CheckSpec(mesh, inputs[i], op, inputs.size() == 1 ? "x" : (i == 0 ? "x" : "y"));
        rank = std::max(rank, inputs[i].shape.size());
    }
    const std::string labels = detail::BatchLabels(rank, op);
    EinsumProblem problem;
    problem.op = op;
    for (size_t i = 0; i < inputs.size(); ++i) {
        const std::string name = i == 0 ? "x" : "y";
        problem.inputs.push_back(detail::Operand(name, labels.substr(rank - inputs[i].shape.size()), inputs[i],
                                                 static_cast<int>(i), kind.linear[i],
                                                 kind.policy == PartialPolicy::kAdditive));
    }
    problem.output = labels;
    problem.partial_policy = kind.policy;
    problem.single_kept_ops = kind.kept_ops;
    problem.multiplicative = op == "multiply" || op == "divide";
    EinsumLabelSizes(problem); // broadcast compatibility
    return problem;
}

} // namespace

bool IsElementwiseOp(const std::string &op) { return Kinds().count(op) != 0; }

std::vector<std::string> ElementwiseOpNames() {
    std::vector<std::string> names;
    for (const auto &[name, kind] : Kinds()) {
        names.push_back(name);
    }
    return names;
}

int ElementwiseArity(const std::string &op) { return Kind(op).arity; }

SpmdInfo InferElementwiseForward(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                                 const RuleOptions &options) {
    const EinsumProblem problem = ElementwiseProblem(mesh, op, inputs);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferElementwiseReverse(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                                 const TensorSpec &out, const RuleOptions &options) {
    const EinsumProblem problem = ElementwiseProblem(mesh, op, inputs);
    detail::CheckSpec(mesh, out, op, "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferElementwiseGrad(const ProcessMesh &mesh, const std::string &op, const std::vector<TensorSpec> &inputs,
                              const TensorSpec &out_grad, const RuleOptions &options) {
    const EinsumProblem problem = ElementwiseProblem(mesh, op, inputs);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem,
                            std::vector<bool>(problem.inputs.size(), true));
}

} // namespace shardline::spmd
