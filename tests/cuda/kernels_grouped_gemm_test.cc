// The CUDA grouped GEMM's own behaviour (issue 15): the CUTLASS SM90 grouped kernel — every config, forward / dgrad /
// wgrad layouts, bf16 and fp16, wgrad into fp32 main grads — against float64 references on MoE-like shapes with
// empty and one-row experts; it and the cuBLASLt loop agree; it is bitwise deterministic run to run; with device
// sizes a grouped forward + backward is captured into a CUDA graph and replayed with new sizes written into the same
// buffer, equal to eager; the loop refuses a capture with device sizes, naming the op. On a GPU that is not an sm_90,
// or a build without CUTLASS, the CUTLASS cases skip with the reason (GroupedGemmPath).

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "captured_graph.h"
#include "grouped_gemm_helpers.h"
#include "helpers.h"

namespace shardline::testing {
namespace {

using grouped::CutlassExpected;
using grouped::ForwardProblem;
using grouped::HostSizes;
using grouped::Refs;
using grouped::ScopedChoice;
using grouped::Total;
using kernels::GroupedGemmChoice;
using kernels::GroupedGemmImpl;
using kernels::GroupedGemmRaster;
using kernels::GroupedGemmTile;

// Mixtral-like but small: 8 experts of uneven load (one empty, one with a single row), in/out multiples of 8.
constexpr std::int64_t kIn = 256;
constexpr std::int64_t kOut = 384;
const std::vector<std::int64_t> kSizes = {97, 0, 1, 300, 64, 211, 16, 335};
const std::vector<std::int64_t> kOtherSizes = {0, 512, 3, 0, 128, 77, 300, 4}; // the same total (1024)

Refs Reference(const Values &x, const Values &w, const Values &dy, const std::vector<std::int64_t> &sizes) {
    return grouped::Reference(x, w, dy, sizes, kOut, kIn);
}

using CutlassParam = std::tuple<DType, GroupedGemmTile, bool /*device sizes*/, GroupedGemmRaster>;

class GroupedCutlassTest : public CudaParamTest<CutlassParam> {
protected:
    void SetUp() override {
        CudaParamTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        dtype_ = std::get<0>(GetParam());
        choice_.emplace(GroupedGemmChoice{
            .impl = GroupedGemmImpl::kCutlass, .tile = std::get<1>(GetParam()), .raster = std::get<3>(GetParam())});
        const Tensor host = HostSizes(kSizes);
        sizes_ = std::get<2>(GetParam()) ? host.To(Gpu()) : host;
        rows_ = Total(kSizes);
        x_ = RandomGpu({rows_, kIn}, dtype_, 41, "x");
        w_ = RandomGpu({8, kOut, kIn}, dtype_, 41, "w", 1.0 / std::sqrt(static_cast<double>(kIn)));
        dy_ = RandomGpu({rows_, kOut}, dtype_, 41, "dy");
        const Tensor probe = Tensor::Empty({rows_, kOut}, dtype_, Gpu());
        const std::string path = kernels::GroupedGemmPath(ForwardProblem(x_, w_, probe, sizes_));
        if (path.rfind("cutlass", 0) != 0) {
            ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
            GTEST_SKIP() << "the CUTLASS grouped GEMM does not run here: " << path;
        }
        // The forced config and raster are what runs (every config of the instantiations is built for its dtype).
        ASSERT_EQ(path,
                  "cutlass " + grouped::ConfigName(std::get<1>(GetParam()), std::get<3>(GetParam())) + " (forced)");
        ref_ = Reference(x_.ToDoubleVector(), w_.ToDoubleVector(), dy_.ToDoubleVector(), kSizes);
    }
    DType dtype_ = DType::kBFloat16;
    std::optional<ScopedChoice> choice_;
    Tensor sizes_, x_, w_, dy_;
    std::int64_t rows_ = 0;
    Refs ref_;
};

TEST_P(GroupedCutlassTest, ForwardDgradAndWgradMatchFloat64) {
    Tensor y = RandomGpu({rows_, kOut}, dtype_, 9, "poison", 100.0);
    kernels::GroupedLinearForward({.x = x_, .weight = w_, .group_sizes = sizes_, .y = y});
    EXPECT_TRUE(ValuesMatch(y, ref_.y, dtype_)) << "forward (TN)";
    Tensor dx = RandomGpu({rows_, kIn}, dtype_, 9, "poison", 100.0);
    kernels::GroupedLinearBackwardInput({.dy = dy_, .weight = w_, .group_sizes = sizes_, .dx = dx});
    EXPECT_TRUE(ValuesMatch(dx, ref_.dx, dtype_)) << "dgrad (NN)";
    Tensor dw = RandomGpu({8, kOut, kIn}, dtype_, 9, "poison", 100.0);
    Tensor db = RandomGpu({8, kOut}, dtype_, 9, "poison", 100.0);
    kernels::GroupedLinearBackwardWeight({.dy = dy_, .x = x_, .group_sizes = sizes_, .dweight = dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dw, ref_.dw, dtype_)) << "wgrad (NT); the empty expert's grad must be 0";
    EXPECT_TRUE(ValuesMatch(db, ref_.db, dtype_)) << "bias grad";
}

TEST_P(GroupedCutlassTest, WgradAccumulatesIntoFloat32MainGrads) {
    Tensor dw = RandomGpu({8, kOut, kIn}, DType::kFloat32, 5, "main", 4.0);
    Tensor db = RandomGpu({8, kOut}, DType::kFloat32, 5, "main_db", 4.0);
    const Values want_dw = AddScaled(dw.ToDoubleVector(), ref_.dw);
    const Values want_db = AddScaled(db.ToDoubleVector(), ref_.db);
    kernels::GroupedLinearBackwardWeight(
        {.dy = dy_, .x = x_, .group_sizes = sizes_, .dweight = dw, .dbias = &db, .accumulate = true});
    // The empty expert keeps its old main grad: old + 0.
    EXPECT_TRUE(ValuesMatch(dw, want_dw, DType::kFloat32, 2));
    EXPECT_TRUE(ValuesMatch(db, want_db, DType::kFloat32, 2));
}

TEST_P(GroupedCutlassTest, AgreesWithTheCublasLtLoop) {
    Tensor y_cutlass = kernels::GroupedLinearForward(x_, w_, nullptr, sizes_);
    Tensor y_loop;
    {
        ScopedChoice loop({.impl = GroupedGemmImpl::kLoop});
        y_loop = kernels::GroupedLinearForward(x_, w_, nullptr, sizes_);
    }
    EXPECT_TRUE(ValuesMatch(y_cutlass, y_loop.ToDoubleVector(), dtype_, 2));
}

TEST_P(GroupedCutlassTest, IsBitwiseDeterministicRunToRun) {
    const Tensor first = kernels::GroupedLinearForward(x_, w_, nullptr, sizes_);
    Tensor dw1 = Tensor::Empty({8, kOut, kIn}, dtype_, Gpu());
    kernels::GroupedLinearBackwardWeight({.dy = dy_, .x = x_, .group_sizes = sizes_, .dweight = dw1});
    for (int run = 0; run < 3; ++run) {
        EXPECT_EQ(HostBytes(kernels::GroupedLinearForward(x_, w_, nullptr, sizes_)), HostBytes(first));
        Tensor dw = Tensor::Empty({8, kOut, kIn}, dtype_, Gpu());
        kernels::GroupedLinearBackwardWeight({.dy = dy_, .x = x_, .group_sizes = sizes_, .dweight = dw});
        EXPECT_EQ(HostBytes(dw), HostBytes(dw1));
    }
}

std::string CutlassName(const ::testing::TestParamInfo<CutlassParam> &info) {
    return fmt::format("{}_{}_{}_along_{}", ShortDTypeName(std::get<0>(info.param)),
                       grouped::ConfigName(std::get<1>(info.param)),
                       std::get<2>(info.param) ? "device_sizes" : "host_sizes",
                       std::get<3>(info.param) == GroupedGemmRaster::kAlongN ? "n" : "m");
}

// bf16 has every config; fp16 the cooperative 256x128 and 128x128 (grouped_cutlass.h). Each with both raster orders.
INSTANTIATE_TEST_SUITE_P(CutlassBf16, GroupedCutlassTest,
                         ::testing::Combine(::testing::Values(DType::kBFloat16),
                                            ::testing::Values(GroupedGemmTile::k256x128, GroupedGemmTile::k128x128,
                                                              GroupedGemmTile::kPingpong128x128,
                                                              GroupedGemmTile::kPingpong128x64,
                                                              GroupedGemmTile::k128x256),
                                            ::testing::Bool(),
                                            ::testing::Values(GroupedGemmRaster::kAlongM, GroupedGemmRaster::kAlongN)),
                         CutlassName);
INSTANTIATE_TEST_SUITE_P(CutlassFp16, GroupedCutlassTest,
                         ::testing::Combine(::testing::Values(DType::kFloat16),
                                            ::testing::Values(GroupedGemmTile::k256x128, GroupedGemmTile::k128x128),
                                            ::testing::Bool(),
                                            ::testing::Values(GroupedGemmRaster::kAlongM, GroupedGemmRaster::kAlongN)),
                         CutlassName);

// ---- CUDA graphs --------------------------------------------------------------------------------------------------

class GroupedGraphTest : public CudaTest {};

// Forward (and GroupedBiasAdd), dgrad, wgrad and the bias grad with device sizes, captured once; the sizes buffer then
// gets other sizes (the same total) and the replay equals an eager run with them.
TEST_F(GroupedGraphTest, CapturedForwardBackwardReplaysWithNewSizes) {
    const DType dtype = DType::kBFloat16;
    ScopedChoice auto_choice({});
    const std::int64_t rows = Total(kSizes);
    const Tensor sizes = HostSizes(kSizes).To(Gpu());
    const Tensor x = RandomGpu({rows, kIn}, dtype, 43, "x");
    const Tensor w = RandomGpu({8, kOut, kIn}, dtype, 43, "w", 1.0 / std::sqrt(static_cast<double>(kIn)));
    const Tensor b = RandomGpu({8, kOut}, dtype, 43, "b");
    const Tensor dy = RandomGpu({rows, kOut}, dtype, 43, "dy");
    Tensor y = Tensor::Empty({rows, kOut}, dtype, Gpu());
    const std::string path = kernels::GroupedGemmPath(ForwardProblem(x, w, y, sizes));
    if (path.rfind("cutlass", 0) != 0) {
        ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
        GTEST_SKIP() << "device sizes without CUTLASS read the sizes on the host: " << path;
    }
    Tensor dx = Tensor::Empty({rows, kIn}, dtype, Gpu());
    Tensor dw = Tensor::Empty({8, kOut, kIn}, DType::kFloat32, Gpu());
    Tensor db = Tensor::Empty({8, kOut}, DType::kFloat32, Gpu());
    auto step = [&] {
        kernels::GroupedLinearForward({.x = x, .weight = w, .bias = &b, .group_sizes = sizes, .y = y});
        // And the bias once more as a row-parallel grouped layer adds it after its reduction: one launch reading the
        // device sizes (it read them on the host before, which a capture refuses).
        kernels::GroupedBiasAdd(y, b, sizes);
        kernels::GroupedLinearBackwardInput({.dy = dy, .weight = w, .group_sizes = sizes, .dx = dx});
        dw.Fill(0.0);
        db.Fill(0.0);
        kernels::GroupedLinearBackwardWeight(
            {.dy = dy, .x = x, .group_sizes = sizes, .dweight = dw, .dbias = &db, .accumulate = true});
    };
    CudaContext &ctx = CudaContext::Get(0);
    // An eager step first, as a program warms up before capturing: it tunes the shape classes (no timing inside a
    // capture), so the graph and the eager runs below take the same configs.
    step();
    Synchronize(Gpu());
    CapturedGraph graph(ctx.stream(), step);
    for (const std::vector<std::int64_t> &next : {kOtherSizes, kSizes}) {
        Tensor(sizes).CopyFrom(HostSizes(next));
        graph.Replay();
        const std::vector<unsigned char> y_graph = HostBytes(y), dx_graph = HostBytes(dx), dw_graph = HostBytes(dw),
                                         db_graph = HostBytes(db);
        step(); // eager, with the same sizes
        Synchronize(Gpu());
        EXPECT_EQ(y_graph, HostBytes(y)) << "y";
        EXPECT_EQ(dx_graph, HostBytes(dx)) << "dx";
        EXPECT_EQ(dw_graph, HostBytes(dw)) << "dw";
        EXPECT_EQ(db_graph, HostBytes(db)) << "db";
        // And the values are right for the new sizes.
        const Refs ref = Reference(x.ToDoubleVector(), w.ToDoubleVector(), dy.ToDoubleVector(), next);
        EXPECT_TRUE(ValuesMatch(dx, ref.dx, dtype)) << "dx for the replayed sizes";
        EXPECT_TRUE(ValuesMatch(dw, ref.dw, DType::kFloat32, 2)) << "dw for the replayed sizes";
    }
}

TEST_F(GroupedGraphTest, LoopRefusesACaptureWithDeviceSizes) {
    ScopedChoice loop({.impl = GroupedGemmImpl::kLoop});
    const Tensor sizes = HostSizes(kSizes).To(Gpu());
    const std::int64_t rows = Total(kSizes);
    const Tensor x = RandomGpu({rows, kIn}, DType::kBFloat16, 44, "x");
    const Tensor w = RandomGpu({8, kOut, kIn}, DType::kBFloat16, 44, "w");
    Tensor y = Tensor::Empty({rows, kOut}, DType::kBFloat16, Gpu());
    Synchronize(Gpu());
    std::string message;
    try {
        CapturedGraph graph(CudaContext::Get(0).stream(), [&] {
            kernels::GroupedLinearForward({.x = x, .weight = w, .group_sizes = sizes, .y = y});
        });
    } catch (const Error &e) {
        message = e.what();
    }
    EXPECT_NE(message.find("GroupedGemm: device-resident group sizes are read on the host by this provider"),
              std::string::npos)
        << message;
}

// ---- autograd on CUDA: analytic gradients against float64
// ------------------------------------------------------------

class GroupedAutogradCudaTest : public CudaParamTest<DType> {};

// y = GroupedLinear(x, W, b) with device sizes; backward of dy gives dx, dW (the empty expert's 0) and db, each against
// the float64 reference.
TEST_P(GroupedAutogradCudaTest, GradientsMatchFloat64) {
    const DType dtype = GetParam();
    const std::int64_t rows = Total(kSizes);
    const Tensor sizes = HostSizes(kSizes).To(Gpu());
    autograd::Variable x(RandomGpu({rows, kIn}, dtype, 45, "x"), true);
    autograd::Variable w(RandomGpu({8, kOut, kIn}, dtype, 45, "w", 1.0 / std::sqrt(static_cast<double>(kIn))), true);
    autograd::Variable b(RandomGpu({8, kOut}, dtype, 45, "b"), true);
    const Tensor dy = RandomGpu({rows, kOut}, dtype, 45, "dy");
    autograd::Variable y = autograd::GroupedLinear(x, w, b, sizes);
    const dist::DistTensor dout = dist::DistTensor::Local(dy);
    y.Backward(&dout);
    ASSERT_TRUE(x.grad().defined() && w.grad().defined() && b.grad().defined()) << "the graph was cut";
    const Refs ref = Reference(x.local().ToDoubleVector(), w.local().ToDoubleVector(), dy.ToDoubleVector(), kSizes);
    EXPECT_TRUE(ValuesMatch(x.grad().local(), ref.dx, dtype)) << "dx";
    EXPECT_TRUE(ValuesMatch(w.grad().local(), ref.dw, dtype)) << "dW";
    EXPECT_TRUE(ValuesMatch(b.grad().local(), ref.db, dtype)) << "db";
}

INSTANTIATE_TEST_SUITE_P(Cuda, GroupedAutogradCudaTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
