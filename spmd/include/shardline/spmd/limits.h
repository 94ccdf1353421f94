#pragma once

// The bounds every mesh, shape and request is checked against before anything is allocated from it, and the checked
// arithmetic that derived sizes (element counts, bytes per rank) go through. A query costs time and memory in the
// number of mesh dims, tensor dims and labels, never in the number of ranks or elements (docs/spmd.md 8).

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

namespace shardline::spmd {

/// Mesh dims of a ProcessMesh (DTensor meshes have at most a handful).
inline constexpr int kMaxMeshDims = 16;
/// Ranks of a ProcessMesh, the product of its dims (2^40: far beyond any machine; only the checked products below
/// care).
inline constexpr int64_t kMaxMeshSize = int64_t{1} << 40;
/// Dims of a tensor.
inline constexpr int kMaxTensorRank = 64;
/// Elements of a tensor, counting a 0-size dim as 1 (so every partial product of its dims is bounded too).
inline constexpr int64_t kMaxElements = int64_t{1} << 50;
/// Bytes per element (`element_size`).
inline constexpr int64_t kMaxElementSize = 64;
/// Candidates a cost-mode rule or an `enumerate` request may price (the product over mesh dims of the choices per
/// mesh dim); beyond it the request is refused rather than left running.
inline constexpr int64_t kMaxCandidates = 1024;
/// Bytes of one request text (shardline-spmd, AnswerRequestText) and nesting depth of its JSON.
inline constexpr int64_t kMaxRequestBytes = int64_t{64} << 20;
inline constexpr int kMaxRequestDepth = 32;

/// a * b for a, b >= 0; throws SpmdError naming `what` when it exceeds int64.
int64_t CheckedMul(int64_t a, int64_t b, std::string_view what);
/// a + b for a, b >= 0; throws SpmdError naming `what` when it exceeds int64.
int64_t CheckedAdd(int64_t a, int64_t b, std::string_view what);
/// Product of `values` (each >= 0); throws SpmdError naming `what` when it exceeds int64.
int64_t CheckedProduct(const std::vector<int64_t> &values, std::string_view what);

/// Throws SpmdError naming `what` unless `shape` has at most kMaxTensorRank dims, every dim >= 0 and at most
/// kMaxElements elements (a 0-size dim counted as 1).
void CheckShape(const std::vector<int64_t> &shape, std::string_view what);

} // namespace shardline::spmd
