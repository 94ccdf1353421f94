#pragma once

// Private: typed access to request fields with errors that name the field.

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/spmd/error.h>

namespace shardline::spmd::detail {

inline std::string Field(std::string_view parent, std::string_view key) {
    return parent.empty() ? std::string(key) : fmt::format("{}.{}", parent, key);
}

inline std::string Index(std::string_view parent, size_t i) { return fmt::format("{}[{}]", parent, i); }

inline std::string TypeName(const nlohmann::json &j) { return j.type_name(); }

inline const nlohmann::json &Require(const nlohmann::json &j, std::string_view key, std::string_view field) {
    if (!j.is_object()) {
        throw SpmdError(fmt::format("{}: expected an object, got {}", field, TypeName(j)));
    }
    auto it = j.find(std::string(key));
    if (it == j.end()) {
        throw SpmdError(fmt::format("{}: missing required field '{}'", field.empty() ? "request" : field, key));
    }
    return *it;
}

inline int64_t AsInt(const nlohmann::json &j, std::string_view field) {
    if (!j.is_number_integer()) {
        throw SpmdError(fmt::format("{}: expected an integer, got {} {}", field, TypeName(j), j.dump()));
    }
    return j.get<int64_t>();
}

/// An integer that fits an int (mesh dims, axes, permutations): a larger one would wrap around when narrowed.
inline int AsInt32(const nlohmann::json &j, std::string_view field) {
    const int64_t value = AsInt(j, field);
    if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
        throw SpmdError(fmt::format("{}: expected an integer in the int range, got {}", field, value));
    }
    return static_cast<int>(value);
}

inline bool AsBool(const nlohmann::json &j, std::string_view field) {
    if (!j.is_boolean()) {
        throw SpmdError(fmt::format("{}: expected true or false, got {} {}", field, TypeName(j), j.dump()));
    }
    return j.get<bool>();
}

inline double AsNumber(const nlohmann::json &j, std::string_view field) {
    if (!j.is_number()) {
        throw SpmdError(fmt::format("{}: expected a number, got {} {}", field, TypeName(j), j.dump()));
    }
    return j.get<double>();
}

inline std::string AsString(const nlohmann::json &j, std::string_view field) {
    if (!j.is_string()) {
        throw SpmdError(fmt::format("{}: expected a string, got {} {}", field, TypeName(j), j.dump()));
    }
    return j.get<std::string>();
}

inline const nlohmann::json &AsArray(const nlohmann::json &j, std::string_view field) {
    if (!j.is_array()) {
        throw SpmdError(fmt::format("{}: expected an array, got {} {}", field, TypeName(j), j.dump()));
    }
    return j;
}

inline std::vector<int64_t> AsIntList(const nlohmann::json &j, std::string_view field) {
    std::vector<int64_t> values;
    for (size_t i = 0; i < AsArray(j, field).size(); ++i) {
        values.push_back(AsInt(j[i], Index(field, i)));
    }
    return values;
}

inline std::vector<int> AsInt32List(const nlohmann::json &j, std::string_view field) {
    std::vector<int> values;
    for (size_t i = 0; i < AsArray(j, field).size(); ++i) {
        values.push_back(AsInt32(j[i], Index(field, i)));
    }
    return values;
}

/// Throws SpmdError unless `j` nests arrays and objects at most `max_depth` deep (checked without recursion, before
/// anything copies or prints the value: both recurse).
void CheckDepth(const nlohmann::json &j, int max_depth, std::string_view field);
/// The same on JSON text, before it is parsed (strings are skipped; the text need not be valid).
void CheckTextDepth(std::string_view text, int max_depth, std::string_view field);

} // namespace shardline::spmd::detail
