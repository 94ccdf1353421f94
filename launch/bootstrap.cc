#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <shardline/comm/communicator.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/launch/bootstrap.h>

namespace shardline::launch {
namespace {

Environment *g_environment = nullptr;

// Open MPI's non-negative integer, or -1 when unset (a malformed value is an error naming the variable).
int EnvInt(const char *name) { return static_cast<int>(env::GetInt(name, -1, 0, std::numeric_limits<int>::max())); }

// Local rank and ranks on this node: Open MPI's variables when set, else MPI's shared-memory split.
std::pair<int, int> LocalRankAndSize(int rank) {
    const int local_rank = EnvInt("OMPI_COMM_WORLD_LOCAL_RANK");
    const int local_size = EnvInt("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local_rank >= 0 && local_size > 0) {
        return {local_rank, local_size};
    }
    MPI_Comm node = MPI_COMM_NULL;
    SHARDLINE_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    int r = 0;
    int s = 1;
    MPI_Comm_rank(node, &r);
    MPI_Comm_size(node, &s);
    MPI_Comm_free(&node);
    return {r, s};
}

// kAuto follows SHARDLINE_BACKEND (auto, cpu, cuda) so that `shardline-run --cpu` reaches programs that ask for
// nothing in particular.
BackendChoice ResolveChoice(BackendChoice choice) {
    if (choice != BackendChoice::kAuto) {
        return choice;
    }
    const std::string backend = env::GetChoice("SHARDLINE_BACKEND", "auto", {"auto", "cpu", "cuda"});
    if (backend == "cpu") {
        return BackendChoice::kCpu;
    }
    return backend == "cuda" ? BackendChoice::kCuda : BackendChoice::kAuto;
}

} // namespace

Environment::Environment(int *argc, char ***argv, BootstrapOptions options) {
    SHARDLINE_CHECK(g_environment == nullptr, "launch::Environment", "one Environment per process, got a second one");
    if (!comm::Communicator::MpiRunning()) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        SHARDLINE_CHECK(finalized == 0, "launch::Environment", "MPI was already finalized in this process");
        int provided = 0;
        SHARDLINE_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
        finalize_mpi_ = true;
        if (provided < MPI_THREAD_FUNNELED) {
            SHARDLINE_LOG_WARN("MPI provides thread level {} only (< MPI_THREAD_FUNNELED): call shardline's "
                               "collectives from the main thread",
                               provided);
        }
    }
    SHARDLINE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    SHARDLINE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));
    SetProcessRank(rank_, world_size_);
    const auto [local_rank, local_size] = LocalRankAndSize(rank_);
    local_rank_ = local_rank;

    host_world_ = comm::Communicator::CreateMpiWorld("host world");

    // Device choice, agreed by every rank: a rank that cannot get its GPU must not leave the others waiting in NCCL
    // initialisation, so all ranks exchange their GPU counts and raise together.
    const BackendChoice choice = ResolveChoice(options.backend);
    const int gpus = choice == BackendChoice::kCpu ? 0 : CudaDeviceCount();
    std::vector<double> all(static_cast<std::size_t>(world_size_) * 2);
    {
        Tensor mine = Tensor::FromVector({static_cast<double>(gpus), static_cast<double>(local_rank_)}, {2});
        Tensor gathered =
            Tensor::FromBlob(all.data(), {static_cast<std::int64_t>(all.size())}, DType::kFloat64, Device::CPU());
        host_world_->AllGather(mine, gathered)->Wait();
        host_world_->ResetCounts();
    }
    bool use_cuda = false;
    if (choice != BackendChoice::kCpu) {
        std::vector<int> without;
        std::vector<std::string> short_of;
        for (int r = 0; r < world_size_; ++r) {
            const int g = static_cast<int>(all[2 * r]);
            const int lr = static_cast<int>(all[2 * r + 1]);
            if (g == 0) {
                without.push_back(r);
            } else if (lr >= g) {
                short_of.push_back(fmt::format("rank {} (local rank {}, {} GPU(s))", r, lr, g));
            }
        }
        const bool any_gpu = static_cast<int>(without.size()) < world_size_;
        if (choice == BackendChoice::kCuda || any_gpu) {
            SHARDLINE_CHECK_AS(DeviceError, SHARDLINE_HAVE_CUDA, "bootstrap",
                               "the CUDA backend was asked for but this build of shardline has no CUDA");
            SHARDLINE_CHECK_AS(DeviceError, without.empty(), "bootstrap",
                               "one GPU per local rank is needed ({}), but rank(s) {} see no CUDA device{}",
                               choice == BackendChoice::kCuda ? "CUDA was asked for" : "some ranks have GPUs",
                               fmt::join(without, ","),
                               choice == BackendChoice::kCuda ? "" : "; run with --cpu (SHARDLINE_BACKEND=cpu)");
            SHARDLINE_CHECK_AS(DeviceError, short_of.empty(), "bootstrap",
                               "one GPU per local rank is needed, but {} node(s) run more ranks than they have GPUs: "
                               "{} (this node: {} local ranks); start at most as many ranks per node as GPUs, or run "
                               "on the CPU with --cpu",
                               short_of.size(), fmt::join(short_of, "; "), local_size);
            use_cuda = true;
        }
    }

    if (use_cuda) {
        device_ = Device::CUDA(local_rank_);
#if SHARDLINE_HAVE_CUDA
        CudaContext::Get(local_rank_); // makes the device current on this thread
#endif
#if SHARDLINE_WITH_NCCL
        world_ = comm::Communicator::CreateNcclWorld(*host_world_, local_rank_, "world");
#else
        SHARDLINE_THROW(DeviceError, "bootstrap",
                        "CUDA tensors need the NCCL backend, but this build has SHARDLINE_WITH_NCCL off; run with "
                        "--cpu (SHARDLINE_BACKEND=cpu)");
#endif
    } else {
        device_ = Device::CPU();
        world_ = comm::Communicator::CreateMpiWorld("world");
    }
    g_environment = this;
    SHARDLINE_LOG_DEBUG("bootstrap: rank {}/{}, local rank {}/{}, device {}, world backend {}", rank_, world_size_,
                        local_rank_, local_size, ToString(device_), world_->backend());
}

Environment::~Environment() {
    if (g_environment == this) {
        g_environment = nullptr;
    }
    // Collectives a caller waited on with Wait(host = false) are only ordered before the compute stream: let them
    // finish, so the NCCL world is torn down idle rather than aborted with work in flight.
    if (device_.is_cuda()) {
        try {
            Synchronize(device_);
        } catch (const std::exception &e) {
            SHARDLINE_LOG_WARN("launch::Environment: device synchronisation at shutdown failed: {}", e.what());
        }
    }
    // Communicators first: they free their MPI/NCCL resources while MPI is still up.
    world_.reset();
    host_world_.reset();
    if (finalize_mpi_ && comm::Communicator::MpiRunning()) {
        MPI_Finalize();
    }
}

Environment &Environment::Get() {
    SHARDLINE_CHECK(g_environment != nullptr, "launch::Environment::Get",
                    "no Environment exists: create one at the start of main (or use launch::RunMain)");
    return *g_environment;
}

int RunMain(int *argc, char ***argv, BootstrapOptions options, const std::function<int(Environment &)> &body) {
    std::unique_ptr<Environment> env;
    std::string failure;
    int code = 0;
    try {
        env = std::make_unique<Environment>(argc, argv, options);
        code = body(*env);
    } catch (const std::exception &e) {
        failure = e.what();
    } catch (...) {
        failure = "unknown exception (not derived from std::exception)";
    }
    if (!failure.empty()) {
        // Never finalize after a failure: MPI_Finalize waits for every rank, and the others may be stuck in a
        // collective this rank will not join. MPI_Abort ends the whole job instead.
        const std::string prefix = fmt::format("[rank {}/{}] ", ProcessRank(), ProcessWorldSize());
        const bool prefixed = std::string_view(failure).starts_with(prefix);
        std::fprintf(stderr, "%s%s\n", prefixed ? "" : prefix.c_str(), failure.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        if (comm::Communicator::MpiRunning()) {
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        std::_Exit(1);
    }
    env.reset();
    return code;
}

} // namespace shardline::launch
