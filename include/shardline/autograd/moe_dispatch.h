#pragma once

// Expert parallelism's token exchange (DESIGN.md §8, docs/moe.md "Expert parallelism"): the dispatcher between a MoE
// layer's Permute and its experts, and back before its Unpermute, over the expert-parallel group `ep` of P ranks. The
// E experts are split evenly: ep rank r holds experts [r·E/P, (r+1)·E/P). Permute leaves this rank's routed rows in
// global expert order, so the rows for rank r are one contiguous block and need no regroup before sending.
//
//   PlanExpertExchange  one int64 all-to-all of the E per-expert row counts (block r, E/P counts, goes to rank r):
//                       every rank learns how many rows each peer sends it for each of its local experts.
//   ExpertDispatch      all-to-all-v of the rows (send_rows[r]·H elements to rank r), then a local regroup so that
//                       the local experts' rows are consecutive, expert by expert: expert-major, then source-rank-major
//                       (the rows from ep rank 0 first), then each source's own order (Permute's stable (t, j) order).
//                       Backward: the inverse regroup and the reverse all-to-all-v.
//   ExpertCombine       the inverse: the inverse regroup and the reverse all-to-all-v, back into Permute's order;
//                       backward: the forward all-to-all-v and the regroup.
//
// The order is a pure function of the counts, so the exchange is deterministic (bitwise run to run). Each collective
// goes through the Communicator and is counted there (CollectiveKind::kAllToAll). With P = 1 (or no group) nothing is
// exchanged: the plan is the local counts, and dispatch and combine return their input.
//
// Also here: the small bridges a MoE layer needs between mesh Variables (the parameters, the layer's input and output)
// and the local Variables of the routing ops (autograd/moe.h): LocalPart and AsShard move no data.

#include <cstdint>
#include <vector>

#include <shardline/autograd/variable.h>
#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>

namespace shardline::autograd {

/// Where every routed row of one MoE layer call goes over the expert-parallel group (see above).
struct ExpertExchangePlan {
    int ep_size = 1;
    std::int64_t num_experts = 0;        ///< E (global)
    std::int64_t local_experts = 0;      ///< E / P, the experts of this rank
    std::vector<std::int64_t> send_rows; ///< [P]: rows this rank sends to ep rank r (its rows of r's experts)
    std::vector<std::int64_t> recv_rows; ///< [P]: rows this rank receives from ep rank r
    /// [P · E/P]: at r·(E/P) + l, the rows ep rank r sends for local expert l.
    std::vector<std::int64_t> recv_counts;
    /// [E/P]: the local experts' rows after the dispatch (Σ over r of recv_counts): the experts' group sizes.
    std::vector<std::int64_t> local_group_sizes;

    std::int64_t sent() const;     ///< Σ send_rows: the rows of Permute's output
    std::int64_t received() const; ///< Σ recv_rows: the rows the local experts receive
    /// No row arrives: the experts run on one zero pad row instead (the grouped layers need memory to point to); its
    /// output is dropped by the combine and its gradient is zero, so it changes no value and no gradient.
    bool padded() const;
    /// The rows of ExpertDispatch's output: received(), or 1 when padded.
    std::int64_t expert_rows() const;
    /// The experts' group sizes for ExpertDispatch's output: local_group_sizes, with the pad row on the first expert.
    std::vector<std::int64_t> expert_group_sizes() const;
};

/// The plan from this rank's per-expert row counts `group_sizes` (E entries, Permute's host_group_sizes). Collective
/// over `ep` when it has more than one rank (one int64 all-to-all of E elements); ep null or of one rank: local. Raises
/// Error naming "ExpertExchange" when E is not divisible by the group's size or a count is negative, before the
/// collective (the sizes agree on every rank when every rank passes E entries).
ExpertExchangePlan PlanExpertExchange(const std::vector<std::int64_t>& group_sizes, comm::Communicator* ep);

/// tokens [R, H] (a local Variable, R = plan.sent(), rows in global expert order) → [plan.expert_rows(), H], the
/// local experts' rows grouped expert by expert (group sizes plan.expert_group_sizes()). Differentiable in tokens.
Variable ExpertDispatch(const Variable& tokens, const ExpertExchangePlan& plan, comm::Communicator* ep);
/// The inverse of ExpertDispatch: expert_rows [plan.expert_rows(), H] → [plan.sent(), H] in Permute's order.
Variable ExpertCombine(const Variable& expert_rows, const ExpertExchangePlan& plan, comm::Communicator* ep);

/// x's local shard as a local Variable of shape `local_shape` (same elements, e.g. [..., H] flattened to [T, H]; x's
/// local must be contiguous). The gradient goes back as x's local shard in x's layout (which must have no Partial).
Variable LocalPart(const Variable& x, const Shape& local_shape);
/// The local Variable `local` viewed as `local_shape` and taken as this rank's shard of a DistTensor of `global_shape`
/// in `layout` on `mesh` (no data moves; the caller vouches for the shard). The gradient is moved to `layout` without
/// its Partials and its local shard goes back, in `local`'s shape.
Variable AsShard(const Variable& local, const Shape& local_shape, const Shape& global_shape, const spmd::Layout& layout,
                 comm::DeviceMesh& mesh);

} // namespace shardline::autograd
