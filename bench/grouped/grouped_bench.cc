// shardline-grouped-bench: the grouped GEMM of mixture-of-experts layers (issue 15) against torch._grouped_mm and a
// loop of F.linear (bench/peers/grouped_peer.py, the same command: bench/grouped/run_grouped_bench.sh), following the
// project's benchmark rules (shared/BENCHMARKS.md "Grouped GEMM", outside this repository).
//
//   1. Calibration: the 8192³ bf16 GEMM ceiling (bench/common/cublaslt_floor.h).
//   2. Cases: Mixtral-, DeepSeek-, OLMoE-, Qwen-MoE-like experts with Zipf-skewed routing (count_e = ⌊T·topk·w_e/Σw⌋
//      rounded down to 16, w_e = 1/(e+1)^s, the last `zero` experts empty). Y_e = X_e·W_eᵀ, W [E, N, K], bf16.
//      Phases: fwd (GroupedLinearForward), dgrad (GroupedLinearBackwardInput), wgrad (GroupedLinearBackwardWeight),
//      fwd+bwd (GroupedLinearForward then GroupedLinearBackward for dx and dW — what the GroupedLinear autograd
//      Function runs — in one timed region; 6·M·K·N flops). Variants: the provider's auto choice (per-shape tuning:
//      each phase's first call times the candidates and keeps the fastest), the CUTLASS grouped kernel with each
//      config forced, and the loop of cached cuBLASLt GEMMs; sizes on the host and on the device; the backward's wgrad
//      beside its dgrad on the side stream (SHARDLINE_GROUPED_CONCURRENT_BWD, on by default) or, in the `-serial`
//      variants, after it ("concurrent_runs": how many timed backwards really ran concurrently). Each variant
//      passes a correctness gate (its forward against the loop's, which the kernel tests hold to float64) first.
//      Every record says what ran ("config": GroupedGemm's path per phase); "tuning" records give each tuned shape
//      class's candidates (µs) and winner.
//   3. Host µs per call: 2000 back-to-back forwards without synchronising (device sizes: no host sync on the CUTLASS
//      path).
//
// Timing: CUDA events around every iteration; warm-ups, then `rounds` rounds of every variant in turn (A B A B ...);
// median and p90. Random normal data.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/cublaslt_floor.h"
#include "common/event_timer.h"

namespace {

using namespace shardline;
using namespace shardline::kernels;
using json = nlohmann::json;

struct Case {
    std::string name;
    std::int64_t tokens, experts, topk, k, n;
    double skew;
    std::int64_t zero;
};

/// shared/BENCHMARKS.md "Grouped GEMM".
const std::vector<Case> kCases = {
    {"mixtral-8x7b-w1", 8192, 8, 2, 4096, 14336, 0.3, 0}, {"mixtral-8x7b-w2", 8192, 8, 2, 14336, 4096, 0.3, 0},
    {"deepseek-64e-w1", 8192, 64, 6, 2048, 1408, 0.5, 0}, {"olmoe-64e-w1", 8192, 64, 8, 2048, 1024, 0.5, 4},
    {"ep8-local-8e-w1", 16384, 8, 1, 4096, 2048, 0.2, 1}, {"qwen3-128e-w1", 8192, 128, 8, 2048, 768, 0.5, 8},
};

std::vector<std::int64_t> Counts(const Case &c) {
    std::vector<double> w(static_cast<std::size_t>(c.experts));
    double sum = 0.0;
    for (std::int64_t e = 0; e < c.experts; ++e) {
        w[static_cast<std::size_t>(e)] =
            e >= c.experts - c.zero ? 0.0 : 1.0 / std::pow(static_cast<double>(e + 1), c.skew);
        sum += w[static_cast<std::size_t>(e)];
    }
    std::vector<std::int64_t> counts;
    for (double we : w) {
        const auto rows = static_cast<std::int64_t>(std::floor(static_cast<double>(c.tokens * c.topk) * we / sum));
        counts.push_back(rows / 16 * 16);
    }
    return counts;
}

struct Variant {
    std::string name;
    GroupedGemmChoice choice;
    bool device_sizes;
    bool concurrent = true; ///< SetGroupedConcurrentBackward for the fwd+bwd's backward
};

const std::vector<Variant> kVariants = {
    {"auto-device", {}, true},
    {"auto-device-serial", {}, true, false},
    {"auto-host", {}, false},
    {"auto-host-serial", {}, false, false},
    {"cutlass256-device", {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k256x128}, true},
    {"cutlass128-device", {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k128x128}, true},
    {"cutlass-pp128x128-device", {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::kPingpong128x128}, true},
    {"cutlass-pp128x64-device", {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::kPingpong128x64}, true},
    {"cutlass128x256-device", {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k128x256}, true},
    {"cutlass256-n-device",
     {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k256x128, .raster = GroupedGemmRaster::kAlongN},
     true},
    {"cutlass128x256-n-device",
     {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k128x256, .raster = GroupedGemmRaster::kAlongN},
     true},
    {"loop-host", {.impl = GroupedGemmImpl::kLoop}, false},
};

struct Options {
    std::set<std::string> cases;
    std::set<std::string> variants;
    int warmup = 10;
    int iters = 20;
    int rounds = 5;
    int host_calls = 2000;
    std::string json_path;
    bool list_cases = false;
};

Options Parse(int argc, char **argv) {
    Options o;
    CLI::App app{
        "shardline-grouped-bench: grouped GEMM (MoE experts) vs torch._grouped_mm (bench/peers/grouped_peer.py)"};
    bench::UseBenchDefaults(app);
    std::string cases, variants;
    app.add_option("--cases", cases, "comma list of case names (default: all)");
    app.add_option("--variants", variants, "comma list of variants (default: all)");
    app.add_option("--warmup", o.warmup, "warm-up iterations per variant")->check(CLI::PositiveNumber);
    app.add_option("--iters", o.iters, "timed iterations per variant per round")->check(CLI::PositiveNumber);
    app.add_option("--rounds", o.rounds, "interleaved rounds")->check(CLI::PositiveNumber);
    app.add_option("--host-calls", o.host_calls, "back-to-back calls for the host cost")->check(CLI::PositiveNumber);
    app.add_option("--json", o.json_path, "append one JSON record per measurement to this file");
    app.add_flag("--list-cases", o.list_cases, "print the cases (with their group sizes) as JSON and exit");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError &e) {
        std::exit(app.exit(e));
    }
    for (const std::string &c : bench::SplitList(cases)) {
        o.cases.insert(c);
    }
    for (const std::string &v : bench::SplitList(variants)) {
        o.variants.insert(v);
    }
    return o;
}

struct Operands {
    Tensor x, w, y, dy, dx, dw, sizes_host, sizes_device;
    std::int64_t rows = 0;
};

void Forward(const Operands &o, const Tensor &sizes) {
    Tensor y = o.y;
    GroupedLinearForward({.x = o.x, .weight = o.w, .group_sizes = sizes, .y = y});
}
void Dgrad(const Operands &o, const Tensor &sizes) {
    Tensor dx = o.dx;
    GroupedLinearBackwardInput({.dy = o.dy, .weight = o.w, .group_sizes = sizes, .dx = dx});
}
void Wgrad(const Operands &o, const Tensor &sizes) {
    Tensor dw = o.dw;
    GroupedLinearBackwardWeight({.dy = o.dy, .x = o.x, .group_sizes = sizes, .dweight = dw});
}
/// The backward as the GroupedLinear autograd Function runs it: dx and dW in one GroupedLinearBackward.
void Backward(const Operands &o, const Tensor &sizes) {
    Tensor dx = o.dx;
    Tensor dw = o.dw;
    GroupedLinearBackward({.dy = o.dy, .x = &o.x, .weight = &o.w, .group_sizes = sizes, .dx = &dx, .dweight = &dw});
}
/// The variant's choice and backward schedule.
void Select(const Variant &v) {
    SetGroupedGemmChoice(v.choice);
    SetGroupedConcurrentBackward(v.concurrent);
}

} // namespace

int main(int argc, char **argv) try {
    const Options opt = Parse(argc, argv);
    if (opt.list_cases) {
        json cases = json::array();
        for (const Case &c : kCases) {
            cases.push_back({{"case", c.name}, {"k", c.k}, {"n", c.n}, {"experts", c.experts}, {"sizes", Counts(c)}});
        }
        std::printf("%s\n", cases.dump().c_str());
        return 0;
    }
    const Device gpu = Device::CUDA(0);
    CudaContext &ctx = CudaContext::Get(0);
    cudaStream_t stream = ctx.stream();
    cudaDeviceProp prop{};
    SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    const bench::GemmCeiling ceiling = bench::MeasureGemmCeiling(stream);
    std::ofstream out;
    if (!opt.json_path.empty()) {
        out.open(opt.json_path, std::ios::app);
    }
    const json meta = {{"tool", "shardline-grouped-bench"},
                       {"device", prop.name},
                       {"date", bench::NowUtc()},
                       {"commit", bench::Commit()}};
    auto emit = [&](json rec) {
        rec.update(meta);
        if (out.is_open()) {
            out << rec.dump() << "\n";
            out.flush();
        }
    };
    emit({{"case", "calibration"}, {"variant", "gemm8192"}, {"tflops", ceiling.tflops}});
    std::printf("# %s, ceiling bf16 8192^3 %.1f TF/s\n", prop.name, ceiling.tflops);
    std::printf("%-18s %-18s %10s %10s %10s %10s %8s %8s  %s\n", "case", "variant", "fwd_us", "dgrad_us", "wgrad_us",
                "fwdbwd_us", "TF/s", "host_us", "config fwd | dgrad | wgrad");
    bench::EventTimer timer(stream);
    for (const Case &c : kCases) {
        if (!opt.cases.empty() && opt.cases.count(c.name) == 0) {
            continue;
        }
        const std::vector<std::int64_t> counts = Counts(c);
        Operands o;
        for (std::int64_t s : counts) {
            o.rows += s;
        }
        const DType bf16 = DType::kBFloat16;
        auto random = [&](Shape shape, const char *name, double stddev) {
            Tensor t = Tensor::Empty(std::move(shape), bf16, gpu);
            FillRandom(t, RandomSpec{.seed = 1, .name = name, .b = stddev});
            return t;
        };
        o.x = random({o.rows, c.k}, "x", 1.0);
        o.w = random({c.experts, c.n, c.k}, "w", 1.0 / std::sqrt(static_cast<double>(c.k)));
        o.dy = random({o.rows, c.n}, "dy", 1.0);
        o.y = Tensor::Empty({o.rows, c.n}, bf16, gpu);
        o.dx = Tensor::Empty({o.rows, c.k}, bf16, gpu);
        o.dw = Tensor::Empty({c.experts, c.n, c.k}, bf16, gpu);
        o.sizes_host =
            Tensor::FromVector(std::vector<double>(counts.begin(), counts.end()), Shape{c.experts}, DType::kInt64);
        o.sizes_device = o.sizes_host.To(gpu);
        const double flops = 2.0 * static_cast<double>(o.rows) * static_cast<double>(c.k) * static_cast<double>(c.n);

        // The gate's reference: the loop's forward (the kernel tests hold it to float64).
        SetGroupedGemmChoice({.impl = GroupedGemmImpl::kLoop});
        Forward(o, o.sizes_host);
        const std::vector<double> want = o.y.ToDoubleVector();
        double want_max = 0.0;
        for (double v : want) {
            want_max = std::max(want_max, std::abs(v));
        }

        std::map<std::string, std::map<std::string, std::vector<double>>> samples;
        std::vector<const Variant *> variants;
        for (const Variant &v : kVariants) {
            if (!opt.variants.empty() && opt.variants.count(v.name) == 0) {
                continue;
            }
            Select(v);
            const Tensor &sizes = v.device_sizes ? o.sizes_device : o.sizes_host;
            o.y.Fill(0.0);
            Forward(o, sizes);
            const std::vector<double> got = o.y.ToDoubleVector();
            double err = 0.0;
            for (std::size_t i = 0; i < got.size(); ++i) {
                err = std::max(err, std::abs(got[i] - want[i]));
            }
            if (!(err <= 2e-2 * want_max)) {
                std::fprintf(stderr, "GATE FAILED %s %s: max |diff| %.4g vs max |y| %.4g\n", c.name.c_str(),
                             v.name.c_str(), err, want_max);
                continue;
            }
            for (int i = 0; i < opt.warmup; ++i) {
                Forward(o, sizes);
                Dgrad(o, sizes);
                Wgrad(o, sizes);
                Backward(o, sizes);
            }
            variants.push_back(&v);
        }
        std::map<std::string, std::uint64_t> concurrent_runs;
        for (int round = 0; round < opt.rounds; ++round) {
            for (const Variant *v : variants) {
                Select(*v);
                const Tensor &sizes = v->device_sizes ? o.sizes_device : o.sizes_host;
                auto &s = samples[v->name];
                const std::uint64_t runs_before = GroupedConcurrentBackwardRuns();
                for (int i = 0; i < opt.iters; ++i) {
                    s["fwd"].push_back(timer.Microseconds([&] { Forward(o, sizes); }));
                    s["dgrad"].push_back(timer.Microseconds([&] { Dgrad(o, sizes); }));
                    s["wgrad"].push_back(timer.Microseconds([&] { Wgrad(o, sizes); }));
                    s["fwdbwd"].push_back(timer.Microseconds([&] {
                        Forward(o, sizes);
                        Backward(o, sizes);
                    }));
                }
                concurrent_runs[v->name] += GroupedConcurrentBackwardRuns() - runs_before;
            }
        }
        for (const Variant *v : variants) {
            Select(*v);
            const Tensor &sizes = v->device_sizes ? o.sizes_device : o.sizes_host;
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < opt.host_calls; ++i) {
                Forward(o, sizes);
            }
            const auto t1 = std::chrono::steady_clock::now();
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
            const double host_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / opt.host_calls;
            // What ran in each phase (auto: the tuned winner of the phase's shape class).
            std::map<std::string, std::string> config;
            Forward(o, sizes);
            config["fwd"] = LastGroupedGemmPath();
            Dgrad(o, sizes);
            config["dgrad"] = LastGroupedGemmPath();
            Wgrad(o, sizes);
            config["wgrad"] = LastGroupedGemmPath();
            config["fwdbwd"] = config["fwd"] + " | " + config["dgrad"] + " | " + config["wgrad"];
            auto &s = samples[v->name];
            std::map<std::string, double> median;
            for (const char *phase : {"fwd", "dgrad", "wgrad", "fwdbwd"}) {
                const double med = bench::Percentile(s[phase], 0.5);
                median[phase] = med;
                const double phase_flops = std::string(phase) == "fwdbwd" ? 3 * flops : flops;
                emit({{"case", c.name},
                      {"variant", v->name},
                      {"phase", phase},
                      {"rows", o.rows},
                      {"experts", c.experts},
                      {"k", c.k},
                      {"n", c.n},
                      {"median_us", med},
                      {"p90_us", bench::Percentile(s[phase], 0.9)},
                      {"tflops", phase_flops / med * 1e-6},
                      {"frac_ceiling", phase_flops / med * 1e-6 / ceiling.tflops},
                      {"host_us_per_fwd", host_us},
                      {"concurrent_bwd", v->concurrent},
                      {"concurrent_runs", concurrent_runs[v->name]},
                      {"config", config[phase]}});
            }
            std::printf("%-18s %-18s %10.1f %10.1f %10.1f %10.1f %8.1f %8.2f  %s (concurrent bwd: %llu of %zu)\n",
                        c.name.c_str(), v->name.c_str(), median["fwd"], median["dgrad"], median["wgrad"],
                        median["fwdbwd"], 3 * flops / median["fwdbwd"] * 1e-6, host_us, config["fwdbwd"].c_str(),
                        static_cast<unsigned long long>(concurrent_runs[v->name]), s["fwdbwd"].size());
        }
        // The per-shape tuning of this case: every timed class, its candidates' µs and the winner.
        for (const GroupedGemmTuningInfo &info : GroupedGemmTuningInfos()) {
            json candidates = json::object();
            for (const auto &[name, us] : info.candidates_us) {
                candidates[name] = us;
            }
            emit({{"case", c.name},
                  {"variant", "tuning"},
                  {"key", info.key},
                  {"winner", info.winner},
                  {"candidates_us", candidates}});
            std::printf("#   tuned %s -> %s\n", info.key.c_str(), info.winner.c_str());
        }
        ClearGroupedGemmTuning();
    }
    SetGroupedGemmChoice({});
    SetGroupedConcurrentBackward(true);
    return 0;
} catch (const std::exception &e) {
    std::fprintf(stderr, "shardline-grouped-bench: %s\n", e.what());
    return 1;
}
