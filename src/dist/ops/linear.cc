// dist::LinearForward / LinearBackward: the linear rule decides every layout, so column- and row-parallel Linear get
// DESIGN §6's communication from the rule and the planner, not from hand-written mappings:
//   column (weight S(0) on tp): x must be Replicate on tp (sequence parallel: all-gather), y S(-1); dx Partial(tp)
//   row (weight S(1) on tp): x S(-1), y Partial(tp) -> output_layout (all-reduce or reduce-scatter), then + bias.

#include <fmt/format.h>

#include <shardline/dist/ops.h>
#include <shardline/kernels/linear.h>

#include "ops_util.h"

namespace shardline::dist {
namespace {

std::optional<spmd::TensorSpec> SpecOf(const DistTensor *t) {
    if (t == nullptr) {
        return std::nullopt;
    }
    return t->spec();
}

} // namespace

LinearForwardResult LinearForward(const DistTensor &x, const DistTensor &weight, const DistTensor *bias,
                                  const LinearForwardOptions &options) {
    constexpr const char *kOp = "dist::LinearForward";
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&x, &weight, bias});
    LinearForwardResult result;
    LinearSaved &saved = result.saved;
    saved.x_spec = x.spec();
    saved.weight_spec = weight.spec();
    saved.bias_spec = SpecOf(bias);
    const bool add_bias = bias != nullptr && !options.skip_bias;
    saved.bias_added = add_bias;

    if (mesh == nullptr) {
        SHARDLINE_CHECK(!options.output_layout || options.output_layout->IsReplicated(), kOp,
                        "local tensors have no mesh to move the output to {}", options.output_layout->ToString());
        saved.x_used = x;
        saved.gemm_output_layout = spmd::Layout::Replicated(x.local().rank());
        Tensor y = kernels::LinearForward(x.local(), weight.local(), add_bias ? &bias->local() : nullptr);
        result.y = DistTensor::Local(std::move(y));
        return result;
    }

    spmd::RuleRequest request{.op = "linear", .inputs = {x.spec(), weight.spec()}};
    if (bias != nullptr) {
        request.inputs.push_back(bias->spec());
    }
    const auto rule = LookupRule(kOp, *mesh, std::move(request));
    const spmd::SpmdInfo &info = rule->info;
    saved.x_used = detail::Prepare(x, info.inputs[0], rule->input_plans[0]);
    const DistTensor w = detail::Prepare(weight, info.inputs[1], rule->input_plans[1]);
    DistTensor b;
    if (bias != nullptr) {
        b = detail::Prepare(*bias, info.inputs[2], rule->input_plans[2]);
    }
    const spmd::TensorSpec &out = info.outputs[0];
    saved.gemm_output_layout = out.layout;
    saved.bias_after_output = add_bias && info.bias_after_reduction;

    // Column parallel: the bias rides in the GEMM epilogue (one launch). Row parallel: after the reduction, once.
    const bool fused_bias = add_bias && !info.bias_after_reduction;
    Tensor y_local = kernels::LinearForward(saved.x_used.local(), w.local(), fused_bias ? &b.local() : nullptr);
    DistTensor y = detail::Shard(std::move(y_local), out, mesh);
    if (options.output_layout) {
        y = detail::MoveTo(y, *options.output_layout);
    }
    if (saved.bias_after_output) {
        SHARDLINE_CHECK(!y.layout().IsPartial(), kOp,
                        "the output {} is Partial, so the bias must be added after its reduction: pass an "
                        "output_layout without Partial (e.g. replicated), or skip_bias",
                        y.ToString());
        y = BiasAdd(y, b);
    }
    result.y = std::move(y);
    return result;
}

LinearGrads LinearBackward(const LinearBackwardArgs &args) {
    constexpr const char *kOp = "dist::LinearBackward";
    const LinearSaved &saved = args.saved;
    SHARDLINE_CHECK(!args.need_input || args.weight != nullptr, kOp, "the input grad needs the weight");
    SHARDLINE_CHECK(!args.need_weight || saved.x_used.defined(), kOp, "the weight grad needs the saved input");
    SHARDLINE_CHECK(!args.need_bias || saved.bias_spec.has_value(), kOp, "a bias grad was asked for without a bias");
    comm::DeviceMesh *mesh = detail::CommonMesh(kOp, {&args.dy, args.weight});
    LinearGrads grads;
    // A local result, or a shard in the layout the grad rule gave.
    auto wrap = [mesh](Tensor t, const spmd::TensorSpec *spec) {
        return mesh == nullptr ? DistTensor::Local(std::move(t)) : detail::Shard(std::move(t), *spec, mesh);
    };

    DistTensor dy = args.dy;
    // Row parallel: the bias was added after the output's redistribution, so its grad is a row sum of dy.
    // When dX or dW is needed, dy is gathered for them anyway and the bias grad comes from it below (no extra
    // collective); only a bias-only backward sums the rows where dy is (then Partial, reduced by the caller).
    const bool gemm_grads = args.need_input || args.need_weight;
    if (args.need_bias && saved.bias_after_output && !gemm_grads) {
        spmd::RuleRequest request{.op = "add",
                                  .direction = spmd::RuleDirection::kGrad,
                                  .inputs = {dy.spec(), *saved.bias_spec},
                                  .out_grad = dy.spec()};
        const auto rule = LookupRule(kOp, *mesh, std::move(request));
        const spmd::TensorSpec &spec = rule->info.outputs.back();
        const DistTensor dy_used = detail::Prepare(dy, rule->info.inputs.back(), rule->input_plans.back());
        if (Tensor *sink = detail::SinkFor(mesh, args.bias_sink, spec.layout)) {
            kernels::LinearBackwardBias({.dy = dy_used.local(), .dbias = *sink, .accumulate = true});
            grads.dbias.accumulated = true;
        } else {
            grads.dbias.value = wrap(kernels::LinearBackwardBias(dy_used.local()), &spec);
        }
    }

    if (!args.need_input && !args.need_weight && (!args.need_bias || saved.bias_after_output)) {
        return grads;
    }
    // The grad rule's layouts (or, for local tensors, none).
    std::shared_ptr<const spmd::CachedRule> rule;
    const spmd::TensorSpec *x_grad = nullptr;
    const spmd::TensorSpec *w_grad = nullptr;
    const spmd::TensorSpec *b_grad = nullptr;
    DistTensor x = saved.x_used;
    DistTensor w = args.weight != nullptr ? *args.weight : DistTensor();
    if (mesh != nullptr) {
        // dy back to the GEMM output's layout (Partial dims read as Replicate: every rank's local got the same dy).
        dy = detail::MoveTo(dy, saved.gemm_output_layout.WithoutPartial());
        spmd::RuleRequest request{.op = "linear",
                                  .direction = spmd::RuleDirection::kGrad,
                                  .inputs = {saved.x_spec, saved.weight_spec},
                                  .out_grad = dy.spec()};
        if (saved.bias_spec) {
            request.inputs.push_back(*saved.bias_spec);
        }
        rule = LookupRule(kOp, *mesh, std::move(request));
        const spmd::SpmdInfo &info = rule->info;
        const std::size_t dy_index = info.inputs.size() - 1;
        dy = detail::Prepare(dy, info.inputs[dy_index], rule->input_plans[dy_index]);
        x_grad = &info.Output("x_grad");
        w_grad = &info.Output("weight_grad");
        b_grad = saved.bias_spec ? &info.Output("bias_grad") : nullptr;
        if (args.need_weight) {
            x = detail::MoveTo(x, info.Input("x").layout);
        }
        if (args.need_input) {
            w = detail::MoveTo(w, info.Input("weight").layout);
        }
    }
    const Tensor &dyl = dy.local();

    if (args.need_input) {
        grads.dx.value = wrap(kernels::LinearBackwardInput(dyl, w.local()), x_grad);
    }
    const bool bias_here = args.need_bias && (!saved.bias_after_output || gemm_grads);
    Tensor *bsink = bias_here ? detail::SinkFor(mesh, args.bias_sink, b_grad ? b_grad->layout : spmd::Layout())
                              : nullptr;
    bool bias_done = false;
    if (args.need_weight) {
        Tensor *wsink = detail::SinkFor(mesh, args.weight_sink, w_grad ? w_grad->layout : spmd::Layout());
        // The bias grad rides on the weight-grad GEMM (BGRADB where the provider fuses it) when both land alike.
        const bool fuse_bias = bias_here && ((wsink != nullptr) == (bsink != nullptr));
        Tensor db;
        if (fuse_bias && bsink == nullptr) {
            db = Tensor::Empty({dyl.shape().back()}, dyl.dtype(), dyl.device());
        }
        Tensor *dbias = fuse_bias ? (bsink != nullptr ? bsink : &db) : nullptr;
        if (wsink != nullptr) {
            kernels::LinearBackwardWeight(
                {.dy = dyl, .x = x.local(), .dweight = *wsink, .dbias = dbias, .accumulate = true});
            grads.dweight.accumulated = true;
        } else {
            Tensor dw = Tensor::Empty({dyl.shape().back(), x.local().shape().back()}, x.dtype(), dyl.device());
            kernels::LinearBackwardWeight({.dy = dyl, .x = x.local(), .dweight = dw, .dbias = dbias});
            grads.dweight.value = wrap(std::move(dw), w_grad);
        }
        if (fuse_bias) {
            bias_done = true;
            if (bsink != nullptr) {
                grads.dbias.accumulated = true;
            } else {
                grads.dbias.value = wrap(std::move(db), b_grad);
            }
        }
    }
    if (bias_here && !bias_done) {
        if (bsink != nullptr) {
            kernels::LinearBackwardBias({.dy = dyl, .dbias = *bsink, .accumulate = true});
            grads.dbias.accumulated = true;
        } else {
            grads.dbias.value = wrap(kernels::LinearBackwardBias(dyl), b_grad);
        }
    }
    return grads;
}

} // namespace shardline::dist
