#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>
#include <shardline/spmd/limits.h>

#include "json_util.h"

namespace shardline::spmd {

using nlohmann::json;

json MeshToJson(const ProcessMesh &mesh) {
    json j{{"shape", mesh.Shape()}, {"dim_names", mesh.DimNames()}};
    if (!mesh.HasDefaultProcessIds()) {
        j["process_ids"] = mesh.ProcessIds(); // the default 0 .. N-1 is not spelled out (N may be 2^40)
    }
    return j;
}

ProcessMesh MeshFromJson(const json &j, std::string_view field) {
    const std::vector<int64_t> shape =
        detail::AsIntList(detail::Require(j, "shape", field), detail::Field(field, "shape"));
    std::vector<std::string> names;
    if (j.contains("dim_names")) {
        const std::string f = detail::Field(field, "dim_names");
        const json &list = detail::AsArray(j["dim_names"], f);
        for (size_t i = 0; i < list.size(); ++i) {
            names.push_back(detail::AsString(list[i], detail::Index(f, i)));
        }
    }
    std::vector<int64_t> ids;
    if (j.contains("process_ids")) {
        ids = detail::AsIntList(j["process_ids"], detail::Field(field, "process_ids"));
    }
    try {
        return ProcessMesh(shape, names, ids);
    } catch (const SpmdError &e) {
        throw SpmdError(fmt::format("{}: {}", field, e.what()));
    }
}

json LayoutToJson(const Layout &layout, const ProcessMesh &mesh) {
    json dims_mapping = json::array();
    for (const auto &dims : layout.DimsMeshDims()) {
        if (dims.empty()) {
            dims_mapping.push_back(-1);
        } else if (dims.size() == 1) {
            dims_mapping.push_back(dims[0]);
        } else {
            dims_mapping.push_back(dims);
        }
    }
    json partial = json::object();
    for (const auto &[d, op] : layout.Partial()) {
        partial[std::to_string(d)] = std::string(ToString(op));
    }
    json placements = json::array();
    for (const Placement &p : layout.ToPlacements(mesh.NDim())) {
        placements.push_back(p.ToString());
    }
    return json{
        {"dims_mapping", dims_mapping}, {"partial", partial}, {"placements", placements}, {"text", layout.ToString()}};
}

namespace {

int MeshDimFromJson(const json &j, const ProcessMesh &mesh, std::string_view field) {
    if (j.is_string()) {
        try {
            return mesh.DimIndex(j.get<std::string>());
        } catch (const SpmdError &e) {
            throw SpmdError(fmt::format("{}: {}", field, e.what()));
        }
    }
    return detail::AsInt32(j, field);
}

std::map<int, ReduceOp> PartialFromJson(const json &j, const ProcessMesh &mesh, std::string_view field) {
    std::map<int, ReduceOp> partial;
    if (j.is_array()) {
        for (size_t i = 0; i < j.size(); ++i) {
            const int d = MeshDimFromJson(j[i], mesh, detail::Index(field, i));
            if (!partial.emplace(d, ReduceOp::kSum).second) {
                throw SpmdError(fmt::format("{}: mesh dim {} is listed twice", field, d));
            }
        }
    } else if (j.is_object()) {
        for (const auto &[key, value] : j.items()) {
            const std::string f = detail::Field(field, key);
            int d = 0;
            try {
                size_t used = 0;
                d = std::stoi(key, &used);
                if (used != key.size()) {
                    throw std::invalid_argument(key);
                }
            } catch (const std::exception &) {
                d = MeshDimFromJson(json(key), mesh, f);
            }
            try {
                partial[d] = ParseReduceOp(detail::AsString(value, f));
            } catch (const SpmdError &e) {
                throw SpmdError(fmt::format("{}: {}", f, e.what()));
            }
        }
    } else {
        throw SpmdError(fmt::format("{}: expected a list of mesh dims or an object mesh dim -> reduce op, got {}",
                                    field, j.dump()));
    }
    return partial;
}

} // namespace

Layout LayoutFromJson(const json &j, const ProcessMesh &mesh, int tensor_rank, std::string_view field) {
    if (!j.is_object()) {
        throw SpmdError(fmt::format("{}: expected an object, got {}", field, j.type_name()));
    }
    const int given = static_cast<int>(j.contains("dims_mapping")) + static_cast<int>(j.contains("placements")) +
                      static_cast<int>(j.contains("layout"));
    if (given > 1) {
        throw SpmdError(fmt::format("{}: give one of dims_mapping, placements or layout, not several", field));
    }
    Layout layout = Layout::Replicated(tensor_rank);
    std::string where = std::string(field);
    try {
        if (j.contains("dims_mapping")) {
            where = detail::Field(field, "dims_mapping");
            const json &list = detail::AsArray(j["dims_mapping"], where);
            std::vector<std::vector<int>> dims;
            for (size_t t = 0; t < list.size(); ++t) {
                const std::string f = detail::Index(where, t);
                std::vector<int> entry;
                if (list[t].is_array()) {
                    for (size_t k = 0; k < list[t].size(); ++k) {
                        const int d = MeshDimFromJson(list[t][k], mesh, detail::Index(f, k));
                        if (d < 0) {
                            throw SpmdError(fmt::format("{}: a co-shard list holds mesh dims >= 0, got {}",
                                                        detail::Index(f, k), d));
                        }
                        entry.push_back(d);
                    }
                } else {
                    const int d = MeshDimFromJson(list[t], mesh, f);
                    if (d < -1) {
                        throw SpmdError(fmt::format("{}: expected -1 or a mesh dim, got {}", f, d));
                    }
                    if (d >= 0) {
                        entry.push_back(d);
                    }
                }
                dims.push_back(std::move(entry));
            }
            std::map<int, ReduceOp> partial;
            if (j.contains("partial")) {
                where = detail::Field(field, "partial");
                partial = PartialFromJson(j["partial"], mesh, where);
            }
            where = detail::Field(field, "dims_mapping");
            layout = Layout(std::move(dims), std::move(partial));
        } else if (j.contains("placements")) {
            where = detail::Field(field, "placements");
            const json &list = detail::AsArray(j["placements"], where);
            if (static_cast<int>(list.size()) != mesh.NDim()) {
                throw SpmdError(fmt::format("{}: expected one placement per mesh dim ({}), got {}", where, mesh.NDim(),
                                            list.size()));
            }
            std::vector<Placement> placements;
            for (size_t d = 0; d < list.size(); ++d) {
                placements.push_back(Placement::Parse(detail::AsString(list[d], detail::Index(where, d))));
            }
            if (j.contains("partial")) {
                where = detail::Field(field, "partial");
                throw SpmdError(fmt::format("{}: with placements, write Partial as P(op), not a partial field", where));
            }
            layout = Layout::FromPlacements(placements, tensor_rank);
        } else if (j.contains("layout")) {
            where = detail::Field(field, "layout");
            layout = Layout::Parse(detail::AsString(j["layout"], where));
        } else if (j.contains("partial")) {
            where = detail::Field(field, "partial");
            layout = Layout(std::vector<std::vector<int>>(tensor_rank), PartialFromJson(j["partial"], mesh, where));
        }
        layout.Validate(mesh, tensor_rank, where);
    } catch (const SpmdError &e) {
        const std::string what = e.what();
        if (what.rfind(where, 0) == 0) {
            throw;
        }
        throw SpmdError(fmt::format("{}: {}", where, what));
    }
    return layout;
}

json TensorToJson(const std::string &name, const TensorSpec &spec, const ProcessMesh &mesh) {
    json j = LayoutToJson(spec.layout, mesh);
    j["name"] = name;
    j["shape"] = spec.shape;
    j["max_local_shape"] = MaxLocalShape(mesh, spec.shape, spec.layout);
    return j;
}

TensorSpec TensorFromJson(const json &j, const ProcessMesh &mesh, std::string_view field) {
    TensorSpec spec;
    spec.shape = detail::AsIntList(detail::Require(j, "shape", field), detail::Field(field, "shape"));
    CheckShape(spec.shape, detail::Field(field, "shape"));
    spec.layout = LayoutFromJson(j, mesh, static_cast<int>(spec.shape.size()), field);
    return spec;
}

namespace detail {

void CheckDepth(const json &j, int max_depth, std::string_view field) {
    std::vector<std::pair<const json *, int>> stack = {{&j, 1}};
    while (!stack.empty()) {
        const auto [value, depth] = stack.back();
        stack.pop_back();
        if (!value->is_array() && !value->is_object()) {
            continue;
        }
        if (depth > max_depth) {
            throw SpmdError(fmt::format("{}: nests arrays and objects more than {} deep", field, max_depth));
        }
        for (const json &child : *value) {
            stack.emplace_back(&child, depth + 1);
        }
    }
}

void CheckTextDepth(std::string_view text, int max_depth, std::string_view field) {
    int depth = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') {
                ++i;
            } else if (c == '"') {
                in_string = false;
            }
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth) {
                throw SpmdError(fmt::format("{}: nests arrays and objects more than {} deep", field, max_depth));
            }
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
}

} // namespace detail

json PlanToJson(const RedistributePlan &plan, const ProcessMesh &mesh) {
    json steps = json::array();
    for (const RedistributeStep &step : plan.steps) {
        json s{{"collective", std::string(ToString(step.collective))},
               {"mesh_dim", step.mesh_dim},
               {"mesh_dim_name", mesh.DimNames()[step.mesh_dim]},
               {"tensor_dim", step.tensor_dim},
               {"bytes_per_rank", step.bytes_per_rank},
               {"cost_us", step.cost_us},
               {"before", step.before.ToString()},
               {"after", step.after.ToString()}};
        if (step.collective == Collective::kAllToAll) {
            s["to_tensor_dim"] = step.to_tensor_dim;
        }
        if (step.collective == Collective::kAllReduce || step.collective == Collective::kReduceScatter ||
            step.collective == Collective::kLocalPartialize) {
            s["reduce_op"] = std::string(ToString(step.reduce_op));
        }
        steps.push_back(std::move(s));
    }
    return json{{"steps", steps}, {"cost_us", plan.cost_us}, {"bytes_per_rank", plan.bytes_per_rank}};
}

} // namespace shardline::spmd
