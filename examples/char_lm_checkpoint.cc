#include "char_lm_checkpoint.h"

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>

namespace char_lm {

using namespace shardline;

nlohmann::json ConfigJson(const Config &c) {
    return {{"steps", c.steps},
            {"tp", c.tp},
            {"dp", c.dp},
            {"context", c.context},
            {"hidden", c.hidden},
            {"ffn", c.ffn},
            {"layers", c.layers},
            {"batch", c.batch},
            {"lr", c.lr},
            {"warmup_steps", c.warmup_steps},
            {"weight_decay", c.weight_decay},
            {"dtype", c.dtype},
            {"seed", c.seed},
            {"data", c.data},
            {"num_experts", c.num_experts},
            {"moe_router_topk", c.moe_router_topk},
            {"ep", c.ep},
            {"etp", c.etp},
            {"moe_aux_loss_coeff", c.moe_aux_loss_coeff},
            {"moe_capacity_factor", c.moe_capacity_factor}};
}

namespace {

/// "dp 2 x tp 2", or "dp 1 x ep 2 x tp 2" for a MoE model (a config without "num_experts" is dense).
std::string MeshText(std::int64_t dp, std::int64_t ep, std::int64_t tp, bool moe) {
    return moe ? fmt::format("dp {} x ep {} x tp {}", dp, ep, tp) : fmt::format("dp {} x tp {}", dp, tp);
}

} // namespace

Checkpointer::Checkpointer(const Config &c, comm::Communicator &world, const char *program)
    : c_(c), world_(world), program_(program) {
    SHARDLINE_CHECK(c.save_interval >= 0, program, "--save-interval must be >= 0, got {}", c.save_interval);
    SHARDLINE_CHECK(c.save_keep_last >= 0, program, "--save-keep-last must be >= 0 (0 keeps all), got {}",
                    c.save_keep_last);
    if (c.async_save && !c.save.empty()) {
        ckpt::SaveOptions options;
        options.keep_last = c.save_keep_last;
        async_ = std::make_unique<ckpt::AsyncSaver>(&world, std::move(options));
    }
}

Checkpointer::~Checkpointer() = default;

std::int64_t Checkpointer::Load(Trainer &trainer, bool lead) {
    if (c_.load.empty()) {
        return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    const ckpt::CheckpointInfo info = ckpt::Load(c_.load, trainer.CheckpointTensors(), &world_);
    const nlohmann::json &extra = info.extra;
    SHARDLINE_CHECK(extra.contains("trainer") && extra.contains("config"), program_,
                    "'{}' is not a char-LM checkpoint (no \"trainer\" and \"config\" in its extra JSON)", info.path);
    const std::uint64_t seed = extra.at("config").at("seed").get<std::uint64_t>();
    SHARDLINE_CHECK(seed == c_.seed, program_,
                    "'{}' was trained with seed {}, this run has seed {}: the batches after the resume would differ "
                    "(pass --seed {})",
                    info.path, seed, c_.seed, seed);
    trainer.RestoreState(extra.at("trainer"));
    if (lead) {
        const nlohmann::json &saved = extra.at("config");
        const bool moe = saved.value("num_experts", 0) > 0 || c_.num_experts > 0;
        fmt::print("{}: loaded '{}' (step {}, saved on {}) onto {} in {:.2f} s\n", program_, info.path, info.step,
                   MeshText(saved.value("dp", 0), saved.value("ep", 1), saved.value("tp", 0), moe),
                   MeshText(c_.dp, c_.ep, c_.tp, moe),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        std::fflush(stdout);
    }
    return info.step;
}

void Checkpointer::MaybeSave(Trainer &trainer, std::int64_t step, bool lead) {
    if (c_.save.empty() || !((c_.save_interval > 0 && step % c_.save_interval == 0) || step == c_.steps)) {
        return;
    }
    const auto start = std::chrono::steady_clock::now();
    const nlohmann::json extra = {{"step", step},
                                  {"trainer", trainer.CheckpointState()},
                                  {"data", {{"next_step", step + 1}, {"consumed_samples", step * c_.batch}}},
                                  {"rng", {{"seed", c_.seed}, {"batches", "a pure function of (seed, step)"}}},
                                  {"config", ConfigJson(c_)}};
    // Test hook (tests/dist/scripts/char_lm_checkpoint_test.py crash): the process dies between the writes and the
    // commit of this step's save, as a killed job would.
    ckpt::SaveOptions options;
    options.keep_last = c_.save_keep_last;
    if (env::GetInt("SHARDLINE_TEST_CRASH_BEFORE_COMMIT_STEP", -1, -1, INT64_MAX) == step) {
        options.before_commit = [] { std::_Exit(9); };
    }
    if (async_) {
        async_->Save(c_.save, step, trainer.CheckpointTensors(), extra);
    } else {
        ckpt::Save(c_.save, step, trainer.CheckpointTensors(), extra, &world_, options);
    }
    if (lead) {
        fmt::print("{}: {} checkpoint of step {} to '{}' ({:.3f} s{})\n", program_,
                   async_ ? "started the" : "saved the", step, c_.save,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                   async_ ? fmt::format(", host copy {:.3f} s", async_->last_snapshot_seconds()) : std::string());
        std::fflush(stdout);
    }
}

void Checkpointer::Finish(bool lead) {
    if (async_ && async_->pending()) {
        const ckpt::CheckpointInfo info = async_->Wait();
        if (lead) {
            fmt::print("{}: committed the checkpoint of step {} to '{}'\n", program_, info.step, info.path);
            std::fflush(stdout);
        }
    }
}

} // namespace char_lm
