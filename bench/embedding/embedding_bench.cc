// shardline-embedding-bench: EmbeddingBag (mode sum) forward and backward on one GPU, each implementation of the CUDA
// provider forced in turn (kernels::SetEmbeddingBagImpl, what SHARDLINE_EMBEDDING_BAG=gather|gemm does): the gather
// kernels (fused gather-sum; sorted segment-sum backward) and the count-GEMM (the per-bag id-count matrix, then one
// cuBLASLt GEMM). The backward accumulates into a float32 main grad, as the trainer does.
//
// Shapes (bf16, H 2048, ids [32, 8192]):
//   char-lm        the README job (examples/char_lm.cc): id = t·86 + char, V_local = 32·86 = 2752
//   char-lm-tp4    the same ids over rank 0's vocab-parallel shard at tp 4: V_local = 688 (a quarter of the ids hit)
//   vocab50k-tp4   uniform ids over a 50257-token vocabulary, rank 0's shard at tp 4: V_local = 12565
// Each line: the median (and p90) of `--repeats` timed calls (CUDA events on the context stream, after warm-ups that
// also tune the GEMM plans), the direction's memory-traffic limit at --hbm-tbps (forward: read the shard once, write
// out, read the ids; backward: read dout once, read and write the fp32 main grad, read the ids), the ratio, and what
// the auto choice (kernels::ChooseEmbeddingBagImpl) takes with its cost estimates. A gate first compares the two
// implementations' results (max |gemm - gather| / max |gather|). One JSON line per measurement follows the table (and
// goes to --json PATH, appended, when given).
//
//   shardline-embedding-bench [--repeats 50] [--warmup 5] [--hbm-tbps 3.35] [--json PATH]

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/embedding.h>

#include "common/bench_util.h"
#include "common/cli.h"
#include "common/event_timer.h"

namespace {

using namespace shardline;
using json = nlohmann::json;
using kernels::EmbeddingBagImpl;

constexpr char kTool[] = "shardline-embedding-bench";

struct Shape3 {
    std::string name;
    std::int64_t bag;
    std::int64_t count;
    std::int64_t rows; ///< V_local (rank 0's shard: ids below it hit)
    std::int64_t hidden;
    bool char_ids;      ///< id = t·86 + char; else uniform over the global vocabulary
    std::int64_t vocab; ///< global vocabulary
};

Tensor MakeIds(const Shape3 &s, Device device) {
    std::mt19937_64 rng(1234);
    std::vector<double> ids(static_cast<std::size_t>(s.bag * s.count));
    for (std::int64_t t = 0; t < s.bag; ++t) {
        for (std::int64_t n = 0; n < s.count; ++n) {
            const auto r = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.char_ids ? 86 : s.vocab));
            ids[static_cast<std::size_t>(t * s.count + n)] = static_cast<double>(s.char_ids ? t * 86 + r : r);
        }
    }
    return Tensor::FromVector(ids, {s.bag, s.count}, DType::kInt64).To(device);
}

double MaxAbs(const std::vector<double> &v) {
    double m = 0.0;
    for (const double x : v) {
        m = std::max(m, std::abs(x));
    }
    return m;
}

/// max |a - b| / max |b|.
double RelativeDiff(const Tensor &a, const Tensor &b) {
    const std::vector<double> x = a.ToDoubleVector();
    const std::vector<double> y = b.ToDoubleVector();
    double d = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        d = std::max(d, std::abs(x[i] - y[i]));
    }
    const double scale = MaxAbs(y);
    return scale > 0.0 ? d / scale : d;
}

} // namespace

int main(int argc, char **argv) {
    int repeats = 50;
    int warmup = 5;
    double hbm_tbps = 3.35;
    std::string json_path;
    CLI::App app{"EmbeddingBag forward/backward: the gather and the count-GEMM paths on one GPU"};
    bench::UseBenchDefaults(app);
    app.add_option("--repeats", repeats, "timed calls per measurement")->check(CLI::Range(1, 100000));
    app.add_option("--warmup", warmup, "untimed calls first (the first tunes the GEMM plan)")
        ->check(CLI::Range(1, 1000));
    app.add_option("--hbm-tbps", hbm_tbps, "memory bandwidth for the traffic limit, TB/s (H100 SXM: 3.35)");
    app.add_option("--json", json_path, "also append the JSON lines to PATH")->type_name("PATH");
    CLI11_PARSE(app, argc, argv);

    try {
        const Device gpu = Device::CUDA(0);
        CudaContext &ctx = CudaContext::Get(0);
        bench::EventTimer timer(ctx.stream());
        const std::vector<Shape3> shapes = {{"char-lm", 32, 8192, 2752, 2048, true, 2752},
                                            {"char-lm-tp4", 32, 8192, 688, 2048, true, 2752},
                                            {"vocab50k-tp4", 32, 8192, 12565, 2048, false, 50257}};
        const DType dtype = DType::kBFloat16;
        const std::string commit = bench::Commit();
        const std::string date = bench::NowUtc();
        std::vector<json> lines;

        std::printf("# %s  commit %s  %s  bf16, backward into an fp32 main grad; limit at %.2f TB/s\n", kTool,
                    commit.c_str(), date.c_str(), hbm_tbps);
        std::printf("%-13s %6s %-4s %-7s %10s %10s %10s %8s   %s\n", "shape", "V_loc", "dir", "path", "median_us",
                    "p90_us", "limit_us", "x_limit", "auto (estimate gather / gemm us)");
        for (const Shape3 &s : shapes) {
            const Tensor ids = MakeIds(s, gpu);
            Tensor weight = Tensor::Empty({s.rows, s.hidden}, dtype, gpu);
            FillRandom(weight, RandomSpec{.seed = 1, .name = "weight"});
            Tensor dout = Tensor::Empty({s.count, s.hidden}, dtype, gpu);
            FillRandom(dout, RandomSpec{.seed = 2, .name = "dout", .b = 1e-3});
            Tensor out = Tensor::Empty({s.count, s.hidden}, dtype, gpu);
            Tensor main_grad = Tensor::Zeros({s.rows, s.hidden}, DType::kFloat32, gpu);

            const double e = static_cast<double>(ElementSize(dtype));
            const double ids_bytes = static_cast<double>(s.bag * s.count) * 8.0;
            const double table = static_cast<double>(s.rows * s.hidden);
            const double rows_out = static_cast<double>(s.count * s.hidden);
            const double limit_us[2] = {(table * e + rows_out * e + ids_bytes) / (hbm_tbps * 1e12) * 1e6,
                                        (rows_out * e + 2.0 * table * 4.0 + ids_bytes) / (hbm_tbps * 1e12) * 1e6};
            const kernels::EmbeddingBagProblem problem{
                .bag = s.bag, .count = s.count, .rows = s.rows, .hidden = s.hidden, .dtype = dtype};
            const kernels::EmbeddingBagCostEstimate estimate = kernels::EstimateEmbeddingBagCost(problem);
            const std::string auto_path(kernels::EmbeddingBagImplName(
                kernels::ChooseEmbeddingBagImpl(problem, EmbeddingBagImpl::kAuto, kTool)));

            auto forward = [&] { kernels::EmbeddingBagForward({.ids = ids, .weight = weight, .out = out}); };
            auto backward = [&] {
                kernels::EmbeddingBagBackward({.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
            };

            // The gate: both implementations' forward and (overwriting) backward agree.
            Tensor results[2][2];
            for (int p = 0; p < 2; ++p) {
                kernels::SetEmbeddingBagImpl(p == 0 ? EmbeddingBagImpl::kGather : EmbeddingBagImpl::kGemm);
                forward();
                results[p][0] = out.Clone();
                kernels::EmbeddingBagBackward({.ids = ids, .dout = dout, .dweight = main_grad});
                results[p][1] = main_grad.Clone();
            }
            const double gate[2] = {RelativeDiff(results[1][0], results[0][0]),
                                    RelativeDiff(results[1][1], results[0][1])};
            std::printf("%-13s %6lld gate: max|gemm - gather| / max|gather| forward %.2e, backward %.2e\n",
                        s.name.c_str(), static_cast<long long>(s.rows), gate[0], gate[1]);

            for (int dir = 0; dir < 2; ++dir) {
                for (const EmbeddingBagImpl impl : {EmbeddingBagImpl::kGather, EmbeddingBagImpl::kGemm}) {
                    kernels::SetEmbeddingBagImpl(impl);
                    auto body = [&] { dir == 0 ? forward() : backward(); };
                    for (int i = 0; i < warmup; ++i) {
                        body();
                    }
                    std::vector<double> us;
                    us.reserve(static_cast<std::size_t>(repeats));
                    for (int i = 0; i < repeats; ++i) {
                        us.push_back(timer.Microseconds(body));
                    }
                    const double median = bench::Percentile(us, 0.5);
                    const double p90 = bench::Percentile(us, 0.9);
                    const std::string path(kernels::EmbeddingBagImplName(impl));
                    std::printf("%-13s %6lld %-4s %-7s %10.1f %10.1f %10.1f %8.2f   %s (%.0f / %.0f)\n", s.name.c_str(),
                                static_cast<long long>(s.rows), dir == 0 ? "fwd" : "bwd", path.c_str(), median, p90,
                                limit_us[dir], median / limit_us[dir], auto_path.c_str(), estimate.gather_s * 1e6,
                                estimate.count_gemm_s * 1e6);
                    lines.push_back(json{{"kind", "embedding_bag"},
                                         {"commit", commit},
                                         {"date", date},
                                         {"shape", s.name},
                                         {"bag", s.bag},
                                         {"count", s.count},
                                         {"rows", s.rows},
                                         {"hidden", s.hidden},
                                         {"dtype", "bf16"},
                                         {"direction", dir == 0 ? "forward" : "backward"},
                                         {"path", path},
                                         {"median_us", median},
                                         {"p90_us", p90},
                                         {"repeats", repeats},
                                         {"limit_us", limit_us[dir]},
                                         {"hbm_tbps", hbm_tbps},
                                         {"x_limit", median / limit_us[dir]},
                                         {"auto", auto_path},
                                         {"estimate_gather_us", estimate.gather_s * 1e6},
                                         {"estimate_gemm_us", estimate.count_gemm_s * 1e6},
                                         {"gate", gate[dir]}});
                }
            }
        }
        kernels::SetEmbeddingBagImpl(EmbeddingBagImpl::kAuto);
        std::ofstream file;
        if (!json_path.empty()) {
            file.open(json_path, std::ios::app);
            SHARDLINE_CHECK(file.good(), kTool, "cannot open {} for appending", json_path);
        }
        for (const json &line : lines) {
            std::printf("%s\n", line.dump().c_str());
            if (file.is_open()) {
                file << line.dump() << '\n';
            }
        }
    } catch (const std::exception &e) {
        std::fprintf(stderr, "%s: %s\n", kTool, e.what());
        return 1;
    }
    return 0;
}
