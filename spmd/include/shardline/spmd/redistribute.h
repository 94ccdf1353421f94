#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

namespace shardline::spmd {

/// Cost of collectives on each mesh dim: a collective call of s ring steps moving b bytes per rank costs
/// call_us + s * alpha_us + b / (bandwidth_gb_per_s * 1e3) microseconds. The per-call term (launch, host issue,
/// stream ordering) is paid once per collective, so one all_reduce costs less than a reduce_scatter and an all_gather
/// of the same tensor, as with NCCL; the bandwidth is the bus bandwidth (nccl-tests' busbw: bytes_per_rank counts
/// what a ring moves). Per-dim values (intra- vs inter-node) override the defaults when given. flops_per_us prices
/// local compute in the cost-based rules and the strategy enumeration.
/// The defaults are the profile "nccl_h200" (spmd/profiles/nccl_h200.json: NCCL on H200, docs/PERFORMANCE.md);
/// CostProfile(name) gives the built-in profiles, json.h reads others (docs/spmd.md 7).
struct CostModel {
    double call_us = 63.9;                          ///< per collective call
    double alpha_us = 1.78;                         ///< per ring step
    double bandwidth_gb_per_s = 341.6;              ///< bus bandwidth
    std::vector<double> call_us_per_dim;            ///< empty or one per mesh dim
    std::vector<double> alpha_us_per_dim;           ///< empty or one per mesh dim
    std::vector<double> bandwidth_gb_per_s_per_dim; ///< empty or one per mesh dim
    double flops_per_us = 7.339e8;                  ///< 733.9 TFLOP/s (bf16 GEMM ceiling measured on H200)
    std::string name = "nccl_h200";                 ///< the profile it came from (a label: not priced)

    double Call(int mesh_dim) const;
    double Alpha(int mesh_dim) const;
    double Bandwidth(int mesh_dim) const;
    /// One call: call_us + `ring_steps` latencies + `bytes` at the mesh dim's bandwidth, in microseconds.
    double Cost(int mesh_dim, int64_t ring_steps, int64_t bytes) const;
    /// Throws SpmdError naming `what` unless every value is finite, latencies >= 0, bandwidths and flops > 0.
    void Validate(std::string_view what) const;
};

/// The built-in cost profiles: "nccl_h200" (the default, CostModel{}) and "mpi_cpu" (MPI on CPU tensors), each from
/// the JSON file of that name in spmd/profiles/ (compiled in). Throws SpmdError listing the names for another name.
CostModel CostProfile(std::string_view name);
/// The built-in profile names, sorted.
std::vector<std::string> CostProfileNames();

/// kAllToAllV (uneven blocks) is never a planner step: only an op's internal collective (the MoE token exchange).
enum class Collective { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kLocalSlice, kLocalPartialize, kAllToAllV };

std::string_view ToString(Collective collective);

/// One step of a redistribution, on one mesh dim.
struct RedistributeStep {
    Collective collective = Collective::kLocalSlice;
    int mesh_dim = -1;
    int tensor_dim = -1;    ///< gathered, scattered or sliced tensor dim; for all_to_all the dim that is gathered
    int to_tensor_dim = -1; ///< all_to_all only: the dim that becomes sharded
    ReduceOp reduce_op = ReduceOp::kSum; ///< all_reduce, reduce_scatter, partialize
    /// Bytes each rank sends (ring algorithms; uneven shards are padded to the largest, as NCCL needs equal counts):
    /// all_reduce 2(n-1)*ceil(B/n), reduce_scatter (n-1)*max_out, all_gather (n-1)*max_in,
    /// all_to_all (n-1)*max_block, local steps 0. A count beyond int64 is an SpmdError, never a wrap-around.
    int64_t bytes_per_rank = 0;
    double cost_us = 0.0;
    Layout before;
    Layout after;
    bool operator==(const RedistributeStep &other) const = default;
};

struct RedistributePlan {
    std::vector<RedistributeStep> steps;
    double cost_us = 0.0;
    int64_t bytes_per_rank = 0; ///< sum over steps
    /// Number of steps that communicate (everything but local slice / partialize).
    int NumCollectives() const;
};

struct PlanOptions {
    int64_t element_size = 4; ///< bytes per element
    CostModel cost;
    /// When the ordered plan gathers a mesh dim that dst shards again, also search every step sequence for a
    /// strictly cheaper plan (all_to_alls instead of all_gather + re-slice; see PlanRedistribute).
    bool search = true;
};

/// Plans src -> dst for a tensor of `global_shape` on `mesh`, one mesh dim per step, in this order:
///   1. local slices that are possible at once (R -> S where the dim's current shard list is a prefix of dst's);
///   2. all_reduce of Partial mesh dims that dst neither keeps Partial nor scatters (on the smallest tensor);
///   3. un-sharding of every mesh dim that dst shards differently, minor-most first: all_to_all when the mesh dim
///      moves to another tensor dim whose shard list is ready for it, all_gather otherwise;
///   4. sharding in dst's major -> minor order: reduce_scatter for a Partial mesh dim (never all_reduce + slice),
///      local slice for a free one;
///   5. all_reduce of the remaining Partial mesh dims (also those whose reduce op changes);
///   6. local partialize (R -> P) of dst's new Partial mesh dims.
/// When that plan all-gathers a mesh dim that dst shards again (a swap of mesh dims between tensor dims, a co-shard
/// order change) and options.search is set, a shortest-path search over all single-mesh-dim step sequences runs
/// (bounded; it gives up on meshes too large to enumerate) and its plan replaces the ordered one if strictly cheaper
/// under options.cost, e.g. [[0,1],-1] -> [[1,0],-1] by all_to_alls through dim 1 instead of two all-gathers.
/// Throws SpmdError when a layout does not fit the mesh or the tensor.
RedistributePlan PlanRedistribute(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &src,
                                  const Layout &dst, const PlanOptions &options = {});

/// Cost of the plan only (what the strategy enumeration sums).
double RedistributeCost(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &src,
                        const Layout &dst, const PlanOptions &options = {});

} // namespace shardline::spmd
