// The CUDA grouped GEMM's per-shape choice by measurement (issue 15) and every CUTLASS config on the shapes that
// stress it: E = 1 and E = 64 experts with empty and one-row experts, host and device sizes, each config forced and
// the tuner's pick, forward / dgrad / wgrad (and the wgrad accumulating into fp32 main grads) against float64. The
// tuner: its first call of a shape class times only the candidates this build has for the dtype (the loop only with
// host sizes), caches the winner per class (other sizes of the same class reuse it, another class is tuned apart),
// never times inside a graph capture or under GemmTuningPause (the heuristic serves, untuned), accumulates exactly once
// while it times, and whatever wins the results are right and bitwise repeatable. On a GPU that is not an sm_90, or a
// build without CUTLASS, the cases skip with the reason.

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/kernels/gemm_tuning.h>
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
using kernels::GroupedGemmImpl;
using kernels::GroupedGemmTile;

constexpr std::int64_t kIn = 128;
constexpr std::int64_t kOut = 192;

/// 64 experts of uneven load: empty ones (every 7th), one-row ones, the rest 2..52 rows, not multiples of 8.
std::vector<std::int64_t> Sizes64(int salt = 0) {
    std::vector<std::int64_t> s;
    for (int e = 0; e < 64; ++e) {
        const int r = (e + salt) % 64;
        s.push_back(r % 7 == 0 ? 0 : (r % 11 == 1 ? 1 : 2 + (r * 29) % 51));
    }
    return s;
}
const std::vector<std::int64_t> kSizes1 = {257};

/// One problem: operands, sizes on the host or the device, the float64 reference.
struct Problem {
    std::vector<std::int64_t> host_sizes;
    Tensor sizes, x, w, dy;
    Refs ref;
    std::int64_t experts = 0, rows = 0;
    DType dtype = DType::kBFloat16;

    Problem(std::vector<std::int64_t> sizes_, bool device_sizes, DType dtype_, std::uint64_t seed)
        : host_sizes(std::move(sizes_)), dtype(dtype_) {
        experts = static_cast<std::int64_t>(host_sizes.size());
        rows = Total(host_sizes);
        const Tensor host = HostSizes(host_sizes);
        sizes = device_sizes ? host.To(Gpu()) : host;
        x = RandomGpu({rows, kIn}, dtype, seed, "x");
        w = RandomGpu({experts, kOut, kIn}, dtype, seed, "w", 1.0 / std::sqrt(static_cast<double>(kIn)));
        dy = RandomGpu({rows, kOut}, dtype, seed, "dy");
        ref = grouped::Reference(x.ToDoubleVector(), w.ToDoubleVector(), dy.ToDoubleVector(), host_sizes, kOut, kIn);
    }
    std::string Path() const {
        const Tensor probe = Tensor::Empty({rows, kOut}, dtype, Gpu());
        return kernels::GroupedGemmPath(ForwardProblem(x, w, probe, sizes));
    }
    Tensor Forward() const { return kernels::GroupedLinearForward(x, w, nullptr, sizes); }
};

/// Skips (or fails, where CUTLASS must run) unless the CUTLASS path serves `p`.
#define SKIP_UNLESS_CUTLASS(p)                                                                                         \
    do {                                                                                                               \
        const std::string path_ = (p).Path();                                                                          \
        if (path_.rfind("cutlass", 0) != 0) {                                                                          \
            ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path_; \
            GTEST_SKIP() << "the CUTLASS grouped GEMM does not run here: " << path_;                                   \
        }                                                                                                              \
    } while (0)

// ---- every config (forced) and the tuner's pick on E = 1 and E = 64 -------------------------------------------------

using ShapeParam = std::tuple<GroupedGemmTile /*kAuto: tuned*/, int /*experts*/, bool /*device sizes*/>;

class GroupedConfigShapeTest : public CudaParamTest<ShapeParam> {
protected:
    void SetUp() override {
        CudaParamTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        kernels::ClearGroupedGemmTuning();
        const GroupedGemmTile tile = std::get<0>(GetParam());
        choice_.emplace(tile == GroupedGemmTile::kAuto
                            ? kernels::GroupedGemmChoice{}
                            : kernels::GroupedGemmChoice{.impl = GroupedGemmImpl::kCutlass, .tile = tile});
        p_.emplace(std::get<1>(GetParam()) == 1 ? kSizes1 : Sizes64(), std::get<2>(GetParam()), DType::kBFloat16, 61);
    }
    void TearDown() override {
        kernels::ClearGroupedGemmTuning();
        CudaParamTest::TearDown();
    }
    std::optional<ScopedChoice> choice_;
    std::optional<Problem> p_;
};

TEST_P(GroupedConfigShapeTest, ForwardDgradWgradAndAccumulationMatchFloat64) {
    const Problem &p = *p_;
    const GroupedGemmTile tile = std::get<0>(GetParam());
    if (tile != GroupedGemmTile::kAuto) {
        SKIP_UNLESS_CUTLASS(p);
    }
    const DType dt = p.dtype;
    Tensor y = RandomGpu({p.rows, kOut}, dt, 9, "poison", 100.0);
    kernels::GroupedLinearForward({.x = p.x, .weight = p.w, .group_sizes = p.sizes, .y = y});
    if (tile != GroupedGemmTile::kAuto) {
        EXPECT_EQ(kernels::LastGroupedGemmPath(), "cutlass " + grouped::ConfigName(tile) + " (forced)");
    }
    EXPECT_TRUE(ValuesMatch(y, p.ref.y, dt)) << "forward, " << kernels::LastGroupedGemmPath();
    Tensor dx = RandomGpu({p.rows, kIn}, dt, 9, "poison", 100.0);
    kernels::GroupedLinearBackwardInput({.dy = p.dy, .weight = p.w, .group_sizes = p.sizes, .dx = dx});
    EXPECT_TRUE(ValuesMatch(dx, p.ref.dx, dt)) << "dgrad, " << kernels::LastGroupedGemmPath();
    Tensor dw = RandomGpu({p.experts, kOut, kIn}, dt, 9, "poison", 100.0);
    kernels::GroupedLinearBackwardWeight({.dy = p.dy, .x = p.x, .group_sizes = p.sizes, .dweight = dw});
    EXPECT_TRUE(ValuesMatch(dw, p.ref.dw, dt)) << "wgrad (empty experts 0), " << kernels::LastGroupedGemmPath();
    // Into fp32 main grads, accumulating: old + dW exactly once (the tuner times on a scratch copy).
    Tensor main = RandomGpu({p.experts, kOut, kIn}, DType::kFloat32, 5, "main", 4.0);
    const Values want = AddScaled(main.ToDoubleVector(), p.ref.dw);
    kernels::GroupedLinearBackwardWeight(
        {.dy = p.dy, .x = p.x, .group_sizes = p.sizes, .dweight = main, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(main, want, DType::kFloat32, 2)) << "accumulate, " << kernels::LastGroupedGemmPath();
}

std::string ShapeName(const ::testing::TestParamInfo<ShapeParam> &info) {
    const GroupedGemmTile tile = std::get<0>(info.param);
    return fmt::format("{}_E{}_{}", tile == GroupedGemmTile::kAuto ? "tuned" : grouped::ConfigName(tile),
                       std::get<1>(info.param), std::get<2>(info.param) ? "device_sizes" : "host_sizes");
}

INSTANTIATE_TEST_SUITE_P(
    Bf16, GroupedConfigShapeTest,
    ::testing::Combine(::testing::Values(GroupedGemmTile::kAuto, GroupedGemmTile::k256x128, GroupedGemmTile::k128x128,
                                         GroupedGemmTile::kPingpong128x128, GroupedGemmTile::kPingpong128x64,
                                         GroupedGemmTile::k128x256),
                       ::testing::Values(1, 64), ::testing::Bool()),
    ShapeName);

// ---- the tuner ------------------------------------------------------------------------------------------------------

class GroupedTuningTest : public CudaTest {
protected:
    void SetUp() override {
        CudaTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        kernels::ClearGroupedGemmTuning();
        choice_.emplace(kernels::GroupedGemmChoice{});
    }
    void TearDown() override {
        kernels::ClearGroupedGemmTuning();
        CudaTest::TearDown();
    }
    std::optional<ScopedChoice> choice_;
};

std::set<std::string> CandidateNames(const kernels::GroupedGemmTuningInfo &info) {
    std::set<std::string> names;
    for (const auto &[name, us] : info.candidates_us) {
        names.insert(name);
    }
    return names;
}

// The candidates are exactly the configs built for the dtype, each along m and along n, plus the loop with host sizes;
// each ran (µs > 0) and the winner is one of them.
TEST_F(GroupedTuningTest, TimesOnlyTheValidCandidates) {
    auto both_rasters = [](std::initializer_list<const char *> configs) {
        std::set<std::string> names;
        for (const char *c : configs) {
            names.insert(c);
            names.insert(std::string(c) + " along-n");
        }
        return names;
    };
    const std::set<std::string> bf16 = both_rasters(
        {"cooperative256x128", "cooperative128x128", "pingpong128x128", "pingpong128x64", "cooperative128x256"});
    const std::set<std::string> fp16 = both_rasters({"cooperative256x128", "cooperative128x128"});
    for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        for (const bool device_sizes : {true, false}) {
            kernels::ClearGroupedGemmTuning();
            const Problem p(Sizes64(), device_sizes, dtype, 62);
            SKIP_UNLESS_CUTLASS(p);
            const Tensor y = p.Forward();
            EXPECT_TRUE(ValuesMatch(y, p.ref.y, dtype));
            const auto infos = kernels::GroupedGemmTuningInfos();
            ASSERT_EQ(infos.size(), 1u);
            std::set<std::string> want = dtype == DType::kBFloat16 ? bf16 : fp16;
            if (!device_sizes) {
                want.insert("loop");
            }
            const std::string what = fmt::format("{} {}", DTypeName(dtype), infos[0].key);
            EXPECT_EQ(CandidateNames(infos[0]), want) << what;
            EXPECT_EQ(want.count(infos[0].winner), 1u) << what << ": " << infos[0].winner;
            for (const auto &[name, us] : infos[0].candidates_us) {
                EXPECT_GT(us, 0.0) << what << ": " << name << " did not run";
            }
            EXPECT_NE(kernels::LastGroupedGemmPath().find("(tuned)"), std::string::npos)
                << kernels::LastGroupedGemmPath();
            EXPECT_NE(kernels::LastGroupedGemmPath().find(infos[0].winner), std::string::npos)
                << kernels::LastGroupedGemmPath() << " vs the winner " << infos[0].winner;
        }
    }
}

// Other sizes of the same class (same experts, dims, mean rows per group within a power of two) reuse the winner;
// a class with 4× the rows per group, and the dgrad and wgrad, are tuned apart.
TEST_F(GroupedTuningTest, CachesTheWinnerPerShapeClass) {
    const Problem a(Sizes64(), true, DType::kBFloat16, 63);
    SKIP_UNLESS_CUTLASS(a);
    EXPECT_TRUE(ValuesMatch(a.Forward(), a.ref.y, a.dtype));
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 1u);
    const Problem b(Sizes64(5), true, DType::kBFloat16, 64); // a rotation: other per-group sizes, the same total
    ASSERT_EQ(b.rows, a.rows);
    EXPECT_TRUE(ValuesMatch(b.Forward(), b.ref.y, b.dtype));
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 1u) << "the same class was timed again";
    EXPECT_GE(kernels::GetGroupedGemmTuningStats().hits, 1u);
    std::vector<std::int64_t> larger = Sizes64();
    for (std::int64_t &s : larger) {
        s *= 4;
    }
    const Problem c(larger, true, DType::kBFloat16, 65);
    EXPECT_TRUE(ValuesMatch(c.Forward(), c.ref.y, c.dtype));
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 2u) << "4x the rows per group is another class";
    Tensor dx = Tensor::Empty({a.rows, kIn}, a.dtype, Gpu());
    kernels::GroupedLinearBackwardInput({.dy = a.dy, .weight = a.w, .group_sizes = a.sizes, .dx = dx});
    Tensor dw = Tensor::Empty({a.experts, kOut, kIn}, a.dtype, Gpu());
    kernels::GroupedLinearBackwardWeight({.dy = a.dy, .x = a.x, .group_sizes = a.sizes, .dweight = dw});
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 4u) << "dgrad and wgrad are classes of their own";
    EXPECT_TRUE(ValuesMatch(dx, a.ref.dx, a.dtype));
    EXPECT_TRUE(ValuesMatch(dw, a.ref.dw, a.dtype));
    EXPECT_EQ(kernels::GroupedGemmTuningInfos().size(), 4u);
}

// Whatever wins, the results repeat bitwise: the first call (which times the candidates, then runs the winner) and the
// later ones (the cached winner).
TEST_F(GroupedTuningTest, ResultsAreBitwiseRepeatableWhateverWins) {
    for (const bool device_sizes : {true, false}) {
        kernels::ClearGroupedGemmTuning();
        const Problem p(Sizes64(), device_sizes, DType::kBFloat16, 66);
        SKIP_UNLESS_CUTLASS(p);
        const std::vector<unsigned char> first = HostBytes(p.Forward());
        Tensor dw1 = Tensor::Empty({p.experts, kOut, kIn}, p.dtype, Gpu());
        kernels::GroupedLinearBackwardWeight({.dy = p.dy, .x = p.x, .group_sizes = p.sizes, .dweight = dw1});
        for (int run = 0; run < 2; ++run) {
            EXPECT_EQ(HostBytes(p.Forward()), first);
            Tensor dw = Tensor::Empty({p.experts, kOut, kIn}, p.dtype, Gpu());
            kernels::GroupedLinearBackwardWeight({.dy = p.dy, .x = p.x, .group_sizes = p.sizes, .dweight = dw});
            EXPECT_EQ(HostBytes(dw), HostBytes(dw1));
        }
    }
}

// Under GemmTuningPause an untuned class runs the heuristic's pick without timing, and stays untuned.
TEST_F(GroupedTuningTest, PauseServesTheHeuristicWithoutTiming) {
    const Problem p(Sizes64(), true, DType::kBFloat16, 67);
    SKIP_UNLESS_CUTLASS(p);
    {
        const kernels::GemmTuningPause pause;
        EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype));
        EXPECT_NE(kernels::LastGroupedGemmPath().find("(heuristic)"), std::string::npos)
            << kernels::LastGroupedGemmPath();
    }
    kernels::GroupedGemmTuningStats stats = kernels::GetGroupedGemmTuningStats();
    EXPECT_EQ(stats.tuned, 0u);
    EXPECT_EQ(stats.untuned, 1u);
    EXPECT_TRUE(kernels::GroupedGemmTuningInfos().empty());
    // Unpaused, the class is tuned at its next call.
    EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype));
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 1u);
}

// Inside a graph capture an untuned class runs the heuristic's pick (no timing: the capture would record it); the
// replay is right, and an eager call afterwards tunes the class.
TEST_F(GroupedTuningTest, CaptureServesTheHeuristicWithoutTiming) {
    const Problem p(Sizes64(), true, DType::kBFloat16, 68);
    SKIP_UNLESS_CUTLASS(p);
    Tensor y = Tensor::Empty({p.rows, kOut}, p.dtype, Gpu());
    y.Fill(0.0);
    Synchronize(Gpu());
    CapturedGraph graph(CudaContext::Get(0).stream(), [&] {
        kernels::GroupedLinearForward({.x = p.x, .weight = p.w, .group_sizes = p.sizes, .y = y});
    });
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 0u);
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().untuned, 1u);
    graph.Replay();
    Synchronize(Gpu());
    EXPECT_TRUE(ValuesMatch(y, p.ref.y, p.dtype)) << "the replay";
    EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype)) << "eager";
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 1u);
}

// A forced config is not tuned, and GroupedGemmPath says what runs.
TEST_F(GroupedTuningTest, ForcedConfigsAreNotTuned) {
    const Problem p(Sizes64(), false, DType::kBFloat16, 69);
    SKIP_UNLESS_CUTLASS(p);
    EXPECT_NE(p.Path().find("(heuristic)"), std::string::npos) << p.Path();
    {
        ScopedChoice forced({.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::kPingpong128x64});
        EXPECT_EQ(p.Path(), "cutlass pingpong128x64 (forced)");
        EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype));
    }
    {
        ScopedChoice loop({.impl = GroupedGemmImpl::kLoop});
        EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype));
        EXPECT_EQ(kernels::LastGroupedGemmPath(), "loop (forced)");
    }
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 0u);
    EXPECT_TRUE(ValuesMatch(p.Forward(), p.ref.y, p.dtype));
    EXPECT_EQ(kernels::GetGroupedGemmTuningStats().tuned, 1u);
    EXPECT_NE(p.Path().find("(tuned)"), std::string::npos) << p.Path();
}

} // namespace
} // namespace shardline::testing
