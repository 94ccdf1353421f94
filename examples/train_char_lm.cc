// train_char_lm: a character-level language model built from shardline's layers, trained with AdamW on the English
// texts in /usr/share/common-licenses (or --data). The README's main job.
//
//   shardline-run -n 2 build/examples/train_char_lm [--config examples/configs/char_lm_cpu.json] [--steps N] ...
//
// Model: the previous `context` characters -> a position-wise embedding summed over positions (a linear layer on
// the one-hot context) -> `layers` residual ParallelMLP blocks (ColumnParallelLinear -> GELU -> RowParallelLinear)
// -> a ColumnParallelLinear head over the vocabulary -> vocab-parallel cross-entropy (the logits stay sharded).
// Mesh dp×tp from the config: the batch is sharded on dp (gradients all-reduced in buckets during backward), the
// layers on tp. NCCL on GPUs when present, MPI on the CPU otherwise.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/init.h>
#include <shardline/nn/mlp.h>
#include <shardline/nn/optim.h>

namespace {

using namespace shardline;
using autograd::Variable;
using dist::DistTensor;
using nlohmann::json;

constexpr const char *kProgram = "train_char_lm";

struct Config {
    std::int64_t steps = 300;
    int tp = 0; ///< 0: the world size divided by dp
    int dp = 1;
    std::int64_t context = 16;
    std::int64_t hidden = 128;
    std::int64_t ffn = 512;
    int layers = 2;
    std::int64_t batch = 64; ///< global: predictions per step
    double lr = 3e-3;
    double weight_decay = 0.01;
    std::string dtype = "auto";  ///< auto: bf16 on GPU, fp32 on CPU
    std::uint64_t seed = 1234;
    int log_interval = 25;
    int eval_interval = 100;
    int eval_batches = 4;
    std::string data = "/usr/share/common-licenses";
    std::string metrics = "train_char_lm_metrics.jsonl";
    int sample_chars = 200;
    double peak_tflops = 989.0; ///< per GPU, for MFU (H100/H200 dense bf16)
};

/// The JSON config: every key must be known and of the right type (checked before anything starts).
void LoadConfig(const std::string &path, Config &c) {
    std::ifstream in(path);
    SHARDLINE_CHECK(in.good(), kProgram, "cannot read the config file '{}'", path);
    json j;
    try {
        in >> j;
    } catch (const json::exception &e) {
        SHARDLINE_THROW(Error, kProgram, "config '{}' is not valid JSON: {}", path, e.what());
    }
    SHARDLINE_CHECK(j.is_object(), kProgram, "config '{}' must be a JSON object", path);
    for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string &k = it.key();
        const json &v = it.value();
        auto integer = [&](auto &field) {
            SHARDLINE_CHECK(v.is_number_integer(), kProgram, "config key '{}' must be an integer, got {}", k, v.dump());
            field = v.get<std::remove_reference_t<decltype(field)>>();
        };
        auto number = [&](double &field) {
            SHARDLINE_CHECK(v.is_number(), kProgram, "config key '{}' must be a number, got {}", k, v.dump());
            field = v.get<double>();
        };
        auto text = [&](std::string &field) {
            SHARDLINE_CHECK(v.is_string(), kProgram, "config key '{}' must be a string, got {}", k, v.dump());
            field = v.get<std::string>();
        };
        if (k == "steps") integer(c.steps);
        else if (k == "tp") integer(c.tp);
        else if (k == "dp") integer(c.dp);
        else if (k == "context") integer(c.context);
        else if (k == "hidden") integer(c.hidden);
        else if (k == "ffn") integer(c.ffn);
        else if (k == "layers") integer(c.layers);
        else if (k == "batch") integer(c.batch);
        else if (k == "lr") number(c.lr);
        else if (k == "weight_decay") number(c.weight_decay);
        else if (k == "dtype") text(c.dtype);
        else if (k == "seed") integer(c.seed);
        else if (k == "log_interval") integer(c.log_interval);
        else if (k == "eval_interval") integer(c.eval_interval);
        else if (k == "eval_batches") integer(c.eval_batches);
        else if (k == "data") text(c.data);
        else if (k == "metrics") text(c.metrics);
        else if (k == "sample_chars") integer(c.sample_chars);
        else if (k == "peak_tflops") number(c.peak_tflops);
        else {
            SHARDLINE_THROW(Error, kProgram,
                            "unknown config key '{}' in '{}' (known: steps, tp, dp, context, hidden, ffn, layers, batch, "
                            "lr, weight_decay, dtype, seed, log_interval, eval_interval, eval_batches, data, metrics, "
                            "sample_chars, peak_tflops)",
                            k, path);
        }
    }
}

void Validate(const Config &c, int world) {
    SHARDLINE_CHECK(c.steps >= 0 && c.context > 0 && c.hidden > 0 && c.ffn > 0 && c.layers >= 0 && c.batch > 0,
                    kProgram, "steps >= 0 and context, hidden, ffn, batch > 0, layers >= 0 are required, got steps {} "
                              "context {} hidden {} ffn {} batch {} layers {}",
                    c.steps, c.context, c.hidden, c.ffn, c.batch, c.layers);
    SHARDLINE_CHECK(c.dp >= 1 && c.tp >= 1 && c.dp * c.tp == world, kProgram,
                    "dp ({}) x tp ({}) must equal the number of ranks ({})", c.dp, c.tp, world);
    SHARDLINE_CHECK(c.ffn % c.tp == 0, kProgram, "ffn ({}) must be divisible by tp ({})", c.ffn, c.tp);
    SHARDLINE_CHECK(c.lr > 0 && c.log_interval > 0 && c.eval_interval > 0 && c.eval_batches > 0, kProgram,
                    "lr, log_interval, eval_interval and eval_batches must be positive");
    SHARDLINE_CHECK(c.dtype == "auto" || c.dtype == "fp32" || c.dtype == "float32" || c.dtype == "bf16" ||
                        c.dtype == "bfloat16" || c.dtype == "fp16" || c.dtype == "float16",
                    kProgram, "dtype must be auto, fp32, bf16 or fp16, got '{}'", c.dtype);
}

/// Every regular file under `path` (or the file itself), concatenated in name order.
std::string ReadCorpus(const std::string &path) {
    namespace fs = std::filesystem;
    std::vector<fs::path> files;
    SHARDLINE_CHECK(fs::exists(path), kProgram, "the data path '{}' does not exist", path);
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

struct Corpus {
    std::vector<char> vocab;       ///< id -> byte
    std::vector<std::int64_t> ids; ///< the text as ids
    std::int64_t split = 0;        ///< first validation position
};

Corpus Encode(const std::string &text, std::int64_t context) {
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
    SHARDLINE_CHECK(c.split > context + 1 && static_cast<std::int64_t>(c.ids.size()) - c.split > context + 1, kProgram,
                    "the corpus ({} characters) is too short for a context of {}", c.ids.size(), context);
    return c;
}

/// The global batch of step `step`: ids [context, batch] (position-major, shifted by position·vocab so one embedding
/// table holds every position) and labels [batch]. The same on every rank.
struct Batch {
    Tensor ids;
    Tensor labels;
};

Batch MakeBatch(const Corpus &corpus, std::int64_t context, std::int64_t batch, std::int64_t vocab_padded,
                std::uint64_t seed, bool validation) {
    std::mt19937_64 rng(seed);
    const std::int64_t lo = validation ? corpus.split : 0;
    const std::int64_t hi = (validation ? static_cast<std::int64_t>(corpus.ids.size()) : corpus.split) - context - 1;
    std::uniform_int_distribution<std::int64_t> pick(lo, hi);
    std::vector<double> ids(static_cast<std::size_t>(context * batch));
    std::vector<double> labels(static_cast<std::size_t>(batch));
    for (std::int64_t b = 0; b < batch; ++b) {
        const std::int64_t start = pick(rng);
        for (std::int64_t t = 0; t < context; ++t) {
            ids[static_cast<std::size_t>(t * batch + b)] =
                static_cast<double>(t * vocab_padded + corpus.ids[static_cast<std::size_t>(start + t)]);
        }
        labels[static_cast<std::size_t>(b)] = static_cast<double>(corpus.ids[static_cast<std::size_t>(start + context)]);
    }
    return {Tensor::FromVector(ids, {context, batch}, DType::kInt64),
            Tensor::FromVector(labels, {batch}, DType::kInt64)};
}

class CharLM : public nn::Module {
public:
    CharLM(const Config &c, std::int64_t vocab_padded, comm::DeviceMesh &mesh, const nn::ParameterOptions &param)
        : c_(c), vocab_(vocab_padded), mesh_(mesh) {
        nn::TensorParallel tp{.mesh = &mesh, .tp_dim = "tp"};
        // The embedding table is small and replicated; its gradient arrives replicated over tp.
        embedding_ = RegisterParameter(
            "embedding", nn::MakeParameter({c.context * vocab_padded, c.hidden}, spmd::Layout::Replicated(2), &mesh,
                                           param,
                                           {.seed = 0,
                                            .name = "embedding",
                                            .distribution = RandomDistribution::kNormal,
                                            .a = 0.0,
                                            .b = 1.0 / std::sqrt(static_cast<double>(c.context))}));
        for (int l = 0; l < c.layers; ++l) {
            blocks_.push_back(RegisterModule(
                fmt::format("block{}", l),
                std::make_shared<nn::ParallelMLP>(nn::ParallelMLPOptions{.hidden = c.hidden,
                                                                         .ffn_hidden = c.ffn,
                                                                         .bias = true,
                                                                         .sequence_parallel = false,
                                                                         .param = param,
                                                                         .name = fmt::format("block{}", l)},
                                                  tp)));
        }
        head_ = RegisterModule("head", std::make_shared<nn::ColumnParallelLinear>(
                                           nn::ColumnParallelLinearOptions{.in_features = c.hidden,
                                                                           .out_features = vocab_padded,
                                                                           .bias = true,
                                                                           .param = param,
                                                                           .name = "head"},
                                           tp));
    }

    /// Logits [batch, vocab] sharded on dp (rows) and tp (vocabulary).
    Variable Forward(const Tensor &ids_full) const {
        const int dp = mesh_.dim_index("dp");
        const DistTensor ids = DistTensor::FromFull(ids_full, spmd::Layout(std::vector<std::vector<int>>{{}, {dp}}), mesh_);
        Variable x = autograd::Embedding(Variable(ids), embedding_); // [context, batch, hidden]
        x = autograd::Sum(x, {0});                                   // [batch, hidden]
        for (const auto &block : blocks_) {
            x = autograd::Add(x, block->Forward(x));
        }
        return head_->Forward(x).output;
    }

    /// Multiply-adds of the matmuls per prediction (for TFLOP/s): blocks and head.
    double FlopsPerPrediction() const {
        return 2.0 * (static_cast<double>(c_.layers) * 2.0 * static_cast<double>(c_.hidden * c_.ffn) +
                      static_cast<double>(c_.hidden * vocab_));
    }

private:
    Config c_;
    std::int64_t vocab_;
    comm::DeviceMesh &mesh_;
    Variable embedding_;
    std::vector<std::shared_ptr<nn::ParallelMLP>> blocks_;
    std::shared_ptr<nn::ColumnParallelLinear> head_;
};

/// The mean loss as a host number (reduces the Partial over dp).
double LossValue(const Variable &loss) { return loss.value().FullTensor().ToDoubleVector().at(0); }

int Run(launch::Environment &env, Config c) {
    const int world = env.world_size();
    if (c.tp == 0) {
        c.tp = world / std::max(1, c.dp);
    }
    Validate(c, world);
    SHARDLINE_CHECK(c.batch % c.dp == 0, kProgram, "batch ({}) must be divisible by dp ({})", c.batch, c.dp);
    const bool gpu = env.device().type == DeviceType::kCUDA;
    const DType dtype = c.dtype == "auto" ? (gpu ? DType::kBFloat16 : DType::kFloat32) : ParseDType(c.dtype);
    SHARDLINE_CHECK(gpu || !IsHalf(dtype), kProgram, "dtype {} needs GPUs; this run is on the CPU",
                    DTypeName(dtype));
    const bool lead = env.rank() == 0;

    const Corpus corpus = Encode(ReadCorpus(c.data), c.context);
    const std::int64_t vocab = static_cast<std::int64_t>(corpus.vocab.size());
    // Padded to a multiple of 64 (Megatron's make-vocab-size-divisible-by), the same for every tp up to 64, so the
    // model and its loss curve do not depend on tp. Padding classes never occur as labels.
    const std::int64_t vocab_padded = (vocab + 63) / 64 * 64;

    comm::DeviceMesh mesh(env.world(), {c.dp, c.tp}, {"dp", "tp"});
    const nn::ParameterOptions param{.dtype = dtype, .device = env.device(), .seed = c.seed};
    CharLM model(c, vocab_padded, mesh, param);
    std::vector<Variable> params = model.Parameters();
    std::int64_t numel = 0;
    for (const auto &p : params) {
        numel += Numel(p.shape());
    }
    std::unique_ptr<nn::GradSync> sync;
    if (c.dp > 1) {
        sync = std::make_unique<nn::GradSync>(params, mesh, nn::GradSyncOptions{.dp_dim = "dp"});
    }
    nn::AdamW optimizer(params, {.lr = c.lr, .weight_decay = c.weight_decay});

    if (lead) {
        fmt::print("{}: {} characters ({} train / {} val), vocab {} (padded {}), {} parameters\n", kProgram,
                   corpus.ids.size(), corpus.split, corpus.ids.size() - corpus.split, vocab, vocab_padded, numel);
        fmt::print("{}: mesh dp {} x tp {} on {} ({}), {}, context {}, hidden {}, ffn {}, layers {}, batch {}\n",
                   kProgram, c.dp, c.tp, gpu ? "GPUs" : "CPU", env.world().backend(), DTypeName(dtype), c.context,
                   c.hidden, c.ffn, c.layers, c.batch);
        std::fflush(stdout);
    }
    std::ofstream metrics;
    if (lead && !c.metrics.empty()) {
        metrics.open(c.metrics);
        SHARDLINE_CHECK(metrics.good(), kProgram, "cannot write the metrics file '{}'", c.metrics);
    }
    const int dp_dim = mesh.dim_index("dp");
    const spmd::Layout label_layout(std::vector<std::vector<int>>{{dp_dim}});

    auto evaluate = [&]() {
        autograd::NoGradGuard no_grad;
        double total = 0.0;
        for (int i = 0; i < c.eval_batches; ++i) {
            const Batch b = MakeBatch(corpus, c.context, c.batch, vocab_padded, c.seed * 7919 + 17 + i, true);
            const Variable logits = model.Forward(b.ids.To(env.device()));
            const Variable labels(DistTensor::FromFull(b.labels.To(env.device()), label_layout, mesh));
            total += LossValue(autograd::CrossEntropy(logits, labels, {.vocab_parallel = true}));
        }
        return total / c.eval_batches;
    };

    auto window_start = std::chrono::steady_clock::now();
    double last_val = std::nan("");
    for (std::int64_t step = 1; step <= c.steps; ++step) {
        const Batch b = MakeBatch(corpus, c.context, c.batch, vocab_padded, c.seed * 1000003 + step, false);
        if (sync) {
            sync->ZeroGrad();
        } else {
            optimizer.ZeroGrad();
        }
        const Variable logits = model.Forward(b.ids.To(env.device()));
        const Variable labels(DistTensor::FromFull(b.labels.To(env.device()), label_layout, mesh));
        const Variable loss = autograd::CrossEntropy(logits, labels, {.vocab_parallel = true});
        loss.Backward();
        if (sync) {
            sync->Finish();
        }
        optimizer.Step();

        const bool log = step % c.log_interval == 0 || step == c.steps || step == 1;
        const bool eval = step % c.eval_interval == 0 || step == c.steps;
        if (!log && !eval) {
            continue;
        }
        const double train_loss = LossValue(loss); // a collective: every rank takes part
        Synchronize(env.device());
        const auto now = std::chrono::steady_clock::now();
        const std::int64_t steps_in_window =
            step == 1 ? 1 : (step % c.log_interval == 0 ? c.log_interval : step % c.log_interval);
        const double ms = std::chrono::duration<double, std::milli>(now - window_start).count() /
                          static_cast<double>(steps_in_window);
        if (eval) {
            last_val = evaluate();
        }
        window_start = std::chrono::steady_clock::now();
        const double tokens_per_s = static_cast<double>(c.batch) / (ms / 1e3);
        const double tflops = 3.0 * model.FlopsPerPrediction() * static_cast<double>(c.batch) / (ms / 1e3) / 1e12 /
                              static_cast<double>(world);
        if (lead) {
            const std::string val = std::isnan(last_val) ? std::string("  -   ") : fmt::format("{:.4f}", last_val);
            std::string line = fmt::format("step {:>5}/{} | loss {:.6f} | val {} | {:.2f} ms/step | {:.0f} tok/s | "
                                           "{:.3f} TFLOP/s/{}",
                                           step, c.steps, train_loss, val, ms, tokens_per_s, tflops,
                                           gpu ? "GPU" : "rank");
            if (gpu) {
                line += fmt::format(" | MFU {:.2f}%", 100.0 * tflops / c.peak_tflops);
            }
            fmt::print("{}\n", line);
            std::fflush(stdout);
            if (metrics.is_open()) {
                json rec = {{"step", step},       {"loss", train_loss},     {"ms_per_step", ms},
                            {"tokens_per_s", tokens_per_s}, {"tflops_per_device", tflops}, {"dp", c.dp},
                            {"tp", c.tp},         {"dtype", DTypeName(dtype)}};
                if (!std::isnan(last_val)) {
                    rec["val_loss"] = last_val;
                }
                if (gpu) {
                    rec["mfu"] = tflops / c.peak_tflops;
                }
                metrics << rec.dump() << "\n";
                metrics.flush();
            }
        }
    }

    // A few sampled lines: dp sequences (one per dp rank's row), the same random stream on every rank.
    if (c.sample_chars > 0) {
        autograd::NoGradGuard no_grad;
        std::mt19937_64 rng(c.seed + 99);
        const std::int64_t rows = c.dp;
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
                        static_cast<double>(t * vocab_padded + ctx[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)]);
                }
            }
            const Variable logits =
                model.Forward(Tensor::FromVector(ids, {c.context, rows}, DType::kInt64).To(env.device()));
            const std::vector<double> all = logits.value().FullTensor().ToDoubleVector();
            for (std::int64_t r = 0; r < rows; ++r) {
                const double *row = all.data() + r * vocab_padded;
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
    std::string config_path;
    Config cli;
    app.add_option("--config", config_path, "JSON config file (keys as the options below)");
    auto *steps = app.add_option("--steps", cli.steps, "training steps");
    auto *tp = app.add_option("--tp", cli.tp, "tensor-parallel size (default: ranks / dp)");
    auto *dp = app.add_option("--dp", cli.dp, "data-parallel size");
    auto *hidden = app.add_option("--hidden", cli.hidden, "hidden size");
    auto *ffn = app.add_option("--ffn", cli.ffn, "MLP inner size (divisible by tp)");
    auto *layers = app.add_option("--layers", cli.layers, "ParallelMLP blocks");
    auto *context = app.add_option("--context", cli.context, "characters of context");
    auto *batch = app.add_option("--batch", cli.batch, "global batch (predictions per step)");
    auto *lr = app.add_option("--lr", cli.lr, "AdamW learning rate");
    auto *dtype = app.add_option("--dtype", cli.dtype, "auto, fp32, bf16, fp16");
    auto *seed = app.add_option("--seed", cli.seed, "seed of the weights and the batches");
    auto *data = app.add_option("--data", cli.data, "a text file or a directory of text files");
    auto *metrics = app.add_option("--metrics", cli.metrics, "JSON-lines metrics file (rank 0)");
    auto *log_interval = app.add_option("--log-interval", cli.log_interval, "steps between progress lines");
    auto *eval_interval = app.add_option("--eval-interval", cli.eval_interval, "steps between validation losses");
    auto *sample = app.add_option("--sample-chars", cli.sample_chars, "characters to sample at the end");
    CLI11_PARSE(app, argc, argv);

    return launch::RunMain(&argc, &argv, {}, [&](launch::Environment &env) {
        Config c;
        if (!config_path.empty()) {
            LoadConfig(config_path, c);
        }
        // Command-line values override the file.
        if (*steps) c.steps = cli.steps;
        if (*tp) c.tp = cli.tp;
        if (*dp) c.dp = cli.dp;
        if (*hidden) c.hidden = cli.hidden;
        if (*ffn) c.ffn = cli.ffn;
        if (*layers) c.layers = cli.layers;
        if (*context) c.context = cli.context;
        if (*batch) c.batch = cli.batch;
        if (*lr) c.lr = cli.lr;
        if (*dtype) c.dtype = cli.dtype;
        if (*seed) c.seed = cli.seed;
        if (*data) c.data = cli.data;
        if (*metrics) c.metrics = cli.metrics;
        if (*log_interval) c.log_interval = cli.log_interval;
        if (*eval_interval) c.eval_interval = cli.eval_interval;
        if (*sample) c.sample_chars = cli.sample_chars;
        return Run(env, c);
    });
}
