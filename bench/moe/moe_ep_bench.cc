// shardline-moe-ep-bench: nn::MoEMLP with expert parallelism over the whole world (ep = the ranks, one GPU each, NCCL),
// forward + backward, against a torch reference (bench/peers/moe_ep_peer.py: all_to_all_single + torch._grouped_mm) in
// the same command (bench/moe/run_moe_ep_bench.sh). Issue 16's EP benchmark, issue 20 item 3.
//
//   layer     ForwardRouted at a given routing: Permute → the counts' all-to-all → the rows' all-to-all-v → grouped
//             fc1 → GELU → grouped fc2 → the rows back → weighted Unpermute; forward and autograd backward of y (given
//             dy) through x and both expert weights. bf16 tokens and weights, no biases, no gate (the router's small
//             GEMM and softmax are left out on both sides, as in bench/moe).
//   exchange  the same without the experts (Permute → dispatch → combine → Unpermute, forward and backward): the
//             routing and all-to-all part of the layer. a2a share = exchange / layer.
// Every rank holds T tokens (weak scaling, as Megatron's data-parallel ranks); tokens/s = ranks · T / layer.
//
// Routing (the peer computes the same): token g = rank·T + t, u = ((g·2654435761 + 12345) mod 2^32) / 2^32, first
// expert min(E-1, floor(E·u^(1+skew))), then the next topk-1 experts cyclically; weights (k-j) / (k(k+1)/2). The skew
// loads the low experts, hence the low ranks, more (as the Zipf routing of bench/moe).
// Timing: CUDA events around every iteration after a barrier per batch; per iteration the max over ranks; median, p90.

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
#include <shardline/autograd/moe.h>
#include <shardline/autograd/moe_dispatch.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/launch/bootstrap.h>
#include <shardline/nn/moe.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/event_timer.h"
#include "common/host_reduce.h"
#include "moe_cli.h"

namespace {

using namespace shardline;
using json = nlohmann::json;
using autograd::Variable;
using dist::DistTensor;

constexpr const char *kTool = "shardline-moe-ep-bench";

struct Case {
    std::string name;
    std::int64_t tokens, experts, topk, hidden, ffn; // tokens per rank
    double skew;
};

/// shared/BENCHMARKS.md "Grouped GEMM" layers, T tokens on every rank.
const std::vector<Case> kCases = {
    {"mixtral-8x7b", 8192, 8, 2, 4096, 14336, 0.3},
    {"deepseek-64e", 8192, 64, 6, 2048, 1408, 0.5},
    {"olmoe-64e", 8192, 64, 8, 2048, 1024, 0.5},
    {"qwen3-128e", 8192, 128, 8, 2048, 768, 0.5},
};

using Options = bench::MoeBenchOptions;

/// This rank's routing: indices and weights [T, topk], row-major.
void Routing(const Case &c, std::int64_t rank, std::vector<double> &indices, std::vector<double> &weights) {
    const double norm = static_cast<double>(c.topk * (c.topk + 1)) / 2.0;
    for (std::int64_t t = 0; t < c.tokens; ++t) {
        const std::uint64_t g = static_cast<std::uint64_t>(rank * c.tokens + t);
        const std::uint64_t h = (g * 2654435761ULL + 12345ULL) & 0xffffffffULL;
        const double u = static_cast<double>(h) / 4294967296.0;
        const auto first =
            std::min(c.experts - 1,
                     static_cast<std::int64_t>(std::floor(static_cast<double>(c.experts) * std::pow(u, 1.0 + c.skew))));
        for (std::int64_t j = 0; j < c.topk; ++j) {
            indices.push_back(static_cast<double>((first + j) % c.experts));
            weights.push_back(static_cast<double>(c.topk - j) / norm);
        }
    }
}

Options Parse(int argc, char **argv) {
    return bench::ParseMoeBench(
        argc, argv,
        "shardline-moe-ep-bench: MoE MLP fwd+bwd with ep = the world over NCCL, vs bench/peers/moe_ep_peer.py", 3);
}

int Run(launch::Environment &env, const Options &opt) {
    const std::int64_t ep = env.world_size();
    const std::int64_t rank = env.rank();
    SHARDLINE_CHECK(env.device().is_cuda(), kTool, "needs one GPU per rank, the world is '{}'", env.world().backend());
    const Device gpu = env.device();
    cudaDeviceProp prop{};
    SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, gpu.index));
    comm::DeviceMesh mesh(env.world(), {1, ep, 1}, {"dp", "ep", "tp"});
    comm::Communicator *ep_group = ep > 1 ? &mesh.group("ep") : nullptr; // as nn::MoEMLP passes it
    const DType bf16 = DType::kBFloat16;
    bench::EventTimer timer(CudaContext::Get(gpu.index).stream());
    std::ofstream out;
    if (rank == 0 && !opt.json_path.empty()) {
        out.open(opt.json_path, std::ios::app);
    }
    if (rank == 0) {
        std::printf("# %s, shardline MoE MLP fwd+bwd, ep = %lld (NCCL), bf16, T per rank\n", prop.name,
                    static_cast<long long>(ep));
        std::printf("%-14s %10s %10s %12s %9s %14s\n", "case", "layer_us", "a2a_us", "tokens/s", "a2a",
                    "max/min rank rows");
    }
    int status = 0;
    for (const Case &c : kCases) {
        if (!opt.cases.empty() && opt.cases.count(c.name) == 0) {
            continue;
        }
        if (c.experts % ep != 0) {
            if (rank == 0) {
                std::printf("%-14s skipped: %lld experts not divisible by ep %lld\n", c.name.c_str(),
                            static_cast<long long>(c.experts), static_cast<long long>(ep));
            }
            continue;
        }
        nn::MoEMLP layer({.hidden = c.hidden,
                          .ffn = c.ffn,
                          .num_experts = c.experts,
                          .topk = static_cast<int>(c.topk),
                          .ep = ep,
                          .bias = false},
                         mesh, nn::ParameterOptions{.dtype = bf16, .device = gpu, .seed = 5, .name = "moe"});
        const spmd::Layout tokens_layout(std::vector<std::vector<int>>{{0, 1}, {}});
        const Shape local{c.tokens, c.hidden};
        const Shape global{c.tokens * ep, c.hidden};
        Tensor xl = Tensor::Empty(local, bf16, gpu);
        FillRandom(xl, RandomSpec{.seed = static_cast<std::uint64_t>(10 + rank), .name = "x", .b = 1.0});
        Variable x(DistTensor::FromTrustedShard(xl, global, tokens_layout, &mesh), true);
        Tensor dyl = Tensor::Empty(local, bf16, gpu);
        FillRandom(dyl, RandomSpec{.seed = static_cast<std::uint64_t>(20 + rank), .name = "dy", .b = 1.0});
        std::vector<double> idx, w;
        Routing(c, rank, idx, w);
        const Tensor indices = Tensor::FromVector(idx, {c.tokens, c.topk}, DType::kInt64).To(gpu);
        const Variable weights(Tensor::FromVector(w, {c.tokens, c.topk}, DType::kFloat32).To(gpu), false);

        nn::MoEStats stats;
        auto layer_step = [&] {
            for (Variable *v : {&x, &layer.fc1_weight, &layer.fc2_weight}) {
                v->ZeroGrad();
            }
            const nn::MoEOutput o = layer.ForwardRouted(x, indices, weights);
            const DistTensor dy = DistTensor::FromTrustedShard(dyl, global, o.output.value().layout(), &mesh);
            o.output.Backward(&dy);
            stats = o.stats;
            return o.output;
        };
        auto exchange_step = [&] {
            x.ZeroGrad();
            const autograd::PermuteOutput p =
                autograd::Permute(autograd::LocalPart(x, local), indices, static_cast<int>(c.experts));
            const autograd::ExpertExchangePlan plan = autograd::PlanExpertExchange(p.host_group_sizes, ep_group);
            const Variable rows = autograd::ExpertDispatch(p.tokens, plan, ep_group);
            const Variable back = autograd::ExpertCombine(rows, plan, ep_group);
            const Variable y = autograd::Unpermute(back, p.row_map, weights);
            autograd::Backward({y}, {DistTensor::Local(dyl)});
        };

        // Gate: a finite output and gradients; every copy routed (dropless).
        const Variable y = layer_step();
        bool finite = true;
        for (double v : y.local().ToDoubleVector()) {
            finite = finite && std::isfinite(v);
        }
        for (const Variable *v : {&x, &layer.fc1_weight, &layer.fc2_weight}) {
            for (double g : v->grad().local().ToDoubleVector()) {
                finite = finite && std::isfinite(g);
            }
        }
        std::vector<double> gate{finite ? 0.0 : 1.0};
        bench::AllReduceHost(env, gate, comm::ReduceOp::kMax);
        if (gate[0] != 0.0) {
            if (rank == 0) {
                std::fprintf(stderr, "GATE FAILED %s: a non-finite output or gradient on some rank\n", c.name.c_str());
            }
            status = 1;
            continue;
        }
        // The rows each rank's experts receive (the load balance over ranks).
        std::vector<double> rows_in(static_cast<std::size_t>(ep), 0.0);
        {
            const std::int64_t per_rank = c.experts / ep;
            for (double e : idx) {
                rows_in[static_cast<std::size_t>(static_cast<std::int64_t>(e) / per_rank)] += 1.0;
            }
            bench::AllReduceHost(env, rows_in, comm::ReduceOp::kSum);
        }

        for (int i = 0; i < opt.warmup; ++i) {
            layer_step();
            exchange_step();
        }
        std::vector<double> layer_us, a2a_us;
        for (int round = 0; round < opt.rounds; ++round) {
            Synchronize(gpu);
            env.world().Barrier()->Wait(true);
            for (int i = 0; i < opt.iters; ++i) {
                layer_us.push_back(timer.Microseconds([&] { layer_step(); }));
            }
            Synchronize(gpu);
            env.world().Barrier()->Wait(true);
            for (int i = 0; i < opt.iters; ++i) {
                a2a_us.push_back(timer.Microseconds([&] { exchange_step(); }));
            }
        }
        bench::AllReduceHost(env, layer_us, comm::ReduceOp::kMax); // the slowest rank sets each iteration's time
        bench::AllReduceHost(env, a2a_us, comm::ReduceOp::kMax);
        const double layer_med = bench::Percentile(layer_us, 0.5);
        const double a2a_med = bench::Percentile(a2a_us, 0.5);
        const double tokens_per_s = static_cast<double>(c.tokens * ep) / (layer_med * 1e-6);
        const auto [lo, hi] = std::minmax_element(rows_in.begin(), rows_in.end());
        if (rank == 0) {
            std::printf("%-14s %10.1f %10.1f %12.0f %8.1f%% %7.0f/%.0f\n", c.name.c_str(), layer_med, a2a_med,
                        tokens_per_s, 100.0 * a2a_med / layer_med, *hi, *lo);
            std::fflush(stdout);
        }
        if (out.is_open()) {
            const json rec = {{"tool", kTool},
                              {"impl", "shardline"},
                              {"device", prop.name},
                              {"date", bench::NowUtc()},
                              {"commit", bench::Commit()},
                              {"case", c.name},
                              {"ep", ep},
                              {"tokens_per_rank", c.tokens},
                              {"experts", c.experts},
                              {"topk", c.topk},
                              {"hidden", c.hidden},
                              {"ffn", c.ffn},
                              {"rank_rows", rows_in},
                              {"layer_median_us", layer_med},
                              {"layer_p90_us", bench::Percentile(layer_us, 0.9)},
                              {"a2a_median_us", a2a_med},
                              {"a2a_p90_us", bench::Percentile(a2a_us, 0.9)},
                              {"tokens_per_s", tokens_per_s},
                              {"a2a_share", a2a_med / layer_med}};
            out << rec.dump() << "\n";
            out.flush();
        }
    }
    return status;
}

} // namespace

int main(int argc, char **argv) {
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
                             {"skew", c.skew}});
        }
        std::printf("%s\n", cases.dump().c_str());
        return 0;
    }
    return launch::RunMain(&argc, &argv, {}, [&](launch::Environment &env) { return Run(env, opt); });
}
