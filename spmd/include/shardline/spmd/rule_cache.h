#pragma once

// A rule request as one value, one entry point for every op (`InferRule`), and a thread-safe cache of the answers.
// Rule inference runs once per layer configuration; the module hot path only looks the answer up:
//
//     // init, once per layer:
//     key_ = RuleKey(RuleRequest{.op = "linear", .mesh = mesh, .inputs = {x, weight, bias}});
//     const auto rule = cache.GetOrInfer(key_);          // infers on the first call, shares afterwards
//     // every step:
//     const auto rule = cache.Lookup(key_);              // hashes nothing, allocates nothing
//
// A RuleKey encodes the request (op, direction, mesh shape, layouts, shapes, attrs, options) as a few integers and
// hashes them once, when it is built; a lookup compares the precomputed hash and then those integers.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd {

enum class RuleDirection { kForward, kReverse, kGrad };

struct TransposeAttrs {
    std::vector<int> perm{};
};
struct ReshapeAttrs {
    std::vector<int64_t> shape{}; ///< forward and grad: the target shape (one -1 allowed)
};
struct EinsumAttrs {
    std::string equation{}; ///< "mk,kn->mn"
};

/// The attributes of a request; std::monostate means the op's defaults. The op name decides a reduction's kind
/// (sum, mean, max, min, prod: ReductionAttrs::kind is ignored) and softmax's `log` (softmax, log_softmax).
using RuleAttrs =
    std::variant<std::monostate, MatmulAttrs, ReductionAttrs, SoftmaxAttrs, CrossEntropyAttrs, TransposeAttrs,
                 ReshapeAttrs, EinsumAttrs, LinearAttrs, EmbeddingAttrs, MoEDispatchAttrs>;

/// One rule request, as the shardline-spmd JSON request (docs/spmd.md 5) but typed.
struct RuleRequest {
    std::string op{}; ///< matmul, linear, grouped_linear, moe_dispatch, moe_combine, embedding, softmax, log_softmax,
                      ///< cross_entropy, transpose, reshape, einsum, sum, mean, max, min, prod, or an elementwise name
    RuleDirection direction = RuleDirection::kForward;
    ProcessMesh mesh{};
    std::vector<TensorSpec> inputs{};     ///< positional, as the Infer* functions take them (linear: x, weight[, bias])
    std::optional<TensorSpec> out{};      ///< reverse: the output
    std::optional<TensorSpec> out_grad{}; ///< grad: the output gradient (cross_entropy: the loss gradient)
    RuleAttrs attrs{};
    RuleOptions options{};
};

/// The ops InferRule knows, sorted.
const std::vector<std::string> &RuleOpNames();
bool IsRuleOp(const std::string &op);

/// Dispatches `request` to the op's Infer{Forward,Reverse,Grad}; throws SpmdError naming the op for an unknown op,
/// a wrong input count (the message starts with "inputs:"), attrs of another op, or a missing out ("outputs:") /
/// out_grad ("out_grad:").
SpmdInfo InferRule(const RuleRequest &request);

/// The strategy enumeration of an einsum-style request (EnumerateEinsumStrategies over the op's einsum problem,
/// from the given input layouts, priced with request.options.plan).
struct RuleStrategies {
    std::vector<std::string> input_names;
    EinsumStrategies enumeration;
    /// linear with a bias: a strategy whose output is Partial adds the bias once, after the reduction.
    bool bias_after_reduction_if_partial = false;
};
/// The einsum-style ops EnumerateRuleStrategies takes: matmul, linear, einsum.
const std::vector<std::string> &EnumerableOpNames();
/// Enumerates the strategies of `request` (its direction is ignored: a forward request's inputs are the given
/// layouts). Throws SpmdError for an op that is not einsum-style, and as InferRule for a wrong request.
RuleStrategies EnumerateRuleStrategies(const RuleRequest &request);

/// An answer with the plans a module executes.
struct CachedRule {
    SpmdInfo info;
    /// One per info.inputs: the given layout -> the required one (forward and grad; in grad the output gradient
    /// too). Empty plans in reverse, and where the required tensor was not given (softmax grad's `out`).
    std::vector<RedistributePlan> input_plans;
    /// One per info.outputs. grad: the gradient -> its input's given layout without Partials (the op's backward
    /// communication); forward: the output -> options.output_target when set; empty otherwise.
    std::vector<RedistributePlan> output_plans;
};

/// Infers `request` and plans its redistributions (CachedRule's fields).
CachedRule InferRuleWithPlans(const RuleRequest &request);

/// The identity of a request: built once (it encodes and hashes the request), compared cheaply. Two keys are equal
/// exactly when their requests give the same answer by construction: same op, direction, mesh shape (names and
/// process ids do not change an answer, except the index of the dim that MoEDispatchAttrs::ep_dim names, which is
/// encoded), input / out / out_grad shapes and layouts, attrs and options.
class RuleKey {
public:
    RuleKey() = default;
    explicit RuleKey(RuleRequest request);
    /// Appends the encoding of `request` to `words` (what Words() holds), for a lookup that builds no key.
    static void Encode(const RuleRequest &request, std::vector<int64_t> &words);
    static uint64_t HashOf(const std::vector<int64_t> &words);

    const RuleRequest &Request() const { return request_; }
    uint64_t Hash() const { return hash_; }
    /// The encoded request (for tests and diagnostics).
    const std::vector<int64_t> &Words() const { return words_; }

    bool operator==(const RuleKey &other) const { return hash_ == other.hash_ && words_ == other.words_; }

private:
    RuleRequest request_;
    std::vector<int64_t> words_;
    uint64_t hash_ = 0;
};

/// An encoded request without its RuleKey (no copy of the request): what a cache hit looks up by.
struct RuleKeyView {
    const std::vector<int64_t> *words = nullptr;
    uint64_t hash = 0;
};

struct RuleKeyHash {
    using is_transparent = void;
    size_t operator()(const RuleKey &key) const noexcept { return static_cast<size_t>(key.Hash()); }
    size_t operator()(const RuleKeyView &key) const noexcept { return static_cast<size_t>(key.hash); }
};
struct RuleKeyEqual {
    using is_transparent = void;
    bool operator()(const RuleKey &a, const RuleKey &b) const { return a == b; }
    bool operator()(const RuleKeyView &a, const RuleKey &b) const {
        return a.hash == b.Hash() && *a.words == b.Words();
    }
    bool operator()(const RuleKey &a, const RuleKeyView &b) const {
        return b.hash == a.Hash() && *b.words == a.Words();
    }
};

/// A thread-safe map RuleKey -> CachedRule. Lookups take a shared lock; a miss infers outside the lock, so two
/// threads missing on one key may both infer, and the first insertion wins (both get the same answer). Entries stay
/// until Clear(); a returned pointer keeps its entry alive after Clear().
class RuleCache {
public:
    struct Stats {
        uint64_t hits = 0;
        uint64_t misses = 0;
        size_t size = 0;
    };

    /// The cached answer, or nullptr (counted as a miss). Allocates nothing.
    std::shared_ptr<const CachedRule> Lookup(const RuleKey &key) const;
    /// The cached answer, inferring and inserting it on a miss; inference errors propagate and cache nothing.
    std::shared_ptr<const CachedRule> GetOrInfer(const RuleKey &key);
    /// The same for a request: a hit encodes it into a per-thread buffer and copies nothing (the per-op-call path);
    /// only a miss builds the RuleKey.
    std::shared_ptr<const CachedRule> GetOrInfer(RuleRequest request);

    Stats GetStats() const;
    void Clear();

private:
    std::shared_ptr<const CachedRule> Find(const RuleKey &key) const;

    mutable std::shared_mutex mutex_;
    std::unordered_map<RuleKey, std::shared_ptr<const CachedRule>, RuleKeyHash, RuleKeyEqual> entries_;
    mutable std::atomic<uint64_t> hits_{0};
    mutable std::atomic<uint64_t> misses_{0};
};

} // namespace shardline::spmd
