// einsum as an op: "mk,kn->mn" (explicit output, letters only, no ellipsis). The op is multilinear: one P(sum)
// operand may stay Partial; conflicts go to the earlier operand.

#include <cctype>

#include <shardline/spmd/rules.h>

#include "problems.h"
#include "rule_util.h"

namespace shardline::spmd {

EinsumProblem detail::EquationProblem(const ProcessMesh &mesh, const std::string &equation,
                                      const std::vector<TensorSpec> &inputs) {
    const auto arrow = equation.find("->");
    if (arrow == std::string::npos) {
        throw SpmdError(fmt::format("einsum: equation '{}' must have an explicit output ('ab,bc->ac')", equation));
    }
    std::vector<std::string> terms(1);
    for (char c : equation.substr(0, arrow)) {
        if (c == ',') {
            terms.emplace_back();
        } else if (std::isalpha(static_cast<unsigned char>(c))) {
            terms.back().push_back(c);
        } else if (c != ' ') {
            throw SpmdError(fmt::format("einsum: equation '{}' may only use letters, ',' and '->'", equation));
        }
    }
    if (terms.size() != inputs.size()) {
        throw SpmdError(fmt::format("einsum: equation '{}' has {} operand(s) but {} input(s) were given", equation,
                                    terms.size(), inputs.size()));
    }
    EinsumProblem problem;
    problem.op = "einsum";
    for (size_t i = 0; i < inputs.size(); ++i) {
        const std::string name = fmt::format("in{}", i);
        detail::CheckSpec(mesh, inputs[i], "einsum", name);
        problem.inputs.push_back(detail::Operand(name, terms[i], inputs[i], static_cast<int>(i)));
    }
    for (char c : equation.substr(arrow + 2)) {
        if (std::isalpha(static_cast<unsigned char>(c))) {
            problem.output.push_back(c);
        } else if (c != ' ') {
            throw SpmdError(fmt::format("einsum: equation '{}' may only use letters, ',' and '->'", equation));
        }
    }
    problem.partial_policy = PartialPolicy::kMultilinear;
    return problem;
}

SpmdInfo InferEinsumOpForward(const ProcessMesh &mesh, const std::string &equation,
                              const std::vector<TensorSpec> &inputs, const RuleOptions &options) {
    const EinsumProblem problem = detail::EquationProblem(mesh, equation, inputs);
    return detail::FromForward(InferEinsumForward(mesh, problem, options), problem);
}

SpmdInfo InferEinsumOpReverse(const ProcessMesh &mesh, const std::string &equation,
                              const std::vector<TensorSpec> &inputs, const TensorSpec &out,
                              const RuleOptions &options) {
    const EinsumProblem problem = detail::EquationProblem(mesh, equation, inputs);
    detail::CheckSpec(mesh, out, "einsum", "out");
    return detail::FromForward(InferEinsumReverse(mesh, problem, out.layout, options), problem);
}

SpmdInfo InferEinsumOpGrad(const ProcessMesh &mesh, const std::string &equation, const std::vector<TensorSpec> &inputs,
                           const TensorSpec &out_grad, const RuleOptions &options) {
    const EinsumProblem problem = detail::EquationProblem(mesh, equation, inputs);
    return detail::FromGrad(InferEinsumGrad(mesh, problem, out_grad, options), problem,
                            std::vector<bool>(problem.inputs.size(), true));
}

} // namespace shardline::spmd
