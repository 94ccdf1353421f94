// shardline-tp-mlp-bench: the tensor-parallel MLP (nn::ParallelMLP: ColumnParallelLinear → GELU(tanh) →
// RowParallelLinear, with bias) forward + backward through shardline autograd, one rank per GPU, TP = world size,
// against its lower bounds (shared/BENCHMARKS.md, "Multi-GPU": the project's benchmark rules, outside this
// repository). bench/tp_mlp/run_tp_mlp_bench.sh runs it next to the torch DTensor peer (bench/peers/tp_mlp_peer.py) in
// one command.
//
//   mpirun -n N shardline-tp-mlp-bench [options]
//
// Per case (shape h/ff, tokens T), interleaved in rounds (A B C ... A B C ...):
//   tp          the step with plain TP: x [T, h] replicated; forward all-reduce of y, backward all-reduce of dX.
//   sp          the step with sequence parallelism: x [T/tp, h] sharded on tokens; forward all-gather x and
//               reduce-scatter y, backward all-gather dY and reduce-scatter dX.
//   compute_tp  T_compute: the local shard's kernels of the step, on this rank's GPU, no collective:
//   compute_sp    LinearForward(x, W1, b1) → GeluForward → LinearForward(·, W2) → BiasAdd(b2) on [T, h] (sp: [T/tp,h]);
//                 LinearBackward(dY; W2) → dA, dW2, db2 → GeluBackward → LinearBackward(dH; W1) → dX, dW1, db1.
//   gemm        the six GEMMs of the step alone (no bias, GELU or bias grad): a floor under T_compute.
//   comm_tp     T_comm: the step's collectives through the tp group's communicator, at the step's sizes:
//   comm_sp       tp: all_reduce [T, h] twice; sp: (all_gather [T/tp, h] → [T, h], reduce_scatter [T, h] → [T/tp, h])
//                 twice. Each waited on as the layers do (Wait(host=false): ordered before the compute stream).
// and, per step variant: LB_serial = T_compute + T_comm, LB_overlap = max(T_compute, T_comm), T / LB_serial,
// TF/GPU = 12·T·h·ff / tp / t (fwd 2·T·h·ff + bwd 4·T·h·ff per Linear, two Linears, the work split over tp GPUs), and
// the fraction of the calibration ceiling (an 8192³ bf16 cuBLASLt GEMM on this GPU, bench/common/cublaslt_floor.h).
//
// Timing: parameter and input grads dropped before each step (torch: zero_grad(set_to_none=True)), outside the timed
// region; CUDA events on every rank's compute stream around each iteration, back to back (no synchronisation inside a
// batch, so a host-bound step shows its host time); a barrier before each batch; per iteration the max over ranks;
// median and p90 over all timed iterations. Data: x and dY normal(0, 1), the module's own U(±1/√in) weights and biases
// (torch.nn.Linear's init). No buffer rotation: the smallest step already streams ≥ 117 MB of weights and weight
// grads (8b, tp 4), more than 2× the L2 of an H100/H200; the records carry working_set_bytes.
//
// Correctness gate, before timing, on every case and step variant: the first step's gathered y and dX on two token
// rows, and dW1, db1, dW2, db2 on two ffn columns of each rank's shard, against float64 host sums over the same
// bf16 inputs (rows: each rank sums its shard's contribution, the ranks add them up over MPI). Tolerance: the
// distributed tests' bf16 rtol 1.6e-2 × (tp + 3) (tests/dist/nn_parallel_mlp_test.cc), relative to
// max(|expected|, rms(expected)); fp32 (--cpu) 1e-4. A failed gate skips that variant's timing and fails the exit code.
//
// --chunks C runs the tp and sp steps with the chunked collective-GEMM pipelines (ParallelMLPOptions::comm_chunks;
// docs/functional.md "Chunked pipelines"): every collective of the step in C chunks, each beside another chunk's GEMM.
// T_compute and T_comm stay the unchunked kernels and collectives, so T / LB_overlap shows what the pipelines hide.
//
// Options: `shardline-tp-mlp-bench --help` lists them with their defaults (ParseCommandLine below).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/variable.h>
#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/linear.h>
#include <shardline/launch/bootstrap.h>
#include <shardline/nn/mlp.h>
#include <shardline/spmd/layout.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/host_reduce.h"
#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cublaslt_floor.h"
#endif

namespace {

using namespace shardline;
using autograd::Variable;
using dist::DistTensor;
using json = nlohmann::json;

constexpr std::string_view kTool = "shardline-tp-mlp-bench";

// ---------------------------------------------------------------------------------------------------------------------
// Options and cases

struct MlpShape {
    std::string name;
    std::int64_t hidden = 0;
    std::int64_t ffn = 0;
};
/// Llama 3 8B and 70B MLPs (shared/BENCHMARKS.md "Shapes").
const std::vector<MlpShape> kShapes = {{"8b", 4096, 14336}, {"70b", 8192, 28672}};
const MlpShape kCpuShape = {"cpu-tiny", 64, 256};

struct Options {
    std::string suite = "full";
    std::vector<MlpShape> shapes; ///< empty: the suite's
    std::vector<std::int64_t> tokens;
    std::vector<std::string> variants = {"tp", "sp"};
    int warmup = 10; ///< the suite's: ParseCommandLine fills them in
    int iters = 10;
    int rounds = 5;
    bool gate = true;
    bool cpu = false;
    bool list_cases = false;
    bool no_overlap = false; ///< overlap_grad_comm off
    int chunks = 0;          ///< comm_chunks of fc1 and fc2 (the chunked collective-GEMM pipelines)
    std::string json;
};

constexpr int kIntMax = std::numeric_limits<int>::max();

/// NAME:H:FF with H and FF positive integers.
std::optional<MlpShape> ParseShape(const std::string& text) {
    std::vector<std::string> parts;
    std::string::size_type begin = 0;
    for (std::string::size_type colon; (colon = text.find(':', begin)) != std::string::npos; begin = colon + 1) {
        parts.push_back(text.substr(begin, colon - begin));
    }
    parts.push_back(text.substr(begin));
    MlpShape shape;
    if (parts.size() != 3 || parts[0].empty() || !CLI::detail::lexical_cast(parts[1], shape.hidden) ||
        !CLI::detail::lexical_cast(parts[2], shape.ffn) || shape.hidden < 1 || shape.ffn < 1) {
        return std::nullopt;
    }
    shape.name = parts[0];
    return shape;
}

/// Parses argv into `o` and fills in the suite's defaults; returns -1 to go on, else the exit code (--help, or
/// CLI11's code for a bad command line).
int ParseCommandLine(int argc, char** argv, Options& o) {
    CLI::App app{"shardline-tp-mlp-bench: nn::ParallelMLP forward + backward, TP = world size, one rank per GPU "
                 "(mpirun -n N shardline-tp-mlp-bench [options]), against T_compute, T_comm and their lower bounds",
                 std::string(kTool)};
    bench::UseBenchDefaults(app);
    std::string shape_names;
    std::vector<std::string> custom;
    std::string tokens;
    std::string variants = "tp,sp";
    int warmup = 10;
    int iters = 10;
    int rounds = 5;
    bool no_gate = false;
    app.add_option("--suite", o.suite,
                   "full: shapes 8b,70b x tokens 128,2048,8192; quick: 8b x 128,8192, fewer "
                   "iterations")
        ->check(CLI::IsMember({"quick", "full"}));
    app.add_option("--shapes", shape_names, "Llama 3 MLP shapes, comma-separated (empty: the suite's)")
        ->type_name("LIST")
        ->check(bench::ListOf({"8b", "70b"}));
    app.add_option("--shape", custom, "a custom shape, hidden H and ffn FF; repeatable; replaces --shapes")
        ->type_name("NAME:H:FF")
        ->default_str("")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
        ->allow_extra_args(false)
        ->check(CLI::Validator(
            [](std::string& text) {
                return ParseShape(text) ? std::string() : "expected NAME:H:FF with H, FF >= 1, got '" + text + "'";
            },
            ""));
    app.add_option("--tokens", tokens, "token counts T, comma-separated (empty: the suite's; --cpu: 16,64)")
        ->type_name("LIST")
        ->check(bench::IntListAtLeast(1));
    app.add_option("--variants", variants, "step variants, comma-separated: tp (plain), sp (sequence parallel)")
        ->type_name("LIST")
        ->check(bench::ListOf({"tp", "sp"}));
    CLI::Option* warmup_opt = app.add_option("--warmup", warmup, "untimed steps per case (--suite quick, --cpu: 3)")
                                  ->check(CLI::Range(0, kIntMax));
    CLI::Option* iters_opt = app.add_option("--iters", iters,
                                            "timed steps per variant and round (--suite quick, "
                                            "--cpu: 5)")
                                 ->check(CLI::Range(1, kIntMax));
    CLI::Option* rounds_opt = app.add_option("--rounds", rounds, "rounds over the variants (--suite quick, --cpu: 2)")
                                  ->check(CLI::Range(1, kIntMax));
    app.add_flag("--no-gate", no_gate, "skip the correctness gate before timing");
    app.add_flag(
        "--no-overlap", o.no_overlap,
        "the backward's dx collective after the parameter grads (overlap_grad_comm off), to measure the overlap");
    app.add_option("--chunks", o.chunks,
                   "comm_chunks of fc1 and fc2: every collective of the step in C chunks of rows, each beside another "
                   "chunk's GEMM (the chunked collective-GEMM pipelines; 0 or 1: off). C must not exceed the rows a "
                   "rank's block has (tokens / tp under sp)")
        ->check(CLI::Range(0, kIntMax));
    app.add_flag("--cpu", o.cpu, "MPI on CPU tensors, fp32, shape cpu-tiny (h 64, ff 256): a smoke test of the logic");
    app.add_option("--json", o.json, "append one JSON line per measurement to PATH")->type_name("PATH");
    app.add_flag("--list-cases", o.list_cases, "print the cases as JSON (for the torch peer) and exit");
    CLI11_PARSE(app, argc, argv);

    o.gate = !no_gate;
    o.variants = bench::SplitList(variants);
    o.tokens = bench::ParseIntList(tokens);
    const bool quick = o.suite == "quick";
    const std::vector<std::string> named = bench::SplitList(shape_names);
    if (!custom.empty()) {
        for (const std::string& text : custom) {
            o.shapes.push_back(*ParseShape(text));
        }
    } else if (o.cpu) {
        o.shapes = {kCpuShape};
    } else {
        for (const MlpShape& s : kShapes) {
            const bool wanted = std::find(named.begin(), named.end(), s.name) != named.end();
            if (named.empty() ? (!quick || s.name == "8b") : wanted) {
                o.shapes.push_back(s);
            }
        }
    }
    if (o.tokens.empty()) {
        o.tokens = o.cpu ? std::vector<std::int64_t>{16, 64}
                         : (quick ? std::vector<std::int64_t>{128, 8192} : std::vector<std::int64_t>{128, 2048, 8192});
    }
    const bool short_run = quick || o.cpu;
    o.warmup = warmup_opt->count() > 0 ? warmup : (short_run ? 3 : 10);
    o.iters = iters_opt->count() > 0 ? iters : (short_run ? 5 : 10);
    o.rounds = rounds_opt->count() > 0 ? rounds : (short_run ? 2 : 5);
    return -1;
}

/// What the torch peer reads (--cases): the same cases, variants and iteration counts.
json CasesJson(const Options& o) {
    json cases = json::array();
    for (const MlpShape& s : o.shapes) {
        for (const std::int64_t t : o.tokens) {
            cases.push_back({{"shape", s.name}, {"hidden", s.hidden}, {"ffn", s.ffn}, {"tokens", t}});
        }
    }
    return {{"suite", o.suite}, {"cases", cases},     {"variants", o.variants},          {"warmup", o.warmup},
            {"iters", o.iters}, {"rounds", o.rounds}, {"dtype", o.cpu ? "fp32" : "bf16"}};
}

// ---------------------------------------------------------------------------------------------------------------------
// Timing: CUDA events on the compute stream (host clock on the CPU), the max over ranks per iteration

class BatchTimer {
public:
    BatchTimer(Device device, int iters) : device_(device), iters_(iters) {
#if SHARDLINE_HAVE_CUDA
        if (device_.is_cuda()) {
            stream_ = CudaContext::Get(device_.index).stream();
            events_.resize(static_cast<std::size_t>(2 * iters));
            for (auto& e : events_) {
                SHARDLINE_CHECK_CUDA(cudaEventCreate(&e));
            }
            return;
        }
#endif
        host_.resize(static_cast<std::size_t>(2 * iters));
    }
    ~BatchTimer() {
#if SHARDLINE_HAVE_CUDA
        for (auto& e : events_) {
            cudaEventDestroy(e);
        }
#endif
    }
    BatchTimer(const BatchTimer&) = delete;
    BatchTimer& operator=(const BatchTimer&) = delete;

    void Mark(int slot) {
#if SHARDLINE_HAVE_CUDA
        if (!events_.empty()) {
            SHARDLINE_CHECK_CUDA(cudaEventRecord(events_[static_cast<std::size_t>(slot)], stream_));
            return;
        }
#endif
        host_[static_cast<std::size_t>(slot)] = std::chrono::steady_clock::now();
    }
    void Start(int i) { Mark(2 * i); }
    void Stop(int i) { Mark(2 * i + 1); }

    /// µs per iteration of the batch just run (waits for the device).
    std::vector<double> Collect() {
        Synchronize(device_);
        std::vector<double> us(static_cast<std::size_t>(iters_));
        for (int i = 0; i < iters_; ++i) {
#if SHARDLINE_HAVE_CUDA
            if (!events_.empty()) {
                float ms = 0.0f;
                SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, events_[static_cast<std::size_t>(2 * i)],
                                                          events_[static_cast<std::size_t>(2 * i + 1)]));
                us[static_cast<std::size_t>(i)] = 1000.0 * ms;
                continue;
            }
#endif
            us[static_cast<std::size_t>(i)] =
                std::chrono::duration<double, std::micro>(host_[static_cast<std::size_t>(2 * i + 1)] -
                                                          host_[static_cast<std::size_t>(2 * i)])
                    .count();
        }
        return us;
    }

private:
    Device device_;
    int iters_;
#if SHARDLINE_HAVE_CUDA
    cudaStream_t stream_ = nullptr;
    std::vector<cudaEvent_t> events_;
#endif
    std::vector<std::chrono::steady_clock::time_point> host_;
};

using bench::AllReduceHost;

/// The device idle and every rank past this point.
void Barrier(launch::Environment& env) {
    Synchronize(env.device());
    env.world().Barrier()->Wait(true);
}

// ---------------------------------------------------------------------------------------------------------------------
// The correctness gate: float64 host sums over the bf16 inputs

double GeluTanh(double x) {
    constexpr double kC = 0.7978845608028654; // √(2/π)
    return 0.5 * x * (1.0 + std::tanh(kC * (x + 0.044715 * x * x * x)));
}
double GeluTanhGrad(double x) {
    constexpr double kC = 0.7978845608028654;
    const double th = std::tanh(kC * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kC * (1.0 + 3.0 * 0.044715 * x * x);
}

/// Sampled (actual, expected) pairs of one quantity; passes when every |a − e| ≤ tol · max(|e|, rms(expected)).
struct Samples {
    std::string what;
    std::vector<double> actual{};
    std::vector<double> expected{};
    void Add(double a, double e) {
        actual.push_back(a);
        expected.push_back(e);
    }
    std::string Check(double tol) const {
        double sq = 0.0;
        for (double e : expected) {
            sq += e * e;
        }
        const double rms = expected.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(expected.size()));
        if (!(rms > 0.0)) {
            return fmt::format("{}: every sampled reference is 0 (or none was sampled)", what);
        }
        for (std::size_t i = 0; i < actual.size(); ++i) {
            const double allowed = tol * std::max(std::abs(expected[i]), rms);
            if (!(std::abs(actual[i] - expected[i]) <= allowed)) {
                return fmt::format("{}: sample {} is {} against {} (allowed error {}, rms {})", what, i, actual[i],
                                   expected[i], allowed, rms);
            }
        }
        return {};
    }
};

/// This rank's parameter shards on the host (float64), read once per shape.
struct HostParams {
    std::int64_t f = 0;                 ///< local ffn rows (ff / tp)
    std::vector<double> w1, b1, w2, b2; ///< [f, h], [f], [h, f], [h]
};

/// `count` elements of contiguous `t` from flat index `offset`, as float64 (the device must be idle).
std::vector<double> ReadElements(const Tensor& t, std::int64_t offset, std::int64_t count) {
    SHARDLINE_CHECK(t.is_contiguous() && offset >= 0 && offset + count <= t.numel(), kTool,
                    "cannot read {} elements at {} of {}", count, offset, t.ToString());
    const std::size_t es = ElementSize(t.dtype());
    std::vector<unsigned char> buf(static_cast<std::size_t>(count) * es);
    const auto* src = static_cast<const unsigned char*>(t.data()) + static_cast<std::size_t>(offset) * es;
#if SHARDLINE_HAVE_CUDA
    if (t.device().is_cuda()) {
        SHARDLINE_CHECK_CUDA(cudaMemcpy(buf.data(), src, buf.size(), cudaMemcpyDeviceToHost));
        return Tensor::FromBlob(buf.data(), {count}, t.dtype(), Device::CPU()).ToDoubleVector();
    }
#endif
    std::memcpy(buf.data(), src, buf.size());
    return Tensor::FromBlob(buf.data(), {count}, t.dtype(), Device::CPU()).ToDoubleVector();
}

// ---------------------------------------------------------------------------------------------------------------------
// One case

struct Variant {
    std::string name; ///< tp, sp, compute_tp, compute_sp, gemm, comm_tp, comm_sp
    std::string kind; ///< step, compute, gemm, comm
    double flops = 0.0;
    std::function<void()> prepare = [] {}; ///< host work before each iteration, outside the timed region
    std::function<void()> run{};           ///< empty: not timed (its gate failed)
    std::vector<double> samples_us{};
    json extra = json::object();
};

struct Run {
    launch::Environment* env = nullptr;
    comm::DeviceMesh* mesh = nullptr;
    Options options;
    DType dtype = DType::kBFloat16;
    std::string device;
    std::string commit;
    std::string date;
    double ceiling_tflops = 0.0;
    std::ofstream out;
    int gate_failures = 0;

    bool rank0() const { return env->rank() == 0; }
    void Emit(json rec) {
        rec["impl"] = "shardline";
        rec["device"] = device;
        rec["commit"] = commit;
        rec["date"] = date;
        rec["ranks"] = env->world_size();
        rec["tp"] = env->world_size();
        rec["dtype"] = options.cpu ? "fp32" : "bf16";
        rec["overlap_grad_comm"] = !options.no_overlap;
        rec["comm_chunks"] = options.chunks;
        if (out.is_open()) {
            out << rec.dump() << '\n';
            out.flush();
        }
    }
};

/// One shape's two modules (plain TP and sequence parallel) with identical parameters, and their host copies.
struct ShapeState {
    MlpShape shape;
    std::map<std::string, std::unique_ptr<nn::ParallelMLP>> mlp; ///< by variant
    HostParams host;
};

class CaseRunner {
public:
    CaseRunner(Run& run, ShapeState& state, std::int64_t tokens)
        : run_(run), state_(state), tokens_(tokens), env_(*run.env), mesh_(*run.mesh) {
        tp_ = env_.world_size();
        h_ = state.shape.hidden;
        ff_ = state.shape.ffn;
        f_ = ff_ / tp_;
        const Device dev = env_.device();
        x_full_ = Tensor::Empty({tokens_, h_}, run_.dtype, dev);
        dy_full_ = Tensor::Empty({tokens_, h_}, run_.dtype, dev);
        FillRandom(x_full_, RandomSpec{.seed = 21, .name = "tp_mlp_bench/x"});
        FillRandom(dy_full_, RandomSpec{.seed = 21, .name = "tp_mlp_bench/dy"});
    }

    void Execute() {
        const Options& o = run_.options;
        for (const std::string& v : o.variants) {
            SetUpStep(v);
        }
        SetUpCompute();
        SetUpComm();

        const int warmup = o.warmup;
        const int iters = o.iters;
        for (Variant& v : variants_) {
            if (!v.run) {
                continue;
            }
            for (int i = 0; i < warmup; ++i) {
                v.prepare();
                v.run();
            }
        }
        BatchTimer timer(env_.device(), iters);
        for (int r = 0; r < o.rounds; ++r) {
            for (Variant& v : variants_) {
                if (!v.run) {
                    continue;
                }
                Barrier(env_);
                for (int i = 0; i < iters; ++i) {
                    v.prepare();
                    timer.Start(i);
                    v.run();
                    timer.Stop(i);
                }
                std::vector<double> us = timer.Collect();
                AllReduceHost(env_, us, comm::ReduceOp::kMax); // the slowest rank sets each iteration's time
                v.samples_us.insert(v.samples_us.end(), us.begin(), us.end());
            }
        }
        Report();
    }

private:
    // ---- the distributed step ---------------------------------------------------------------------------------------

    struct StepState {
        Variable x;
        DistTensor dy;
    };

    void SetUpStep(const std::string& v) {
        nn::ParallelMLP& mlp = *state_.mlp.at(v);
        const bool sp = v == "sp";
        SHARDLINE_CHECK(!sp || tokens_ % tp_ == 0, kTool, "sequence parallel needs tokens ({}) divisible by tp ({})",
                        tokens_, tp_);
        const spmd::Layout x_layout =
            sp ? spmd::Layout(std::vector<std::vector<int>>{{0}, {}}) : spmd::Layout::Replicated(2);
        auto st = std::make_shared<StepState>();
        st->x = Variable(DistTensor::FromFull(x_full_, x_layout, mesh_), /*requires_grad=*/true);

        // The first step: dY takes y's layout, and the gate checks its values.
        mlp.ZeroGrad();
        Variable y = mlp.Forward(st->x);
        st->dy = DistTensor::FromFull(dy_full_, y.value().layout(), mesh_);
        y.Backward(&st->dy);
        bool ok = true;
        if (run_.options.gate) {
            ok = Gate(v, mlp, st->x, y);
        }
        y = Variable();

        Variant var{.name = v, .kind = "step", .flops = StepFlops()};
        var.extra["collectives"] = sp ? "fwd all_gather x + reduce_scatter y; bwd all_gather dY + reduce_scatter dX"
                                      : "fwd all_reduce y; bwd all_reduce dX";
        if (ok) {
            var.prepare = [&mlp, st] {
                mlp.ZeroGrad();
                st->x.ZeroGrad();
            };
            var.run = [&mlp, st] {
                Variable out = mlp.Forward(st->x);
                out.Backward(&st->dy);
            };
        }
        variants_.push_back(std::move(var));
    }

    double StepFlops() const {
        return 12.0 * static_cast<double>(tokens_) * static_cast<double>(h_) * static_cast<double>(ff_) /
               static_cast<double>(tp_);
    }

    /// The float64 reference of the sampled values, computed once per case (both variants have the same parameters,
    /// x and dY, so the same answers). Rows: y and dX from every rank's shard contribution, summed over MPI. Columns:
    /// this rank's dW1, db1, dW2 on two of its ffn rows, and db2, from all the tokens.
    struct Reference {
        std::vector<std::int64_t> rows, cols, ks;
        std::vector<double> y, dx;              ///< [rows, h]
        std::vector<double> dw1, db1, dw2, db2; ///< [cols, ks], [cols], [cols, ks], [ks]
    };

    const Reference& ReferenceFor(nn::ParallelMLP& mlp) {
        if (reference_) {
            return *reference_;
        }
        const HostParams& p = HostParamsFor(mlp);
        const std::int64_t T = tokens_;
        const std::int64_t h = h_;
        const std::int64_t f = p.f;
        const std::vector<double> xs = x_full_.ToDoubleVector();
        const std::vector<double> dys = dy_full_.ToDoubleVector();
        auto ref = std::make_unique<Reference>();
        ref->rows = {T / 3, T - 1};
        ref->cols = {0, f - 1};
        ref->ks = {0, h / 2, h - 1};
        const std::size_t hs = static_cast<std::size_t>(h);

        // Rows: this shard's part of y and of dX (h values each per row), then the sum over ranks.
        std::vector<double> parts(ref->rows.size() * 2 * hs, 0.0);
        std::vector<double> h1(static_cast<std::size_t>(f));
        std::vector<double> act(static_cast<std::size_t>(f));
        std::vector<double> g(static_cast<std::size_t>(f));
        for (std::size_t r = 0; r < ref->rows.size(); ++r) {
            const double* xr = &xs[static_cast<std::size_t>(ref->rows[r]) * hs];
            const double* dyr = &dys[static_cast<std::size_t>(ref->rows[r]) * hs];
            double* ypart = &parts[r * 2 * hs];
            double* dxpart = ypart + h;
            for (std::int64_t i = 0; i < f; ++i) {
                const double* w1i = &p.w1[static_cast<std::size_t>(i) * hs];
                double acc = p.b1[static_cast<std::size_t>(i)];
                for (std::int64_t k = 0; k < h; ++k) {
                    acc += xr[k] * w1i[k];
                }
                h1[static_cast<std::size_t>(i)] = acc;
                act[static_cast<std::size_t>(i)] = GeluTanh(acc);
                g[static_cast<std::size_t>(i)] = 0.0;
            }
            for (std::int64_t j = 0; j < h; ++j) {
                const double* w2j = &p.w2[static_cast<std::size_t>(j * f)];
                double acc = 0.0;
                for (std::int64_t i = 0; i < f; ++i) {
                    acc += act[static_cast<std::size_t>(i)] * w2j[i];
                    g[static_cast<std::size_t>(i)] += dyr[j] * w2j[i]; // dA = dY·W2
                }
                ypart[j] = acc;
            }
            for (std::int64_t i = 0; i < f; ++i) {
                const double dh = g[static_cast<std::size_t>(i)] * GeluTanhGrad(h1[static_cast<std::size_t>(i)]);
                const double* w1i = &p.w1[static_cast<std::size_t>(i) * hs];
                for (std::int64_t k = 0; k < h; ++k) {
                    dxpart[k] += dh * w1i[k]; // dX = dH·W1
                }
            }
        }
        AllReduceHost(env_, parts, comm::ReduceOp::kSum);
        for (std::size_t r = 0; r < ref->rows.size(); ++r) {
            for (std::size_t j = 0; j < hs; ++j) {
                ref->y.push_back(parts[r * 2 * hs + j] + p.b2[j]);
            }
            for (std::size_t j = 0; j < hs; ++j) {
                ref->dx.push_back(parts[(r * 2 + 1) * hs + j]);
            }
        }

        // Columns i of this shard, over every token: dW1[i, k] = Σ_t dH[t, i]·x[t, k], db1[i] = Σ_t dH[t, i],
        // dW2[k, i] = Σ_t dY[t, k]·A[t, i].
        for (const std::int64_t i : ref->cols) {
            const double* w1i = &p.w1[static_cast<std::size_t>(i) * hs];
            std::vector<double> w2i(hs); // column i of W2 [h, f]
            for (std::size_t k = 0; k < hs; ++k) {
                w2i[k] = p.w2[k * static_cast<std::size_t>(f) + static_cast<std::size_t>(i)];
            }
            std::vector<double> dw1(ref->ks.size(), 0.0);
            std::vector<double> dw2(ref->ks.size(), 0.0);
            double db1 = 0.0;
            for (std::int64_t t = 0; t < T; ++t) {
                const double* xt = &xs[static_cast<std::size_t>(t) * hs];
                const double* dyt = &dys[static_cast<std::size_t>(t) * hs];
                double pre = p.b1[static_cast<std::size_t>(i)];
                double da = 0.0;
                for (std::size_t k = 0; k < hs; ++k) {
                    pre += xt[k] * w1i[k];
                    da += dyt[k] * w2i[k];
                }
                const double dh = da * GeluTanhGrad(pre);
                const double a = GeluTanh(pre);
                db1 += dh;
                for (std::size_t s = 0; s < ref->ks.size(); ++s) {
                    dw1[s] += dh * xt[ref->ks[s]];
                    dw2[s] += dyt[ref->ks[s]] * a;
                }
            }
            ref->db1.push_back(db1);
            ref->dw1.insert(ref->dw1.end(), dw1.begin(), dw1.end());
            ref->dw2.insert(ref->dw2.end(), dw2.begin(), dw2.end());
        }
        for (const std::int64_t k : ref->ks) {
            double acc = 0.0;
            for (std::int64_t t = 0; t < T; ++t) {
                acc += dys[static_cast<std::size_t>(t) * hs + static_cast<std::size_t>(k)];
            }
            ref->db2.push_back(acc);
        }
        reference_ = std::move(ref);
        return *reference_;
    }

    /// The first step's results against the reference. Every rank returns the same verdict.
    bool Gate(const std::string& v, nn::ParallelMLP& mlp, const Variable& x, const Variable& y) {
        const auto t0 = std::chrono::steady_clock::now();
        const Reference& ref = ReferenceFor(mlp);
        const std::int64_t h = h_;
        const std::int64_t f = f_;
        // Collectives first, in one order on every rank.
        const Tensor y_full = y.value().FullTensor();
        const Tensor dx_full = x.grad().FullTensor();
        const Tensor db2_full = mlp.fc2->bias.grad().FullTensor();
        const Tensor& dw1 = mlp.fc1->weight.grad().local();
        const Tensor& db1 = mlp.fc1->bias.grad().local();
        const Tensor& dw2 = mlp.fc2->weight.grad().local();
        Synchronize(env_.device());

        Samples ys{.what = "y rows"};
        Samples dxs{.what = "dX rows"};
        for (std::size_t r = 0; r < ref.rows.size(); ++r) {
            const std::vector<double> yr = ReadElements(y_full, ref.rows[r] * h, h);
            const std::vector<double> dxr = ReadElements(dx_full, ref.rows[r] * h, h);
            for (std::size_t j = 0; j < static_cast<std::size_t>(h); ++j) {
                ys.Add(yr[j], ref.y[r * static_cast<std::size_t>(h) + j]);
                dxs.Add(dxr[j], ref.dx[r * static_cast<std::size_t>(h) + j]);
            }
        }
        Samples dw1s{.what = "dW1 (this rank's shard)"};
        Samples db1s{.what = "db1 (this rank's shard)"};
        Samples dw2s{.what = "dW2 (this rank's shard)"};
        Samples db2s{.what = "db2"};
        const std::size_t nk = ref.ks.size();
        for (std::size_t c = 0; c < ref.cols.size(); ++c) {
            const std::int64_t i = ref.cols[c];
            db1s.Add(ReadElements(db1, i, 1)[0], ref.db1[c]);
            for (std::size_t s = 0; s < nk; ++s) {
                dw1s.Add(ReadElements(dw1, i * h + ref.ks[s], 1)[0], ref.dw1[c * nk + s]);
                dw2s.Add(ReadElements(dw2, ref.ks[s] * f + i, 1)[0], ref.dw2[c * nk + s]);
            }
        }
        for (std::size_t s = 0; s < nk; ++s) {
            db2s.Add(ReadElements(db2_full, ref.ks[s], 1)[0], ref.db2[s]);
        }
        const double tol = run_.options.cpu ? 1e-4 : 1.6e-2 * static_cast<double>(tp_ + 3);
        std::string failure;
        for (const Samples* smp : {&ys, &dxs, &dw1s, &db1s, &dw2s, &db2s}) {
            if (failure.empty()) {
                failure = smp->Check(tol);
            }
        }
        std::vector<double> failed = {failure.empty() ? 0.0 : 1.0};
        if (!failure.empty()) {
            std::fprintf(stderr, "[rank %d/%d] GATE FAILED %s tokens %lld %s: %s\n", env_.rank(), env_.world_size(),
                         state_.shape.name.c_str(), static_cast<long long>(tokens_), v.c_str(), failure.c_str());
        }
        AllReduceHost(env_, failed, comm::ReduceOp::kMax);
        const bool ok = failed[0] == 0.0;
        if (!ok) {
            run_.gate_failures++;
        } else if (run_.rank0()) {
            std::printf("# gate %s tokens %lld %s: ok (%zu y, %zu dX, %zu dW1, %zu db1, %zu dW2, %zu db2 samples, "
                        "rtol %.3g; %.2f s)\n",
                        state_.shape.name.c_str(), static_cast<long long>(tokens_), v.c_str(), ys.actual.size(),
                        dxs.actual.size(), dw1s.actual.size(), db1s.actual.size(), dw2s.actual.size(),
                        db2s.actual.size(), tol,
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            std::fflush(stdout);
        }
        return ok;
    }

    const HostParams& HostParamsFor(nn::ParallelMLP& mlp) {
        HostParams& p = state_.host;
        if (p.w1.empty()) {
            p.f = mlp.fc1->weight.local().shape()[0];
            p.w1 = mlp.fc1->weight.local().ToDoubleVector();
            p.b1 = mlp.fc1->bias.local().ToDoubleVector();
            p.w2 = mlp.fc2->weight.local().ToDoubleVector();
            p.b2 = mlp.fc2->bias.local().ToDoubleVector();
        }
        return p;
    }

    // ---- T_compute: the local shard's kernels, no collective -----------------------------------------------------

    void SetUpCompute() {
        // Any of the modules: both hold the same parameters.
        nn::ParallelMLP& mlp = *state_.mlp.begin()->second;
        const Device dev = env_.device();
        const DType dt = run_.dtype;
        auto buf = std::make_shared<LocalBuffers>();
        LocalBuffers& b = *buf;
        b.w1 = mlp.fc1->weight.local();
        b.b1 = mlp.fc1->bias.local();
        b.w2 = mlp.fc2->weight.local();
        b.b2 = mlp.fc2->bias.local();
        b.x = x_full_;
        b.dy = dy_full_;
        b.h1 = Tensor::Empty({tokens_, f_}, dt, dev);
        b.a = Tensor::Empty({tokens_, f_}, dt, dev);
        b.da = Tensor::Empty({tokens_, f_}, dt, dev);
        b.dh = Tensor::Empty({tokens_, f_}, dt, dev);
        b.y = Tensor::Empty({tokens_, h_}, dt, dev);
        b.y_out = Tensor::Empty({tokens_, h_}, dt, dev);
        b.dx = Tensor::Empty({tokens_, h_}, dt, dev);
        b.dw1 = Tensor::Empty({f_, h_}, dt, dev);
        b.db1 = Tensor::Empty({f_}, dt, dev);
        b.dw2 = Tensor::Empty({h_, f_}, dt, dev);
        b.db2 = Tensor::Empty({h_}, dt, dev);
        const std::int64_t rows_sp = std::max<std::int64_t>(tokens_ / tp_, 1);
        b.y_sp = Tensor::Empty({rows_sp, h_}, dt, dev);
        b.y_sp_out = Tensor::Empty({rows_sp, h_}, dt, dev);
        FillRandom(b.y_sp, RandomSpec{.seed = 22, .name = "tp_mlp_bench/y_sp"});
        // Forward fills h1, a, y before any backward reads them (the warm-ups run forward first).
        for (const std::string& v : run_.options.variants) {
            const bool sp = v == "sp";
            Variant var{.name = "compute_" + v, .kind = "compute", .flops = StepFlops()};
            var.run = [buf, sp] { buf->Step(sp); };
            variants_.push_back(std::move(var));
        }
        Variant gemm{.name = "gemm", .kind = "gemm", .flops = StepFlops()};
        gemm.run = [buf] { buf->Gemms(); };
        variants_.push_back(std::move(gemm));
    }

    struct LocalBuffers {
        Tensor x, dy, w1, b1, w2, b2, h1, a, da, dh, y, y_out, dx, dw1, db1, dw2, db2, y_sp, y_sp_out;

        /// The step's local kernels: the column layer with its bias in the epilogue, GELU, the row layer's GEMM, its
        /// bias after the (here absent) reduction, on [T, h] or, sequence parallel, on this rank's [T/tp, h].
        void Step(bool sp) {
            kernels::LinearForward({.x = x, .weight = w1, .bias = &b1, .y = h1});
            kernels::GeluForward({.x = h1, .y = a, .approximation = kernels::GeluApproximation::kTanh});
            kernels::LinearForward({.x = a, .weight = w2, .bias = nullptr, .y = y});
            kernels::BiasAdd({.x = sp ? y_sp : y, .bias = b2, .out = sp ? y_sp_out : y_out});
            kernels::LinearBackward({.dy = dy, .x = &a, .weight = &w2, .dx = &da, .dweight = &dw2, .dbias = &db2});
            kernels::GeluBackward({.dy = da, .x = h1, .dx = dh, .approximation = kernels::GeluApproximation::kTanh});
            kernels::LinearBackward({.dy = dh, .x = &x, .weight = &w1, .dx = &dx, .dweight = &dw1, .dbias = &db1});
        }
        /// The six GEMMs alone: H1 = X·W1ᵀ, Y = A·W2ᵀ, dA = dY·W2, dW2 = dYᵀ·A, dX = dH·W1, dW1 = dHᵀ·X.
        void Gemms() {
            kernels::LinearForward({.x = x, .weight = w1, .bias = nullptr, .y = h1});
            kernels::LinearForward({.x = a, .weight = w2, .bias = nullptr, .y = y});
            kernels::LinearBackwardInput({.dy = dy, .weight = w2, .dx = da});
            kernels::LinearBackwardWeight({.dy = dy, .x = a, .dweight = dw2});
            kernels::LinearBackwardInput({.dy = dh, .weight = w1, .dx = dx});
            kernels::LinearBackwardWeight({.dy = dh, .x = x, .dweight = dw1});
        }
    };

    // ---- T_comm: the step's collectives at its sizes ----------------------------------------------------------------

    void SetUpComm() {
        comm::Communicator& group = mesh_.group("tp");
        const Device dev = env_.device();
        const DType dt = run_.dtype;
        const std::int64_t big_bytes = tokens_ * h_ * static_cast<std::int64_t>(ElementSize(dt));
        for (const std::string& v : run_.options.variants) {
            const bool sp = v == "sp";
            auto bufs = std::make_shared<std::vector<Tensor>>();
            if (sp) {
                // all_gather small → big, reduce_scatter big → small, twice (forward: x, y; backward: dY, dX).
                for (int i = 0; i < 2; ++i) {
                    bufs->push_back(Tensor::Empty({tokens_ / tp_, h_}, dt, dev));
                    bufs->push_back(Tensor::Empty({tokens_, h_}, dt, dev));
                    bufs->push_back(Tensor::Empty({tokens_ / tp_, h_}, dt, dev));
                }
            } else {
                bufs->push_back(Tensor::Empty({tokens_, h_}, dt, dev));
                bufs->push_back(Tensor::Empty({tokens_, h_}, dt, dev));
            }
            for (std::size_t i = 0; i < bufs->size(); ++i) {
                FillRandom((*bufs)[i], RandomSpec{.seed = 23, .name = fmt::format("tp_mlp_bench/comm{}", i)});
            }
            Variant var{.name = "comm_" + v, .kind = "comm", .flops = 0.0};
            var.extra["bytes"] = big_bytes; // the [T, h] side of every collective, as nccl-tests counts it
            var.extra["collectives"] = sp ? "2 x (all_gather + reduce_scatter)" : "2 x all_reduce";
            if (sp) {
                var.run = [&group, bufs] {
                    for (int i = 0; i < 2; ++i) {
                        Tensor& small = (*bufs)[static_cast<std::size_t>(3 * i)];
                        Tensor& big = (*bufs)[static_cast<std::size_t>(3 * i + 1)];
                        Tensor& out = (*bufs)[static_cast<std::size_t>(3 * i + 2)];
                        group.AllGather(small, big)->Wait(/*host=*/false);
                        group.ReduceScatter(big, out, comm::ReduceOp::kSum)->Wait(/*host=*/false);
                    }
                };
            } else {
                var.run = [&group, bufs] {
                    for (Tensor& t : *bufs) {
                        group.AllReduce(t, comm::ReduceOp::kSum)->Wait(/*host=*/false);
                    }
                };
            }
            variants_.push_back(std::move(var));
        }
    }

    // ---- results -------------------------------------------------------------------------------------------------

    void Report() {
        std::map<std::string, std::pair<double, double>> stats; // name → (median, p90)
        for (const Variant& v : variants_) {
            if (!v.samples_us.empty()) {
                stats[v.name] = {bench::Percentile(v.samples_us, 0.5), bench::Percentile(v.samples_us, 0.9)};
            }
        }
        auto median = [&](const std::string& name) { return stats.count(name) ? stats[name].first : 0.0; };
        const double param_bytes =
            static_cast<double>(ElementSize(run_.dtype)) * static_cast<double>(2 * f_ * h_ + f_ + h_);
        const double act_bytes = static_cast<double>(ElementSize(run_.dtype)) * static_cast<double>(tokens_) *
                                 static_cast<double>(4 * h_ + 4 * f_);
        for (const Variant& v : variants_) {
            if (v.samples_us.empty()) {
                continue;
            }
            const auto [med, p90] = stats[v.name];
            json rec = {{"kind", "case"},
                        {"shape", state_.shape.name},
                        {"hidden", h_},
                        {"ffn", ff_},
                        {"tokens", tokens_},
                        {"variant", v.name},
                        {"median_us", med},
                        {"p90_us", p90},
                        {"iterations", v.samples_us.size()},
                        {"working_set_bytes", 2.0 * param_bytes + act_bytes}};
            rec.update(v.extra);
            if (v.flops > 0.0) {
                const double tflops = v.flops / (med * 1e-6) / 1e12;
                rec["flops_per_gpu"] = v.flops;
                rec["tflops"] = tflops;
                rec["frac_ceiling"] = run_.ceiling_tflops > 0.0 ? tflops / run_.ceiling_tflops : 0.0;
            }
            if (v.kind == "step") {
                const double t_compute = median("compute_" + v.name);
                const double t_comm = median("comm_" + v.name);
                const double lb_serial = t_compute + t_comm;
                const double lb_overlap = std::max(t_compute, t_comm);
                rec["t_compute_us"] = t_compute;
                rec["t_comm_us"] = t_comm;
                rec["t_gemm_us"] = median("gemm");
                rec["lb_serial_us"] = lb_serial;
                rec["lb_overlap_us"] = lb_overlap;
                rec["t_over_lb_serial"] = lb_serial > 0.0 ? med / lb_serial : 0.0;
                rec["t_over_lb_overlap"] = lb_overlap > 0.0 ? med / lb_overlap : 0.0;
                if (run_.rank0()) {
                    std::printf("%-8s %6lld %-3s %11.1f %11.1f %11.1f %11.1f %11.1f %11.1f %8.3f %8.1f\n",
                                state_.shape.name.c_str(), static_cast<long long>(tokens_), v.name.c_str(), med, p90,
                                t_compute, t_comm, lb_serial, lb_overlap, lb_serial > 0.0 ? med / lb_serial : 0.0,
                                rec.value("tflops", 0.0));
                    std::fflush(stdout);
                }
            }
            if (run_.rank0()) {
                run_.Emit(rec);
            }
        }
    }

    Run& run_;
    ShapeState& state_;
    std::int64_t tokens_;
    launch::Environment& env_;
    comm::DeviceMesh& mesh_;
    std::int64_t tp_ = 1, h_ = 0, ff_ = 0, f_ = 0;
    Tensor x_full_, dy_full_;
    std::unique_ptr<Reference> reference_;
    std::vector<Variant> variants_;
};

// ---------------------------------------------------------------------------------------------------------------------

int RunBench(launch::Environment& env, const Options& o) {
    Run run;
    run.env = &env;
    run.options = o;
    run.dtype = o.cpu ? DType::kFloat32 : DType::kBFloat16;
    run.commit = bench::Commit();
    run.date = bench::NowUtc();
    const int tp = env.world_size();
    SHARDLINE_CHECK(o.cpu || env.device().is_cuda(), kTool, "needs one GPU per rank (or --cpu), the world is '{}'",
                    env.world().backend());
    comm::DeviceMesh mesh(env.world(), {tp}, {"tp"});
    run.mesh = &mesh;
    mesh.group("tp"); // created up front, on every rank in one order
    run.device = "cpu";
#if SHARDLINE_HAVE_CUDA
    if (env.device().is_cuda()) {
        cudaDeviceProp prop{};
        SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, env.device().index));
        run.device = prop.name;
        const bench::GemmCeiling ceiling =
            bench::MeasureGemmCeiling(CudaContext::Get(env.device().index).stream(), env.device().index);
        // Every GPU measured its own; the slowest sets the ceiling of a step that waits for all.
        std::vector<double> tf = {-ceiling.tflops};
        AllReduceHost(env, tf, comm::ReduceOp::kMax);
        run.ceiling_tflops = -tf[0];
    }
#endif
    if (env.rank() == 0 && !o.json.empty()) {
        run.out.open(o.json, std::ios::app);
        SHARDLINE_CHECK(run.out.good(), kTool, "cannot open {} for appending", o.json);
        if (run.ceiling_tflops > 0.0) {
            run.Emit({{"kind", "calibration"}, {"what", "gemm_bf16_8192"}, {"tflops", run.ceiling_tflops}});
        }
    }
    if (env.rank() == 0) {
        const std::string nvls = env::Get("NCCL_NVLS_ENABLE").value_or("(unset)");
        std::printf("# shardline ParallelMLP fwd+bwd, tp %d (%s), %s, %s, commit %s, %s, NCCL_NVLS_ENABLE=%s, "
                    "backward overlap %s, comm_chunks %d\n",
                    tp, std::string(env.world().backend()).c_str(), run.device.c_str(), o.cpu ? "fp32" : "bf16",
                    run.commit.c_str(), run.date.c_str(), nvls.c_str(), o.no_overlap ? "off" : "on", o.chunks);
        std::printf("# ceiling (8192^3 bf16 cuBLASLt GEMM, slowest rank): %.1f TF/s; warmup %d, %d rounds x %d iters; "
                    "TF/GPU = 12*T*h*ff/tp / t\n",
                    run.ceiling_tflops, o.warmup, o.rounds, o.iters);
        std::printf("%-8s %6s %-3s %11s %11s %11s %11s %11s %11s %8s %8s\n", "shape", "tokens", "var", "T_us", "p90_us",
                    "Tcompute", "Tcomm", "LB_serial", "LB_overlap", "T/LBs", "TF/GPU");
        std::fflush(stdout);
    }
    for (const MlpShape& s : o.shapes) {
        SHARDLINE_CHECK(s.ffn % tp == 0, kTool, "shape {}: ffn ({}) must be divisible by tp ({})", s.name, s.ffn, tp);
        ShapeState state;
        state.shape = s;
        for (const std::string& v : o.variants) {
            // Same seed and names: both modules hold the same parameters.
            state.mlp[v] = std::make_unique<nn::ParallelMLP>(
                nn::ParallelMLPOptions{.hidden = s.hidden,
                                       .ffn_hidden = s.ffn,
                                       .bias = true,
                                       .sequence_parallel = v == "sp",
                                       .approximation = kernels::GeluApproximation::kTanh,
                                       .overlap_grad_comm = !o.no_overlap,
                                       .comm_chunks = o.chunks},
                nn::TensorParallelGroup::Named(mesh, "tp"),
                nn::ParameterOptions{.dtype = run.dtype, .device = env.device(), .seed = 5, .name = "mlp"});
        }
        for (const std::int64_t tokens : o.tokens) {
            CaseRunner(run, state, tokens).Execute();
        }
    }
    if (env.rank() == 0 && run.gate_failures > 0) {
        std::fprintf(stderr, "%s: %d gate failure(s): those variants were not timed\n", std::string(kTool).c_str(),
                     run.gate_failures);
    }
    return run.gate_failures > 0 ? 1 : 0;
}

} // namespace

int main(int argc, char** argv) {
    Options options;
    if (const int code = ParseCommandLine(argc, argv, options); code >= 0) {
        return code;
    }
    if (options.list_cases) {
        std::printf("%s\n", CasesJson(options).dump(2).c_str());
        return 0;
    }
    const auto backend = options.cpu ? shardline::launch::BackendChoice::kCpu : shardline::launch::BackendChoice::kCuda;
    return shardline::launch::RunMain(&argc, &argv, {.backend = backend},
                                      [&](shardline::launch::Environment& env) { return RunBench(env, options); });
}
