#pragma once

// Checkpoints of the char-LM programs, with Megatron's flags: --load DIR resumes on any rank count and --tp/--dp
// (ckpt::Load reshards), --save DIR writes after every --save-interval steps and after the last one, --async-save
// writes on a background thread, --save-keep-last K keeps the newest K committed checkpoints. --steps stays the total
// (Megatron's train-iters): a run loaded from step 20 with --steps 40 trains steps 21..40. The batches are a pure
// function of (seed, step), so the data position and the RNG state are the step and the seed, both saved with the
// config.

#include <cstdint>
#include <memory>

#include <nlohmann/json.hpp>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/comm/communicator.h>

#include "char_lm.h"

namespace char_lm {

/// The config as JSON (the keys of the config file).
nlohmann::json ConfigJson(const Config& c);

class Checkpointer {
public:
    Checkpointer(const Config& c, shardline::comm::Communicator& world, const char* program);
    ~Checkpointer();
    /// Restores `trainer` from --load; returns the step it was saved after (0 without --load). Collective.
    std::int64_t Load(Trainer& trainer, bool lead);
    /// After step `step`: saves when --save is set and the step is a multiple of --save-interval or the last one.
    /// Collective.
    void MaybeSave(Trainer& trainer, std::int64_t step, bool lead);
    /// Waits for and commits a pending async save. Collective.
    void Finish(bool lead);

private:
    Config c_;
    shardline::comm::Communicator& world_;
    const char* program_;
    std::unique_ptr<shardline::ckpt::AsyncSaver> async_;
};

} // namespace char_lm
