// The CUDA mixture-of-experts kernels' own behaviour at training sizes: the router (softmax and sigmoid, E up to 256,
// every per-lane width, topk up to 8) against the CPU provider on the same fp32 logits — the same experts and counts
// bit for bit, weights, aux and z losses and dlogits within fp32 tolerance; the permutation map (CUB's multi-block
// sort) equal to the CPU's with and without capacity; the gather, combine and weight gradient in bf16/fp16/fp32 at MoE
// widths, vectorised and not, against float64 references, and the gather and combine bit for bit against fp32 host
// references that follow the kernels' order (topk up to 32, rows of fewer vectors than a warp has lanes, partial
// chunks, dropped slots); every kernel bitwise equal run to run; and Router → Permute → Unpermute through
// autograd on the GPU against the same graph on the CPU (values and gradients). The tests/kernels cases cover the
// small and edge routings on both devices.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe.h>
#include <shardline/kernels/moe.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::MoERouterConfig;
using kernels::MoEScoreFunction;

struct RouterRun {
    Tensor weights, indices, counts, aux, z, dlogits;
};

/// Forward and backward (with every gradient term) on the logits' device.
RouterRun RunRouter(const Tensor &logits, const MoERouterConfig &c, const Tensor &dw_host) {
    const Device d = logits.device();
    const std::int64_t tokens = logits.size(0);
    RouterRun r{Tensor::Empty({tokens, c.topk}, DType::kFloat32, d),
                Tensor::Empty({tokens, c.topk}, DType::kInt64, d),
                Tensor::Empty({c.num_experts}, DType::kInt64, d),
                Tensor::Empty({}, DType::kFloat32, d),
                Tensor::Empty({}, DType::kFloat32, d),
                Tensor::Empty(logits.shape(), DType::kFloat32, d)};
    kernels::MoERouterForward({.logits = logits,
                               .config = c,
                               .weights = r.weights,
                               .indices = r.indices,
                               .tokens_per_expert = r.counts,
                               .aux_loss = &r.aux,
                               .z_loss = &r.z});
    const Tensor dw = dw_host.To(d);
    const Tensor daux = Tensor::Full({}, 0.9, DType::kFloat32, d);
    const Tensor dz = Tensor::Full({}, 1.7, DType::kFloat32, d);
    kernels::MoERouterBackward({.logits = logits,
                                .config = c,
                                .indices = r.indices,
                                .tokens_per_expert = r.counts,
                                .dweights = &dw,
                                .daux_loss = &daux,
                                .dz_loss = &dz,
                                .dlogits = r.dlogits});
    return r;
}

class MoECudaTest : public CudaParamTest<std::tuple<int, int, bool>> {};

TEST_P(MoECudaTest, RouterMatchesTheCpuProviderAndIsBitwiseDeterministic) {
    const auto [experts, topk, sigmoid] = GetParam();
    const MoERouterConfig c{.num_experts = experts,
                            .topk = topk,
                            .score_function = sigmoid ? MoEScoreFunction::kSigmoid : MoEScoreFunction::kSoftmax,
                            .normalize_topk = !sigmoid,
                            .aux_loss_coeff = 0.01,
                            .z_loss_coeff = 0.001};
    const std::int64_t tokens = 4099; // not a multiple of the 4 tokens per block nor of the 256-row chunks
    const Tensor logits = RandomTensor({tokens, experts}, DType::kFloat32, Device::CPU(), 21, "logits",
                                       RandomDistribution::kNormal, 0.0, 3.0);
    const Tensor dw = RandomTensor({tokens, topk}, DType::kFloat32, Device::CPU(), 21, "dw");
    const RouterRun cpu = RunRouter(logits, c, dw);
    const RouterRun gpu = RunRouter(logits.To(Gpu()), c, dw);
    EXPECT_EQ(gpu.indices.ToDoubleVector(), cpu.indices.ToDoubleVector()) << "top-k on the same logits";
    EXPECT_EQ(gpu.counts.ToDoubleVector(), cpu.counts.ToDoubleVector());
    EXPECT_TRUE(ValuesMatch(gpu.weights, cpu.weights.ToDoubleVector(), DType::kFloat32, 16)) << "weights";
    EXPECT_TRUE(ValuesMatch(gpu.aux, cpu.aux.ToDoubleVector(), DType::kFloat32, 64)) << "aux loss";
    EXPECT_TRUE(ValuesMatch(gpu.z, cpu.z.ToDoubleVector(), DType::kFloat32, 64)) << "z loss";
    // dlogits = p ⊙ (g − Σ_e p_e g_e) (+ the loss terms): an fp32 sum over E experts whose result cancels, so its
    // error grows with E (measured on an H200: 1.6x the 64-term bound at E = 256; the CPU sums in float64).
    EXPECT_TRUE(ValuesMatch(gpu.dlogits, cpu.dlogits.ToDoubleVector(), DType::kFloat32, std::max(64, 2 * experts)))
        << "dlogits";
    ASSERT_GT(AbsSum(cpu.dlogits.ToDoubleVector()), 0.0);
    const RouterRun again = RunRouter(logits.To(Gpu()), c, dw);
    for (const auto &[a, b] :
         {std::pair{&again.weights, &gpu.weights}, std::pair{&again.indices, &gpu.indices},
          std::pair{&again.aux, &gpu.aux}, std::pair{&again.z, &gpu.z}, std::pair{&again.dlogits, &gpu.dlogits}}) {
        EXPECT_EQ(HostBytes(*a), HostBytes(*b));
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoECudaTest,
                         ::testing::Values(std::tuple{8, 2, false}, std::tuple{64, 6, false}, std::tuple{64, 8, true},
                                           std::tuple{128, 8, false}, std::tuple{256, 8, false},
                                           std::tuple{256, 1, true}, std::tuple{33, 3, false}));

/// "E96_top8_softmax": a router shape as a test name.
std::string RouterShapeName(const ::testing::TestParamInfo<std::tuple<int, int, bool>> &info) {
    const auto [experts, topk, sigmoid] = info.param;
    return "E" + std::to_string(experts) + "_top" + std::to_string(topk) + (sigmoid ? "_sigmoid" : "_softmax");
}

// The router kernels are instantiated for 1, 2, 4 and 8 experts per lane (the fewest that hold E <= 32, 64, 128, 256).
// Above, E = 8 and 33 leave padding slots in the 1- and 2-wide rows, but E = 128 and 256 fill the 4- and 8-wide ones;
// these put E inside those two bands, so that their top per-lane slots hold padding experts (E = 96: the 4th slot of
// every lane; E = 100: the 4th slot of lanes 4..31; E = 200: the 7th slot of lanes 8..31 and the whole 8th), which
// must add nothing to the sums and never be chosen.
INSTANTIATE_TEST_SUITE_P(LaneBands, MoECudaTest,
                         ::testing::Values(std::tuple{96, 8, false}, std::tuple{100, 4, true},
                                           std::tuple{200, 8, false}, std::tuple{200, 3, true}),
                         RouterShapeName);

TEST_F(CudaTest, RouterCountsLeaveOutTheEmptySlotsOfANanRow) {
    // A NaN row chooses no expert: its slots get id -1 and no count (the counts come from a pass over the ids).
    constexpr int kTokens = 64, kExperts = 40, kTopk = 3;
    std::vector<double> l = RandomTensor({kTokens, kExperts}, DType::kFloat32, Device::CPU(), 5, "l").ToDoubleVector();
    for (int e = 0; e < kExperts; ++e) {
        l[static_cast<std::size_t>(7 * kExperts + e)] = std::nan("");
    }
    const Tensor logits = Tensor::FromVector(l, {kTokens, kExperts}, DType::kFloat32).To(Gpu());
    Tensor weights = Tensor::Empty({kTokens, kTopk}, DType::kFloat32, Gpu());
    Tensor indices = Tensor::Empty({kTokens, kTopk}, DType::kInt64, Gpu());
    Tensor counts = Tensor::Empty({kExperts}, DType::kInt64, Gpu());
    kernels::MoERouterForward({.logits = logits,
                               .config = {.num_experts = kExperts, .topk = kTopk},
                               .weights = weights,
                               .indices = indices,
                               .tokens_per_expert = counts});
    const Values ids = indices.ToDoubleVector();
    Values want(kExperts, 0.0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        if (i / kTopk == 7) {
            EXPECT_EQ(ids[i], -1.0) << "slot " << i % kTopk << " of the NaN row";
        } else {
            ASSERT_GE(ids[i], 0.0);
            want[static_cast<std::size_t>(ids[i])] += 1.0;
        }
    }
    EXPECT_EQ(counts.ToDoubleVector(), want);
}

class MoECudaPermuteTest : public CudaTest {};

TEST_F(MoECudaPermuteTest, MapMatchesTheCpuWithAndWithoutCapacity) {
    for (const auto &[tokens, topk, experts] :
         // 2000 experts: more than the key kernel's shared-memory histogram holds (its global-atomic path).
         std::vector<std::tuple<int, int, int>>{
             {16384, 8, 128}, {8192, 2, 8}, {30000, 1, 300}, {5, 8, 8}, {4096, 3, 2000}}) {
        const Tensor ids = RandomTensor({tokens, topk}, DType::kInt64, Device::CPU(), 9, "ids",
                                        RandomDistribution::kInteger, 0, experts - 1);
        for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{tokens * topk / experts}}) {
            SCOPED_TRACE(::testing::Message()
                         << "T " << tokens << " topk " << topk << " E " << experts << " capacity " << capacity);
            std::vector<Tensor> maps, sizes;
            for (const Device d : {Device::CPU(), Gpu(), Gpu()}) {
                maps.push_back(Tensor::Empty(ids.shape(), DType::kInt64, d));
                sizes.push_back(Tensor::Empty({experts}, DType::kInt64, d));
                kernels::MoEPermuteMap({.indices = ids.To(d),
                                        .num_experts = experts,
                                        .capacity = capacity,
                                        .row_map = maps.back(),
                                        .group_sizes = sizes.back()});
            }
            EXPECT_EQ(maps[1].ToDoubleVector(), maps[0].ToDoubleVector());
            EXPECT_EQ(sizes[1].ToDoubleVector(), sizes[0].ToDoubleVector());
            EXPECT_EQ(HostBytes(maps[2]), HostBytes(maps[1]));
        }
    }
}

TEST_F(MoECudaPermuteTest, OutOfRangeIdsAreDroppedOnTheDevice) {
    const Tensor ids = Tensor::FromVector({0, 5, -1, 2, 9, 2}, {3, 2}, DType::kInt64).To(Gpu());
    Tensor map = Tensor::Empty({3, 2}, DType::kInt64, Gpu());
    Tensor sizes = Tensor::Empty({3}, DType::kInt64, Gpu());
    kernels::MoEPermuteMap({.indices = ids, .num_experts = 3, .row_map = map, .group_sizes = sizes});
    EXPECT_EQ(map.ToDoubleVector(), (Values{0, -1, -1, 1, -1, 2}));
    EXPECT_EQ(sizes.ToDoubleVector(), (Values{1, 0, 2}));
}

TEST_F(MoECudaPermuteTest, RowKernelsRejectMoreSlotsThanAWarpHasLanes) {
    const Tensor x = RandomGpu({4, 16}, DType::kFloat32, 1, "x");
    const Tensor row_map = Tensor::Zeros({4, 33}, DType::kInt64, Gpu());
    Tensor out = Tensor::Empty({1, 16}, DType::kFloat32, Gpu());
    try {
        kernels::MoEPermuteRows({.x = x, .row_map = row_map, .out = out});
        FAIL() << "topk 33 was accepted";
    } catch (const ShapeError &e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("topk <= 32"));
        EXPECT_THAT(e.what(), ::testing::HasSubstr("[4, 33]"));
    }
    Tensor y = Tensor::Empty({4, 16}, DType::kFloat32, Gpu());
    EXPECT_THROW(kernels::MoEUnpermuteRows({.tokens = out, .row_map = row_map, .y = y}), ShapeError);
}

class MoECudaRowsTest : public CudaParamTest<DType> {};

TEST_P(MoECudaRowsTest, GatherCombineAndWeightsGradAtMoEWidths) {
    const DType dtype = GetParam();
    for (const auto &[tokens, topk, hidden, experts] :
         // The widths of the MoE cases, an odd hidden (no 16-byte vectors), topk 12 (more slots than the router's
         // eight) with a hidden of several vector chunks and a partial last one.
         std::vector<std::tuple<int, int, int, int>>{
             {2048, 2, 4096, 8}, {1024, 8, 2048, 64}, {777, 3, 1001, 5}, {96, 12, 2056, 16}}) {
        SCOPED_TRACE(::testing::Message() << "T " << tokens << " topk " << topk << " H " << hidden);
        const Tensor ids =
            RandomTensor({tokens, topk}, DType::kInt64, Gpu(), 3, "ids", RandomDistribution::kInteger, 0, experts - 1);
        Tensor row_map = Tensor::Empty({tokens, topk}, DType::kInt64, Gpu());
        Tensor sizes = Tensor::Empty({experts}, DType::kInt64, Gpu());
        const std::int64_t capacity = tokens * topk / experts; // about half the experts drop some copies
        kernels::MoEPermuteMap(
            {.indices = ids, .num_experts = experts, .capacity = capacity, .row_map = row_map, .group_sizes = sizes});
        std::int64_t rows = 0;
        for (double s : sizes.ToDoubleVector()) {
            rows += static_cast<std::int64_t>(s);
        }
        const Values map = row_map.ToDoubleVector();
        const Tensor x = RandomGpu({tokens, hidden}, dtype, 4, "x");
        const Tensor w = RandomGpu({tokens, topk}, DType::kFloat32, 4, "w");
        const Tensor dy = RandomGpu({tokens, hidden}, dtype, 4, "dy");
        const Values xv = x.ToDoubleVector(), wv = w.ToDoubleVector(), dyv = dy.ToDoubleVector();
        // Gather: a copy.
        Tensor tokens_out = Tensor::Empty({rows, hidden}, dtype, Gpu());
        kernels::MoEPermuteRows({.x = x, .row_map = row_map, .out = tokens_out});
        const Values tv = tokens_out.ToDoubleVector();
        Values combine(xv.size(), 0.0), dw(static_cast<std::size_t>(tokens * topk), 0.0);
        for (std::int64_t i = 0; i < tokens * topk; ++i) {
            const auto r = static_cast<std::int64_t>(map[i]);
            for (std::int64_t h = 0; r >= 0 && h < hidden; ++h) {
                ASSERT_EQ(tv[r * hidden + h], xv[(i / topk) * hidden + h]) << "copy " << i << " h " << h;
                combine[(i / topk) * hidden + h] += wv[i] * tv[r * hidden + h];
                dw[i] += dyv[(i / topk) * hidden + h] * tv[r * hidden + h];
            }
        }
        // Weighted gather (the combine's backward): w·x rounded once to the dtype.
        Tensor scaled = Tensor::Empty({rows, hidden}, dtype, Gpu());
        kernels::MoEPermuteRows({.x = x, .row_map = row_map, .weights = &w, .out = scaled});
        Values scaled_ref(static_cast<std::size_t>(rows * hidden), 0.0);
        for (std::int64_t i = 0; i < tokens * topk; ++i) {
            const auto r = static_cast<std::int64_t>(map[i]);
            for (std::int64_t h = 0; r >= 0 && h < hidden; ++h) {
                scaled_ref[r * hidden + h] = wv[i] * xv[(i / topk) * hidden + h];
            }
        }
        EXPECT_TRUE(ValuesMatch(scaled, scaled_ref, dtype)) << "weighted gather";
        Tensor y = Tensor::Empty({tokens, hidden}, dtype, Gpu());
        kernels::MoEUnpermuteRows({.tokens = tokens_out, .row_map = row_map, .weights = &w, .y = y});
        EXPECT_TRUE(ValuesMatch(y, combine, dtype, topk + 1)) << "combine";
        Tensor dweights = Tensor::Empty({tokens, topk}, DType::kFloat32, Gpu());
        kernels::MoEUnpermuteWeightsGrad({.dy = dy, .tokens = tokens_out, .row_map = row_map, .dweights = dweights});
        EXPECT_TRUE(ValuesMatch(dweights, dw, DType::kFloat32, 64)) << "dweights";
        // Reruns: bitwise.
        Tensor y2 = Tensor::Empty({tokens, hidden}, dtype, Gpu());
        kernels::MoEUnpermuteRows({.tokens = tokens_out, .row_map = row_map, .weights = &w, .y = y2});
        EXPECT_EQ(HostBytes(y2), HostBytes(y));
        Tensor dweights2 = Tensor::Empty({tokens, topk}, DType::kFloat32, Gpu());
        kernels::MoEUnpermuteWeightsGrad({.dy = dy, .tokens = tokens_out, .row_map = row_map, .dweights = dweights2});
        EXPECT_EQ(HostBytes(dweights2), HostBytes(dweights));
    }
}

// ---- the gather and the combine, bit for bit against fp32 host references ------------------------------------------
//
// Both kernels are token-major, one warp per token: slot j's row and weight sit in lane j (topk <= 32, so at topk 32
// every lane holds one) and reach the other lanes by shuffles; each lane moves 16-byte vectors of the row, 8 per step
// in the gather (256 vectors a warp step), 4 in the combine (128), when the hidden size is a multiple of a vector and
// both pointers are 16-byte aligned, else single elements. Per element the math is fixed: the gather stores x, or
// round(w·x) (one fp32 multiply, then round to nearest even to the dtype); the combine runs acc = 0, then for the kept
// slots in increasing j acc += w_j·v_j, then rounds once. nvcc's default --fmad=true (the build keeps it) compiles
// that += into one fma.rn.f32 per slot: the PTX of every UnpermuteRowsKernel instantiation holds fma.rn.f32 and no
// separate fp32 mul or add. So the host can redo both exactly, with std::fma for the combine.

/// The values of a float tensor as fp32 (exact for the kernels' dtypes).
std::vector<float> HostFloats(const Tensor &t) {
    const Values v = t.ToDoubleVector();
    return std::vector<float>(v.begin(), v.end());
}

/// Whether `actual` holds bitwise `expected` (fp32 values, each rounded once to actual's dtype, round to nearest even,
/// as the kernels' FromFloat and the host conversion do); a failure names the first differing element.
::testing::AssertionResult SameBits(const Tensor &actual, const std::vector<float> &expected) {
    const Tensor want = Tensor::FromVector(Values(expected.begin(), expected.end()), actual.shape(), actual.dtype());
    const std::vector<unsigned char> a = HostBytes(actual), b = HostBytes(want);
    if (a == b) {
        return ::testing::AssertionSuccess();
    }
    const std::size_t size = ElementSize(actual.dtype());
    const Values av = actual.ToDoubleVector(), bv = want.ToDoubleVector();
    std::size_t differ = 0, first = 0;
    for (std::size_t i = 0; i < av.size(); ++i) {
        if (!std::equal(a.begin() + i * size, a.begin() + (i + 1) * size, b.begin() + i * size) && differ++ == 0) {
            first = i;
        }
    }
    return ::testing::AssertionFailure() << differ << " of " << av.size()
                                         << " elements differ in their bits; the first, "
                                         << "flat index " << first << ": got " << av[first] << ", want " << bv[first];
}

/// A routing of the row kernels: row_map [T, topk] on the host and the GPU, over `rows` rows of permuted tokens.
struct RowRouting {
    std::vector<std::int64_t> map;
    std::int64_t rows = 0;
    Tensor row_map;
};

/// A random routing, each kept slot on its own row and the rows in a random order (not the expert order: the kernels
/// take any). Dropless: every slot has a row and every row a slot. With drops: about 3 slots in 10 are -1, token 0
/// keeps none (the combine gives it zeros) and 5 rows get no copy (the gather leaves them as they were).
RowRouting RandomRouting(std::int64_t tokens, std::int64_t topk, bool drops, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::int64_t> kept;
    for (std::int64_t i = 0; i < tokens * topk; ++i) {
        if (!drops || (i >= topk && rng() % 10 >= 3)) {
            kept.push_back(i);
        }
    }
    RowRouting r;
    r.rows = static_cast<std::int64_t>(kept.size()) + (drops ? 5 : 0);
    std::vector<std::int64_t> order(static_cast<std::size_t>(r.rows));
    std::iota(order.begin(), order.end(), std::int64_t{0});
    for (std::size_t i = order.size(); i > 1; --i) { // Fisher-Yates, the same on every standard library
        std::swap(order[i - 1], order[rng() % i]);
    }
    r.map.assign(static_cast<std::size_t>(tokens * topk), -1);
    for (std::size_t n = 0; n < kept.size(); ++n) {
        r.map[static_cast<std::size_t>(kept[n])] = order[n];
    }
    r.row_map = Tensor::FromVector(Values(r.map.begin(), r.map.end()), {tokens, topk}, DType::kInt64).To(Gpu());
    return r;
}

/// The gather on the host over `out`'s prior values: out[row_map[t, j]] = x[t], or the fp32 product w[t, j]·x[t].
std::vector<float> RefGather(const std::vector<float> &x, std::int64_t hidden, const RowRouting &r, std::int64_t topk,
                             const std::vector<float> *w, std::vector<float> out) {
    for (std::size_t i = 0; i < r.map.size(); ++i) {
        const std::int64_t row = r.map[i];
        const auto t = static_cast<std::int64_t>(i) / topk;
        for (std::int64_t h = 0; row >= 0 && h < hidden; ++h) {
            const float v = x[static_cast<std::size_t>(t * hidden + h)];
            out[static_cast<std::size_t>(row * hidden + h)] = w != nullptr ? (*w)[i] * v : v;
        }
    }
    return out;
}

/// How the host adds a token's slots: the kernel's fma chain in increasing j; the same in decreasing j; or rounding
/// each product before its add. The last two are what the kernel does not do (the tests check the data tells them
/// apart, and a failure says whether the kernel matched the unfused chain instead).
enum class Chain { kFma, kFmaReversed, kRoundedProducts };

/// The combine on the host: y[t] = the chain over the kept slots from acc = +0 (w = 1 without weights: fma(1, v, acc)
/// is acc + v rounded once, so the kinds agree there).
std::vector<float> RefCombine(const std::vector<float> &tokens, std::int64_t hidden, const RowRouting &r,
                              std::int64_t topk, const std::vector<float> *w, Chain chain) {
    const auto num_tokens = static_cast<std::int64_t>(r.map.size()) / topk;
    std::vector<float> y(static_cast<std::size_t>(num_tokens * hidden), 0.0f);
    for (std::int64_t t = 0; t < num_tokens; ++t) {
        for (std::int64_t h = 0; h < hidden; ++h) {
            float acc = 0.0f;
            for (std::int64_t n = 0; n < topk; ++n) {
                const std::int64_t j = chain == Chain::kFmaReversed ? topk - 1 - n : n;
                const auto i = static_cast<std::size_t>(t * topk + j);
                const std::int64_t row = r.map[i];
                if (row < 0) {
                    continue;
                }
                const float wj = w != nullptr ? (*w)[i] : 1.0f;
                const float v = tokens[static_cast<std::size_t>(row * hidden + h)];
                if (chain == Chain::kRoundedProducts) {
                    // The product rounded to fp32 through double (exact there), so that no compiler fuses it.
                    acc += static_cast<float>(static_cast<double>(wj) * static_cast<double>(v));
                } else {
                    acc = std::fma(wj, v, acc);
                }
            }
            y[static_cast<std::size_t>(t * hidden + h)] = acc;
        }
    }
    return y;
}

struct ExactRowsCase {
    std::int64_t tokens, topk;
    std::int64_t vectors;    ///< 16-byte vectors per row: hidden = vectors · (16 / element size) + extra
    std::int64_t extra = 0;  ///< not 0: the hidden size is no multiple of a vector (the element-wise form)
    bool misaligned = false; ///< the input starts one element past an allocation (the element-wise form too)
};
// 19 and 9 tokens: the last block of 8 warps is partly idle.
const std::vector<ExactRowsCase> kExactRowsCases = {
    {19, 32, 8},          // topk 32: every lane holds a slot; 8 vectors (bf16 hidden 64): fewer vectors than lanes
    {19, 32, 9},          // an odd number of vectors (bf16 72, fp32 36)
    {19, 32, 5},          // (bf16 40, fp32 20)
    {9, 32, 257},         // a partial last step in both kernels: 256 + 1 vectors (gather), 2·128 + 1 (combine)
    {19, 32, 0, 7},       // element-wise, fewer elements than lanes
    {19, 32, 0, 37},      // element-wise, a partial second step
    {19, 32, 8, 0, true}, // a vector multiple, but a misaligned input: element-wise
    {19, 1, 257},         // one slot: lane 0 alone holds a row
    {19, 7, 9},           // an odd topk: lanes 7.. hold none
};

std::int64_t ExactRowsHidden(const ExactRowsCase &c, DType dtype) {
    return c.vectors * static_cast<std::int64_t>(16 / ElementSize(dtype)) + c.extra;
}

/// No weights, fp32 weights, and weights of the rows' dtype (the kernels' second template type).
std::vector<std::optional<DType>> WeightDTypes(DType dtype) {
    std::vector<std::optional<DType>> w{std::nullopt, DType::kFloat32};
    if (dtype != DType::kFloat32) {
        w.emplace_back(dtype);
    }
    return w;
}

// Pins the gather's bits: a plain gather copies x's rows bit for bit, a weighted one stores round(w·x) of one fp32
// multiply; rows no copy maps to keep their bits; at topk 32, fewer vectors than lanes, partial chunks, element-wise.
TEST_P(MoECudaRowsTest, GatherIsBitwiseTheHostFp32Product) {
    const DType dtype = GetParam();
    for (const ExactRowsCase &c : kExactRowsCases) {
        const std::int64_t hidden = ExactRowsHidden(c, dtype);
        for (const bool drops : {false, true}) {
            const RowRouting r =
                RandomRouting(c.tokens, c.topk, drops, static_cast<std::uint64_t>(hidden * 64 + c.topk));
            const Tensor x = RandomGpu({c.tokens, hidden}, dtype, 31, "x");
            const MisalignedTensor shifted = c.misaligned ? MisalignedCopy(x) : MisalignedTensor{};
            const Tensor &input = c.misaligned ? shifted.view : x;
            const Tensor prior = RandomGpu({r.rows, hidden}, dtype, 31, "prior");
            const std::vector<float> xv = HostFloats(x), prior_v = HostFloats(prior);
            for (const std::optional<DType> wdtype : WeightDTypes(dtype)) {
                SCOPED_TRACE(::testing::Message()
                             << "T " << c.tokens << " topk " << c.topk << " H " << hidden
                             << (c.misaligned ? " misaligned" : "") << (drops ? " with drops" : " dropless")
                             << " weights " << (wdtype ? DTypeName(*wdtype) : "none"));
                const Tensor w = RandomGpu({c.tokens, c.topk}, wdtype.value_or(DType::kFloat32), 32, "w");
                const std::vector<float> wv = HostFloats(w);
                Tensor out = prior.Clone();
                kernels::MoEPermuteRows(
                    {.x = input, .row_map = r.row_map, .weights = wdtype ? &w : nullptr, .out = out});
                EXPECT_TRUE(SameBits(out, RefGather(xv, hidden, r, c.topk, wdtype ? &wv : nullptr, prior_v)));
            }
        }
    }
}

// Pins the combine's bits: y[t] is acc = fma(w_j, v_j, acc) over the kept slots in increasing j from +0, rounded once
// to the dtype (a token with no kept slot: +0), with and without weights, at the shapes of the gather's test. The
// data must tell that order from the reverse one and the fused from the unfused chain, or the check could not fail.
TEST_P(MoECudaRowsTest, CombineIsBitwiseTheHostFmaChainInSlotOrder) {
    const DType dtype = GetParam();
    for (const ExactRowsCase &c : kExactRowsCases) {
        const std::int64_t hidden = ExactRowsHidden(c, dtype);
        for (const bool drops : {false, true}) {
            const RowRouting r =
                RandomRouting(c.tokens, c.topk, drops, static_cast<std::uint64_t>(hidden * 64 + c.topk));
            const Tensor tokens = RandomGpu({r.rows, hidden}, dtype, 41, "tokens");
            const MisalignedTensor shifted = c.misaligned ? MisalignedCopy(tokens) : MisalignedTensor{};
            const Tensor &input = c.misaligned ? shifted.view : tokens;
            const std::vector<float> tv = HostFloats(tokens);
            for (const std::optional<DType> wdtype : WeightDTypes(dtype)) {
                SCOPED_TRACE(::testing::Message()
                             << "T " << c.tokens << " topk " << c.topk << " H " << hidden
                             << (c.misaligned ? " misaligned" : "") << (drops ? " with drops" : " dropless")
                             << " weights " << (wdtype ? DTypeName(*wdtype) : "none"));
                const Tensor w = RandomGpu({c.tokens, c.topk}, wdtype.value_or(DType::kFloat32), 42, "w");
                const std::vector<float> wv = HostFloats(w);
                const std::vector<float> *wp = wdtype ? &wv : nullptr;
                Tensor y = RandomGpu({c.tokens, hidden}, dtype, 43, "poison", 100.0); // overwritten, token 0 too
                kernels::MoEUnpermuteRows(
                    {.tokens = input, .row_map = r.row_map, .weights = wdtype ? &w : nullptr, .y = y});
                const std::vector<float> want = RefCombine(tv, hidden, r, c.topk, wp, Chain::kFma);
                EXPECT_TRUE(SameBits(y, want))
                    << (wp != nullptr && SameBits(y, RefCombine(tv, hidden, r, c.topk, wp, Chain::kRoundedProducts))
                            ? "the kernel matches the chain of rounded products instead: built without FMA contraction?"
                            : "");
                if (dtype == DType::kFloat32 && c.topk == 32 && !drops) {
                    EXPECT_TRUE(RefCombine(tv, hidden, r, c.topk, wp, Chain::kFmaReversed) != want)
                        << "order-blind data";
                    if (wp != nullptr) {
                        EXPECT_TRUE(RefCombine(tv, hidden, r, c.topk, wp, Chain::kRoundedProducts) != want)
                            << "fma-blind data";
                    }
                }
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(DTypes, MoECudaRowsTest, CudaDTypes(), DTypeParamName);

/// Which terms of the router's gradient a pipeline carries: all, or one at a time (a failure then names the term).
enum class Terms { kAll, kWeightsOnly, kAuxOnly, kZOnly };

/// Router → Permute → gelu → Unpermute, plus the aux and z losses, on `device`.
autograd::Variable Pipeline(const autograd::Variable &x, const autograd::Variable &logits, std::int64_t capacity,
                            Terms terms) {
    using namespace autograd;
    const bool all = terms == Terms::kAll;
    const RouterOptions o{.num_experts = 16,
                          .topk = 2,
                          .aux_loss_coeff = all || terms == Terms::kAuxOnly ? 0.01 : 0.0,
                          .z_loss_coeff = all || terms == Terms::kZOnly ? 0.001 : 0.0};
    const RouterOutput r = Router(logits, o);
    if (terms == Terms::kAuxOnly) {
        return r.aux_loss;
    }
    if (terms == Terms::kZOnly) {
        return r.z_loss;
    }
    const PermuteOutput p = Permute(x, r.indices, o.num_experts, capacity);
    // Experts that differ (fixed random weights, no grad): without them both copies of a token are the same row, so
    // the weights' true gradient w_j·(dw_j − w·dw) is exactly 0 and the comparison measures rounding noise alone.
    const Tensor w = RandomTensor({o.num_experts, x.local().size(1), x.local().size(1)}, DType::kFloat32, Device::CPU(),
                                  6, "experts")
                         .To(x.local().device());
    const Variable experts = GroupedLinear(Gelu(p.tokens), Variable(w, false), Variable(), p.group_sizes);
    const Variable y = Sum(Unpermute(experts, p.row_map, r.weights));
    return all ? Add(Add(y, r.aux_loss), r.z_loss) : y;
}

TEST_F(MoECudaPermuteTest, AutogradPipelineMatchesTheCpu) {
    for (const Terms terms : {Terms::kAll, Terms::kWeightsOnly, Terms::kAuxOnly, Terms::kZOnly}) {
        for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{40}}) {
            SCOPED_TRACE(::testing::Message() << "terms " << static_cast<int>(terms) << " capacity " << capacity);
            const Tensor x0 = RandomTensor({512, 64}, DType::kFloat32, Device::CPU(), 5, "x");
            const Tensor l0 = RandomTensor({512, 16}, DType::kFloat32, Device::CPU(), 5, "logits");
            std::vector<Values> results[2];
            for (int run = 0; run < 2; ++run) {
                const Device d = run == 0 ? Device::CPU() : Gpu();
                autograd::Variable x(x0.To(d), true);
                autograd::Variable logits(l0.To(d), true);
                const autograd::Variable loss = Pipeline(x, logits, capacity, terms);
                loss.Backward();
                const bool has_dx = x.grad().defined();
                results[run] = {loss.local().ToDoubleVector(), has_dx ? x.grad().local().ToDoubleVector() : Values{},
                                logits.grad().local().ToDoubleVector()};
            }
            // allclose: a relative budget plus an absolute one of 16 roundings of the largest entry. dlogits of a
            // chosen expert = w_j·(dw_j − w·dw), a difference of two fp32 dot products of similar size, and dx
            // passes through the experts' GEMM: their errors follow the largest entries, not each one's own value
            // (measured on an H200: dropless rows off by 800x a purely relative budget).
            const auto close = [](const Values &actual, const Values &expected, double roundings) {
                double largest = 0.0;
                for (const double v : expected) {
                    largest = std::max(largest, std::abs(v));
                }
                EXPECT_GT(largest, 0.0);
                return CompareValues(actual, expected, Tolerance(DType::kFloat32, roundings),
                                     Tolerance(DType::kFloat32, 16) * largest);
            };
            EXPECT_EQ(close(results[1][0], results[0][0], 64), "") << "loss";
            if (terms == Terms::kAll || terms == Terms::kWeightsOnly) {
                EXPECT_EQ(close(results[1][1], results[0][1], 64), "") << "dx";
            }
            EXPECT_EQ(close(results[1][2], results[0][2], 64), "") << "dlogits";
        }
    }
}

} // namespace
} // namespace shardline::testing
