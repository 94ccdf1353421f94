// The request mutator and the check of one answer (spmd_fuzz.h).

#include <algorithm>
#include <climits>
#include <cstdint>

#include <shardline/spmd/json.h>

#include "spmd_fuzz.h"

namespace shardline::spmd::fuzz {

using nlohmann::json;

namespace {

/// Field names and string values the requests use: mutations draw from them so that they reach past the parser.
const std::vector<std::string> &Words() {
    static const std::vector<std::string> words = {"op",
                                                   "mesh",
                                                   "shape",
                                                   "dim_names",
                                                   "process_ids",
                                                   "direction",
                                                   "mode",
                                                   "inputs",
                                                   "outputs",
                                                   "out_grad",
                                                   "attrs",
                                                   "output_target",
                                                   "dtype",
                                                   "element_size",
                                                   "cost_model",
                                                   "cost_profile",
                                                   "name",
                                                   "dims_mapping",
                                                   "partial",
                                                   "placements",
                                                   "layout",
                                                   "src",
                                                   "dst",
                                                   "trans_x",
                                                   "trans_y",
                                                   "sparse",
                                                   "axes",
                                                   "keepdim",
                                                   "axis",
                                                   "vocab_parallel",
                                                   "reduction",
                                                   "perm",
                                                   "equation",
                                                   "num_experts",
                                                   "topk",
                                                   "capacity",
                                                   "ep_dim",
                                                   "call_us",
                                                   "alpha_us",
                                                   "bandwidth_gb_per_s",
                                                   "flops_per_us",
                                                   "alpha_us_per_dim",
                                                   "call_us_per_dim",
                                                   "bandwidth_gb_per_s_per_dim",
                                                   "matmul",
                                                   "linear",
                                                   "moe_dispatch",
                                                   "moe_combine",
                                                   "embedding",
                                                   "embedding_bag",
                                                   "softmax",
                                                   "log_softmax",
                                                   "cross_entropy",
                                                   "transpose",
                                                   "reshape",
                                                   "einsum",
                                                   "sum",
                                                   "mean",
                                                   "max",
                                                   "min",
                                                   "prod",
                                                   "avg",
                                                   "add",
                                                   "multiply",
                                                   "divide",
                                                   "relu",
                                                   "identity",
                                                   "abs",
                                                   "redistribute",
                                                   "forward",
                                                   "reverse",
                                                   "grad",
                                                   "enumerate",
                                                   "cost",
                                                   "deterministic",
                                                   "float32",
                                                   "bfloat16",
                                                   "int64",
                                                   "nccl_h200",
                                                   "mpi_cpu",
                                                   "R",
                                                   "S(0)",
                                                   "S(1)",
                                                   "S(0)[1]",
                                                   "P(sum)",
                                                   "P(prod)",
                                                   "P(max)",
                                                   "P",
                                                   "[0,-1]",
                                                   "[[0,1],-1] partial{2:prod}",
                                                   "[-1] partial{0:avg}",
                                                   "mk,kn->mn",
                                                   "abc,cd->abd",
                                                   "a->",
                                                   "->",
                                                   "ab,ab,ab->ab",
                                                   "dp",
                                                   "tp",
                                                   "d0",
                                                   "none",
                                                   ""};
    return words;
}

const std::vector<int64_t> &EdgeIntegers() {
    static const std::vector<int64_t> values = {0,
                                                1,
                                                -1,
                                                -2,
                                                2,
                                                3,
                                                7,
                                                16,
                                                64,
                                                1000,
                                                INT_MAX,
                                                int64_t{INT_MAX} + 1,
                                                INT_MIN,
                                                int64_t{1} << 32,
                                                int64_t{1} << 40,
                                                (int64_t{1} << 40) + 1,
                                                int64_t{1} << 50,
                                                (int64_t{1} << 50) + 1,
                                                int64_t{1} << 53,
                                                int64_t{1} << 62,
                                                INT64_MAX,
                                                INT64_MIN};
    return values;
}

} // namespace

Mutator::Mutator(uint64_t seed) : rng_(seed) {
    for (const std::string &text : SeedRequests()) {
        seeds_.push_back(json::parse(text));
    }
}

void Mutator::Remember(const std::string &text) {
    if (remembered_.size() < 4096) {
        remembered_.push_back(text);
    } else {
        remembered_[rng_() % remembered_.size()] = text;
    }
}

json Mutator::RandomValue(int depth) {
    switch (rng_() % (depth > 2 ? 6 : 9)) {
    case 0:
        return EdgeIntegers()[rng_() % EdgeIntegers().size()];
    case 1:
        return static_cast<int64_t>(rng_() % 9) - 2;
    case 2:
        return Words()[rng_() % Words().size()];
    case 3: {
        const double doubles[] = {0.0, -0.0, 0.5, -1.5, 1e-300, 1e300, -1e300, 3.0};
        return doubles[rng_() % 8];
    }
    case 4:
        return rng_() % 2 == 0;
    case 5:
        return nullptr;
    case 6: {
        json a = json::array();
        const size_t n = rng_() % 5;
        for (size_t i = 0; i < n; ++i) {
            a.push_back(RandomValue(depth + 1));
        }
        return a;
    }
    case 7: {
        json o = json::object();
        const size_t n = rng_() % 4;
        for (size_t i = 0; i < n; ++i) {
            o[Words()[rng_() % Words().size()]] = RandomValue(depth + 1);
        }
        return o;
    }
    default: {
        // A deep nest (the depth limit) or a long list (the size limits).
        json v = 1;
        const int nest = static_cast<int>(rng_() % 48);
        for (int i = 0; i < nest; ++i) {
            v = json::array({v});
        }
        if (rng_() % 2 == 0) {
            v = json::array();
            const size_t n = 1 + rng_() % 200;
            for (size_t i = 0; i < n; ++i) {
                v.push_back(rng_() % 3 == 0 ? int64_t{-1} : static_cast<int64_t>(rng_() % 3));
            }
        }
        return v;
    }
    }
}

json *Mutator::RandomNode(json &root) {
    // A random walk down from the root; stops at a random depth.
    json *node = &root;
    while ((node->is_object() || node->is_array()) && !node->empty() && rng_() % 3 != 0) {
        auto it = node->begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng_() % node->size()));
        node = &*it;
    }
    return node;
}

void Mutator::MutateTree(json &j) {
    json *node = RandomNode(j);
    switch (rng_() % 10) {
    case 0: // an edge number where a number is
    case 1:
        *node = node->is_number() || rng_() % 3 == 0 ? json(EdgeIntegers()[rng_() % EdgeIntegers().size()])
                                                     : RandomValue(0);
        break;
    case 2: // another value, any type
        *node = RandomValue(0);
        break;
    case 3: // delete a field or element
        if (node->is_object() && !node->empty()) {
            auto it = node->begin();
            std::advance(it, static_cast<std::ptrdiff_t>(rng_() % node->size()));
            node->erase(it);
        } else if (node->is_array() && !node->empty()) {
            node->erase(node->begin() + static_cast<std::ptrdiff_t>(rng_() % node->size()));
        }
        break;
    case 4: // duplicate an element / grow a list
        if (node->is_array() && !node->empty()) {
            const json copy = (*node)[rng_() % node->size()];
            const size_t times = 1 + rng_() % 4;
            for (size_t i = 0; i < times; ++i) {
                node->push_back(copy);
            }
        } else if (node->is_array()) {
            node->push_back(RandomValue(1));
        }
        break;
    case 5: // a known field with a random value
        if (node->is_object()) {
            (*node)[Words()[rng_() % Words().size()]] = RandomValue(0);
        }
        break;
    case 6: // a known string value
        if (node->is_string() || rng_() % 4 == 0) {
            *node = Words()[rng_() % Words().size()];
        }
        break;
    case 7: { // crossover: a subtree of another seed
        json other = seeds_[rng_() % seeds_.size()];
        *node = *RandomNode(other);
        break;
    }
    case 8: // numbers nudged by one (off-by-one boundaries)
        if (node->is_number_integer()) {
            const int64_t v = node->get<int64_t>();
            *node = v == INT64_MAX ? v - 1 : v == INT64_MIN ? v + 1 : v + (rng_() % 2 == 0 ? 1 : -1);
        }
        break;
    default: // the mesh: a large or odd shape
        if (j.is_object() && j.contains("mesh") && j["mesh"].is_object()) {
            json shape = json::array();
            const size_t n = 1 + rng_() % 6;
            for (size_t i = 0; i < n; ++i) {
                shape.push_back(rng_() % 4 == 0 ? EdgeIntegers()[rng_() % EdgeIntegers().size()]
                                                : static_cast<int64_t>(1 + rng_() % 4));
            }
            j["mesh"]["shape"] = shape;
        }
        break;
    }
}

void Mutator::MutateText(std::string &text) {
    if (text.empty()) {
        text = "{";
        return;
    }
    const size_t at = rng_() % text.size();
    switch (rng_() % 4) {
    case 0:
        text.resize(at); // truncated
        break;
    case 1:
        text[at] = static_cast<char>(rng_() % 256); // a flipped byte (possibly not UTF-8)
        break;
    case 2:
        text.insert(at, text.substr(rng_() % text.size(), rng_() % 32)); // a duplicated chunk
        break;
    default: {
        const char *pieces[] = {"[", "]", "{", "}", ",", ":", "\"", "\\u0000", "-", "1e999", "null", "\xff\xfe"};
        text.insert(at, pieces[rng_() % 12]);
        break;
    }
    }
}

std::string Mutator::Next() {
    json j;
    if (!remembered_.empty() && rng_() % 2 == 0) {
        j = json::parse(remembered_[rng_() % remembered_.size()], nullptr, false);
        if (j.is_discarded()) {
            j = seeds_[rng_() % seeds_.size()];
        }
    } else {
        j = seeds_[rng_() % seeds_.size()];
    }
    const int mutations = static_cast<int>(rng_() % 4); // 0: the request itself, now and then
    for (int i = 0; i < mutations; ++i) {
        MutateTree(j);
    }
    std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
    if (rng_() % 8 == 0) {
        MutateText(text);
    }
    return text;
}

Outcome RunOne(std::string_view text) {
    Outcome outcome;
    const RequestAnswer answer = AnswerRequestText(text);
    outcome.exit_code = answer.exit_code;
    const json &a = answer.answer;
    // The tool prints with the replace handler; the answer must serialise that way whatever bytes it quotes.
    const std::string printed = a.dump(-1, ' ', false, json::error_handler_t::replace);
    if (!a.is_object()) {
        outcome.finding = "the answer is not a JSON object: " + printed.substr(0, 200);
    } else if (answer.exit_code == 2) {
        if (a.size() != 1 || !a.contains("error") || !a["error"].is_string()) {
            outcome.finding = "exit 2 without exactly {\"error\": \"...\"}: " + printed.substr(0, 200);
        } else {
            const std::string message = a["error"];
            // An exception the code did not expect: AnswerRequestText prefixes it with "internal error" (any
            // std::exception) or "request: [json.exception" (a nlohmann error outside the parser). Prefixes only: a
            // field name quoted later in a message is the request's text.
            if (message.rfind("internal error", 0) == 0 || message.rfind("request: [json.exception", 0) == 0 ||
                message.rfind("request: out of memory", 0) == 0) {
                outcome.finding = "unexpected exception: " + message.substr(0, 300);
            }
            if (message.find(':') == std::string::npos) {
                outcome.finding = "an error without its field: " + message.substr(0, 300);
            }
        }
    } else if (answer.exit_code != 0 || a.contains("error")) {
        outcome.finding = "exit " + std::to_string(answer.exit_code) + " with " + printed.substr(0, 200);
    }
    return outcome;
}

} // namespace shardline::spmd::fuzz
