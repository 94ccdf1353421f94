// shardline-comm-host-bench: the per-call host cost of one small all_reduce, through shardline's NCCL communicator and
// through bare NCCL on the same ranks (mpirun -n N shardline-comm-host-bench [options]; N = 1 works on one GPU).
//
// Cases (all in-place all_reduce(sum) of --bytes on this rank's GPU):
//   nccl_blocking         bare ncclAllReduce on a blocking communicator, on the compute stream: NCCL's own floor
//   nccl_blocking_group   the same inside ncclGroupStart/End (what shardline's issue engine wraps every call in)
//   nccl_blocking_events  the same on a side stream ordered like any side-stream design (torch's ProcessGroupNCCL
//                         too): record on compute, side waits, all_reduce, record done, compute waits
//   nccl_nonblocking      bare ncclAllReduce on a non-blocking communicator, then ncclCommGetAsyncError polled until
//                         it leaves ncclInProgress (what every non-blocking user must do before trusting the enqueue)
//   shardline             world.AllReduce(t)->Wait(false): the world communicator as layers call it, on the default
//                         path (collectives on a blocking NCCL communicator; SHARDLINE_NCCL_BLOCKING=0 changes it)
//   shardline_nowait      world.AllReduce(t), handle dropped (the watchdog retires it)
//   shardline_hostwait    world.AllReduce(t)->Wait(true)
//   shardline_blocking    Communicator::FromNcclComm(a blocking communicator)->AllReduce(t)->Wait(false)
//   shardline_nonblocking a second world made with SHARDLINE_NCCL_BLOCKING=0 (collectives on the non-blocking
//                         communicator, the default before issue 18 item 3)->AllReduce(t)->Wait(false)
//
// Three numbers per case, each the max over ranks, median over --rounds:
//   host_us   host wall time per call of --iters back-to-back calls, before any synchronisation (the host path);
//   e2e_us    the same calls plus one cudaStreamSynchronize of the compute stream, per call (throughput);
//   event_us  CUDA-event time around each call (+ its wait) on the compute stream, median over --iters calls, with no
//             host sync in between: what shardline-comm-bench and torch's bench/peers/comm_peer.py report as "us per
//             call" (the GPU waits on the host between the events, so it is host path + kernel when host-bound).
// Ratios printed last: the default path (shardline) against bare blocking calls (nccl_blocking, the issue-18 target:
// within 1.2x a bare ncclAllReduce; nccl_blocking_events, the same with a side stream's four event calls) and against
// bare non-blocking calls (nccl_nonblocking), and the non-blocking path (shardline_nonblocking) against both.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>
#include <nlohmann/json.hpp>

#include <shardline/comm/communicator.h>
#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/launch/bootstrap.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/host_reduce.h"

namespace {

using namespace shardline;
using Clock = std::chrono::steady_clock;

struct Options {
    std::int64_t bytes = 1024;
    int warmup = 200;
    int iters = 2000;
    int rounds = 5;
    std::string cases_text = "nccl_blocking,nccl_blocking_group,nccl_blocking_events,nccl_nonblocking,shardline,"
                             "shardline_nowait,shardline_hostwait,shardline_blocking,shardline_nonblocking";
    std::string dtype_text = "bf16";
    std::string json;
};

int ParseCommandLine(int argc, char** argv, Options& o) {
    CLI::App app{"shardline-comm-host-bench: per-call host cost of a small all_reduce, shardline vs bare NCCL "
                 "(mpirun -n N shardline-comm-host-bench [options])",
                 "shardline-comm-host-bench"};
    bench::UseBenchDefaults(app);
    constexpr int kIntMax = std::numeric_limits<int>::max();
    app.add_option("--bytes", o.bytes, "all_reduce size in bytes")
        ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 30));
    app.add_option("--warmup", o.warmup, "untimed calls per case and round")->check(CLI::Range(1, kIntMax));
    app.add_option("--iters", o.iters, "timed calls per case and round")->check(CLI::Range(1, kIntMax));
    app.add_option("--rounds", o.rounds, "rounds (cases interleaved); the median is reported")
        ->check(CLI::Range(1, kIntMax));
    app.add_option("--cases", o.cases_text, "cases, comma-separated")
        ->type_name("LIST")
        ->check(bench::ListOf({"nccl_blocking", "nccl_blocking_group", "nccl_blocking_events", "nccl_nonblocking",
                               "shardline", "shardline_nowait", "shardline_hostwait", "shardline_blocking",
                               "shardline_nonblocking"}));
    app.add_option("--dtype", o.dtype_text, "element type (bf16, fp16, fp32)")
        ->check(bench::AcceptedBy([](const std::string& text) { ParseDType(text); }, "DTYPE"));
    app.add_option("--json", o.json, "append one JSON line per case to PATH")->type_name("PATH");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    return -1;
}

ncclDataType_t NcclType(DType d) {
    switch (d) {
    case DType::kFloat32:
        return ncclFloat32;
    case DType::kFloat16:
        return ncclFloat16;
    case DType::kBFloat16:
        return ncclBfloat16;
    default:
        SHARDLINE_THROW(DTypeError, "shardline-comm-host-bench", "bf16, fp16 or fp32, got {}", DTypeName(d));
    }
}

/// A raw NCCL communicator over the world's ranks (the id travels over the MPI host world).
ncclComm_t MakeRawComm(launch::Environment& env, bool blocking) {
    ncclUniqueId id{};
    if (env.rank() == 0) {
        SHARDLINE_CHECK_NCCL(ncclGetUniqueId(&id));
    }
    Tensor blob =
        Tensor::FromBlob(&id, {static_cast<std::int64_t>(sizeof(id) / sizeof(float))}, DType::kFloat32, Device::CPU());
    env.host_world().Broadcast(blob, 0)->Wait(true);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    config.commName = blocking ? "bench-blocking" : "bench-nonblocking";
    ncclComm_t comm = nullptr;
    SHARDLINE_CHECK_NCCL(ncclCommInitRankConfig(&comm, env.world_size(), id, env.rank(), &config));
    ncclResult_t state = ncclInProgress;
    do {
        SHARDLINE_CHECK_NCCL(ncclCommGetAsyncError(comm, &state));
    } while (state == ncclInProgress);
    SHARDLINE_CHECK(state == ncclSuccess, "shardline-comm-host-bench", "NCCL init failed: {}",
                    ncclGetErrorString(state));
    return comm;
}

struct Sample {
    double host_us;
    double e2e_us;
    double event_us;
};

/// One round of one case: warm-up, `iters` back-to-back calls timed on the host (+ one sync), then `iters` calls
/// each between two events; the max over ranks of each.
Sample Measure(launch::Environment& env, const Options& o, cudaStream_t stream, const std::function<void()>& call) {
    for (int i = 0; i < o.warmup; ++i) {
        call();
    }
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    env.host_world().Barrier()->Wait(true);
    const auto t0 = Clock::now();
    for (int i = 0; i < o.iters; ++i) {
        call();
    }
    const auto t1 = Clock::now();
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    const auto t2 = Clock::now();

    std::vector<cudaEvent_t> events(static_cast<std::size_t>(2 * o.iters));
    for (auto& e : events) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&e));
    }
    env.host_world().Barrier()->Wait(true);
    for (int i = 0; i < o.iters; ++i) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(events[2 * i], stream));
        call();
        SHARDLINE_CHECK_CUDA(cudaEventRecord(events[2 * i + 1], stream));
    }
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> per_call(static_cast<std::size_t>(o.iters));
    for (int i = 0; i < o.iters; ++i) {
        float ms = 0;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
        per_call[i] = ms * 1000.0;
    }
    for (auto& e : events) {
        SHARDLINE_CHECK_CUDA(cudaEventDestroy(e));
    }
    const auto us = [&](Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count() / o.iters; };
    std::vector<double> mine = {us(t1 - t0), us(t2 - t0), bench::Percentile(per_call, 0.5)};
    bench::AllReduceHost(env, mine, comm::ReduceOp::kMax);
    return Sample{mine[0], mine[1], mine[2]};
}

int Run(launch::Environment& env, const Options& o) {
    SHARDLINE_CHECK_AS(DeviceError, env.device().is_cuda(), "shardline-comm-host-bench",
                       "needs one GPU per rank (the world communicator is '{}')", env.world().backend());
    const int device = env.device().index;
    const DType dtype = ParseDType(o.dtype_text);
    const ncclDataType_t type = NcclType(dtype);
    const std::int64_t count = std::max<std::int64_t>(o.bytes / static_cast<std::int64_t>(ElementSize(dtype)), 1);
    Tensor t = Tensor::Empty({count}, dtype, env.device());
    FillRandom(t, RandomSpec{.seed = 7, .name = "comm_host_bench"});
    void* data = t.data();
    const auto n = static_cast<std::size_t>(count);

    cudaStream_t compute = CudaContext::Get(device).stream();
    cudaStream_t side = nullptr;
    cudaEvent_t ready = nullptr;
    cudaEvent_t done = nullptr;
    SHARDLINE_CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    ncclComm_t blocking = MakeRawComm(env, /*blocking=*/true);
    ncclComm_t nonblocking = MakeRawComm(env, /*blocking=*/false);
    comm::Communicator& world = env.world();
    // Borrowed: destroyed before `blocking` is.
    std::unique_ptr<comm::Communicator> over_blocking =
        comm::Communicator::FromNcclComm(blocking, {.name = "bench-blocking"});
    // The non-blocking path: SHARDLINE_NCCL_BLOCKING is read when a communicator is created.
    const std::optional<std::string> blocking_env = env::Get("SHARDLINE_NCCL_BLOCKING");
    ::setenv("SHARDLINE_NCCL_BLOCKING", "0", 1);
    std::unique_ptr<comm::Communicator> nonblocking_world =
        comm::Communicator::CreateNcclWorld(env.host_world(), device, "bench-nonblocking-world");
    if (blocking_env) {
        ::setenv("SHARDLINE_NCCL_BLOCKING", blocking_env->c_str(), 1);
    } else {
        ::unsetenv("SHARDLINE_NCCL_BLOCKING");
    }

    std::map<std::string, std::function<void()>> calls;
    calls["nccl_blocking"] = [&] {
        SHARDLINE_CHECK_NCCL(ncclAllReduce(data, data, n, type, ncclSum, blocking, compute));
    };
    calls["nccl_blocking_group"] = [&] {
        SHARDLINE_CHECK_NCCL(ncclGroupStart());
        SHARDLINE_CHECK_NCCL(ncclAllReduce(data, data, n, type, ncclSum, blocking, compute));
        SHARDLINE_CHECK_NCCL(ncclGroupEnd());
    };
    calls["nccl_blocking_events"] = [&] {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(ready, compute));
        SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(side, ready, 0));
        SHARDLINE_CHECK_NCCL(ncclAllReduce(data, data, n, type, ncclSum, blocking, side));
        SHARDLINE_CHECK_CUDA(cudaEventRecord(done, side));
        SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(compute, done, 0));
    };
    calls["nccl_nonblocking"] = [&] {
        SHARDLINE_CHECK_NCCL(ncclAllReduce(data, data, n, type, ncclSum, nonblocking, compute));
        ncclResult_t state = ncclInProgress;
        do {
            SHARDLINE_CHECK_NCCL(ncclCommGetAsyncError(nonblocking, &state));
        } while (state == ncclInProgress);
        SHARDLINE_CHECK(state == ncclSuccess, "nccl_nonblocking", "{}", ncclGetErrorString(state));
    };
    calls["shardline"] = [&] { world.AllReduce(t, comm::ReduceOp::kSum)->Wait(false); };
    calls["shardline_nowait"] = [&] { (void)world.AllReduce(t, comm::ReduceOp::kSum); };
    calls["shardline_hostwait"] = [&] { world.AllReduce(t, comm::ReduceOp::kSum)->Wait(true); };
    calls["shardline_blocking"] = [&] { over_blocking->AllReduce(t, comm::ReduceOp::kSum)->Wait(false); };
    calls["shardline_nonblocking"] = [&] { nonblocking_world->AllReduce(t, comm::ReduceOp::kSum)->Wait(false); };

    const std::vector<std::string> cases = bench::SplitList(o.cases_text);
    std::map<std::string, std::vector<Sample>> samples;
    for (int round = 0; round < o.rounds; ++round) {
        for (const std::string& c : cases) {
            samples[c].push_back(Measure(env, o, compute, calls.at(c)));
        }
    }

    std::map<std::string, Sample> median;
    for (const std::string& c : cases) {
        std::vector<double> h, e, v;
        for (const Sample& s : samples[c]) {
            h.push_back(s.host_us);
            e.push_back(s.e2e_us);
            v.push_back(s.event_us);
        }
        median[c] = Sample{bench::Percentile(h, 0.5), bench::Percentile(e, 0.5), bench::Percentile(v, 0.5)};
    }
    if (env.rank() == 0) {
        cudaDeviceProp prop{};
        SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
        int nccl_version = 0;
        SHARDLINE_CHECK_NCCL(ncclGetVersion(&nccl_version));
        const std::string commit = bench::Commit();
        const std::string date = bench::NowUtc();
        std::printf("# shardline-comm-host-bench: %d rank(s), %s, NCCL %d, %s, %lld bytes, commit %s, %s; "
                    "max over ranks, median of %d rounds of %d calls; world: SHARDLINE_NCCL_BLOCKING=%s\n",
                    env.world_size(), prop.name, nccl_version, std::string(DTypeName(dtype)).c_str(),
                    static_cast<long long>(o.bytes), commit.c_str(), date.c_str(), o.rounds, o.iters,
                    blocking_env.value_or("unset (1)").c_str());
        std::printf("%-22s %10s %10s %10s\n", "case", "host_us", "e2e_us", "event_us");
        std::ofstream json;
        if (!o.json.empty()) {
            json.open(o.json, std::ios::app);
        }
        for (const std::string& c : cases) {
            const Sample& s = median[c];
            std::printf("%-22s %10.2f %10.2f %10.2f\n", c.c_str(), s.host_us, s.e2e_us, s.event_us);
            if (json.is_open()) {
                json << nlohmann::json{{"bench", "comm_host"},
                                       {"case", c},
                                       {"ranks", env.world_size()},
                                       {"device", prop.name},
                                       {"nccl", nccl_version},
                                       {"bytes", o.bytes},
                                       {"dtype", std::string(DTypeName(dtype))},
                                       {"commit", commit},
                                       {"date", date},
                                       {"host_us", s.host_us},
                                       {"e2e_us", s.e2e_us},
                                       {"event_us", s.event_us}}
                            .dump()
                     << '\n';
            }
        }
        const auto ratio = [&](const char* a, const char* b) {
            if (median.count(a) != 0 && median.count(b) != 0) {
                std::printf("# %s / %s: host %.2fx, e2e %.2fx, event %.2fx\n", a, b,
                            median[a].host_us / median[b].host_us, median[a].e2e_us / median[b].e2e_us,
                            median[a].event_us / median[b].event_us);
            }
        };
        ratio("shardline", "nccl_blocking");
        ratio("shardline", "nccl_blocking_events");
        ratio("shardline", "nccl_nonblocking");
        ratio("shardline", "shardline_nonblocking");
        ratio("shardline_blocking", "nccl_blocking");
        ratio("shardline_nonblocking", "nccl_nonblocking");
        ratio("shardline_nonblocking", "nccl_blocking");
    }

    SHARDLINE_CHECK_CUDA(cudaDeviceSynchronize());
    nonblocking_world.reset();
    over_blocking.reset();
    (void)ncclCommDestroy(blocking);
    ncclResult_t r = ncclCommFinalize(nonblocking);
    while (r == ncclInProgress) {
        (void)ncclCommGetAsyncError(nonblocking, &r);
    }
    (void)ncclCommDestroy(nonblocking);
    (void)cudaEventDestroy(ready);
    (void)cudaEventDestroy(done);
    (void)cudaStreamDestroy(side);
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    Options o;
    if (const int code = ParseCommandLine(argc, argv, o); code >= 0) {
        return code;
    }
    return shardline::launch::RunMain(&argc, &argv, {.backend = shardline::launch::BackendChoice::kCuda},
                                      [&](shardline::launch::Environment& env) { return Run(env, o); });
}
