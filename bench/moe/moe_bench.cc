// shardline-moe-bench: a mixture-of-experts MLP forward + backward at ep = 1 on one GPU (issue 16), against a torch
// reference MoE (bench/peers/moe_peer.py, the same command: bench/moe/run_moe_bench.sh), following the project's
// benchmark rules (shared/BENCHMARKS.md; the expert shapes of its "Grouped GEMM" table, one layer per -w1 case).
//
//   layer   Router (softmax top-k, renormalised, aux loss 0.01) → Permute (dropless, the group sizes left on the
//           device as nn::MoEMLP does at ep 1: no host sync) → GroupedLinear fc1 → GELU →
//           GroupedLinear fc2 → Unpermute, forward and autograd backward of y (given dy) and the aux loss, through
//           x, the logits and both expert weights. The logits [T, E] fp32 are an input (the gate Linear's output:
//           its tiny GEMM is left out on both sides). bf16 tokens and weights, no biases.
//   experts the six grouped GEMMs of that layer alone (fc1/fc2 forward, dgrad, wgrad) on the same group sizes.
//   The non-GEMM share is 1 - experts / layer: routing, permutation, GELU, the combine, the aux loss and the launch
//   gaps. tokens/s = T / layer.
//
// The floor: the bytes this design must move outside the GEMMs at the device's copy bandwidth (measured once: a
// device-to-device cudaMemcpyAsync of 1 GiB, median of 5), with C = T·topk copies, h = hidden, f = ffn, 2-byte
// elements: the gather of x into expert order (reads T·h, writes C·h) and its backward (the combine of the copies'
// gradients: reads C·h, writes T·h), the combine (C·h → T·h) and its backward (the weighted gather of dy, T·h → C·h,
// and the routing-weight gradient, reading C·h and T·h), and the GELU forward (reads and writes C·f): 2·(5·C·h +
// 5·T·h + 2·C·f) bytes. floor share = floor / (experts + floor): the non-GEMM share if every one of those kernels ran
// at the copy bandwidth and nothing else (router, sort, launches) took any time.
//
// Under a CUDA graph: the layer step and the six GEMMs, each captured once after the warm-ups and replayed, timed the
// same way in the same rounds as the eager steps (a gate first: a replay rewrites the eager step's bits). The layer
// makes no host sync at ep 1, so its routing runs inside the replay. The leaves' gradients are persistent buffers of
// their own dtype in both (AllocateMainGrad, deferred zeroing: the first writer overwrites); x's and the logits' then
// take one copy each from the fresh tensors Permute's and the router's backwards return. The graph columns show the
// GPU's time without the host's launch gaps (an eager step starts on an idle GPU after each event sync and waits for
// the host at every small kernel until a large GEMM lets it run ahead); the torch peer's layer reads the loads on the
// host (bincount) and cannot be captured, so its figures stay eager.
//
// Routing: logits = N(0, 1) + log w_e with Zipf weights w_e = 1/(e+1)^s (the last `zero` experts get -30), so the loads
// are skewed like the Grouped GEMM cases'. Timing: CUDA events around every iteration; warm-ups, then `rounds` rounds
// of (layer, experts); median and p90.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/cuda_graph.h"
#include "common/event_timer.h"
#include "kernels/cuda/cutlass/grouped_cutlass.h"
#include "moe_cli.h"

namespace {

using namespace shardline;
using json = nlohmann::json;

struct Case {
    std::string name;
    std::int64_t tokens, experts, topk, hidden, ffn;
    double skew;
    std::int64_t zero;
};

/// shared/BENCHMARKS.md "Grouped GEMM": each -w1 case is a layer (hidden = K, ffn = N).
const std::vector<Case> kCases = {
    {"mixtral-8x7b", 8192, 8, 2, 4096, 14336, 0.3, 0}, {"deepseek-64e", 8192, 64, 6, 2048, 1408, 0.5, 0},
    {"olmoe-64e", 8192, 64, 8, 2048, 1024, 0.5, 4},    {"ep8-local-8e", 16384, 8, 1, 4096, 2048, 0.2, 1},
    {"qwen3-128e", 8192, 128, 8, 2048, 768, 0.5, 8},
};

constexpr double kAuxLossCoeff = 0.01;

using Options = bench::MoeBenchOptions;

Options Parse(int argc, char **argv) {
    return bench::ParseMoeBench(
        argc, argv, "shardline-moe-bench: MoE MLP fwd+bwd at ep = 1 vs a torch reference (bench/peers/moe_peer.py)", 5);
}

/// Zipf routing bias log w_e (the last `zero` experts: -30, never chosen).
std::vector<double> RoutingBias(const Case &c) {
    std::vector<double> bias;
    for (std::int64_t e = 0; e < c.experts; ++e) {
        bias.push_back(e >= c.experts - c.zero ? -30.0 : -c.skew * std::log(static_cast<double>(e + 1)));
    }
    return bias;
}

Tensor Random(Shape shape, DType dtype, const char *name, double stddev) {
    Tensor t = Tensor::Empty(std::move(shape), dtype, Device::CUDA(0));
    FillRandom(t, RandomSpec{.seed = 1, .name = name, .b = stddev});
    return t;
}

struct Layer {
    autograd::Variable x, logits, w1, w2;
    Tensor dy;
    Tensor one; ///< d loss / d aux
    std::int64_t experts = 0, topk = 0;
    Tensor sizes; ///< the last forward's group sizes (on the GPU: the step makes no host sync, as nn::MoEMLP at ep 1)

    /// Forward and backward through every input; returns y for the gate. `keep_sizes` false inside a graph capture
    /// (the group sizes are the graph's memory and must not outlive it).
    Tensor Step(bool keep_sizes = true) {
        for (autograd::Variable *v : {&x, &logits, &w1, &w2}) {
            v->ZeroGrad();
        }
        const autograd::RouterOutput r = autograd::Router(logits, {.num_experts = static_cast<int>(experts),
                                                                   .topk = static_cast<int>(topk),
                                                                   .aux_loss_coeff = kAuxLossCoeff});
        const autograd::PermuteOutput p = autograd::Permute(x, r.indices, static_cast<int>(experts), -1, false);
        const autograd::Variable h = autograd::GroupedLinear(p.tokens, w1, {}, p.group_sizes);
        // The GELU and fc2 as nn::MoEMLP runs them: GELU's gradient in fc2's grouped dgrad epilogue.
        const autograd::Variable o = autograd::GeluGroupedLinear(h, w2, {}, p.group_sizes);
        const autograd::Variable y = autograd::Unpermute(o, p.row_map, r.weights);
        autograd::Backward({y, r.aux_loss}, {dist::DistTensor::Local(dy), dist::DistTensor::Local(one)});
        if (keep_sizes) {
            sizes = p.group_sizes;
            return y.local();
        }
        return {};
    }
};

/// The device-to-device copy bandwidth in bytes/s: the median of 5 cudaMemcpyAsync of 1 GiB (read + write counted).
double CopyBandwidth(bench::EventTimer &timer, cudaStream_t stream) {
    constexpr std::size_t kBytes = std::size_t{1} << 30;
    const auto elements = static_cast<std::int64_t>(kBytes / sizeof(std::int64_t));
    const Tensor a = Tensor::Empty({elements}, DType::kInt64, Device::CUDA(0));
    Tensor b = Tensor::Empty({elements}, DType::kInt64, Device::CUDA(0));
    std::vector<double> us;
    for (int i = 0; i < 6; ++i) {
        const double t = timer.Microseconds([&] {
            SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(b.data(), a.data(), kBytes, cudaMemcpyDeviceToDevice, stream));
        });
        if (i > 0) {
            us.push_back(t);
        }
    }
    return 2.0 * static_cast<double>(kBytes) / (bench::Percentile(us, 0.5) * 1e-6);
}

/// The bytes the design moves outside the GEMMs (see the header).
double FloorBytes(const Case &c) {
    const double t = static_cast<double>(c.tokens), copies = t * static_cast<double>(c.topk);
    const double h = static_cast<double>(c.hidden), f = static_cast<double>(c.ffn);
    return 2.0 * (5.0 * copies * h + 5.0 * t * h + 2.0 * copies * f);
}

/// The six grouped GEMMs of the layer on fixed operands.
struct Experts {
    Tensor tokens, h, a, o, dtokens, da, dh, do_, dw1, dw2, w1, w2, sizes;

    void Step() {
        kernels::GroupedLinearForward({.x = tokens, .weight = w1, .group_sizes = sizes, .y = h});
        kernels::GroupedLinearForward({.x = a, .weight = w2, .group_sizes = sizes, .y = o});
        kernels::GroupedLinearBackwardInput({.dy = do_, .weight = w2, .group_sizes = sizes, .dx = da});
        kernels::GroupedLinearBackwardWeight({.dy = do_, .x = a, .group_sizes = sizes, .dweight = dw2});
        kernels::GroupedLinearBackwardInput({.dy = dh, .weight = w1, .group_sizes = sizes, .dx = dtokens});
        kernels::GroupedLinearBackwardWeight({.dy = dh, .x = tokens, .group_sizes = sizes, .dweight = dw1});
    }
};

} // namespace

int main(int argc, char **argv) try {
    const Options opt = Parse(argc, argv);
    if (opt.list_cases) {
        json cases = json::array();
        for (const Case &c : kCases) {
            cases.push_back({{"case", c.name},
                             {"tokens", c.tokens},
                             {"experts", c.experts},
                             {"topk", c.topk},
                             {"hidden", c.hidden},
                             {"ffn", c.ffn},
                             {"routing_bias", RoutingBias(c)},
                             {"aux_loss_coeff", kAuxLossCoeff}});
        }
        std::printf("%s\n", cases.dump().c_str());
        return 0;
    }
    const Device gpu = Device::CUDA(0);
    cudaStream_t stream = CudaContext::Get(0).stream();
    cudaDeviceProp prop{};
    SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::ofstream out;
    if (!opt.json_path.empty()) {
        out.open(opt.json_path, std::ios::app);
    }
    bench::EventTimer timer(stream);
    const double bandwidth = CopyBandwidth(timer, stream);
    std::printf("# %s, shardline MoE MLP fwd+bwd, ep = 1, bf16; device-to-device copy %.2f TB/s\n", prop.name,
                bandwidth * 1e-12);
    std::printf("%-14s %10s %10s %12s %10s %12s %10s %8s %10s %10s %10s\n", "case", "layer_us", "gemm_us", "tokens/s",
                "non-GEMM", "max/min load", "floor_us", "floor", "graph_layer", "graph_gemm", "graph nonG");
    int status = 0;
    for (const Case &c : kCases) {
        if (!opt.cases.empty() && opt.cases.count(c.name) == 0) {
            continue;
        }
        const DType bf16 = DType::kBFloat16;
        Layer layer;
        layer.experts = c.experts;
        layer.topk = c.topk;
        layer.x = autograd::Variable(Random({c.tokens, c.hidden}, bf16, "x", 1.0), true);
        Tensor logits = Random({c.tokens, c.experts}, DType::kFloat32, "logits", 1.0);
        {
            // + the routing bias per column (host round trip once, outside the timing).
            std::vector<double> l = logits.ToDoubleVector();
            const std::vector<double> bias = RoutingBias(c);
            for (std::size_t i = 0; i < l.size(); ++i) {
                l[i] += bias[i % bias.size()];
            }
            logits = Tensor::FromVector(l, logits.shape(), DType::kFloat32).To(gpu);
        }
        layer.logits = autograd::Variable(logits, true);
        layer.w1 = autograd::Variable(
            Random({c.experts, c.ffn, c.hidden}, bf16, "w1", 1.0 / std::sqrt(static_cast<double>(c.hidden))), true);
        layer.w2 = autograd::Variable(
            Random({c.experts, c.hidden, c.ffn}, bf16, "w2", 1.0 / std::sqrt(static_cast<double>(c.ffn))), true);
        layer.dy = Random({c.tokens, c.hidden}, bf16, "dy", 1.0);
        layer.one = Tensor::Full({}, 1.0, DType::kFloat32, gpu);
        // The leaves' gradients in persistent buffers of their own dtype (deferred zeroing: the first backward writer
        // overwrites), in the eager and the captured step alike, so both run the same kernels: a graph cannot keep
        // fresh gradients, which would be its own memory still held by the host.
        for (autograd::Variable *v : {&layer.x, &layer.logits, &layer.w1, &layer.w2}) {
            v->AllocateMainGrad(v->dtype());
        }

        // Gate: a finite output and finite gradients, every copy kept.
        const std::vector<double> y = layer.Step().ToDoubleVector();
        bool finite = true;
        for (double v : y) {
            finite = finite && std::isfinite(v);
        }
        for (const autograd::Variable *v : {&layer.x, &layer.logits, &layer.w1}) {
            for (double g : v->grad().local().ToDoubleVector()) {
                finite = finite && std::isfinite(g);
            }
        }
        std::vector<std::int64_t> loads;
        for (double s : layer.sizes.ToDoubleVector()) {
            loads.push_back(static_cast<std::int64_t>(s));
        }
        std::int64_t rows = 0, max_load = 0, min_load = c.tokens * c.topk;
        for (std::int64_t s : loads) {
            rows += s;
            max_load = std::max(max_load, s);
            min_load = std::min(min_load, s);
        }
        if (!finite || rows != c.tokens * c.topk) {
            std::fprintf(stderr, "GATE FAILED %s: finite %d, rows %lld of %lld\n", c.name.c_str(), finite ? 1 : 0,
                         static_cast<long long>(rows), static_cast<long long>(c.tokens * c.topk));
            status = 1;
            continue;
        }

        Experts ex;
        ex.sizes = layer.sizes;
        ex.tokens = Random({rows, c.hidden}, bf16, "tokens", 1.0);
        ex.a = Random({rows, c.ffn}, bf16, "a", 1.0);
        ex.do_ = Random({rows, c.hidden}, bf16, "do", 1.0);
        ex.dh = Random({rows, c.ffn}, bf16, "dh", 1.0);
        ex.h = Tensor::Empty({rows, c.ffn}, bf16, gpu);
        ex.o = Tensor::Empty({rows, c.hidden}, bf16, gpu);
        ex.da = Tensor::Empty({rows, c.ffn}, bf16, gpu);
        ex.dtokens = Tensor::Empty({rows, c.hidden}, bf16, gpu);
        ex.w1 = layer.w1.local();
        ex.w2 = layer.w2.local();
        ex.dw1 = Tensor::Empty(ex.w1.shape(), bf16, gpu);
        ex.dw2 = Tensor::Empty(ex.w2.shape(), bf16, gpu);

        for (int i = 0; i < opt.warmup; ++i) {
            layer.Step();
            ex.Step();
        }
        // The same two steps captured (after the warm-ups built and tuned every plan) and replayed (see the header).
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
        const bench::CudaGraph layer_graph(stream, [&] { layer.Step(/*keep_sizes=*/false); });
        const bench::CudaGraph gemm_graph(stream, [&] { ex.Step(); });
        // Gate of the replays: after an eager step, NaN bytes in what the step writes last (w1's and x's gradients,
        // the GEMMs' dW1); a replay must write the eager step's bits back.
        auto replay_matches = [&](const bench::CudaGraph &graph, const std::vector<Tensor> &outputs) {
            std::vector<std::vector<double>> eager;
            for (const Tensor &t : outputs) {
                eager.push_back(t.ToDoubleVector());
                SHARDLINE_CHECK_CUDA(cudaMemsetAsync(t.data(), 0xFF, t.nbytes(), stream));
            }
            graph.Launch();
            bool same = true;
            for (std::size_t i = 0; i < outputs.size(); ++i) {
                same = same && outputs[i].ToDoubleVector() == eager[i];
            }
            return same;
        };
        layer.Step();
        const bool layer_replay_ok = replay_matches(layer_graph, {layer.w1.grad().local(), layer.x.grad().local()});
        ex.Step();
        const bool gemm_replay_ok = replay_matches(gemm_graph, {ex.dw1});
        if (!layer_replay_ok || !gemm_replay_ok) {
            std::fprintf(stderr,
                         "GATE FAILED %s: a CUDA-graph replay differs from the eager step (layer %d, GEMMs %d)\n",
                         c.name.c_str(), layer_replay_ok ? 1 : 0, gemm_replay_ok ? 1 : 0);
            status = 1;
            continue;
        }
        for (int i = 0; i < opt.warmup; ++i) {
            layer_graph.Launch();
            gemm_graph.Launch();
        }
        std::vector<double> layer_us, gemm_us, layer_graph_us, gemm_graph_us;
        // The CUTLASS kernels' cached Params (kernels/cuda/cutlass/grouped_cutlass.cuh): a miss rebuilds them on the
        // host (TMA descriptors, a cudaFuncSetAttribute) before the launch.
        namespace cg = kernels::cuda::cutlass_grouped;
        cg::CachedParamsStats layer_params{}, gemm_params{};
        auto add_params = [](cg::CachedParamsStats &into, const cg::CachedParamsStats &before) {
            const cg::CachedParamsStats now = cg::GetCachedParamsStats();
            into.hits += now.hits - before.hits;
            into.misses += now.misses - before.misses;
        };
        // Each round: the eager layer, the eager GEMMs, then both replayed, so drift over the run hits all four alike.
        for (int round = 0; round < opt.rounds; ++round) {
            cg::CachedParamsStats before = cg::GetCachedParamsStats();
            for (int i = 0; i < opt.iters; ++i) {
                layer_us.push_back(timer.Microseconds([&] { layer.Step(); }));
            }
            add_params(layer_params, before);
            before = cg::GetCachedParamsStats();
            for (int i = 0; i < opt.iters; ++i) {
                gemm_us.push_back(timer.Microseconds([&] { ex.Step(); }));
            }
            add_params(gemm_params, before);
            for (int i = 0; i < opt.iters; ++i) {
                layer_graph_us.push_back(timer.Microseconds([&] { layer_graph.Launch(); }));
            }
            for (int i = 0; i < opt.iters; ++i) {
                gemm_graph_us.push_back(timer.Microseconds([&] { gemm_graph.Launch(); }));
            }
        }
        const double layer_med = bench::Percentile(layer_us, 0.5);
        const double gemm_med = bench::Percentile(gemm_us, 0.5);
        const double layer_graph_med = bench::Percentile(layer_graph_us, 0.5);
        const double gemm_graph_med = bench::Percentile(gemm_graph_us, 0.5);
        const double non_gemm_graph = 1.0 - gemm_graph_med / layer_graph_med;
        const double tokens_per_s = static_cast<double>(c.tokens) / (layer_med * 1e-6);
        const double non_gemm = 1.0 - gemm_med / layer_med;
        const double floor_us = FloorBytes(c) / bandwidth * 1e6;
        const double floor_share = floor_us / (gemm_med + floor_us);
        std::printf("%-14s %10.1f %10.1f %12.0f %9.1f%% %6lld/%-5lld %10.1f %7.1f%% %10.1f %10.1f %9.1f%%\n",
                    c.name.c_str(), layer_med, gemm_med, tokens_per_s, 100.0 * non_gemm,
                    static_cast<long long>(max_load), static_cast<long long>(min_load), floor_us, 100.0 * floor_share,
                    layer_graph_med, gemm_graph_med, 100.0 * non_gemm_graph);
        if (out.is_open()) {
            const json rec = {{"tool", "shardline-moe-bench"},
                              {"impl", "shardline"},
                              {"device", prop.name},
                              {"date", bench::NowUtc()},
                              {"commit", bench::Commit()},
                              {"case", c.name},
                              {"tokens", c.tokens},
                              {"experts", c.experts},
                              {"topk", c.topk},
                              {"hidden", c.hidden},
                              {"ffn", c.ffn},
                              {"loads", loads},
                              {"layer_median_us", layer_med},
                              {"layer_p90_us", bench::Percentile(layer_us, 0.9)},
                              {"gemm_median_us", gemm_med},
                              {"gemm_p90_us", bench::Percentile(gemm_us, 0.9)},
                              {"tokens_per_s", tokens_per_s},
                              {"non_gemm_share", non_gemm},
                              {"copy_bandwidth_bytes_per_s", bandwidth},
                              {"floor_bytes", FloorBytes(c)},
                              {"floor_us", floor_us},
                              {"floor_share", floor_share},
                              {"layer_graph_median_us", layer_graph_med},
                              {"gemm_graph_median_us", gemm_graph_med},
                              {"tokens_per_s_graph", static_cast<double>(c.tokens) / (layer_graph_med * 1e-6)},
                              {"non_gemm_share_graph", non_gemm_graph}};
            out << rec.dump() << "\n";
            out.flush();
        }
        const double steps = static_cast<double>(opt.rounds) * opt.iters;
        std::printf(
            "#   cached CUTLASS Params per step: layer %.1f hits, %.1f misses; the six GEMMs %.1f hits, %.1f misses\n",
            static_cast<double>(layer_params.hits) / steps, static_cast<double>(layer_params.misses) / steps,
            static_cast<double>(gemm_params.hits) / steps, static_cast<double>(gemm_params.misses) / steps);
        // What the grouped GEMMs' per-shape tuning chose for this case (a dgelu class: only cooperative256x128 has
        // the dGELU in its epilogue; another winner runs the dGELU as a kernel after it).
        for (const kernels::GroupedGemmTuningInfo &info : kernels::GroupedGemmTuningInfos()) {
            std::printf("#   tuned %s -> %s\n", info.key.c_str(), info.winner.c_str());
        }
        kernels::ClearGroupedGemmTuning();
    }
    return status;
} catch (const std::exception &e) {
    std::fprintf(stderr, "shardline-moe-bench: %s\n", e.what());
    return 1;
}
