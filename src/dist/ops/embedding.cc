// Embedding lookup and bag sum on DistTensors. A vocab-sharded table (weight S(0)) gives a Partial(sum) output: each
// rank looks up the ids in its row range and writes zeros for the others (Megatron's VocabParallelEmbedding before its
// all-reduce, which the caller's redistribution to Replicate performs). The bag sum follows the same path under its
// own rule (embedding_bag), with its own kernels.

#include <shardline/dist/ops.h>
#include <shardline/kernels/embedding.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

/// The two lookups on DistTensors, which differ only in their rule and their kernels.
struct Lookup {
    const char *forward_op;  ///< for messages
    const char *backward_op; ///< for messages
    const char *rule;        ///< the SPMD rule
    Tensor (*forward)(const Tensor &ids, const Tensor &weight, std::int64_t vocab_start);
    void (*backward)(const Tensor &ids, const Tensor &dout, Tensor &dweight, std::int64_t vocab_start, bool accumulate);
};

const Lookup kEmbedding{
    .forward_op = "dist::EmbeddingForward",
    .backward_op = "dist::EmbeddingBackward",
    .rule = "embedding",
    .forward = [](const Tensor &ids, const Tensor &weight,
                  std::int64_t vocab_start) { return kernels::EmbeddingForward(ids, weight, vocab_start); },
    .backward =
        [](const Tensor &ids, const Tensor &dout, Tensor &dweight, std::int64_t vocab_start, bool accumulate) {
            kernels::EmbeddingBackward(
                {.ids = ids, .dout = dout, .dweight = dweight, .vocab_start = vocab_start, .accumulate = accumulate});
        },
};

const Lookup kEmbeddingBag{
    .forward_op = "dist::EmbeddingBagForward",
    .backward_op = "dist::EmbeddingBagBackward",
    .rule = "embedding_bag",
    .forward = [](const Tensor &ids, const Tensor &weight,
                  std::int64_t vocab_start) { return kernels::EmbeddingBagForward(ids, weight, vocab_start); },
    .backward =
        [](const Tensor &ids, const Tensor &dout, Tensor &dweight, std::int64_t vocab_start, bool accumulate) {
            kernels::EmbeddingBagBackward(
                {.ids = ids, .dout = dout, .dweight = dweight, .vocab_start = vocab_start, .accumulate = accumulate});
        },
};

DistTensor LookupForward(const Lookup &lookup, const DistTensor &ids, const DistTensor &weight) {
    comm::DeviceMesh *mesh = detail::CommonMesh(lookup.forward_op, {&ids, &weight});
    if (mesh == nullptr) {
        return DistTensor::Local(lookup.forward(ids.local(), weight.local(), 0));
    }
    const auto rule = LookupRule(lookup.forward_op, *mesh, {.op = lookup.rule, .inputs = {ids.spec(), weight.spec()}});
    const DistTensor iu = detail::Prepare(ids, rule->info.inputs[0], rule->input_plans[0]);
    const DistTensor wu = detail::Prepare(weight, rule->info.inputs[1], rule->input_plans[1]);
    return detail::Shard(lookup.forward(iu.local(), wu.local(), detail::LocalOffset(wu, 0)), rule->info.outputs[0],
                         mesh);
}

Grad LookupBackward(const Lookup &lookup, const DistTensor &dout, const DistTensor &ids, const DistTensor &weight,
                    const GradSink &weight_sink) {
    comm::DeviceMesh *mesh = detail::CommonMesh(lookup.backward_op, {&dout, &ids, &weight});
    DistTensor iu = ids;
    DistTensor wu = weight;
    DistTensor du = dout;
    const spmd::TensorSpec *wspec = nullptr;
    std::shared_ptr<const spmd::CachedRule> rule;
    if (mesh != nullptr) {
        rule = LookupRule(lookup.backward_op, *mesh,
                          {.op = lookup.rule,
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
        lookup.backward(iu.local(), du.local(), *sink, vocab_start, /*accumulate=*/!weight_sink.fresh());
        weight_sink.Written();
        grad.accumulated = true;
        return grad;
    }
    Tensor dw = Tensor::Empty(wu.local().shape(), du.dtype(), du.device());
    lookup.backward(iu.local(), du.local(), dw, vocab_start, /*accumulate=*/false);
    grad.value = mesh == nullptr ? DistTensor::Local(std::move(dw)) : detail::Shard(std::move(dw), *wspec, mesh);
    return grad;
}

} // namespace

DistTensor EmbeddingForward(const DistTensor &ids, const DistTensor &weight) {
    return LookupForward(kEmbedding, ids, weight);
}

Grad EmbeddingBackward(const DistTensor &dout, const DistTensor &ids, const DistTensor &weight,
                       const GradSink &weight_sink) {
    return LookupBackward(kEmbedding, dout, ids, weight, weight_sink);
}

DistTensor EmbeddingBagForward(const DistTensor &ids, const DistTensor &weight) {
    return LookupForward(kEmbeddingBag, ids, weight);
}

Grad EmbeddingBagBackward(const DistTensor &dout, const DistTensor &ids, const DistTensor &weight,
                          const GradSink &weight_sink) {
    return LookupBackward(kEmbeddingBag, dout, ids, weight, weight_sink);
}

} // namespace shardline::dist
