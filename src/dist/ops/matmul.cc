// Matmul (torch.matmul batch broadcasting) and Outer on DistTensors, through the matmul and einsum rules.

#include <shardline/dist/ops.h>
#include <shardline/kernels/matmul.h>
#include <shardline/kernels/outer.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

const spmd::EinsumAttrs kOuterAttrs{.equation = "i,j->ij"};

} // namespace

DistTensor Matmul(const DistTensor &a, const DistTensor &b) {
    constexpr const char *kOp = "dist::Matmul";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&a, &b});
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::MatmulForward(a.local(), b.local()));
    }
    const auto rule = LookupRule(kOp, *mesh, {.op = "matmul", .inputs = {a.spec(), b.spec()}});
    const DistTensor au = detail::Prepare(a, rule->info.inputs[0], rule->input_plans[0]);
    const DistTensor bu = detail::Prepare(b, rule->info.inputs[1], rule->input_plans[1]);
    return detail::Shard(kernels::MatmulForward(au.local(), bu.local()), rule->info.outputs[0], mesh);
}

std::vector<Grad> MatmulBackward(const MatmulBackwardArgs &args) {
    constexpr const char *kOp = "dist::MatmulBackward";
    const auto &[dout, a, b, need_a, need_b] = args;
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout, &a, &b});
    std::vector<Grad> grads(2);
    if (!need_a && !need_b) {
        return grads;
    }
    DistTensor au = a;
    DistTensor bu = b;
    DistTensor du = dout;
    std::shared_ptr<const spmd::CachedRule> rule;
    if (mesh != nullptr) {
        rule = LookupRule(kOp, *mesh,
                          {.op = "matmul",
                           .direction = spmd::RuleDirection::kGrad,
                           .inputs = {a.spec(), b.spec()},
                           .out_grad = dout.spec()});
        au = detail::MoveTo(a, rule->info.inputs[0].layout);
        bu = detail::MoveTo(b, rule->info.inputs[1].layout);
        du = detail::Prepare(dout, rule->info.inputs[2], rule->input_plans[2]);
    }
    auto wrap = [&](Tensor t, int index) {
        return mesh == nullptr ? DistTensor::Local(std::move(t))
                               : detail::Shard(std::move(t), rule->info.outputs[static_cast<std::size_t>(index)], mesh);
    };
    if (need_a) {
        Tensor da = Tensor::Empty(au.local().shape(), au.dtype(), au.device());
        kernels::MatmulBackwardInput({.dout = du.local(), .b = bu.local(), .da = da});
        grads[0].value = wrap(std::move(da), 0);
    }
    if (need_b) {
        Tensor db = Tensor::Empty(bu.local().shape(), bu.dtype(), bu.device());
        kernels::MatmulBackwardOther({.a = au.local(), .dout = du.local(), .db = db});
        grads[1].value = wrap(std::move(db), 1);
    }
    return grads;
}

DistTensor Outer(const DistTensor &x, const DistTensor &y) {
    constexpr const char *kOp = "dist::Outer";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x, &y});
    if (mesh == nullptr) {
        return DistTensor::Local(kernels::OuterForward(x.local(), y.local()));
    }
    const auto rule = LookupRule(kOp, *mesh, {.op = "einsum", .inputs = {x.spec(), y.spec()}, .attrs = kOuterAttrs});
    const DistTensor xu = detail::Prepare(x, rule->info.inputs[0], rule->input_plans[0]);
    const DistTensor yu = detail::Prepare(y, rule->info.inputs[1], rule->input_plans[1]);
    return detail::Shard(kernels::OuterForward(xu.local(), yu.local()), rule->info.outputs[0], mesh);
}

std::vector<Grad> OuterBackward(const OuterBackwardArgs &args) {
    constexpr const char *kOp = "dist::OuterBackward";
    const auto &[dout, x, y, need_x, need_y] = args;
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout, &x, &y});
    std::vector<Grad> grads(2);
    if (!need_x && !need_y) {
        return grads;
    }
    DistTensor xu = x;
    DistTensor yu = y;
    DistTensor du = dout;
    std::shared_ptr<const spmd::CachedRule> rule;
    if (mesh != nullptr) {
        rule = LookupRule(kOp, *mesh,
                          {.op = "einsum",
                           .direction = spmd::RuleDirection::kGrad,
                           .inputs = {x.spec(), y.spec()},
                           .out_grad = dout.spec(),
                           .attrs = kOuterAttrs});
        xu = detail::MoveTo(x, rule->info.inputs[0].layout);
        yu = detail::MoveTo(y, rule->info.inputs[1].layout);
        du = detail::Prepare(dout, rule->info.inputs[2], rule->input_plans[2]);
    }
    Tensor dx;
    Tensor dy;
    if (need_x) {
        dx = Tensor::Empty(xu.local().shape(), xu.dtype(), xu.device());
    }
    if (need_y) {
        dy = Tensor::Empty(yu.local().shape(), yu.dtype(), yu.device());
    }
    kernels::OuterBackward({.dout = du.local(),
                            .x = xu.local(),
                            .y = yu.local(),
                            .dx = need_x ? &dx : nullptr,
                            .dy = need_y ? &dy : nullptr});
    auto wrap = [&](Tensor t, int index) {
        return mesh == nullptr ? DistTensor::Local(std::move(t))
                               : detail::Shard(std::move(t), rule->info.outputs[static_cast<std::size_t>(index)], mesh);
    };
    if (need_x) {
        grads[0].value = wrap(std::move(dx), 0);
    }
    if (need_y) {
        grads[1].value = wrap(std::move(dy), 1);
    }
    return grads;
}

} // namespace shardline::dist
