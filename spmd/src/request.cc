// shardline-spmd requests: one JSON object in, one JSON answer out (docs/spmd.md has the schema).

#include <functional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>
#include <shardline/spmd/rules.h>

#include "json_util.h"

namespace shardline::spmd {

using nlohmann::json;

namespace {

enum class Direction { kForward, kReverse, kGrad };

struct Context {
    std::string op;
    Direction direction = Direction::kForward;
    ProcessMesh mesh;
    std::vector<TensorSpec> inputs;
    std::optional<TensorSpec> out;      // reverse
    std::optional<TensorSpec> out_grad; // grad
    json attrs = json::object();
    RuleOptions options;
};

class Attrs {
public:
    Attrs(const Context &ctx, std::set<std::string> known) : ctx_(ctx) {
        if (!ctx.attrs.is_object()) {
            throw SpmdError(fmt::format("attrs: expected an object, got {}", ctx.attrs.type_name()));
        }
        for (const auto &[key, value] : ctx.attrs.items()) {
            if (known.count(key) == 0) {
                throw SpmdError(fmt::format("attrs.{}: unknown attribute for {} (known: [{}])", key, ctx.op,
                                            fmt::join(known, ",")));
            }
        }
    }
    bool Bool(const std::string &key, bool fallback) const {
        return ctx_.attrs.contains(key) ? detail::AsBool(ctx_.attrs[key], "attrs." + key) : fallback;
    }
    int Int(const std::string &key, int fallback) const {
        return ctx_.attrs.contains(key) ? static_cast<int>(detail::AsInt(ctx_.attrs[key], "attrs." + key)) : fallback;
    }
    std::string String(const std::string &key, const std::string &fallback) const {
        return ctx_.attrs.contains(key) ? detail::AsString(ctx_.attrs[key], "attrs." + key) : fallback;
    }
    std::vector<int64_t> IntList(const std::string &key) const {
        return ctx_.attrs.contains(key) ? detail::AsIntList(ctx_.attrs[key], "attrs." + key) : std::vector<int64_t>{};
    }
    bool Has(const std::string &key) const { return ctx_.attrs.contains(key); }

private:
    const Context &ctx_;
};

void ExpectInputs(const Context &ctx, size_t min_count, size_t max_count, std::string_view names) {
    if (ctx.inputs.size() < min_count || ctx.inputs.size() > max_count) {
        throw SpmdError(fmt::format("inputs: {} expects {} input(s) ({}), got {}", ctx.op,
                                    min_count == max_count ? std::to_string(min_count)
                                                           : fmt::format("{} to {}", min_count, max_count),
                                    names, ctx.inputs.size()));
    }
}

const TensorSpec &Out(const Context &ctx) {
    return *ctx.out;
}
const TensorSpec &OutGrad(const Context &ctx) {
    return *ctx.out_grad;
}

std::vector<int> ToIntVector(const std::vector<int64_t> &v) {
    return std::vector<int>(v.begin(), v.end());
}

SpmdInfo RunMatmul(const Context &ctx) {
    ExpectInputs(ctx, 2, 2, "x, y");
    const Attrs a(ctx, {"trans_x", "trans_y"});
    const MatmulAttrs attrs{.trans_x = a.Bool("trans_x", false), .trans_y = a.Bool("trans_y", false)};
    const auto &x = ctx.inputs[0];
    const auto &y = ctx.inputs[1];
    switch (ctx.direction) {
    case Direction::kForward:
        return InferMatmulForward(ctx.mesh, x, y, attrs, ctx.options);
    case Direction::kReverse:
        return InferMatmulReverse(ctx.mesh, x, y, Out(ctx), attrs, ctx.options);
    case Direction::kGrad:
        return InferMatmulGrad(ctx.mesh, x, y, OutGrad(ctx), attrs, ctx.options);
    }
    return {};
}

SpmdInfo RunLinear(const Context &ctx) {
    ExpectInputs(ctx, 2, 3, "x, weight, optional bias");
    const Attrs a(ctx, {});
    std::optional<TensorSpec> bias;
    if (ctx.inputs.size() == 3) {
        bias = ctx.inputs[2];
    }
    switch (ctx.direction) {
    case Direction::kForward:
        return InferLinearForward(ctx.mesh, ctx.inputs[0], ctx.inputs[1], bias, ctx.options);
    case Direction::kReverse:
        return InferLinearReverse(ctx.mesh, ctx.inputs[0], ctx.inputs[1], bias, Out(ctx), ctx.options);
    case Direction::kGrad:
        return InferLinearGrad(ctx.mesh, ctx.inputs[0], ctx.inputs[1], bias, OutGrad(ctx), ctx.options);
    }
    return {};
}

SpmdInfo RunElementwise(const Context &ctx) {
    const size_t arity = static_cast<size_t>(ElementwiseArity(ctx.op));
    ExpectInputs(ctx, arity, arity, arity == 1 ? "x" : "x, y");
    const Attrs a(ctx, {});
    switch (ctx.direction) {
    case Direction::kForward:
        return InferElementwiseForward(ctx.mesh, ctx.op, ctx.inputs, ctx.options);
    case Direction::kReverse:
        return InferElementwiseReverse(ctx.mesh, ctx.op, ctx.inputs, Out(ctx), ctx.options);
    case Direction::kGrad:
        return InferElementwiseGrad(ctx.mesh, ctx.op, ctx.inputs, OutGrad(ctx), ctx.options);
    }
    return {};
}

SpmdInfo RunReduction(const Context &ctx, ReductionKind kind) {
    ExpectInputs(ctx, 1, 1, "x");
    const Attrs a(ctx, {"axes", "keepdim"});
    const ReductionAttrs attrs{
        .kind = kind, .axes = ToIntVector(a.IntList("axes")), .keepdim = a.Bool("keepdim", false)};
    switch (ctx.direction) {
    case Direction::kForward:
        return InferReductionForward(ctx.mesh, ctx.inputs[0], attrs, ctx.options);
    case Direction::kReverse:
        return InferReductionReverse(ctx.mesh, ctx.inputs[0], Out(ctx), attrs, ctx.options);
    case Direction::kGrad:
        return InferReductionGrad(ctx.mesh, ctx.inputs[0], OutGrad(ctx), attrs, ctx.options);
    }
    return {};
}

SpmdInfo RunEmbedding(const Context &ctx) {
    ExpectInputs(ctx, 2, 2, "ids, weight");
    const Attrs a(ctx, {});
    switch (ctx.direction) {
    case Direction::kForward:
        return InferEmbeddingForward(ctx.mesh, ctx.inputs[0], ctx.inputs[1], ctx.options);
    case Direction::kReverse:
        return InferEmbeddingReverse(ctx.mesh, ctx.inputs[0], ctx.inputs[1], Out(ctx), ctx.options);
    case Direction::kGrad:
        return InferEmbeddingGrad(ctx.mesh, ctx.inputs[0], ctx.inputs[1], OutGrad(ctx), ctx.options);
    }
    return {};
}

SpmdInfo RunSoftmax(const Context &ctx, bool log) {
    ExpectInputs(ctx, 1, 1, "x");
    const Attrs a(ctx, {"axis", "vocab_parallel"});
    const SoftmaxAttrs attrs{.axis = a.Int("axis", -1), .log = log, .vocab_parallel = a.Bool("vocab_parallel", false)};
    switch (ctx.direction) {
    case Direction::kForward:
        return InferSoftmaxForward(ctx.mesh, ctx.inputs[0], attrs, ctx.options);
    case Direction::kReverse:
        return InferSoftmaxReverse(ctx.mesh, ctx.inputs[0], Out(ctx), attrs, ctx.options);
    case Direction::kGrad:
        return InferSoftmaxGrad(ctx.mesh, ctx.inputs[0], OutGrad(ctx), attrs, ctx.options);
    }
    return {};
}

SpmdInfo RunCrossEntropy(const Context &ctx) {
    ExpectInputs(ctx, 2, 2, "logits, labels");
    const Attrs a(ctx, {"reduction", "vocab_parallel"});
    const std::string reduction = a.String("reduction", "none");
    CrossEntropyAttrs attrs{.reduction = LossReduction::kNone, .vocab_parallel = a.Bool("vocab_parallel", false)};
    if (reduction == "mean") {
        attrs.reduction = LossReduction::kMean;
    } else if (reduction == "sum") {
        attrs.reduction = LossReduction::kSum;
    } else if (reduction != "none") {
        throw SpmdError(fmt::format("attrs.reduction: expected none, mean or sum, got '{}'", reduction));
    }
    switch (ctx.direction) {
    case Direction::kForward:
        return InferCrossEntropyForward(ctx.mesh, ctx.inputs[0], ctx.inputs[1], attrs, ctx.options);
    case Direction::kReverse:
        return InferCrossEntropyReverse(ctx.mesh, ctx.inputs[0], ctx.inputs[1], Out(ctx), attrs, ctx.options);
    case Direction::kGrad:
        return InferCrossEntropyGrad(ctx.mesh, ctx.inputs[0], ctx.inputs[1], OutGrad(ctx), attrs, ctx.options);
    }
    return {};
}

SpmdInfo RunTranspose(const Context &ctx) {
    ExpectInputs(ctx, 1, 1, "x");
    const Attrs a(ctx, {"perm"});
    if (!a.Has("perm")) {
        throw SpmdError("attrs.perm: transpose needs a permutation, e.g. [1,0]");
    }
    const std::vector<int> perm = ToIntVector(a.IntList("perm"));
    switch (ctx.direction) {
    case Direction::kForward:
        return InferTransposeForward(ctx.mesh, ctx.inputs[0], perm, ctx.options);
    case Direction::kReverse:
        return InferTransposeReverse(ctx.mesh, ctx.inputs[0], Out(ctx), perm, ctx.options);
    case Direction::kGrad:
        return InferTransposeGrad(ctx.mesh, ctx.inputs[0], OutGrad(ctx), perm, ctx.options);
    }
    return {};
}

SpmdInfo RunReshape(const Context &ctx) {
    ExpectInputs(ctx, 1, 1, "x");
    const Attrs a(ctx, {"shape"});
    if (ctx.direction != Direction::kReverse && !a.Has("shape")) {
        throw SpmdError("attrs.shape: reshape needs the target shape, e.g. [-1, 64]");
    }
    switch (ctx.direction) {
    case Direction::kForward:
        return InferReshapeForward(ctx.mesh, ctx.inputs[0], a.IntList("shape"), ctx.options);
    case Direction::kReverse:
        return InferReshapeReverse(ctx.mesh, ctx.inputs[0], Out(ctx), ctx.options);
    case Direction::kGrad:
        return InferReshapeGrad(ctx.mesh, ctx.inputs[0], OutGrad(ctx), a.IntList("shape"), ctx.options);
    }
    return {};
}

SpmdInfo RunEinsum(const Context &ctx) {
    const Attrs a(ctx, {"equation"});
    if (!a.Has("equation")) {
        throw SpmdError("attrs.equation: einsum needs an equation, e.g. \"mk,kn->mn\"");
    }
    const std::string equation = a.String("equation", "");
    switch (ctx.direction) {
    case Direction::kForward:
        return InferEinsumOpForward(ctx.mesh, equation, ctx.inputs, ctx.options);
    case Direction::kReverse:
        return InferEinsumOpReverse(ctx.mesh, equation, ctx.inputs, Out(ctx), ctx.options);
    case Direction::kGrad:
        return InferEinsumOpGrad(ctx.mesh, equation, ctx.inputs, OutGrad(ctx), ctx.options);
    }
    return {};
}

using Handler = std::function<SpmdInfo(const Context &)>;

const std::map<std::string, Handler> &Handlers() {
    static const std::map<std::string, Handler> handlers = [] {
        std::map<std::string, Handler> h;
        h["matmul"] = RunMatmul;
        h["linear"] = RunLinear;
        h["embedding"] = RunEmbedding;
        h["softmax"] = [](const Context &c) { return RunSoftmax(c, false); };
        h["log_softmax"] = [](const Context &c) { return RunSoftmax(c, true); };
        h["cross_entropy"] = RunCrossEntropy;
        h["transpose"] = RunTranspose;
        h["reshape"] = RunReshape;
        h["einsum"] = RunEinsum;
        h["sum"] = [](const Context &c) { return RunReduction(c, ReductionKind::kSum); };
        h["mean"] = [](const Context &c) { return RunReduction(c, ReductionKind::kMean); };
        h["max"] = [](const Context &c) { return RunReduction(c, ReductionKind::kMax); };
        h["min"] = [](const Context &c) { return RunReduction(c, ReductionKind::kMin); };
        for (const char *name :
             {"add", "subtract", "multiply", "divide", "maximum", "minimum", "pow", "relu",  "sigmoid", "tanh",
              "exp", "log",      "sqrt",     "gelu",   "silu",    "abs",     "neg", "scale", "cast",    "identity"}) {
            h[name] = RunElementwise;
        }
        return h;
    }();
    return handlers;
}

PlanOptions PlanOptionsFromJson(const json &request) {
    PlanOptions plan;
    if (request.contains("element_size") && request.contains("dtype")) {
        throw SpmdError("element_size: give element_size or dtype, not both");
    }
    if (request.contains("element_size")) {
        plan.element_size = detail::AsInt(request["element_size"], "element_size");
        if (plan.element_size < 1) {
            throw SpmdError(fmt::format("element_size: must be >= 1, got {}", plan.element_size));
        }
    } else if (request.contains("dtype")) {
        static const std::map<std::string, int64_t> kSizes = {{"float32", 4}, {"float16", 2}, {"bfloat16", 2},
                                                              {"float64", 8}, {"int64", 8},   {"int32", 4}};
        const std::string dtype = detail::AsString(request["dtype"], "dtype");
        auto it = kSizes.find(dtype);
        if (it == kSizes.end()) {
            throw SpmdError(
                fmt::format("dtype: expected float32, float16, bfloat16, float64, int64 or int32, got '{}'", dtype));
        }
        plan.element_size = it->second;
    }
    if (request.contains("cost_model")) {
        const json &c = request["cost_model"];
        if (!c.is_object()) {
            throw SpmdError(fmt::format("cost_model: expected an object, got {}", c.type_name()));
        }
        for (const auto &[key, value] : c.items()) {
            const std::string f = "cost_model." + key;
            if (key == "alpha_us") {
                plan.cost.alpha_us = detail::AsNumber(value, f);
            } else if (key == "bandwidth_gb_per_s") {
                plan.cost.bandwidth_gb_per_s = detail::AsNumber(value, f);
            } else if (key == "flops_per_us") {
                plan.cost.flops_per_us = detail::AsNumber(value, f);
            } else if (key == "alpha_us_per_dim" || key == "bandwidth_gb_per_s_per_dim") {
                std::vector<double> values;
                for (size_t i = 0; i < detail::AsArray(value, f).size(); ++i) {
                    values.push_back(detail::AsNumber(value[i], detail::Index(f, i)));
                }
                (key == "alpha_us_per_dim" ? plan.cost.alpha_us_per_dim : plan.cost.bandwidth_gb_per_s_per_dim) =
                    values;
            } else {
                throw SpmdError(fmt::format("{}: unknown field (known: alpha_us, bandwidth_gb_per_s, alpha_us_per_dim, "
                                            "bandwidth_gb_per_s_per_dim, flops_per_us)",
                                            f));
            }
        }
        if (plan.cost.bandwidth_gb_per_s <= 0) {
            throw SpmdError("cost_model.bandwidth_gb_per_s: must be > 0");
        }
    }
    return plan;
}

json HandleRedistribute(const json &request, const ProcessMesh &mesh, const PlanOptions &plan_options) {
    const json &src_json = detail::Require(request, "src", "");
    const json &dst_json = detail::Require(request, "dst", "");
    std::vector<int64_t> shape;
    if (request.contains("shape")) {
        shape = detail::AsIntList(request["shape"], "shape");
    } else if (src_json.is_object() && src_json.contains("shape")) {
        shape = detail::AsIntList(src_json["shape"], "src.shape");
    } else {
        throw SpmdError("shape: missing; give the global shape as \"shape\" or \"src.shape\"");
    }
    for (int64_t s : shape) {
        if (s < 0) {
            throw SpmdError(fmt::format("shape: dims must be >= 0, got {}", ShapeToString(shape)));
        }
    }
    if (dst_json.is_object() && dst_json.contains("shape") &&
        detail::AsIntList(dst_json["shape"], "dst.shape") != shape) {
        throw SpmdError(fmt::format("dst.shape: must equal the source shape {}", ShapeToString(shape)));
    }
    const int rank = static_cast<int>(shape.size());
    const Layout src = LayoutFromJson(src_json, mesh, rank, "src");
    const Layout dst = LayoutFromJson(dst_json, mesh, rank, "dst");
    const RedistributePlan plan = PlanRedistribute(mesh, shape, src, dst, plan_options);
    json answer = PlanToJson(plan, mesh);
    answer["op"] = "redistribute";
    answer["src"] = TensorToJson("src", {shape, src.Canonical(mesh)}, mesh);
    answer["dst"] = TensorToJson("dst", {shape, dst.Canonical(mesh)}, mesh);
    return answer;
}

json TensorWithPlan(const std::string &name, const TensorSpec &spec, const ProcessMesh &mesh,
                    const std::optional<TensorSpec> &from, const std::optional<Layout> &to, const PlanOptions &plan) {
    json j = TensorToJson(name, spec, mesh);
    if (from) {
        j["redistribute"] = PlanToJson(PlanRedistribute(mesh, spec.shape, from->layout, spec.layout, plan), mesh);
    }
    if (to) {
        j["redistribute_to"] = TensorToJson(name, {spec.shape, *to}, mesh);
        j["redistribute_to"].erase("name");
        j["redistribute_to"]["plan"] = PlanToJson(PlanRedistribute(mesh, spec.shape, spec.layout, *to, plan), mesh);
    }
    return j;
}

} // namespace

json HandleRequest(const json &request) {
    if (!request.is_object()) {
        throw SpmdError(fmt::format("request: expected a JSON object, got {}", request.type_name()));
    }
    const std::string op = detail::AsString(detail::Require(request, "op", ""), "op");
    const ProcessMesh mesh = MeshFromJson(detail::Require(request, "mesh", ""), "mesh");
    const PlanOptions plan_options = PlanOptionsFromJson(request);
    if (op == "redistribute") {
        return HandleRedistribute(request, mesh, plan_options);
    }
    auto handler = Handlers().find(op);
    if (handler == Handlers().end()) {
        std::vector<std::string> names = {"redistribute"};
        for (const auto &[name, h] : Handlers()) {
            names.push_back(name);
        }
        throw SpmdError(fmt::format("op: unknown op '{}' (known: [{}])", op, fmt::join(names, ",")));
    }
    Context ctx;
    ctx.op = op;
    ctx.mesh = mesh;
    ctx.options.plan = plan_options;
    const std::string direction =
        request.contains("direction") ? detail::AsString(request["direction"], "direction") : std::string("forward");
    if (direction == "forward") {
        ctx.direction = Direction::kForward;
    } else if (direction == "reverse") {
        ctx.direction = Direction::kReverse;
    } else if (direction == "grad") {
        ctx.direction = Direction::kGrad;
    } else {
        throw SpmdError(fmt::format("direction: expected forward, reverse or grad, got '{}'", direction));
    }
    const std::string mode =
        request.contains("mode") ? detail::AsString(request["mode"], "mode") : std::string("deterministic");
    if (mode == "cost") {
        ctx.options.mode = RuleMode::kCostBased;
    } else if (mode != "deterministic") {
        throw SpmdError(fmt::format("mode: expected deterministic or cost, got '{}'", mode));
    }
    const json &inputs = detail::AsArray(detail::Require(request, "inputs", ""), "inputs");
    std::vector<std::string> given_names;
    for (size_t i = 0; i < inputs.size(); ++i) {
        ctx.inputs.push_back(TensorFromJson(inputs[i], mesh, detail::Index("inputs", i)));
        given_names.push_back(inputs[i].contains("name")
                                  ? detail::AsString(inputs[i]["name"], detail::Index("inputs", i) + ".name")
                                  : std::string());
    }
    std::vector<std::optional<Layout>> output_targets;
    if (request.contains("outputs")) {
        const json &outputs = detail::AsArray(request["outputs"], "outputs");
        if (outputs.size() != 1) {
            throw SpmdError(fmt::format("outputs: every op here has one output, got {}", outputs.size()));
        }
        ctx.out = TensorFromJson(outputs[0], mesh, "outputs[0]");
    }
    if (ctx.direction == Direction::kReverse && !ctx.out) {
        throw SpmdError("outputs: a reverse request needs \"outputs\": [{the output's shape and layout}]");
    }
    if (ctx.direction == Direction::kGrad) {
        ctx.out_grad = TensorFromJson(detail::Require(request, "out_grad", ""), mesh, "out_grad");
    }
    if (request.contains("attrs")) {
        ctx.attrs = request["attrs"];
    }
    if (request.contains("output_target")) {
        const json &target = request["output_target"];
        if (!target.is_object() || !target.contains("shape")) {
            throw SpmdError("output_target: expected an object with the output's shape and layout");
        }
        ctx.options.output_target = TensorFromJson(target, mesh, "output_target").layout;
    }

    const SpmdInfo info = Handlers().at(op)(ctx);

    json answer;
    answer["op"] = op;
    answer["direction"] = direction;
    answer["mode"] = mode;
    answer["mesh"] = MeshToJson(mesh);
    json in = json::array();
    for (size_t i = 0; i < info.inputs.size(); ++i) {
        std::optional<TensorSpec> from;
        if (ctx.direction != Direction::kReverse) {
            if (i < ctx.inputs.size() && info.input_names[i] != "out") {
                from = ctx.inputs[i];
            } else if (info.input_names[i] == "out_grad" || info.input_names[i] == "loss_grad") {
                from = ctx.out_grad;
            }
        }
        if (from && from->shape != info.inputs[i].shape) {
            from.reset();
        }
        in.push_back(TensorWithPlan(info.input_names[i], info.inputs[i], mesh, from, std::nullopt, plan_options));
    }
    answer["inputs"] = in;
    json out = json::array();
    for (size_t o = 0; o < info.outputs.size(); ++o) {
        std::optional<Layout> to;
        if (ctx.direction == Direction::kForward && ctx.out && ctx.out->shape == info.outputs[o].shape) {
            to = ctx.out->layout; // forward with "outputs": where the caller wants the output
        }
        if (ctx.direction == Direction::kGrad) {
            // A gradient goes back to its input's layout: that is the backward communication of the op.
            const std::string name = info.output_names[o].substr(0, info.output_names[o].size() - 5);
            for (size_t i = 0; i < info.input_names.size() && i < ctx.inputs.size(); ++i) {
                if (info.input_names[i] == name) {
                    to = ctx.inputs[i].layout.Canonical(mesh);
                }
            }
        }
        out.push_back(TensorWithPlan(info.output_names[o], info.outputs[o], mesh, std::nullopt, to, plan_options));
    }
    answer["outputs"] = out;
    json internal = json::array();
    for (const InternalCollective &c : info.internal) {
        internal.push_back({{"collective", std::string(ToString(c.collective))},
                            {"mesh_dim", c.mesh_dim},
                            {"reduce_op", std::string(ToString(c.reduce_op))},
                            {"what", c.what}});
    }
    answer["internal"] = internal;
    if (op == "linear") {
        answer["bias_after_reduction"] = info.bias_after_reduction;
    }
    if (ctx.options.mode == RuleMode::kCostBased) {
        answer["cost_us"] = info.cost_us;
    }
    return answer;
}

} // namespace shardline::spmd
