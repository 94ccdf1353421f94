// Expert parallelism's token exchange (autograd/moe_dispatch.h) over the ep group of (dp, ep, tp) meshes: every rank
// routes uneven, partly empty per-expert row counts; each rank checks, exactly, that it receives every peer's rows of
// its local experts in the documented order (expert-major, then source-rank-major, then the source's order), that the
// combine returns its own rows bitwise, that the backward of each is the other's forward, and the exact all-to-all
// counts (none at ep = 1). LocalPart keeps no reference to its input, and its gradient returns as the input's shard.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe_dispatch.h>
#include <shardline/core/error.h>

#include "moe_test_util.h"

namespace shardline {
namespace {

using namespace moe_test;

constexpr std::int64_t kExperts = 4;
constexpr std::int64_t kH = 3;

/// The rows source ep rank `r` routes to expert e: uneven, with zeros (expert (r + 1) % E gets none).
std::int64_t Count(std::int64_t r, std::int64_t e) { return e == (r + 1) % kExperts ? 0 : (r * 3 + e * 5) % 4 + 1; }

std::vector<std::int64_t> Counts(std::int64_t r) {
    std::vector<std::int64_t> c;
    for (std::int64_t e = 0; e < kExperts; ++e) {
        c.push_back(Count(r, e));
    }
    return c;
}

/// Row i (in expert order) of source r, column c: a value naming all three, exact in float32.
double RowValue(std::int64_t r, std::int64_t i, std::int64_t c) { return static_cast<double>(r * 1000 + i * 4 + c); }

Tensor SourceRows(std::int64_t r) {
    std::int64_t rows = 0;
    for (std::int64_t n : Counts(r)) {
        rows += n;
    }
    std::vector<double> v;
    for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t c = 0; c < kH; ++c) {
            v.push_back(RowValue(r, i, c));
        }
    }
    return Tensor::FromVector(v, Shape{rows, kH}, DType::kFloat32).To(TestDevice());
}

/// What ep rank q must hold after the dispatch: for each local expert, each source's rows of it, sources in order.
std::vector<double> ExpectedReceived(std::int64_t q, std::int64_t ep) {
    const std::int64_t le = kExperts / ep;
    std::vector<double> v;
    for (std::int64_t l = 0; l < le; ++l) {
        const std::int64_t e = q * le + l;
        for (std::int64_t r = 0; r < ep; ++r) {
            std::int64_t first = 0;
            for (std::int64_t x = 0; x < e; ++x) {
                first += Count(r, x);
            }
            for (std::int64_t i = first; i < first + Count(r, e); ++i) {
                for (std::int64_t c = 0; c < kH; ++c) {
                    v.push_back(RowValue(r, i, c));
                }
            }
        }
    }
    return v;
}

class ExpertExchangeTest : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(ExpertExchangeTest, DispatchDeliversEveryPeersRowsInExpertThenSourceOrderAndCombineReturnsThemBitwise) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::int64_t ep = GetParam();
    if (World().size() % ep != 0) {
        GTEST_SKIP() << "ep " << ep << " does not divide the world";
    }
    DeviceMesh &mesh = MoeMesh(ep, 1);
    comm::Communicator *group = ep > 1 ? &mesh.group("ep") : nullptr;
    const std::int64_t q = mesh.coordinate()[1];
    ResetCounts(mesh);

    const autograd::ExpertExchangePlan plan = autograd::PlanExpertExchange(Counts(q), group);
    ExpectAllToAll(mesh, ep > 1 ? 1 : 0, 0, "the counts");
    std::vector<std::int64_t> want_sizes(static_cast<std::size_t>(kExperts / ep), 0);
    for (std::int64_t l = 0; l < kExperts / ep; ++l) {
        for (std::int64_t r = 0; r < ep; ++r) {
            want_sizes[static_cast<std::size_t>(l)] += Count(r, q * (kExperts / ep) + l);
        }
    }
    EXPECT_EQ(plan.local_group_sizes, want_sizes);

    autograd::Variable rows(SourceRows(q), true);
    ResetCounts(mesh);
    autograd::Variable received = autograd::ExpertDispatch(rows, plan, group);
    ExpectAllToAll(mesh, ep > 1 ? 1 : 0, 0, "dispatch forward");
    EXPECT_EQ(received.local().ToDoubleVector(), ExpectedReceived(q, ep));

    // Scale the received rows by 2 so the gradient differs from the value: the combine brings them back, doubled.
    autograd::Variable back = autograd::ExpertCombine(autograd::Scale(received, 2.0), plan, group);
    ExpectAllToAll(mesh, ep > 1 ? 2 : 0, 0, "dispatch + combine forward");
    std::vector<double> want_back = SourceRows(q).ToDoubleVector();
    for (double &v : want_back) {
        v *= 2.0;
    }
    EXPECT_EQ(back.local().ToDoubleVector(), want_back);

    // d back / d rows = 2: the backward of the combine is the dispatch, and the dispatch's the combine.
    ResetCounts(mesh);
    const Tensor dy_tensor = SourceRows(q);
    const dist::DistTensor dy = dist::DistTensor::Local(dy_tensor);
    back.Backward(&dy);
    ExpectAllToAll(mesh, ep > 1 ? 2 : 0, 0, "backward");
    EXPECT_EQ(rows.grad().local().ToDoubleVector(), want_back);
}

INSTANTIATE_TEST_SUITE_P(Ep, ExpertExchangeTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<std::int64_t> &info) {
                             return fmt::format("ep{}", info.param);
                         });

TEST(ExpertExchangeErrorTest, ExpertsNotDivisibleByEpAreRefusedBeforeAnyCollective) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs two ranks";
    }
    DeviceMesh &mesh = MoeMesh(2, 1);
    ResetCounts(mesh);
    std::string message = "threw nothing";
    try {
        autograd::PlanExpertExchange({1, 2, 3}, &mesh.group("ep"));
    } catch (const Error &e) {
        message = e.what();
    }
    EXPECT_NE(message.find("ExpertExchange: the number of experts (3) must be positive and divisible by the "
                           "expert-parallel size (2)"),
              std::string::npos)
        << message;
    ExpectAllToAll(mesh, 0, 0, "a refused exchange");
}

// LocalPart's node keeps x's shapes, layout and mesh, not x: while its output (a view of x's shard) lives, x's storage
// has that one more holder, and none once it is gone. The gradient goes back as x's shard in x's layout; gathered, it
// is the full dy.
TEST(LocalPartTest, KeepsNoReferenceToTheInputAndSendsTheGradientBackAsItsShard) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::int64_t w = World().size();
    DeviceMesh &mesh = MoeMesh(w, 1);
    const std::vector<dist::ShardOn> on_ep = {{.dim = 0, .over = {"ep"}}};
    const Tensor x_full = RandomFull({4 * w, 2, kH}, "local_part_x");
    const Tensor dy_full = RandomFull({4 * w, 2, kH}, "local_part_dy");
    Variable x(DistTensor::Sharded(x_full, mesh, on_ep), true);
    const Tensor &x_local = x.value().local();
    const long before = x_local.storage().use_count();
    {
        Variable y = autograd::LocalPart(x, {8, kH});
        EXPECT_TRUE(y.value().is_local());
        EXPECT_EQ(x_local.storage().use_count(), before + 1) << "the output's view, and nothing the node keeps";
        EXPECT_EQ(y.value().local().ToDoubleVector(), x_local.ToDoubleVector());
        const DistTensor dy = DistTensor::Local(DistTensor::Sharded(dy_full, mesh, on_ep).local().View({8, kH}));
        y.Backward(&dy);
    }
    EXPECT_EQ(x_local.storage().use_count(), before);
    EXPECT_EQ(x.grad().layout(), x.value().layout());
    EXPECT_EQ(x.grad().global_shape(), (Shape{4 * w, 2, kH}));
    EXPECT_EQ(x.grad().FullTensor().ToDoubleVector(), dy_full.ToDoubleVector());
}

} // namespace
} // namespace shardline
