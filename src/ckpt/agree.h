#pragma once

// Private to src/ckpt: the small collectives a save or load agrees with, over any world (MPI or NCCL: the values
// travel as float64, exact for integers below 2^53 and for crc32s).

#include <cstdint>
#include <string>
#include <vector>

#include <shardline/comm/communicator.h>

namespace shardline::ckpt::detail {

/// Collective: when any rank passes a non-empty `error`, every rank throws Error with the lowest failing rank's
/// message ("rank r: ..." on the other ranks) plus how many ranks failed. `world` may be nullptr (one process).
void AgreeOrThrow(comm::Communicator* world, const std::string& op, const std::string& error);

/// Collective elementwise sum (every rank gets it).
std::vector<double> AllReduceSum(comm::Communicator* world, std::vector<double> values);
/// Collective elementwise max.
std::vector<double> AllReduceMax(comm::Communicator* world, std::vector<double> values);

} // namespace shardline::ckpt::detail
