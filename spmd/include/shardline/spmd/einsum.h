#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::spmd {

/// How an op treats Partial inputs on a mesh dim that no label claims.
enum class PartialPolicy {
    kResolve,     ///< nonlinear: every Partial input is reduced first
    kMultilinear, ///< a product (matmul, multiply): one `linear` operand may stay P(sum|avg), the output inherits it
    kAdditive,    ///< a sum (add, subtract): P(sum|avg) on all operands with one op; non-Partial ones are
                  ///< partialized locally (R -> P), the output inherits it
    kSingle,      ///< one operand: a Partial whose op is in `single_kept_ops` passes to the output
};

struct EinsumOperand {
    std::string name;
    std::string labels; ///< one character per tensor dim
    std::vector<int64_t> shape;
    Layout layout;
    int priority = 0;           ///< lower wins label conflicts; ties go to the earlier operand
    bool linear = true;         ///< kMultilinear: the op is linear in this operand
    bool additive_term = false; ///< its gradient is the output gradient alone (bias, add): no other operand enters it
    bool differentiable = true; ///< kCostBased grad: its gradient (compute and communication) is priced
};

struct EinsumProblem {
    std::string op; ///< for messages
    std::vector<EinsumOperand> inputs;
    std::string output;                    ///< output labels; input labels absent here are contracted
    ReduceOp contraction = ReduceOp::kSum; ///< how a sharded contracted label makes the output Partial
    PartialPolicy partial_policy = PartialPolicy::kResolve;
    std::vector<ReduceOp> single_kept_ops; ///< kSingle only
    std::string unshardable;               ///< labels that must stay replicated (e.g. a softmax axis)
    /// kMultilinear elementwise products (multiply, divide; no contracted label): when every operand is P(prod) on a
    /// mesh dim no label claims, they stay Partial and so does the output (prod_i x_i * prod_i y_i = prod_i x_i y_i).
    bool multiplicative = false;
};

/// The decision of a rule: which mesh dims shard each label, which input Partials pass through.
struct EinsumAssignment {
    std::map<char, std::vector<int>> labels; ///< label -> mesh dims, major -> minor
    struct Kept {
        ReduceOp op = ReduceOp::kSum;
        std::vector<bool> inputs; ///< which inputs are required Partial on this mesh dim
        bool operator==(const Kept &other) const = default;
    };
    std::map<int, Kept> kept_partial; ///< mesh dim -> kept Partial
    bool operator==(const EinsumAssignment &other) const = default;
};

enum class RuleMode {
    kDeterministic, ///< the merge policy of docs/spmd.md: predictable, Paddle-like
    /// Enumerate assignments and take the cheapest (ties keep the deterministic answer). forward: input
    /// redistributions + compute (+ output -> output_target); reverse: compute + output -> the given output;
    /// grad: saved inputs and output gradient -> required, gradient einsums, each gradient -> its input's layout.
    /// reshape has no alternatives to price and answers deterministically in every mode (docs/spmd.md 2.2).
    kCostBased,
};

struct RuleOptions {
    RuleMode mode = RuleMode::kDeterministic;
    PlanOptions plan;                    ///< element size and alpha-beta model for kCostBased
    std::optional<Layout> output_target; ///< kCostBased forward: also price moving the output there (an error in
                                         ///< reverse and grad, whose targets are the given output / input layouts)
};

struct EinsumResult {
    EinsumAssignment assignment;
    std::vector<TensorSpec> inputs; ///< required input layouts
    TensorSpec output;
    double cost_us = 0.0; ///< kCostBased: the chosen candidate's cost
};

struct EinsumGradResult {
    EinsumAssignment assignment;
    std::vector<TensorSpec> inputs;      ///< required forward inputs (as saved by the forward)
    TensorSpec out_grad;                 ///< required output gradient
    std::vector<TensorSpec> input_grads; ///< one per input, Partial(sum) on mesh dims of labels reduced away
    double cost_us = 0.0;                ///< kCostBased: the chosen candidate's cost
};

/// Label sizes of a problem; throws SpmdError when the operands disagree (sizes other than 1 differ).
std::map<char, int64_t> EinsumLabelSizes(const EinsumProblem &problem);

/// Forward: input layouts -> required input layouts + output layout.
EinsumResult InferEinsumForward(const ProcessMesh &mesh, const EinsumProblem &problem, const RuleOptions &options = {});
/// Reverse: the output layout -> input layouts (input layouts in `problem` are ignored); the result is the
/// forward rule applied to those inputs, so it is consistent by construction.
EinsumResult InferEinsumReverse(const ProcessMesh &mesh, const EinsumProblem &problem, const Layout &output,
                                const RuleOptions &options = {});
/// Grad: forward inputs + output gradient -> required inputs, required output gradient, input gradients.
EinsumGradResult InferEinsumGrad(const ProcessMesh &mesh, const EinsumProblem &problem, const TensorSpec &out_grad,
                                 const RuleOptions &options = {});

/// Builds the required layouts and the output of `assignment` (used by the rules and the enumeration).
EinsumResult ApplyAssignment(const ProcessMesh &mesh, const EinsumProblem &problem, const EinsumAssignment &assignment);

/// One candidate of EnumerateEinsumStrategies.
struct EinsumStrategy {
    EinsumAssignment assignment;    ///< label -> mesh dims (ascending); never a kept Partial
    std::vector<TensorSpec> inputs; ///< the layouts the inputs must have
    TensorSpec output;              ///< Partial (the problem's contraction op) on the mesh dims of contracted labels
    double redistribute_us = 0.0;   ///< sum over inputs: the ordered plan from the given layout to the required one
    double compute_us = 0.0;        ///< 2 * prod(label sizes) / shard count / flops_per_us
    double cost_us = 0.0;           ///< redistribute_us + compute_us
};

struct EinsumStrategies {
    std::vector<EinsumStrategy> strategies;
    size_t chosen = 0; ///< the least cost_us; ties: the first in order
};

/// DTensor's gen_einsum_strategies for any einsum problem, on any mesh: per mesh dim of size > 1, either everything
/// Replicate or one label sharded on it -- every operand holding the label shards it (a size-1 broadcast dim stays
/// Replicate) and so does the output, except for a contracted label, which makes the output Partial instead -- and
/// the product over mesh dims (the first mesh dim varies slowest; a label chosen on several mesh dims is co-sharded
/// in ascending mesh dim order). Per mesh dim the options come in DTensor's order: Replicate, then the batch labels
/// (in every operand and the output), the contracted labels, the other output labels, each group sorted. Only labels
/// some operand may shard are offered (size > 1, not `unshardable`); size-1 mesh dims only replicate (they would
/// repeat every candidate). Each candidate is priced from the given input layouts with the ordered plans
/// (PlanOptions::search off: a swap search per candidate would multiply the cost of the query). Throws SpmdError
/// for more than kMaxCandidates candidates.
EinsumStrategies EnumerateEinsumStrategies(const ProcessMesh &mesh, const EinsumProblem &problem,
                                           const PlanOptions &options = {});

} // namespace shardline::spmd
