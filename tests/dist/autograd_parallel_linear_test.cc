// autograd::ColumnParallelLinear / RowParallelLinear called directly (below the nn modules): what the autograd layer
// decides on top of the functional core. An input in another layout is moved to the layer's (and its gradient moved
// back); parameter gradients are Partial over the mesh dims sharding the rows and the engine reduces them when no
// GradSync defers it; main grads take the gradient straight from the kernel (alone or beside a plain one); bad input
// raises on every rank before any collective; Add, BiasAdd and Mean keep no operand's memory, and Add's backward moves
// no saved operand; a saved spec of the wrong shape raises before any collective. Integer data (|x| <= 8, K <= 16):
// every fp32 sum is exact, so the gathered results are compared bitwise with the float64 dense reference. CPU/MPI at np
// 1, 2, 4.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>

#include "dist_tensor_test_util.h"
#include "reference.h"

namespace shardline {
namespace {

using namespace dist_test;
using dist::ShardOn;
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using testing::Values;

constexpr std::int64_t kSeq = 8;
constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kRows = kSeq * kBatch;
constexpr std::int64_t kIn = 16;
constexpr std::int64_t kOut = 8; ///< divides by 1, 2 and 4

/// Exactly equal values, shape first.
::testing::AssertionResult Exactly(const Tensor &got, const Shape &shape, const Values &want) {
    if (got.shape() != shape) {
        return ::testing::AssertionFailure()
               << "shape " << ShapeToString(got.shape()) << ", expected " << ShapeToString(shape);
    }
    const Values g = got.ToDoubleVector();
    for (std::size_t i = 0; i < g.size(); ++i) {
        if (g[i] != want[i]) {
            return ::testing::AssertionFailure() << "element " << i << " is " << g[i] << ", expected " << want[i];
        }
    }
    return ::testing::AssertionSuccess();
}

Values Times(Values v, double factor) {
    for (double &e : v) {
        e *= factor;
    }
    return v;
}

void ResetCounts(DeviceMesh &mesh) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
}

std::int64_t Calls(DeviceMesh &mesh, std::string_view dim, CollectiveKind kind) {
    return mesh.group(dim).Counts().Calls(kind);
}

std::int64_t AllCalls(DeviceMesh &mesh, std::string_view dim) { return mesh.group(dim).Counts().TotalCalls(); }

/// The column layer's parameters as leaves on `mesh`: W [kOut, kIn] split on dim 0 over tp, b [kOut] likewise.
struct ColumnParams {
    Tensor w_full = RandomFull({kOut, kIn}, "w");
    Tensor b_full = RandomFull({kOut}, "b");
    Variable w, b;
    explicit ColumnParams(DeviceMesh &mesh)
        : w(DistTensor::Sharded(w_full, mesh, {{.dim = 0, .over = {"tp"}}}), true),
          b(DistTensor::Sharded(b_full, mesh, {{.dim = 0, .over = {"tp"}}}), true) {}
};

/// The dense float64 answers of y = x·Wᵀ + b for x [kSeq, kBatch, kIn] and dy.
struct Dense {
    Values y, dx, dw, db;
};
Dense DenseOf(const Tensor &x, const ColumnParams &p, const Tensor &dy) {
    const Values xv = x.ToDoubleVector();
    const Values wv = p.w_full.ToDoubleVector();
    const Values bv = p.b_full.ToDoubleVector();
    const Values dyv = dy.ToDoubleVector();
    return {.y = testing::RefLinearForward(xv, wv, &bv, kRows, kOut, kIn),
            .dx = testing::RefLinearBackwardInput(dyv, wv, kRows, kOut, kIn),
            .dw = testing::RefLinearBackwardWeight(dyv, xv, kRows, kOut, kIn),
            .db = testing::RefColumnSum(dyv, kRows, kOut)};
}

TEST(AutogradParallelLinearTest, ColumnInputInAnotherLayoutIsMovedThereAndItsGradientBack) {
    // x arrives split on the sequence over tp but the layer is not sequence parallel: the input is all-gathered
    // (autograd::Redistribute), the layer runs on the replicated input, and dx (an all-reduce of tp partial sums)
    // returns to x's layout by a local slice.
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    ColumnParams p(mesh);
    const Tensor x_full = RandomFull({kSeq, kBatch, kIn}, "x");
    const Tensor dy_full = RandomFull({kSeq, kBatch, kOut}, "dy");
    Variable x(DistTensor::Sharded(x_full, mesh, {{.dim = 0, .over = {"tp"}}}), true);

    ResetCounts(mesh);
    Variable y = autograd::ColumnParallelLinear(x, p.w, p.b, {.in_features = kIn, .out_features = kOut}, tp);
    EXPECT_EQ(Calls(mesh, "tp", CollectiveKind::kAllGather), w > 1 ? 1 : 0) << "x all-gathered once";
    EXPECT_EQ(AllCalls(mesh, "tp"), w > 1 ? 1 : 0);
    EXPECT_EQ(y.value().layout(), dist::ShardedLayout(mesh, 3, {{.dim = -1, .over = {"tp"}}}));

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    EXPECT_EQ(Calls(mesh, "tp", CollectiveKind::kAllReduce), w > 1 ? 1 : 0) << "dx all-reduced, then sliced";
    EXPECT_EQ(AllCalls(mesh, "tp"), w > 1 ? 1 : 0);
    EXPECT_EQ(x.grad().layout(), x.value().layout()) << "dx returns to x's layout";

    const Dense d = DenseOf(x_full, p, dy_full);
    EXPECT_TRUE(Exactly(y.value().FullTensor(), {kSeq, kBatch, kOut}, d.y)) << "y";
    EXPECT_TRUE(Exactly(x.grad().FullTensor(), {kSeq, kBatch, kIn}, d.dx)) << "dx";
    EXPECT_TRUE(Exactly(p.w.grad().FullTensor(), {kOut, kIn}, d.dw)) << "dW";
    EXPECT_TRUE(Exactly(p.b.grad().FullTensor(), {kOut}, d.db)) << "db";
}

TEST(AutogradParallelLinearTest, ParameterGradientsArePartialOverDpAndTheEngineReducesThemWithoutAGradSync) {
    // A dp×tp mesh, the batch split over dp, no GradSync: each dp replica sums dW and db over its own rows, the
    // gradients leave the Function Partial over dp, and the engine all-reduces each of them over dp once.
    const int w = World().size();
    const std::int64_t dp = w >= 2 ? 2 : 1;
    DeviceMesh mesh(World(), {dp, w / dp}, {"dp", "tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    ColumnParams p(mesh);
    const Tensor x_full = RandomFull({kSeq, kBatch, kIn}, "x");
    const Tensor dy_full = RandomFull({kSeq, kBatch, kOut}, "dy");
    Variable x(DistTensor::Sharded(x_full, mesh, {{.dim = 1, .over = {"dp"}}}), false);

    Variable y = autograd::ColumnParallelLinear(x, p.w, p.b, {.in_features = kIn, .out_features = kOut}, tp);
    EXPECT_EQ(y.value().layout(),
              dist::ShardedLayout(mesh, 3, {{.dim = 1, .over = {"dp"}}, {.dim = 2, .over = {"tp"}}}));
    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    EXPECT_EQ(Calls(mesh, "dp", CollectiveKind::kAllReduce), dp > 1 ? 2 : 0) << "one per parameter gradient";
    EXPECT_EQ(AllCalls(mesh, "dp"), dp > 1 ? 2 : 0);
    EXPECT_EQ(AllCalls(mesh, "tp"), 0) << "x needs no grad: nothing over tp";
    EXPECT_FALSE(p.w.grad().layout().IsPartial()) << p.w.grad().ToString();

    const Dense d = DenseOf(x_full, p, dy_full);
    EXPECT_TRUE(Exactly(y.value().FullTensor(), {kSeq, kBatch, kOut}, d.y)) << "y";
    EXPECT_TRUE(Exactly(p.w.grad().FullTensor(), {kOut, kIn}, d.dw)) << "dW over the whole batch";
    EXPECT_TRUE(Exactly(p.b.grad().FullTensor(), {kOut}, d.db)) << "db over the whole batch";
}

TEST(AutogradParallelLinearTest, MainGradsTakeTheGradientStraightFromTheKernelBesideAPlainOne) {
    // W has an fp32 main grad, b has none: dW accumulates into the main grad across two backward passes (the kernel
    // runs with beta = 1), db is returned as a plain gradient and summed by the engine.
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    ColumnParams p(mesh);
    p.w.AllocateMainGrad();
    const Tensor main_grad = p.w.impl()->main_grad;
    const Tensor x_full = RandomFull({kSeq, kBatch, kIn}, "x");
    const Tensor dy_full = RandomFull({kSeq, kBatch, kOut}, "dy");
    Variable x(DistTensor::Replicated(x_full, mesh), false);
    for (int pass = 0; pass < 2; ++pass) {
        Variable y = autograd::ColumnParallelLinear(x, p.w, p.b, {.in_features = kIn, .out_features = kOut}, tp);
        const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
        y.Backward(&dy);
    }
    const Dense d = DenseOf(x_full, p, dy_full);
    EXPECT_EQ(p.w.grad().local().data(), main_grad.data()) << "dW lives in the main grad";
    EXPECT_TRUE(Exactly(p.w.grad().FullTensor(), {kOut, kIn}, Times(d.dw, 2.0))) << "dW accumulated twice";
    EXPECT_TRUE(Exactly(p.b.grad().FullTensor(), {kOut}, Times(d.db, 2.0))) << "db summed twice";
}

TEST(AutogradParallelLinearTest, SkipBiasAddLeavesTheBiasOutOfTheLayerAndWithoutAGradient) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    Tensor w_full = RandomFull({kIn, kOut}, "w_row");
    Variable weight(DistTensor::Sharded(w_full, mesh, {{.dim = 1, .over = {"tp"}}}), true);
    Variable bias(DistTensor::Replicated(RandomFull({kIn}, "b_row"), mesh), true);
    const Tensor x_full = RandomFull({kSeq, kBatch, kOut}, "x_row");
    Variable x(DistTensor::Sharded(x_full, mesh, {{.dim = -1, .over = {"tp"}}}), false);
    Variable y = autograd::RowParallelLinear(
        x, weight, bias, {.in_features = kOut, .out_features = kIn, .input_is_parallel = true, .skip_bias_add = true},
        tp);
    const DistTensor ones =
        DistTensor::Replicated(Tensor::Full({kSeq, kBatch, kIn}, 1.0, DType::kFloat32, dist_test::TestDevice()), mesh);
    y.Backward(&ones);
    const Values want =
        testing::RefLinearForward(x_full.ToDoubleVector(), w_full.ToDoubleVector(), nullptr, kRows, kIn, kOut);
    EXPECT_TRUE(Exactly(y.value().FullTensor(), {kSeq, kBatch, kIn}, want)) << "y without the bias";
    EXPECT_TRUE(weight.grad().defined());
    EXPECT_FALSE(bias.grad().defined()) << "the caller adds the bias: it gets its gradient there";
}

// Add, BiasAdd and Mean read no operand value in backward, so their nodes keep only the operands' specs: no operand's
// storage is held by the graph, and Add's backward moves no saved operand (Partial ones included), only dy. Gathered
// gradients equal the dense answers.
TEST(AutogradParallelLinearTest, AddBiasAddAndMeanKeepSpecsOnly) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const Tensor a_full = RandomFull({kRows, kOut}, "add_a");
    const Tensor b_full = RandomFull({kRows, kOut}, "add_b");
    const Tensor x_full = RandomFull({kRows, kOut}, "bias_x");
    const Tensor bias_full = RandomFull({kOut}, "bias_b");
    const Tensor dy_full = RandomFull({kRows, kOut}, "add_dy");
    // Partial operands of two reduce ops (reductions left pending): the add rule keeps no Partial it cannot add, so
    // its grad rule asks for both replicated: two all-reduces of values the backward never reads (before it
    // took specs, it ran them).
    Variable a(DistTensor::FromFull(a_full, ParsePlacements("P(sum)", 2), mesh), true);
    Variable b(DistTensor::FromFull(b_full, ParsePlacements("P(avg)", 2), mesh), true);
    Variable x(DistTensor::Sharded(x_full, mesh, {{.dim = 0, .over = {"tp"}}}), true);
    Variable bias(DistTensor::Replicated(bias_full, mesh), true);
    Variable m(DistTensor::Sharded(x_full, mesh, {{.dim = 0, .over = {"tp"}}}), true);
    const Tensor &a_local = a.value().local();
    const Tensor &b_local = b.value().local();
    const Tensor &x_local = x.value().local();
    const Tensor &bias_local = bias.value().local();
    const Tensor &m_local = m.value().local();
    const long a_before = a_local.storage().use_count();
    const long b_before = b_local.storage().use_count();
    const long x_before = x_local.storage().use_count();
    const long bias_before = bias_local.storage().use_count();
    const long m_before = m_local.storage().use_count();

    Variable sum = autograd::Add(a, b, 0.5);
    Variable shifted = autograd::BiasAdd(x, bias);
    Variable mean = autograd::Mean(m, {0});
    EXPECT_EQ(a_local.storage().use_count(), a_before) << "a kept by Add";
    EXPECT_EQ(b_local.storage().use_count(), b_before) << "b kept by Add";
    EXPECT_EQ(x_local.storage().use_count(), x_before) << "x kept by BiasAdd";
    EXPECT_EQ(bias_local.storage().use_count(), bias_before) << "bias kept by BiasAdd";
    EXPECT_EQ(m_local.storage().use_count(), m_before) << "m kept by Mean";

    // dy replicated, as sum's value is: each operand's gradient goes back to its Partial layout locally.
    EXPECT_EQ(sum.value().layout(), ParsePlacements("R", 2));
    ResetCounts(mesh);
    const DistTensor dy_sum = DistTensor::Replicated(dy_full, mesh);
    sum.Backward(&dy_sum);
    EXPECT_EQ(AllCalls(mesh, "tp"), 0) << "Add's backward moved a saved operand";
    const Values dy = dy_full.ToDoubleVector();
    EXPECT_TRUE(Exactly(a.grad().FullTensor(), {kRows, kOut}, dy)) << "da = dy";
    EXPECT_TRUE(Exactly(b.grad().FullTensor(), {kRows, kOut}, Times(dy, 0.5))) << "db = 0.5·dy";

    const DistTensor dy_shifted = DistTensor::FromFull(dy_full, shifted.value().layout(), mesh);
    shifted.Backward(&dy_shifted);
    EXPECT_TRUE(Exactly(x.grad().FullTensor(), {kRows, kOut}, dy)) << "dx = dy";
    EXPECT_TRUE(Exactly(bias.grad().FullTensor(), {kOut}, testing::RefColumnSum(dy, kRows, kOut)))
        << "dbias = Σ_rows dy";

    const Tensor dmean_full = RandomFull({kOut}, "mean_dy");
    const DistTensor dmean = DistTensor::FromFull(dmean_full, mean.value().layout(), mesh);
    mean.Backward(&dmean);
    Values want(static_cast<std::size_t>(kRows * kOut));
    const Values dm = dmean_full.ToDoubleVector();
    for (std::size_t i = 0; i < want.size(); ++i) {
        want[i] = dm[i % static_cast<std::size_t>(kOut)] / static_cast<double>(kRows); // kRows = 16: exact
    }
    EXPECT_TRUE(Exactly(m.grad().FullTensor(), {kRows, kOut}, want)) << "dm = dy / rows, broadcast";
}

/// The message of the Error `call` raises, and that it raised on every rank before any collective on `mesh`.
template <class F> std::string ErrorOnEveryRank(DeviceMesh &mesh, F &&call) {
    ResetCounts(mesh);
    std::string message = "<no error>";
    try {
        call();
    } catch (const Error &e) {
        message = e.what();
    }
    for (int d = 0; d < mesh.ndim(); ++d) {
        EXPECT_EQ(mesh.group(d).Counts().TotalCalls(), 0) << "a collective ran before the error";
    }
    return message;
}

TEST(AutogradParallelLinearTest, UnevenSequenceShardsRaiseOnEveryRankBeforeAnyCollective) {
    const int w = World().size();
    if (w == 1) {
        GTEST_SKIP() << "one rank: every sequence length divides";
    }
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    ColumnParams p(mesh);
    const std::int64_t seq = 4 * w + 1;
    Variable x(DistTensor::Replicated(RandomFull({seq, kIn}, "x_odd"), mesh), true);
    const std::string message = ErrorOnEveryRank(mesh, [&] {
        autograd::ColumnParallelLinear(x, p.w, p.b,
                                       {.in_features = kIn, .out_features = kOut, .sequence_parallel = true}, tp);
    });
    for (const std::string part : {std::string("autograd::ColumnParallelLinear"), std::string("sequence_parallel"),
                                   fmt::format("({})", seq), fmt::format("{} ranks", w)}) {
        EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
    }
}

TEST(AutogradParallelLinearTest, AWeightInTheWrongLayoutRaisesNamingItBeforeAnyCollective) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const TensorParallelGroup tp = TensorParallelGroup::Named(mesh, "tp");
    // A row layer's weight (split on in_features) given to a column layer.
    Variable weight(DistTensor::Sharded(RandomFull({kOut, kIn}, "w"), mesh, {{.dim = 1, .over = {"tp"}}}), true);
    Variable x(DistTensor::Replicated(RandomFull({kSeq, kIn}, "x"), mesh), true);
    const std::string message = ErrorOnEveryRank(mesh, [&] {
        autograd::ColumnParallelLinear(x, weight, Variable(), {.in_features = kIn, .out_features = kOut, .bias = false},
                                       tp);
    });
    if (w == 1) {
        EXPECT_EQ(message, "<no error>") << "on one rank every layout is the same";
        return;
    }
    for (const std::string part : {"autograd::ColumnParallelLinear", "weight must have layout"}) {
        EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
    }
}

TEST(AutogradParallelLinearTest, AGradientOffTheRootsMeshRaisesNamingTheRoot) {
    // A local root takes a local gradient, a root on a mesh one on that mesh; the engine says so before any node runs.
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    Variable local_x(RandomFull({kSeq, kIn}, "x_local"), true);
    Variable local_y = autograd::Scale(local_x, 2.0);
    const DistTensor on_mesh = DistTensor::Replicated(RandomFull({kSeq, kIn}, "g_mesh"), mesh);
    const std::string local_message = ErrorOnEveryRank(mesh, [&] { local_y.Backward(&on_mesh); });
    for (const std::string part : {"autograd::Backward", "root 0", "local, as the root is"}) {
        EXPECT_NE(local_message.find(part), std::string::npos) << "'" << part << "' missing from: " << local_message;
    }
    EXPECT_FALSE(local_x.grad().defined());

    Variable mesh_x(DistTensor::Replicated(RandomFull({kSeq, kIn}, "x_mesh"), mesh), true);
    Variable mesh_y = autograd::Scale(mesh_x, 2.0);
    const DistTensor local_g = DistTensor::Local(RandomFull({kSeq, kIn}, "g_local"));
    const std::string mesh_message = ErrorOnEveryRank(mesh, [&] { mesh_y.Backward(&local_g); });
    EXPECT_NE(mesh_message.find("on the root's mesh"), std::string::npos) << mesh_message;
    EXPECT_FALSE(mesh_x.grad().defined());

    // The right gradients still flow: d(2x)/dx = 2 on both.
    const DistTensor local_ones = DistTensor::Local(Tensor::Full({kSeq, kIn}, 1.0, DType::kFloat32));
    local_y.Backward(&local_ones);
    EXPECT_EQ(local_x.grad().local().ToDoubleVector(), Values(static_cast<std::size_t>(kSeq * kIn), 2.0));
}

// The grad ops take the forward operands' specs from the caller: one of the wrong shape (not the forward's) raises a
// ShapeError naming the op and the shapes on every rank, before any collective.
TEST(AutogradParallelLinearTest, ASavedSpecOfTheWrongShapeRaisesBeforeAnyCollective) {
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const DistTensor dout =
        DistTensor::Sharded(RandomFull({kRows, kOut}, "spec_dout"), mesh, {{.dim = 0, .over = {"tp"}}});
    const spmd::TensorSpec right = dout.spec();
    const spmd::TensorSpec wrong{.shape = {kRows, kOut + 1}, .layout = right.layout};
    const spmd::TensorSpec bias = DistTensor::Replicated(RandomFull({kOut}, "spec_bias"), mesh).spec();
    const spmd::TensorSpec wrong_bias = DistTensor::Replicated(RandomFull({kOut + 1}, "spec_bias2"), mesh).spec();

    const std::string add = ErrorOnEveryRank(
        mesh, [&] { dist::AddBackward({.dout = dout, .a = right, .b = wrong, .need_a = true, .need_b = true}); });
    for (const std::string_view part :
         {"dist::AddBackward", "the saved spec of b has shape [16, 9], but dout has [16, 8]"}) {
        EXPECT_NE(add.find(part), std::string::npos) << "'" << part << "' missing from: " << add;
    }
    const std::string x_message = ErrorOnEveryRank(mesh, [&] { dist::BiasAddBackward(dout, wrong, bias); });
    EXPECT_NE(x_message.find("dist::BiasAddBackward: the saved spec of x has shape [16, 9]"), std::string::npos)
        << x_message;
    const std::string bias_message = ErrorOnEveryRank(mesh, [&] { dist::BiasAddBackward(dout, right, wrong_bias); });
    EXPECT_NE(bias_message.find("the saved spec of bias has shape [9], but x's last dim is 8"), std::string::npos)
        << bias_message;

    // The right specs give the gradients: da = dy, and db = Σ_rows dy.
    const std::vector<dist::Grad> grads =
        dist::AddBackward({.dout = dout, .a = right, .b = right, .need_a = true, .need_b = false});
    EXPECT_TRUE(grads[0].value.defined());
    EXPECT_FALSE(grads[1].defined());
    EXPECT_TRUE(Exactly(grads[0].value.FullTensor(), {kRows, kOut}, dout.FullTensor().ToDoubleVector()));
    const dist::Grad db = dist::BiasAddBackward(dout, right, bias);
    EXPECT_TRUE(
        Exactly(db.value.FullTensor(), {kOut}, testing::RefColumnSum(dout.FullTensor().ToDoubleVector(), kRows, kOut)));
}

} // namespace
} // namespace shardline
