#pragma once

// Private: the built-in cost profiles (spmd/profiles/*.json, compiled in by spmd/CMakeLists.txt), name -> JSON text.

#include <string_view>
#include <utility>
#include <vector>

namespace shardline::spmd::detail {

const std::vector<std::pair<std::string_view, std::string_view>> &BuiltinCostProfiles();

} // namespace shardline::spmd::detail
