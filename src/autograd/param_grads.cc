#include "param_grads.h"

namespace shardline::autograd::detail {
namespace {

dist::Grad ToGrad(const Tensor &buffer, bool in_sink, comm::DeviceMesh *mesh, const ParamGradRequest &request,
                  const Shape &global_shape) {
    dist::Grad grad;
    if (!buffer.defined()) {
        return grad;
    }
    if (in_sink) {
        grad.accumulated = true;
    } else if (mesh == nullptr) {
        grad.value = dist::DistTensor::Local(buffer);
    } else {
        grad.value = dist::DistTensor::FromTrustedShard(buffer, global_shape, request.layout, mesh);
    }
    return grad;
}

} // namespace

ParamGradTargets PlanParamGrads(comm::DeviceMesh *mesh, const ParamGradRequest &weight, const ParamGradRequest &bias,
                                DType dtype, Device device) {
    ParamGradTargets t;
    Tensor *wsink = weight.needed ? weight.sink.BufferFor(mesh, weight.layout) : nullptr;
    Tensor *bsink = bias.needed ? bias.sink.BufferFor(mesh, bias.layout) : nullptr;
    t.weight_in_sink = wsink != nullptr;
    t.bias_in_sink = bsink != nullptr;
    t.accumulate = t.weight_in_sink || t.bias_in_sink;
    auto fresh = [&](const ParamGradRequest &r) {
        return t.accumulate ? Tensor::Zeros(r.local_shape, dtype, device) : Tensor::Empty(r.local_shape, dtype, device);
    };
    if (weight.needed) {
        t.dweight = wsink != nullptr ? *wsink : fresh(weight);
    }
    if (bias.needed) {
        t.dbias = bsink != nullptr ? *bsink : fresh(bias);
    }
    return t;
}

dist::Grad ParamGradTargets::WeightGrad(comm::DeviceMesh *mesh, const ParamGradRequest &request,
                                        const Shape &global_shape) const {
    return ToGrad(dweight, weight_in_sink, mesh, request, global_shape);
}

dist::Grad ParamGradTargets::BiasGrad(comm::DeviceMesh *mesh, const ParamGradRequest &request,
                                      const Shape &global_shape) const {
    return ToGrad(dbias, bias_in_sink, mesh, request, global_shape);
}

} // namespace shardline::autograd::detail
