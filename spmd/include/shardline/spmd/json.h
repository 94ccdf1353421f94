#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd {

/// {"shape": [2,4], "dim_names": ["dp","tp"], "process_ids": [...]}; only "shape" is required. MeshToJson writes
/// process_ids only when they are not the default 0 .. N-1.
nlohmann::json MeshToJson(const ProcessMesh &mesh);
ProcessMesh MeshFromJson(const nlohmann::json &j, std::string_view field = "mesh");

/// {"dims_mapping": [1,-1] (a co-sharded entry is a list, major first), "partial": {"0": "sum"},
///  "placements": ["S(0)", "R"], "text": "[1,-1] partial{0}"}.
nlohmann::json LayoutToJson(const Layout &layout, const ProcessMesh &mesh);
/// Reads a layout from an object holding one of "dims_mapping" (+ optional "partial": a list of mesh dims for
/// sum, or an object mesh dim -> op), "placements" or "layout" (the text form); none of them means Replicate.
/// Validated against the mesh and `tensor_rank`; errors name `field`.
Layout LayoutFromJson(const nlohmann::json &j, const ProcessMesh &mesh, int tensor_rank, std::string_view field);

/// {"name", "shape", layout fields..., "max_local_shape"}.
nlohmann::json TensorToJson(const std::string &name, const TensorSpec &spec, const ProcessMesh &mesh);
/// {"name"?, "shape", layout fields}: errors name `field`.
TensorSpec TensorFromJson(const nlohmann::json &j, const ProcessMesh &mesh, std::string_view field);

nlohmann::json PlanToJson(const RedistributePlan &plan, const ProcessMesh &mesh);

/// Reads a cost profile, or overrides of one: {"name", "description", "call_us", "alpha_us", "bandwidth_gb_per_s",
/// "flops_per_us", "call_us_per_dim", "alpha_us_per_dim", "bandwidth_gb_per_s_per_dim", "measurements"}; absent
/// fields keep `base`'s values. Unknown fields and invalid values (CostModel::Validate) are errors naming `field`.
CostModel CostModelFromJson(const nlohmann::json &j, const CostModel &base, std::string_view field);
nlohmann::json CostModelToJson(const CostModel &model);
/// Reads a profile file (CostModelFromJson over CostModel{}); errors name the path.
CostModel LoadCostProfile(const std::string &path);

/// Answers one shardline-spmd request (docs/spmd.md): a rule ("op": "matmul", "direction": "forward" | "reverse"
/// | "grad" | "enumerate", ...) or a plan ("op": "redistribute"). `base` is the cost model before the request's
/// "cost_profile" and "cost_model" (shardline-spmd --cost-profile). Throws SpmdError naming the offending field.
nlohmann::json HandleRequest(const nlohmann::json &request, const CostModel &base = CostModel{});

/// What shardline-spmd prints for one request text and its exit code: the answer and 0, or {"error": "..."} and 2
/// for every wrong request (bad JSON, too large or too deep, any SpmdError); never throws for a request.
struct RequestAnswer {
    nlohmann::json answer;
    int exit_code = 0;
};
RequestAnswer AnswerRequestText(std::string_view text, const CostModel &base = CostModel{});

} // namespace shardline::spmd
