// shardline-linear-bench: single-GPU Linear layers against cuBLASLt floors (and, through bench/peers/linear_peer.py,
// torch), following the project's benchmark rules (shared/BENCHMARKS.md, outside this repository).
//
//   1. Calibration: an 8192³ bf16 GEMM (cuBLASLt, best of the heuristic's top 8: the ceiling) and a 1 GiB device copy.
//   2. Cases (shape, M, dtype): shardline forward (with and without bias), backward (LinearBackward: dX, dW, db;
//      and the split ops), forward+backward, with the default and legacy providers; plain cuBLASLt GEMMs for the three
//      products (the heuristic's first pick and the best of its top 8) and, in bf16, the BIAS-epilogue forward that
//      torch's F.linear issues (floor_fwdbias_h1: its first pick, timed beside ours in this process); decode under a
//      CUDA graph (fwd_graph: the GPU time per call without the launch); fp32 main-grad accumulation against a bf16 dW.
//      Each variant passes a correctness gate (sampled outputs against float64 host sums) before it is timed.
//   3. Host cost: 2000 back-to-back calls without synchronising (LinearForward, a raw cublasLtMatmul, a fwd+bwd step
//      through the kernels) and the same step replayed as a CUDA graph.
//
// Timing: CUDA events around every iteration on the context stream; warm-ups, then `rounds` rounds in which every
// variant of the case runs `iters` iterations in turn (A B A B ...); median and p90 over all timed iterations. Inputs
// are random normal; when a set of operands fits in 3x the L2 cache, iterations rotate over enough sets to defeat it.
//
// Options: `shardline-linear-bench --help` lists them with their defaults (ParseCommandLine below).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/gemm_tuning.h>
#include <shardline/kernels/linear.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/cublaslt_floor.h"
#include "common/cuda_graph.h"

namespace shardline::bench {
cudaError_t LaunchEmptyKernel(cudaStream_t stream); // host_floor.cu
/// cuStreamIsCapturing through the driver's entry point: 1 capturing, 0 not, -1 an error; null when not found.
int (*DriverStreamIsCapturing())(cudaStream_t); // host_floor.cu
} // namespace shardline::bench

namespace {

using namespace shardline;
using namespace shardline::kernels;
using json = nlohmann::json;

constexpr std::string_view kTool = "shardline-linear-bench";

// ---------------------------------------------------------------------------------------------------------------------
// Options and cases

struct Options {
    std::string suite = "full";
    std::set<std::string> regimes;
    std::set<std::string> shapes; ///< empty: every shape of the suite
    int warmup = 10;
    int iters = 10;
    int rounds = 5;
    int host_calls = 2000;
    std::string json;
    bool list_cases = false;
};

constexpr int kIntMax = std::numeric_limits<int>::max();

/// Parses argv into `o`; returns -1 to go on, else the exit code (--help, or CLI11's code for a bad command line).
int ParseCommandLine(int argc, char** argv, Options& o) {
    CLI::App app{"shardline-linear-bench: single-GPU Linear layers against cuBLASLt floors (the torch peer runs the "
                 "cases --list-cases prints)",
                 std::string(kTool)};
    bench::UseBenchDefaults(app);
    std::string regimes = "decode,prefill,training,dtypes,odd,host";
    std::string shapes;
    app.add_option("--suite", o.suite, "quick or full")->check(CLI::IsMember({"quick", "full"}));
    app.add_option("--regimes", regimes, "regimes to run, comma-separated (those of the suite)")
        ->type_name("LIST")
        ->check(bench::ListOf({"decode", "prefill", "training", "dtypes", "odd", "host"}));
    app.add_option("--shapes", shapes, "shapes to run, comma-separated (empty: every shape of the suite)")
        ->type_name("LIST");
    app.add_option("--warmup", o.warmup, "untimed iterations per variant")->check(CLI::Range(0, kIntMax));
    app.add_option("--iters", o.iters, "timed iterations per variant and round")->check(CLI::Range(1, kIntMax));
    app.add_option("--rounds", o.rounds, "rounds over the variants of a case (A B A B ...)")
        ->check(CLI::Range(1, kIntMax));
    app.add_option("--host-calls", o.host_calls, "back-to-back calls of the host-cost regime")
        ->check(CLI::Range(1, kIntMax));
    app.add_option("--json", o.json, "append one JSON line per measurement to PATH")->type_name("PATH");
    app.add_flag("--list-cases", o.list_cases, "print the suite's cases as JSON (for the torch peer) and exit");
    CLI11_PARSE(app, argc, argv);
    for (const std::string& r : bench::SplitList(regimes)) {
        o.regimes.insert(r);
    }
    for (const std::string& name : bench::SplitList(shapes)) {
        o.shapes.insert(name);
    }
    return -1;
}

/// Row-major Y[M,N] = X[M,K]·W[N,K]ᵀ + b: K = in_features, N = out_features.
struct Shape2 {
    std::string name;
    std::int64_t k;
    std::int64_t n;
};
const std::vector<Shape2> kLlamaShapes = {
    {"8b-tp1-qkv", 4096, 6144},  {"8b-tp1-o", 4096, 4096},  {"8b-tp1-up", 4096, 14336}, {"8b-tp1-down", 14336, 4096},
    {"8b-tp4-qkv", 4096, 1536},  {"8b-tp4-o", 1024, 4096},  {"8b-tp4-up", 4096, 3584},  {"8b-tp4-down", 3584, 4096},
    {"70b-tp4-qkv", 8192, 2560}, {"70b-tp4-o", 2048, 8192}, {"70b-tp4-up", 8192, 7168}, {"70b-tp4-down", 7168, 8192},
};

struct Case {
    std::string regime;
    std::string shape;
    std::int64_t m = 0;
    std::int64_t k = 0;
    std::int64_t n = 0;
    std::string dtype = "bf16"; ///< bf16, fp16, fp32, tf32
    bool backward = true;       ///< also bwd and fwd+bwd (decode: forward only)
    bool legacy = true;         ///< also the legacy provider
    bool floors = true;         ///< also the plain cuBLASLt GEMMs
    bool main_grad = false;     ///< also fp32 main-grad accumulation vs bf16 dW
    bool extras = true;         ///< also forward without bias and the split backward ops
    int iters_scale_down = 1;   ///< fp32 (no TF32) runs fewer iterations
};

json CaseJson(const Case& c) {
    return json{{"regime", c.regime}, {"shape", c.shape},      {"m", c.m}, {"k", c.k}, {"n", c.n},
                {"dtype", c.dtype},   {"backward", c.backward}};
}

std::vector<Case> Cases(const Options& o) {
    const bool quick = o.suite == "quick";
    std::vector<Case> cases;
    auto want = [&](const char* regime) { return o.regimes.count(regime) > 0; };
    const std::vector<Shape2> quick_shapes = {kLlamaShapes[0], kLlamaShapes[1], kLlamaShapes[2], kLlamaShapes[3]};
    const std::vector<Shape2>& shapes = quick ? quick_shapes : kLlamaShapes;
    if (want("decode")) {
        for (const std::int64_t m : {1, 32}) {
            for (const Shape2& s : shapes) {
                if (quick && s.name != "8b-tp1-o") {
                    continue;
                }
                cases.push_back(
                    Case{.regime = "decode", .shape = s.name, .m = m, .k = s.k, .n = s.n, .backward = false});
            }
        }
    }
    if (want("prefill") && !quick) {
        for (const Shape2& s : shapes) {
            cases.push_back(Case{.regime = "prefill", .shape = s.name, .m = 2048, .k = s.k, .n = s.n});
        }
    }
    if (want("training")) {
        for (const std::int64_t m : {8192, 16384}) {
            if (quick && m == 16384) {
                continue;
            }
            // The full protocol for shardline and torch at both M; legacy, floors and the extra variants at 8192 only
            // (they answer per-shape questions, and the device time of a run is limited).
            const bool full = m == 8192;
            for (const Shape2& s : shapes) {
                cases.push_back(Case{.regime = "training",
                                     .shape = s.name,
                                     .m = m,
                                     .k = s.k,
                                     .n = s.n,
                                     .legacy = full,
                                     .floors = full,
                                     .main_grad = full,
                                     .extras = full});
            }
        }
    }
    if (want("dtypes") && !quick) {
        for (const char* dtype : {"fp16", "tf32", "fp32"}) {
            for (std::size_t i = 0; i < 4; ++i) {
                const Shape2& s = kLlamaShapes[i];
                const bool fp32 = std::string_view(dtype) == "fp32";
                cases.push_back(Case{.regime = "dtypes",
                                     .shape = s.name,
                                     .m = 8192,
                                     .k = s.k,
                                     .n = s.n,
                                     .dtype = dtype,
                                     .legacy = false,
                                     .floors = false,
                                     .extras = false,
                                     .iters_scale_down = fp32 ? 5 : 1});
            }
        }
    }
    if (want("odd") && !quick) {
        cases.push_back(Case{.regime = "odd", .shape = "odd-5120x13824", .m = 8192, .k = 5120, .n = 13824});
        cases.push_back(Case{.regime = "odd", .shape = "misaligned-k4100", .m = 8192, .k = 4100, .n = 4096});
    }
    if (!o.shapes.empty()) {
        std::erase_if(cases, [&](const Case& c) { return o.shapes.count(c.shape) == 0; });
    }
    return cases;
}

// ---------------------------------------------------------------------------------------------------------------------
// Run metadata (bench/common/bench_util.h)

using bench::ChooseBest;
using bench::Commit;
using bench::FloorChoice;
using bench::LtFloor;
using bench::MedianUs;
using bench::Percentile;

struct Run {
    std::string device;
    std::string commit;
    std::string date;
    std::size_t l2_bytes = 0;
    double ceiling_tflops = 0.0;
    double copy_tbps = 0.0;
    std::ofstream out;
    cudaStream_t stream = nullptr;

    void Emit(json rec) {
        rec["impl"] = rec.value("impl", "shardline");
        rec["device"] = device;
        rec["commit"] = commit;
        rec["date"] = date;
        if (out.is_open()) {
            out << rec.dump() << '\n';
            out.flush();
        }
    }
};

// ---------------------------------------------------------------------------------------------------------------------
// Host-side spot checks (the correctness gate): sampled outputs against float64 sums of the device inputs.

DType ParseBenchDType(const std::string& d) {
    if (d == "bf16") {
        return DType::kBFloat16;
    }
    if (d == "fp16") {
        return DType::kFloat16;
    }
    return DType::kFloat32; // fp32, tf32
}

double GateTolerance(const std::string& d) {
    if (d == "bf16") {
        return 3e-2;
    }
    if (d == "fp16") {
        return 4e-3;
    }
    if (d == "tf32") {
        return 1e-2;
    }
    return 1e-4;
}

double HostValue(const unsigned char* p, DType d) {
    if (d == DType::kBFloat16) {
        __nv_bfloat16 v;
        std::memcpy(&v, p, sizeof(v));
        return static_cast<double>(__bfloat162float(v));
    }
    if (d == DType::kFloat16) {
        __half v;
        std::memcpy(&v, p, sizeof(v));
        return static_cast<double>(__half2float(v));
    }
    float v;
    std::memcpy(&v, p, sizeof(v));
    return static_cast<double>(v);
}

/// Row r of a row-major [rows, cols] device tensor.
std::vector<double> Row(const Tensor& t, std::int64_t r) {
    const std::int64_t cols = t.shape().back();
    const std::size_t es = ElementSize(t.dtype());
    std::vector<unsigned char> buf(static_cast<std::size_t>(cols) * es);
    SHARDLINE_CHECK_CUDA(
        cudaMemcpy(buf.data(), static_cast<const char*>(t.data()) + r * cols * es, buf.size(), cudaMemcpyDeviceToHost));
    std::vector<double> out(static_cast<std::size_t>(cols));
    for (std::int64_t c = 0; c < cols; ++c) {
        out[static_cast<std::size_t>(c)] = HostValue(buf.data() + c * es, t.dtype());
    }
    return out;
}

/// Column c of a row-major [rows, cols] device tensor.
std::vector<double> Column(const Tensor& t, std::int64_t c) {
    const std::int64_t cols = t.shape().back();
    const std::int64_t rows = t.numel() / cols;
    const std::size_t es = ElementSize(t.dtype());
    std::vector<unsigned char> buf(static_cast<std::size_t>(rows) * es);
    SHARDLINE_CHECK_CUDA(cudaMemcpy2D(buf.data(), es, static_cast<const char*>(t.data()) + c * es, cols * es, es,
                                      static_cast<std::size_t>(rows), cudaMemcpyDeviceToHost));
    std::vector<double> out(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
        out[static_cast<std::size_t>(r)] = HostValue(buf.data() + r * es, t.dtype());
    }
    return out;
}

double Element(const Tensor& t, std::int64_t r, std::int64_t c) {
    const std::int64_t cols = t.shape().back();
    const std::size_t es = ElementSize(t.dtype());
    unsigned char buf[8];
    SHARDLINE_CHECK_CUDA(
        cudaMemcpy(buf, static_cast<const char*>(t.data()) + (r * cols + c) * es, es, cudaMemcpyDeviceToHost));
    return HostValue(buf, t.dtype());
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        s += a[i] * b[i];
    }
    return s;
}

/// Sampled (actual, expected) pairs; passes when every |a - e| <= tol · max(|e|, rms(expected)).
struct Samples {
    std::vector<double> actual;
    std::vector<double> expected;
    void Add(double a, double e) {
        actual.push_back(a);
        expected.push_back(e);
    }
    std::string Check(double tol, std::string_view what) const {
        double sq = 0.0;
        for (double e : expected) {
            sq += e * e;
        }
        const double rms = expected.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(expected.size()));
        for (std::size_t i = 0; i < actual.size(); ++i) {
            const double allowed = tol * std::max(std::abs(expected[i]), rms);
            if (!(std::abs(actual[i] - expected[i]) <= allowed)) {
                return fmt::format("{}: sample {} is {} against {} (allowed error {})", what, i, actual[i], expected[i],
                                   allowed);
            }
        }
        return rms > 0.0 ? std::string() : fmt::format("{}: every sampled reference is 0", what);
    }
};

// ---------------------------------------------------------------------------------------------------------------------
// One case: operand sets, variants, interleaved timing

struct OperandSet {
    Tensor x, w, b, dy, y, dx, dw, db;
};

struct Variant {
    std::string name;     ///< fwd, bwd, fwdbwd, ...
    std::string provider; ///< default, legacy, cublaslt
    double flops = 0.0;
    std::function<void()> before; ///< provider / TF32 selection, run before each batch
    std::function<void(int)> run; ///< one iteration on operand set i
    std::function<std::string()> gate;
    std::vector<double> samples_us;
    int calls = 1; ///< layer calls per iteration (a CUDA graph of several): samples are per call
};

struct CaseResult {
    std::map<std::string, double> median_us; ///< by "provider/variant"
};

class CaseRunner {
public:
    CaseRunner(Run& run, const Options& o, const Case& c) : run_(run), o_(o), c_(c) {
        dtype_ = ParseBenchDType(c.dtype);
        tf32_ = c.dtype == "tf32";
        const std::size_t es = ElementSize(dtype_);
        const std::int64_t m = c.m;
        const std::int64_t k = c.k;
        const std::int64_t n = c.n;
        const double set_bytes =
            static_cast<double>(es) *
            static_cast<double>(m * k + n * k + n + (c.backward ? 2 * m * n + m * k + n * k : m * n));
        const double l2 = static_cast<double>(run.l2_bytes);
        sets_ = set_bytes < 3.0 * l2 ? static_cast<int>(std::min(16.0, std::ceil(3.0 * l2 / set_bytes))) : 1;
        const Device gpu = Device::CUDA(0);
        for (int s = 0; s < sets_; ++s) {
            OperandSet set;
            const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(s);
            set.x = Tensor::Empty({m, k}, dtype_, gpu);
            set.w = Tensor::Empty({n, k}, dtype_, gpu);
            set.b = Tensor::Empty({n}, dtype_, gpu);
            set.y = Tensor::Empty({m, n}, dtype_, gpu);
            FillRandom(set.x, RandomSpec{.seed = seed, .name = "x"});
            FillRandom(set.w, RandomSpec{.seed = seed, .name = "w", .b = 1.0 / std::sqrt(static_cast<double>(k))});
            FillRandom(set.b, RandomSpec{.seed = seed, .name = "b"});
            if (c.backward) {
                set.dy = Tensor::Empty({m, n}, dtype_, gpu);
                set.dx = Tensor::Empty({m, k}, dtype_, gpu);
                set.dw = Tensor::Empty({n, k}, dtype_, gpu);
                set.db = Tensor::Empty({n}, dtype_, gpu);
                FillRandom(set.dy, RandomSpec{.seed = seed, .name = "dy"});
            }
            sets_data_.push_back(std::move(set));
        }
        if (c.main_grad) {
            main_dw_ = Tensor::Zeros({n, k}, DType::kFloat32, gpu);
        }
        Synchronize(gpu);
    }
    ~CaseRunner() = default;
    CaseRunner(const CaseRunner&) = delete;
    CaseRunner& operator=(const CaseRunner&) = delete;

    CaseResult Execute() {
        BuildVariants();
        for (Variant& v : variants_) {
            v.before();
            const std::string failure = v.gate();
            if (!failure.empty()) {
                std::fprintf(stderr, "GATE FAILED %s %s %s/%s: %s\n", c_.shape.c_str(), c_.dtype.c_str(),
                             v.provider.c_str(), v.name.c_str(), failure.c_str());
                gate_failures_++;
                v.run = nullptr; // not timed
            }
        }
        const int warmup = std::max(1, o_.warmup / c_.iters_scale_down);
        const int iters = std::max(2, o_.iters / c_.iters_scale_down);
        const int rounds = c_.iters_scale_down > 1 ? std::max(1, o_.rounds / 2) : o_.rounds;
        std::vector<cudaEvent_t> ev(static_cast<std::size_t>(2 * iters));
        for (auto& e : ev) {
            SHARDLINE_CHECK_CUDA(cudaEventCreate(&e));
        }
        int rotation = 0;
        for (Variant& v : variants_) {
            if (!v.run) {
                continue;
            }
            v.before();
            for (int i = 0; i < warmup; ++i) {
                v.run(rotation++ % sets_);
            }
        }
        for (int r = 0; r < rounds; ++r) {
            for (Variant& v : variants_) {
                if (!v.run) {
                    continue;
                }
                v.before();
                SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(run_.stream));
                for (int i = 0; i < iters; ++i) {
                    SHARDLINE_CHECK_CUDA(cudaEventRecord(ev[2 * i], run_.stream));
                    v.run(rotation++ % sets_);
                    SHARDLINE_CHECK_CUDA(cudaEventRecord(ev[2 * i + 1], run_.stream));
                }
                SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(run_.stream));
                for (int i = 0; i < iters; ++i) {
                    float ms = 0.0f;
                    SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                    v.samples_us.push_back(1000.0 * ms / v.calls);
                }
            }
        }
        for (auto& e : ev) {
            SHARDLINE_CHECK_CUDA(cudaEventDestroy(e));
        }
        SetProvider(kDefaultProvider);
        CudaContext::Get(0).SetAllowTf32(false);
        CaseResult result;
        for (const Variant& v : variants_) {
            if (v.samples_us.empty()) {
                continue;
            }
            const double med = Percentile(v.samples_us, 0.5);
            const double p90 = Percentile(v.samples_us, 0.9);
            const double tflops = v.flops / (med * 1e-6) / 1e12;
            result.median_us[v.provider + "/" + v.name] = med;
            json rec = CaseJson(c_);
            rec["kind"] = "case";
            rec["impl"] = v.provider == "cublaslt" ? "cublaslt" : "shardline";
            rec["provider"] = v.provider;
            rec["variant"] = v.name;
            rec["median_us"] = med;
            rec["p90_us"] = p90;
            rec["iterations"] = v.samples_us.size();
            rec["tflops"] = tflops;
            rec["frac_ceiling"] = run_.ceiling_tflops > 0 ? tflops / run_.ceiling_tflops : 0.0;
            rec["operand_sets"] = sets_;
            if (v.name.rfind("floor", 0) == 0 && floor_choice_.count(v.name) > 0) {
                rec["candidates"] = floor_choice_[v.name].first;
                rec["best_index"] = floor_choice_[v.name].second;
            }
            run_.Emit(rec);
        }
        return result;
    }

    int gate_failures() const { return gate_failures_; }
    int sets() const { return sets_; }

private:
    const OperandSet& S(int i) const { return sets_data_[static_cast<std::size_t>(i)]; }
    OperandSet& S(int i) { return sets_data_[static_cast<std::size_t>(i)]; }

    void Forward(int i, bool bias) {
        OperandSet& s = S(i);
        LinearForward(LinearForwardArgs{.x = s.x, .weight = s.w, .bias = bias ? &s.b : nullptr, .y = s.y});
    }
    void Backward(int i) {
        OperandSet& s = S(i);
        LinearBackward(
            LinearBackwardArgs{.dy = s.dy, .x = &s.x, .weight = &s.w, .dx = &s.dx, .dweight = &s.dw, .dbias = &s.db});
    }
    void BackwardSplit(int i) {
        OperandSet& s = S(i);
        LinearBackwardInput(LinearBackwardInputArgs{.dy = s.dy, .weight = s.w, .dx = s.dx});
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = s.dw, .dbias = &s.db});
    }

    // Gates: sampled outputs of operand set 0 against float64 sums.
    std::string GateForward(bool bias) {
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(run_.stream)); // the reads below use the legacy stream
        const OperandSet& s = S(0);
        std::mt19937_64 rng(7);
        Samples y;
        for (int t = 0; t < 8; ++t) {
            const std::int64_t i = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c_.m));
            const std::int64_t j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c_.n));
            const double ref = Dot(Row(s.x, i), Row(s.w, j)) + (bias ? Element(s.b.View({1, c_.n}), 0, j) : 0.0);
            y.Add(Element(s.y, i, j), ref);
        }
        return y.Check(GateTolerance(c_.dtype), "y");
    }
    std::string GateBackward(bool dx, bool dw, bool db, const Tensor* dw_tensor = nullptr) {
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(run_.stream)); // the reads below use the legacy stream
        const OperandSet& s = S(0);
        std::mt19937_64 rng(8);
        const double tol = GateTolerance(c_.dtype);
        Samples sx, sw, sb;
        for (int t = 0; t < 8; ++t) {
            const std::int64_t i = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c_.m));
            const std::int64_t j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c_.n));
            const std::int64_t kk = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c_.k));
            if (dx) {
                sx.Add(Element(s.dx, i, kk), Dot(Row(s.dy, i), Column(s.w, kk)));
            }
            if (dw || db) {
                const std::vector<double> dy_col = Column(s.dy, j);
                if (dw) {
                    sw.Add(Element(dw_tensor != nullptr ? *dw_tensor : s.dw, j, kk), Dot(dy_col, Column(s.x, kk)));
                }
                if (db) {
                    double sum = 0.0;
                    for (double v : dy_col) {
                        sum += v;
                    }
                    sb.Add(Element(s.db.View({1, c_.n}), 0, j), sum);
                }
            }
        }
        std::string failure;
        if (dx) {
            failure += sx.Check(tol, "dx");
        }
        if (dw) {
            failure += sw.Check(tol, "dw");
        }
        if (db) {
            failure += sb.Check(tol, "db");
        }
        return failure;
    }

    void AddVariant(std::string name, std::string provider, double flops, std::function<void(int)> fn,
                    std::function<std::string()> gate, int calls = 1) {
        const bool tf32 = tf32_;
        std::function<void()> before = [provider, tf32] {
            if (provider == "legacy") {
                SetProvider(kLegacyProvider);
            } else {
                SetProvider(kDefaultProvider);
            }
            CudaContext::Get(0).SetAllowTf32(tf32);
        };
        variants_.push_back(Variant{.name = std::move(name),
                                    .provider = std::move(provider),
                                    .flops = flops,
                                    .before = std::move(before),
                                    .run = std::move(fn),
                                    .gate = std::move(gate),
                                    .samples_us = {},
                                    .calls = calls});
    }

    void BuildVariants() {
        const double f = 2.0 * static_cast<double>(c_.m) * static_cast<double>(c_.n) * static_cast<double>(c_.k);
        const cudaStream_t stream = run_.stream;
        std::vector<std::string> providers = {"default"};
        if (c_.legacy) {
            providers.push_back("legacy");
        }
        for (const std::string& p : providers) {
            AddVariant(
                "fwd", p, f, [this](int i) { Forward(i, true); },
                [this] {
                    Forward(0, true);
                    return GateForward(true);
                });
            if (!c_.backward) {
                continue;
            }
            AddVariant(
                "bwd", p, 2 * f, [this](int i) { Backward(i); },
                [this] {
                    Backward(0);
                    return GateBackward(true, true, true);
                });
            AddVariant(
                "fwdbwd", p, 3 * f,
                [this](int i) {
                    Forward(i, true);
                    Backward(i);
                },
                [this] {
                    Forward(0, true);
                    Backward(0);
                    return GateForward(true) + GateBackward(true, true, true);
                });
        }
        if (c_.extras) {
            AddVariant(
                "fwd_nobias", "default", f, [this](int i) { Forward(i, false); },
                [this] {
                    Forward(0, false);
                    return GateForward(false);
                });
        }
        if (c_.backward && c_.extras) {
            AddVariant(
                "bwd_split", "default", 2 * f, [this](int i) { BackwardSplit(i); },
                [this] {
                    BackwardSplit(0);
                    return GateBackward(true, true, true);
                });
        }
        if (c_.main_grad) {
            AddVariant(
                "wgrad_bf16", "default", f,
                [this](int i) {
                    OperandSet& s = S(i);
                    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = s.dw});
                },
                [this] {
                    OperandSet& s = S(0);
                    LinearBackwardWeight(LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = s.dw});
                    return GateBackward(false, true, false);
                });
            AddVariant(
                "wgrad_fp32_main_grad", "default", f,
                [this](int i) {
                    OperandSet& s = S(i);
                    LinearBackwardWeight(
                        LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = main_dw_, .accumulate = true});
                },
                [this] {
                    OperandSet& s = S(0);
                    main_dw_.Fill(0.0);
                    LinearBackwardWeight(
                        LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = main_dw_, .accumulate = true});
                    return GateBackward(false, true, false, &main_dw_);
                });
            AddVariant(
                "wgrad_bias", "default", f,
                [this](int i) {
                    OperandSet& s = S(i);
                    LinearBackwardWeight(
                        LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = s.dw, .dbias = &s.db});
                },
                [this] {
                    OperandSet& s = S(0);
                    LinearBackwardWeight(
                        LinearBackwardWeightArgs{.dy = s.dy, .x = s.x, .dweight = s.dw, .dbias = &s.db});
                    return GateBackward(false, true, true);
                });
        }
        if (c_.regime == "decode") {
            AddDecodeGraphVariant();
        }
        if (!c_.floors) {
            return;
        }
        // Plain cuBLASLt GEMMs, the operands derived as in linear.cc:
        //   fwd   Yᶜ[N,M] = Wᶜᵀ·Xᶜ:   m=N n=M k=K, A = W (ld K, T), B = X (ld K)
        //   dgrad dXᶜ[K,M] = Wᶜ·dYᶜ:  m=K n=M k=N, A = W (ld K),    B = dY (ld N)
        //   wgrad dWᶜ[K,N] = Xᶜ·dYᶜᵀ: m=K n=N k=M, A = X (ld K),    B = dY (ld N, T)
        //   fwdbias: fwd + b through CUBLASLT_EPILOGUE_BIAS, the call torch's F.linear makes (its h1 is torch's
        //   pick: the heuristic's first), timed in this process beside shardline's tuned forward.
        const std::int64_t M = c_.m, K = c_.k, N = c_.n;
        struct Product {
            const char* name;
            std::unique_ptr<LtFloor> floor;
            std::function<const void*(int)> a, b;
            std::function<void*(int)> c;
            std::function<const void*(int)> bias;
            std::function<std::string()> gate;
        };
        std::vector<Product> products;
        auto w = [this](int i) { return S(i).w.data(); };
        auto x = [this](int i) { return S(i).x.data(); };
        auto dy = [this](int i) { return S(i).dy.data(); };
        products.push_back({"fwd",
                            std::make_unique<LtFloor>(true, false, N, M, K, K, K, N, dtype_, dtype_, tf32_, 0.0f), w, x,
                            [this](int i) { return S(i).y.data(); }, nullptr, [this] { return GateForward(false); }});
        // Not at decode: torch's addmm takes cuBLASLt's bias path only for more than one row.
        if (c_.dtype == "bf16" && c_.regime != "decode") {
            products.push_back(
                {"fwdbias",
                 std::make_unique<LtFloor>(true, false, N, M, K, K, K, N, dtype_, dtype_, tf32_, 0.0f, S(0).b.data()),
                 w, x, [this](int i) { return S(i).y.data(); }, [this](int i) { return S(i).b.data(); },
                 [this] { return GateForward(true); }});
        }
        if (c_.backward) {
            products.push_back({"dgrad",
                                std::make_unique<LtFloor>(false, false, K, M, N, K, N, K, dtype_, dtype_, tf32_, 0.0f),
                                w, dy, [this](int i) { return S(i).dx.data(); }, nullptr,
                                [this] { return GateBackward(true, false, false); }});
            products.push_back({"wgrad",
                                std::make_unique<LtFloor>(false, true, K, N, M, K, N, K, dtype_, dtype_, tf32_, 0.0f),
                                x, dy, [this](int i) { return S(i).dw.data(); }, nullptr,
                                [this] { return GateBackward(false, true, false); }});
        }
        for (Product& prod : products) {
            const LtFloor* floor = prod.floor.get();
            floors_.push_back(std::move(prod.floor));
            auto a = prod.a, b = prod.b;
            auto out = prod.c;
            auto bias = prod.bias ? prod.bias : [](int) -> const void* { return nullptr; };
            const FloorChoice choice = ChooseBest(
                *floor, sets_,
                [floor, a, b, out, bias, stream](std::size_t algo, int i) {
                    return floor->Run(algo, a(i), b(i), out(i), stream, bias(i));
                },
                stream);
            for (const bool best : {false, true}) {
                const std::string name = fmt::format("floor_{}_{}", prod.name, best ? "top8" : "h1");
                const std::size_t algo = best ? choice.best : 0;
                floor_choice_[name] = {static_cast<int>(floor->candidates()), static_cast<int>(algo)};
                auto gate = prod.gate;
                AddVariant(
                    name, "cublaslt", f,
                    [floor, a, b, out, bias, algo, stream](int i) {
                        SHARDLINE_CHECK(floor->Run(algo, a(i), b(i), out(i), stream, bias(i)), kTool,
                                        "cublasLtMatmul failed");
                    },
                    [floor, a, b, out, bias, algo, stream, gate] {
                        SHARDLINE_CHECK(floor->Run(algo, a(0), b(0), out(0), stream, bias(0)), kTool,
                                        "cublasLtMatmul failed");
                        return gate();
                    });
            }
        }
    }

    /// Decode under a CUDA graph: the forward of every operand set (at least 8 calls) captured once and replayed, so
    /// the GPU time per call shows without the host's launch cost (what a serving loop that captures its decode step
    /// pays). Captured after an eager call on every set built and tuned their plans.
    void AddDecodeGraphVariant() {
        const int calls = sets_ * ((8 + sets_ - 1) / sets_); // at least 8, every set as often
        const cudaStream_t stream = run_.stream;
        auto capture = [this, calls, stream] {
            if (graph_) {
                return;
            }
            for (int i = 0; i < sets_; ++i) {
                Forward(i, true); // every set's plan (alignment is in its key), built and tuned outside the capture
            }
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
            graph_ = bench::CudaGraph(stream, [this, calls] {
                for (int i = 0; i < calls; ++i) {
                    Forward((i + 1) % sets_, true); // set 0 last: the gate reads its output
                }
            });
        };
        const double f = 2.0 * static_cast<double>(c_.m) * static_cast<double>(c_.n) * static_cast<double>(c_.k);
        AddVariant(
            "fwd_graph", "default", f, [this](int) { graph_.Launch(); },
            [this, capture, stream] {
                capture();
                // NaN bytes first: the gate then passes only if the replay itself wrote set 0's output.
                SHARDLINE_CHECK_CUDA(cudaMemsetAsync(S(0).y.data(), 0xFF, S(0).y.nbytes(), stream));
                graph_.Launch();
                return GateForward(true);
            },
            calls);
    }

    Run& run_;
    const Options& o_;
    const Case& c_;
    DType dtype_ = DType::kBFloat16;
    bool tf32_ = false;
    int sets_ = 1;
    std::vector<OperandSet> sets_data_;
    Tensor main_dw_;
    std::vector<Variant> variants_;
    std::vector<std::unique_ptr<LtFloor>> floors_;
    bench::CudaGraph graph_; ///< decode: the captured forwards of fwd_graph
    std::map<std::string, std::pair<int, int>> floor_choice_;
    int gate_failures_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// Calibration

void Calibrate(Run& run) {
    const Device gpu = Device::CUDA(0);
    {
        const bench::GemmCeiling ceiling = bench::MeasureGemmCeiling(run.stream);
        run.ceiling_tflops = ceiling.tflops;
        run.Emit(json{{"kind", "calibration"},
                      {"what", "gemm_bf16_8192"},
                      {"median_us", ceiling.median_us},
                      {"tflops", ceiling.tflops},
                      {"first_pick_tflops", ceiling.first_pick_tflops},
                      {"best_index", ceiling.best_index}});
    }
    {
        const std::size_t bytes = std::size_t{1} << 30;
        Tensor src = Tensor::Empty({static_cast<std::int64_t>(bytes / 2)}, DType::kBFloat16, gpu);
        Tensor dst = Tensor::Empty({static_cast<std::int64_t>(bytes / 2)}, DType::kBFloat16, gpu);
        FillRandom(src, RandomSpec{.seed = 1, .name = "copy"});
        const double us = MedianUs(run.stream, 3, 20, [&] {
            SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, run.stream));
        });
        run.copy_tbps = 2.0 * static_cast<double>(bytes) / (us * 1e-6) / 1e12;
        run.Emit(json{{"kind", "calibration"}, {"what", "copy_1gib"}, {"median_us", us}, {"tbps", run.copy_tbps}});
    }
    std::printf("# calibration: bf16 8192^3 GEMM %.1f TF/s (ceiling), 1 GiB device copy %.2f TB/s\n",
                run.ceiling_tflops, run.copy_tbps);
}

// ---------------------------------------------------------------------------------------------------------------------
// Host cost

/// Wall-clock µs per call of `calls` back-to-back calls without synchronising (after warm-ups); also the device
/// time per call, to show whether the host (not the GPU) set the pace.
struct HostCost {
    double host_us = 0.0;
    double device_us = 0.0;
};
HostCost TimeHost(cudaStream_t stream, int calls, const std::function<void()>& fn) {
    for (int i = 0; i < 50; ++i) {
        fn();
    }
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaEvent_t start = nullptr;
    cudaEvent_t stop = nullptr;
    SHARDLINE_CHECK_CUDA(cudaEventCreate(&start));
    SHARDLINE_CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<double> host;
    std::vector<double> device;
    for (int rep = 0; rep < 5; ++rep) {
        SHARDLINE_CHECK_CUDA(cudaEventRecord(start, stream));
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) {
            fn();
        }
        const auto t1 = std::chrono::steady_clock::now();
        SHARDLINE_CHECK_CUDA(cudaEventRecord(stop, stream));
        SHARDLINE_CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0.0f;
        SHARDLINE_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
        device.push_back(1000.0 * ms / calls);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return HostCost{Percentile(host, 0.5), Percentile(device, 0.5)};
}

void HostBench(Run& run, const Options& o) {
    const Device gpu = Device::CUDA(0);
    const std::int64_t m = 1;
    const std::int64_t k = 256;
    const std::int64_t n = 256;
    const DType dt = DType::kBFloat16;
    Tensor x = Tensor::Empty({m, k}, dt, gpu), w = Tensor::Empty({n, k}, dt, gpu), b = Tensor::Empty({n}, dt, gpu);
    Tensor y = Tensor::Empty({m, n}, dt, gpu), dy = Tensor::Empty({m, n}, dt, gpu), dx = Tensor::Empty({m, k}, dt, gpu);
    Tensor dw = Tensor::Empty({n, k}, dt, gpu), db = Tensor::Empty({n}, dt, gpu);
    for (Tensor* t : {&x, &w, &b, &dy}) {
        FillRandom(*t, RandomSpec{.seed = 3, .name = "host"});
    }
    SetProvider(kDefaultProvider);
    const cudaStream_t stream = run.stream;
    auto emit = [&](const std::string& what, int ops, const HostCost& c) {
        run.Emit(json{{"kind", "host"},
                      {"what", what},
                      {"m", m},
                      {"k", k},
                      {"n", n},
                      {"dtype", "bf16"},
                      {"calls", o.host_calls},
                      {"ops", ops},
                      {"host_us", c.host_us},
                      {"host_us_per_op", c.host_us / ops},
                      {"device_us", c.device_us}});
        std::printf("host %-34s %8.2f us per call (%d op%s, %.2f us per op; device %.2f us per call)\n", what.c_str(),
                    c.host_us, ops, ops > 1 ? "s" : "", c.host_us / ops, c.device_us);
    };
    auto forward = [&] { LinearForward(LinearForwardArgs{.x = x, .weight = w, .bias = &b, .y = y}); };
    auto backward = [&] {
        LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w, .dx = &dx, .dweight = &dw, .dbias = &db});
    };
    auto split_step = [&] {
        forward();
        LinearBackwardInput(LinearBackwardInputArgs{.dy = dy, .weight = w, .dx = dx});
        LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw});
        LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db});
    };
    {
        // The first call of a new shape builds its plans (a tuning-file record, or the heuristic and the timing).
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
        const auto t0 = std::chrono::steady_clock::now();
        forward();
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        const GemmPlanStats stats = GetGemmPlanStats();
        run.Emit(json{{"kind", "host"},
                      {"what", "first LinearForward (plan build)"},
                      {"m", m},
                      {"k", k},
                      {"n", n},
                      {"dtype", "bf16"},
                      {"calls", 1},
                      {"ops", 1},
                      {"host_us", us},
                      {"host_us_per_op", us},
                      {"device_us", 0.0},
                      {"heuristic_queries", stats.heuristic_queries},
                      {"file_hits", stats.file_hits}});
        std::printf("host %-34s %8.1f us (heuristic queries so far %llu, tuning-file hits %llu)\n",
                    "first LinearForward (plan build)", us, static_cast<unsigned long long>(stats.heuristic_queries),
                    static_cast<unsigned long long>(stats.file_hits));
    }
    emit("LinearForward", 1, TimeHost(stream, o.host_calls, forward));
    emit("fwd+bwd kernels (LinearBackward)", 2, TimeHost(stream, o.host_calls, [&] {
             forward();
             backward();
         }));
    emit("fwd+bwd kernels (split ops)", 4, TimeHost(stream, o.host_calls, split_step));

    // The floor: one cached cublasLtMatmul with the bias epilogue (the bench's own descriptor).
    {
        CudaContext& ctx = CudaContext::Get(0);
        cublasLtMatmulDesc_t desc = nullptr;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t t = CUBLAS_OP_T;
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const void* bias = b.data();
        const cudaDataType_t bias_type = CUDA_R_16BF;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
        cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
        SHARDLINE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n));
        cublasLtMatmulPreference_t pref = nullptr;
        SHARDLINE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
        const std::uint64_t ws = ctx.workspace_bytes();
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result{};
        int returned = 0;
        SHARDLINE_CHECK_CUBLAS(
            cublasLtMatmulAlgoGetHeuristic(ctx.lt_handle(), desc, la, lb, lc, lc, pref, 1, &result, &returned));
        SHARDLINE_CHECK(returned == 1, kTool, "no cuBLASLt algorithm for the host-cost GEMM");
        const float alpha = 1.0f, beta = 0.0f;
        auto lt = [&] {
            SHARDLINE_CHECK_CUBLAS(cublasLtMatmul(ctx.lt_handle(), desc, &alpha, w.data(), la, x.data(), lb, &beta,
                                                  y.data(), lc, y.data(), lc, &result.algo, ctx.workspace(),
                                                  ctx.workspace_bytes(), stream));
        };
        emit("cublasLtMatmul (cached, bias epilogue)", 1, TimeHost(stream, o.host_calls, lt));
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
    }

    // What the steps above are made of, on this machine: one runtime launch of a kernel that does nothing, one
    // stream-ordered allocation and free (the size of dW), one event record and stream wait (a side stream's fork or
    // join), and the kernels' steps again with fresh outputs from the pool each call, as autograd's step has them.
    emit("floor: empty kernel launch", 1,
         TimeHost(stream, o.host_calls, [&] { SHARDLINE_CHECK_CUDA(bench::LaunchEmptyKernel(stream)); }));
    {
        const std::size_t bytes = static_cast<std::size_t>(dw.numel()) * ElementSize(dt);
        emit("floor: cudaMallocAsync + cudaFreeAsync", 1, TimeHost(stream, o.host_calls, [&] {
                 void* ptr = nullptr;
                 SHARDLINE_CHECK_CUDA(cudaMallocAsync(&ptr, bytes, stream));
                 SHARDLINE_CHECK_CUDA(cudaFreeAsync(ptr, stream));
             }));
        cudaEvent_t event = nullptr;
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        emit("floor: cudaEventRecord + cudaStreamWaitEvent", 1, TimeHost(stream, o.host_calls, [&] {
                 SHARDLINE_CHECK_CUDA(cudaEventRecord(event, stream));
                 SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(stream, event, 0));
             }));
        cudaEventDestroy(event);
    }
    // The runtime queries a step makes per tensor and per op: the capture query (the small-block cache asks it on
    // every allocation and free) through the runtime and through the driver's entry point, and the current device
    // (every CudaContext::Get); and one cached 1 KiB Tensor made and released, what each fresh output costs.
    {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        emit("floor: cudaStreamIsCapturing", 1,
             TimeHost(stream, o.host_calls, [&] { SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(stream, &status)); }));
        if (const auto driver_query = bench::DriverStreamIsCapturing()) {
            emit("floor: cuStreamIsCapturing (driver entry point)", 1, TimeHost(stream, o.host_calls, [&] {
                     SHARDLINE_CHECK(driver_query(stream) >= 0, kTool, "cuStreamIsCapturing failed");
                 }));
        }
        int device = -1;
        emit("floor: cudaGetDevice", 1,
             TimeHost(stream, o.host_calls, [&] { SHARDLINE_CHECK_CUDA(cudaGetDevice(&device)); }));
        emit("one fresh 1 KiB Tensor (Empty + release)", 1,
             TimeHost(stream, o.host_calls, [&] { const Tensor t = Tensor::Empty({512}, dt, gpu); }));
    }
    emit("fwd+bwd kernels (LinearBackward), fresh outputs", 2, TimeHost(stream, o.host_calls, [&] {
             Tensor fy = Tensor::Empty({m, n}, dt, gpu), fdx = Tensor::Empty({m, k}, dt, gpu);
             Tensor fdw = Tensor::Empty({n, k}, dt, gpu), fdb = Tensor::Empty({n}, dt, gpu);
             LinearForward(LinearForwardArgs{.x = x, .weight = w, .bias = &b, .y = fy});
             LinearBackward(
                 LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w, .dx = &fdx, .dweight = &fdw, .dbias = &fdb});
         }));

    // CUDA graphs: the split-op step (4 ops) and the LinearBackward step (2 ops), captured once, replayed.
    auto graph_of = [&](const std::function<void()>& body) {
        body(); // plans built and tuned outside the capture
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
        return bench::CudaGraph(stream, body);
    };
    for (const bool split : {true, false}) {
        const bench::CudaGraph graph = split ? graph_of(split_step) : graph_of([&] {
            forward();
            backward();
        });
        emit(split ? "CUDA graph: fwd+bwd split ops" : "CUDA graph: fwd+bwd (LinearBackward)", split ? 4 : 2,
             TimeHost(stream, o.host_calls, [&] { graph.Launch(); }));
    }

    // Through shardline autograd (local Variables, no mesh): y = Linear(x, w, b), then backward from dY into x, w and
    // b, as torch's fwd+bwd autograd peer does. Fresh grads each step (ZeroGrad drops them: backward allocates them
    // from the pool, as torch.autograd.grad does), and with fp32 main grads that backward accumulates into (ZeroGrad
    // is a fill), which is what a CUDA graph of the step needs.
    {
        autograd::Variable xv(x, true), wv(w, true), bv(b, true);
        const dist::DistTensor dyv = dist::DistTensor::Local(dy);
        auto autograd_step = [&] {
            xv.ZeroGrad();
            wv.ZeroGrad();
            bv.ZeroGrad();
            const autograd::Variable yv = autograd::Linear(xv, wv, bv);
            yv.Backward(&dyv);
        };
        emit("fwd+bwd autograd (Linear)", 2, TimeHost(stream, o.host_calls, autograd_step));
        emit("fwd autograd (Linear, no grad)", 1, TimeHost(stream, o.host_calls, [&] {
                 const autograd::NoGradGuard no_grad;
                 const autograd::Variable yv = autograd::Linear(xv, wv, bv);
             }));
        for (autograd::Variable* v : {&xv, &wv, &bv}) {
            v->AllocateMainGrad(DType::kFloat32);
        }
        emit("fwd+bwd autograd (Linear, main grads)", 2, TimeHost(stream, o.host_calls, autograd_step));
        const bench::CudaGraph graph = graph_of(autograd_step);
        emit("CUDA graph: fwd+bwd autograd (main grads)", 2, TimeHost(stream, o.host_calls, [&] { graph.Launch(); }));
    }
}

// ---------------------------------------------------------------------------------------------------------------------

int Main(const Options& o) {
    const std::vector<Case> cases = Cases(o);
    if (o.list_cases) {
        json list = json::array();
        for (const Case& c : cases) {
            list.push_back(CaseJson(c));
        }
        std::printf("%s\n", list.dump(1).c_str());
        return 0;
    }
    SHARDLINE_CHECK_AS(DeviceError, CudaDeviceCount() > 0, kTool, "needs a GPU");
    Run run;
    CudaContext& ctx = CudaContext::Get(0);
    run.stream = ctx.stream();
    cudaDeviceProp prop{};
    SHARDLINE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    run.device = prop.name;
    run.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
    run.commit = Commit();
    run.date = bench::NowUtc();
    if (!o.json.empty()) {
        run.out.open(o.json, std::ios::app);
        SHARDLINE_CHECK(run.out.good(), kTool, "cannot open {} for appending", o.json);
    }
    const GemmTuningOptions tuning = CurrentGemmTuningOptions();
    Dl_info lt_info{};
    const std::string lt_path =
        dladdr(reinterpret_cast<void*>(&cublasLtGetVersion), &lt_info) != 0 && lt_info.dli_fname != nullptr
            ? lt_info.dli_fname
            : "?";
    std::printf(
        "# shardline-linear-bench: %s, %d SMs, L2 %zu MiB, commit %s, %s, cuBLASLt %zu (%s), tuning %s (top %d)%s\n",
        run.device.c_str(), prop.multiProcessorCount, run.l2_bytes >> 20, run.commit.c_str(), run.date.c_str(),
        cublasLtGetVersion(), lt_path.c_str(), tuning.enabled ? "on" : "off", tuning.top_k,
        tuning.file.empty() ? "" : (", file " + tuning.file).c_str());
    run.Emit(json{{"kind", "meta"},
                  {"sms", prop.multiProcessorCount},
                  {"l2_bytes", run.l2_bytes},
                  {"cublaslt", cublasLtGetVersion()},
                  {"cublaslt_path", lt_path},
                  {"tuning", tuning.enabled},
                  {"top_k", tuning.top_k},
                  {"tuning_file", tuning.file},
                  {"suite", o.suite},
                  {"warmup", o.warmup},
                  {"iters", o.iters},
                  {"rounds", o.rounds}});
    Calibrate(run);
    if (o.regimes.count("host") > 0) {
        HostBench(run, o);
    }
    int failures = 0;
    std::printf("%-9s %-16s %6s %6s %6s %-5s %-9s %-22s %10s\n", "regime", "shape", "M", "K", "N", "dtype", "provider",
                "variant", "median_us");
    for (const Case& c : cases) {
        CaseRunner runner(run, o, c);
        const CaseResult r = runner.Execute();
        failures += runner.gate_failures();
        for (const auto& [key, us] : r.median_us) {
            const std::size_t slash = key.find('/');
            std::printf("%-9s %-16s %6lld %6lld %6lld %-5s %-9s %-22s %10.1f\n", c.regime.c_str(), c.shape.c_str(),
                        static_cast<long long>(c.m), static_cast<long long>(c.k), static_cast<long long>(c.n),
                        c.dtype.c_str(), key.substr(0, slash).c_str(), key.substr(slash + 1).c_str(), us);
        }
        std::fflush(stdout);
    }
    // How the library tuned each GEMM it met (heuristic's first pick vs the kept candidate; fused-or-apart decisions of
    // the measured epilogues, BGRADB here; CUTLASS's GEMV against cuBLASLt for the one-token forwards).
    for (const GemmPlanInfo& info : GemmPlanInfos()) {
        run.Emit(json{{"kind", "plan"},
                      {"key", info.key},
                      {"usable", info.usable},
                      {"tuned", info.tuned},
                      {"from_file", info.from_file},
                      {"candidates", info.candidates},
                      {"chosen", info.chosen},
                      {"chosen_us", info.chosen_us},
                      {"first_us", info.first_us},
                      {"epilogue_separate", info.epilogue_separate},
                      {"epilogue_fused_us", info.epilogue_fused_us},
                      {"epilogue_separate_us", info.epilogue_separate_us},
                      {"chosen_small_workspace", info.chosen_small_workspace},
                      {"gemv", info.gemv},
                      {"gemv_us", info.gemv_us},
                      {"gemv_cublaslt_us", info.gemv_cublaslt_us}});
    }
    const GemmPlanStats stats = GetGemmPlanStats();
    std::printf(
        "# plans: %llu built, %llu heuristic queries, %llu tuned, %llu from the tuning file; measured epilogues "
        "fused %llu, separate %llu; CUTLASS GEMV %llu; gate failures: %d\n",
        static_cast<unsigned long long>(stats.plans_built), static_cast<unsigned long long>(stats.heuristic_queries),
        static_cast<unsigned long long>(stats.tuned), static_cast<unsigned long long>(stats.file_hits),
        static_cast<unsigned long long>(stats.epilogue_fused), static_cast<unsigned long long>(stats.epilogue_separate),
        static_cast<unsigned long long>(stats.gemv), failures);
    return failures == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    Options o;
    if (const int code = ParseCommandLine(argc, argv, o); code >= 0) {
        return code;
    }
    try {
        return Main(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "shardline-linear-bench: %s\n", e.what());
        return 2;
    }
}
