// The program the launcher and fault tests start on several ranks (through shardline-run).
//
//   shardline_dist_helper env       prints "rank r/N VAR=value ..." for the variables the tests set
//   shardline_dist_helper exit      the last rank std::_Exit(3)s before an all_reduce the others enter
//   shardline_dist_helper skip      the last rank skips the all_reduce and sleeps (it stops answering)
//   shardline_dist_helper stop      the last rank SIGSTOPs itself before the all_reduce
//   shardline_dist_helper kill      the last rank SIGKILLs itself before the all_reduce
//   shardline_dist_helper mismatch  the last rank passes count n+1 (run with SHARDLINE_COMM_CHECK=1)
//
// The faulty rank prints "FAULT_AT <unix ms> PID <pid>" just before its fault, so the test can time the job's end
// from the fault. The tensors live on the environment's device: started without --cpu on GPUs, the world is NCCL and
// the same faults exercise its watchdog. Everything runs under launch::RunMain: an exception on a healthy rank prints
// "[rank r/N] <what>" and MPI_Abort()s the job.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include <unistd.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>

namespace {

using shardline::DType;
using shardline::Tensor;
using shardline::comm::ReduceOp;
using shardline::launch::Environment;

long long UnixMs() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

void MarkFault(const Environment &env) {
    std::printf("[rank %d/%d] FAULT_AT %lld PID %d\n", env.rank(), env.world_size(), UnixMs(), getpid());
    std::fflush(stdout);
}

const char *Env(const char *name) {
    const char *v = std::getenv(name);
    return v != nullptr ? v : "<unset>";
}

int Run(std::string_view scenario, Environment &env) {
    auto &world = env.world();
    const int last = env.world_size() - 1;
    const std::int64_t n = 1024;
    if (scenario == "env") {
        std::printf("rank %d/%d SHARDLINE_TEST_VALUE=%s NCCL_TEST_VALUE=%s NCCL_NVLS_ENABLE=%s SHARDLINE_BACKEND=%s "
                    "backend=%s\n",
                    env.rank(), env.world_size(), Env("SHARDLINE_TEST_VALUE"), Env("NCCL_TEST_VALUE"),
                    Env("NCCL_NVLS_ENABLE"), Env("SHARDLINE_BACKEND"), std::string(world.backend()).c_str());
        std::fflush(stdout);
        world.Barrier()->Wait();
        return 0;
    }
    world.Barrier()->Wait(/*host=*/true); // everyone is up: what follows is "mid-step"
    Tensor x =
        Tensor::Full({env.rank() == last && scenario == "mismatch" ? n + 1 : n}, 1.0, DType::kFloat32, env.device());
    if (env.rank() == last) {
        if (scenario == "exit") {
            MarkFault(env);
            std::_Exit(3);
        }
        if (scenario == "skip") {
            MarkFault(env);
            std::this_thread::sleep_for(std::chrono::seconds(60));
            return 0;
        }
        if (scenario == "stop") {
            MarkFault(env);
            std::raise(SIGSTOP);
            return 0;
        }
        if (scenario == "kill") {
            MarkFault(env);
            std::raise(SIGKILL);
            return 0;
        }
    }
    if (scenario == "mismatch") {
        try {
            world.AllReduce(x, ReduceOp::kSum)->Wait(/*host=*/true);
        } catch (const shardline::CommError &e) {
            // The check left no collective in flight on any rank, so the ranks can still meet on the host world and
            // end cleanly (non-zero) after every one of them has reported.
            std::printf("CAUGHT %s\n", e.what());
            std::fflush(stdout);
            env.host_world().Barrier()->Wait();
            return 4;
        }
        std::printf("[rank %d/%d] NO ERROR\n", env.rank(), env.world_size());
        return 0;
    }
    if (scenario == "exit" || scenario == "skip" || scenario == "stop" || scenario == "kill") {
        world.AllReduce(x, ReduceOp::kSum)->Wait(/*host=*/true);
        // The value says whether it really ran (every rank adds 1) or a peer's aborted kernel completed it with
        // garbage (docs/comm.md, "A timeout's abort waits for a grace").
        std::printf("[rank %d/%d] all_reduce completed (x[0] = %g, expected %d)\n", env.rank(), env.world_size(),
                    x.ToDoubleVector().front(), env.world_size());
        return 0;
    }
    std::fprintf(stderr, "shardline_dist_helper: unknown scenario '%.*s'\n", static_cast<int>(scenario.size()),
                 scenario.data());
    return 2;
}

} // namespace

int main(int argc, char **argv) {
    const std::string scenario = argc > 1 ? argv[1] : "";
    return shardline::launch::RunMain(&argc, &argv, {}, [&](Environment &env) { return Run(scenario, env); });
}
