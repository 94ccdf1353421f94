// The CUDA grouped backward's schedule and per-call work (issue 15): GroupedLinearBackward with its wgrad and bias grad
// on the side stream beside the dgrad is bitwise the serial backward (integer-valued operands, so every path is also
// exact against float64); empty experts get dW = db = 0 with beta = 0 (the setup kernel zeroes them, no separate
// launch) and keep their grads when accumulating; more than 256 experts (several rounds of the setup kernel's scan);
// the CUTLASS kernel's cached Params give the bits a freshly initialised call gives, for new sizes too; and a captured
// concurrent backward with device sizes replays with new sizes equal to eager. The CUTLASS cases skip with the reason
// where the CUTLASS path does not run (no sm_90, a build without it), and fail if it should.

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/random.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>

#include "captured_graph.h"
#include "grouped_gemm_helpers.h"
#include "helpers.h"
#include "kernels/cuda/cutlass/grouped_cutlass.h"

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

constexpr std::int64_t kIn = 256;
constexpr std::int64_t kOut = 384;
// Empty experts first, last, and side by side; one single-row expert.
const std::vector<std::int64_t> kSizes = {0, 97, 0, 0, 1, 300, 64, 211, 16, 335, 0};
const std::vector<std::int64_t> kOtherSizes = {512, 0, 3, 0, 0, 128, 77, 300, 4, 0, 0}; // the same total (1024)

/// Integer values in [-2, 2]: every product and fp32 partial sum is an exact integer, so the kernels agree bitwise
/// whatever their order, and with the float64 reference up to the output dtype's rounding.
Tensor IntegersGpu(const Shape &shape, DType dtype, std::uint64_t seed, std::string_view name) {
    return RandomTensor(shape, dtype, Gpu(), seed, name, RandomDistribution::kInteger, -2, 2);
}

/// SetGroupedConcurrentBackward for one scope.
class ScopedConcurrent {
public:
    explicit ScopedConcurrent(bool on) : saved_(kernels::GetGroupedConcurrentBackward()) {
        kernels::SetGroupedConcurrentBackward(on);
    }
    ~ScopedConcurrent() { kernels::SetGroupedConcurrentBackward(saved_); }
    ScopedConcurrent(const ScopedConcurrent &) = delete;
    ScopedConcurrent &operator=(const ScopedConcurrent &) = delete;

private:
    bool saved_;
};

struct Grads {
    Tensor dx, dw, db;
};

using BackwardParam = std::tuple<bool /*device sizes*/, bool /*accumulate into fp32 main grads*/>;

class GroupedBackwardTest : public CudaParamTest<BackwardParam> {
protected:
    void SetUp() override {
        CudaParamTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        device_sizes_ = std::get<0>(GetParam());
        accumulate_ = std::get<1>(GetParam());
        experts_ = static_cast<std::int64_t>(kSizes.size());
        rows_ = Total(kSizes);
        sizes_ = device_sizes_ ? HostSizes(kSizes).To(Gpu()) : HostSizes(kSizes);
        x_ = IntegersGpu({rows_, kIn}, kDType, 61, "x");
        w_ = IntegersGpu({experts_, kOut, kIn}, kDType, 61, "w");
        dy_ = IntegersGpu({rows_, kOut}, kDType, 61, "dy");
        const Tensor probe = Tensor::Empty({rows_, kOut}, kDType, Gpu());
        std::string path;
        {
            ScopedChoice cutlass({.impl = GroupedGemmImpl::kCutlass}); // whether it can run, whatever auto picks
            path = kernels::GroupedGemmPath(ForwardProblem(x_, w_, probe, sizes_));
        }
        if (path.rfind("cutlass", 0) != 0) {
            ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
            GTEST_SKIP() << "the CUTLASS grouped GEMM does not run here: " << path;
        }
        // The old main grads of an accumulating backward: integers too, so old + new is exact in fp32.
        old_dw_ = IntegersGpu({experts_, kOut, kIn}, GradDType(), 62, "old_dw");
        old_db_ = IntegersGpu({experts_, kOut}, GradDType(), 62, "old_db");
    }
    DType GradDType() const { return accumulate_ ? DType::kFloat32 : kDType; }

    /// One GroupedLinearBackward for dx, dW and db, into fresh tensors (poisoned, or the old main grads).
    Grads Backward(const Tensor &sizes) {
        Grads g;
        g.dx = RandomGpu({rows_, kIn}, kDType, 9, "poison", 100.0);
        if (accumulate_) {
            g.dw = old_dw_.Clone();
            g.db = old_db_.Clone();
        } else {
            g.dw = RandomGpu({experts_, kOut, kIn}, kDType, 9, "poison", 100.0);
            g.db = RandomGpu({experts_, kOut}, kDType, 9, "poison", 100.0);
        }
        kernels::GroupedLinearBackward({.dy = dy_,
                                        .x = &x_,
                                        .weight = &w_,
                                        .group_sizes = sizes,
                                        .dx = &g.dx,
                                        .dweight = &g.dw,
                                        .dbias = &g.db,
                                        .accumulate = accumulate_});
        return g;
    }

    void ExpectMatchesReference(const Grads &g, const std::vector<std::int64_t> &sizes, const std::string &what) {
        const Refs ref =
            grouped::Reference(x_.ToDoubleVector(), w_.ToDoubleVector(), dy_.ToDoubleVector(), sizes, kOut, kIn);
        Values want_dw = ref.dw;
        Values want_db = ref.db;
        if (accumulate_) {
            want_dw = AddScaled(old_dw_.ToDoubleVector(), ref.dw);
            want_db = AddScaled(old_db_.ToDoubleVector(), ref.db);
        }
        EXPECT_TRUE(ValuesMatch(g.dx, ref.dx, kDType)) << what << ": dx";
        EXPECT_TRUE(ValuesMatch(g.dw, want_dw, GradDType())) << what << ": dW";
        EXPECT_TRUE(ValuesMatch(g.db, want_db, GradDType())) << what << ": db";
        // Empty experts exactly: zero with beta = 0 (poisoned before), their old grads bitwise when accumulating.
        const Values dw = g.dw.ToDoubleVector();
        const Values db = g.db.ToDoubleVector();
        const Values old_dw = old_dw_.ToDoubleVector();
        const Values old_db = old_db_.ToDoubleVector();
        for (std::size_t e = 0; e < sizes.size(); ++e) {
            if (sizes[e] != 0) {
                continue;
            }
            const auto w0 = static_cast<std::size_t>(e) * kOut * kIn;
            for (std::size_t i = w0; i < w0 + kOut * kIn; ++i) {
                ASSERT_EQ(dw[i], accumulate_ ? old_dw[i] : 0.0)
                    << what << ": empty expert " << e << " dW[" << i - w0 << "]";
            }
            const auto b0 = static_cast<std::size_t>(e) * kOut;
            for (std::size_t i = b0; i < b0 + kOut; ++i) {
                ASSERT_EQ(db[i], accumulate_ ? old_db[i] : 0.0) << what << ": empty expert " << e << " db";
            }
        }
    }

    static constexpr DType kDType = DType::kBFloat16;
    bool device_sizes_ = false;
    bool accumulate_ = false;
    std::int64_t experts_ = 0, rows_ = 0;
    Tensor sizes_, x_, w_, dy_, old_dw_, old_db_;
};

void ExpectBitwiseEqual(const Grads &a, const Grads &b, const std::string &what) {
    EXPECT_EQ(HostBytes(a.dx), HostBytes(b.dx)) << what << ": dx";
    EXPECT_EQ(HostBytes(a.dw), HostBytes(b.dw)) << what << ": dW";
    EXPECT_EQ(HostBytes(a.db), HostBytes(b.db)) << what << ": db";
}

TEST_P(GroupedBackwardTest, ConcurrentBackwardIsBitwiseTheSerialOne) {
    ScopedChoice auto_choice({});
    Grads serial;
    {
        ScopedConcurrent off(false);
        serial = Backward(sizes_); // also tunes the dgrad and wgrad shape classes
        ExpectMatchesReference(serial, kSizes, "serial");
    }
    ScopedConcurrent on(true);
    const std::uint64_t before = kernels::GroupedConcurrentBackwardRuns();
    const Grads concurrent = Backward(sizes_);
    const bool ran_concurrently = kernels::GroupedConcurrentBackwardRuns() > before;
    // Host sizes let the tuning choose the cuBLASLt loop for the wgrad, which then runs after the dgrad; device sizes
    // (the CUTLASS path) must run beside it.
    if (device_sizes_) {
        EXPECT_TRUE(ran_concurrently) << "the wgrad did not run on the side stream; wgrad path: "
                                      << kernels::LastGroupedGemmPath();
    }
    ExpectMatchesReference(concurrent, kSizes, ran_concurrently ? "concurrent" : "serial (loop wgrad)");
    ExpectBitwiseEqual(concurrent, serial, "concurrent vs serial");
    // And run to run, for other sizes after these.
    const Tensor other = device_sizes_ ? HostSizes(kOtherSizes).To(Gpu()) : HostSizes(kOtherSizes);
    const Grads first = Backward(other);
    ExpectMatchesReference(first, kOtherSizes, "concurrent, other sizes");
    ExpectBitwiseEqual(Backward(other), first, "concurrent, run to run");
}

TEST_P(GroupedBackwardTest, CachedKernelParamsGiveTheBitsOfAFreshInitialisation) {
    // The CUTLASS path forced (both tiles' kernels), device or host sizes: the first call after ForgetCachedParams
    // builds the Params; the next calls reuse them — also for other sizes in the same device buffer.
    for (const GroupedGemmTile tile : {GroupedGemmTile::k256x128, GroupedGemmTile::k128x128}) {
        ScopedChoice cutlass({.impl = GroupedGemmImpl::kCutlass, .tile = tile});
        ScopedConcurrent on(true);
        const std::string name = grouped::ConfigName(tile);
        kernels::cuda::cutlass_grouped::ForgetCachedParams();
        const Grads fresh = Backward(sizes_);
        ExpectMatchesReference(fresh, kSizes, name + " fresh");
        const std::uint64_t hits = kernels::cuda::cutlass_grouped::GetCachedParamsStats().hits;
        for (int run = 0; run < 3; ++run) {
            ExpectBitwiseEqual(Backward(sizes_), fresh, fmt::format("{} cached, run {}", name, run));
        }
        // Same-sized calls get their scratch back from the stream-ordered pool, so the Params are reused (a miss
        // everywhere would mean the cache never serves, and this test compared fresh with fresh).
        EXPECT_GT(kernels::cuda::cutlass_grouped::GetCachedParamsStats().hits, hits) << name;
        Tensor sizes = device_sizes_ ? HostSizes(kSizes).To(Gpu()) : HostSizes(kSizes);
        Tensor(sizes).CopyFrom(HostSizes(kOtherSizes));
        const Grads other = Backward(sizes);
        ExpectMatchesReference(other, kOtherSizes, name + " cached, other sizes");
        kernels::cuda::cutlass_grouped::ForgetCachedParams();
        ExpectBitwiseEqual(Backward(sizes), other, name + " other sizes, fresh vs cached");
    }
}

std::string BackwardName(const ::testing::TestParamInfo<BackwardParam> &info) {
    return fmt::format("{}_{}", std::get<0>(info.param) ? "device_sizes" : "host_sizes",
                       std::get<1>(info.param) ? "accumulate_fp32" : "overwrite");
}

INSTANTIATE_TEST_SUITE_P(Cuda, GroupedBackwardTest, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         BackwardName);

// ---- many experts: the setup kernel's scan over several rounds of 256 groups
// -----------------------------------------

class GroupedManyExpertsTest : public CudaTest {};

// 300 experts of 0-5 rows (about a third empty): forward, dgrad and wgrad (+ bias grad) against float64, every CUTLASS
// config of bf16, device sizes.
TEST_F(GroupedManyExpertsTest, ThreeHundredExpertsMatchFloat64) {
    constexpr std::int64_t kExperts = 300;
    constexpr std::int64_t kFeatures = 64;
    std::vector<std::int64_t> sizes(kExperts);
    for (std::size_t e = 0; e < sizes.size(); ++e) {
        sizes[e] = static_cast<std::int64_t>((e * 7 + 3) % 6) % 4 == 0 ? 0 : static_cast<std::int64_t>((e * 5) % 6);
    }
    const std::int64_t rows = Total(sizes);
    const Tensor device_sizes = HostSizes(sizes).To(Gpu());
    const DType dtype = DType::kBFloat16;
    const Tensor x = IntegersGpu({rows, kFeatures}, dtype, 63, "x");
    const Tensor w = IntegersGpu({kExperts, kFeatures, kFeatures}, dtype, 63, "w");
    const Tensor dy = IntegersGpu({rows, kFeatures}, dtype, 63, "dy");
    const Refs ref =
        grouped::Reference(x.ToDoubleVector(), w.ToDoubleVector(), dy.ToDoubleVector(), sizes, kFeatures, kFeatures);
    for (const GroupedGemmTile tile :
         {GroupedGemmTile::k256x128, GroupedGemmTile::k128x128, GroupedGemmTile::kPingpong128x128,
          GroupedGemmTile::kPingpong128x64, GroupedGemmTile::k128x256}) {
        ScopedChoice cutlass({.impl = GroupedGemmImpl::kCutlass, .tile = tile});
        const std::string name = grouped::ConfigName(tile);
        Tensor y = RandomGpu({rows, kFeatures}, dtype, 9, "poison", 100.0);
        const std::string path = kernels::GroupedGemmPath(ForwardProblem(x, w, y, device_sizes));
        if (path.rfind("cutlass", 0) != 0) {
            ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
            GTEST_SKIP() << "the CUTLASS grouped GEMM does not run here: " << path;
        }
        kernels::GroupedLinearForward({.x = x, .weight = w, .group_sizes = device_sizes, .y = y});
        EXPECT_TRUE(ValuesMatch(y, ref.y, dtype)) << name << ": forward";
        Tensor dx = RandomGpu({rows, kFeatures}, dtype, 9, "poison", 100.0);
        Tensor dw = RandomGpu({kExperts, kFeatures, kFeatures}, dtype, 9, "poison", 100.0);
        Tensor db = RandomGpu({kExperts, kFeatures}, dtype, 9, "poison", 100.0);
        kernels::GroupedLinearBackward(
            {.dy = dy, .x = &x, .weight = &w, .group_sizes = device_sizes, .dx = &dx, .dweight = &dw, .dbias = &db});
        EXPECT_TRUE(ValuesMatch(dx, ref.dx, dtype)) << name << ": dgrad";
        EXPECT_TRUE(ValuesMatch(dw, ref.dw, dtype)) << name << ": wgrad (empty experts 0)";
        EXPECT_TRUE(ValuesMatch(db, ref.db, dtype)) << name << ": bias grad";
    }
}

// ---- CUDA graphs ----------------------------------------------------------------------------------------------------

class GroupedBackwardGraphTest : public CudaTest {};

// The concurrent backward (dx, dW into an fp32 main grad, db) with device sizes, captured once after an eager warm-up
// (which tunes); the sizes buffer then gets other sizes and each replay equals an eager run with them, bitwise.
TEST_F(GroupedBackwardGraphTest, CapturedConcurrentBackwardReplaysWithNewSizes) {
    const DType dtype = DType::kBFloat16;
    ScopedChoice auto_choice({});
    ScopedConcurrent on(true);
    const std::int64_t experts = static_cast<std::int64_t>(kSizes.size());
    const std::int64_t rows = Total(kSizes);
    const Tensor sizes = HostSizes(kSizes).To(Gpu());
    const Tensor x = IntegersGpu({rows, kIn}, dtype, 64, "x");
    const Tensor w = IntegersGpu({experts, kOut, kIn}, dtype, 64, "w");
    const Tensor dy = IntegersGpu({rows, kOut}, dtype, 64, "dy");
    Tensor probe = Tensor::Empty({rows, kOut}, dtype, Gpu());
    const std::string path = kernels::GroupedGemmPath(ForwardProblem(x, w, probe, sizes));
    if (path.rfind("cutlass", 0) != 0) {
        ASSERT_FALSE(CutlassExpected()) << "this build has the CUTLASS grouped GEMM and an sm_90, but: " << path;
        GTEST_SKIP() << "device sizes without CUTLASS read the sizes on the host: " << path;
    }
    Tensor dx = Tensor::Empty({rows, kIn}, dtype, Gpu());
    Tensor dw = Tensor::Empty({experts, kOut, kIn}, DType::kFloat32, Gpu());
    Tensor db = Tensor::Empty({experts, kOut}, DType::kFloat32, Gpu());
    auto step = [&] {
        dw.Fill(0.0);
        db.Fill(0.0);
        kernels::GroupedLinearBackward({.dy = dy,
                                        .x = &x,
                                        .weight = &w,
                                        .group_sizes = sizes,
                                        .dx = &dx,
                                        .dweight = &dw,
                                        .dbias = &db,
                                        .accumulate = true});
    };
    step(); // tunes (no timing inside a capture)
    Synchronize(Gpu());
    const std::uint64_t before = kernels::GroupedConcurrentBackwardRuns();
    CudaContext &ctx = CudaContext::Get(0);
    CapturedGraph graph(ctx.stream(), step);
    EXPECT_GT(kernels::GroupedConcurrentBackwardRuns(), before) << "the captured backward did not fork the side stream";
    for (const std::vector<std::int64_t> &next : {kOtherSizes, kSizes}) {
        Tensor(sizes).CopyFrom(HostSizes(next));
        graph.Replay();
        const std::vector<unsigned char> dx_graph = HostBytes(dx), dw_graph = HostBytes(dw), db_graph = HostBytes(db);
        step(); // eager, with the same sizes
        Synchronize(Gpu());
        EXPECT_EQ(dx_graph, HostBytes(dx)) << "dx";
        EXPECT_EQ(dw_graph, HostBytes(dw)) << "dw";
        EXPECT_EQ(db_graph, HostBytes(db)) << "db";
        const Refs ref =
            grouped::Reference(x.ToDoubleVector(), w.ToDoubleVector(), dy.ToDoubleVector(), next, kOut, kIn);
        EXPECT_TRUE(ValuesMatch(dx, ref.dx, dtype)) << "dx for the replayed sizes";
        EXPECT_TRUE(ValuesMatch(dw, ref.dw, DType::kFloat32)) << "dw for the replayed sizes";
        EXPECT_TRUE(ValuesMatch(db, ref.db, DType::kFloat32)) << "db for the replayed sizes";
    }
}

} // namespace
} // namespace shardline::testing
