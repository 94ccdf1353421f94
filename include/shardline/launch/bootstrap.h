#pragma once

// Process bootstrap for programs launched with mpirun (or shardline-run): MPI init, world rank/size, local rank,
// one GPU per local rank, the world communicator of the right backend.

#include <functional>
#include <memory>

#include <shardline/comm/communicator.h>

namespace shardline::launch {

enum class BackendChoice : std::uint8_t {
    kAuto, ///< NCCL on GPUs when CUDA is built and a GPU is visible, else MPI on the CPU
    kCpu,  ///< MPI, CPU tensors
    kCuda, ///< NCCL, CUDA tensors; an error when there is no GPU or too few for the local ranks
};

struct BootstrapOptions {
    BackendChoice backend = BackendChoice::kAuto;
};

/// The process's place in the job and its world communicator. Finalizes MPI on destruction (after the
/// communicators it owns are gone). One per process.
class Environment {
public:
    explicit Environment(int* argc, char*** argv, BootstrapOptions options = {});
    ~Environment();
    Environment(const Environment&) = delete;
    Environment& operator=(const Environment&) = delete;

    int rank() const { return rank_; }
    int world_size() const { return world_size_; }
    /// OMPI_COMM_WORLD_LOCAL_RANK (or MPI's shared-memory split when unset).
    int local_rank() const { return local_rank_; }
    /// The device this rank's tensors live on: cuda:<local_rank> or cpu.
    Device device() const { return device_; }
    /// The world communicator (NCCL for CUDA, MPI for CPU).
    comm::Communicator& world() { return *world_; }
    /// An MPI communicator over the world for host-side agreement (never NCCL), e.g. to exchange ids or to agree
    /// on failure before a collective.
    comm::Communicator& host_world() { return *host_world_; }

    /// The process-wide environment (throws Error when none was created).
    static Environment& Get();

private:
    int rank_ = 0;
    int world_size_ = 1;
    int local_rank_ = 0;
    Device device_;
    std::unique_ptr<comm::Communicator> host_world_;
    std::unique_ptr<comm::Communicator> world_;
    bool finalize_mpi_ = false;
};

/// For a program's main: runs body(env); on any exception prints "[rank r/N] <what>" to stderr and calls
/// MPI_Abort so no rank is left waiting. Returns body's exit code.
int RunMain(int* argc, char*** argv, BootstrapOptions options, const std::function<int(Environment&)>& body);

} // namespace shardline::launch
