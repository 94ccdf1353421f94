// train_char_lm: a character-level language model built from shardline's layers, trained with AdamW on the English
// texts in /usr/share/common-licenses (or --data). The README's main job.
//
//   shardline-run -n 2 build/examples/train_char_lm [--config examples/configs/char_lm_cpu.json] [--steps N] ...
//
// The model, the config, the corpus and the training step live in char_lm.h (shared with train_dp_tp): embedding ->
// residual ParallelMLP blocks -> a column-parallel head -> vocab-parallel cross-entropy, on a dp×tp mesh from the
// config. NCCL on GPUs when present, MPI on the CPU otherwise. --num-experts N --moe-router-topk K --ep E [--etp T]
// [--moe-aux-loss-coeff C] [--moe-capacity-factor F] make every block a MoE MLP on a (dp, ep, tp) mesh (dp derived from
// the rank count); the progress line then adds the auxiliary loss and the per-expert load (min/max).

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>

#include "char_lm.h"
#include "char_lm_checkpoint.h"

namespace {

using namespace shardline;
using namespace char_lm;
using nlohmann::json;

constexpr const char *kProgram = "train_char_lm";

int Run(launch::Environment &env, Config c) {
    const int world = env.world_size();
    Validate(c, world, kProgram);
    const bool gpu = env.device().type == DeviceType::kCUDA;
    const DType dtype = ResolveDType(c, gpu, kProgram);
    const bool lead = env.rank() == 0;

    const Corpus corpus = Encode(ReadCorpus(c.data, kProgram), c.context, kProgram);
    // Not padded: the head and the vocab-parallel loss split it over tp as torch.chunk (86 over tp 4: 22, 22, 22, 20).
    const std::int64_t vocab = static_cast<std::int64_t>(corpus.vocab.size());

    comm::DeviceMesh mesh(env.world(), MeshShape(c), MeshDims(c));
    const nn::ParameterOptions param{.dtype = dtype, .device = env.device(), .seed = c.seed};
    Trainer trainer(c, vocab, mesh, param);
    const CharLM &model = trainer.model();
    const std::int64_t numel = trainer.numel();
    // --load: resume on this mesh (any rank count / tp / dp); --steps stays the total, so training goes on from there.
    Checkpointer checkpoints(c, env.world(), kProgram);
    const std::int64_t first_step = checkpoints.Load(trainer, lead) + 1;

    if (lead) {
        fmt::print("{}: {} characters ({} train / {} val), vocab {}, {} parameters\n", kProgram, corpus.ids.size(),
                   corpus.split, corpus.ids.size() - corpus.split, vocab, numel);
        fmt::print("{}: mesh dp {} x tp {} on {} ({}), {}, context {}, hidden {}, ffn {}, layers {}, batch {}\n",
                   kProgram, c.dp, c.tp, gpu ? "GPUs" : "CPU", env.world().backend(), DTypeName(dtype), c.context,
                   c.hidden, c.ffn, c.layers, c.batch);
        if (model.moe()) {
            fmt::print("{}: MoE blocks: {} experts, top-{}, mesh dp {} x ep {} x tp {}, etp {}, aux loss coeff {}, "
                       "capacity factor {}\n",
                       kProgram, c.num_experts, c.moe_router_topk, c.dp, c.ep, c.tp, c.etp == 0 ? c.tp : c.etp,
                       c.moe_aux_loss_coeff,
                       c.moe_capacity_factor < 0 ? std::string("dropless") : fmt::format("{}", c.moe_capacity_factor));
        }
        std::fflush(stdout);
    }
    std::ofstream metrics;
    if (lead && !c.metrics.empty()) {
        metrics.open(c.metrics);
        SHARDLINE_CHECK(metrics.good(), kProgram, "cannot write the metrics file '{}'", c.metrics);
    }
    auto evaluate = [&]() {
        autograd::NoGradGuard no_grad;
        double total = 0.0;
        for (int i = 0; i < c.eval_batches; ++i) {
            const Batch b = MakeBatch(corpus, c.context, c.batch, vocab, EvalBatchSeed(c, i), true);
            total += LossValue(model.Loss(b, env.device()));
        }
        return total / c.eval_batches;
    };

    StepWindow window;
    window.Open(first_step, StepWindow::Clock::now());
    double last_val = std::nan("");
    for (std::int64_t step = first_step; step <= c.steps; ++step) {
        const auto host_start = StepWindow::Clock::now();
        const Batch b = MakeBatch(corpus, c.context, c.batch, vocab, TrainBatchSeed(c, step), false);
        const Variable loss = trainer.Step(b, env.device());
        window.AddHostTime(StepWindow::Clock::now() - host_start);
        checkpoints.MaybeSave(trainer, step, lead);

        const bool log = step % c.log_interval == 0 || step == c.steps || step == first_step;
        const bool eval = step % c.eval_interval == 0 || step == c.steps;
        if (!log && !eval) {
            continue;
        }
        const double train_loss = LossValue(loss); // a collective: every rank takes part
        const double aux_loss = model.moe() ? LossValue(model.aux()) : 0.0;
        const CharLM::MoELog moe_stats = model.moe_stats();
        Synchronize(env.device());
        const double ms = window.MsPerStep(step, StepWindow::Clock::now());
        const double host_ms = window.HostMsPerStep(step);
        if (eval) {
            last_val = evaluate();
        }
        window.Open(step + 1, StepWindow::Clock::now()); // the evaluation is not part of the next window
        const double tokens_per_s = static_cast<double>(c.batch) / (ms / 1e3);
        const double tflops = 3.0 * model.FlopsPerPrediction() * static_cast<double>(c.batch) / (ms / 1e3) / 1e12 /
                              static_cast<double>(world);
        if (lead) {
            const std::string val = std::isnan(last_val) ? std::string("  -   ") : fmt::format("{:.4f}", last_val);
            std::string line =
                fmt::format("step {:>5}/{} | loss {:.6f} | val {} | {:.2f} ms/step | {:.0f} tok/s | "
                            "{:.3f} TFLOP/s/{}",
                            step, c.steps, train_loss, val, ms, tokens_per_s, tflops, gpu ? "GPU" : "rank");
            // The most device memory held at once so far (this rank's GPU), as torch.cuda.max_memory_allocated.
            const double peak_gib = static_cast<double>(GetDeviceMemoryStats(env.device()).peak_allocated) /
                                    static_cast<double>(std::uint64_t{1} << 30);
            if (gpu) {
                line += fmt::format(" | MFU {:.2f}% | peak {:.2f} GiB | host {:.2f} ms", 100.0 * tflops / c.peak_tflops,
                                    peak_gib, host_ms);
            }
            if (model.moe()) {
                // Rank 0's tokens: the least and most loaded expert over the blocks, copies dropped by the capacity.
                line += fmt::format(" | aux {:.5f} | load {}/{} of {}", aux_loss, moe_stats.load_min,
                                    moe_stats.load_max, moe_stats.tokens * c.moe_router_topk);
                if (moe_stats.dropped > 0) {
                    line += fmt::format(" | dropped {}", moe_stats.dropped);
                }
            }
            fmt::print("{}\n", line);
            std::fflush(stdout);
            if (metrics.is_open()) {
                json rec = {{"step", step},
                            {"loss", train_loss},
                            {"ms_per_step", ms},
                            {"tokens_per_s", tokens_per_s},
                            {"tflops_per_device", tflops},
                            {"host_ms_per_step", host_ms},
                            {"dp", c.dp},
                            {"tp", c.tp},
                            {"dtype", DTypeName(dtype)}};
                if (!std::isnan(last_val)) {
                    rec["val_loss"] = last_val;
                }
                if (model.moe()) {
                    rec["ep"] = c.ep;
                    rec["aux_loss"] = aux_loss;
                    rec["expert_load_min"] = moe_stats.load_min;
                    rec["expert_load_max"] = moe_stats.load_max;
                    rec["dropped"] = moe_stats.dropped;
                }
                if (gpu) {
                    rec["mfu"] = tflops / c.peak_tflops;
                    rec["peak_gpu_mem_gib"] = peak_gib;
                }
                metrics << rec.dump() << "\n";
                metrics.flush();
            }
        }
    }

    checkpoints.Finish(lead);

    // A few sampled lines: dp·ep sequences (one per data-parallel rank's row; dp·ep·tp with etp 1 below tp, whose MoE
    // blocks split the rows over tp too), the same random stream on every rank.
    if (c.sample_chars > 0) {
        autograd::NoGradGuard no_grad;
        std::mt19937_64 rng(c.seed + 99);
        const std::int64_t rows = TokenRanks(c);
        std::vector<std::vector<std::int64_t>> ctx(static_cast<std::size_t>(rows));
        std::vector<std::string> text(static_cast<std::size_t>(rows));
        for (std::int64_t r = 0; r < rows; ++r) {
            const std::int64_t start = corpus.split + (r * 7919) % (static_cast<std::int64_t>(corpus.ids.size()) -
                                                                    corpus.split - c.context - 1);
            ctx[static_cast<std::size_t>(r)].assign(corpus.ids.begin() + start, corpus.ids.begin() + start + c.context);
        }
        for (int i = 0; i < c.sample_chars; ++i) {
            std::vector<double> ids(static_cast<std::size_t>(c.context * rows));
            for (std::int64_t t = 0; t < c.context; ++t) {
                for (std::int64_t r = 0; r < rows; ++r) {
                    ids[static_cast<std::size_t>(t * rows + r)] =
                        static_cast<double>(t * vocab + ctx[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)]);
                }
            }
            const Variable logits =
                model.Forward(Tensor::FromVector(ids, {c.context, rows}, DType::kInt64).To(env.device()));
            const std::vector<double> all = logits.value().FullTensor().ToDoubleVector();
            for (std::int64_t r = 0; r < rows; ++r) {
                const double *row = all.data() + r * vocab;
                double m = -1e300;
                for (std::int64_t v = 0; v < vocab; ++v) {
                    m = std::max(m, row[v]);
                }
                std::vector<double> p(static_cast<std::size_t>(vocab));
                for (std::int64_t v = 0; v < vocab; ++v) {
                    p[static_cast<std::size_t>(v)] = std::exp(row[v] - m);
                }
                std::discrete_distribution<std::int64_t> pick(p.begin(), p.end());
                const std::int64_t next = pick(rng);
                auto &cx = ctx[static_cast<std::size_t>(r)];
                cx.erase(cx.begin());
                cx.push_back(next);
                text[static_cast<std::size_t>(r)] += corpus.vocab[static_cast<std::size_t>(next)];
            }
        }
        if (lead) {
            for (const auto &t : text) {
                fmt::print("--- sample ---\n{}\n", t);
            }
        }
    }
    return 0;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"shardline character-level language model: embedding -> ParallelMLP blocks -> vocab-parallel head"};
    ConfigFlags flags;
    flags.Add(app);
    CLI11_PARSE(app, argc, argv);

    return launch::RunMain(&argc, &argv, {},
                           [&](launch::Environment &env) { return Run(env, flags.Resolve(Config{}, kProgram)); });
}
