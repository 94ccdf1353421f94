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

} // namespace shardline::nn
