// Embedding lookup on DistTensors. A vocab-sharded table (weight S(0)) gives a Partial(sum) output: each rank looks
// up the ids in its row range and writes zeros for the others (Megatron's VocabParallelEmbedding before its
// all-reduce, which the caller's redistribution to Replicate performs).

#include <shardline/dist/ops.h>
#include <shardline/kernels/embedding.h>

#include "ops_util.h"

namespace shardline::dist {

DistTensor EmbeddingForward(const DistTensor &ids, const DistTensor &weight) {
    constexpr const char *kOp = "dist::EmbeddingForward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&ids, &weight});
    auto run = [](const Tensor &il, const Tensor &wl, std::int64_t vocab_start) {
        Shape shape = il.shape();
        shape.push_back(wl.size(1));
        Tensor out = Tensor::Empty(shape, wl.dtype(), wl.device());
        kernels::EmbeddingForward({.ids = il, .weight = wl, .out = out, .vocab_start = vocab_start});
        return out;
    };
    if (mesh == nullptr) {
        return DistTensor::Local(run(ids.local(), weight.local(), 0));
    }
    const auto rule = LookupRule(kOp, *mesh, {.op = "embedding", .inputs = {ids.spec(), weight.spec()}});
    const DistTensor iu = detail::Prepare(ids, rule->info.inputs[0], rule->input_plans[0]);
    const DistTensor wu = detail::Prepare(weight, rule->info.inputs[1], rule->input_plans[1]);
    return detail::Shard(run(iu.local(), wu.local(), detail::LocalOffset(wu, 0)), rule->info.outputs[0], mesh);
}

Grad EmbeddingBackward(const DistTensor &dout, const DistTensor &ids, const DistTensor &weight,
                       const GradSink &weight_sink) {
    constexpr const char *kOp = "dist::EmbeddingBackward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dout, &ids, &weight});
    DistTensor iu = ids;
    DistTensor wu = weight;
    DistTensor du = dout;
    const spmd::TensorSpec *wspec = nullptr;
    std::shared_ptr<const spmd::CachedRule> rule;
    if (mesh != nullptr) {
        rule = LookupRule(kOp, *mesh,
                          {.op = "embedding",
                           .direction = spmd::RuleDirection::kGrad,
                           .inputs = {ids.spec(), weight.spec()},
                           .out_grad = dout.spec()});
        iu = detail::MoveTo(ids, rule->info.inputs[0].layout);
        wu = detail::MoveTo(weight, rule->info.inputs[1].layout);
        du = detail::Prepare(dout, rule->info.inputs[2], rule->input_plans[2]);
        wspec = &rule->info.outputs[0];
    }
    const std::int64_t vocab_start = detail::LocalOffset(wu, 0);
    Grad grad;
    if (Tensor *sink = weight_sink.BufferFor(mesh, wspec != nullptr ? wspec->layout : spmd::Layout())) {
        kernels::EmbeddingBackward(
            {.ids = iu.local(), .dout = du.local(), .dweight = *sink, .vocab_start = vocab_start, .accumulate = true});
        grad.accumulated = true;
        return grad;
    }
    Tensor dw = Tensor::Empty(wu.local().shape(), du.dtype(), du.device());
    kernels::EmbeddingBackward(
        {.ids = iu.local(), .dout = du.local(), .dweight = dw, .vocab_start = vocab_start, .accumulate = false});
    grad.value = mesh == nullptr ? DistTensor::Local(std::move(dw)) : detail::Shard(std::move(dw), *wspec, mesh);
    return grad;
}

} // namespace shardline::dist
