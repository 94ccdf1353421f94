#pragma once

// Private to src/autograd: where the parameter gradients of a Linear-like backward (dweight, dbias) are computed. A
// leaf with a main-grad buffer (AllocateMainGrad, or a GradSync bucket) takes its gradient straight from the kernel
// (beta = 1) when the gradient comes out in the buffer's layout; otherwise the Function returns a new tensor and the
// engine moves and accumulates it. The kernels take one accumulate flag for both, so when only one of them goes into a
// buffer the other starts from zeros.

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

/// Where the kernels write dweight and dbias.
struct ParamGradTargets {
    Tensor dweight; ///< undefined when not needed
    Tensor dbias;
    bool weight_in_sink = false;
    bool bias_in_sink = false;
    bool accumulate = false; ///< beta = 1 for both (a new buffer then holds zeros)

    /// The Grad a Function returns for dweight / dbias: accumulated into the sink, or the new tensor as a gradient of
    /// `global_shape` in the request's layout (a local tensor when mesh is null).
    dist::Grad WeightGrad(comm::DeviceMesh *mesh, const ParamGradRequest &request, const Shape &global_shape) const;
    dist::Grad BiasGrad(comm::DeviceMesh *mesh, const ParamGradRequest &request, const Shape &global_shape) const;
};

/// The targets of a backward computing `weight` and `bias` in `dtype` on `device` (mesh null: local tensors).
ParamGradTargets PlanParamGrads(comm::DeviceMesh *mesh, const ParamGradRequest &weight, const ParamGradRequest &bias,
                                DType dtype, Device device);

} // namespace shardline::autograd::detail
