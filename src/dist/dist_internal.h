#pragma once

// Glue between spmd/ (layouts, planner) and comm/ (meshes, collectives), private to dist/.

#include <string_view>
#include <utility>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

namespace shardline::dist::detail {

/// The spmd view of a DeviceMesh (same shape and names; process id = world rank).
inline spmd::ProcessMesh ToProcessMesh(const comm::DeviceMesh &mesh) {
    return spmd::ProcessMesh(mesh.shape(), mesh.dim_names());
}

/// ToProcessMesh(mesh) without building it on every op call: the last one built on this thread, rebuilt when the
/// mesh differs (compared by value, so a new mesh at a freed one's address is never confused with it). The reference
/// is valid until the next call on this thread.
inline const spmd::ProcessMesh &ProcessMeshOf(const comm::DeviceMesh &mesh) {
    thread_local spmd::ProcessMesh cached;
    if (cached.Shape() != mesh.shape() || cached.DimNames() != mesh.dim_names()) {
        cached = ToProcessMesh(mesh);
    }
    return cached;
}

inline comm::ReduceOp ToCommOp(spmd::ReduceOp op) {
    switch (op) {
    case spmd::ReduceOp::kSum:
        return comm::ReduceOp::kSum;
    case spmd::ReduceOp::kAvg:
        return comm::ReduceOp::kAvg;
    case spmd::ReduceOp::kMax:
        return comm::ReduceOp::kMax;
    case spmd::ReduceOp::kMin:
        return comm::ReduceOp::kMin;
    case spmd::ReduceOp::kProd:
        // The rules know Partial(prod); the communicators have no product reduction yet. Every rank holds the same
        // layouts, so every rank raises here, before the collective.
        SHARDLINE_THROW(Error, "dist::Redistribute",
                        "a Partial(prod) tensor cannot be reduced: the communicators have no product reduction");
    }
    SHARDLINE_THROW(Error, "dist::Redistribute", "unknown reduce op {}", static_cast<int>(op));
}

/// Runs an spmd call, turning its SpmdError into a shardline::Error (with file, line and rank) naming `op`.
template <class F> auto CallSpmd(const char *file, int line, std::string_view op, F &&f) -> decltype(f()) {
    try {
        return std::forward<F>(f)();
    } catch (const spmd::SpmdError &e) {
        throw Error(shardline::detail::FormatError(file, line, op, e.what()));
    }
}

#define SHARDLINE_DIST_SPMD(op, ...)                                                                                   \
    ::shardline::dist::detail::CallSpmd(__FILE__, __LINE__, (op), [&] { return __VA_ARGS__; })

} // namespace shardline::dist::detail
