#pragma once

// Private to src/functional: one linear layer configuration, the rule answers and plans it runs on, and the cache that
// keeps them (GetPlanCacheStats).
//
// A configuration is a small value (mesh shape, tp dim, the global shapes, the flags, the dtype), hashed without
// allocating. Its first call asks the linear SPMD rule, forward and grad (spmd::InferRuleWithPlans through an
// spmd::RuleCache), with the layouts of the caller's tensors; later calls find the answer here.

#include <array>
#include <cstdint>
#include <memory>
#include <string_view>

#include <shardline/core/dtype.h>
#include <shardline/core/tensor.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/rule_cache.h>

namespace shardline::functional::detail {

inline constexpr int kMaxMeshDims = 8;

enum class LinearKind : std::uint8_t { kColumn, kRow };

/// Everything a layer's rule answer depends on. Shapes are global.
struct LinearConfig {
    LinearKind kind = LinearKind::kColumn;
    DType dtype = DType::kFloat32;
    bool bias = false;
    bool gather_output = false;     ///< column
    bool input_is_parallel = false; ///< row
    bool sequence_parallel = false;
    int tp_dim = 0;
    int mesh_ndim = 0;
    int x_ndim = 0;
    std::array<std::int64_t, kMaxMeshDims> mesh_shape{};
    std::array<std::int64_t, 4> x_shape{}; ///< global [s, ..., in_features]
    std::int64_t out_features = 0;

    bool operator==(const LinearConfig &) const = default;
};

struct LinearConfigHash {
    std::size_t operator()(const LinearConfig &config) const noexcept;
};

/// The layouts of the caller's tensors and the rule's answers for them. Indices name the rule's inputs and outputs.
struct LinearPlan {
    Shape x_shape;              ///< global
    Shape weight_shape;         ///< global [N, K]
    Shape bias_shape;           ///< global [N]
    Shape y_shape;              ///< global [s, ..., N]
    spmd::Layout x_layout;      ///< the caller's x (and dx)
    spmd::Layout weight_layout; ///< the caller's weight (and dweight)
    spmd::Layout bias_layout;   ///< the caller's bias (and dbias)
    spmd::Layout y_layout;      ///< the caller's y (and dy)

    /// forward: inputs x, weight[, bias]; output "out" planned to y_layout.
    std::shared_ptr<const spmd::CachedRule> forward;
    /// grad: inputs x, weight[, bias], out_grad (given in y_layout); outputs x_grad, weight_grad[, bias_grad] planned
    /// to the caller's layouts.
    std::shared_ptr<const spmd::CachedRule> grad;

    int forward_x = -1;
    int grad_x = -1;
    int grad_weight = -1;
    int grad_out_grad = -1;
    int grad_x_grad = -1;
    int grad_weight_grad = -1;
    int grad_bias_grad = -1;
};

/// The plan of `config`: from the cache, or inferred (and cached) on the first call. `op` names the caller in errors
/// (a rule's SpmdError becomes a shardline::Error naming it).
std::shared_ptr<const LinearPlan> GetLinearPlan(const LinearConfig &config, std::string_view op);

} // namespace shardline::functional::detail
