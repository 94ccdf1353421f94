#pragma once

// Private to src/autograd: where the parameter gradients of a Linear-like backward (dweight, dbias; a ParallelMLP's
// four) are computed. A leaf with a main-grad buffer (AllocateMainGrad, or a GradSync bucket) takes its gradient
// straight from the kernel (beta = 1) when the gradient comes out in the buffer's layout; otherwise the Function
// returns a new tensor and the engine moves and accumulates it. The kernels take one accumulate flag for all, so when
// only some of them go into a buffer the others start from zeros.

#include <array>
#include <cstddef>
#include <span>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/ops.h>
#include <shardline/spmd/layout.h>

namespace shardline::autograd::detail {

/// One parameter gradient a backward may compute.
struct ParamGradRequest {
    bool needed = false;
    dist::GradSink sink{}; ///< the leaf's main grad (Function::GradSinkFor), possibly empty
    Shape local_shape{};   ///< this rank's shard of the gradient
    spmd::Layout layout{}; ///< the layout it comes out in (Partial where rows were summed locally); local: unused
};

/// Where the kernels write the parameter gradients of one backward, in the order of the requests.
struct ParamGradTargets {
    /// The most gradients one backward asks for (a ParallelMLP's four); fixed arrays, so that planning allocates
    /// nothing but the new gradients themselves.
    static constexpr std::size_t kMaxGrads = 4;

    std::array<Tensor, kMaxGrads> grads;   ///< in the requests' order; undefined where not needed (and past them)
    std::array<bool, kMaxGrads> in_sink{}; ///< the gradient is the leaf's main-grad buffer itself
    bool accumulate = false; ///< beta = 1 for all (a new buffer then holds zeros); false also when every main-grad
                             ///< buffer written stands for zeros (Variable::ZeroGrad deferred): they are overwritten

    /// The Grad a Function returns for gradient i: accumulated into the sink, or the new tensor as a gradient of
    /// `global_shape` in the request's layout (a local tensor when mesh is null). Moves grads[i] out: call it once per
    /// gradient, after the kernels.
    dist::Grad GradOf(std::size_t i, comm::DeviceMesh *mesh, const ParamGradRequest &request,
                      const Shape &global_shape);
};

/// The targets of a backward computing the requested parameter gradients in `dtype` on `device` (mesh null: local
/// tensors). The kernels take one accumulate flag per call, so when any gradient goes into its main grad, every other
/// one starts from zeros. At most ParamGradTargets::kMaxGrads requests.
ParamGradTargets PlanParamGrads(comm::DeviceMesh *mesh, std::span<const ParamGradRequest> requests, DType dtype,
                                Device device);

} // namespace shardline::autograd::detail
