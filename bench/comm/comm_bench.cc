// shardline-comm-bench: all_reduce, all_gather, reduce_scatter through shardline's NCCL communicator, one rank per
// GPU (mpirun -n N shardline-comm-bench [options]).
//
// Sizes follow nccl-tests: `bytes` is the larger buffer (all_reduce: the tensor; all_gather: the gathered output;
// reduce_scatter: the input). algbw = bytes / t; busbw = algbw · 2(n-1)/n (all_reduce) or (n-1)/n (all_gather,
// reduce_scatter). Each iteration is timed with CUDA events on the compute stream around the call and its
// Wait(host=false), which is what a layer pays; the per-iteration time is the max over ranks, then median and p90.
//
// Options: `shardline-comm-bench --help` lists them with their defaults (AddOptions below).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
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

struct Options {
    std::int64_t min_bytes = 8;
    std::int64_t max_bytes = std::int64_t{1} << 30;
    std::int64_t factor = 2;
    int warmup = 10;
    int iters = 50;
    std::string ops_text = "all_reduce,all_gather,reduce_scatter"; ///< --ops, comma-separated
    std::string dtype_text = "bf16";                               ///< --dtype
    std::string json;
    // Resolved from the text above once the command line is parsed.
    std::vector<std::string> ops;
    DType dtype = DType::kBFloat16;
};

constexpr int kIntMax = std::numeric_limits<int>::max();

/// The command line (CLI11); a bad value is CLI11's error and exit code, before MPI starts.
void AddOptions(CLI::App& app, Options& o) {
    bench::UseBenchDefaults(app);
    app.add_option("--min-bytes", o.min_bytes, "smallest buffer in bytes (the larger buffer of each op)")
        ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()));
    app.add_option("--max-bytes", o.max_bytes, "largest buffer in bytes")
        ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()));
    app.add_option("--factor", o.factor, "ratio between successive sizes")
        ->check(CLI::Range(std::int64_t{2}, std::numeric_limits<std::int64_t>::max()));
    app.add_option("--warmup", o.warmup, "untimed iterations per size")->check(CLI::Range(0, kIntMax));
    app.add_option("--iters", o.iters, "timed iterations per size")->check(CLI::Range(1, kIntMax));
    app.add_option("--ops", o.ops_text, "collectives to measure, comma-separated")
        ->type_name("LIST")
        ->check(bench::ListOf({"all_reduce", "all_gather", "reduce_scatter"}));
    app.add_option("--dtype", o.dtype_text, "element type (bf16, fp16, fp32, ...)")
        ->check(bench::AcceptedBy([](const std::string& text) { ParseDType(text); }, "DTYPE"));
    app.add_option("--json", o.json, "append one JSON line per measurement to PATH")->type_name("PATH");
}

/// Parses argv into `o`; returns -1 to go on, else the exit code (--help, or CLI11's code for a bad command line).
int ParseCommandLine(int argc, char** argv, Options& o) {
    CLI::App app{"shardline-comm-bench: all_reduce, all_gather and reduce_scatter through shardline's NCCL "
                 "communicator, one rank per GPU (mpirun -n N shardline-comm-bench [options])",
                 "shardline-comm-bench"};
    AddOptions(app, o);
    try {
        app.parse(argc, argv);
        if (o.max_bytes < o.min_bytes) {
            throw CLI::ValidationError(
                "--max-bytes", fmt::format("must be at least --min-bytes ({}), got {}", o.min_bytes, o.max_bytes));
        }
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    o.ops = bench::SplitList(o.ops_text);
    o.dtype = ParseDType(o.dtype_text);
    return -1;
}

using bench::Commit;
using bench::Percentile;

double BusFactor(const std::string& op, int n) {
    return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

struct Result {
    double median_us;
    double p90_us;
};

Result Measure(launch::Environment& env, const Options& o, const std::string& op, std::int64_t bytes) {
    comm::Communicator& world = env.world();
    const int n = world.size();
    const std::size_t elem = ElementSize(o.dtype);
    // Elements of the larger buffer, a multiple of n so every op splits it evenly.
    std::int64_t count = std::max<std::int64_t>(bytes / static_cast<std::int64_t>(elem), n);
    count = count / n * n;
    const Device gpu = env.device();
    Tensor big = Tensor::Empty({count}, o.dtype, gpu);
    Tensor small = Tensor::Empty({count / n}, o.dtype, gpu);
    FillRandom(big, RandomSpec{.seed = 7, .name = "comm_bench/big"});
    FillRandom(small, RandomSpec{.seed = 7, .name = "comm_bench/small"});

    auto run = [&]() -> comm::WorkHandle {
        if (op == "all_reduce") {
            return world.AllReduce(big, comm::ReduceOp::kSum);
        }
        if (op == "all_gather") {
            return world.AllGather(small, big);
        }
        if (op == "reduce_scatter") {
            return world.ReduceScatter(big, small, comm::ReduceOp::kSum);
        }
        SHARDLINE_THROW(Error, "shardline-comm-bench", "unknown op '{}'", op);
    };

    cudaStream_t stream = CudaContext::Get(gpu.index).stream();
    for (int i = 0; i < o.warmup; ++i) {
        run()->Wait();
    }
    std::vector<cudaEvent_t> events(static_cast<std::size_t>(2 * o.iters));
    for (auto& e : events) {
        SHARDLINE_CHECK_CUDA(cudaEventCreate(&e));
    }
    world.Barrier()->Wait(true);
    for (int i = 0; i < o.iters; ++i) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(events[2 * i], stream));
        run()->Wait(/*host=*/false);
        SHARDLINE_CHECK_CUDA(cudaEventRecord(events[2 * i + 1], stream));
    }
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> times(static_cast<std::size_t>(o.iters));
    for (int i = 0; i < o.iters; ++i) {
        float ms = 0;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
        times[i] = ms * 1000.0;
    }
    for (auto& e : events) {
        SHARDLINE_CHECK_CUDA(cudaEventDestroy(e));
    }
    // The slowest rank sets each iteration's time.
    bench::AllReduceHost(env, times, comm::ReduceOp::kMax);
    return Result{Percentile(times, 0.5), Percentile(times, 0.9)};
}

int Run(launch::Environment& env, const Options& o) {
    SHARDLINE_CHECK_AS(DeviceError, env.device().is_cuda(), "shardline-comm-bench",
                       "needs one GPU per rank (the world communicator is '{}')", env.world().backend());
    const int n = env.world_size();
    const bool rank0 = env.rank() == 0;
    cudaDeviceProp prop{};
    SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, env.device().index));
    const std::string device = prop.name;
    const std::string commit = Commit();
    const std::string date = bench::NowUtc();
    const std::string nvls = env::Get("NCCL_NVLS_ENABLE").value_or("(unset)");

    std::ofstream json;
    if (rank0 && !o.json.empty()) {
        json.open(o.json, std::ios::app);
        SHARDLINE_CHECK(json.good(), "shardline-comm-bench", "cannot open {} for appending", o.json);
    }
    if (rank0) {
        std::printf("# shardline NCCL backend, %d ranks, %s, %s, commit %s, %s, NCCL_NVLS_ENABLE=%s\n", n,
                    device.c_str(), std::string(DTypeName(o.dtype)).c_str(), commit.c_str(), date.c_str(),
                    nvls.c_str());
        std::printf("%-15s %12s %12s %12s %10s %10s\n", "op", "bytes", "median_us", "p90_us", "algbw", "busbw");
    }
    for (const std::string& op : o.ops) {
        for (std::int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
            const Result r = Measure(env, o, op, bytes);
            const double algbw = static_cast<double>(bytes) / (r.median_us * 1e-6) / 1e9;
            const double busbw = algbw * BusFactor(op, n);
            if (!rank0) {
                continue;
            }
            std::printf("%-15s %12lld %12.2f %12.2f %10.2f %10.2f\n", op.c_str(), static_cast<long long>(bytes),
                        r.median_us, r.p90_us, algbw, busbw);
            std::fflush(stdout);
            if (json.is_open()) {
                nlohmann::json rec = {{"impl", "shardline"},
                                      {"device", device},
                                      {"date", date},
                                      {"commit", commit},
                                      {"ranks", n},
                                      {"dtype", std::string(DTypeName(o.dtype))},
                                      {"op", op},
                                      {"bytes", bytes},
                                      {"median_us", r.median_us},
                                      {"p90_us", r.p90_us},
                                      {"algbw", algbw},
                                      {"busbw", busbw}};
                json << rec.dump() << '\n';
            }
        }
    }
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
