// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h), and
// every phase's collectives are asserted from the mesh groups' counters against the table of DESIGN.md §6.
// This file: dp x tp on a [2, W/2] {"dp", "tp"} mesh with GradSync.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_DIST_TENSOR_TEST_CUDA adds the bf16 and fp16
// cases) build this file, with the shared sizes, meshes, counts and comparisons of nn_test_util.h.

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/spmd/layout.h>

#include "nn_test_util.h"

namespace shardline {
namespace {

using namespace nn_test;

// ---- data parallel × tensor parallel -------------------------------------------------------------------------------

struct DataParallelCase {
    bool sequence_parallel = false;
    DType dtype = DType::kFloat32; ///< float32: integer data, bitwise; bf16 / fp16: random data, fp32 main grads
};

std::string DataParallelCaseName(const ::testing::TestParamInfo<DataParallelCase> &info) {
    return fmt::format("{}_{}", info.param.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       DTypeTag(info.param.dtype));
}

void PrintTo(const DataParallelCase &c, std::ostream *os) { *os << DataParallelCaseName({c, 0}); }

class DataParallelTest : public ::testing::TestWithParam<DataParallelCase> {};

// column → row on the dp×tp mesh, batch (dim 1 of [s, b, h]) sharded on dp, GradSync with buckets small enough that
// there are several. Per step: the tp group runs the column → row table, the dp group exactly one all-reduce per
// bucket, all of them launched during backward (a bucket goes as soon as its gradients are complete, so Finish issues
// none), and after Finish every gradient equals the dense one over the whole batch (bitwise for fp32 integers; half
// parameters get fp32 main grads). Two steps with different data: ZeroGrad must leave nothing of the first behind.
TEST_P(DataParallelTest, GradSyncAllReducesEachBucketOnceDuringBackwardAndGradientsMatchDense) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const bool sp = GetParam().sequence_parallel;
    const DType dtype = GetParam().dtype;
    const Data data = IsHalf(dtype) ? Data::kRandom : Data::kInteger;
    DeviceMesh &mesh = DpTpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const int dp_dim = mesh.dim_index("dp");
    const int tp_dim = mesh.dim_index("tp");
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kFfn, .sequence_parallel = sp}, Tp(mesh),
                                    WithName(Param(dtype), "dp.column"));
    nn::RowParallelLinear row(
        {.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true, .sequence_parallel = sp}, Tp(mesh),
        WithName(Param(dtype), "dp.row"));
    const PairFull params_full = MakePairFull(data, dtype, 15); // its x and dY are unused: each step draws its own
    SetPairFull(column, row, params_full, /*bias=*/true);

    std::vector<Variable> params = column.Parameters();
    for (const Variable &p : row.Parameters()) {
        params.push_back(p);
    }
    std::int64_t local_bytes = 0; // the buckets are fp32 whatever the parameters' dtype
    for (const Variable &p : params) {
        local_bytes += 4 * p.local().numel();
    }
    // A bucket holds one weight shard and a bias shard at most: several buckets, and at least one with two
    // parameters (one all-reduce per bucket, not per parameter).
    const std::int64_t bucket_bytes = 4 * (column.weight.local().numel() + column.bias.local().numel());
    nn::GradSync sync(params, mesh, {.dp_dim = "dp", .bucket_bytes = bucket_bytes});
    const int buckets = sync.num_buckets();
    EXPECT_GE(buckets, 2);
    EXPECT_LT(buckets, static_cast<int>(params.size())) << "a bucket per parameter";

    // x [s, b, h]: b on dp; with sequence parallelism s on tp as well.
    const spmd::Layout x_layout = sp ? LayoutOf(3, {{0, {tp_dim}}, {1, {dp_dim}}}) : LayoutOf(3, {{1, {dp_dim}}});
    for (std::uint64_t step = 0; step < 2; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, dtype, 100 + step);
        const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, dtype, 100 + step);
        sync.ZeroGrad();
        Variable x(DistTensor::FromFull(x_full, x_layout, mesh), true);

        ResetCounts(mesh);
        Variable y = row.Forward(column.Forward(x).output).output;
        ExpectPairForward(mesh, sp, x, y);

        ResetCounts(mesh);
        const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
        y.Backward(&dy);
        // tp: the column → row table. dp: the buckets' all-reduces, already issued during backward (none over a
        // dp group of one rank).
        const Calls tp_backward = PairCalls(sp);
        const int dp_calls = SizeOf(mesh, "dp") > 1 ? buckets : 0;
        ExpectCalls(mesh, {{"tp", Planned(tp, tp_backward)}, {"dp", {.all_reduce = dp_calls}}}, "backward");
        // The buckets cover every parameter's local gradient once, each starting on a 256-byte boundary (at most
        // 252 bytes of zero padding before each).
        const std::int64_t reduced = mesh.group("dp").Counts().Bytes(CollectiveKind::kAllReduce);
        if (dp_calls > 0) {
            EXPECT_GE(reduced, local_bytes);
            EXPECT_LE(reduced, local_bytes + 252 * static_cast<std::int64_t>(params.size()));
        } else {
            EXPECT_EQ(reduced, 0);
        }
        sync.Finish();
        ExpectCalls(mesh, {{"tp", Planned(tp, tp_backward)}, {"dp", {.all_reduce = dp_calls}}}, "backward + Finish");
        for (const Variable &p : params) {
            // 256 bytes from the bucket's start; the buffer itself is as aligned as its allocator makes it (at least
            // the 16 bytes the GEMMs and vectorised kernels need).
            EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.grad().local().data()) % 16, 0u)
                << p.name() << ": a main grad in a bucket starts 16-byte aligned";
            EXPECT_FALSE(p.grad().layout().IsPartial()) << p.name() << ": " << p.grad().ToString();
            EXPECT_EQ(p.grad().dtype(), DType::kFloat32) << p.name() << ": the main grad is fp32";
        }

        const PairGot got = GatherPair(x, y, column, row, /*bias=*/true);
        const DensePair ref =
            ReferencePair(x_full, params_full.w1, &params_full.b1, params_full.w2, &params_full.b2, dy_full);
        // Half: h rounds before the row GEMM, y and dX sum tp rounded partials, and the parameter grads (summed in
        // fp32) see the rounding of h or dh; under SP the row db sums tp rounded partials.
        EXPECT_TRUE(Matches(got.y, {kSeq, kBatch, kHidden}, ref.y, data, dtype, HalfFactor(tp, 2))) << "y";
        EXPECT_TRUE(Matches(got.dx, {kSeq, kBatch, kHidden}, ref.dx, data, dtype, HalfFactor(tp, 1))) << "dX";
        EXPECT_TRUE(Matches(got.dw1, {kFfn, kHidden}, ref.dw1, data, dtype, HalfFactor(1, 2))) << "column dW";
        EXPECT_TRUE(Matches(got.db1, {kFfn}, ref.db1, data, dtype, HalfFactor(1, 2))) << "column db";
        EXPECT_TRUE(Matches(got.dw2, {kHidden, kFfn}, ref.dw2, data, dtype, HalfFactor(1, 2))) << "row dW";
        EXPECT_TRUE(Matches(got.db2, {kHidden}, ref.db2, data, dtype, HalfFactor(sp ? tp : 1))) << "row db";
    }
}

// A bucket holding a parameter that got no gradient this step: ZeroGrad only marks main grads as standing for zeros
// (the first writer overwrites), so the bucket's all-reduce must fill that parameter's stale slot with zeros first.
TEST(DataParallelZeroGradTest, AParameterWithoutAGradientReducesAsZeros) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = DpTpMesh();
    const int dp_dim = mesh.dim_index("dp");
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kFfn}, Tp(mesh),
                                    WithName(Param(DType::kFloat32), "zg.column"));
    nn::ColumnParallelLinear idle({.in_features = kHidden, .out_features = kFfn}, Tp(mesh),
                                  WithName(Param(DType::kFloat32), "zg.idle"));
    std::vector<Variable> params = column.Parameters();
    for (const Variable &p : idle.Parameters()) {
        params.push_back(p);
    }
    // One bucket for all: the idle layer's slots share the all-reduce with the column's gradients.
    nn::GradSync sync(params, mesh, {.dp_dim = "dp", .bucket_bytes = std::int64_t{1} << 30});
    ASSERT_EQ(sync.num_buckets(), 1);
    const spmd::Layout x_layout = LayoutOf(3, {{1, {dp_dim}}});
    for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        for (const Variable &p : idle.Parameters()) {
            Tensor slot = p.grad().local(); // a view into the bucket
            slot.Fill(3.0);                 // stale values that must not survive ZeroGrad
        }
        sync.ZeroGrad();
        const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", Data::kInteger, DType::kFloat32, 200 + step);
        Variable x(DistTensor::FromFull(x_full, x_layout, mesh), false);
        Variable y = column.Forward(x).output;
        const DistTensor dy = DistTensor::FromFull(MakeFull(y.shape(), "dy", Data::kInteger, DType::kFloat32, 300),
                                                   y.value().layout(), mesh);
        y.Backward(&dy);
        sync.Finish();
        for (const Variable &p : idle.Parameters()) {
            const std::vector<double> g = p.grad().local().ToDoubleVector();
            EXPECT_EQ(g, std::vector<double>(g.size(), 0.0)) << p.name();
        }
        const std::vector<double> dw = column.weight.grad().local().ToDoubleVector();
        EXPECT_NE(dw, std::vector<double>(dw.size(), 0.0)) << "the column's weight grad arrived";
    }
}

std::vector<DataParallelCase> DataParallelCases() {
    std::vector<DType> dtypes = {DType::kFloat32};
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    dtypes.push_back(DType::kBFloat16);
    dtypes.push_back(DType::kFloat16);
#endif
    std::vector<DataParallelCase> cases;
    for (DType dtype : dtypes) {
        for (bool sp : {false, true}) {
            cases.push_back({.sequence_parallel = sp, .dtype = dtype});
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, DataParallelTest, ::testing::ValuesIn(DataParallelCases()), DataParallelCaseName);

} // namespace
} // namespace shardline
