// The host side of the grouped GEMM's per-shape tuning (src/kernels/grouped_tuning.h): shape classes (what is and is
// not part of a key), the choice among timed candidates (the fastest that ran; the heuristic's pick within 1 %; none
// cached when none ran), the cache of winners per class and its counters, and when timing is allowed (not under
// GemmTuningPause, not inside a capture, not with tuning off). No GPU: the timings are given; tests/cuda times the
// real kernels.

#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/gemm_tuning.h>
#include <shardline/kernels/grouped_gemm.h>

#include "kernels/grouped_tuning.h"

namespace shardline::kernels {
namespace {

using detail::GroupedTuningKey;
using detail::kLoopCandidate;
using detail::MakeGroupedTuningKey;

constexpr int kCoop256 = static_cast<int>(GroupedGemmTile::k256x128);
constexpr int kCoop128 = static_cast<int>(GroupedGemmTile::k128x128);
constexpr int kPing128 = static_cast<int>(GroupedGemmTile::kPingpong128x128);
constexpr int kPing64 = static_cast<int>(GroupedGemmTile::kPingpong128x64);

/// A forward of `groups` experts (out = m, in = k) over `total` grouped rows, sizes on the device.
GroupedGemmParams Forward(std::int64_t groups, std::int64_t total, std::int64_t m = 1408, std::int64_t k = 2048) {
    GroupedGemmParams p;
    p.trans_a = true;
    p.grouped_dim = GroupedDim::kN;
    p.m = m;
    p.k = k;
    p.n = 12345; // ignored with kN
    p.group_count = groups;
    p.total = total;
    p.sizes_device = Device::CUDA(0);
    p.a_type = p.b_type = p.c_type = DType::kBFloat16;
    p.device = Device::CUDA(0);
    return p;
}

class GroupedTuningHostTest : public ::testing::Test {
protected:
    void SetUp() override { ClearGroupedGemmTuning(); }
    void TearDown() override { ClearGroupedGemmTuning(); }
};

TEST_F(GroupedTuningHostTest, ShapeClassesBucketTheMeanRowsPerGroup) {
    // 64 experts, 49152 rows (768 per group) and 40000 rows (625): the same class (512–1023 rows per group).
    EXPECT_EQ(MakeGroupedTuningKey(Forward(64, 49152)), MakeGroupedTuningKey(Forward(64, 40000)));
    // 1024 rows per group is the next class, 511 the previous one.
    EXPECT_NE(MakeGroupedTuningKey(Forward(64, 64 * 1024)), MakeGroupedTuningKey(Forward(64, 64 * 1023)));
    EXPECT_NE(MakeGroupedTuningKey(Forward(64, 64 * 511)), MakeGroupedTuningKey(Forward(64, 64 * 512)));
    EXPECT_EQ(MakeGroupedTuningKey(Forward(64, 0)).mean_rows_class, 0);
    EXPECT_EQ(MakeGroupedTuningKey(Forward(64, 64)).mean_rows_class, 1);
    EXPECT_EQ(MakeGroupedTuningKey(Forward(64, 64 * 768)).mean_rows_class, 10);
    // Not part of the class: the per-group sizes and pointers, beta, the ignored dim.
    GroupedGemmParams p = Forward(64, 49152);
    const std::vector<std::int64_t> sizes(64, 768);
    p.sizes = sizes.data();
    p.beta = 1.0;
    p.n = 7;
    EXPECT_EQ(MakeGroupedTuningKey(p), MakeGroupedTuningKey(Forward(64, 49152)));
}

TEST_F(GroupedTuningHostTest, ShapeClassesSeparateWhatTheKernelsDependOn) {
    const GroupedTuningKey base = MakeGroupedTuningKey(Forward(64, 49152));
    std::vector<GroupedGemmParams> others;
    others.push_back(Forward(128, 49152 * 2));        // experts
    others.push_back(Forward(64, 49152, 1024));       // m
    others.push_back(Forward(64, 49152, 1408, 4096)); // k
    GroupedGemmParams host = Forward(64, 49152);
    host.sizes_device = Device::CPU();
    others.push_back(host);
    GroupedGemmParams fp16 = Forward(64, 49152);
    fp16.a_type = fp16.b_type = fp16.c_type = DType::kFloat16;
    others.push_back(fp16);
    GroupedGemmParams dgrad = Forward(64, 49152);
    dgrad.trans_a = false;
    others.push_back(dgrad);
    GroupedGemmParams wgrad = Forward(64, 49152);
    wgrad.trans_a = false;
    wgrad.trans_b = true;
    wgrad.grouped_dim = GroupedDim::kK;
    wgrad.n = 1408;
    others.push_back(wgrad);
    GroupedGemmParams wgrad_fp32 = wgrad;
    wgrad_fp32.c_type = DType::kFloat32;
    others.push_back(wgrad_fp32);
    GroupedGemmParams bias = Forward(64, 49152);
    bias.epilogue = GemmEpilogue::kBias;
    others.push_back(bias);
    GroupedGemmParams device1 = Forward(64, 49152);
    device1.device = Device::CUDA(1);
    others.push_back(device1);
    std::set<std::string> texts = {detail::GroupedTuningKeyString(base)};
    for (const GroupedGemmParams &o : others) {
        const GroupedTuningKey key = MakeGroupedTuningKey(o);
        EXPECT_NE(key, base) << detail::GroupedTuningKeyString(key);
        EXPECT_TRUE(texts.insert(detail::GroupedTuningKeyString(key)).second)
            << "two keys, one text: " << detail::GroupedTuningKeyString(key);
    }
    // With kK the grouped dim is k: n is part of the class, k is not.
    GroupedGemmParams wgrad_k = wgrad;
    wgrad_k.k = 99;
    EXPECT_EQ(MakeGroupedTuningKey(wgrad_k), MakeGroupedTuningKey(wgrad));
    EXPECT_EQ(detail::GroupedTuningKeyString(base),
              "tn grouped=n groups=64 m=1408 k=2048 rows~512-1023 bfloat16->bfloat16 device-sizes cuda:0");
}

TEST_F(GroupedTuningHostTest, KeepsTheFastestCandidateThatRan) {
    const GroupedTuningKey key = MakeGroupedTuningKey(Forward(64, 49152));
    const std::map<int, double> us = {{kCoop256, 500.0}, {kCoop128, 480.0}, {kPing128, -1.0}, {kPing64, 430.0}};
    std::map<int, int> calls;
    const auto winner = detail::TuneGroupedGemm(key, {kCoop256, kCoop128, kPing128, kPing64}, kCoop128, [&](int c) {
        ++calls[c];
        return us.at(c);
    });
    ASSERT_TRUE(winner.has_value());
    EXPECT_EQ(*winner, kPing64);
    // Two passes; a refused candidate is not asked again.
    EXPECT_EQ(calls[kCoop256], 2);
    EXPECT_EQ(calls[kPing64], 2);
    EXPECT_EQ(calls[kPing128], 1);
    EXPECT_EQ(detail::FindGroupedWinner(key), kPing64);
    const auto infos = GroupedGemmTuningInfos();
    ASSERT_EQ(infos.size(), 1u);
    EXPECT_EQ(infos[0].winner, "pingpong128x64");
    ASSERT_EQ(infos[0].candidates_us.size(), 4u);
    EXPECT_EQ(infos[0].candidates_us[2].first, "pingpong128x128");
    EXPECT_LT(infos[0].candidates_us[2].second, 0.0);
    EXPECT_DOUBLE_EQ(infos[0].candidates_us[3].second, 430.0);
}

TEST_F(GroupedTuningHostTest, TakesEachCandidatesBetterPass) {
    const GroupedTuningKey key = MakeGroupedTuningKey(Forward(8, 16384, 14336, 4096));
    // The loop stalls on its first pass only; the config is steady.
    std::map<int, int> calls;
    const auto winner = detail::TuneGroupedGemm(key, {kCoop256, kLoopCandidate}, kCoop256, [&](int c) {
        const int n = ++calls[c];
        return c == kLoopCandidate ? (n == 1 ? 900.0 : 400.0) : 450.0;
    });
    EXPECT_EQ(winner, kLoopCandidate);
    EXPECT_EQ(GroupedGemmTuningInfos().at(0).winner, "loop");
}

TEST_F(GroupedTuningHostTest, KeepsTheHeuristicsPickWithinOnePercent) {
    const GroupedTuningKey key = MakeGroupedTuningKey(Forward(64, 49152));
    const std::map<int, double> close = {{kCoop256, 100.0}, {kCoop128, 100.5}};
    EXPECT_EQ(detail::TuneGroupedGemm(key, {kCoop256, kCoop128}, kCoop128, [&](int c) { return close.at(c); }),
              kCoop128);
    const std::map<int, double> far = {{kCoop256, 100.0}, {kCoop128, 102.0}};
    EXPECT_EQ(detail::TuneGroupedGemm(key, {kCoop256, kCoop128}, kCoop128, [&](int c) { return far.at(c); }), kCoop256);
    EXPECT_EQ(detail::FindGroupedWinner(key), kCoop256) << "a key timed again is replaced";
    EXPECT_EQ(GetGroupedGemmTuningStats().tuned, 2u);
}

TEST_F(GroupedTuningHostTest, CachesNothingWhenNoCandidateRan) {
    const GroupedTuningKey key = MakeGroupedTuningKey(Forward(64, 49152));
    EXPECT_FALSE(detail::TuneGroupedGemm(key, {kCoop256, kCoop128}, kCoop256, [](int) { return -1.0; }).has_value());
    EXPECT_FALSE(detail::FindGroupedWinner(key).has_value());
    EXPECT_EQ(GetGroupedGemmTuningStats().tuned, 0u);
    EXPECT_TRUE(GroupedGemmTuningInfos().empty());
}

TEST_F(GroupedTuningHostTest, CachesPerClassAndCounts) {
    const GroupedTuningKey a = MakeGroupedTuningKey(Forward(64, 49152));
    const GroupedTuningKey b = MakeGroupedTuningKey(Forward(128, 65536, 768));
    EXPECT_FALSE(detail::FindGroupedWinner(a).has_value());
    EXPECT_EQ(detail::TuneGroupedGemm(a, {kCoop256}, kCoop256, [](int) { return 1.0; }), kCoop256);
    EXPECT_FALSE(detail::FindGroupedWinner(b).has_value()) << "another class";
    EXPECT_EQ(
        detail::TuneGroupedGemm(b, {kCoop128, kPing128}, kCoop128, [](int c) { return c == kPing128 ? 1.0 : 2.0; }),
        kPing128);
    EXPECT_EQ(detail::FindGroupedWinner(a), kCoop256);
    EXPECT_EQ(detail::FindGroupedWinner(b), kPing128);
    EXPECT_EQ(detail::FindGroupedWinner(b, /*count_hit=*/false), kPing128);
    detail::CountGroupedUntuned();
    const GroupedGemmTuningStats stats = GetGroupedGemmTuningStats();
    EXPECT_EQ(stats.tuned, 2u);
    EXPECT_EQ(stats.hits, 2u);
    EXPECT_EQ(stats.untuned, 1u);
    EXPECT_EQ(GroupedGemmTuningInfos().size(), 2u);
    ClearGroupedGemmTuning();
    EXPECT_FALSE(detail::FindGroupedWinner(a).has_value());
    EXPECT_EQ(GetGroupedGemmTuningStats().tuned, 0u);
    EXPECT_EQ(GetGroupedGemmTuningStats().hits, 0u);
}

TEST_F(GroupedTuningHostTest, TimingIsAllowedOutsidePausesCapturesAndWithTuningOn) {
    const GemmTuningOptions saved = CurrentGemmTuningOptions();
    ASSERT_TRUE(saved.enabled) << "the tests run with SHARDLINE_GEMM_TUNING unset";
    EXPECT_TRUE(detail::GroupedTuningAllowed(/*capturing=*/false));
    EXPECT_FALSE(detail::GroupedTuningAllowed(/*capturing=*/true));
    {
        const GemmTuningPause pause;
        EXPECT_FALSE(detail::GroupedTuningAllowed(false));
        {
            const GemmTuningPause nested;
            EXPECT_FALSE(detail::GroupedTuningAllowed(false));
        }
        EXPECT_FALSE(detail::GroupedTuningAllowed(false));
    }
    EXPECT_TRUE(detail::GroupedTuningAllowed(false));
    GemmTuningOptions off = saved;
    off.enabled = false;
    SetGemmTuningOptions(off);
    EXPECT_FALSE(detail::GroupedTuningAllowed(false));
    SetGemmTuningOptions(saved);
    EXPECT_TRUE(detail::GroupedTuningAllowed(false));
}

TEST_F(GroupedTuningHostTest, CandidateNames) {
    EXPECT_EQ(detail::GroupedCandidateName(kLoopCandidate), "loop");
    EXPECT_EQ(detail::GroupedCandidateName(kCoop256), "cooperative256x128");
    EXPECT_EQ(detail::GroupedCandidateName(kCoop128), "cooperative128x128");
    EXPECT_EQ(detail::GroupedCandidateName(kPing128), "pingpong128x128");
    EXPECT_EQ(detail::GroupedCandidateName(kPing64), "pingpong128x64");
    EXPECT_EQ(detail::GroupedCandidateName(static_cast<int>(GroupedGemmTile::k128x256)), "cooperative128x256");
    EXPECT_EQ(detail::GroupedCandidateName(kCoop256 + detail::kRasterAlongN), "cooperative256x128 along-n");
    EXPECT_EQ(detail::GroupedCandidateName(kPing64 + detail::kRasterAlongN), "pingpong128x64 along-n");
    EXPECT_EQ(detail::CandidateTile(kCoop128 + detail::kRasterAlongN), GroupedGemmTile::k128x128);
    EXPECT_TRUE(detail::CandidateAlongN(kCoop128 + detail::kRasterAlongN));
    EXPECT_FALSE(detail::CandidateAlongN(kCoop128));
    EXPECT_LT(static_cast<int>(GroupedGemmTile::k128x256) + detail::kRasterAlongN, detail::kCandidateSlots);
}

TEST_F(GroupedTuningHostTest, ChoiceKeepsTileAndRaster) {
    const GroupedGemmChoice saved = GetGroupedGemmChoice();
    SetGroupedGemmChoice(
        {.impl = GroupedGemmImpl::kCutlass, .tile = GroupedGemmTile::k128x256, .raster = GroupedGemmRaster::kAlongN});
    const GroupedGemmChoice got = GetGroupedGemmChoice();
    EXPECT_EQ(got.impl, GroupedGemmImpl::kCutlass);
    EXPECT_EQ(got.tile, GroupedGemmTile::k128x256);
    EXPECT_EQ(got.raster, GroupedGemmRaster::kAlongN);
    SetGroupedGemmChoice(saved);
    EXPECT_EQ(GetGroupedGemmChoice().raster, saved.raster);
}

} // namespace
} // namespace shardline::kernels
