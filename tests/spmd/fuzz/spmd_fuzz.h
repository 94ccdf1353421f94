#pragma once

// The shardline-spmd request fuzzer's pieces, shared by the seeded driver (spmd_fuzz_driver.cc) and the optional
// libFuzzer entry point (spmd_libfuzzer.cc): the seed requests, the mutator and the check of one answer.

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace shardline::spmd::fuzz {

/// Valid requests of every kind (each op and direction, redistribute, enumerate, cost mode and profiles, co-sharding,
/// Partials, uneven shapes) and the known hard cases (a mesh dim of 2^31, shapes near the limits).
const std::vector<std::string> &SeedRequests();

/// Mutates requests: JSON-level (edge numbers, type swaps, deleted / duplicated / renamed fields, known field names
/// and values, deep nesting, crossover between requests) and text-level (truncation, byte flips, insertions).
class Mutator {
public:
    explicit Mutator(uint64_t seed);
    /// A new request text: a mutated seed, or a mutation of an earlier interesting request.
    std::string Next();
    /// Keeps `text` as a base for later mutations (answered requests are interesting: they got past validation).
    void Remember(const std::string &text);

private:
    void MutateTree(nlohmann::json &j);
    void MutateText(std::string &text);
    nlohmann::json RandomValue(int depth);
    nlohmann::json *RandomNode(nlohmann::json &root);

    std::mt19937_64 rng_;
    std::vector<nlohmann::json> seeds_;
    std::vector<std::string> remembered_;
};

/// What one request did.
struct Outcome {
    int exit_code = 0;
    std::string finding; ///< non-empty: a defect (an internal error, an answer that is not an object, ...)
};

/// Answers `text` as shardline-spmd does (AnswerRequestText) and checks the answer: an object; exit 0 with a
/// non-error answer or exit 2 with exactly {"error": "<field>: <what>"}; serialisable; no "internal error".
Outcome RunOne(std::string_view text);

} // namespace shardline::spmd::fuzz
