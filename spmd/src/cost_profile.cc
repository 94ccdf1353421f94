// Cost profiles: the built-in ones (spmd/profiles/*.json) and the JSON form of a CostModel (docs/spmd.md 7).

#include <algorithm>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/redistribute.h>

#include "cost_profiles.h"
#include "json_util.h"

namespace shardline::spmd {

using nlohmann::json;

CostModel CostModelFromJson(const json &j, const CostModel &base, std::string_view field) {
    if (!j.is_object()) {
        throw SpmdError(fmt::format("{}: expected an object, got {}", field, j.type_name()));
    }
    CostModel model = base;
    for (const auto &item : j.items()) {
        // Named, not structured bindings: the lambda below captures them (clang < 16 cannot capture a binding).
        const std::string &key = item.key();
        const json &value = item.value();
        const std::string f = detail::Field(field, key);
        auto per_dim = [&](std::vector<double> &out) {
            const json &list = detail::AsArray(value, f);
            if (list.size() > static_cast<size_t>(kMaxMeshDims)) {
                throw SpmdError(
                    fmt::format("{}: {} entries; a mesh has at most {} dims", f, list.size(), kMaxMeshDims));
            }
            out.clear();
            for (size_t i = 0; i < list.size(); ++i) {
                out.push_back(detail::AsNumber(list[i], detail::Index(f, i)));
            }
        };
        if (key == "call_us") {
            model.call_us = detail::AsNumber(value, f);
        } else if (key == "alpha_us") {
            model.alpha_us = detail::AsNumber(value, f);
        } else if (key == "bandwidth_gb_per_s") {
            model.bandwidth_gb_per_s = detail::AsNumber(value, f);
        } else if (key == "flops_per_us") {
            model.flops_per_us = detail::AsNumber(value, f);
        } else if (key == "call_us_per_dim") {
            per_dim(model.call_us_per_dim);
        } else if (key == "alpha_us_per_dim") {
            per_dim(model.alpha_us_per_dim);
        } else if (key == "bandwidth_gb_per_s_per_dim") {
            per_dim(model.bandwidth_gb_per_s_per_dim);
        } else if (key == "name") {
            model.name = detail::AsString(value, f);
        } else if (key == "description" || key == "measurements") {
            // Documentation of a profile (shardline-spmd-mpi-probe writes both): not priced.
        } else {
            throw SpmdError(fmt::format("{}: unknown field (known: call_us, alpha_us, bandwidth_gb_per_s, "
                                        "flops_per_us, call_us_per_dim, alpha_us_per_dim, bandwidth_gb_per_s_per_dim, "
                                        "name, description, measurements)",
                                        f));
        }
    }
    // The error names the field as the request spells it: "cost_model.bandwidth_gb_per_s: must be ...".
    model.Validate(field);
    return model;
}

json CostModelToJson(const CostModel &model) {
    json j{{"name", model.name},
           {"call_us", model.call_us},
           {"alpha_us", model.alpha_us},
           {"bandwidth_gb_per_s", model.bandwidth_gb_per_s},
           {"flops_per_us", model.flops_per_us}};
    if (!model.call_us_per_dim.empty()) {
        j["call_us_per_dim"] = model.call_us_per_dim;
    }
    if (!model.alpha_us_per_dim.empty()) {
        j["alpha_us_per_dim"] = model.alpha_us_per_dim;
    }
    if (!model.bandwidth_gb_per_s_per_dim.empty()) {
        j["bandwidth_gb_per_s_per_dim"] = model.bandwidth_gb_per_s_per_dim;
    }
    return j;
}

CostModel CostProfile(std::string_view name) {
    for (const auto &[profile, text] : detail::BuiltinCostProfiles()) {
        if (profile == name) {
            return CostModelFromJson(json::parse(text), CostModel{}, fmt::format("cost profile {}", name));
        }
    }
    throw SpmdError(
        fmt::format("cost profile: unknown profile '{}' (built in: [{}])", name, fmt::join(CostProfileNames(), ",")));
}

std::vector<std::string> CostProfileNames() {
    std::vector<std::string> names;
    for (const auto &[profile, text] : detail::BuiltinCostProfiles()) {
        names.emplace_back(profile);
    }
    std::sort(names.begin(), names.end());
    return names;
}

CostModel LoadCostProfile(const std::string &path) {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
        throw SpmdError(fmt::format("cost profile '{}': cannot open it", path));
    }
    std::string text;
    text.reserve(4096);
    std::istreambuf_iterator<char> it(file);
    for (; it != std::istreambuf_iterator<char>(); ++it) {
        if (static_cast<int64_t>(text.size()) >= kMaxRequestBytes) {
            throw SpmdError(fmt::format("cost profile '{}': larger than {} bytes", path, kMaxRequestBytes));
        }
        text.push_back(*it);
    }
    json j;
    try {
        j = json::parse(text);
    } catch (const json::parse_error &e) {
        throw SpmdError(fmt::format("cost profile '{}': invalid JSON: {}", path, e.what()));
    }
    return CostModelFromJson(j, CostModel{}, fmt::format("cost profile '{}'", path));
}

} // namespace shardline::spmd
