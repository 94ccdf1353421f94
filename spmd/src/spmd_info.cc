#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd {

namespace {

const TensorSpec &Find(const std::vector<std::string> &names, const std::vector<TensorSpec> &specs,
                       const std::string &name, std::string_view kind) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
        throw SpmdError(fmt::format("SpmdInfo: no {} named '{}' (have [{}])", kind, name, fmt::join(names, ",")));
    }
    return specs.at(it - names.begin());
}

} // namespace

const TensorSpec &SpmdInfo::Input(const std::string &name) const { return Find(input_names, inputs, name, "input"); }

const TensorSpec &SpmdInfo::Output(const std::string &name) const {
    return Find(output_names, outputs, name, "output");
}

} // namespace shardline::spmd
