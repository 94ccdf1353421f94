#pragma once

// Private: the einsum problems of the einsum-style ops, shared by their rules and the strategy enumeration
// (EnumerateRuleStrategies, rule_cache.cc).

#include <optional>
#include <string>
#include <vector>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd::detail {

/// matmul: "...mk,...kn->...mn" with trans_x / trans_y and 1-D operands (matmul.cc).
EinsumProblem MatmulProblem(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &y,
                            const MatmulAttrs &attrs);
/// linear: "...k,nk,n->...n" with trans_x / trans_y (linear.cc).
EinsumProblem LinearProblem(const ProcessMesh &mesh, const TensorSpec &x, const TensorSpec &weight,
                            const std::optional<TensorSpec> &bias, const LinearAttrs &attrs);
/// einsum: the equation's problem over `inputs` (einsum_op.cc).
EinsumProblem EquationProblem(const ProcessMesh &mesh, const std::string &equation,
                              const std::vector<TensorSpec> &inputs);

} // namespace shardline::spmd::detail
