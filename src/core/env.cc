#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>

namespace shardline::env {
namespace {

std::string Lower(std::string_view text) {
    std::string out(text);
    std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
    return out;
}

} // namespace

std::optional<std::string> Get(std::string_view name) {
    const std::string key(name);
    const char* value = std::getenv(key.c_str());
    if (value == nullptr || *value == '\0') {
        return std::nullopt;
    }
    return std::string(value);
}

bool ParseBool(std::string_view name, std::string_view text) {
    const std::string v = Lower(text);
    if (v == "1" || v == "true" || v == "on" || v == "yes") {
        return true;
    }
    if (v == "0" || v == "false" || v == "off" || v == "no") {
        return false;
    }
    SHARDLINE_THROW(Error, name, "expected a boolean (1/0, true/false, on/off, yes/no), got '{}'", text);
}

std::int64_t ParseInt(std::string_view name, std::string_view text, std::int64_t min, std::int64_t max) {
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    SHARDLINE_CHECK(ec == std::errc() && end == text.data() + text.size() && value >= min && value <= max, name,
                    "expected an integer in {}..{}, got '{}'", min, max, text);
    return value;
}

double ParseDouble(std::string_view name, std::string_view text, double min, double max) {
    // strtod rather than from_chars: g++ 12's libstdc++ has the double overload, but strtod is what every
    // toolchain agrees on for "1e3" and "0.5".
    const std::string s(text);
    char* end = nullptr;
    const double value = s.empty() ? std::nan("") : std::strtod(s.c_str(), &end);
    SHARDLINE_CHECK(!s.empty() && end == s.c_str() + s.size() && std::isfinite(value) && value >= min && value <= max,
                    name, "expected a number in [{}, {}], got '{}'", min, max, text);
    return value;
}

std::string ParseChoice(std::string_view name, std::string_view text, std::initializer_list<std::string_view> choices) {
    for (std::string_view c : choices) {
        if (text == c) {
            return std::string(c);
        }
    }
    SHARDLINE_THROW(Error, name, "expected one of {}, got '{}'", fmt::join(choices, ", "), text);
}

bool GetBool(std::string_view name, bool fallback) {
    const auto v = Get(name);
    return v ? ParseBool(name, *v) : fallback;
}

std::int64_t GetInt(std::string_view name, std::int64_t fallback, std::int64_t min, std::int64_t max) {
    const auto v = Get(name);
    return v ? ParseInt(name, *v, min, max) : fallback;
}

double GetDouble(std::string_view name, double fallback, double min, double max) {
    const auto v = Get(name);
    return v ? ParseDouble(name, *v, min, max) : fallback;
}

std::string GetChoice(std::string_view name, std::string_view fallback,
                      std::initializer_list<std::string_view> choices) {
    const auto v = Get(name);
    return v ? ParseChoice(name, *v, choices) : std::string(fallback);
}

} // namespace shardline::env
