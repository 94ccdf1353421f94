// Elementwise ops on DistTensors: GELU, Add, BiasAdd, Scale, through the elementwise rule (numpy broadcasting).

#include <shardline/dist/ops.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/linear.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

/// The forward rule of an elementwise op and its inputs moved to the required layouts.
struct Prepared {
    std::shared_ptr<const spmd::CachedRule> rule;
    std::vector<DistTensor> inputs;
};

Prepared PrepareForward(std::string_view kop, comm::DeviceMesh &mesh, std::string op,
                        const std::vector<const DistTensor *> &inputs) {
    spmd::RuleRequest request{.op = std::move(op)};
    for (const DistTensor *t : inputs) {
        request.inputs.push_back(t->spec());
    }
    Prepared p{.rule = LookupRule(kop, mesh, std::move(request)), .inputs = {}};
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        p.inputs.push_back(detail::Prepare(*inputs[i], p.rule->info.inputs[i], p.rule->input_plans[i]));
    }
    return p;
}

/// The grad rule of an elementwise op for forward inputs of these specs, and dout moved to the layout it requires.
struct PreparedGrad {
    std::shared_ptr<const spmd::CachedRule> rule;
    DistTensor dout;
};

PreparedGrad PrepareGrad(std::string_view kop, comm::DeviceMesh &mesh, std::string op,
                         std::initializer_list<const spmd::TensorSpec *> inputs, const DistTensor &dout) {
    spmd::RuleRequest request{.op = std::move(op), .direction = spmd::RuleDirection::kGrad, .out_grad = dout.spec()};
    for (const spmd::TensorSpec *t : inputs) {
        request.inputs.push_back(*t);
    }
    PreparedGrad p{.rule = LookupRule(kop, mesh, std::move(request)), .dout = {}};
    const std::size_t g = p.rule->info.inputs.size() - 1;
    p.dout = detail::Prepare(dout, p.rule->info.inputs[g], p.rule->input_plans[g]);
    return p;
}

/// The forward shape a grad op was given must be dout's (an elementwise op's output has its operand's shape).
void CheckSavedShape(std::string_view kop, std::string_view name, const spmd::TensorSpec &saved,
                     const DistTensor &dout) {
    SHARDLINE_CHECK_AS(ShapeError, saved.shape == dout.global_shape(), kop,
                       "the saved spec of {} has shape {}, but dout has {} (pass the forward operand's spec())", name,
                       ShapeToString(saved.shape), ShapeToString(dout.global_shape()));
}

} // namespace

DistTensor GeluForward(const DistTensor &x, kernels::GeluApproximation approximation) {
    constexpr const char *kOp = "dist::GeluForward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x});
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::GeluForward(x.local(), approximation));
    }
    const Prepared p = PrepareForward(kOp, *mesh, "gelu", {&x});
    return detail::Shard(kernels::GeluForward(p.inputs[0].local(), approximation), p.rule->info.outputs[0], mesh);
}

DistTensor GeluBackward(const DistTensor &dy, const DistTensor &x, kernels::GeluApproximation approximation) {
    constexpr const char *kOp = "dist::GeluBackward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dy, &x});
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::GeluBackward(dy.local(), x.local(), approximation));
    }
    const spmd::TensorSpec x_spec = x.spec();
    const PreparedGrad p = PrepareGrad(kOp, *mesh, "gelu", {&x_spec}, dy);
    const DistTensor x_used = detail::MoveTo(x, p.rule->info.inputs[0].layout); // x's values are read
    return detail::Shard(kernels::GeluBackward(p.dout.local(), x_used.local(), approximation), p.rule->info.outputs[0],
                         mesh);
}

DistTensor Add(const DistTensor &a, const DistTensor &b, double alpha) {
    constexpr const char *kOp = "dist::Add";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&a, &b});
    SHARDLINE_CHECK_AS(ShapeError, a.global_shape() == b.global_shape(), kOp,
                       "a and b must have one shape (use BiasAdd to broadcast a bias), got {} and {}",
                       ShapeToString(a.global_shape()), ShapeToString(b.global_shape()));
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::Add(a.local(), b.local(), alpha));
    }
    const Prepared p = PrepareForward(kOp, *mesh, "add", {&a, &b});
    return detail::Shard(kernels::Add(p.inputs[0].local(), p.inputs[1].local(), alpha), p.rule->info.outputs[0], mesh);
}

std::vector<Grad> AddBackward(const AddBackwardArgs &args) {
    constexpr const char *kOp = "dist::AddBackward";
    const auto &[dout, a, b, alpha, need_a, need_b] = args;
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout});
    std::vector<Grad> grads(2);
    if (!need_a && !need_b) {
        return grads;
    }
    if (mesh == nullptr) {
        if (need_a) {
            grads[0].value = dout;
        }
        if (need_b) {
            grads[1].value = alpha == 1.0 ? dout : DistTensor::Local(kernels::Scale(dout.local(), alpha));
        }
        return grads;
    }
    CheckSavedShape(kOp, "a", a, dout);
    CheckSavedShape(kOp, "b", b, dout);
    const PreparedGrad p = PrepareGrad(kOp, *mesh, "add", {&a, &b}, dout);
    const Tensor &g = p.dout.local();
    if (need_a) {
        grads[0].value = detail::Shard(g, p.rule->info.outputs[0], mesh);
    }
    if (need_b) {
        grads[1].value = detail::Shard(alpha == 1.0 ? g : kernels::Scale(g, alpha), p.rule->info.outputs[1], mesh);
    }
    return grads;
}

DistTensor BiasAdd(const DistTensor &x, const DistTensor &bias) {
    constexpr const char *kOp = "dist::BiasAdd";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x, &bias});
    auto run = [](const Tensor &xl, const Tensor &bl) {
        Tensor out = Tensor::Empty(xl.shape(), xl.dtype(), xl.device());
        kernels::BiasAdd({.x = xl, .bias = bl, .out = out});
        return out;
    };
    if (mesh == nullptr) {
        return DistTensor::Local(run(x.local(), bias.local()));
    }
    const Prepared p = PrepareForward(kOp, *mesh, "add", {&x, &bias});
    return detail::Shard(run(p.inputs[0].local(), p.inputs[1].local()), p.rule->info.outputs[0], mesh);
}

Grad BiasAddBackward(const DistTensor &dout, const spmd::TensorSpec &x, const spmd::TensorSpec &bias,
                     const GradSink &bias_sink) {
    constexpr const char *kOp = "dist::BiasAddBackward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout});
    Grad grad;
    if (mesh == nullptr) {
        grad.value = DistTensor::Local(kernels::LinearBackwardBias(dout.local()));
        return grad;
    }
    // The add rule's grad of a broadcast operand: dout summed over the rows, Partial over the mesh dims sharding them.
    CheckSavedShape(kOp, "x", x, dout);
    SHARDLINE_CHECK_AS(
        ShapeError, x.shape.size() >= 1 && bias.shape == Shape{x.shape.back()}, kOp,
        "the saved spec of bias has shape {}, but x's last dim is {} (pass the forward operand's spec())",
        ShapeToString(bias.shape), x.shape.empty() ? std::int64_t{0} : x.shape.back());
    const PreparedGrad p = PrepareGrad(kOp, *mesh, "add", {&x, &bias}, dout);
    const spmd::TensorSpec &spec = p.rule->info.outputs[1];
    const Tensor &g = p.dout.local();
    if (Tensor *sink = bias_sink.BufferFor(mesh, spec.layout)) {
        kernels::LinearBackwardBias({.dy = g, .dbias = *sink, .accumulate = !bias_sink.fresh()});
        bias_sink.Written();
        grad.accumulated = true;
    } else {
        grad.value = detail::Shard(kernels::LinearBackwardBias(g), spec, mesh);
    }
    return grad;
}

DistTensor Scale(const DistTensor &x, double alpha) {
    constexpr const char *kOp = "dist::Scale";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x});
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::Scale(x.local(), alpha));
    }
    const Prepared p = PrepareForward(kOp, *mesh, "scale", {&x});
    return detail::Shard(kernels::Scale(p.inputs[0].local(), alpha), p.rule->info.outputs[0], mesh);
}

} // namespace shardline::dist
