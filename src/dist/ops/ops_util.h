#pragma once

// Shared steps of the ops on DistTensors, private to dist/: checking that operands live on one mesh, asking the rule
// cache, and moving an operand to the layout its rule requires.

#include <initializer_list>
#include <string_view>

#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/dist/ops.h>

namespace shardline::dist::detail {

/// The mesh shared by `tensors` (nullptr when all are local); throws naming `op` when they mix meshes or mix local
/// and distributed tensors, or when one is undefined.
comm::DeviceMesh* CommonMesh(std::string_view op, std::initializer_list<const DistTensor*> tensors);

/// `t` moved to `required` by `plan` (the rule's input plan for it).
DistTensor Prepare(const DistTensor& t, const spmd::TensorSpec& required, const spmd::RedistributePlan& plan);

/// `t` in `layout`: itself when the layouts agree on the mesh (size-1 mesh dims aside), else redistributed.
DistTensor MoveTo(const DistTensor& t, const spmd::Layout& layout);

/// A shard an op computed, in the layout its rule gave.
inline DistTensor Shard(Tensor local, const spmd::TensorSpec& spec, comm::DeviceMesh* mesh) {
    return DistTensor::FromTrustedShard(std::move(local), spec.shape, spec.layout, mesh);
}

/// The global index of the first element of t's local shard along `dim` (0 for a local tensor).
std::int64_t LocalOffset(const DistTensor& t, int dim);

} // namespace shardline::dist::detail
