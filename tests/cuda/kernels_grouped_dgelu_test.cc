// The grouped dgrad through a GELU (issue 16): GroupedLinearBackwardInput with input_activation gelu_tanh, i.e.
// GroupedGemm's kDGelu epilogue, dx_e = (dy_e·W_e) ⊙ gelu_tanh'(Z_e), on CUDA against a float64 reference on random
// data: bf16 and fp16; the CUTLASS kernel with the dGELU in its epilogue (cooperative 256x128, the EVT reading Z as
// the source C), a CUTLASS config without it (the GEMM, then the dGELU kernel), and the loop of cuBLASLt GEMMs; host
// and device sizes; 8 experts of uneven load with 0- and 1-row experts, 64 experts (many empty), and one expert. Z is
// only read; the fused path agrees with the unfused pair (the dgrad, then GeluBackward) within a rounding; it is
// bitwise deterministic run to run; with device sizes it is captured into a CUDA graph and replayed with new sizes.

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "captured_graph.h"
#include "grouped_gemm_helpers.h"
#include "helpers.h"
#include "reference.h"

namespace shardline::testing {
namespace {

using grouped::CutlassExpected;
using grouped::HostSizes;
using grouped::ScopedChoice;
using grouped::Total;
using kernels::GroupedGemmChoice;
using kernels::GroupedGemmImpl;
using kernels::GroupedGemmTile;
using kernels::LinearActivation;

constexpr std::int64_t kIn = 256;  ///< the dgrad's output features (the pre-activation's)
constexpr std::int64_t kOut = 384; ///< dy's features

enum class Experts { kEight, kSixtyFour, kOne };

std::vector<std::int64_t> SizesOf(Experts e) {
    switch (e) {
    case Experts::kEight:
        return {97, 0, 1, 300, 64, 211, 16, 335};
    case Experts::kSixtyFour: {
        std::vector<std::int64_t> s(64, 0);
        for (std::size_t i = 0; i < s.size(); ++i) {
            s[i] = i % 5 == 1 ? 0 : (i % 7 == 3 ? 1 : static_cast<std::int64_t>((i * 37) % 61)); // uneven, 0s and 1s
        }
        return s;
    }
    case Experts::kOne:
        return {517};
    }
    return {};
}

/// Per expert e: (dy_e·W_e) ⊙ gelu_tanh'(z_e) in float64, with z as stored (rounded to the dtype).
Values Reference(const Values &dy, const Values &w, const Values &z, const std::vector<std::int64_t> &sizes) {
    Values dx;
    std::int64_t first = 0;
    for (std::size_t e = 0; e < sizes.size(); ++e) {
        const std::int64_t m = sizes[e];
        const auto ei = static_cast<std::int64_t>(e);
        const Values we(w.begin() + ei * kOut * kIn, w.begin() + (ei + 1) * kOut * kIn);
        const Values dye(dy.begin() + first * kOut, dy.begin() + (first + m) * kOut);
        Values g = RefLinearBackwardInput(dye, we, m, kOut, kIn);
        for (std::int64_t i = 0; i < m * kIn; ++i) {
            g[static_cast<std::size_t>(i)] *= RefGeluTanhGrad(z[static_cast<std::size_t>((first * kIn) + i)]);
        }
        dx.insert(dx.end(), g.begin(), g.end());
        first += m;
    }
    return dx;
}

/// The GroupedGemm problem of that dgrad (as GroupedLinearBackwardInput builds it), for GroupedGemmPath: column-major
/// dX_eᶜ[in, M_e] = W_eᶜ[in, out]·dY_eᶜ[out, M_e], D and Z packed [rows, in].
kernels::GroupedGemmParams DgradProblem(const Tensor &dy, const Tensor &w, const Tensor &dx, const Tensor &z,
                                        const Tensor &sizes) {
    kernels::GroupedGemmParams p;
    p.m = kIn;
    p.k = kOut;
    p.group_count = sizes.numel();
    p.sizes = sizes.data_as<std::int64_t>();
    p.sizes_device = sizes.device();
    p.total = dy.size(0);
    p.a = {.data = w.data(), .ld = kIn, .group_stride = kOut * kIn};
    p.a_type = w.dtype();
    p.b = {.data = dy.data(), .ld = kOut, .row_stride = kOut};
    p.b_type = dy.dtype();
    p.c = {.data = dx.data(), .ld = kIn, .row_stride = kIn};
    p.c_type = dx.dtype();
    p.epilogue = kernels::GemmEpilogue::kDGelu;
    p.aux = {.data = z.data(), .ld = kIn, .row_stride = kIn};
    p.device = dx.device();
    return p;
}

/// How the problem runs: CUTLASS with the dGELU in the epilogue, CUTLASS then the dGELU kernel, or the loop.
enum class Path { kCutlassEpilogue, kCutlassKernel, kLoop };

using Param = std::tuple<DType, Path, bool /*device sizes*/, Experts>;

class GroupedDGeluTest : public CudaParamTest<Param> {
protected:
    void SetUp() override {
        CudaParamTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        dtype_ = std::get<0>(GetParam());
        const Path path = std::get<1>(GetParam());
        choice_.emplace(path == Path::kLoop
                            ? GroupedGemmChoice{.impl = GroupedGemmImpl::kLoop}
                            : GroupedGemmChoice{.impl = GroupedGemmImpl::kCutlass,
                                                .tile = path == Path::kCutlassEpilogue ? GroupedGemmTile::k256x128
                                                                                       : GroupedGemmTile::k128x128});
        sizes_list_ = SizesOf(std::get<3>(GetParam()));
        experts_ = static_cast<std::int64_t>(sizes_list_.size());
        const Tensor host = HostSizes(sizes_list_);
        sizes_ = std::get<2>(GetParam()) ? host.To(Gpu()) : host;
        rows_ = Total(sizes_list_);
        w_ = RandomGpu({experts_, kOut, kIn}, dtype_, 71, "w", 1.0 / std::sqrt(static_cast<double>(kOut)));
        dy_ = RandomGpu({rows_, kOut}, dtype_, 71, "dy");
        z_ = RandomGpu({rows_, kIn}, dtype_, 71, "z", 1.5); // spans gelu's curved part and both tails
        ASSERT_GT(AbsSum(z_.ToDoubleVector()), 0.0);
        Tensor probe = Tensor::Empty({rows_, kIn}, dtype_, Gpu());
        const std::string got = kernels::GroupedGemmPath(DgradProblem(dy_, w_, probe, z_, sizes_));
        if (path == Path::kLoop) {
            ASSERT_EQ(got.rfind("loop", 0), 0U) << got;
        } else if (got.rfind("cutlass", 0) != 0) {
            ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << got;
            GTEST_SKIP() << "the CUTLASS grouped GEMM does not run here: " << got;
        } else {
            const std::string suffix = path == Path::kCutlassEpilogue ? " dgelu-epilogue" : " dgelu-kernel";
            ASSERT_TRUE(got.size() > suffix.size() &&
                        got.compare(got.size() - suffix.size(), suffix.size(), suffix) == 0)
                << got;
        }
        ref_ = Reference(dy_.ToDoubleVector(), w_.ToDoubleVector(), z_.ToDoubleVector(), sizes_list_);
    }

    Tensor Dgrad(bool gelu) {
        Tensor dx = RandomGpu({rows_, kIn}, dtype_, 9, "poison", 100.0);
        kernels::GroupedLinearBackwardInput(
            {.dy = dy_,
             .weight = w_,
             .group_sizes = sizes_,
             .dx = dx,
             .input_activation = gelu ? LinearActivation::kGeluTanh : LinearActivation::kNone,
             .pre_activation = gelu ? &z_ : nullptr});
        return dx;
    }

    DType dtype_ = DType::kBFloat16;
    std::optional<ScopedChoice> choice_;
    std::vector<std::int64_t> sizes_list_;
    std::int64_t experts_ = 0, rows_ = 0;
    Tensor sizes_, w_, dy_, z_;
    Values ref_;
};

TEST_P(GroupedDGeluTest, MatchesFloat64AndLeavesThePreActivationAlone) {
    const std::vector<unsigned char> z_before = HostBytes(z_);
    const Tensor dx = Dgrad(true);
    // The fused epilogue rounds once (fp32 accumulator ⊙ fp32 gelu'); the unfused paths round the dgrad, then the
    // product: the GELU epilogue budget holds both.
    EXPECT_TRUE(ValuesMatch(dx, ref_, dtype_, kGeluEpilogueRoundings)) << "dx = (dy·W) ⊙ gelu'(z)";
    EXPECT_EQ(HostBytes(z_), z_before) << "the pre-activation is only read";
    // Not just the plain dgrad: the GELU's gradient was applied (a dropped epilogue fails here).
    const Values plain = Dgrad(false).ToDoubleVector();
    EXPECT_FALSE(ValuesMatch(plain, ref_, dtype_, kGeluEpilogueRoundings));
}

TEST_P(GroupedDGeluTest, AgreesWithTheDgradThenGeluBackward) {
    const Tensor fused = Dgrad(true);
    const Tensor unfused = kernels::GeluBackward(Dgrad(false), z_, kernels::GeluApproximation::kTanh);
    // Fused: one rounding of the exact value; unfused: the dgrad's rounding passes through gelu' (< 1.13), then the
    // product rounds: within a few roundings of each other.
    EXPECT_TRUE(ValuesMatch(fused, unfused.ToDoubleVector(), dtype_, kGeluEpilogueRoundings));
}

TEST_P(GroupedDGeluTest, IsBitwiseDeterministicRunToRun) {
    const std::vector<unsigned char> first = HostBytes(Dgrad(true));
    for (int run = 0; run < 3; ++run) {
        EXPECT_EQ(HostBytes(Dgrad(true)), first) << "run " << run;
    }
}

std::string ParamName(const ::testing::TestParamInfo<Param> &info) {
    const Path path = std::get<1>(info.param);
    const Experts experts = std::get<3>(info.param);
    return fmt::format("{}_{}_{}_{}", ShortDTypeName(std::get<0>(info.param)),
                       path == Path::kCutlassEpilogue ? "cutlass_epilogue"
                       : path == Path::kCutlassKernel ? "cutlass_kernel"
                                                      : "loop",
                       std::get<2>(info.param) ? "device_sizes" : "host_sizes",
                       experts == Experts::kEight       ? "e8"
                       : experts == Experts::kSixtyFour ? "e64"
                                                        : "e1");
}

INSTANTIATE_TEST_SUITE_P(
    All, GroupedDGeluTest,
    ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(Path::kCutlassEpilogue, Path::kCutlassKernel, Path::kLoop), ::testing::Bool(),
                       ::testing::Values(Experts::kEight, Experts::kSixtyFour, Experts::kOne)),
    ParamName);

// ---- GroupedLinearBackward with the dGELU under a CUDA graph; refusals ---------------------------------------------

class GroupedDGeluGraphTest : public CudaTest {};

// The dgrad with the dGELU and the wgrad (beside it on the side stream) with device sizes, captured once after an
// eager warm-up; the sizes buffer then gets other sizes (the same total) and the replay equals an eager run with them,
// and the float64 reference.
TEST_F(GroupedDGeluGraphTest, CapturedBackwardReplaysWithNewSizes) {
    const DType dtype = DType::kBFloat16;
    ScopedChoice auto_choice({});
    const std::vector<std::int64_t> a = SizesOf(Experts::kEight);
    const std::vector<std::int64_t> b = {0, 512, 3, 0, 128, 77, 300, 4}; // the same total
    ASSERT_EQ(Total(a), Total(b));
    const std::int64_t rows = Total(a);
    const Tensor sizes = HostSizes(a).To(Gpu());
    const Tensor w = RandomGpu({8, kOut, kIn}, dtype, 73, "w", 1.0 / std::sqrt(static_cast<double>(kOut)));
    const Tensor dy = RandomGpu({rows, kOut}, dtype, 73, "dy");
    const Tensor z = RandomGpu({rows, kIn}, dtype, 73, "z", 1.5);
    const Tensor h = kernels::GeluForward(z, kernels::GeluApproximation::kTanh);
    Tensor dx = Tensor::Empty({rows, kIn}, dtype, Gpu());
    Tensor dw = Tensor::Empty({8, kOut, kIn}, DType::kFloat32, Gpu());
    const std::string path = kernels::GroupedGemmPath(DgradProblem(dy, w, dx, z, sizes));
    if (path.rfind("cutlass", 0) != 0) {
        ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
        GTEST_SKIP() << "device sizes without CUTLASS read the sizes on the host: " << path;
    }
    auto step = [&] {
        dw.Fill(0.0);
        kernels::GroupedLinearBackward({.dy = dy,
                                        .x = &h,
                                        .weight = &w,
                                        .group_sizes = sizes,
                                        .dx = &dx,
                                        .dweight = &dw,
                                        .accumulate = true,
                                        .input_activation = LinearActivation::kGeluTanh,
                                        .pre_activation = &z});
    };
    step(); // tunes the shape classes (no timing inside a capture)
    Synchronize(Gpu());
    CapturedGraph graph(CudaContext::Get(0).stream(), step);
    for (const std::vector<std::int64_t> &next : {b, a}) {
        Tensor(sizes).CopyFrom(HostSizes(next));
        graph.Replay();
        const std::vector<unsigned char> dx_graph = HostBytes(dx), dw_graph = HostBytes(dw);
        step();
        Synchronize(Gpu());
        EXPECT_EQ(dx_graph, HostBytes(dx)) << "dx";
        EXPECT_EQ(dw_graph, HostBytes(dw)) << "dw";
        EXPECT_TRUE(ValuesMatch(dx, Reference(dy.ToDoubleVector(), w.ToDoubleVector(), z.ToDoubleVector(), next), dtype,
                                kGeluEpilogueRoundings))
            << "dx for the replayed sizes";
    }
}

// Bad input is refused naming the op and the values, before any kernel runs.
TEST_F(GroupedDGeluGraphTest, RefusesAMissingOrMisshapenPreActivation) {
    const std::int64_t rows = 16;
    const Tensor sizes = HostSizes({10, 6});
    const Tensor w = RandomGpu({2, kOut, kIn}, DType::kBFloat16, 74, "w");
    const Tensor dy = RandomGpu({rows, kOut}, DType::kBFloat16, 74, "dy");
    Tensor dx = Tensor::Empty({rows, kIn}, DType::kBFloat16, Gpu());
    const Tensor wrong = RandomGpu({rows, kIn + 8}, DType::kBFloat16, 74, "z");
    auto message = [&](const Tensor *z) {
        try {
            kernels::GroupedLinearBackwardInput({.dy = dy,
                                                 .weight = w,
                                                 .group_sizes = sizes,
                                                 .dx = dx,
                                                 .input_activation = LinearActivation::kGeluTanh,
                                                 .pre_activation = z});
        } catch (const Error &e) {
            return std::string(e.what());
        }
        return std::string();
    };
    EXPECT_NE(message(nullptr).find("GroupedLinearBackwardInput: input_activation gelu_tanh needs the pre-activation"),
              std::string::npos)
        << message(nullptr);
    EXPECT_NE(message(&wrong).find("GroupedLinearBackwardInput"), std::string::npos) << message(&wrong);
    EXPECT_NE(message(&dx).find("must not be dx itself"), std::string::npos) << message(&dx);
}

} // namespace
} // namespace shardline::testing
