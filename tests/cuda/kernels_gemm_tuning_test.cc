// GEMM tuning on the GPU: tuned plans (timed top-k candidates, the per-shape fused-or-apart decision of BGRADB and the
// GELU epilogues) against float64 references, the tuning-cache file (a process starts tuned: no heuristic query, no
// timing, the same bits; both paths of every measured epilogue forced through it), a record cuBLASLt refuses, plans
// first built inside a CUDA-graph capture, tuning switched off, and CUTLASS's GEMV for the matrix-vector products of a
// one-token Linear forward (GemmGemv: always, off, auto; from the tuning file; inside a capture); a rank-1 BGRADB
// (one token's wgrad) fused without a plan.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <shardline/config.h>
#include <shardline/kernels/linear.h>

#include "captured_graph.h"
#include "helpers.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gemm_tuning.h"
#include "kernels/linear_gemm.h"

namespace shardline::testing {
namespace {

using kernels::CurrentGemmTuningOptions;
using kernels::GemmGemv;
using kernels::GemmPlanInfo;
using kernels::GemmPlanInfos;
using kernels::GemmPlanStats;
using kernels::GemmTuningOptions;
using kernels::GemmTuningTable;
using kernels::GetGemmPlanStats;
using kernels::LinearBackward;
using kernels::LinearBackwardArgs;
using kernels::LinearForward;
using kernels::LinearForwardArgs;
using kernels::ResetGemmPlanStats;
using kernels::SetGemmTuningOptions;

/// A temp file path, removed at scope exit.
class TempFile {
public:
    TempFile() {
        std::string pattern = (std::filesystem::temp_directory_path() / "shardline_cuda_tuning_XXXXXX").string();
        dir_ = ::mkdtemp(pattern.data());
    }
    ~TempFile() {
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    std::string path() const { return (std::filesystem::path(dir_) / "tuning.json").string(); }

private:
    std::string dir_;
};

/// Runs the test under given tuning options, with an empty plan cache and zeroed counters; restores the options.
class CudaGemmTuningTest : public CudaParamTest<DType> {
protected:
    void SetUp() override {
        CudaParamTest<DType>::SetUp();
        if (IsSkipped()) {
            return;
        }
        saved_ = CurrentGemmTuningOptions();
        Use(GemmTuningOptions{.enabled = true, .top_k = 8});
    }
    void TearDown() override {
        if (saved_.has_value()) {
            SetGemmTuningOptions(*saved_);
        }
        CudaParamTest<DType>::TearDown();
    }
    static void Use(const GemmTuningOptions& options) {
        SetGemmTuningOptions(options); // also drops every cached plan
        ResetGemmPlanStats();
    }

private:
    std::optional<GemmTuningOptions> saved_;
};

/// One Linear layer's tensors: x [m, in], w [out, in], b [out], dy [m, out].
struct Layer {
    Layer(std::int64_t m, std::int64_t in, std::int64_t out, DType dtype, std::uint64_t seed)
        : m(m), in(in), out(out), dtype(dtype) {
        x = RandomGpu({m, in}, dtype, seed, "x");
        w = RandomGpu({out, in}, dtype, seed, "w", 1.0 / std::sqrt(static_cast<double>(in)));
        b = RandomGpu({out}, dtype, seed, "b");
        dy = RandomGpu({m, out}, dtype, seed, "dy");
    }
    std::int64_t m, in, out;
    DType dtype;
    Tensor x, w, b, dy;
};

struct Grads {
    Tensor y, dx, dw, db;
};

/// Forward with bias, then LinearBackward for dx, dw and db, into poisoned outputs.
Grads RunLayer(const Layer& l) {
    Grads g{RandomGpu({l.m, l.out}, l.dtype, 999, "poison_y", 100.0),
            RandomGpu({l.m, l.in}, l.dtype, 999, "poison_dx", 100.0),
            RandomGpu({l.out, l.in}, l.dtype, 999, "poison_dw", 100.0),
            RandomGpu({l.out}, l.dtype, 999, "poison_db", 100.0)};
    LinearForward(LinearForwardArgs{.x = l.x, .weight = l.w, .bias = &l.b, .y = g.y});
    LinearBackward(
        LinearBackwardArgs{.dy = l.dy, .x = &l.x, .weight = &l.w, .dx = &g.dx, .dweight = &g.dw, .dbias = &g.db});
    Synchronize(Gpu());
    return g;
}

void ExpectMatchesFloat64(const Layer& l, const Grads& g) {
    const Values xv = l.x.ToDoubleVector();
    const Values wv = l.w.ToDoubleVector();
    const Values bv = l.b.ToDoubleVector();
    const Values dyv = l.dy.ToDoubleVector();
    EXPECT_TRUE(ValuesMatch(g.y, RefLinearForward(xv, wv, &bv, l.m, l.out, l.in), l.dtype, kUnfusedBiasRoundings))
        << "y";
    EXPECT_TRUE(ValuesMatch(g.dx, RefLinearBackwardInput(dyv, wv, l.m, l.out, l.in), l.dtype)) << "dx";
    EXPECT_TRUE(ValuesMatch(g.dw, RefLinearBackwardWeight(dyv, xv, l.m, l.out, l.in), l.dtype, kEpilogueRoundings))
        << "dw";
    EXPECT_TRUE(ValuesMatch(g.db, RefColumnSum(dyv, l.m, l.out), l.dtype, kEpilogueRoundings)) << "db";
}

// Shapes where cuBLASLt offers several candidates (aligned, a few hundred rows), one with K not a multiple of 8
// (2-byte alignment only for half types) and one tall-skinny.
const std::vector<std::array<std::int64_t, 3>> kShapes = {{256, 512, 384}, {200, 136, 72}, {1024, 64, 1000}};

TEST_P(CudaGemmTuningTest, TunedPlansMatchFloat64) {
    const DType dtype = GetParam();
    for (const auto& [m, in, out] : kShapes) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " in=" << in << " out=" << out);
        const Layer layer(m, in, out, dtype, 21);
        ExpectMatchesFloat64(layer, RunLayer(layer));
    }
    const GemmPlanStats stats = GetGemmPlanStats();
    EXPECT_GT(stats.tuned, 0u) << "no plan was timed";
    EXPECT_EQ(stats.file_hits, 0u);
    // Every usable BGRADB plan took a decision, and the plan list says which and what it measured.
    std::uint64_t bgradb_plans = 0;
    for (const kernels::GemmPlanInfo& info : GemmPlanInfos()) {
        if (info.key.find("epilogue=bgradb") != std::string::npos && info.usable) {
            ++bgradb_plans;
            EXPECT_TRUE(info.tuned) << info.key;
            EXPECT_GT(info.epilogue_fused_us, 0.0) << info.key;
            EXPECT_GT(info.epilogue_separate_us, 0.0) << info.key;
            EXPECT_EQ(info.epilogue_separate, !(info.epilogue_fused_us < 0.99 * info.epilogue_separate_us)) << info.key;
        }
        if (info.tuned && info.usable) {
            EXPECT_GE(info.candidates, 1) << info.key;
            EXPECT_GT(info.chosen_us, 0.0) << info.key;
            EXPECT_LE(info.chosen_us, info.first_us * 1.0001) << info.key << ": kept a slower candidate";
        }
    }
    EXPECT_GT(bgradb_plans, 0u);
    // BGRADB is the only measured epilogue of a layer with a plain bias (the bias epilogue is always fused).
    EXPECT_EQ(stats.epilogue_fused + stats.epilogue_separate, bgradb_plans);
}

TEST_P(CudaGemmTuningTest, AccumulatingIntoAMainGradIsTunedWithoutAddingTwice) {
    const DType dtype = GetParam();
    const Layer l(512, 256, 128, dtype, 22);
    const double scale = std::sqrt(512.0);
    Tensor main_dw = RandomGpu({l.out, l.in}, DType::kFloat32, 22, "main_dw", scale);
    Tensor main_db = RandomGpu({l.out}, DType::kFloat32, 22, "main_db", scale);
    const Values old_dw = main_dw.ToDoubleVector();
    const Values old_db = main_db.ToDoubleVector();
    // The first call tunes the beta = 1 GEMM: the candidates must not have accumulated into main_dw.
    LinearBackward(
        LinearBackwardArgs{.dy = l.dy, .x = &l.x, .dweight = &main_dw, .dbias = &main_db, .accumulate = true});
    const Values dyv = l.dy.ToDoubleVector();
    Values want_dw = RefLinearBackwardWeight(dyv, l.x.ToDoubleVector(), l.m, l.out, l.in);
    Values want_db = RefColumnSum(dyv, l.m, l.out);
    for (std::size_t i = 0; i < want_dw.size(); ++i) {
        want_dw[i] += old_dw[i];
    }
    for (std::size_t i = 0; i < want_db.size(); ++i) {
        want_db[i] += old_db[i];
    }
    EXPECT_TRUE(ValuesMatch(main_dw, want_dw, DType::kFloat32)) << "dweight = old + new, once";
    EXPECT_TRUE(ValuesMatch(main_db, want_db, DType::kFloat32)) << "dbias = old + new, once";
    EXPECT_GT(GetGemmPlanStats().tuned, 0u);
}

TEST_P(CudaGemmTuningTest, TuningFileStartsAProcessTunedWithoutHeuristicQueries) {
    const DType dtype = GetParam();
    TempFile file;
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    const Layer layer(256, 512, 384, dtype, 23);
    const Grads first = RunLayer(layer);
    ExpectMatchesFloat64(layer, first);
    const GemmPlanStats tuned = GetGemmPlanStats();
    EXPECT_GT(tuned.heuristic_queries, 0u);
    // Every timed plan is in the file, under this GPU's name and cuBLASLt version.
    const GemmTuningTable table = GemmTuningTable::Load(file.path());
    EXPECT_EQ(table.size(), tuned.tuned);
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    for (const kernels::GemmTuningRecord& r : table.records()) {
        EXPECT_EQ(r.gpu, std::string(prop.name));
        EXPECT_EQ(r.cublaslt_version, static_cast<std::int64_t>(cublasLtGetVersion()));
    }

    // A "new process": no plans, the file read afresh.
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    const Grads second = RunLayer(layer);
    const GemmPlanStats from_file = GetGemmPlanStats();
    EXPECT_EQ(from_file.heuristic_queries, 0u) << "a cache hit asked the heuristic";
    EXPECT_EQ(from_file.tuned, 0u) << "a cache hit was timed again";
    EXPECT_EQ(from_file.file_hits, from_file.plans_built);
    EXPECT_EQ(from_file.file_rejected, 0u);
    EXPECT_EQ(from_file.epilogue_fused + from_file.epilogue_separate, tuned.epilogue_fused + tuned.epilogue_separate);
    // The same algorithms and the same BGRADB decision: the same bits.
    EXPECT_EQ(HostBytes(second.y), HostBytes(first.y));
    EXPECT_EQ(HostBytes(second.dx), HostBytes(first.dx));
    EXPECT_EQ(HostBytes(second.dw), HostBytes(first.dw));
    EXPECT_EQ(HostBytes(second.db), HostBytes(first.db));
}

TEST_P(CudaGemmTuningTest, RefusedRecordIsTunedAfreshAndReplaced) {
    const DType dtype = GetParam();
    TempFile file;
    const Layer layer(256, 512, 384, dtype, 24);
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    (void)RunLayer(layer);
    // Corrupt every record's algorithm: cublasLtMatmulAlgoCheck must refuse it (never launched blindly).
    GemmTuningTable table = GemmTuningTable::Load(file.path());
    ASSERT_GT(table.size(), 0u);
    GemmTuningTable corrupt;
    for (kernels::GemmTuningRecord r : table.records()) {
        r.algo.fill(0xdeadbeefdeadbeefULL);
        corrupt.Upsert(r);
    }
    std::filesystem::remove(file.path());
    corrupt.Save(file.path());
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    const Grads g = RunLayer(layer);
    ExpectMatchesFloat64(layer, g);
    const GemmPlanStats stats = GetGemmPlanStats();
    EXPECT_EQ(stats.file_hits, 0u);
    EXPECT_EQ(stats.file_rejected, table.size());
    EXPECT_EQ(stats.tuned, table.size());
    // The file holds working records again.
    const GemmTuningTable rewritten = GemmTuningTable::Load(file.path());
    for (const kernels::GemmTuningRecord& r : rewritten.records()) {
        EXPECT_NE(r.algo[0], 0xdeadbeefdeadbeefULL) << r.key;
    }
}

TEST_P(CudaGemmTuningTest, BothBiasGradPathsFromTheFileMatchFloat64) {
    const DType dtype = GetParam();
    TempFile file;
    const Layer layer(512, 256, 192, dtype, 25);
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    (void)RunLayer(layer);
    const GemmTuningTable tuned = GemmTuningTable::Load(file.path());
    for (const bool separate : {false, true}) {
        SCOPED_TRACE(separate ? "bias grad as a separate column sum" : "bias grad fused (BGRADB)");
        GemmTuningTable forced;
        for (kernels::GemmTuningRecord r : tuned.records()) {
            if (r.key.find("epilogue=bgradb") != std::string::npos) {
                r.epilogue_separate = separate;
            }
            forced.Upsert(r);
        }
        std::filesystem::remove(file.path());
        forced.Save(file.path());
        Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
        ExpectMatchesFloat64(layer, RunLayer(layer));
        const GemmPlanStats stats = GetGemmPlanStats();
        EXPECT_EQ(stats.epilogue_separate, separate ? 1u : 0u);
        EXPECT_EQ(stats.epilogue_fused, separate ? 0u : 1u);
    }
}

/// The GELU epilogues of one layer: forward y = gelu(x·Wᵀ + b) saving the pre-activation (GELU_AUX_BIAS), and a dgrad
/// after a GELU, dx = (dy·W) ⊙ gelu'(pre_in) with the previous bias grad Σ_rows dx (DGELU_BGRAD, or DGELU + column
/// sum).
struct GeluOutputs {
    Tensor y, pre, dx, pre_db;
};
GeluOutputs RunGeluLayer(const Layer& l, const Tensor& pre_in) {
    GeluOutputs o{RandomGpu({l.m, l.out}, l.dtype, 999, "poison_y", 100.0),
                  RandomGpu({l.m, l.out}, l.dtype, 999, "poison_pre", 100.0),
                  RandomGpu({l.m, l.in}, l.dtype, 999, "poison_dx", 100.0),
                  RandomGpu({l.in}, l.dtype, 999, "poison_pre_db", 100.0)};
    LinearForward(LinearForwardArgs{.x = l.x,
                                    .weight = l.w,
                                    .bias = &l.b,
                                    .y = o.y,
                                    .activation = kernels::LinearActivation::kGeluTanh,
                                    .pre_activation = &o.pre});
    LinearBackward(LinearBackwardArgs{.dy = l.dy,
                                      .weight = &l.w,
                                      .dx = &o.dx,
                                      .input_activation = kernels::LinearActivation::kGeluTanh,
                                      .pre_activation = &pre_in,
                                      .pre_activation_dbias = &o.pre_db});
    Synchronize(Gpu());
    return o;
}

void ExpectGeluLayerMatchesFloat64(const Layer& l, const Tensor& pre_in, const GeluOutputs& o) {
    const Values bv = l.b.ToDoubleVector();
    const Values pre = RefLinearForward(l.x.ToDoubleVector(), l.w.ToDoubleVector(), &bv, l.m, l.out, l.in);
    Values y(pre.size());
    for (std::size_t i = 0; i < pre.size(); ++i) {
        y[i] = RefGeluTanh(pre[i]);
    }
    Values dx = RefLinearBackwardInput(l.dy.ToDoubleVector(), l.w.ToDoubleVector(), l.m, l.out, l.in);
    const Values pre_in_v = pre_in.ToDoubleVector();
    Values g_abs(dx.size());
    for (std::size_t i = 0; i < dx.size(); ++i) {
        g_abs[i] = std::abs(dx[i]);
        dx[i] *= RefGeluTanhGrad(pre_in_v[i]);
    }
    EXPECT_TRUE(ValuesMatch(o.pre, pre, l.dtype, kUnfusedBiasRoundings)) << "pre-activation";
    EXPECT_TRUE(ValuesMatch(o.y, y, l.dtype, kGeluEpilogueRoundings)) << "y = gelu(pre)";
    EXPECT_TRUE(GeluGradMatch(o.dx, dx, g_abs, l.dtype, kGeluEpilogueRoundings)) << "dx = dy·W ⊙ gelu'(pre_in)";
    EXPECT_TRUE(GeluGradMatch(o.pre_db, RefColumnSum(dx, l.m, l.in), RefColumnSum(g_abs, l.m, l.in), l.dtype,
                              kGeluEpilogueRoundings))
        << "Σ_rows dx";
}

TEST_P(CudaGemmTuningTest, BothPathsOfTheGeluEpiloguesFromTheFileMatchFloat64) {
    const DType dtype = GetParam();
    TempFile file;
    // Every leading dimension a multiple of 8: cuBLASLt may fuse GELU_AUX_BIAS, DGELU and DGELU_BGRAD.
    const Layer layer(512, 256, 192, dtype, 28);
    const Tensor pre_in = RandomGpu({layer.m, layer.in}, dtype, 28, "pre_in", 1.5);
    Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
    ExpectGeluLayerMatchesFloat64(layer, pre_in, RunGeluLayer(layer, pre_in));
    // Each measured epilogue took a decision and timed both paths.
    int measured = 0;
    for (const kernels::GemmPlanInfo& info : GemmPlanInfos()) {
        const bool gelu_epilogue = info.key.find("epilogue=gelu_aux_bias") != std::string::npos ||
                                   info.key.find("epilogue=dgelu") != std::string::npos;
        if (gelu_epilogue && info.usable) {
            ++measured;
            EXPECT_GT(info.epilogue_fused_us, 0.0) << info.key;
            EXPECT_GT(info.epilogue_separate_us, 0.0) << info.key;
            EXPECT_EQ(info.epilogue_separate, !(info.epilogue_fused_us < 0.99 * info.epilogue_separate_us)) << info.key;
        }
    }
    // GELU_AUX_BIAS, DGELU_BGRAD and DGELU (DGELU_BGRAD's apart path), where cuBLASLt has an algorithm for them.
    std::printf("[ measured ] %d GELU epilogue plan(s) with a cuBLASLt algorithm (%s)\n", measured,
                std::string(DTypeName(dtype)).c_str());
    const GemmTuningTable tuned = GemmTuningTable::Load(file.path());
    for (const bool separate : {false, true}) {
        SCOPED_TRACE(separate ? "every GELU epilogue apart" : "every GELU epilogue fused");
        GemmTuningTable forced;
        for (kernels::GemmTuningRecord r : tuned.records()) {
            if (r.key.find("epilogue=gelu_aux_bias") != std::string::npos ||
                r.key.find("epilogue=dgelu") != std::string::npos) {
                r.epilogue_separate = separate;
            }
            forced.Upsert(r);
        }
        std::filesystem::remove(file.path());
        forced.Save(file.path());
        Use(GemmTuningOptions{.enabled = true, .top_k = 8, .file = file.path()});
        ExpectGeluLayerMatchesFloat64(layer, pre_in, RunGeluLayer(layer, pre_in));
        const GemmPlanStats stats = GetGemmPlanStats();
        // Apart, every measured plan of the tuned run runs apart (DGELU_BGRAD's apart plan is DGELU's); fused, none.
        if (separate) {
            EXPECT_EQ(stats.epilogue_separate, static_cast<std::uint64_t>(measured));
            EXPECT_EQ(stats.epilogue_fused, 0u);
        } else {
            EXPECT_EQ(stats.epilogue_separate, 0u);
        }
        EXPECT_EQ(stats.tuned, 0u) << "every plan came from the file";
    }
}

TEST_P(CudaGemmTuningTest, PlanFirstBuiltInsideACaptureIsTunedAtTheFirstEagerCall) {
    const DType dtype = GetParam();
    const Layer l(384, 256, 320, dtype, 26);
    Tensor y = RandomGpu({l.m, l.out}, dtype, 999, "poison", 100.0);
    Synchronize(Gpu());
    const cudaStream_t stream = CudaContext::Get(0).stream();
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    LinearForward(LinearForwardArgs{.x = l.x, .weight = l.w, .bias = &l.b, .y = y});
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(GetGemmPlanStats().tuned, 0u) << "timed inside a capture";
    EXPECT_EQ(GetGemmPlanStats().plans_built, 1u);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Values bv = l.b.ToDoubleVector();
    const Values ref = RefLinearForward(l.x.ToDoubleVector(), l.w.ToDoubleVector(), &bv, l.m, l.out, l.in);
    EXPECT_TRUE(ValuesMatch(y, ref, dtype, kUnfusedBiasRoundings)) << "graph (heuristic's first pick)";
    Tensor y2 = RandomGpu({l.m, l.out}, dtype, 998, "poison", 100.0);
    LinearForward(LinearForwardArgs{.x = l.x, .weight = l.w, .bias = &l.b, .y = y2});
    EXPECT_EQ(GetGemmPlanStats().tuned, 1u) << "the first eager call tunes the plan";
    EXPECT_EQ(GetGemmPlanStats().plans_built, 1u);
    EXPECT_TRUE(ValuesMatch(y2, ref, dtype, kUnfusedBiasRoundings)) << "eager (tuned)";
    // The graph still replays (its kernels were fixed at capture).
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(ValuesMatch(y, ref, dtype, kUnfusedBiasRoundings)) << "graph replay after tuning";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

TEST_P(CudaGemmTuningTest, TuningOffTakesTheHeuristicsFirstPick) {
    const DType dtype = GetParam();
    Use(GemmTuningOptions{.enabled = false, .top_k = 8});
    const Layer layer(256, 512, 384, dtype, 27);
    ExpectMatchesFloat64(layer, RunLayer(layer));
    const GemmPlanStats stats = GetGemmPlanStats();
    EXPECT_EQ(stats.tuned, 0u);
    EXPECT_EQ(stats.heuristic_queries, stats.plans_built);
    EXPECT_EQ(stats.epilogue_fused, 1u) << "untuned BGRADB stays fused";
    for (const kernels::GemmPlanInfo& info : GemmPlanInfos()) {
        EXPECT_FALSE(info.tuned) << info.key;
        EXPECT_EQ(info.chosen, 0) << info.key;
    }
}

// The grouped GEMM's loop over experts: under a pause, shapes that change from call to call (the rows of each expert)
// ask the heuristic once per shape class and reuse its pick, and stay out of the plan cache that GemmPlanInfos lists.
TEST_P(CudaGemmTuningTest, PausedShapesOfOneClassShareOneHeuristicQuery) {
    const DType dtype = GetParam();
    const std::size_t listed = GemmPlanInfos().size();
    // m 897..1024 are one class (rounded up to 1024); a fresh class at 1500 asks again.
    const std::vector<std::int64_t> rows = {1000, 1016, 1024, 968, 1000, 1500};
    {
        const kernels::GemmTuningPause pause;
        for (std::size_t i = 0; i < rows.size(); ++i) {
            SCOPED_TRACE(::testing::Message() << "m=" << rows[i]);
            const Layer layer(rows[i], 256, 384, dtype, 40 + i);
            ExpectMatchesFloat64(layer, RunLayer(layer));
        }
    }
    const GemmPlanStats stats = GetGemmPlanStats();
    EXPECT_EQ(stats.tuned, 0u) << "timed under a pause";
    // Three GEMMs per layer (forward, dgrad, wgrad + BGRADB). The forward and dgrad vary in m, the wgrad in k: each
    // asks once for the class of 1024 and once for 1500's; m = 1000 the second time hits the transient cache.
    EXPECT_EQ(stats.heuristic_queries, 6u);
    EXPECT_EQ(stats.algo_reused, 9u) << "1016, 1024 and 968 reuse the class's pick for each of the three GEMMs";
    EXPECT_EQ(stats.plans_built, 15u);
    EXPECT_EQ(GemmPlanInfos().size(), listed) << "transient plans are not in the listed cache";
}

// One token's wgrad with its bias grad (k = M = 1): the rank-1 kernel writes both in one launch, so the default
// provider calls its BGRADB fused (LinearBackward then runs no column sum) without building, tuning or timing a plan.
// Two rows are a GEMM again: deciding BGRADB there builds the plan (and the plain GEMM's it is timed against).
TEST_P(CudaGemmTuningTest, ARankOneBGradBIsFusedWithoutAPlan) {
    const DType dtype = GetParam();
    for (const std::int64_t rows : {std::int64_t{1}, std::int64_t{2}}) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows);
        ResetGemmPlanStats();
        const Tensor x = RandomGpu({rows, 256}, dtype, 61, "x");
        const Tensor dy = RandomGpu({rows, 96}, dtype, 61, "dy");
        Tensor dw = Tensor::Empty({96, 256}, dtype, Gpu());
        Tensor db = Tensor::Empty({96}, dtype, Gpu());
        const kernels::GemmParams wgrad = kernels::detail::LinearWgradGemm(dy, x, dw, &db, /*accumulate=*/false);
        ASSERT_EQ(wgrad.epilogue, kernels::GemmEpilogue::kBGradB);
        const bool fused = kernels::cuda::EpilogueRunsFused(wgrad);
        const GemmPlanStats stats = GetGemmPlanStats();
        if (rows == 1) {
            EXPECT_TRUE(fused) << "the rank-1 kernel writes the bias grad in its launch";
            EXPECT_EQ(stats.plans_built, 0u);
            EXPECT_EQ(stats.tuned, 0u);
        } else {
            // The BGRADB plan, and the plain GEMM's that its apart path is timed with.
            EXPECT_GT(stats.plans_built, 0u) << "a GEMM's BGRADB decision needs its plan";
        }
    }
}

INSTANTIATE_TEST_SUITE_P(DType, CudaGemmTuningTest, CudaDTypes(), DTypeParamName);

// ---------------------------------------------------------------------------------------------------------------------
// CUTLASS's GEMV: the matrix-vector product of a one-token Linear forward (GEMM m = out, n = 1, k = in)

/// Why CUTLASS's GEMV cannot run here (GTEST_SKIP's message), or "" when it can: it is sm_90a code, compiled only in a
/// build with CUTLASS.
std::string GemvUnavailableReason() {
    if (!SHARDLINE_HAVE_CUTLASS) {
        return "this build has no CUTLASS (SHARDLINE_WITH_CUTLASS off), so no GEMV";
    }
    if (const int cc = CudaContext::Get(0).compute_capability(); cc != 90) {
        return "CUTLASS's GEMV is sm_90a code; device 0 has compute capability " + std::to_string(cc);
    }
    return {};
}

/// A GEMV suite's fixture over Base (CudaTest, or CudaParamTest<DType>): skips where the GEMV cannot run; each case
/// picks its options with Use (which drops every plan and zeroes the counters), and the options in force before the
/// case are restored after it.
template <class Base> class GemvFixture : public Base {
protected:
    void SetUp() override {
        Base::SetUp();
        if (Base::IsSkipped()) {
            return;
        }
        if (const std::string reason = GemvUnavailableReason(); !reason.empty()) {
            GTEST_SKIP() << reason;
        }
        saved_ = CurrentGemmTuningOptions();
    }
    void TearDown() override {
        if (saved_.has_value()) {
            SetGemmTuningOptions(*saved_);
        }
        Base::TearDown();
    }
    static void Use(GemmGemv gemv, bool tuning, const std::string& file = {}) {
        SetGemmTuningOptions(GemmTuningOptions{.enabled = tuning, .top_k = 8, .file = file, .gemv = gemv});
        ResetGemmPlanStats();
    }

private:
    std::optional<GemmTuningOptions> saved_;
};

/// The GEMV's dtypes (bf16 and fp16), one case each.
class CudaGemmGemvTest : public GemvFixture<CudaParamTest<DType>> {};
/// fp32, which the GEMV does not take.
class CudaGemmGemvFp32Test : public GemvFixture<CudaTest> {};

/// y = x·Wᵀ (+ b) into a fresh y poisoned from `poison_seed` (two calls get different garbage, so equal bits are the
/// kernel's), synchronized.
Tensor Forward(const Layer& l, bool bias, std::uint64_t poison_seed = 999) {
    Tensor y = RandomGpu({l.m, l.out}, l.dtype, poison_seed, "poison_y", 100.0);
    LinearForward(LinearForwardArgs{.x = l.x, .weight = l.w, .bias = bias ? &l.b : nullptr, .y = y});
    Synchronize(Gpu());
    return y;
}

/// y against the float64 reference of l's forward, which must not be all zeros (zeros would let a kernel that wrote
/// only zeros pass).
::testing::AssertionResult ForwardMatchesFloat64(const Tensor& y, const Layer& l, bool bias, double roundings) {
    const Values bv = l.b.ToDoubleVector();
    const Values ref =
        RefLinearForward(l.x.ToDoubleVector(), l.w.ToDoubleVector(), bias ? &bv : nullptr, l.m, l.out, l.in);
    if (AbsSum(ref) == 0.0) {
        return ::testing::AssertionFailure() << "the float64 reference is all zeros";
    }
    return ValuesMatch(y, ref, l.dtype, roundings);
}

/// The GEMV's precision: fp32 accumulation, alpha·acc + bias in fp32, rounded once to the output dtype, with or
/// without the bias (cuBLASLt's budgets are kEpilogueRoundings for a fused bias, kUnfusedBiasRoundings for its
/// fallback).
constexpr double kGemvRoundings = 1;

/// " m=<out> n=<tokens> k=<in> ": the forward GEMM's shape as its plan key spells it.
std::string ForwardShape(const Layer& l) {
    return " m=" + std::to_string(l.out) + " n=" + std::to_string(l.m) + " k=" + std::to_string(l.in) + " ";
}

/// The keys of the cached plans, one a line, for failure messages.
std::string Keys(const std::vector<GemmPlanInfo>& infos) {
    std::string keys;
    for (const GemmPlanInfo& info : infos) {
        keys += "\n  " + info.key + (info.gemv ? " [gemv]" : "");
    }
    return keys;
}

struct GemvShape {
    std::int64_t out, in;
};
// (1, 8): one row, one 16-byte load, K below one warp's tile (256 elements: the tail loop only); (7, 64): fewer rows
// than a block's 8; (1536, 4096) and (4100, 1024): decode shapes, 4100 leaving a partial last block; (300, 4104): a
// tail of 8 past the whole tiles.
const std::vector<GemvShape> kGemvShapes = {{1, 8}, {7, 64}, {1536, 4096}, {4100, 1024}, {300, 4104}};

// GemmGemv::kAlways, tuning on and off: every eligible one-token forward (with a bias and without) is one plan that
// runs the GEMV, rounded once, deterministic, timed only when tuning.
TEST_P(CudaGemmGemvTest, AlwaysRunsTheGemvForOneTokenAndMatchesFloat64) {
    const DType dtype = GetParam();
    std::uint64_t seed = 60;
    for (const bool tuning : {true, false}) {
        for (const GemvShape& shape : kGemvShapes) {
            for (const bool bias : {false, true}) {
                SCOPED_TRACE(::testing::Message() << "tuning=" << tuning << " out=" << shape.out << " in=" << shape.in
                                                  << (bias ? " with bias" : " without bias"));
                Use(GemmGemv::kAlways, tuning);
                const Layer l(1, shape.in, shape.out, dtype, seed++);
                const Tensor y = Forward(l, bias, 999);
                const Tensor again = Forward(l, bias, 998);
                EXPECT_TRUE(ForwardMatchesFloat64(y, l, bias, kGemvRoundings));
                EXPECT_EQ(HostBytes(again), HostBytes(y)) << "the second call changed the bits";
                const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
                ASSERT_EQ(infos.size(), 1u) << Keys(infos);
                const GemmPlanInfo& plan = infos[0];
                EXPECT_NE(plan.key.find(ForwardShape(l)), std::string::npos) << plan.key;
                EXPECT_TRUE(plan.usable) << plan.key;
                EXPECT_TRUE(plan.gemv) << plan.key;
                EXPECT_EQ(plan.tuned, tuning) << plan.key;
                if (tuning) {
                    EXPECT_GT(plan.gemv_us, 0.0) << plan.key << ": the GEMV was not timed";
                    EXPECT_GT(plan.gemv_cublaslt_us, 0.0) << plan.key << ": cuBLASLt was not timed beside it";
                } else {
                    EXPECT_EQ(plan.gemv_us, 0.0) << plan.key << ": timed with tuning off";
                    EXPECT_EQ(plan.gemv_cublaslt_us, 0.0) << plan.key;
                }
                const GemmPlanStats stats = GetGemmPlanStats();
                EXPECT_EQ(stats.plans_built, 1u);
                EXPECT_EQ(stats.gemv, 1u);
                EXPECT_EQ(stats.tuned, tuning ? 1u : 0u);
            }
        }
    }
}

// Products outside the GEMV's eligibility stay on cuBLASLt under kAlways: K not a multiple of 8, two tokens (n = 2),
// and an x that is not 16-byte aligned.
TEST_P(CudaGemmGemvTest, AlwaysLeavesIneligibleProductsToCublasLt) {
    const DType dtype = GetParam();
    struct Case {
        const char* what;
        std::int64_t tokens, in, out;
        bool misaligned_x;
    };
    const std::vector<Case> cases = {{"in = 12, not a multiple of 8", 1, 12, 64, false},
                                     {"two tokens", 2, 4096, 1536, false},
                                     {"x 2-byte aligned", 1, 1024, 256, true}};
    std::uint64_t seed = 70;
    // With tuning off kAlways decides by eligibility alone (a wrongly eligible product would run the GEMV, or fail in
    // its launcher); with tuning on a launch the launcher refuses would also end on cuBLASLt, so both are run.
    for (const Case& c : cases) {
        for (const bool bias : {false, true}) {
            for (const bool tuning : {false, true}) {
                SCOPED_TRACE(::testing::Message() << c.what << (bias ? ", with bias" : ", without bias")
                                                  << (tuning ? ", tuning on" : ", tuning off"));
                Use(GemmGemv::kAlways, tuning);
                const Layer l(c.tokens, c.in, c.out, dtype, seed++);
                Tensor y = RandomGpu({l.m, l.out}, dtype, 999, "poison_y", 100.0);
                std::optional<MisalignedTensor> x;
                if (c.misaligned_x) {
                    x = MisalignedCopy(l.x);
                }
                LinearForward(
                    LinearForwardArgs{.x = x ? x->view : l.x, .weight = l.w, .bias = bias ? &l.b : nullptr, .y = y});
                Synchronize(Gpu());
                EXPECT_TRUE(ForwardMatchesFloat64(y, l, bias, kUnfusedBiasRoundings));
                const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
                EXPECT_FALSE(infos.empty());
                for (const GemmPlanInfo& plan : infos) {
                    EXPECT_FALSE(plan.gemv) << plan.key;
                    EXPECT_EQ(plan.gemv_us, 0.0) << plan.key << ": an ineligible product was timed";
                }
                EXPECT_EQ(GetGemmPlanStats().gemv, 0u) << Keys(infos);
            }
        }
    }
}

// A tuning-file record without a GEMV measurement (written under kOff here, as by a process before the GEMV existed)
// is timed for the GEMV when a kAuto process with tuning on reads it: from the file (no heuristic query, no candidate
// timing), the GEMV's and cuBLASLt's times stored, and the record rewritten with them. With tuning off it is not timed.
TEST_P(CudaGemmGemvTest, AutoTimesTheGemvOfARecordThatHasNone) {
    const DType dtype = GetParam();
    TempFile file;
    const Layer l(1, 4096, 1536, dtype, 88);
    Use(GemmGemv::kOff, true, file.path());
    (void)Forward(l, true, 999);
    {
        const GemmTuningTable table = GemmTuningTable::Load(file.path());
        ASSERT_EQ(table.size(), 1u);
        EXPECT_EQ(table.records()[0].gemv_us, 0.0) << "kOff timed the GEMV";
    }
    Use(GemmGemv::kAuto, false, file.path());
    (void)Forward(l, true, 998);
    ASSERT_EQ(GemmPlanInfos().size(), 1u);
    EXPECT_TRUE(GemmPlanInfos()[0].from_file);
    EXPECT_FALSE(GemmPlanInfos()[0].gemv) << "tuning off: the record's cuBLASLt algorithm";
    EXPECT_EQ(GemmPlanInfos()[0].gemv_us, 0.0) << "tuning off timed the GEMV";

    Use(GemmGemv::kAuto, true, file.path());
    const Tensor y = Forward(l, true, 997);
    const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
    ASSERT_EQ(infos.size(), 1u) << Keys(infos);
    const GemmPlanInfo& plan = infos[0];
    EXPECT_TRUE(plan.from_file) << plan.key;
    EXPECT_GT(plan.gemv_us, 0.0) << plan.key << ": the record's missing GEMV time was not measured";
    EXPECT_GT(plan.gemv_cublaslt_us, 0.0) << plan.key;
    EXPECT_EQ(plan.gemv, plan.gemv_us < plan.gemv_cublaslt_us * 0.99) << plan.key;
    EXPECT_TRUE(ForwardMatchesFloat64(y, l, true, plan.gemv ? kGemvRoundings : kUnfusedBiasRoundings));
    const GemmPlanStats stats = GetGemmPlanStats();
    EXPECT_EQ(stats.heuristic_queries, 0u) << "a cache hit asked the heuristic";
    EXPECT_EQ(stats.tuned, 0u) << "a cache hit timed the cuBLASLt candidates again";
    EXPECT_EQ(stats.gemv, plan.gemv ? 1u : 0u);
    const GemmTuningTable table = GemmTuningTable::Load(file.path());
    ASSERT_EQ(table.size(), 1u);
    EXPECT_EQ(table.records()[0].gemv_us, plan.gemv_us) << "the record was not rewritten with the GEMV's time";
    EXPECT_EQ(table.records()[0].gemv, plan.gemv);
}

// fp32 operands, otherwise an eligible decode shape: cuBLASLt under kAlways.
TEST_F(CudaGemmGemvFp32Test, AlwaysLeavesFloat32ToCublasLt) {
    for (const bool bias : {false, true}) {
        SCOPED_TRACE(bias ? "with bias" : "without bias");
        Use(GemmGemv::kAlways, true);
        const Layer l(1, 4096, 1536, DType::kFloat32, bias ? 81 : 80);
        EXPECT_TRUE(ForwardMatchesFloat64(Forward(l, bias), l, bias, kUnfusedBiasRoundings));
        const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
        EXPECT_FALSE(infos.empty());
        for (const GemmPlanInfo& plan : infos) {
            EXPECT_FALSE(plan.gemv) << plan.key;
            EXPECT_EQ(plan.gemv_us, 0.0) << plan.key;
        }
        EXPECT_EQ(GetGemmPlanStats().gemv, 0u) << Keys(infos);
    }
}

// kOff: a tuned eligible product never runs the GEMV, and the GEMV is not even timed.
TEST_P(CudaGemmGemvTest, OffKeepsCublasLtAndTimesNoGemv) {
    const DType dtype = GetParam();
    Use(GemmGemv::kOff, true);
    const Layer l(1, 4096, 1536, dtype, 82);
    EXPECT_TRUE(ForwardMatchesFloat64(Forward(l, true), l, true, kUnfusedBiasRoundings));
    const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
    ASSERT_EQ(infos.size(), 1u) << Keys(infos);
    EXPECT_TRUE(infos[0].tuned) << infos[0].key;
    EXPECT_FALSE(infos[0].gemv) << infos[0].key;
    EXPECT_EQ(infos[0].gemv_us, 0.0) << infos[0].key;
    EXPECT_EQ(GetGemmPlanStats().gemv, 0u);
}

// kAuto, tuning on: the GEMV is timed against cuBLASLt's kept algorithm. Which wins is the hardware's business;
// whichever it is, the plan says so consistently, the result is right and repeats bit for bit.
TEST_P(CudaGemmGemvTest, AutoTimesTheGemvAndKeepsOneKernel) {
    const DType dtype = GetParam();
    std::uint64_t seed = 83;
    for (const GemvShape& shape : std::vector<GemvShape>{{1536, 4096}, {4096, 1024}}) {
        SCOPED_TRACE(::testing::Message() << "out=" << shape.out << " in=" << shape.in);
        Use(GemmGemv::kAuto, true);
        const Layer l(1, shape.in, shape.out, dtype, seed++);
        const Tensor y = Forward(l, true, 999);
        const Tensor again = Forward(l, true, 998);
        EXPECT_TRUE(ForwardMatchesFloat64(y, l, true, kUnfusedBiasRoundings));
        EXPECT_EQ(HostBytes(again), HostBytes(y)) << "the second call changed the bits";
        const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
        ASSERT_EQ(infos.size(), 1u) << Keys(infos);
        const GemmPlanInfo& plan = infos[0];
        EXPECT_TRUE(plan.tuned) << plan.key;
        EXPECT_GT(plan.gemv_us, 0.0) << plan.key << ": the GEMV was not timed";
        EXPECT_GT(plan.gemv_cublaslt_us, 0.0) << plan.key << ": cuBLASLt was not timed beside it";
        // kAuto keeps the faster by the 1 % margin: the choice follows the two times it stores.
        EXPECT_EQ(plan.gemv, plan.gemv_us < plan.gemv_cublaslt_us * 0.99) << plan.key;
        EXPECT_EQ(GetGemmPlanStats().gemv, plan.gemv ? 1u : 0u);
        std::printf("[ measured ] %s m=%lld k=%lld: GEMV %.2f us, cuBLASLt (same passes) %.2f us -> %s\n",
                    std::string(ShortDTypeName(dtype)).c_str(), static_cast<long long>(shape.out),
                    static_cast<long long>(shape.in), plan.gemv_us, plan.gemv_cublaslt_us,
                    plan.gemv ? "GEMV" : "cuBLASLt");
    }
}

// kAuto, tuning off (and no tuning file): nothing measured the GEMV faster, so cuBLASLt.
TEST_P(CudaGemmGemvTest, AutoWithTuningOffKeepsCublasLt) {
    const DType dtype = GetParam();
    Use(GemmGemv::kAuto, false);
    const Layer l(1, 4096, 1536, dtype, 85);
    EXPECT_TRUE(ForwardMatchesFloat64(Forward(l, true), l, true, kUnfusedBiasRoundings));
    const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
    ASSERT_EQ(infos.size(), 1u) << Keys(infos);
    EXPECT_FALSE(infos[0].gemv) << infos[0].key;
    EXPECT_EQ(infos[0].gemv_us, 0.0) << infos[0].key;
    EXPECT_EQ(GetGemmPlanStats().gemv, 0u);
}

// The tuning file keeps what tuning measured (the GEMV faster or not), not what a mode forced; a plan read from it
// follows the record under kAuto, runs the GEMV under kAlways and cuBLASLt under kOff, without a heuristic query or
// timing. Both record values are checked: the measured one, then the record flipped by hand.
TEST_P(CudaGemmGemvTest, TuningFileKeepsTheMeasuredKernelAndTheModesReadIt) {
    const DType dtype = GetParam();
    TempFile file;
    const Layer l(1, 4096, 1536, dtype, 86);
    Use(GemmGemv::kAlways, true, file.path());
    const Tensor first = Forward(l, true, 999);
    EXPECT_TRUE(ForwardMatchesFloat64(first, l, true, kGemvRoundings));
    ASSERT_EQ(GemmPlanInfos().size(), 1u);
    const GemmPlanInfo tuned = GemmPlanInfos()[0];
    EXPECT_TRUE(tuned.gemv) << "kAlways runs the GEMV";
    std::stringstream text;
    text << std::ifstream(file.path()).rdbuf();
    EXPECT_NE(text.str().find("\"kernel\":"), std::string::npos) << text.str();
    GemmTuningTable table = GemmTuningTable::Load(file.path());
    ASSERT_EQ(table.size(), 1u) << text.str();
    const kernels::GemmTuningRecord measured = table.records()[0];
    EXPECT_NE(measured.key.find(ForwardShape(l)), std::string::npos) << measured.key;
    EXPECT_EQ(measured.gemv_us, tuned.gemv_us);
    EXPECT_GT(measured.gemv_us, 0.0);
    EXPECT_EQ(measured.gemv_cublaslt_us, tuned.gemv_cublaslt_us);
    EXPECT_EQ(measured.gemv, measured.gemv_us < measured.gemv_cublaslt_us * 0.99) << "the record keeps the measurement";
    EXPECT_EQ(measured.chosen_us, tuned.chosen_us);
    std::printf("[ measured ] %s: GEMV %.2f us, cuBLASLt %.2f us, record says %s\n", DTypeName(dtype).data(),
                measured.gemv_us, measured.gemv_cublaslt_us, measured.gemv ? "gemv" : "cublaslt");

    for (const bool record_gemv : {measured.gemv, !measured.gemv}) {
        kernels::GemmTuningRecord record = measured;
        record.gemv = record_gemv;
        table.Upsert(record);
        std::filesystem::remove(file.path());
        table.Save(file.path());
        for (const GemmGemv mode : {GemmGemv::kAuto, GemmGemv::kAlways, GemmGemv::kOff}) {
            SCOPED_TRACE(::testing::Message()
                         << "record " << (record_gemv ? "gemv" : "cublaslt") << ", mode " << static_cast<int>(mode));
            Use(mode, true, file.path()); // a new process: no plans, the file read afresh
            const bool runs_gemv = mode == GemmGemv::kAlways || (mode == GemmGemv::kAuto && record_gemv);
            const Tensor y = Forward(l, true, 998);
            EXPECT_TRUE(ForwardMatchesFloat64(y, l, true, runs_gemv ? kGemvRoundings : kUnfusedBiasRoundings));
            if (runs_gemv) {
                EXPECT_EQ(HostBytes(y), HostBytes(first)) << "the GEMV from the file wrote other bits";
            }
            const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
            ASSERT_EQ(infos.size(), 1u) << Keys(infos);
            EXPECT_TRUE(infos[0].from_file) << infos[0].key;
            EXPECT_EQ(infos[0].gemv, runs_gemv) << infos[0].key;
            const GemmPlanStats stats = GetGemmPlanStats();
            EXPECT_GE(stats.file_hits, 1u);
            EXPECT_EQ(stats.heuristic_queries, 0u) << "a cache hit asked the heuristic";
            EXPECT_EQ(stats.tuned, 0u) << "a cache hit was timed again";
            EXPECT_EQ(stats.gemv, runs_gemv ? 1u : 0u);
        }
    }
}

// A plan first built inside a capture under kAlways runs the GEMV in the graph (untimed), and the first eager call
// tunes it and keeps the GEMV: replay and eager write the same bits.
TEST_P(CudaGemmGemvTest, PlanFirstBuiltInsideACaptureRunsTheGemvInTheGraph) {
    const DType dtype = GetParam();
    Use(GemmGemv::kAlways, true);
    const Layer l(1, 4096, 1536, dtype, 87);
    Tensor y = RandomGpu({l.m, l.out}, dtype, 999, "poison_y", 100.0);
    Synchronize(Gpu());
    CapturedGraph graph(CudaContext::Get(0).stream(),
                        [&] { LinearForward(LinearForwardArgs{.x = l.x, .weight = l.w, .bias = &l.b, .y = y}); });
    {
        const GemmPlanStats stats = GetGemmPlanStats();
        EXPECT_EQ(stats.plans_built, 1u);
        EXPECT_EQ(stats.tuned, 0u) << "timed inside a capture";
        EXPECT_EQ(stats.gemv, 0u) << "counted before its tuning decided";
        const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
        ASSERT_EQ(infos.size(), 1u) << Keys(infos);
        EXPECT_TRUE(infos[0].gemv) << infos[0].key;
        EXPECT_EQ(infos[0].gemv_us, 0.0) << infos[0].key;
    }
    graph.Replay();
    EXPECT_TRUE(ForwardMatchesFloat64(y, l, true, kGemvRoundings)) << "graph";

    // The first eager call tunes the plan (the GEMV stays, now timed).
    const Tensor eager = Forward(l, true, 998);
    EXPECT_EQ(HostBytes(y), HostBytes(eager)) << "replay and eager call differ";
    {
        const GemmPlanStats stats = GetGemmPlanStats();
        EXPECT_EQ(stats.plans_built, 1u);
        EXPECT_EQ(stats.tuned, 1u) << "the first eager call tunes the plan";
        EXPECT_EQ(stats.gemv, 1u);
        const std::vector<GemmPlanInfo> infos = GemmPlanInfos();
        ASSERT_EQ(infos.size(), 1u) << Keys(infos);
        EXPECT_TRUE(infos[0].tuned) << infos[0].key;
        EXPECT_TRUE(infos[0].gemv) << infos[0].key;
        EXPECT_GT(infos[0].gemv_us, 0.0) << infos[0].key;
    }
    // The graph replays after the tuning too, over fresh garbage.
    y.CopyFrom(RandomGpu({l.m, l.out}, dtype, 997, "poison_y", 100.0));
    Synchronize(Gpu());
    graph.Replay();
    EXPECT_EQ(HostBytes(y), HostBytes(eager)) << "replay after tuning";
}

INSTANTIATE_TEST_SUITE_P(DType, CudaGemmGemvTest, HalfDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
