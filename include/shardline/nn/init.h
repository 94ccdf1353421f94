#pragma once

// Parameter initialisation from the counter-based RNG (core/random.h): a value is a pure function of (seed, name,
// global index), so every rank makes only its shard and the global parameters are identical for every TP size and
// device.

#include <cstdint>
#include <string>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/random.h>
#include <shardline/spmd/layout.h>

namespace shardline::nn {

/// Where a module's parameters live and how they are made.
struct ParameterOptions {
    DType dtype = DType::kFloat32;
    Device device = Device::CPU();
    std::uint64_t seed = 0;
    /// The module's name: its parameters are "<name>.weight", "<name>.bias" (their RNG streams, and the name in
    /// messages). Empty: the module's default ("linear", "column", "row", "mlp").
    std::string name = {};
};

/// A leaf requiring grad of `global_shape` in `layout` on `mesh` (nullptr: local), this rank's shard filled from
/// `spec` (spec.name is the parameter's global name).
autograd::Variable MakeParameter(const Shape& global_shape, const spmd::Layout& layout, comm::DeviceMesh* mesh,
                                 const ParameterOptions& options, RandomSpec spec);

} // namespace shardline::nn
