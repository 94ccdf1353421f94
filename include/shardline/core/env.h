#pragma once

// The one reader of shardline's environment variables. Every SHARDLINE_* variable (and the few foreign ones the
// library consults, such as NCCL_NVLS_ENABLE) is read through these functions, so they share one grammar:
//   - unset or empty means "not given" (the caller's default applies);
//   - booleans: 1/0, true/false, on/off, yes/no (case-insensitive);
//   - integers: decimal, within the range the caller states;
//   - numbers: decimal or scientific, within the range the caller states;
//   - choices: one of the listed words, exactly.
// Anything else raises shardline::Error naming the variable, the accepted values and what was found, so a typo is
// never read as "off".

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace shardline::env {

/// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> Get(std::string_view name);

/// Parsers for one value of variable `name` (exposed so the grammar is testable without touching the environment).
bool ParseBool(std::string_view name, std::string_view text);
std::int64_t ParseInt(std::string_view name, std::string_view text, std::int64_t min, std::int64_t max);
double ParseDouble(std::string_view name, std::string_view text, double min, double max);
std::string ParseChoice(std::string_view name, std::string_view text, std::initializer_list<std::string_view> choices);

/// Get + Parse*, or `fallback` when the variable is not given.
bool GetBool(std::string_view name, bool fallback);
std::int64_t GetInt(std::string_view name, std::int64_t fallback, std::int64_t min, std::int64_t max);
double GetDouble(std::string_view name, double fallback, double min, double max);
std::string GetChoice(std::string_view name, std::string_view fallback,
                      std::initializer_list<std::string_view> choices);

} // namespace shardline::env
