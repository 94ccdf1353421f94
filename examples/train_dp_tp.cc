// train_dp_tp: train_char_lm's character-level language model on a dp×tp mesh — the batch sharded on dp, the
// gradients all-reduced over dp in buckets during backward (nn::GradSync) — trained in the same launch next to a
// tp-only reference from the same seed. Prints both loss curves side by side with their relative difference and
// exits non-zero when a step's difference exceeds the tolerance.
//
//   shardline-run -n 4 build/examples/train_dp_tp [--dp 2] [--steps 40] [--config examples/configs/char_lm_cpu.json]
//                 [--rtol R] ...
//
// The reference: every dp replica (the tp ranks of one dp coordinate) also trains the same model on the whole global
// batch, on a dp 1 × tp mesh over its own tp group. Same seed, so the same global weights (counter-based init), the
// same batches and the same tp sharding of every layer: the only difference between the runs is data parallelism
// (each dp rank takes batch/dp rows, the loss mean and the gradients are summed over dp), so the curves must agree to
// rounding. That tp does not change the curve either is shown by train_char_lm at tp 1, 2 and 4 (its CTest).
//
// Tolerance on |loss - loss_ref| / |loss_ref| per step, by dtype (DESIGN.md §7): float32 1e-5 (CPU, and CUDA without
// TF32), TF32 1e-3, float16 1e-3, bfloat16 1.6e-2; --rtol overrides. The options are train_char_lm's (--dp defaults to
// 2, --steps to 40, --log-interval to 1); evaluation, sampling and the metrics file are not used here.

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>

#include "char_lm.h"

namespace {

using namespace shardline;
using namespace char_lm;

constexpr const char *kProgram = "train_dp_tp";

/// The default tolerance on a step's relative loss difference for the compute dtype.
double DefaultRtol(DType dtype, bool tf32) {
    switch (dtype) {
    case DType::kBFloat16:
        return 1.6e-2;
    case DType::kFloat16:
        return 1e-3;
    default:
        return tf32 ? 1e-3 : 1e-5;
    }
}

int Run(launch::Environment &env, Config c, std::optional<double> rtol_option) {
    const int world = env.world_size();
    Validate(c, world, kProgram);
    SHARDLINE_CHECK(c.dp >= 2, kProgram, "dp ({}) must be at least 2 to compare data parallelism with a tp-only run",
                    c.dp);
    const bool gpu = env.device().type == DeviceType::kCUDA;
    const DType dtype = ResolveDType(c, gpu, kProgram);
    bool tf32 = false;
#if SHARDLINE_HAVE_CUDA
    tf32 = gpu && dtype == DType::kFloat32 && CudaContext::Current().allow_tf32();
#endif
    SHARDLINE_CHECK(!rtol_option || *rtol_option > 0.0, kProgram, "rtol must be positive, got {}", *rtol_option);
    const double rtol = rtol_option.value_or(DefaultRtol(dtype, tf32));
    const bool lead = env.rank() == 0;

    const Corpus corpus = Encode(ReadCorpus(c.data, kProgram), c.context, kProgram);
    const std::int64_t vocab = static_cast<std::int64_t>(corpus.vocab.size()); // split over tp as torch.chunk
    const nn::ParameterOptions param{.dtype = dtype, .device = env.device(), .seed = c.seed};

    comm::DeviceMesh mesh(env.world(), {c.dp, c.tp}, {"dp", "tp"});
    Trainer trainer(c, vocab, mesh, param);
    // The reference mesh spans this rank's tp group only: every dp replica trains its own copy on the whole batch.
    comm::DeviceMesh reference_mesh(mesh.group("tp"), {1, c.tp}, {"dp", "tp"});
    Trainer reference(c, vocab, reference_mesh, param);

    const std::string run = fmt::format("dp{}×tp{}", c.dp, c.tp);
    const std::string ref = fmt::format("tp{} (reference)", c.tp);
    if (lead) {
        fmt::print("{}: vocab {}, {} parameters, {} on {} ({}), context {}, hidden {}, ffn {}, layers {}\n", kProgram,
                   vocab, trainer.numel(), DTypeName(dtype), gpu ? "GPUs" : "CPU", env.world().backend(), c.context,
                   c.hidden, c.ffn, c.layers);
        fmt::print("{}: {}: mesh dp {} x tp {}, global batch {} ({} rows per dp rank), GradSync over dp\n", kProgram,
                   run, c.dp, c.tp, c.batch, c.batch / c.dp);
        fmt::print("{}: {}: mesh dp 1 x tp {} per dp replica, the whole batch of {} on each\n", kProgram, ref, c.tp,
                   c.batch);
        fmt::print("{}: tolerance: relative loss difference <= {:.1e} per step\n", kProgram, rtol);
        fmt::print("{:>6} | {:>16} | {:>18} | {:>9}\n", "step", run, ref, "rel diff");
        std::fflush(stdout);
    }

    double max_diff = 0.0;
    std::int64_t max_step = 0;
    std::int64_t failures = 0;
    for (std::int64_t step = 1; step <= c.steps; ++step) {
        const Batch b = MakeBatch(corpus, c.context, c.batch, vocab, TrainBatchSeed(c, step), false);
        // LossValue is a collective on its mesh: every rank computes both numbers, so every rank decides alike.
        const double loss = LossValue(trainer.Step(b, env.device()));
        const double loss_ref = LossValue(reference.Step(b, env.device()));
        const double diff = std::fabs(loss - loss_ref) / std::fabs(loss_ref);
        const bool bad = !(diff <= rtol); // a NaN is a failure
        failures += bad ? 1 : 0;
        if (!std::isnan(max_diff) && (std::isnan(diff) || diff > max_diff)) {
            max_diff = diff;
            max_step = step;
        }
        if (lead && (step % c.log_interval == 0 || step == 1 || step == c.steps || bad)) {
            fmt::print("{:>6} | {:>16.9f} | {:>18.9f} | {:>9.2e}{}\n", step, loss, loss_ref, diff,
                       bad ? "  > tolerance" : "");
            std::fflush(stdout);
        }
    }
    if (lead) {
        fmt::print("{}: max relative difference {:.2e} at step {} over {} steps (tolerance {:.1e}): {}\n", kProgram,
                   max_diff, max_step, c.steps, rtol,
                   failures == 0 ? "the curves agree" : fmt::format("FAILED at {} step(s)", failures));
        std::fflush(stdout);
    }
    return failures == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"shardline char-LM on a dp×tp mesh, checked against a tp-only run of the same global batch"};
    ConfigFlags flags;
    flags.Add(app);
    double rtol = 0.0;
    auto *rtol_flag =
        app.add_option("--rtol", rtol, "tolerance on a step's relative loss difference (default: by dtype)");
    CLI11_PARSE(app, argc, argv);

    return launch::RunMain(&argc, &argv, {}, [&](launch::Environment &env) {
        Config defaults;
        defaults.dp = 2;
        defaults.steps = 40;
        defaults.log_interval = 1;
        return Run(env, flags.Resolve(defaults, kProgram), *rtol_flag ? std::optional<double>(rtol) : std::nullopt);
    });
}
