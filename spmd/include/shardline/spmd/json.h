#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>
#include <shardline/spmd/rules.h>

namespace shardline::spmd {

/// {"shape": [2,4], "dim_names": ["dp","tp"], "process_ids": [0,...]}; only "shape" is required.
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

/// Answers one shardline-spmd request (docs/spmd.md): a rule ("op": "matmul", "direction": "forward" | "reverse"
/// | "grad", ...) or a plan ("op": "redistribute"). Throws SpmdError naming the offending field.
nlohmann::json HandleRequest(const nlohmann::json &request);

} // namespace shardline::spmd
