// InferRule (one entry point for every op), RuleKey (a request encoded as integers and hashed once) and RuleCache.

#include <algorithm>
#include <bit>
#include <iterator>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/rule_cache.h>

#include "problems.h"

namespace shardline::spmd {

namespace {

const char *DirectionName(RuleDirection direction) {
    switch (direction) {
    case RuleDirection::kForward:
        return "forward";
    case RuleDirection::kReverse:
        return "reverse";
    case RuleDirection::kGrad:
        return "grad";
    }
    return "?";
}

const char *AttrsName(const RuleAttrs &attrs) {
    constexpr const char *kNames[] = {
        "none",         "MatmulAttrs", "ReductionAttrs", "SoftmaxAttrs",   "CrossEntropyAttrs", "TransposeAttrs",
        "ReshapeAttrs", "EinsumAttrs", "LinearAttrs",    "EmbeddingAttrs", "MoEDispatchAttrs"};
    static_assert(std::size(kNames) == std::variant_size_v<RuleAttrs>);
    return kNames[attrs.index()];
}

/// The op's attrs: defaults for std::monostate, an error for another op's attrs.
template <typename A> A AttrsOf(const RuleRequest &request) {
    if (std::holds_alternative<std::monostate>(request.attrs)) {
        return A{};
    }
    if (const A *attrs = std::get_if<A>(&request.attrs)) {
        return *attrs;
    }
    throw SpmdError(
        fmt::format("{}: attrs hold {}, which this op does not take", request.op, AttrsName(request.attrs)));
}

void ExpectInputs(const RuleRequest &request, size_t min_count, size_t max_count, const char *names) {
    if (request.inputs.size() < min_count || request.inputs.size() > max_count) {
        throw SpmdError(fmt::format("inputs: {} expects {} input(s) ({}), got {}", request.op,
                                    min_count == max_count ? std::to_string(min_count)
                                                           : fmt::format("{} to {}", min_count, max_count),
                                    names, request.inputs.size()));
    }
}

const TensorSpec &Out(const RuleRequest &request) {
    if (!request.out) {
        throw SpmdError(
            fmt::format("outputs: a reverse {} request needs `out` (the output's shape and layout)", request.op));
    }
    return *request.out;
}

const TensorSpec &OutGrad(const RuleRequest &request) {
    if (!request.out_grad) {
        throw SpmdError(fmt::format("out_grad: a grad {} request needs `out_grad` (the output gradient)", request.op));
    }
    return *request.out_grad;
}

/// Calls fwd(), rev(out) or grad(out_grad) by direction.
template <typename F, typename R, typename G>
SpmdInfo ByDirection(const RuleRequest &request, F forward, R reverse, G grad) {
    switch (request.direction) {
    case RuleDirection::kForward:
        return forward();
    case RuleDirection::kReverse:
        return reverse(Out(request));
    case RuleDirection::kGrad:
        return grad(OutGrad(request));
    }
    throw SpmdError(fmt::format("{}: unknown direction", request.op));
}

std::optional<ReductionKind> ReductionKindOf(const std::string &op) {
    if (op == "sum") {
        return ReductionKind::kSum;
    }
    if (op == "mean") {
        return ReductionKind::kMean;
    }
    if (op == "max") {
        return ReductionKind::kMax;
    }
    if (op == "min") {
        return ReductionKind::kMin;
    }
    if (op == "prod") {
        return ReductionKind::kProd;
    }
    return std::nullopt;
}

// ---- key encoding ------------------------------------------------------------------------------------------------

void PutString(std::vector<int64_t> &w, const std::string &text) {
    w.push_back(static_cast<int64_t>(text.size()));
    for (size_t i = 0; i < text.size(); i += 8) {
        uint64_t packed = 0;
        for (size_t j = i; j < text.size() && j < i + 8; ++j) {
            packed = (packed << 8) | static_cast<unsigned char>(text[j]);
        }
        w.push_back(static_cast<int64_t>(packed));
    }
}

void PutDouble(std::vector<int64_t> &w, double value) { w.push_back(std::bit_cast<int64_t>(value)); }

template <typename T> void PutList(std::vector<int64_t> &w, const std::vector<T> &values) {
    w.push_back(static_cast<int64_t>(values.size()));
    for (const T &v : values) {
        w.push_back(static_cast<int64_t>(v));
    }
}

void PutLayout(std::vector<int64_t> &w, const Layout &layout) {
    w.push_back(layout.TensorRank());
    for (const auto &dims : layout.DimsMeshDims()) {
        PutList(w, dims);
    }
    w.push_back(static_cast<int64_t>(layout.Partial().size()));
    for (const auto &[d, op] : layout.Partial()) {
        w.push_back(d);
        w.push_back(static_cast<int64_t>(op));
    }
}

void PutTensor(std::vector<int64_t> &w, const std::optional<TensorSpec> &spec) {
    w.push_back(spec.has_value() ? 1 : 0);
    if (spec) {
        PutList(w, spec->shape);
        PutLayout(w, spec->layout);
    }
}

void PutAttrs(std::vector<int64_t> &w, const RuleAttrs &attrs) {
    w.push_back(static_cast<int64_t>(attrs.index()));
    std::visit(
        [&w](const auto &a) {
            using A = std::decay_t<decltype(a)>;
            if constexpr (std::is_same_v<A, MatmulAttrs>) {
                w.push_back(a.trans_x);
                w.push_back(a.trans_y);
            } else if constexpr (std::is_same_v<A, ReductionAttrs>) {
                w.push_back(static_cast<int64_t>(a.kind));
                PutList(w, a.axes);
                w.push_back(a.keepdim);
            } else if constexpr (std::is_same_v<A, SoftmaxAttrs>) {
                w.push_back(a.axis);
                w.push_back(a.log);
                w.push_back(a.vocab_parallel);
            } else if constexpr (std::is_same_v<A, CrossEntropyAttrs>) {
                w.push_back(static_cast<int64_t>(a.reduction));
                w.push_back(a.vocab_parallel);
            } else if constexpr (std::is_same_v<A, TransposeAttrs>) {
                PutList(w, a.perm);
            } else if constexpr (std::is_same_v<A, ReshapeAttrs>) {
                PutList(w, a.shape);
            } else if constexpr (std::is_same_v<A, EinsumAttrs>) {
                PutString(w, a.equation);
            } else if constexpr (std::is_same_v<A, LinearAttrs>) {
                w.push_back(a.trans_x);
                w.push_back(a.trans_y);
            } else if constexpr (std::is_same_v<A, EmbeddingAttrs>) {
                w.push_back(a.sparse);
            } else if constexpr (std::is_same_v<A, MoEDispatchAttrs>) {
                w.push_back(a.num_experts);
                w.push_back(a.topk);
                w.push_back(a.capacity);
                PutString(w, a.ep_dim);
            }
        },
        attrs);
}

void PutOptions(std::vector<int64_t> &w, const RuleOptions &options) {
    w.push_back(static_cast<int64_t>(options.mode));
    // The plans priced and returned depend on the element size and the cost model in every mode.
    w.push_back(options.plan.element_size);
    w.push_back(options.plan.search ? 1 : 0);
    const CostModel &cost = options.plan.cost;
    PutDouble(w, cost.call_us);
    PutDouble(w, cost.alpha_us);
    PutDouble(w, cost.bandwidth_gb_per_s);
    PutDouble(w, cost.flops_per_us);
    w.push_back(static_cast<int64_t>(cost.call_us_per_dim.size()));
    for (double v : cost.call_us_per_dim) {
        PutDouble(w, v);
    }
    w.push_back(static_cast<int64_t>(cost.alpha_us_per_dim.size()));
    for (double v : cost.alpha_us_per_dim) {
        PutDouble(w, v);
    }
    w.push_back(static_cast<int64_t>(cost.bandwidth_gb_per_s_per_dim.size()));
    for (double v : cost.bandwidth_gb_per_s_per_dim) {
        PutDouble(w, v);
    }
    w.push_back(options.output_target.has_value() ? 1 : 0);
    if (options.output_target) {
        PutLayout(w, *options.output_target);
    }
}

uint64_t HashWords(const std::vector<int64_t> &words) {
    uint64_t h = 0x243f6a8885a308d3ULL ^ words.size();
    for (int64_t v : words) {
        uint64_t x = static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
        h ^= x ^ (x >> 31);
    }
    return h;
}

} // namespace

const std::vector<std::string> &RuleOpNames() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> n = {
            "matmul",        "linear",  "grouped_linear", "moe_dispatch",  "moe_combine", "embedding",
            "embedding_bag", "softmax", "log_softmax",    "cross_entropy", "transpose",   "reshape",
            "einsum",        "sum",     "mean",           "max",           "min",         "prod"};
        for (std::string &name : ElementwiseOpNames()) {
            n.push_back(std::move(name));
        }
        std::sort(n.begin(), n.end());
        return n;
    }();
    return names;
}

bool IsRuleOp(const std::string &op) { return std::binary_search(RuleOpNames().begin(), RuleOpNames().end(), op); }

SpmdInfo InferRule(const RuleRequest &r) {
    const ProcessMesh &mesh = r.mesh;
    const RuleOptions &opt = r.options;
    const std::string &op = r.op;
    if (op == "matmul") {
        ExpectInputs(r, 2, 2, "x, y");
        const MatmulAttrs a = AttrsOf<MatmulAttrs>(r);
        const TensorSpec &x = r.inputs[0];
        const TensorSpec &y = r.inputs[1];
        return ByDirection(
            r, [&] { return InferMatmulForward(mesh, x, y, a, opt); },
            [&](const TensorSpec &out) { return InferMatmulReverse(mesh, x, y, out, a, opt); },
            [&](const TensorSpec &dy) { return InferMatmulGrad(mesh, x, y, dy, a, opt); });
    }
    if (op == "linear") {
        ExpectInputs(r, 2, 3, "x, weight, optional bias");
        const LinearAttrs a = AttrsOf<LinearAttrs>(r);
        const std::optional<TensorSpec> bias =
            r.inputs.size() == 3 ? std::optional<TensorSpec>(r.inputs[2]) : std::nullopt;
        return ByDirection(
            r, [&] { return InferLinearForward(mesh, r.inputs[0], r.inputs[1], bias, a, opt); },
            [&](const TensorSpec &out) {
                return InferLinearReverse(mesh, r.inputs[0], r.inputs[1], bias, out, a, opt);
            },
            [&](const TensorSpec &dy) { return InferLinearGrad(mesh, r.inputs[0], r.inputs[1], bias, dy, a, opt); });
    }
    if (op == "grouped_linear") {
        ExpectInputs(r, 2, 3, "x, weight, optional bias");
        AttrsOf<std::monostate>(r);
        const std::optional<TensorSpec> bias =
            r.inputs.size() == 3 ? std::optional<TensorSpec>(r.inputs[2]) : std::nullopt;
        return ByDirection(
            r, [&] { return InferGroupedLinearForward(mesh, r.inputs[0], r.inputs[1], bias, opt); },
            [&](const TensorSpec &out) {
                return InferGroupedLinearReverse(mesh, r.inputs[0], r.inputs[1], bias, out, opt);
            },
            [&](const TensorSpec &dy) {
                return InferGroupedLinearGrad(mesh, r.inputs[0], r.inputs[1], bias, dy, opt);
            });
    }
    if (op == "moe_dispatch" || op == "moe_combine") {
        // One rule, two directions (as softmax / log_softmax): the op name picks dispatch or its inverse.
        ExpectInputs(r, 1, 1, op == "moe_dispatch" ? "x, the token rows" : "x, the expert rows");
        const MoEDispatchAttrs a = AttrsOf<MoEDispatchAttrs>(r);
        const TensorSpec &x = r.inputs[0];
        if (op == "moe_dispatch") {
            return ByDirection(
                r, [&] { return InferMoEDispatchForward(mesh, x, a, opt); },
                [&](const TensorSpec &out) { return InferMoEDispatchReverse(mesh, x, out, a, opt); },
                [&](const TensorSpec &dy) { return InferMoEDispatchGrad(mesh, x, dy, a, opt); });
        }
        return ByDirection(
            r, [&] { return InferMoECombineForward(mesh, x, a, opt); },
            [&](const TensorSpec &out) { return InferMoECombineReverse(mesh, x, out, a, opt); },
            [&](const TensorSpec &dy) { return InferMoECombineGrad(mesh, x, dy, a, opt); });
    }
    if (op == "embedding") {
        ExpectInputs(r, 2, 2, "ids, weight");
        const EmbeddingAttrs a = AttrsOf<EmbeddingAttrs>(r);
        return ByDirection(
            r, [&] { return InferEmbeddingForward(mesh, r.inputs[0], r.inputs[1], a, opt); },
            [&](const TensorSpec &out) { return InferEmbeddingReverse(mesh, r.inputs[0], r.inputs[1], out, a, opt); },
            [&](const TensorSpec &dy) { return InferEmbeddingGrad(mesh, r.inputs[0], r.inputs[1], dy, a, opt); });
    }
    if (op == "embedding_bag") {
        ExpectInputs(r, 2, 2, "ids, weight");
        AttrsOf<std::monostate>(r);
        return ByDirection(
            r, [&] { return InferEmbeddingBagForward(mesh, r.inputs[0], r.inputs[1], opt); },
            [&](const TensorSpec &out) { return InferEmbeddingBagReverse(mesh, r.inputs[0], r.inputs[1], out, opt); },
            [&](const TensorSpec &dy) { return InferEmbeddingBagGrad(mesh, r.inputs[0], r.inputs[1], dy, opt); });
    }
    if (op == "softmax" || op == "log_softmax") {
        ExpectInputs(r, 1, 1, "x");
        SoftmaxAttrs a = AttrsOf<SoftmaxAttrs>(r);
        a.log = op == "log_softmax";
        return ByDirection(
            r, [&] { return InferSoftmaxForward(mesh, r.inputs[0], a, opt); },
            [&](const TensorSpec &out) { return InferSoftmaxReverse(mesh, r.inputs[0], out, a, opt); },
            [&](const TensorSpec &dy) { return InferSoftmaxGrad(mesh, r.inputs[0], dy, a, opt); });
    }
    if (op == "cross_entropy") {
        ExpectInputs(r, 2, 2, "logits, labels");
        const CrossEntropyAttrs a = AttrsOf<CrossEntropyAttrs>(r);
        return ByDirection(
            r, [&] { return InferCrossEntropyForward(mesh, r.inputs[0], r.inputs[1], a, opt); },
            [&](const TensorSpec &out) {
                return InferCrossEntropyReverse(mesh, r.inputs[0], r.inputs[1], out, a, opt);
            },
            [&](const TensorSpec &dy) { return InferCrossEntropyGrad(mesh, r.inputs[0], r.inputs[1], dy, a, opt); });
    }
    if (op == "transpose") {
        ExpectInputs(r, 1, 1, "x");
        const TransposeAttrs a = AttrsOf<TransposeAttrs>(r);
        return ByDirection(
            r, [&] { return InferTransposeForward(mesh, r.inputs[0], a.perm, opt); },
            [&](const TensorSpec &out) { return InferTransposeReverse(mesh, r.inputs[0], out, a.perm, opt); },
            [&](const TensorSpec &dy) { return InferTransposeGrad(mesh, r.inputs[0], dy, a.perm, opt); });
    }
    if (op == "reshape") {
        ExpectInputs(r, 1, 1, "x");
        const ReshapeAttrs a = AttrsOf<ReshapeAttrs>(r);
        return ByDirection(
            r, [&] { return InferReshapeForward(mesh, r.inputs[0], a.shape, opt); },
            [&](const TensorSpec &out) { return InferReshapeReverse(mesh, r.inputs[0], out, opt); },
            [&](const TensorSpec &dy) { return InferReshapeGrad(mesh, r.inputs[0], dy, a.shape, opt); });
    }
    if (op == "einsum") {
        const EinsumAttrs a = AttrsOf<EinsumAttrs>(r);
        return ByDirection(
            r, [&] { return InferEinsumOpForward(mesh, a.equation, r.inputs, opt); },
            [&](const TensorSpec &out) { return InferEinsumOpReverse(mesh, a.equation, r.inputs, out, opt); },
            [&](const TensorSpec &dy) { return InferEinsumOpGrad(mesh, a.equation, r.inputs, dy, opt); });
    }
    if (const auto kind = ReductionKindOf(op)) {
        ExpectInputs(r, 1, 1, "x");
        ReductionAttrs a = AttrsOf<ReductionAttrs>(r);
        a.kind = *kind;
        return ByDirection(
            r, [&] { return InferReductionForward(mesh, r.inputs[0], a, opt); },
            [&](const TensorSpec &out) { return InferReductionReverse(mesh, r.inputs[0], out, a, opt); },
            [&](const TensorSpec &dy) { return InferReductionGrad(mesh, r.inputs[0], dy, a, opt); });
    }
    if (IsElementwiseOp(op)) {
        const bool binary = ElementwiseArity(op) == 2;
        ExpectInputs(r, binary ? 2 : 1, binary ? 2 : 1, binary ? "x, y" : "x");
        AttrsOf<std::monostate>(r);
        return ByDirection(
            r, [&] { return InferElementwiseForward(mesh, op, r.inputs, opt); },
            [&](const TensorSpec &out) { return InferElementwiseReverse(mesh, op, r.inputs, out, opt); },
            [&](const TensorSpec &dy) { return InferElementwiseGrad(mesh, op, r.inputs, dy, opt); });
    }
    throw SpmdError(fmt::format("InferRule: unknown op '{}' ({} request)", op, DirectionName(r.direction)));
}

const std::vector<std::string> &EnumerableOpNames() {
    static const std::vector<std::string> names = {"einsum", "linear", "matmul"};
    return names;
}

RuleStrategies EnumerateRuleStrategies(const RuleRequest &r) {
    EinsumProblem problem;
    RuleStrategies out;
    if (r.op == "matmul") {
        ExpectInputs(r, 2, 2, "x, y");
        problem = detail::MatmulProblem(r.mesh, r.inputs[0], r.inputs[1], AttrsOf<MatmulAttrs>(r));
    } else if (r.op == "linear") {
        ExpectInputs(r, 2, 3, "x, weight, optional bias");
        const std::optional<TensorSpec> bias =
            r.inputs.size() == 3 ? std::optional<TensorSpec>(r.inputs[2]) : std::nullopt;
        problem = detail::LinearProblem(r.mesh, r.inputs[0], r.inputs[1], bias, AttrsOf<LinearAttrs>(r));
        out.bias_after_reduction_if_partial = bias.has_value();
    } else if (r.op == "einsum") {
        problem = detail::EquationProblem(r.mesh, AttrsOf<EinsumAttrs>(r).equation, r.inputs);
    } else {
        throw SpmdError(fmt::format("direction: enumerate takes an einsum-style op ({}), got '{}'",
                                    fmt::join(EnumerableOpNames(), ", "), r.op));
    }
    for (const EinsumOperand &operand : problem.inputs) {
        out.input_names.push_back(operand.name);
    }
    out.enumeration = EnumerateEinsumStrategies(r.mesh, problem, r.options.plan);
    return out;
}

CachedRule InferRuleWithPlans(const RuleRequest &request) {
    CachedRule rule;
    rule.info = InferRule(request);
    const SpmdInfo &info = rule.info;
    const ProcessMesh &mesh = request.mesh;
    for (size_t i = 0; i < info.inputs.size(); ++i) {
        std::optional<TensorSpec> from;
        if (request.direction != RuleDirection::kReverse) {
            if (i < request.inputs.size() && info.input_names[i] != "out") {
                from = request.inputs[i];
            } else if (info.input_names[i] == "out_grad" || info.input_names[i] == "loss_grad") {
                from = request.out_grad;
            }
        }
        if (from && from->shape == info.inputs[i].shape) {
            rule.input_plans.push_back(
                PlanRedistribute(mesh, from->shape, from->layout, info.inputs[i].layout, request.options.plan));
        } else {
            rule.input_plans.emplace_back();
        }
    }
    for (size_t o = 0; o < info.outputs.size(); ++o) {
        std::optional<Layout> to;
        if (request.direction == RuleDirection::kForward && request.options.output_target) {
            to = *request.options.output_target;
        }
        if (request.direction == RuleDirection::kGrad) {
            const std::string &name = info.output_names[o];
            const std::string input = name.size() > 5 ? name.substr(0, name.size() - 5) : name;
            for (size_t i = 0; i < info.input_names.size() && i < request.inputs.size(); ++i) {
                if (info.input_names[i] == input && request.inputs[i].shape == info.outputs[o].shape) {
                    to = request.inputs[i].layout.Canonical(mesh).WithoutPartial();
                }
            }
        }
        rule.output_plans.push_back(
            to ? PlanRedistribute(mesh, info.outputs[o].shape, info.outputs[o].layout, *to, request.options.plan)
               : RedistributePlan{});
    }
    return rule;
}

void RuleKey::Encode(const RuleRequest &request, std::vector<int64_t> &w) {
    PutString(w, request.op);
    w.push_back(static_cast<int64_t>(request.direction));
    PutList(w, request.mesh.Shape());
    w.push_back(static_cast<int64_t>(request.inputs.size()));
    for (const TensorSpec &spec : request.inputs) {
        PutTensor(w, spec);
    }
    PutTensor(w, request.out);
    PutTensor(w, request.out_grad);
    PutAttrs(w, request.attrs);
    if (const auto *moe = std::get_if<MoEDispatchAttrs>(&request.attrs)) {
        // The one answer that reads a dim name: which mesh dim is ep (-1: none, an error).
        const auto &names = request.mesh.DimNames();
        const auto it = std::find(names.begin(), names.end(), moe->ep_dim);
        w.push_back(it == names.end() ? -1 : static_cast<int64_t>(it - names.begin()));
    }
    PutOptions(w, request.options);
}

uint64_t RuleKey::HashOf(const std::vector<int64_t> &words) { return HashWords(words); }

RuleKey::RuleKey(RuleRequest request) : request_(std::move(request)) {
    words_.reserve(64);
    Encode(request_, words_);
    hash_ = HashWords(words_);
}

std::shared_ptr<const CachedRule> RuleCache::Find(const RuleKey &key) const {
    std::shared_lock lock(mutex_);
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : it->second;
}

std::shared_ptr<const CachedRule> RuleCache::Lookup(const RuleKey &key) const {
    std::shared_ptr<const CachedRule> found = Find(key);
    (found ? hits_ : misses_).fetch_add(1, std::memory_order_relaxed);
    return found;
}

std::shared_ptr<const CachedRule> RuleCache::GetOrInfer(const RuleKey &key) {
    if (std::shared_ptr<const CachedRule> found = Lookup(key)) {
        return found;
    }
    auto inferred = std::make_shared<const CachedRule>(InferRuleWithPlans(key.Request()));
    std::unique_lock lock(mutex_);
    return entries_.try_emplace(key, std::move(inferred)).first->second;
}

std::shared_ptr<const CachedRule> RuleCache::GetOrInfer(RuleRequest request) {
    thread_local std::vector<int64_t> words;
    words.clear();
    RuleKey::Encode(request, words);
    const RuleKeyView view{&words, RuleKey::HashOf(words)};
    {
        std::shared_lock lock(mutex_);
        if (auto it = entries_.find(view); it != entries_.end()) {
            hits_.fetch_add(1, std::memory_order_relaxed);
            return it->second;
        }
    }
    return GetOrInfer(RuleKey(std::move(request)));
}

RuleCache::Stats RuleCache::GetStats() const {
    std::shared_lock lock(mutex_);
    return {hits_.load(std::memory_order_relaxed), misses_.load(std::memory_order_relaxed), entries_.size()};
}

void RuleCache::Clear() {
    std::unique_lock lock(mutex_);
    entries_.clear();
    hits_.store(0, std::memory_order_relaxed);
    misses_.store(0, std::memory_order_relaxed);
}

} // namespace shardline::spmd
