// Cross-entropy on DistTensors. With vocab_parallel the logits stay sharded on the class dim (Megatron's
// VocabParallelCrossEntropy): the rule lists the internal all-reduces over that mesh dim; this op runs the row max
// (MAX) and then the sum of exponentials and the target logit packed into one buffer (one SUM instead of two).

#include <shardline/comm/communicator.h>
#include <shardline/dist/ops.h>
#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/elementwise.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

spmd::LossReduction ToSpmd(LossReduction r) {
    switch (r) {
    case LossReduction::kNone:
        return spmd::LossReduction::kNone;
    case LossReduction::kMean:
        return spmd::LossReduction::kMean;
    case LossReduction::kSum:
        return spmd::LossReduction::kSum;
    }
    return spmd::LossReduction::kMean;
}

spmd::CrossEntropyAttrs Attrs(const CrossEntropyOptions &options) {
    return {.reduction = ToSpmd(options.reduction), .vocab_parallel = options.vocab_parallel};
}

DType StatsDType(DType logits) { return logits == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

} // namespace

CrossEntropyResult CrossEntropyForward(const DistTensor &logits, const DistTensor &labels,
                                       const CrossEntropyOptions &options) {
    constexpr const char *kOp = "dist::CrossEntropyForward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&logits, &labels});
    SHARDLINE_CHECK_AS(DTypeError, labels.dtype() == DType::kInt64, kOp, "labels must be int64, got {}",
                       labels.ToString());
    CrossEntropyResult result;
    CrossEntropySaved &saved = result.saved;
    saved.options = options;
    saved.logits_spec = logits.spec();
    saved.global_rows = Numel(labels.global_shape());

    std::shared_ptr<const spmd::CachedRule> rule;
    saved.logits_used = logits;
    saved.labels_used = labels;
    if (mesh != nullptr) {
        rule = LookupRule(kOp, *mesh,
                          {.op = "cross_entropy", .inputs = {logits.spec(), labels.spec()}, .attrs = Attrs(options)});
        saved.logits_used = detail::Prepare(logits, rule->info.inputs[0], rule->input_plans[0]);
        saved.labels_used = detail::Prepare(labels, rule->info.inputs[1], rule->input_plans[1]);
    }
    const Tensor &x = saved.logits_used.local();
    const Tensor &y = saved.labels_used.local();
    const std::int64_t rows = y.numel();
    const DType sd = StatsDType(x.dtype());
    const std::int64_t class_start = mesh == nullptr ? 0 : detail::LocalOffset(saved.logits_used, x.rank() - 1);

    saved.row_max = Tensor::Empty({rows}, sd, x.device());
    kernels::CrossEntropyRowMax({.logits = x, .row_max = saved.row_max});
    std::vector<int> sum_dims;
    if (rule) {
        for (const spmd::InternalCollective &c : rule->info.internal) {
            if (c.reduce_op == spmd::ReduceOp::kMax) {
                mesh->group(c.mesh_dim).AllReduce(saved.row_max, comm::ReduceOp::kMax)->Wait();
            } else if (sum_dims.empty() || sum_dims.back() != c.mesh_dim) {
                sum_dims.push_back(c.mesh_dim);
            }
        }
    }
    // sum_exp and target_logit share one buffer so that one all-reduce sums both.
    Tensor stats = Tensor::Empty({2, rows}, sd, x.device());
    const std::size_t half = static_cast<std::size_t>(rows) * ElementSize(sd);
    saved.stats = stats;
    saved.sum_exp = Tensor::FromBlob(stats.data(), {rows}, sd, x.device());
    Tensor target = Tensor::FromBlob(static_cast<char *>(stats.data()) + half, {rows}, sd, x.device());
    kernels::CrossEntropyStats({.logits = x,
                                .row_max = saved.row_max,
                                .labels = y,
                                .class_start = class_start,
                                .sum_exp = saved.sum_exp,
                                .target_logit = target});
    for (int d : sum_dims) {
        mesh->group(d).AllReduce(stats, comm::ReduceOp::kSum)->Wait();
    }
    Tensor loss = Tensor::Empty(y.shape(), sd, x.device());
    Tensor loss_flat = loss.View({rows});
    kernels::CrossEntropyLoss(
        {.row_max = saved.row_max, .sum_exp = saved.sum_exp, .target_logit = target, .loss = loss_flat});
    if (options.reduction != LossReduction::kNone) {
        loss = kernels::Sum(loss);
        if (options.reduction == LossReduction::kMean) {
            loss = kernels::Scale(loss, 1.0 / static_cast<double>(std::max<std::int64_t>(1, saved.global_rows)));
        }
    }
    result.loss = mesh == nullptr ? DistTensor::Local(std::move(loss))
                                  : detail::Shard(std::move(loss), rule->info.outputs[0], mesh);
    return result;
}

DistTensor CrossEntropyBackward(const DistTensor &dloss, const CrossEntropySaved &saved) {
    constexpr const char *kOp = "dist::CrossEntropyBackward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&dloss, &saved.logits_used});
    DistTensor du = dloss;
    DistTensor x = saved.logits_used;
    std::shared_ptr<const spmd::CachedRule> rule;
    if (mesh != nullptr) {
        rule = LookupRule(kOp, *mesh,
                          {.op = "cross_entropy",
                           .direction = spmd::RuleDirection::kGrad,
                           .inputs = {saved.logits_spec, saved.labels_used.spec()},
                           .out_grad = dloss.spec(),
                           .attrs = Attrs(saved.options)});
        const std::size_t g = rule->info.inputs.size() - 1;
        du = detail::Prepare(dloss, rule->info.inputs[g], rule->input_plans[g]);
        SHARDLINE_CHECK(SameLayout(*mesh, rule->info.inputs[0].layout, x.layout()), kOp,
                        "the grad rule wants logits in {}, the forward used {}", rule->info.inputs[0].layout.ToString(),
                        x.layout().ToString());
    }
    const Tensor &xl = x.local();
    Tensor d = du.local();
    if (d.dtype() != saved.row_max.dtype()) {
        d = d.To(saved.row_max.dtype());
    }
    const double scale = saved.options.reduction == LossReduction::kMean
                             ? 1.0 / static_cast<double>(std::max<std::int64_t>(1, saved.global_rows))
                             : 1.0;
    Tensor dlogits = Tensor::Empty(xl.shape(), xl.dtype(), xl.device());
    kernels::CrossEntropyBackward({.logits = xl,
                                   .row_max = saved.row_max,
                                   .sum_exp = saved.sum_exp,
                                   .labels = saved.labels_used.local(),
                                   .class_start = mesh == nullptr ? 0 : detail::LocalOffset(x, xl.rank() - 1),
                                   .dloss = d,
                                   .scale = scale,
                                   .dlogits = dlogits});
    return mesh == nullptr ? DistTensor::Local(std::move(dlogits))
                           : detail::Shard(std::move(dlogits), rule->info.outputs[0], mesh);
}

} // namespace shardline::dist
