#include "char_lm.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/nn/checkpoint.h>

namespace char_lm {

using namespace shardline;
using dist::DistTensor;
using nlohmann::json;

void LoadConfig(const std::string &path, Config &c, const char *program) {
    std::ifstream in(path);
    SHARDLINE_CHECK(in.good(), program, "cannot read the config file '{}'", path);
    json j;
    try {
        in >> j;
    } catch (const json::exception &e) {
        SHARDLINE_THROW(Error, program, "config '{}' is not valid JSON: {}", path, e.what());
    }
    SHARDLINE_CHECK(j.is_object(), program, "config '{}' must be a JSON object", path);
    for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string &k = it.key();
        const json &v = it.value();
        auto integer = [&](auto &field) {
            SHARDLINE_CHECK(v.is_number_integer(), program, "config key '{}' must be an integer, got {}", k, v.dump());
            field = v.get<std::remove_reference_t<decltype(field)>>();
        };
        auto number = [&](double &field) {
            SHARDLINE_CHECK(v.is_number(), program, "config key '{}' must be a number, got {}", k, v.dump());
            field = v.get<double>();
        };
        auto text = [&](std::string &field) {
            SHARDLINE_CHECK(v.is_string(), program, "config key '{}' must be a string, got {}", k, v.dump());
            field = v.get<std::string>();
        };
        if (k == "steps") {
            integer(c.steps);
        } else if (k == "tp") {
            integer(c.tp);
        } else if (k == "dp") {
            integer(c.dp);
        } else if (k == "context") {
            integer(c.context);
        } else if (k == "hidden") {
            integer(c.hidden);
        } else if (k == "ffn") {
            integer(c.ffn);
        } else if (k == "layers") {
            integer(c.layers);
        } else if (k == "batch") {
            integer(c.batch);
        } else if (k == "lr") {
            number(c.lr);
        } else if (k == "warmup_steps") {
            integer(c.warmup_steps);
        } else if (k == "weight_decay") {
            number(c.weight_decay);
        } else if (k == "dtype") {
            text(c.dtype);
        } else if (k == "seed") {
            integer(c.seed);
        } else if (k == "log_interval") {
            integer(c.log_interval);
        } else if (k == "eval_interval") {
            integer(c.eval_interval);
        } else if (k == "eval_batches") {
            integer(c.eval_batches);
        } else if (k == "data") {
            text(c.data);
        } else if (k == "metrics") {
            text(c.metrics);
        } else if (k == "sample_chars") {
            integer(c.sample_chars);
        } else if (k == "peak_tflops") {
            number(c.peak_tflops);
        } else if (k == "save") {
            text(c.save);
        } else if (k == "save_interval") {
            integer(c.save_interval);
        } else if (k == "save_keep_last") {
            integer(c.save_keep_last);
        } else if (k == "load") {
            text(c.load);
        } else if (k == "num_experts") {
            integer(c.num_experts);
        } else if (k == "moe_router_topk") {
            integer(c.moe_router_topk);
        } else if (k == "ep") {
            integer(c.ep);
        } else if (k == "etp") {
            integer(c.etp);
        } else if (k == "moe_aux_loss_coeff") {
            number(c.moe_aux_loss_coeff);
        } else if (k == "moe_capacity_factor") {
            number(c.moe_capacity_factor);
        } else if (k == "async_save") {
            SHARDLINE_CHECK(v.is_boolean(), program, "config key '{}' must be true or false, got {}", k, v.dump());
            c.async_save = v.get<bool>();
        } else {
            SHARDLINE_THROW(
                Error, program,
                "unknown config key '{}' in '{}' (known: steps, tp, dp, context, hidden, ffn, layers, "
                "batch, lr, warmup_steps, weight_decay, dtype, seed, log_interval, eval_interval, "
                "eval_batches, data, metrics, sample_chars, peak_tflops, save, save_interval, save_keep_last, load, "
                "async_save, "
                "num_experts, moe_router_topk, ep, etp, moe_aux_loss_coeff, moe_capacity_factor)",
                k, path);
        }
    }
}

void ConfigFlags::Add(CLI::App &app) {
    app.add_option("--config", config_path_, "JSON config file (keys as the options below)");
    steps_ = app.add_option("--steps", cli_.steps, "training steps");
    tp_ = app.add_option("--tp", cli_.tp, "tensor-parallel size (default: ranks / (dp·ep))");
    dp_ = app.add_option("--dp", cli_.dp, "data-parallel size (default: ranks / (ep·tp), 1 without --tp)");
    num_experts_ = app.add_option("--num-experts", cli_.num_experts,
                                  "experts per MoE block (0: dense ParallelMLP blocks; Megatron's --num-experts)");
    topk_ = app.add_option("--moe-router-topk", cli_.moe_router_topk, "experts per token (default 2)");
    ep_ = app.add_option("--ep", cli_.ep, "expert-parallel size: the experts split over it, the batch over dp·ep");
    etp_ = app.add_option(
        "--etp", cli_.etp,
        "expert tensor-parallel size: tp (the default: each expert split over the tp dim) or 1 (whole experts, the "
        "tp ranks split the tokens)");
    aux_coeff_ = app.add_option("--moe-aux-loss-coeff", cli_.moe_aux_loss_coeff, "load-balancing loss coefficient");
    capacity_ = app.add_option("--moe-capacity-factor", cli_.moe_capacity_factor,
                               "expert capacity factor (tokens beyond it are dropped; default: dropless)");
    hidden_ = app.add_option("--hidden", cli_.hidden, "hidden size");
    ffn_ = app.add_option("--ffn", cli_.ffn, "MLP inner size (divisible by tp)");
    layers_ = app.add_option("--layers", cli_.layers, "ParallelMLP blocks");
    context_ = app.add_option("--context", cli_.context, "characters of context");
    batch_ = app.add_option("--batch", cli_.batch, "global batch (predictions per step)");
    lr_ = app.add_option("--lr", cli_.lr, "AdamW learning rate");
    warmup_ = app.add_option("--warmup", cli_.warmup_steps, "steps of linear learning-rate warmup");
    dtype_ = app.add_option("--dtype", cli_.dtype, "auto, fp32, bf16, fp16");
    seed_ = app.add_option("--seed", cli_.seed, "seed of the weights and the batches");
    data_ = app.add_option("--data", cli_.data, "a text file or a directory of text files");
    metrics_ = app.add_option("--metrics", cli_.metrics, "JSON-lines metrics file (rank 0)");
    log_interval_ = app.add_option("--log-interval", cli_.log_interval, "steps between progress lines");
    eval_interval_ = app.add_option("--eval-interval", cli_.eval_interval, "steps between validation losses");
    sample_ = app.add_option("--sample-chars", cli_.sample_chars, "characters to sample at the end");
    save_ = app.add_option("--save", cli_.save, "directory to save checkpoints into (Megatron's --save)");
    save_interval_ = app.add_option("--save-interval", cli_.save_interval,
                                    "steps between checkpoints (0: only after the last step)");
    save_keep_last_ = app.add_option("--save-keep-last", cli_.save_keep_last,
                                     "committed checkpoints to keep under --save, the oldest removed (0: all)");
    load_ = app.add_option("--load", cli_.load,
                           "checkpoint to resume from, on any rank count / --tp / --dp (--steps stays the total)");
    async_save_ = app.add_flag("--async-save", cli_.async_save, "write checkpoints on a background thread");
}

Config ConfigFlags::Resolve(Config c, const char *program) const {
    if (!config_path_.empty()) {
        LoadConfig(config_path_, c, program);
    }
    // Command-line values override the file.
    if (*steps_) {
        c.steps = cli_.steps;
    }
    if (*tp_) {
        c.tp = cli_.tp;
    }
    if (*dp_) {
        c.dp = cli_.dp;
    }
    if (*hidden_) {
        c.hidden = cli_.hidden;
    }
    if (*ffn_) {
        c.ffn = cli_.ffn;
    }
    if (*layers_) {
        c.layers = cli_.layers;
    }
    if (*context_) {
        c.context = cli_.context;
    }
    if (*batch_) {
        c.batch = cli_.batch;
    }
    if (*lr_) {
        c.lr = cli_.lr;
    }
    if (*warmup_) {
        c.warmup_steps = cli_.warmup_steps;
    }
    if (*dtype_) {
        c.dtype = cli_.dtype;
    }
    if (*seed_) {
        c.seed = cli_.seed;
    }
    if (*data_) {
        c.data = cli_.data;
    }
    if (*metrics_) {
        c.metrics = cli_.metrics;
    }
    if (*log_interval_) {
        c.log_interval = cli_.log_interval;
    }
    if (*eval_interval_) {
        c.eval_interval = cli_.eval_interval;
    }
    if (*sample_) {
        c.sample_chars = cli_.sample_chars;
    }
    if (*save_) {
        c.save = cli_.save;
    }
    if (*save_interval_) {
        c.save_interval = cli_.save_interval;
    }
    if (*save_keep_last_) {
        c.save_keep_last = cli_.save_keep_last;
    }
    if (*load_) {
        c.load = cli_.load;
    }
    if (*async_save_) {
        c.async_save = cli_.async_save;
    }
    if (*num_experts_) {
        c.num_experts = cli_.num_experts;
    }
    if (*topk_) {
        c.moe_router_topk = cli_.moe_router_topk;
    }
    if (*ep_) {
        c.ep = cli_.ep;
    }
    if (*etp_) {
        c.etp = cli_.etp;
    }
    if (*aux_coeff_) {
        c.moe_aux_loss_coeff = cli_.moe_aux_loss_coeff;
    }
    if (*capacity_) {
        c.moe_capacity_factor = cli_.moe_capacity_factor;
    }
    return c;
}

void Validate(Config &c, int world, const char *program) {
    SHARDLINE_CHECK(c.ep >= 1 && c.num_experts >= 0, program, "ep ({}) must be >= 1 and num_experts ({}) >= 0", c.ep,
                    c.num_experts);
    SHARDLINE_CHECK(c.num_experts > 0 || c.ep == 1, program,
                    "ep ({}) needs a MoE model: --num-experts (expert parallelism splits the experts)", c.ep);
    if (c.dp == 0) {
        c.dp = c.tp == 0 ? 1 : std::max(1, world / std::max(1, c.ep * c.tp));
    }
    if (c.tp == 0) {
        c.tp = std::max(1, world / std::max(1, c.dp * c.ep));
    }
    SHARDLINE_CHECK(c.steps >= 0 && c.context > 0 && c.hidden > 0 && c.ffn > 0 && c.layers >= 0 && c.batch > 0, program,
                    "steps >= 0 and context, hidden, ffn, batch > 0, layers >= 0 are required, got steps {} "
                    "context {} hidden {} ffn {} batch {} layers {}",
                    c.steps, c.context, c.hidden, c.ffn, c.batch, c.layers);
    SHARDLINE_CHECK(c.dp >= 1 && c.tp >= 1 && c.dp * c.ep * c.tp == world, program,
                    "dp ({}) x ep ({}) x tp ({}) must equal the number of ranks ({})", c.dp, c.ep, c.tp, world);
    if (c.num_experts > 0) {
        SHARDLINE_CHECK(c.moe_router_topk >= 1 && c.moe_router_topk <= c.num_experts, program,
                        "moe_router_topk ({}) must be in [1, num_experts] = [1, {}]", c.moe_router_topk, c.num_experts);
        SHARDLINE_CHECK(c.layers >= 1, program, "a MoE model (num_experts {}) needs layers >= 1", c.num_experts);
        SHARDLINE_CHECK(c.num_experts % c.ep == 0, program, "num_experts ({}) must be divisible by ep ({})",
                        c.num_experts, c.ep);
        SHARDLINE_CHECK(c.etp == 0 || c.etp == 1 || c.etp == c.tp, program,
                        "etp ({}) must be 1 or tp ({}) (supported: {{1, {}}}): the experts are tensor-parallel over "
                        "the whole tp dim, or whole on every tp rank with the tp ranks splitting the tokens",
                        c.etp, c.tp, c.tp);
        // etp 1 below tp: each MoE block splits its dp·ep shard of the batch over tp as well.
        SHARDLINE_CHECK(c.batch % TokenRanks(c) == 0, program,
                        "batch ({}) must be divisible by dp·ep·tp ({}) with etp 1 below tp (the tp ranks split the "
                        "tokens of the MoE blocks)",
                        c.batch, TokenRanks(c));
    }
    SHARDLINE_CHECK(c.ffn % c.tp == 0, program, "ffn ({}) must be divisible by tp ({})", c.ffn, c.tp);
    SHARDLINE_CHECK(c.warmup_steps >= 0, program, "warmup_steps must be >= 0, got {}", c.warmup_steps);
    SHARDLINE_CHECK(c.lr > 0 && c.log_interval > 0 && c.eval_interval > 0 && c.eval_batches > 0, program,
                    "lr, log_interval, eval_interval and eval_batches must be positive");
    SHARDLINE_CHECK(c.dtype == "auto" || c.dtype == "fp32" || c.dtype == "float32" || c.dtype == "bf16" ||
                        c.dtype == "bfloat16" || c.dtype == "fp16" || c.dtype == "float16",
                    program, "dtype must be auto, fp32, bf16 or fp16, got '{}'", c.dtype);
    SHARDLINE_CHECK(c.batch % DataRanks(c) == 0, program, "batch ({}) must be divisible by dp·ep ({})", c.batch,
                    DataRanks(c));
}

std::vector<std::int64_t> MeshShape(const Config &c) {
    if (c.num_experts > 0) {
        return {c.dp, c.ep, c.tp};
    }
    return {c.dp, c.tp};
}
std::vector<std::string> MeshDims(const Config &c) {
    if (c.num_experts > 0) {
        return {"dp", "ep", "tp"};
    }
    return {"dp", "tp"};
}
std::vector<std::string> DataDims(const Config &c) {
    if (c.num_experts > 0) {
        return {"dp", "ep"};
    }
    return {"dp"};
}

DType ResolveDType(const Config &c, bool gpu, const char *program) {
    const DType dtype = c.dtype == "auto" ? (gpu ? DType::kBFloat16 : DType::kFloat32) : ParseDType(c.dtype);
    SHARDLINE_CHECK(gpu || !IsHalf(dtype), program, "dtype {} needs GPUs; this run is on the CPU", DTypeName(dtype));
    return dtype;
}

std::string ReadCorpus(const std::string &path, const char *program) {
    namespace fs = std::filesystem;
    std::vector<fs::path> files;
    SHARDLINE_CHECK(fs::exists(path), program, "the data path '{}' does not exist", path);
    if (fs::is_directory(path)) {
        for (const auto &e : fs::directory_iterator(path)) {
            if (fs::is_regular_file(e.path())) {
                files.push_back(e.path());
            }
        }
        std::sort(files.begin(), files.end());
    } else {
        files.emplace_back(path);
    }
    std::string text;
    for (const auto &f : files) {
        std::ifstream in(f, std::ios::binary);
        std::ostringstream s;
        s << in.rdbuf();
        text += s.str();
    }
    return text;
}

Corpus Encode(const std::string &text, std::int64_t context, const char *program) {
    Corpus c;
    std::set<unsigned char> chars(text.begin(), text.end());
    std::map<unsigned char, std::int64_t> index;
    for (unsigned char ch : chars) {
        index[ch] = static_cast<std::int64_t>(c.vocab.size());
        c.vocab.push_back(static_cast<char>(ch));
    }
    c.ids.reserve(text.size());
    for (unsigned char ch : text) {
        c.ids.push_back(index[ch]);
    }
    c.split = static_cast<std::int64_t>(static_cast<double>(c.ids.size()) * 0.9);
    SHARDLINE_CHECK(c.split > context + 1 && static_cast<std::int64_t>(c.ids.size()) - c.split > context + 1, program,
                    "the corpus ({} characters) is too short for a context of {}", c.ids.size(), context);
    return c;
}

Batch MakeBatch(const Corpus &corpus, std::int64_t context, std::int64_t batch, std::int64_t vocab_padded,
                std::uint64_t seed, bool validation) {
    std::mt19937_64 rng(seed);
    const std::int64_t lo = validation ? corpus.split : 0;
    const std::int64_t hi = (validation ? static_cast<std::int64_t>(corpus.ids.size()) : corpus.split) - context - 1;
    std::uniform_int_distribution<std::int64_t> pick(lo, hi);
    // Written as int64 in place: the host makes the next batch while the GPU runs the step before.
    Tensor ids = Tensor::Empty({context, batch}, DType::kInt64);
    Tensor labels = Tensor::Empty({batch}, DType::kInt64);
    auto *id = static_cast<std::int64_t *>(ids.data());
    auto *label = static_cast<std::int64_t *>(labels.data());
    for (std::int64_t b = 0; b < batch; ++b) {
        const std::int64_t start = pick(rng);
        for (std::int64_t t = 0; t < context; ++t) {
            id[t * batch + b] = t * vocab_padded + corpus.ids[static_cast<std::size_t>(start + t)];
        }
        label[b] = corpus.ids[static_cast<std::size_t>(start + context)];
    }
    return {std::move(ids), std::move(labels)};
}

CharLM::CharLM(const Config &c, std::int64_t vocab_padded, comm::DeviceMesh &mesh, const nn::ParameterOptions &param)
    : c_(c), vocab_(vocab_padded), mesh_(mesh) {
    const nn::TensorParallelGroup tp = nn::TensorParallelGroup::Named(mesh, "tp");
    // The embedding table is small and replicated; its gradient arrives replicated over tp.
    embedding_ = RegisterParameter(
        "embedding", nn::MakeParameter({c.context * vocab_padded, c.hidden}, spmd::Layout::Replicated(2), &mesh, param,
                                       {.seed = 0,
                                        .name = "embedding",
                                        .distribution = RandomDistribution::kNormal,
                                        .a = 0.0,
                                        .b = 1.0 / std::sqrt(static_cast<double>(c.context))}));
    for (int l = 0; l < c.layers; ++l) {
        nn::ParameterOptions block_param = param;
        block_param.name = fmt::format("block{}", l);
        if (c.num_experts > 0) {
            moe_blocks_.push_back(
                RegisterModule(block_param.name,
                               std::make_shared<nn::MoEMLP>(nn::MoEMLPOptions{.hidden = c.hidden,
                                                                              .ffn = c.ffn,
                                                                              .num_experts = c.num_experts,
                                                                              .topk = c.moe_router_topk,
                                                                              .ep = c.ep,
                                                                              .etp = c.etp,
                                                                              .capacity_factor = c.moe_capacity_factor,
                                                                              .aux_loss_coeff = c.moe_aux_loss_coeff},
                                                            mesh, block_param)));
            continue;
        }
        blocks_.push_back(
            RegisterModule(block_param.name,
                           std::make_shared<nn::ParallelMLP>(
                               nn::ParallelMLPOptions{
                                   .hidden = c.hidden, .ffn_hidden = c.ffn, .bias = true, .sequence_parallel = false},
                               tp, block_param)));
    }
    nn::ParameterOptions head_param = param;
    head_param.name = "head";
    head_ = RegisterModule("head", std::make_shared<nn::ColumnParallelLinear>(
                                       nn::ColumnParallelLinearOptions{
                                           .in_features = c.hidden, .out_features = vocab_padded, .bias = true},
                                       tp, head_param));
}

Variable CharLM::Forward(const Tensor &ids_full) const {
    // ids [context, batch]: the batch is split over dp.
    const DistTensor ids = DistTensor::Sharded(ids_full, mesh_, {{.dim = 1, .over = DataDims(c_)}});
    // Σ over the context of the positions' embeddings, fused: no [context, batch, hidden] lookup in the forward or the
    // backward (torch.nn.EmbeddingBag, mode sum).
    Variable x = autograd::EmbeddingBag(Variable(ids), embedding_); // [batch, hidden]
    for (const auto &block : blocks_) {
        // x + block(x), the add fused into the block's GEMMs (fc2 adds x, fc1's dgrad adds x's pass-through grad).
        x = block->ResidualForward(x);
    }
    // MoE blocks: the layers' auxiliary losses are summed for the loss, their routing statistics for the log.
    aux_ = Variable();
    stats_.clear();
    for (const auto &block : moe_blocks_) {
        nn::MoEOutput out = block->Forward(x);
        x = autograd::Add(x, out.output);
        aux_ = aux_.defined() ? autograd::Add(aux_, out.aux_loss) : out.aux_loss;
        stats_.push_back(std::move(out.stats));
    }
    return head_->Forward(x).output;
}

CharLM::MoELog CharLM::moe_stats() const {
    MoELog log;
    for (std::size_t i = 0; i < stats_.size(); ++i) {
        const nn::MoEStats &s = stats_[i];
        const std::int64_t lo = s.load_min(), hi = s.load_max();
        log.tokens = s.tokens;
        log.load_min = i == 0 ? lo : std::min(log.load_min, lo);
        log.load_max = std::max(log.load_max, hi);
        log.dropped += s.dropped;
    }
    return log;
}

Variable CharLM::Loss(const Batch &b, Device device) const {
    const Variable logits = Forward(b.ids.To(device));
    const Variable labels(DistTensor::Sharded(b.labels.To(device), mesh_, {{.dim = 0, .over = DataDims(c_)}}));
    return autograd::CrossEntropy(logits, labels, {.vocab_parallel = true});
}

std::vector<std::pair<Variable, std::vector<std::string>>> CharLM::ExtraDataParallelDims() const {
    std::vector<std::pair<Variable, std::vector<std::string>>> dims;
    for (const auto &block : moe_blocks_) {
        for (auto &d : block->ExtraDataParallelDims()) {
            dims.push_back(std::move(d));
        }
    }
    return dims;
}

double CharLM::FlopsPerPrediction() const {
    // A MoE block runs topk experts per token and the gate.
    const double block = c_.num_experts > 0 ? 2.0 * static_cast<double>(c_.hidden * c_.ffn * c_.moe_router_topk) +
                                                  static_cast<double>(c_.hidden * c_.num_experts)
                                            : 2.0 * static_cast<double>(c_.hidden * c_.ffn);
    return 2.0 * (static_cast<double>(c_.layers) * block + static_cast<double>(c_.hidden * vocab_));
}

double LossValue(const Variable &loss) { return loss.value().FullTensor().ToDoubleVector().at(0); }

Trainer::Trainer(const Config &c, std::int64_t vocab_padded, comm::DeviceMesh &mesh, const nn::ParameterOptions &param)
    : model_(c, vocab_padded, mesh, param), params_(model_.Parameters()),
      // etp 1 below tp: the MoE blocks' parameters reduce over tp as well (their tp ranks split the tokens).
      sync_(TokenRanks(c) > 1
                ? std::make_unique<nn::GradSync>(params_, mesh,
                                                 nn::GradSyncOptions{.dp_dim = "dp",
                                                                     .dp_dims = DataDims(c),
                                                                     .extra_dp_dims = model_.ExtraDataParallelDims()})
                : nullptr),
      optimizer_(params_, {.lr = c.lr, .weight_decay = c.weight_decay}), lr_(c.lr), warmup_steps_(c.warmup_steps) {}

Variable Trainer::Step(const Batch &b, Device device) {
    if (sync_) {
        sync_->ZeroGrad();
    } else {
        optimizer_.ZeroGrad();
    }
    Variable loss = model_.Loss(b, device);
    // The auxiliary losses are float32 (the router's); a half-precision model's loss takes them in its dtype.
    (model_.moe() ? autograd::Add(loss, autograd::Cast(model_.aux(), loss.dtype())) : loss).Backward();
    if (sync_) {
        sync_->Finish();
    }
    ++step_;
    optimizer_.set_lr(warmup_steps_ > 0 && step_ < warmup_steps_
                          ? lr_ * static_cast<double>(step_) / static_cast<double>(warmup_steps_)
                          : lr_);
    optimizer_.Step();
    return loss;
}

ckpt::TensorList Trainer::CheckpointTensors() { return nn::TrainingTensors(params_, &optimizer_); }

nlohmann::json Trainer::CheckpointState() {
    return {{"steps", step_}, {"optimizer", nn::OptimizerScalars(optimizer_)}};
}

void Trainer::RestoreState(const nlohmann::json &state) {
    SHARDLINE_CHECK(state.contains("steps") && state.contains("optimizer"), "Trainer::RestoreState",
                    "a state with \"steps\" and \"optimizer\" expected, got {}", state.dump());
    step_ = state.at("steps").get<std::int64_t>();
    nn::LoadOptimizerScalars(optimizer_, state.at("optimizer"));
}

std::int64_t Trainer::numel() const {
    std::int64_t n = 0;
    for (const auto &p : params_) {
        n += Numel(p.shape());
    }
    return n;
}

} // namespace char_lm
