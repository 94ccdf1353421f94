// The functional layer beyond one layer kind: meshes with a data-parallel dim, the plan cache, a column -> GELU -> row
// MLP in a foreign training loop (docs/functional.md's example) against the dense MLP in float64 — with the GELU in
// separate kernels and fused in the GEMM epilogues — and on CUDA half precision and the caller's stream and workspace.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_FUNCTIONAL_TEST_CUDA) build this file, with
// the shared problem, meshes and RunColumn / RunRow of functional_test_util.h.

#include <cstddef>
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>

#include "functional_test_util.h"

namespace shardline {
namespace {

using namespace functional_test;

// ---- meshes with a data-parallel dim
// -----------------------------------------------------------------------------------

// dp x tp with tp the minor dim, and tp x dp with tp the major one: each replica has its own data, collectives run on
// the tp group only and the results match each replica's dense reference.
TEST(FunctionalLinearTest, DataParallelMeshCommunicatesOverTheTpDimOnly) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (MeshKind mesh : {MeshKind::kDpTp, MeshKind::kTpDp}) {
        RunColumn({.mesh = mesh, .problem = Fp32Problems()[0]});
        RunColumn({.mesh = mesh, .problem = Fp32Problems()[0], .sequence_parallel = true});
        RunRow({.mesh = mesh, .problem = Fp32Problems()[0]});
        RunRow({.mesh = mesh, .problem = Fp32Problems()[1], .sequence_parallel = true});
    }
}

// ---- the cache
// ---------------------------------------------------------------------------------------------------------

TEST(FunctionalLinearTest, SteadyStateCallsFindTheirRuleAndPlansWithoutInferring) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    functional::ClearPlanCache();
    const ColumnCase c{.problem = Fp32Problems()[0], .sequence_parallel = true};
    RunColumn(c); // forward infers (forward + grad rule at once); backward finds them
    const functional::PlanCacheStats first = functional::GetPlanCacheStats();
    EXPECT_EQ(first.misses, 1u);
    EXPECT_EQ(first.hits, 1u);
    EXPECT_EQ(first.size, 1u);
    RunColumn(c);
    RunColumn(c);
    const functional::PlanCacheStats later = functional::GetPlanCacheStats();
    EXPECT_EQ(later.misses, 1u) << "a steady-state call infers nothing";
    EXPECT_EQ(later.hits, 5u);
    RunRow({.problem = Fp32Problems()[0]}); // another configuration: one more inference
    EXPECT_EQ(functional::GetPlanCacheStats().misses, 2u);
    EXPECT_EQ(functional::GetPlanCacheStats().size, 2u);
}

// ---- an MLP in a foreign training loop (docs/functional.md's example)
// -------------------------------------------------

// Column (sequence parallel) -> GELU -> row (sequence parallel), forward and backward with the caller's own buffers
// and "autograd" (the caller keeps x_total and h), against the dense MLP.
TEST(FunctionalLinearTest, ColumnThenRowMlpMatchesTheDenseMlp) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    constexpr std::int64_t kS = 8;
    constexpr std::int64_t kH = 16;
    constexpr std::int64_t kF = 32;
    const DType f32 = DType::kFloat32;
    const Tensor x_full = MakeFull({kS, kH}, "x", Data::kRandom, f32, 5);
    const Tensor w1_full = MakeFull({kF, kH}, "w1", Data::kRandom, f32, 5);
    const Tensor b1_full = MakeFull({kF}, "b1", Data::kRandom, f32, 5);
    const Tensor w2_full = MakeFull({kH, kF}, "w2", Data::kRandom, f32, 5);
    const Tensor b2_full = MakeFull({kH}, "b2", Data::kRandom, f32, 5);
    const Tensor dz_full = MakeFull({kS, kH}, "dz", Data::kRandom, f32, 5);

    // The trainer's own tensors: this rank's shards.
    const Tensor x = Shard(x_full, 0, m);
    const Tensor w1 = Shard(w1_full, 0, m);
    const Tensor b1 = Shard(b1_full, 0, m);
    const Tensor w2 = Shard(w2_full, 1, m);
    const Tensor &b2 = b2_full;
    const Tensor dz = Shard(dz_full, 0, m);
    const ColumnParallelLinearOptions fc1{.in_features = kH, .out_features = kF, .sequence_parallel = true};
    const RowParallelLinearOptions fc2{
        .in_features = kF, .out_features = kH, .input_is_parallel = true, .sequence_parallel = true};

    Tensor x_total = Tensor::Empty({kS, kH}, f32, TestDevice());
    Tensor h = Tensor::Empty({kS, kF / tp}, f32, TestDevice());
    ColumnParallelLinearForward(
        fc1, {.x = ViewOf(x), .weight = ViewOf(w1), .bias = ViewOf(b1), .y = ViewOf(h), .x_total = ViewOf(x_total)},
        m.group());
    const Tensor a = kernels::GeluForward(h);
    Tensor z = Tensor::Empty({kS / tp, kH}, f32, TestDevice());
    RowParallelLinearForward(fc2, {.x = ViewOf(a), .weight = ViewOf(w2), .bias = ViewOf(b2), .y = ViewOf(z)},
                             m.group());

    Tensor da = Tensor::Empty(a.shape(), f32, TestDevice());
    Tensor dw2 = Tensor::Empty(w2.shape(), f32, TestDevice());
    Tensor db2 = Tensor::Empty(b2.shape(), f32, TestDevice());
    RowParallelLinearBackward(fc2,
                              {.dy = ViewOf(dz),
                               .x = ViewOf(a),
                               .weight = ViewOf(w2),
                               .dx = ViewOf(da),
                               .dweight = ViewOf(dw2),
                               .dbias = ViewOf(db2)},
                              m.group());
    const Tensor dh = kernels::GeluBackward(da, h);
    Tensor dx = Tensor::Empty(x.shape(), f32, TestDevice());
    Tensor dw1 = Tensor::Empty(w1.shape(), f32, TestDevice());
    Tensor db1 = Tensor::Empty(b1.shape(), f32, TestDevice());
    ColumnParallelLinearBackward(fc1,
                                 {.dy = ViewOf(dh),
                                  .x_total = ViewOf(x_total),
                                  .weight = ViewOf(w1),
                                  .dx = ViewOf(dx),
                                  .dweight = ViewOf(dw1),
                                  .dbias = ViewOf(db1)},
                                 m.group());

    // The dense MLP in float64.
    const Values b1v = b1_full.ToDoubleVector();
    const Values b2v = b2_full.ToDoubleVector();
    const testing::RefMlpResult ref =
        testing::RefMlp(x_full.ToDoubleVector(), w1_full.ToDoubleVector(), &b1v, w2_full.ToDoubleVector(), &b2v,
                        dz_full.ToDoubleVector(), kS, kH, kF, /*gelu=*/true);
    const DType t = f32;
    EXPECT_TRUE(Matches(Gather(z, {kS, kH}, 0, m), ref.y, Data::kRandom, t)) << "z";
    EXPECT_TRUE(Matches(Gather(dw2, {kH, kF}, 1, m), ref.dw2, Data::kRandom, t)) << "dw2";
    EXPECT_TRUE(Matches(db2, ref.db2, Data::kRandom, t)) << "db2";
    EXPECT_TRUE(Matches(Gather(dx, {kS, kH}, 0, m), ref.dx, Data::kRandom, t)) << "dx";
    EXPECT_TRUE(Matches(Gather(dw1, {kF, kH}, 0, m), ref.dw1, Data::kRandom, t)) << "dw1";
    EXPECT_TRUE(Matches(Gather(db1, {kF}, 0, m), ref.db1, Data::kRandom, t)) << "db1";
}

// ---- the same MLP with the GELU in the GEMM epilogues ------------------------------------------------------------

struct MlpCase {
    bool fused = true; ///< GELU in fc1's epilogue, its gradient and db1 in fc2's dgrad
    bool sequence_parallel = false;
    bool want_dx = true;
    GradMode mode = GradMode::kOverwrite; ///< kAccumulate: into float32 main grads holding earlier values
    DType dtype = DType::kFloat32;
};

/// What an MLP step computed, gathered to full tensors on every rank.
struct MlpResult {
    Tensor z, dx, dw1, db1, dw2, db2;
};

constexpr std::int64_t kMlpS = 8;
constexpr std::int64_t kMlpH = 16;
constexpr std::int64_t kMlpF = 32;

/// Column -> GELU -> row through the functional API, fused (activation / input_activation) or with the separate GELU
/// kernels, asserting each phase's collectives: forward one all-reduce (sp: all-gather x + reduce-scatter z), backward
/// one all-reduce of dx when wanted (sp: all-gather dz + reduce-scatter dx when wanted), the same either way.
MlpResult RunMlp(const MlpCase &c, const MeshAndDim &m) {
    const std::int64_t tp = m.tp();
    const bool sp = c.sequence_parallel;
    const DType t = c.dtype;
    const Tensor x_full = MakeFull({kMlpS, kMlpH}, "x", Data::kRandom, t, 6);
    const Tensor x = sp ? Shard(x_full, 0, m) : x_full;
    const Tensor w1 = Shard(MakeFull({kMlpF, kMlpH}, "w1", Data::kRandom, t, 6), 0, m);
    const Tensor b1 = Shard(MakeFull({kMlpF}, "b1", Data::kRandom, t, 6), 0, m);
    const Tensor w2 = Shard(MakeFull({kMlpH, kMlpF}, "w2", Data::kRandom, t, 6), 1, m);
    const Tensor b2 = MakeFull({kMlpH}, "b2", Data::kRandom, t, 6);
    const Tensor dz_full = MakeFull({kMlpS, kMlpH}, "dz", Data::kRandom, t, 6);
    const Tensor dz = sp ? Shard(dz_full, 0, m) : dz_full;
    const ColumnParallelLinearOptions fc1{.in_features = kMlpH, .out_features = kMlpF, .sequence_parallel = sp};
    const RowParallelLinearOptions fc2{
        .in_features = kMlpF, .out_features = kMlpH, .input_is_parallel = true, .sequence_parallel = sp};

    ResetCounts(m);
    Tensor x_total = sp ? Poisoned({kMlpS, kMlpH}, t) : Tensor();
    Tensor pre = Poisoned({kMlpS, kMlpF / tp}, t); // fused: the pre-activation; unfused: fc1's output
    Tensor h = Poisoned({kMlpS, kMlpF / tp}, t);   // the activation, fc2's input
    Tensor z = Poisoned({kMlpS / (sp ? tp : 1), kMlpH}, t);
    if (c.fused) {
        ColumnParallelLinearForward(fc1,
                                    {.x = ViewOf(x),
                                     .weight = ViewOf(w1),
                                     .bias = ViewOf(b1),
                                     .y = ViewOf(h),
                                     .x_total = ViewOf(x_total),
                                     .activation = kernels::LinearActivation::kGeluTanh,
                                     .pre_activation = ViewOf(pre)},
                                    m.group());
    } else {
        ColumnParallelLinearForward(
            fc1,
            {.x = ViewOf(x), .weight = ViewOf(w1), .bias = ViewOf(b1), .y = ViewOf(pre), .x_total = ViewOf(x_total)},
            m.group());
        kernels::GeluForward({.x = pre, .y = h});
    }
    RowParallelLinearForward(fc2, {.x = ViewOf(h), .weight = ViewOf(w2), .bias = ViewOf(b2), .y = ViewOf(z)},
                             m.group());
    ExpectCalls(m, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1}, "MLP forward");

    // Main grads start from earlier values when accumulating (float32), from NaN when overwritten.
    const bool accumulate = c.mode == GradMode::kAccumulate;
    const DType gt = accumulate ? DType::kFloat32 : t;
    // This rank's shard (split on `dim`, -1: whole) of the global gradient `shape`.
    auto grad = [&](const Shape &shape, int dim, std::string_view name) {
        return Shard(accumulate ? MakeFull(shape, name, Data::kRandom, gt, 7) : Poisoned(shape, gt), dim, m);
    };
    Tensor dw1 = grad({kMlpF, kMlpH}, 0, "main_dw1");
    Tensor db1 = grad({kMlpF}, 0, "main_db1");
    Tensor dw2 = grad({kMlpH, kMlpF}, 1, "main_dw2");
    Tensor db2 = grad({kMlpH}, -1, "main_db2");
    Tensor dh = Poisoned(h.shape(), t); // fused: the pre-activation's gradient; unfused: the activation's
    Tensor dx = c.want_dx ? Poisoned(x.shape(), t) : Tensor();
    ResetCounts(m);
    RowParallelLinearBackward(
        fc2,
        {.dy = ViewOf(dz),
         .x = ViewOf(h),
         .weight = ViewOf(w2),
         .dx = ViewOf(dh),
         .dweight = ViewOf(dw2),
         .dbias = ViewOf(db2),
         .param_grads = c.mode,
         .input_activation = c.fused ? kernels::LinearActivation::kGeluTanh : kernels::LinearActivation::kNone,
         .pre_activation = c.fused ? ViewOf(pre) : TensorView{},
         .pre_activation_dbias = c.fused ? ViewOf(db1) : TensorView{}},
        m.group());
    const Tensor dpre = c.fused ? dh : kernels::GeluBackward(dh, pre);
    ColumnParallelLinearBackward(fc1,
                                 {.dy = ViewOf(dpre),
                                  .x = sp ? TensorView{} : ViewOf(x),
                                  .x_total = ViewOf(x_total),
                                  .weight = ViewOf(w1),
                                  .dx = ViewOf(dx),
                                  .dweight = ViewOf(dw1),
                                  .dbias = c.fused ? TensorView{} : ViewOf(db1),
                                  .param_grads = c.mode},
                                 m.group());
    const std::int64_t dx_calls = c.want_dx ? 1 : 0;
    ExpectCalls(m, sp ? Calls{.all_gather = 1, .reduce_scatter = dx_calls} : Calls{.all_reduce = dx_calls},
                "MLP backward");
    return {.z = Gather(z, {kMlpS, kMlpH}, sp ? 0 : -1, m),
            .dx = c.want_dx ? Gather(dx, {kMlpS, kMlpH}, sp ? 0 : -1, m) : Tensor(),
            .dw1 = Gather(dw1, {kMlpF, kMlpH}, 0, m),
            .db1 = Gather(db1, {kMlpF}, 0, m),
            .dw2 = Gather(dw2, {kMlpH, kMlpF}, 1, m),
            .db2 = db2};
}

// The fused MLP (GELU in fc1's GEMM epilogue; its gradient and fc1's bias grad in fc2's dgrad epilogue) against the
// dense MLP in float64, and against the same MLP with the separate GELU kernels: bit for bit on the CPU, where the
// fused kernels compute exactly what the separate ones do. Collectives as without the fusion.
TEST(FunctionalLinearTest, FusedGeluMlpMatchesTheDenseMlpAndTheUnfusedOne) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const DType t = DType::kFloat32;
    for (const bool sp : {false, true}) {
        for (const GradMode mode : {GradMode::kOverwrite, GradMode::kAccumulate}) {
            for (const bool want_dx : {true, false}) {
                SCOPED_TRACE(::testing::Message()
                             << (sp ? "sequence parallel" : "tensor parallel")
                             << (mode == GradMode::kAccumulate ? ", main grads" : "") << (want_dx ? "" : ", no dx"));
                const MlpResult fused = RunMlp({.sequence_parallel = sp, .want_dx = want_dx, .mode = mode}, m);
                const MlpResult apart =
                    RunMlp({.fused = false, .sequence_parallel = sp, .want_dx = want_dx, .mode = mode}, m);
                // The dense MLP in float64 (plus the earlier main-grad values when accumulating).
                const Values b1v = MakeFull({kMlpF}, "b1", Data::kRandom, t, 6).ToDoubleVector();
                const Values b2v = MakeFull({kMlpH}, "b2", Data::kRandom, t, 6).ToDoubleVector();
                testing::RefMlpResult ref = testing::RefMlp(
                    MakeFull({kMlpS, kMlpH}, "x", Data::kRandom, t, 6).ToDoubleVector(),
                    MakeFull({kMlpF, kMlpH}, "w1", Data::kRandom, t, 6).ToDoubleVector(), &b1v,
                    MakeFull({kMlpH, kMlpF}, "w2", Data::kRandom, t, 6).ToDoubleVector(), &b2v,
                    MakeFull({kMlpS, kMlpH}, "dz", Data::kRandom, t, 6).ToDoubleVector(), kMlpS, kMlpH, kMlpF, true);
                if (mode == GradMode::kAccumulate) {
                    auto old = [&](const Shape &shape, std::string_view name) {
                        return MakeFull(shape, name, Data::kRandom, DType::kFloat32, 7).ToDoubleVector();
                    };
                    ref.dw1 = Plus(ref.dw1, old({kMlpF, kMlpH}, "main_dw1"));
                    ref.db1 = Plus(ref.db1, old({kMlpF}, "main_db1"));
                    ref.dw2 = Plus(ref.dw2, old({kMlpH, kMlpF}, "main_dw2"));
                    ref.db2 = Plus(ref.db2, old({kMlpH}, "main_db2"));
                }
                // float32's rtol on the CPU; on CUDA cuBLASLt may evaluate gelu and gelu' in the epilogues its own
                // way: the kernel tests' GELU-epilogue budget of 4 roundings.
                const double rtol = testing::RelativeTolerance(t) * (TestDevice().is_cpu() ? 1.0 : 4.0);
                auto close = [&](const Tensor &got, const Values &want, const char *name) {
                    const std::string diff = testing::CompareValues(got.ToDoubleVector(), want, rtol);
                    EXPECT_TRUE(diff.empty()) << name << ": " << diff;
                };
                close(fused.z, ref.y, "z");
                close(apart.z, ref.y, "z (unfused)");
                if (want_dx) {
                    close(fused.dx, ref.dx, "dx");
                }
                close(fused.dw1, ref.dw1, "dw1");
                close(fused.db1, ref.db1, "db1");
                close(fused.dw2, ref.dw2, "dw2");
                close(fused.db2, ref.db2, "db2");
                if (TestDevice().is_cpu()) {
                    EXPECT_EQ(fused.z.ToDoubleVector(), apart.z.ToDoubleVector()) << "z";
                    if (want_dx) {
                        EXPECT_EQ(fused.dx.ToDoubleVector(), apart.dx.ToDoubleVector()) << "dx";
                    }
                    EXPECT_EQ(fused.dw1.ToDoubleVector(), apart.dw1.ToDoubleVector()) << "dw1";
                    EXPECT_EQ(fused.db1.ToDoubleVector(), apart.db1.ToDoubleVector()) << "db1";
                    EXPECT_EQ(fused.dw2.ToDoubleVector(), apart.dw2.ToDoubleVector()) << "dw2";
                }
            }
        }
    }
}

// ---- CUDA: half precision, the caller's stream and workspace
// -------------------------------------------------------------

#if SHARDLINE_FUNCTIONAL_TEST_CUDA

TEST(FunctionalCudaTest, HalfPrecisionMatchesDenseWithinTheDTypeTolerance) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        const Problem p{.lead = {8, 2}, .data = Data::kRandom, .dtype = dtype, .seed = 21};
        RunColumn({.problem = p});
        RunColumn({.problem = p, .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
        RunColumn({.problem = p, .gather_output = true});
        RunRow({.problem = p});
        RunRow({.problem = p, .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
        RunRow({.problem = p, .input_is_parallel = false});
    }
}

TEST(FunctionalCudaTest, RunsOnTheCallersStreamAndWorkspaceAndRestoresTheContext) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    CudaContext &ctx = CudaContext::Get(TestDevice().index);
    const cudaStream_t before = ctx.stream();
    void *const workspace_before = ctx.workspace();
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;
    void *workspace = nullptr;
    ASSERT_EQ(cudaMalloc(&workspace, kWorkspaceBytes), cudaSuccess);

    const Problem p{.lead = {8, 2}, .data = Data::kInteger, .seed = 31};
    const Dense d = MakeDense(p, m);
    Synchronize(TestDevice());
    const Tensor x = Shard(d.x, 0, m);
    const Tensor w = Shard(d.w, 0, m);
    const Tensor b = Shard(d.b, 0, m);
    Tensor y = Poisoned({8, 2, kOut / tp}, p.dtype);
    Tensor x_total = Poisoned(d.x.shape(), p.dtype);
    Synchronize(TestDevice());
    const functional::CudaExecution exec{.stream = stream, .workspace = workspace, .workspace_bytes = kWorkspaceBytes};
    ColumnParallelLinearForward(
        {.in_features = kIn, .out_features = kOut, .sequence_parallel = true},
        {.x = ViewOf(x), .weight = ViewOf(w), .bias = ViewOf(b), .y = ViewOf(y), .x_total = ViewOf(x_total)}, m.group(),
        exec);
    EXPECT_EQ(ctx.stream(), before) << "the context's stream is restored";
    EXPECT_EQ(ctx.workspace(), workspace_before) << "the context's workspace is restored";
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(Matches(Gather(y, {8, 2, kOut}, 2, m), d.y, p.data, p.dtype));
    Synchronize(TestDevice());
    ASSERT_EQ(cudaFree(workspace), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

#endif

} // namespace
} // namespace shardline
