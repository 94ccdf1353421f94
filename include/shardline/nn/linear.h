#pragma once

// Linear layers with Megatron's names and flag meanings; options structs instead of boolean lists. The parallel
// layers carry layouts on a DeviceMesh, and the communication comes from the linear rule and the planner
// (DESIGN.md §6): ColumnParallelLinear (weight [out, in] sharded on out), RowParallelLinear (sharded on in).

#include <memory>
#include <optional>
#include <string>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/nn/init.h>
#include <shardline/nn/module.h>

namespace shardline::nn {

/// What a parallel linear returns: the output, and the bias when skip_bias_add left it out (else undefined).
struct LinearOutput {
    Variable output;
    Variable bias;
};

/// The tensor-parallel group: a mesh and the name of its tp dim (a 1-d mesh, or e.g. dp×tp).
struct TensorParallel {
    comm::DeviceMesh* mesh = nullptr;
    std::string tp_dim = "tp";
};

struct LinearOptions {
    std::int64_t in_features = 0;
    std::int64_t out_features = 0;
    bool bias = true;
    ParameterOptions param{};
    std::string name = "linear"; ///< parameter names "<name>.weight", "<name>.bias" (the RNG streams)
};
/// y = x·Wᵀ + b on one process (local Variables).
class Linear : public Module {
public:
    explicit Linear(const LinearOptions& options);
    Variable Forward(const Variable& x) const;
    Variable weight;
    Variable bias;

private:
    LinearOptions options_;
};

struct ColumnParallelLinearOptions {
    std::int64_t in_features = 0;
    std::int64_t out_features = 0; ///< global; must divide by tp
    bool bias = true;
    /// All-gather the output so every tp rank holds all out_features (else it stays sharded on the last dim).
    bool gather_output = false;
    /// The input arrives sharded on dim 0 (sequence) over tp; the forward all-gathers it, the backward
    /// reduce-scatters dX.
    bool sequence_parallel = false;
    /// Return the bias instead of adding it (the caller fuses it into the next op).
    bool skip_bias_add = false;
    ParameterOptions param{};
    std::string name = "column";
};
/// Megatron's ColumnParallelLinear: weight [out, in] Shard(0) on tp, bias [out] Shard(0) on tp.
class ColumnParallelLinear : public Module {
public:
    ColumnParallelLinear(const ColumnParallelLinearOptions& options, const TensorParallel& tp);
    LinearOutput Forward(const Variable& x) const;
    const ColumnParallelLinearOptions& options() const { return options_; }
    Variable weight;
    Variable bias;

private:
    ColumnParallelLinearOptions options_;
    TensorParallel tp_;
    int tp_dim_ = 0;
};

struct RowParallelLinearOptions {
    std::int64_t in_features = 0; ///< global; must divide by tp
    std::int64_t out_features = 0;
    bool bias = true;
    /// The input is already sharded on its last dim over tp (a ColumnParallelLinear's output). Else it is split
    /// locally (free) and its gradient all-gathered.
    bool input_is_parallel = true;
    /// Reduce-scatter the output on dim 0 (sequence) instead of all-reducing it; the backward all-gathers dY. Needs
    /// input_is_parallel (as in Megatron).
    bool sequence_parallel = false;
    bool skip_bias_add = false;
    ParameterOptions param{};
    std::string name = "row";
};
/// Megatron's RowParallelLinear: weight [out, in] Shard(1) on tp, bias [out] replicated and added once, after the
/// reduction.
class RowParallelLinear : public Module {
public:
    RowParallelLinear(const RowParallelLinearOptions& options, const TensorParallel& tp);
    LinearOutput Forward(const Variable& x) const;
    const RowParallelLinearOptions& options() const { return options_; }
    Variable weight;
    Variable bias;

private:
    RowParallelLinearOptions options_;
    TensorParallel tp_;
    int tp_dim_ = 0;
};

} // namespace shardline::nn
