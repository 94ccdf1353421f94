// shardline-spmd requests: one JSON object in, one JSON answer out (docs/spmd.md has the schema).

#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/rule_cache.h>
#include <shardline/spmd/rules.h>

#include "json_util.h"

namespace shardline::spmd {

using nlohmann::json;

namespace {

/// The request's "attrs" object, checked against the op's known attributes; typed getters name the field.
class AttrReader {
public:
    AttrReader(const json &attrs, const std::string &op, const std::set<std::string> &known) : attrs_(attrs) {
        if (!attrs.is_object()) {
            throw SpmdError(fmt::format("attrs: expected an object, got {}", attrs.type_name()));
        }
        for (const auto &[key, value] : attrs.items()) {
            if (known.count(key) == 0) {
                throw SpmdError(
                    fmt::format("attrs.{}: unknown attribute for {} (known: [{}])", key, op, fmt::join(known, ",")));
            }
        }
    }
    bool Bool(const std::string &key, bool fallback) const {
        return attrs_.contains(key) ? detail::AsBool(attrs_[key], "attrs." + key) : fallback;
    }
    int64_t Int64(const std::string &key, int64_t fallback) const {
        return attrs_.contains(key) ? detail::AsInt(attrs_[key], "attrs." + key) : fallback;
    }
    int Int(const std::string &key, int fallback) const {
        return attrs_.contains(key) ? detail::AsInt32(attrs_[key], "attrs." + key) : fallback;
    }
    std::string String(const std::string &key, const std::string &fallback) const {
        return attrs_.contains(key) ? detail::AsString(attrs_[key], "attrs." + key) : fallback;
    }
    std::vector<int64_t> IntList(const std::string &key) const {
        return attrs_.contains(key) ? detail::AsIntList(attrs_[key], "attrs." + key) : std::vector<int64_t>{};
    }
    std::vector<int> Int32List(const std::string &key) const {
        return attrs_.contains(key) ? detail::AsInt32List(attrs_[key], "attrs." + key) : std::vector<int>{};
    }
    bool Has(const std::string &key) const { return attrs_.contains(key); }

private:
    const json &attrs_;
};

/// JSON attrs -> RuleAttrs for the ops that take attributes; every other op takes none (std::monostate). The op
/// name, not these attrs, decides a reduction's kind and softmax's `log` (InferRule).
struct AttrsSchema {
    std::set<std::string> known;
    RuleAttrs (*parse)(const AttrReader &, RuleDirection);
};

const std::map<std::string, AttrsSchema> &AttrsSchemas() {
    static const std::map<std::string, AttrsSchema> schemas = [] {
        std::map<std::string, AttrsSchema> s;
        s["matmul"] = {{"trans_x", "trans_y"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                           return MatmulAttrs{.trans_x = a.Bool("trans_x", false), .trans_y = a.Bool("trans_y", false)};
                       }};
        // Paddle's fused_gemm_epilogue flags; trans_y defaults to true (linear's weight is [out, in]).
        s["linear"] = {{"trans_x", "trans_y"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                           return LinearAttrs{.trans_x = a.Bool("trans_x", false), .trans_y = a.Bool("trans_y", true)};
                       }};
        s["embedding"] = {{"sparse"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                              return EmbeddingAttrs{.sparse = a.Bool("sparse", false)};
                          }};
        const AttrsSchema reduction = {{"axes", "keepdim"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                                           return ReductionAttrs{.kind = ReductionKind::kSum,
                                                                 .axes = a.Int32List("axes"),
                                                                 .keepdim = a.Bool("keepdim", false)};
                                       }};
        for (const char *name : {"sum", "mean", "max", "min", "prod"}) {
            s[name] = reduction;
        }
        const AttrsSchema softmax = {{"axis", "vocab_parallel"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                                         return SoftmaxAttrs{.axis = a.Int("axis", -1),
                                                             .log = false,
                                                             .vocab_parallel = a.Bool("vocab_parallel", false)};
                                     }};
        s["softmax"] = softmax;
        s["log_softmax"] = softmax;
        s["cross_entropy"] = {
            {"reduction", "vocab_parallel"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                const std::string reduction = a.String("reduction", "none");
                CrossEntropyAttrs attrs{.reduction = LossReduction::kNone,
                                        .vocab_parallel = a.Bool("vocab_parallel", false)};
                if (reduction == "mean") {
                    attrs.reduction = LossReduction::kMean;
                } else if (reduction == "sum") {
                    attrs.reduction = LossReduction::kSum;
                } else if (reduction != "none") {
                    throw SpmdError(fmt::format("attrs.reduction: expected none, mean or sum, got '{}'", reduction));
                }
                return attrs;
            }};
        s["transpose"] = {{"perm"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                              if (!a.Has("perm")) {
                                  throw SpmdError("attrs.perm: transpose needs a permutation, e.g. [1,0]");
                              }
                              return TransposeAttrs{.perm = a.Int32List("perm")};
                          }};
        s["reshape"] = {{"shape"}, [](const AttrReader &a, RuleDirection direction) -> RuleAttrs {
                            if (direction != RuleDirection::kReverse && !a.Has("shape")) {
                                throw SpmdError("attrs.shape: reshape needs the target shape, e.g. [-1, 64]");
                            }
                            return ReshapeAttrs{.shape = a.IntList("shape")};
                        }};
        // The exchange's routing-independent facts (docs/spmd.md 2.7); num_experts has no default.
        const AttrsSchema moe = {{"num_experts", "topk", "capacity", "ep_dim"},
                                 [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                                     if (!a.Has("num_experts")) {
                                         throw SpmdError("attrs.num_experts: the exchange needs the number of "
                                                         "experts, e.g. {\"num_experts\": 8, \"topk\": 2}");
                                     }
                                     return MoEDispatchAttrs{.num_experts = a.Int64("num_experts", 0),
                                                             .topk = a.Int64("topk", 1),
                                                             .capacity = a.Int64("capacity", -1),
                                                             .ep_dim = a.String("ep_dim", "ep")};
                                 }};
        s["moe_dispatch"] = moe;
        s["moe_combine"] = moe;
        s["einsum"] = {{"equation"}, [](const AttrReader &a, RuleDirection) -> RuleAttrs {
                           if (!a.Has("equation")) {
                               throw SpmdError("attrs.equation: einsum needs an equation, e.g. \"mk,kn->mn\"");
                           }
                           return EinsumAttrs{.equation = a.String("equation", "")};
                       }};
        return s;
    }();
    return schemas;
}

RuleAttrs AttrsFromJson(const json &attrs, const std::string &op, RuleDirection direction) {
    auto it = AttrsSchemas().find(op);
    if (it == AttrsSchemas().end()) {
        const AttrReader check(attrs, op, {});
        return std::monostate{};
    }
    return it->second.parse(AttrReader(attrs, op, it->second.known), direction);
}

PlanOptions PlanOptionsFromJson(const json &request, const CostModel &base) {
    PlanOptions plan;
    plan.cost = base;
    if (request.contains("element_size") && request.contains("dtype")) {
        throw SpmdError("element_size: give element_size or dtype, not both");
    }
    if (request.contains("element_size")) {
        plan.element_size = detail::AsInt(request["element_size"], "element_size");
        if (plan.element_size < 1) {
            throw SpmdError(fmt::format("element_size: must be >= 1, got {}", plan.element_size));
        }
        if (plan.element_size > kMaxElementSize) {
            throw SpmdError(
                fmt::format("element_size: must be <= {} bytes, got {}", kMaxElementSize, plan.element_size));
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
    if (request.contains("cost_profile")) {
        // A built-in profile by name, or a whole profile inline; files are read by the caller (--cost-profile).
        const json &profile = request["cost_profile"];
        if (profile.is_string()) {
            try {
                plan.cost = CostProfile(profile.get<std::string>());
            } catch (const SpmdError &e) {
                throw SpmdError(fmt::format("cost_profile: {}", e.what()));
            }
        } else if (profile.is_object()) {
            plan.cost = CostModelFromJson(profile, CostModel{}, "cost_profile");
        } else {
            throw SpmdError(fmt::format("cost_profile: expected a profile name ([{}]) or a profile object, got {}",
                                        fmt::join(CostProfileNames(), ","), profile.type_name()));
        }
    }
    if (request.contains("cost_model")) {
        plan.cost = CostModelFromJson(request["cost_model"], plan.cost, "cost_model");
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
    CheckShape(shape, "shape");
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

/// The answer of a "direction": "enumerate" request (docs/spmd.md 2.5): every strategy's layouts and costs, and the
/// chosen one with its plans (from the full planner, as a module would run them).
json EnumerateAnswer(const RuleRequest &rule) {
    const RuleStrategies strategies = EnumerateRuleStrategies(rule);
    const EinsumStrategies &e = strategies.enumeration;
    auto layout = [&](const std::string &name, const TensorSpec &spec) {
        json j = LayoutToJson(spec.layout, rule.mesh);
        j["name"] = name;
        return j;
    };
    json list = json::array();
    for (const EinsumStrategy &s : e.strategies) {
        json inputs = json::array();
        for (size_t i = 0; i < s.inputs.size(); ++i) {
            inputs.push_back(layout(strategies.input_names[i], s.inputs[i]));
        }
        json entry{{"inputs", inputs},
                   {"output", layout("out", s.output)},
                   {"redistribute_us", s.redistribute_us},
                   {"compute_us", s.compute_us},
                   {"cost_us", s.cost_us}};
        if (rule.op == "linear") {
            entry["bias_after_reduction"] = strategies.bias_after_reduction_if_partial && s.output.layout.IsPartial();
        }
        list.push_back(std::move(entry));
    }
    const EinsumStrategy &best = e.strategies[e.chosen];
    json chosen_inputs = json::array();
    for (size_t i = 0; i < best.inputs.size(); ++i) {
        chosen_inputs.push_back(TensorWithPlan(strategies.input_names[i], best.inputs[i], rule.mesh, rule.inputs[i],
                                               std::nullopt, rule.options.plan));
    }
    return json{{"op", rule.op},
                {"direction", "enumerate"},
                {"mesh", MeshToJson(rule.mesh)},
                {"count", e.strategies.size()},
                {"chosen", e.chosen},
                {"strategies", list},
                {"chosen_strategy",
                 {{"inputs", chosen_inputs},
                  {"output", TensorToJson("out", best.output, rule.mesh)},
                  {"redistribute_us", best.redistribute_us},
                  {"compute_us", best.compute_us},
                  {"cost_us", best.cost_us}}},
                {"cost_model", CostModelToJson(rule.options.plan.cost)}};
}

} // namespace

json HandleRequest(const json &request, const CostModel &base) {
    detail::CheckDepth(request, kMaxRequestDepth, "request");
    if (!request.is_object()) {
        throw SpmdError(fmt::format("request: expected a JSON object, got {}", request.type_name()));
    }
    const std::string op = detail::AsString(detail::Require(request, "op", ""), "op");
    const ProcessMesh mesh = MeshFromJson(detail::Require(request, "mesh", ""), "mesh");
    const PlanOptions plan_options = PlanOptionsFromJson(request, base);
    if (op == "redistribute") {
        return HandleRedistribute(request, mesh, plan_options);
    }
    if (!IsRuleOp(op)) {
        std::vector<std::string> names = {"redistribute"};
        names.insert(names.end(), RuleOpNames().begin(), RuleOpNames().end());
        throw SpmdError(fmt::format("op: unknown op '{}' (known: [{}])", op, fmt::join(names, ",")));
    }
    RuleRequest rule;
    rule.op = op;
    rule.mesh = mesh;
    rule.options.plan = plan_options;
    const std::string direction =
        request.contains("direction") ? detail::AsString(request["direction"], "direction") : std::string("forward");
    const bool enumerate = direction == "enumerate"; // the inputs' given layouts, as a forward request's
    if (direction == "forward" || enumerate) {
        rule.direction = RuleDirection::kForward;
    } else if (direction == "reverse") {
        rule.direction = RuleDirection::kReverse;
    } else if (direction == "grad") {
        rule.direction = RuleDirection::kGrad;
    } else {
        throw SpmdError(fmt::format("direction: expected forward, reverse, grad or enumerate, got '{}'", direction));
    }
    const std::string mode =
        request.contains("mode") ? detail::AsString(request["mode"], "mode") : std::string("deterministic");
    if (mode == "cost") {
        rule.options.mode = RuleMode::kCostBased;
    } else if (mode != "deterministic") {
        throw SpmdError(fmt::format("mode: expected deterministic or cost, got '{}'", mode));
    }
    if (enumerate) {
        for (const char *field : {"outputs", "out_grad", "output_target"}) {
            if (request.contains(field)) {
                throw SpmdError(fmt::format("{}: an enumerate request prices the inputs' redistributions only", field));
            }
        }
    }
    const json &inputs = detail::AsArray(detail::Require(request, "inputs", ""), "inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
        rule.inputs.push_back(TensorFromJson(inputs[i], mesh, detail::Index("inputs", i)));
        if (inputs[i].contains("name")) {
            detail::AsString(inputs[i]["name"], detail::Index("inputs", i) + ".name");
        }
    }
    if (request.contains("outputs")) {
        const json &outputs = detail::AsArray(request["outputs"], "outputs");
        if (outputs.size() != 1) {
            throw SpmdError(fmt::format("outputs: every op here has one output, got {}", outputs.size()));
        }
        rule.out = TensorFromJson(outputs[0], mesh, "outputs[0]");
    }
    if (rule.direction == RuleDirection::kReverse && !rule.out) {
        throw SpmdError("outputs: a reverse request needs \"outputs\": [{the output's shape and layout}]");
    }
    if (rule.direction == RuleDirection::kGrad) {
        rule.out_grad = TensorFromJson(detail::Require(request, "out_grad", ""), mesh, "out_grad");
    }
    const json attrs = request.contains("attrs") ? request["attrs"] : json::object();
    if (request.contains("output_target")) {
        const json &target = request["output_target"];
        if (!target.is_object() || !target.contains("shape")) {
            throw SpmdError("output_target: expected an object with the output's shape and layout");
        }
        rule.options.output_target = TensorFromJson(target, mesh, "output_target").layout;
    }
    rule.attrs = AttrsFromJson(attrs, op, rule.direction);
    if (enumerate) {
        return EnumerateAnswer(rule);
    }

    // A forward request's "outputs" is where the caller wants the output (planned below), not a rule input.
    const std::optional<TensorSpec> wanted_output = rule.out;
    if (rule.direction != RuleDirection::kReverse) {
        rule.out.reset();
    }
    const SpmdInfo info = InferRule(rule);

    json answer;
    answer["op"] = op;
    answer["direction"] = direction;
    answer["mode"] = mode;
    answer["mesh"] = MeshToJson(mesh);
    json in = json::array();
    for (size_t i = 0; i < info.inputs.size(); ++i) {
        std::optional<TensorSpec> from;
        if (rule.direction != RuleDirection::kReverse) {
            if (i < rule.inputs.size() && info.input_names[i] != "out") {
                from = rule.inputs[i];
            } else if (info.input_names[i] == "out_grad" || info.input_names[i] == "loss_grad") {
                from = rule.out_grad;
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
        if (rule.direction == RuleDirection::kForward && wanted_output &&
            wanted_output->shape == info.outputs[o].shape) {
            to = wanted_output->layout; // forward with "outputs": where the caller wants the output
        }
        if (rule.direction == RuleDirection::kGrad) {
            // A gradient goes back to its input's layout: that is the backward communication of the op.
            const std::string name = info.output_names[o].substr(0, info.output_names[o].size() - 5);
            for (size_t i = 0; i < info.input_names.size() && i < rule.inputs.size(); ++i) {
                if (info.input_names[i] == name) {
                    to = rule.inputs[i].layout.Canonical(mesh);
                }
            }
        }
        out.push_back(TensorWithPlan(info.output_names[o], info.outputs[o], mesh, std::nullopt, to, plan_options));
    }
    answer["outputs"] = out;
    json internal = json::array();
    for (const InternalCollective &c : info.internal) {
        json entry{{"collective", std::string(ToString(c.collective))},
                   {"mesh_dim", c.mesh_dim},
                   {"mesh_dim_name", mesh.DimNames()[static_cast<size_t>(c.mesh_dim)]},
                   {"what", c.what}};
        if (c.collective == Collective::kAllReduce || c.collective == Collective::kReduceScatter) {
            entry["reduce_op"] = std::string(ToString(c.reduce_op));
        }
        if (c.collective == Collective::kAllToAll || c.collective == Collective::kAllToAllV) {
            // The MoE exchange's estimate (an upper bound for the rows, docs/spmd.md 2.7).
            entry["bytes_per_rank"] = c.bytes_per_rank;
            entry["cost_us"] = c.cost_us;
        }
        internal.push_back(std::move(entry));
    }
    answer["internal"] = internal;
    if (op == "linear" || op == "grouped_linear") {
        answer["bias_after_reduction"] = info.bias_after_reduction;
    }
    if (rule.options.mode == RuleMode::kCostBased) {
        answer["cost_us"] = info.cost_us;
    }
    return answer;
}

RequestAnswer AnswerRequestText(std::string_view text, const CostModel &base) {
    auto error = [](const std::string &message) { return RequestAnswer{json{{"error", message}}, 2}; };
    try {
        if (static_cast<int64_t>(text.size()) > kMaxRequestBytes) {
            return error(fmt::format("request: larger than {} bytes ({})", kMaxRequestBytes, text.size()));
        }
        detail::CheckTextDepth(text, kMaxRequestDepth, "request");
        json request;
        try {
            request = json::parse(text);
        } catch (const json::exception &e) { // parse_error, or out_of_range for a number beyond a double
            return error(std::string("request: invalid JSON: ") + e.what());
        }
        return RequestAnswer{HandleRequest(request, base), 0};
    } catch (const SpmdError &e) {
        return error(e.what());
    } catch (const json::exception &e) {
        return error(std::string("request: ") + e.what());
    } catch (const std::bad_alloc &) {
        return error("request: out of memory while answering it");
    } catch (const std::exception &e) {
        return error(std::string("internal error: ") + e.what());
    }
}

} // namespace shardline::spmd
