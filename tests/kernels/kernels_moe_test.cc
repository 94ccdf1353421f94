// The mixture-of-experts kernels (kernels/moe.h) on every device against float64 references written here: the router's
// top-k (ties to the lower id), weights (softmax/sigmoid, renormalised or not), counts, aux and z losses and their
// gradient; the permutation map (stable expert order, zero-token experts, all copies on one expert, capacity drops);
// the gather, the combine and the combine's weight gradient; run-to-run bitwise determinism of each.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/moe.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::MoERouterConfig;
using kernels::MoEScoreFunction;

// ---------------------------------------------------------------------------------------------------------------------
// float64 references

struct RefRouting {
    Values weights;
    Values indices;
    Values counts;
    double aux = 0.0;
    double z = 0.0;
    Values dlogits; ///< the gradient of <dw, weights> + daux·aux + dz·z
};

/// The whole router in float64, the gradient by the chain rule written out per term.
RefRouting RefRouter(const Values &logits, std::int64_t tokens, const MoERouterConfig &c, const Values &dw, double daux,
                     double dz) {
    const std::int64_t e_count = c.num_experts;
    const int k = c.topk;
    const bool sigmoid = c.score_function == MoEScoreFunction::kSigmoid;
    const bool normalize = kernels::NormalizesTopk(c);
    RefRouting r;
    r.weights.assign(static_cast<std::size_t>(tokens * k), 0.0);
    r.indices.assign(static_cast<std::size_t>(tokens * k), 0.0);
    r.counts.assign(static_cast<std::size_t>(e_count), 0.0);
    r.dlogits.assign(logits.size(), 0.0);
    std::vector<Values> s(static_cast<std::size_t>(tokens)), p(s.size()), soft(s.size());
    std::vector<double> lse(s.size());
    Values p_sum(static_cast<std::size_t>(e_count), 0.0);
    for (std::int64_t t = 0; t < tokens; ++t) {
        const double *l = logits.data() + t * e_count;
        const double m = *std::max_element(l, l + e_count);
        double z = 0.0;
        for (std::int64_t e = 0; e < e_count; ++e) {
            z += std::exp(l[e] - m);
        }
        lse[t] = m + std::log(z);
        double s_sum = 0.0;
        for (std::int64_t e = 0; e < e_count; ++e) {
            soft[t].push_back(std::exp(l[e] - lse[t]));
            s[t].push_back(sigmoid ? 1.0 / (1.0 + std::exp(-l[e])) : soft[t].back());
            s_sum += s[t].back();
        }
        for (std::int64_t e = 0; e < e_count; ++e) {
            p[t].push_back(sigmoid ? s[t][e] / (s_sum + 1e-20) : s[t][e]);
            p_sum[e] += p[t][e];
        }
        // Sort expert ids by (logit descending, id ascending).
        std::vector<std::int64_t> order(static_cast<std::size_t>(e_count));
        for (std::int64_t e = 0; e < e_count; ++e) {
            order[e] = e;
        }
        std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return l[a] > l[b]; });
        double chosen = sigmoid ? 1e-20 : 0.0;
        for (int j = 0; j < k; ++j) {
            chosen += s[t][order[j]];
        }
        for (int j = 0; j < k; ++j) {
            r.indices[t * k + j] = static_cast<double>(order[j]);
            r.weights[t * k + j] = normalize ? s[t][order[j]] / chosen : s[t][order[j]];
            r.counts[order[j]] += 1.0;
        }
    }
    const auto td = static_cast<double>(tokens);
    for (std::int64_t e = 0; e < e_count; ++e) {
        r.aux += c.aux_loss_coeff * static_cast<double>(e_count) * (r.counts[e] / (td * k)) * (p_sum[e] / td);
    }
    for (std::int64_t t = 0; t < tokens; ++t) {
        r.z += c.z_loss_coeff * lse[t] * lse[t] / td;
    }
    // Gradient: dL/ds_e per row (weights and aux terms), then through the scores; z straight to the logits.
    for (std::int64_t t = 0; t < tokens; ++t) {
        Values ds(static_cast<std::size_t>(e_count), 0.0);
        double chosen = sigmoid ? 1e-20 : 0.0;
        for (int j = 0; j < k; ++j) {
            chosen += s[t][static_cast<std::int64_t>(r.indices[t * k + j])];
        }
        for (int j = 0; j < k; ++j) { // w_j = s_{i_j} / S: ∂w_j/∂s_{i_m} = δ_jm / S - w_j / S
            for (int m = 0; m < k; ++m) {
                const auto im = static_cast<std::int64_t>(r.indices[t * k + m]);
                const double d = normalize ? ((j == m ? 1.0 : 0.0) - r.weights[t * k + j]) / chosen : (j == m);
                ds[im] += dw[t * k + j] * d;
            }
        }
        double s_sum = 0.0;
        for (std::int64_t e = 0; e < e_count; ++e) {
            s_sum += s[t][e];
        }
        for (std::int64_t e = 0; e < e_count; ++e) { // d aux / d p[t, e], then p → s
            const double a_e = daux * c.aux_loss_coeff * static_cast<double>(e_count) * r.counts[e] / (td * td * k);
            if (!sigmoid) {
                ds[e] += a_e;
                continue;
            }
            for (std::int64_t f = 0; f < e_count; ++f) { // p_e = s_e / D: ∂p_e/∂s_f = δ_ef / D - s_e / D²
                const double d = s_sum + 1e-20;
                ds[f] += a_e * ((e == f ? 1.0 : 0.0) / d - s[t][e] / (d * d));
            }
        }
        for (std::int64_t e = 0; e < e_count; ++e) {
            double g = 0.0;
            for (std::int64_t f = 0; f < e_count; ++f) { // ∂s_f/∂l_e
                const double jac =
                    sigmoid ? (e == f ? s[t][e] * (1.0 - s[t][e]) : 0.0) : s[t][f] * ((e == f ? 1.0 : 0.0) - s[t][e]);
                g += ds[f] * jac;
            }
            g += dz * c.z_loss_coeff * 2.0 * lse[t] / td * soft[t][e];
            r.dlogits[t * e_count + e] = g;
        }
    }
    return r;
}

/// row_map and group sizes by the definition: per expert in increasing id, its copies in increasing (t, j) order.
void RefPermuteMap(const Values &ids, std::int64_t experts, std::int64_t capacity, Values *row_map, Values *sizes) {
    row_map->assign(ids.size(), -1.0);
    sizes->assign(static_cast<std::size_t>(experts), 0.0);
    std::int64_t row = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
        std::int64_t seen = 0;
        for (std::size_t i = 0; i < ids.size(); ++i) {
            if (static_cast<std::int64_t>(ids[i]) != e) {
                continue;
            }
            if (capacity < 0 || seen < capacity) {
                (*row_map)[i] = static_cast<double>(row++);
                (*sizes)[e] += 1.0;
            }
            ++seen;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// The router: float32 logits (and float64 on the CPU).

std::vector<DeviceDType> RouterDTypeList(DeviceType type) {
    if (type == DeviceType::kCPU) {
        return {{Device::CPU(), DType::kFloat32}, {Device::CPU(), DType::kFloat64}};
    }
    return {{Gpu(), DType::kFloat32}};
}
auto RouterCases(DeviceType type) { return ::testing::ValuesIn(RouterDTypeList(type)); }

class MoERouterTest : public DeviceTest<> {
protected:
    struct Result {
        Tensor weights, indices, counts, aux, z;
    };
    Result Run(const Tensor &logits, const MoERouterConfig &c) const {
        const std::int64_t tokens = logits.size(0);
        Result r{Poison({tokens, c.topk}, dtype()), Tensor::Full({tokens, c.topk}, 77, DType::kInt64, device()),
                 Tensor::Full({c.num_experts}, 77, DType::kInt64, device()), Poison({}, dtype()), Poison({}, dtype())};
        kernels::MoERouterForward({.logits = logits,
                                   .config = c,
                                   .weights = r.weights,
                                   .indices = r.indices,
                                   .tokens_per_expert = r.counts,
                                   .aux_loss = &r.aux,
                                   .z_loss = &r.z});
        return r;
    }
    /// CUDA computes in fp32 with its own exp: a few roundings.
    double Roundings() const { return OnCuda(16); }

    void ExpectRouterMatches(std::int64_t tokens, const MoERouterConfig &c, std::uint64_t seed) {
        SCOPED_TRACE(::testing::Message() << "T " << tokens << " E " << c.num_experts << " topk " << c.topk
                                          << (c.score_function == MoEScoreFunction::kSigmoid ? " sigmoid" : " softmax")
                                          << " normalize " << c.normalize_topk);
        const Tensor logits = Random({tokens, c.num_experts}, dtype(), seed, "logits", 2.0);
        const Tensor dw = Random({tokens, c.topk}, dtype(), seed, "dweights");
        const Tensor daux = Tensor::Full({}, 0.7, dtype(), device());
        const Tensor dz = Tensor::Full({}, -1.3, dtype(), device());
        const Result r = Run(logits, c);
        const RefRouting want = RefRouter(logits.ToDoubleVector(), tokens, c, dw.ToDoubleVector(), 0.7, -1.3);
        EXPECT_EQ(r.indices.ToDoubleVector(), want.indices);
        EXPECT_EQ(r.counts.ToDoubleVector(), want.counts);
        EXPECT_TRUE(ValuesMatch(r.weights, want.weights, dtype(), Roundings())) << "weights";
        EXPECT_TRUE(ValuesMatch(r.aux, {want.aux}, dtype(), Roundings())) << "aux loss";
        EXPECT_TRUE(ValuesMatch(r.z, {want.z}, dtype(), Roundings())) << "z loss";
        Tensor dlogits = Poison(logits.shape(), dtype());
        kernels::MoERouterBackward({.logits = logits,
                                    .config = c,
                                    .indices = r.indices,
                                    .tokens_per_expert = r.counts,
                                    .dweights = &dw,
                                    .daux_loss = &daux,
                                    .dz_loss = &dz,
                                    .dlogits = dlogits});
        EXPECT_TRUE(ValuesMatch(dlogits, want.dlogits, dtype(), Roundings())) << "dlogits";
        // Bitwise determinism: a second run gives the same bits.
        const Result again = Run(logits, c);
        EXPECT_EQ(HostBytes(again.weights), HostBytes(r.weights));
        EXPECT_EQ(HostBytes(again.aux), HostBytes(r.aux));
        EXPECT_EQ(HostBytes(again.z), HostBytes(r.z));
        Tensor dlogits2 = Poison(logits.shape(), dtype());
        kernels::MoERouterBackward({.logits = logits,
                                    .config = c,
                                    .indices = r.indices,
                                    .tokens_per_expert = r.counts,
                                    .dweights = &dw,
                                    .daux_loss = &daux,
                                    .dz_loss = &dz,
                                    .dlogits = dlogits2});
        EXPECT_EQ(HostBytes(dlogits2), HostBytes(dlogits));
    }
};

TEST_P(MoERouterTest, SoftmaxTopkMatchesTheReference) {
    for (const auto &[tokens, experts, topk] : std::vector<std::tuple<int, int, int>>{
             {1, 1, 1}, {7, 4, 1}, {7, 4, 2}, {33, 8, 2}, {64, 16, 4}, {130, 64, 8}, {40, 256, 8}, {5, 3, 3}}) {
        for (const bool normalize : {true, false}) {
            ExpectRouterMatches(tokens,
                                {.num_experts = experts,
                                 .topk = topk,
                                 .normalize_topk = normalize,
                                 .aux_loss_coeff = 0.01,
                                 .z_loss_coeff = 0.001},
                                static_cast<std::uint64_t>(tokens * 1000 + experts));
        }
    }
}

TEST_P(MoERouterTest, SigmoidTopkMatchesTheReference) {
    for (const auto &[tokens, experts, topk] :
         std::vector<std::tuple<int, int, int>>{{7, 4, 1}, {33, 8, 2}, {64, 16, 4}, {40, 256, 8}}) {
        for (const bool normalize : {true, false}) {
            ExpectRouterMatches(tokens,
                                {.num_experts = experts,
                                 .topk = topk,
                                 .score_function = MoEScoreFunction::kSigmoid,
                                 .normalize_topk = normalize,
                                 .aux_loss_coeff = 0.02,
                                 .z_loss_coeff = 0.003},
                                static_cast<std::uint64_t>(tokens * 77 + experts));
        }
    }
}

TEST_P(MoERouterTest, TiesGoToTheLowerExpertId) {
    // Row 0: all equal; row 1: [1, 3, 3, 2, 3]; row 2: [5, 5, -1, 5, 0] → (0, 1, 3); row 3: two equal maxima last.
    const Tensor logits = OnDevice({0, 0, 0, 0, 0, 1, 3, 3, 2, 3, 5, 5, -1, 5, 0, -2, -1, 0, 4, 4}, {4, 5}, dtype());
    const Result r = Run(logits, {.num_experts = 5, .topk = 3});
    EXPECT_EQ(r.indices.ToDoubleVector(), (Values{0, 1, 2, 1, 2, 4, 0, 1, 3, 3, 4, 2}));
    EXPECT_EQ(r.counts.ToDoubleVector(), (Values{2, 3, 3, 2, 2}));
    // Equal logits give equal weights: row 0 three thirds.
    const Values w = r.weights.ToDoubleVector();
    EXPECT_NEAR(w[0], 1.0 / 3.0, 1e-6);
    EXPECT_EQ(w[0], w[1]);
    EXPECT_EQ(w[1], w[2]);
}

TEST_P(MoERouterTest, AllTokensOnOneExpertGiveTheLargestAuxLoss) {
    // Expert 2's logit dominates every row: f = (0, 0, 1, 0), P_2 ≈ 1 → aux ≈ coeff·E.
    const std::int64_t tokens = 16;
    Values l(tokens * 4, 0.0);
    for (std::int64_t t = 0; t < tokens; ++t) {
        l[t * 4 + 2] = 30.0;
    }
    const Result r = Run(OnDevice(l, {tokens, 4}, dtype()), {.num_experts = 4, .topk = 1, .aux_loss_coeff = 0.5});
    EXPECT_EQ(r.counts.ToDoubleVector(), (Values{0, 0, 16, 0}));
    EXPECT_NEAR(r.aux.ToDoubleVector()[0], 0.5 * 4, 1e-5);
    EXPECT_EQ(r.weights.ToDoubleVector(), Values(tokens, 1.0)) << "topk 1 renormalised: weight 1";
}

TEST_P(MoERouterTest, NoTokensGiveZeroCountsAndLosses) {
    const Result r = Run(Tensor::Empty({0, 6}, dtype(), device()),
                         {.num_experts = 6, .topk = 2, .aux_loss_coeff = 0.1, .z_loss_coeff = 0.1});
    EXPECT_EQ(r.counts.ToDoubleVector(), Values(6, 0.0));
    EXPECT_EQ(r.aux.ToDoubleVector(), Values{0.0});
    EXPECT_EQ(r.z.ToDoubleVector(), Values{0.0});
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(MoERouterTest, RouterCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// The permutation map (int64 only: one case per device).

class MoEPermuteTest : public DeviceTest<> {
protected:
    Tensor Ids(const Shape &shape, std::int64_t experts, std::uint64_t seed) const {
        return RandomTensor(shape, DType::kInt64, device(), seed, "ids", RandomDistribution::kInteger, 0,
                            static_cast<double>(experts - 1));
    }
    /// row_map and group sizes from the kernel, checked against the reference.
    std::pair<Tensor, Tensor> Map(const Tensor &ids, int experts, std::int64_t capacity) const {
        Tensor row_map = Tensor::Full(ids.shape(), 77, DType::kInt64, device());
        Tensor sizes = Tensor::Full({experts}, 77, DType::kInt64, device());
        kernels::MoEPermuteMap(
            {.indices = ids, .num_experts = experts, .capacity = capacity, .row_map = row_map, .group_sizes = sizes});
        Values want_map, want_sizes;
        RefPermuteMap(ids.ToDoubleVector(), experts, capacity, &want_map, &want_sizes);
        EXPECT_EQ(row_map.ToDoubleVector(), want_map) << "capacity " << capacity;
        EXPECT_EQ(sizes.ToDoubleVector(), want_sizes) << "capacity " << capacity;
        return {row_map, sizes};
    }
};

std::vector<DeviceDType> PermuteMapDTypeList(DeviceType type) {
    return {{type == DeviceType::kCPU ? Device::CPU() : Gpu(), DType::kInt64}};
}
auto PermuteMapCases(DeviceType type) { return ::testing::ValuesIn(PermuteMapDTypeList(type)); }

TEST_P(MoEPermuteTest, MapIsTheStableExpertOrder) {
    for (const auto &[tokens, topk, experts] : std::vector<std::tuple<int, int, int>>{
             {1, 1, 1}, {9, 2, 4}, {100, 1, 7}, {257, 2, 16}, {1000, 8, 256}, {5000, 2, 64}, {3, 2, 40}}) {
        SCOPED_TRACE(::testing::Message() << "T " << tokens << " topk " << topk << " E " << experts);
        const Tensor ids = Ids({tokens, topk}, experts, static_cast<std::uint64_t>(tokens + experts));
        for (const std::int64_t capacity : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1},
                                            std::int64_t{tokens * topk / experts}, std::int64_t{tokens * topk}}) {
            Map(ids, experts, capacity);
        }
    }
}

TEST_P(MoEPermuteTest, ZeroTokenExpertsAndAllOnOneExpert) {
    // Experts 0, 2 and 5 get nothing; then every copy on expert 3.
    const Tensor ids = OnDevice({1, 3, 4, 1, 3, 3, 4, 1}, {4, 2}, DType::kInt64);
    const auto [map, sizes] = Map(ids, 6, -1);
    EXPECT_EQ(sizes.ToDoubleVector(), (Values{0, 3, 0, 3, 2, 0}));
    EXPECT_EQ(map.ToDoubleVector(), (Values{0, 3, 6, 1, 4, 5, 7, 2}));
    const Tensor one = OnDevice(Values(12, 3.0), {6, 2}, DType::kInt64);
    const auto [map1, sizes1] = Map(one, 5, -1);
    EXPECT_EQ(sizes1.ToDoubleVector(), (Values{0, 0, 0, 12, 0}));
    const auto [map2, sizes2] = Map(one, 5, 5);
    EXPECT_EQ(map2.ToDoubleVector(), (Values{0, 1, 2, 3, 4, -1, -1, -1, -1, -1, -1, -1})) << "capacity 5 keeps 5";
}

TEST_P(MoEPermuteTest, MapIsDeterministic) {
    const Tensor ids = Ids({4096, 2}, 32, 5);
    const auto [a, sa] = Map(ids, 32, 200);
    const auto [b, sb] = Map(ids, 32, 200);
    EXPECT_EQ(HostBytes(a), HostBytes(b));
    EXPECT_EQ(HostBytes(sa), HostBytes(sb));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(MoEPermuteTest, PermuteMapCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// The gather, the combine and the combine's weight gradient: every float dtype of the device.

class MoERowsTest : public DeviceTest<> {
protected:
    struct Routing {
        Tensor row_map;
        std::int64_t rows = 0;
        Values map;
    };
    /// A routing of T tokens × topk over E experts with the given capacity, from the map kernel.
    Routing Route(std::int64_t tokens, std::int64_t topk, int experts, std::int64_t capacity,
                  std::uint64_t seed) const {
        const Tensor ids = RandomTensor({tokens, topk}, DType::kInt64, device(), seed, "ids",
                                        RandomDistribution::kInteger, 0, experts - 1);
        Routing r;
        r.row_map = Tensor::Empty({tokens, topk}, DType::kInt64, device());
        Tensor sizes = Tensor::Empty({experts}, DType::kInt64, device());
        kernels::MoEPermuteMap(
            {.indices = ids, .num_experts = experts, .capacity = capacity, .row_map = r.row_map, .group_sizes = sizes});
        r.map = r.row_map.ToDoubleVector();
        for (double s : sizes.ToDoubleVector()) {
            r.rows += static_cast<std::int64_t>(s);
        }
        return r;
    }
};

struct RowsCase {
    std::int64_t tokens, topk, hidden;
    int experts;
    std::int64_t capacity;
};
const std::vector<RowsCase> kRowsCases = {{1, 1, 1, 1, -1},     {9, 2, 5, 4, -1},       {33, 2, 64, 8, 5},
                                          {64, 4, 130, 16, -1}, {200, 8, 1000, 32, 40}, {17, 1, 8, 3, 2}};

TEST_P(MoERowsTest, GatherCopiesOrScalesEachKeptCopy) {
    for (const RowsCase &c : kRowsCases) {
        SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " topk " << c.topk << " H " << c.hidden << " E "
                                          << c.experts << " capacity " << c.capacity);
        const Routing r = Route(c.tokens, c.topk, c.experts, c.capacity, 3);
        const Tensor x = Random({c.tokens, c.hidden}, dtype(), 4, "x");
        const Tensor w = Random({c.tokens, c.topk}, DType::kFloat32, 4, "w");
        const Values xv = x.ToDoubleVector(), wv = w.ToDoubleVector();
        Values copy(static_cast<std::size_t>(r.rows * c.hidden)), scaled(copy.size());
        for (std::int64_t i = 0; i < c.tokens * c.topk; ++i) {
            const auto row = static_cast<std::int64_t>(r.map[i]);
            for (std::int64_t h = 0; row >= 0 && h < c.hidden; ++h) {
                copy[row * c.hidden + h] = xv[(i / c.topk) * c.hidden + h];
                scaled[row * c.hidden + h] = wv[i] * xv[(i / c.topk) * c.hidden + h];
            }
        }
        Tensor out = Poison({r.rows, c.hidden}, dtype());
        kernels::MoEPermuteRows({.x = x, .row_map = r.row_map, .out = out});
        EXPECT_EQ(out.ToDoubleVector(), copy) << "a gather is a copy: bit-exact";
        Tensor out_w = Poison({r.rows, c.hidden}, dtype());
        kernels::MoEPermuteRows({.x = x, .row_map = r.row_map, .weights = &w, .out = out_w});
        EXPECT_TRUE(ValuesMatch(out_w, scaled, dtype())) << "scaled gather";
        Tensor again = Poison({r.rows, c.hidden}, dtype());
        kernels::MoEPermuteRows({.x = x, .row_map = r.row_map, .weights = &w, .out = again});
        EXPECT_EQ(HostBytes(again), HostBytes(out_w));
    }
}

TEST_P(MoERowsTest, CombineSumsTheWeightedCopiesInSlotOrder) {
    for (const RowsCase &c : kRowsCases) {
        SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " topk " << c.topk << " H " << c.hidden << " E "
                                          << c.experts << " capacity " << c.capacity);
        const Routing r = Route(c.tokens, c.topk, c.experts, c.capacity, 7);
        const Tensor tokens = Random({r.rows, c.hidden}, dtype(), 8, "tokens");
        const Tensor w = Random({c.tokens, c.topk}, DType::kFloat32, 8, "w");
        const Values tv = tokens.ToDoubleVector(), wv = w.ToDoubleVector();
        Values weighted(static_cast<std::size_t>(c.tokens * c.hidden), 0.0), plain(weighted.size(), 0.0);
        for (std::int64_t i = 0; i < c.tokens * c.topk; ++i) {
            const auto row = static_cast<std::int64_t>(r.map[i]);
            for (std::int64_t h = 0; row >= 0 && h < c.hidden; ++h) {
                weighted[(i / c.topk) * c.hidden + h] += wv[i] * tv[row * c.hidden + h];
                plain[(i / c.topk) * c.hidden + h] += tv[row * c.hidden + h];
            }
        }
        // fp32 accumulation of topk terms, one rounding to the dtype.
        const double roundings = OnCuda(static_cast<double>(c.topk) + 1);
        Tensor y = Poison({c.tokens, c.hidden}, dtype());
        kernels::MoEUnpermuteRows({.tokens = tokens, .row_map = r.row_map, .weights = &w, .y = y});
        EXPECT_TRUE(ValuesMatch(y, weighted, dtype(), roundings)) << "weighted combine";
        Tensor y_plain = Poison({c.tokens, c.hidden}, dtype());
        kernels::MoEUnpermuteRows({.tokens = tokens, .row_map = r.row_map, .y = y_plain});
        EXPECT_TRUE(ValuesMatch(y_plain, plain, dtype(), roundings)) << "unweighted combine (Permute's backward)";
        Tensor again = Poison({c.tokens, c.hidden}, dtype());
        kernels::MoEUnpermuteRows({.tokens = tokens, .row_map = r.row_map, .weights = &w, .y = again});
        EXPECT_EQ(HostBytes(again), HostBytes(y));
    }
}

TEST_P(MoERowsTest, WeightsGradIsTheDotOfEachCopyWithItsTokensGradient) {
    for (const RowsCase &c : kRowsCases) {
        SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " topk " << c.topk << " H " << c.hidden << " E "
                                          << c.experts << " capacity " << c.capacity);
        const Routing r = Route(c.tokens, c.topk, c.experts, c.capacity, 11);
        const Tensor tokens = Random({r.rows, c.hidden}, dtype(), 12, "tokens");
        const Tensor dy = Random({c.tokens, c.hidden}, dtype(), 12, "dy");
        const Values tv = tokens.ToDoubleVector(), dv = dy.ToDoubleVector();
        Values want(static_cast<std::size_t>(c.tokens * c.topk), 0.0);
        for (std::int64_t i = 0; i < c.tokens * c.topk; ++i) {
            const auto row = static_cast<std::int64_t>(r.map[i]);
            for (std::int64_t h = 0; row >= 0 && h < c.hidden; ++h) {
                want[i] += dv[(i / c.topk) * c.hidden + h] * tv[row * c.hidden + h];
            }
        }
        Tensor dw = Poison({c.tokens, c.topk}, DType::kFloat32);
        kernels::MoEUnpermuteWeightsGrad({.dy = dy, .tokens = tokens, .row_map = r.row_map, .dweights = dw});
        // An fp32 sum of H products (the inputs are exact in fp32): about log2(H) roundings on CUDA's tree.
        EXPECT_TRUE(ValuesMatch(dw, want, DType::kFloat32, OnCuda(16))) << "dweights";
        Tensor again = Poison({c.tokens, c.topk}, DType::kFloat32);
        kernels::MoEUnpermuteWeightsGrad({.dy = dy, .tokens = tokens, .row_map = r.row_map, .dweights = again});
        EXPECT_EQ(HostBytes(again), HostBytes(dw));
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(MoERowsTest, DeviceCases, DeviceDTypeName);

} // namespace
} // namespace shardline::testing
