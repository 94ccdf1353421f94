#pragma once

// Linear layers with Megatron's names, flag meanings and defaults; options structs instead of boolean lists. The
// parallel layers keep their parameters' shards on a DeviceMesh and run through the one parallel-Linear core
// (functional/parallel_linear.h), whose communication comes from the linear rule and the planner (DESIGN.md §6):
// ColumnParallelLinear (weight [out, in] sharded on out), RowParallelLinear (sharded on in).

#include <memory>
#include <optional>
#include <string>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/nn/init.h>
#include <shardline/nn/module.h>

namespace shardline::nn {

/// What a parallel linear returns: the output, and the bias when skip_bias_add left it out (else undefined).
struct LinearOutput {
    Variable output;
    Variable bias;
};

/// The options and the tensor-parallel group are the functional layer's types (one per layer kind, Megatron's
/// defaults), so a module and a functional call of the same layer are configured alike.
/// They carry the communication options too: overlap_grad_comm (dx's collective beside the parameter grads) and
/// comm_chunks (the chunked collective-GEMM pipelines: each collective in C chunks of rows beside the GEMMs of the
/// others; off by default), which the modules pass to the core unchanged.
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;

struct LinearOptions {
    std::int64_t in_features = 0;
    std::int64_t out_features = 0;
    bool bias = true;
};
/// y = x·Wᵀ + b on one process (local Variables). Parameters "<param.name or 'linear'>.weight" / ".bias".
class Linear : public Module {
public:
    explicit Linear(const LinearOptions& options, const ParameterOptions& param = {});
    Variable Forward(const Variable& x) const;
    Variable weight;
    Variable bias;

private:
    LinearOptions options_;
};

/// Megatron's ColumnParallelLinear: weight [out, in] Shard(0) on tp, bias [out] Shard(0) on tp; forward and backward
/// through autograd::ColumnParallelLinear (the functional core). Parameters "<param.name or 'column'>.weight".
/// out_features need not divide by tp: Shard(0) splits it as torch.chunk (22 over tp 3: rows 8, 8, 6), every rank must
/// get at least one row (else ShapeError here, on every rank); init is per global element, so it is the same for any
/// tp.
class ColumnParallelLinear : public Module {
public:
    ColumnParallelLinear(const ColumnParallelLinearOptions& options, const TensorParallelGroup& tp,
                         const ParameterOptions& param = {});
    LinearOutput Forward(const Variable& x) const;
    const ColumnParallelLinearOptions& options() const { return options_; }
    const std::string& name() const { return name_; }
    Variable weight;
    Variable bias;

private:
    ColumnParallelLinearOptions options_;
    TensorParallelGroup tp_;
    std::string name_;
};

/// Megatron's RowParallelLinear: weight [out, in] Shard(1) on tp, bias [out] replicated and added once, after the
/// reduction; through autograd::RowParallelLinear. With input_is_parallel the input must already be sharded on its
/// last dim over tp (a ColumnParallelLinear's output). Parameters "<param.name or 'row'>.weight".
/// in_features need not divide by tp: Shard(1) splits it as torch.chunk, every rank must get at least one column.
class RowParallelLinear : public Module {
public:
    RowParallelLinear(const RowParallelLinearOptions& options, const TensorParallelGroup& tp,
                      const ParameterOptions& param = {});
    LinearOutput Forward(const Variable& x) const;
    const RowParallelLinearOptions& options() const { return options_; }
    const std::string& name() const { return name_; }
    Variable weight;
    Variable bias;

private:
    RowParallelLinearOptions options_;
    TensorParallelGroup tp_;
    std::string name_;
};

// ---- Mixture-of-experts: E experts, one Linear each, over the rows routed to them ----------------------------------

struct GroupedLinearOptions {
    std::int64_t num_experts = 0;
    std::int64_t in_features = 0;
    std::int64_t out_features = 0;
    bool bias = true;
};

/// E experts on one process: y_e = x_e·W_eᵀ + b_e over each expert's rows (autograd::GroupedLinear). weight
/// [E, out, in], bias [E, out], initialised as torch.nn.Linear from the counter-based RNG: expert e's values are a
/// function of (seed, name, e and the element) only, the same under any tensor or expert parallelism. Parameters
/// "<param.name or 'grouped'>.weight" / ".bias"; the dtype and device come from `param`.
class GroupedLinear : public Module {
public:
    explicit GroupedLinear(const GroupedLinearOptions& options, const ParameterOptions& param = {});
    /// x [tokens, in] with its rows grouped by expert, group_sizes int64 [E] (host or x's device; Σ = tokens).
    Variable Forward(const Variable& x, const Tensor& group_sizes) const;
    Variable weight;
    Variable bias;

private:
    GroupedLinearOptions options_;
    std::string name_;
};

/// Expert tensor parallelism, column: every expert's weight [E, out, in] sharded on out over tp (bias [E, out] too),
/// through autograd::ColumnParallelGroupedLinear (the functional core). options.num_experts = E; no
/// sequence_parallel. The global parameters equal a GroupedLinear's of the same name. Parameters
/// "<param.name or 'column_grouped'>.weight".
class ColumnParallelGroupedLinear : public Module {
public:
    ColumnParallelGroupedLinear(const ColumnParallelLinearOptions& options, const TensorParallelGroup& tp,
                                const ParameterOptions& param = {});
    LinearOutput Forward(const Variable& x, const Tensor& group_sizes) const;
    const ColumnParallelLinearOptions& options() const { return options_; }
    Variable weight;
    Variable bias;

private:
    ColumnParallelLinearOptions options_;
    TensorParallelGroup tp_;
    std::string name_;
};

/// Expert tensor parallelism, row: weight [E, out, in] sharded on in over tp, bias [E, out] replicated and added per
/// expert once, after the all-reduce; through autograd::RowParallelGroupedLinear. Parameters
/// "<param.name or 'row_grouped'>.weight".
class RowParallelGroupedLinear : public Module {
public:
    RowParallelGroupedLinear(const RowParallelLinearOptions& options, const TensorParallelGroup& tp,
                             const ParameterOptions& param = {});
    LinearOutput Forward(const Variable& x, const Tensor& group_sizes) const;
    const RowParallelLinearOptions& options() const { return options_; }
    Variable weight;
    Variable bias;

private:
    RowParallelLinearOptions options_;
    TensorParallelGroup tp_;
    std::string name_;
};

} // namespace shardline::nn
