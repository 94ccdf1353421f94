#pragma once

// Factories of the communicator backends (private to the library; launch/ and tests use them).

#include <memory>
#include <string>

#include <shardline/comm/communicator.h>
#include <shardline/config.h>

namespace shardline::comm::detail {

#if SHARDLINE_WITH_MPI
/// A communicator over a duplicate of MPI_COMM_WORLD for CPU tensors, named `name`. MPI must be initialized
/// (with MPI_THREAD_MULTIPLE or at least FUNNELED).
std::unique_ptr<Communicator> CreateMpiWorld(std::string name = "world");
#endif

#if SHARDLINE_WITH_NCCL
/// Collective over `host_world` (an MPI communicator over the same ranks): rank 0 creates the ncclUniqueId and
/// broadcasts it over host_world; every rank then creates a non-blocking NCCL communicator on CUDA device `device`.
std::unique_ptr<Communicator> CreateNcclWorld(Communicator& host_world, int device, std::string name = "world");
#endif

} // namespace shardline::comm::detail
