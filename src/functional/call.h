#pragma once

// Private to src/functional: one parallel-Linear call's execution context (device, stream override, the collectives it
// issued, the chunked pipelines' included) and the moves of its tensors by the rule's plans (DistTensor::Redistribute),
// for the sequence in parallel_linear.cc.

#include <optional>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>

#include "checks.h"

namespace shardline::functional::detail {

/// One call's device, mesh and the collectives it issued; on CUDA it also holds the stream/workspace override.
class Call {
public:
    Call(comm::DeviceMesh &mesh, const CudaExecution &cuda) : mesh_(mesh) {
        if (mesh.world().device_type() == DeviceType::kCUDA) {
#if SHARDLINE_HAVE_CUDA
            CudaContext &ctx = CudaContext::Current();
            device_ = Device::CUDA(ctx.device());
            scope_.emplace(ctx, cuda.stream, cuda.workspace, cuda.workspace_bytes);
#endif
        }
    }

    Device device() const { return device_; }
    comm::DeviceMesh &mesh() const { return mesh_; }
    int collectives() const { return collectives_; }
    /// Collectives issued outside Move/Start (the chunked pipelines).
    void Count(int collectives) { collectives_ += collectives; }

    Tensor Wrap(const TensorView &v) const {
        return v.present() ? Tensor::FromBlob(v.data, ShapeOf(v), v.dtype, device_) : Tensor();
    }
    /// A grouped layer's group sizes: host memory, or the call's device.
    Tensor WrapSizes(const TensorView &v, bool on_device) const {
        return v.present() ? Tensor::FromBlob(v.data, ShapeOf(v), v.dtype, on_device ? device_ : Device::CPU())
                           : Tensor();
    }

    /// This rank's shard shape of a global tensor in `layout`.
    Shape LocalShape(const Shape &global, const spmd::Layout &layout) const {
        return spmd::ComputeLocalShard(spmd::ProcessMesh(mesh_.shape()), global, layout, mesh_.coordinate()).shape;
    }

    /// `local` (this rank's shard of a global tensor in `layout`) moved by `plan`, a cached plan of the rule: nothing
    /// to do for an empty plan, else DistTensor::Redistribute runs exactly the plan's steps (no planning) on the mesh
    /// dims' groups and returns a tensor of its own. `output`: local is an output of this call's kernels (a temporary,
    /// or the caller's output buffer it is delivered to), which the plan may overwrite: an all-reduce then runs in
    /// place on it instead of on a copy, and Deliver has nothing left to copy.
    Tensor Move(const Tensor &local, const Shape &global, const spmd::Layout &layout,
                const spmd::RedistributePlan &plan, bool output = false) {
        if (plan.steps.empty()) {
            return local;
        }
        if (output) {
            dist::PendingRedistribute pending = Start(local, global, layout, plan, true);
            return Finish(pending);
        }
        collectives_ += plan.NumCollectives();
        const dist::DistTensor t(local, global, layout, mesh_);
        return t.Redistribute(plan.steps.back().after, plan).local();
    }

    /// Move with the plan's last collective left in flight (DistTensor::RedistributeAsync): the same collectives, in
    /// the same order; Finish gives the moved tensor.
    dist::PendingRedistribute Start(const Tensor &local, const Shape &global, const spmd::Layout &layout,
                                    const spmd::RedistributePlan &plan, bool output = false) {
        collectives_ += plan.NumCollectives();
        const dist::DistTensor t(local, global, layout, mesh_);
        return t.RedistributeAsync(plan.steps.empty() ? layout : plan.steps.back().after, plan, output);
    }
    static Tensor Finish(dist::PendingRedistribute &pending) { return pending.Wait().local(); }

private:
    comm::DeviceMesh &mesh_;
    Device device_ = Device::CPU();
    int collectives_ = 0;
#if SHARDLINE_HAVE_CUDA
    // A Call outlives every tensor of its call (they live in the Run* functions and their arguments), so temporaries
    // are released stream-ordered on the caller's stream before the previous stream is restored.
    std::optional<ScopedCudaOverride> scope_;
#endif
};

/// The tensor a kernel writes an output into: the caller's buffer when the rule's local shard is exactly it and no
/// plan moves it, else a temporary that the plan then moves (Redistribute returns a tensor of its own, which is then
/// copied into the caller's buffer).
inline Tensor OutputBuffer(const Tensor &caller, const Shape &local_shape) {
    if (caller.shape() == local_shape) {
        return caller;
    }
    return Tensor::Empty(local_shape, caller.dtype(), caller.device());
}

inline void Deliver(const Tensor &result, const Tensor &caller) {
    if (result.data() != caller.data()) {
        Tensor dst = caller;
        dst.CopyFrom(result);
    }
}

} // namespace shardline::functional::detail
