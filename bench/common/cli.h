#pragma once

// The command line every benchmark shares: CLI11 with each option's default in --help, and comma-separated lists
// (--ops all_reduce,all_gather) validated item by item. Header-only, no CUDA, no MPI.
//
// A repeated option keeps its last value (the run scripts append $BENCH_ARGS after their own choices, so
// `--suite full ... --suite quick` must mean quick), and a list is one argument, split here, so it follows the same
// rule: `--tokens 128,2048 --tokens 8192` is {8192}.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

namespace shardline::bench {

/// Show every option's default in --help; a repeated option keeps its last value. Call before adding options.
inline void UseBenchDefaults(CLI::App& app) {
    app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

/// The non-empty items of a comma-separated list.
inline std::vector<std::string> SplitList(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');) {
        if (!item.empty()) {
            out.push_back(item);
        }
    }
    return out;
}

/// A list whose items are all among `choices`.
inline CLI::Validator ListOf(std::initializer_list<const char*> choices) {
    std::vector<std::string> allowed(choices.begin(), choices.end());
    std::string names;
    for (const std::string& c : allowed) {
        names += (names.empty() ? "" : ",") + c;
    }
    return CLI::Validator(
        [allowed, names](std::string& text) -> std::string {
            for (const std::string& item : SplitList(text)) {
                if (std::find(allowed.begin(), allowed.end(), item) == allowed.end()) {
                    return "'" + item + "' is not one of " + names;
                }
            }
            return {};
        },
        "{" + names + "},...");
}

/// A list of integers >= `min`.
inline CLI::Validator IntListAtLeast(std::int64_t min) {
    return CLI::Validator(
        [min](std::string& text) -> std::string {
            for (const std::string& item : SplitList(text)) {
                std::int64_t v = 0;
                if (!CLI::detail::lexical_cast(item, v)) {
                    return "'" + item + "' is not an integer";
                }
                if (v < min) {
                    return "'" + item + "' is below " + std::to_string(min);
                }
            }
            return {};
        },
        "INT,...");
}

/// The integers of a list already checked by IntListAtLeast.
inline std::vector<std::int64_t> ParseIntList(const std::string& text) {
    std::vector<std::int64_t> out;
    for (const std::string& item : SplitList(text)) {
        std::int64_t v = 0;
        CLI::detail::lexical_cast(item, v);
        out.push_back(v);
    }
    return out;
}

/// A value that `parse` accepts (it throws on anything else; its message becomes CLI11's).
template <typename Parse> CLI::Validator AcceptedBy(Parse parse, std::string description) {
    return CLI::Validator(
        [parse](std::string& text) -> std::string {
            try {
                parse(text);
            } catch (const std::exception& e) {
                return e.what();
            }
            return {};
        },
        std::move(description));
}

} // namespace shardline::bench
