#include "param_grads.h"

#include <utility>

#include <shardline/core/error.h>

namespace shardline::autograd::detail {
namespace {

dist::Grad ToGrad(Tensor buffer, bool in_sink, comm::DeviceMesh *mesh, const ParamGradRequest &request,
                  const Shape &global_shape) {
    dist::Grad grad;
    if (!buffer.defined()) {
        return grad;
    }
    if (in_sink) {
        grad.accumulated = true;
    } else if (mesh == nullptr) {
        grad.value = dist::DistTensor::Local(std::move(buffer));
    } else {
        grad.value = dist::DistTensor::FromTrustedShard(std::move(buffer), global_shape, request.layout, mesh);
    }
    return grad;
}

} // namespace

ParamGradTargets PlanParamGrads(comm::DeviceMesh *mesh, std::span<const ParamGradRequest> requests, DType dtype,
                                Device device) {
    SHARDLINE_CHECK(requests.size() <= ParamGradTargets::kMaxGrads, "autograd::PlanParamGrads",
                    "at most {} parameter gradients per backward, got {}", ParamGradTargets::kMaxGrads,
                    requests.size());
    ParamGradTargets t;
    bool all_fresh = true; // every gradient going into a buffer finds it standing for zeros
    for (std::size_t i = 0; i < requests.size(); ++i) {
        const ParamGradRequest &r = requests[i];
        const Tensor *sink = r.needed ? r.sink.BufferFor(mesh, r.layout) : nullptr;
        t.in_sink[i] = sink != nullptr; // BufferFor gives the sink's buffer or nothing
        t.accumulate = t.accumulate || sink != nullptr;
        all_fresh = all_fresh && (sink == nullptr || r.sink.fresh());
    }
    // One accumulate flag for the call: overwrite (no zero fill at all) when every buffer is fresh; else the fresh
    // ones get their zeros and everything accumulates.
    if (t.accumulate && all_fresh) {
        t.accumulate = false;
    }
    for (std::size_t i = 0; i < requests.size(); ++i) {
        if (t.in_sink[i]) {
            if (t.accumulate) {
                requests[i].sink.Materialize();
            }
            requests[i].sink.Written();
        }
    }
    for (std::size_t i = 0; i < requests.size(); ++i) {
        const ParamGradRequest &r = requests[i];
        if (!r.needed) {
            continue;
        }
        if (t.in_sink[i]) {
            t.grads[i] = *r.sink.buffer;
        } else {
            t.grads[i] = t.accumulate ? Tensor::Zeros(r.local_shape, dtype, device)
                                      : Tensor::Empty(r.local_shape, dtype, device);
        }
    }
    return t;
}

dist::Grad ParamGradTargets::GradOf(std::size_t i, comm::DeviceMesh *mesh, const ParamGradRequest &request,
                                    const Shape &global_shape) {
    return ToGrad(std::move(grads[i]), in_sink[i], mesh, request, global_shape);
}

} // namespace shardline::autograd::detail
