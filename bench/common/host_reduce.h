#pragma once
// Reducing a benchmark's host-side numbers (per-iteration times, gate flags, counts) over the ranks of a launch, in
// place, through the MPI host communicator: the slowest rank sets an iteration's time. Header-only; for the benches
// that run under launch::RunMain (bench/comm, bench/moe, bench/tp_mlp).

#include <cstdint>
#include <vector>

#include <shardline/comm/communicator.h>
#include <shardline/core/tensor.h>
#include <shardline/launch/bootstrap.h>

namespace shardline::bench {

/// Elementwise `op` of v over the ranks (float64), in place; nothing with one rank or an empty v.
inline void AllReduceHost(launch::Environment &env, std::vector<double> &v, comm::ReduceOp op) {
    if (env.world_size() == 1 || v.empty()) {
        return;
    }
    Tensor t = Tensor::FromBlob(v.data(), {static_cast<std::int64_t>(v.size())}, DType::kFloat64, Device::CPU());
    env.host_world().AllReduce(t, op)->Wait(true);
}

} // namespace shardline::bench
