#pragma once

// The character-level language model of examples/train_char_lm.cc, shared with examples/train_dp_tp.cc: the config
// (JSON file + command-line overrides), the corpus and its batches, the model, and one training step.
//
// Model: the previous `context` characters -> a position-wise embedding summed over positions (a linear layer on the
// one-hot context) -> `layers` residual ParallelMLP blocks (ColumnParallelLinear -> GELU -> RowParallelLinear) -> a
// ColumnParallelLinear head over the vocabulary -> vocab-parallel cross-entropy (the logits stay sharded). Mesh dp×tp:
// the batch is sharded on dp (gradients all-reduced in buckets during backward), the layers on tp.
// With num_experts > 0 (Megatron's --num-experts) every block is an nn::MoEMLP instead of a ParallelMLP, on a
// (dp, ep, tp) mesh: the batch is sharded over dp and ep, the experts over ep (and each over tp), and the loss adds the
// layers' auxiliary losses; GradSync reduces dense gradients over dp and ep, the experts' over dp.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <shardline/autograd/variable.h>
#include <shardline/ckpt/checkpoint.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/init.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/nn/module.h>
#include <shardline/nn/moe.h>
#include <shardline/nn/optim.h>

namespace char_lm {

using shardline::autograd::Variable;

struct Config {
    std::int64_t steps = 300;
    int tp = 0; ///< 0: the world size divided by dp·ep
    int dp = 0; ///< 0: the world size divided by ep·tp (1 when tp is 0 too)
    // Mixture of experts (Megatron's names). num_experts 0: dense ParallelMLP blocks.
    std::int64_t num_experts = 0;
    int moe_router_topk = 2;
    int ep = 1;                        ///< expert_model_parallel_size
    int etp = 0;                       ///< expert_tensor_parallel_size: 0 or tp, or 1 (whole experts)
    double moe_aux_loss_coeff = 0.0;   ///< load-balancing loss coefficient
    double moe_capacity_factor = -1.0; ///< < 0: dropless
    std::int64_t context = 16;
    std::int64_t hidden = 128;
    std::int64_t ffn = 512;
    int layers = 2;
    std::int64_t batch = 64; ///< global: predictions per step
    double lr = 3e-3;
    /// Linear learning-rate warmup over the first steps (Megatron's lr_warmup_iters): lr·min(1, step / warmup_steps).
    std::int64_t warmup_steps = 0;
    double weight_decay = 0.01;
    std::string dtype = "auto"; ///< auto: bf16 on GPU, fp32 on CPU
    std::uint64_t seed = 1234;
    int log_interval = 25;
    int eval_interval = 100;
    int eval_batches = 4;
    std::string data = "/usr/share/common-licenses";
    std::string metrics = "train_char_lm_metrics.jsonl";
    int sample_chars = 200;
    double peak_tflops = 989.0; ///< per GPU, for MFU (H100/H200 dense bf16)
    // Checkpoints (Megatron's names; examples/char_lm_checkpoint.h). --steps stays the total.
    std::string save;               ///< directory to save into ("" = none)
    std::int64_t save_interval = 0; ///< steps between saves (0: only after the last step)
    int save_keep_last = 0;         ///< committed checkpoints kept under `save`, the oldest removed (0: all)
    std::string load;               ///< checkpoint (or directory with `latest`) to resume from
    bool async_save = false;        ///< write on a background thread; the next save or the exit waits
};

/// The JSON config: every key must be known and of the right type (checked before anything starts). Errors name
/// `program`.
void LoadConfig(const std::string& path, Config& c, const char* program);

/// The command-line options shared by the char-LM programs (--config, --steps, --tp, --dp, ...): Add() registers them
/// on the app, Resolve() reads the config file over `defaults` and applies the options given on the command line.
class ConfigFlags {
public:
    void Add(CLI::App& app);
    Config Resolve(Config defaults, const char* program) const;

private:
    std::string config_path_;
    Config cli_;
    CLI::Option* steps_ = nullptr;
    CLI::Option* tp_ = nullptr;
    CLI::Option* dp_ = nullptr;
    CLI::Option* hidden_ = nullptr;
    CLI::Option* ffn_ = nullptr;
    CLI::Option* layers_ = nullptr;
    CLI::Option* context_ = nullptr;
    CLI::Option* batch_ = nullptr;
    CLI::Option* lr_ = nullptr;
    CLI::Option* warmup_ = nullptr;
    CLI::Option* dtype_ = nullptr;
    CLI::Option* seed_ = nullptr;
    CLI::Option* data_ = nullptr;
    CLI::Option* metrics_ = nullptr;
    CLI::Option* log_interval_ = nullptr;
    CLI::Option* eval_interval_ = nullptr;
    CLI::Option* sample_ = nullptr;
    CLI::Option* save_ = nullptr;
    CLI::Option* save_interval_ = nullptr;
    CLI::Option* save_keep_last_ = nullptr;
    CLI::Option* load_ = nullptr;
    CLI::Option* async_save_ = nullptr;
    CLI::Option* num_experts_ = nullptr;
    CLI::Option* topk_ = nullptr;
    CLI::Option* ep_ = nullptr;
    CLI::Option* etp_ = nullptr;
    CLI::Option* aux_coeff_ = nullptr;
    CLI::Option* capacity_ = nullptr;
};

/// Fills dp and tp (0: derived from the world and the others) and checks sizes, the mesh against `world` ranks,
/// divisibility, the MoE options and the dtype's name.
void Validate(Config& c, int world, const char* program);

/// The mesh: (dp, tp), or (dp, ep, tp) for a MoE model.
std::vector<std::int64_t> MeshShape(const Config& c);
std::vector<std::string> MeshDims(const Config& c);
/// The mesh dims that shard the batch: dp, and ep for a MoE model.
std::vector<std::string> DataDims(const Config& c);
/// The ranks over which the batch is sharded (dp·ep).
inline std::int64_t DataRanks(const Config& c) { return static_cast<std::int64_t>(c.dp) * c.ep; }
/// The ranks that split a MoE block's tokens: dp·ep, times tp when the experts are whole (etp 1 below tp).
inline std::int64_t TokenRanks(const Config& c) {
    return DataRanks(c) * (c.num_experts > 0 && c.etp == 1 && c.tp > 1 ? c.tp : 1);
}

/// The compute dtype: `auto` is bf16 on GPUs and fp32 on the CPU; a half dtype on the CPU is an error.
shardline::DType ResolveDType(const Config& c, bool gpu, const char* program);

/// Every regular file under `path` (or the file itself), concatenated in name order.
std::string ReadCorpus(const std::string& path, const char* program);

struct Corpus {
    std::vector<char> vocab;       ///< id -> byte
    std::vector<std::int64_t> ids; ///< the text as ids
    std::int64_t split = 0;        ///< first validation position
};

Corpus Encode(const std::string& text, std::int64_t context, const char* program);

/// The global batch of one step: ids [context, batch] (position-major, shifted by position·vocab so one embedding
/// table holds every position) and labels [batch]. The same on every rank.
struct Batch {
    shardline::Tensor ids;
    shardline::Tensor labels;
};

Batch MakeBatch(const Corpus& corpus, std::int64_t context, std::int64_t batch, std::int64_t vocab, std::uint64_t seed,
                bool validation);

/// The seed of training step `step`'s batch and of validation batch `i`.
inline std::uint64_t TrainBatchSeed(const Config& c, std::int64_t step) {
    return c.seed * 1000003 + static_cast<std::uint64_t>(step);
}
inline std::uint64_t EvalBatchSeed(const Config& c, int i) {
    return c.seed * 7919 + 17 + static_cast<std::uint64_t>(i);
}

class CharLM : public shardline::nn::Module {
public:
    CharLM(const Config& c, std::int64_t vocab, shardline::comm::DeviceMesh& mesh,
           const shardline::nn::ParameterOptions& param);

    /// Logits [batch, vocab] sharded on dp (rows) and tp (vocabulary); ids_full [context, batch] on every rank.
    Variable Forward(const shardline::Tensor& ids_full) const;
    /// The mean vocab-parallel cross-entropy of a global batch (Partial over dp until LossValue reduces it). A MoE
    /// model also keeps the forward's auxiliary loss and routing statistics (aux(), moe_stats()).
    Variable Loss(const Batch& b, shardline::Device device) const;
    bool moe() const { return c_.num_experts > 0; }
    /// The last forward's auxiliary losses summed over the MoE blocks (Partial over dp and ep, as the loss).
    const Variable& aux() const { return aux_; }
    /// The last forward's routing: tokens this rank routed, the least and most loaded expert over all blocks (copies
    /// of this rank's tokens), dropped copies. Reads the blocks' expert loads back from the device (call it where the
    /// step is logged: the blocks themselves keep them on the device and make no host sync at ep 1).
    struct MoELog {
        std::int64_t tokens = 0;
        std::int64_t load_min = 0;
        std::int64_t load_max = 0;
        std::int64_t dropped = 0;
    };
    MoELog moe_stats() const;

    /// The MoE blocks' parameters that are data-parallel over more mesh dims than dp and ep (etp 1 below tp: tp), for
    /// GradSync.
    std::vector<std::pair<Variable, std::vector<std::string>>> ExtraDataParallelDims() const;

    /// Multiply-adds of the matmuls per prediction (for TFLOP/s): blocks and head.
    double FlopsPerPrediction() const;

private:
    Config c_;
    std::int64_t vocab_;
    shardline::comm::DeviceMesh& mesh_;
    Variable embedding_;
    std::vector<std::shared_ptr<shardline::nn::ParallelMLP>> blocks_;
    std::vector<std::shared_ptr<shardline::nn::MoEMLP>> moe_blocks_;
    mutable Variable aux_;
    mutable std::vector<shardline::nn::MoEStats> stats_; ///< the last forward's, one per MoE block
    std::shared_ptr<shardline::nn::ColumnParallelLinear> head_;
};

/// The mean loss as a host number (reduces the Partial over dp). A collective: every rank of the mesh takes part.
double LossValue(const Variable& loss);

/// A CharLM with its optimizer (AdamW) and, when the batch is split over more than one rank, the GradSync that
/// all-reduces its gradients over dp (and ep: a MoE model's dense parameters) in buckets during backward.
class Trainer {
public:
    Trainer(const Config& c, std::int64_t vocab, shardline::comm::DeviceMesh& mesh,
            const shardline::nn::ParameterOptions& param);

    /// One step on the global batch `b`: zero the gradients, forward, backward of the loss plus the MoE auxiliary
    /// losses (buckets launched as they complete), finish the dp reduction, AdamW (at the warmed-up learning rate).
    /// Returns the cross-entropy (as CharLM::Loss).
    Variable Step(const Batch& b, shardline::Device device);

    const CharLM& model() const { return model_; }
    /// Parameters of the global model.
    std::int64_t numel() const;

    /// A checkpoint's tensors: the parameters and AdamW's moments, aliasing the live ones (a load writes into them).
    shardline::ckpt::TensorList CheckpointTensors();
    /// The rest of the training state: steps taken and the optimizer's scalars.
    nlohmann::json CheckpointState();
    /// Restores CheckpointState() (after the tensors were loaded).
    void RestoreState(const nlohmann::json& state);

private:
    CharLM model_;
    std::vector<Variable> params_;
    std::unique_ptr<shardline::nn::GradSync> sync_;
    shardline::nn::AdamW optimizer_;
    double lr_ = 0.0;
    std::int64_t warmup_steps_ = 0;
    std::int64_t step_ = 0;
};

/// The steps a progress line timed. A window opens after the last logged step (or an evaluation, which is not
/// timed) and counts every step taken since, so the ms/step it reports is right whatever the log and evaluation
/// intervals are: after step 1, after an evaluation, at the last step.
class StepWindow {
public:
    using Clock = std::chrono::steady_clock;

    /// Opens the window before step `next_step`, at `now`.
    void Open(std::int64_t next_step, Clock::time_point now) {
        first_step_ = next_step;
        start_ = now;
        host_ = Clock::duration::zero();
    }
    /// Adds the host time one step took to make its batch and queue its work (no synchronisation inside): when the
    /// window's host ms/step comes near its ms/step, the GPU waits for the host.
    void AddHostTime(Clock::duration host) { host_ += host; }
    double HostMsPerStep(std::int64_t step) const {
        return std::chrono::duration<double, std::milli>(host_).count() / static_cast<double>(Steps(step));
    }
    /// The steps from the window's opening to `step` (inclusive).
    std::int64_t Steps(std::int64_t step) const { return step - first_step_ + 1; }
    /// Milliseconds per step of the window that ends after `step`, at `now`.
    double MsPerStep(std::int64_t step, Clock::time_point now) const {
        return std::chrono::duration<double, std::milli>(now - start_).count() / static_cast<double>(Steps(step));
    }

private:
    std::int64_t first_step_ = 1;
    Clock::time_point start_ = Clock::now();
    Clock::duration host_ = Clock::duration::zero();
};

} // namespace char_lm
