#pragma once

// Data-parallel gradient synchronisation (DDP / Megatron's grad buffer): the parameters' fp32 main grads live in
// flat buckets; backward leaves them Partial(sum) over the dp mesh dim, and as soon as every gradient of a bucket is
// complete (a post-accumulate hook) the bucket's all-reduce over the dp group is launched asynchronously, overlapping
// the rest of the backward. Finish() waits for all of them. One all-reduce per bucket per step and data-parallel dim.
//
// Mixture of experts (Megatron's rule): with several data-parallel mesh dims (dp and ep of a (dp, ep, tp) mesh, the
// batch sharded over both), a parameter's gradient is reduced over those of them that do not shard the parameter.
// Dense parameters (the router's gate, attention, embeddings) reduce over every data-parallel rank (dp and ep); expert
// parameters, sharded on their experts dim over ep, reduce over the expert-data-parallel ranks only (dp). Buckets hold
// parameters of one such set; a bucket reduced over two dims runs its all-reduces one after the other. A module whose
// parameters see different data over more mesh dims than those (a MoE layer at etp 1 below tp: its tp ranks split the
// tokens, so its router and its whole experts are data-parallel over tp too) names them per parameter (extra_dp_dims).

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>

namespace shardline::nn {

struct GradSyncOptions {
    std::string dp_dim = "dp";
    /// Every data-parallel mesh dim, e.g. {"dp", "ep"} (empty: {dp_dim}). Each parameter reduces over those of them
    /// that shard none of its dims (see above).
    std::vector<std::string> dp_dims = {};
    /// Bucket capacity (fp32 bytes); parameters are packed in reverse order (the order backward completes them).
    std::int64_t bucket_bytes = 25 << 20;
    /// More data-parallel mesh dims of some parameters (e.g. nn::MoEMLP::ExtraDataParallelDims()): each listed
    /// parameter also reduces over these (those that shard none of its dims), in its bucket.
    std::vector<std::pair<autograd::Variable, std::vector<std::string>>> extra_dp_dims = {};
};

class GradSync {
public:
    /// Gives every parameter an fp32 main grad inside a bucket and a deferred Partial on the data-parallel dims it
    /// reduces over. The parameters must live on `mesh`. GradSync must outlive the backward passes it serves.
    GradSync(std::vector<autograd::Variable> parameters, comm::DeviceMesh& mesh, const GradSyncOptions& options = {});
    ~GradSync();
    GradSync(const GradSync&) = delete;
    GradSync& operator=(const GradSync&) = delete;

    /// Launches the buckets that did not complete (parameters without a gradient this step), waits for every
    /// bucket, and marks the gradients reduced (their layouts lose the dp Partials). Call before the optimizer step.
    void Finish();
    /// Zeroes the buckets and marks the gradients Partial again (call before the next backward).
    void ZeroGrad();
    /// When off, hooks do not launch (gradient accumulation over micro-batches; Finish still reduces).
    void set_enabled(bool enabled);
    int num_buckets() const;
    /// Parameter names per bucket (for tests and logs).
    std::vector<std::vector<std::string>> BucketNames() const;
    /// The mesh dims each bucket reduces over (for tests and logs).
    std::vector<std::vector<int>> BucketDims() const;

    struct State;

private:
    std::shared_ptr<State> state_;
};

} // namespace shardline::nn
