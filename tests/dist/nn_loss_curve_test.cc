// A 20-step SGD run of ParallelMLP gives the loss curve of the same model trained densely on one process, for every
// TP size (fp32, rtol 1e-5). Every rank builds the same data from one seed and also trains the dense reference
// (nn::Linear layers on local Variables, whose global weights the counter-based RNG makes identical to the parallel
// ones); the model is scored by cross-entropy of its output against fixed labels, so the loss falls as it fits them.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/nn/optim.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

constexpr int kSteps = 20;
constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kFfn = 32; // divides by 1, 2, 4
constexpr std::uint64_t kSeed = 7;
constexpr double kRtol = 1e-5;
const nn::SgdOptions kSgd{.lr = 0.2, .momentum = 0.9};

/// The fixed batch: x [8, 16, hidden] normal(0, 1), labels [8, 16] in [0, hidden) (128 rows: too many to memorise in
/// 20 steps, so the loss stays O(1) and its relative error meaningful).
struct Batch {
    Tensor x;
    Tensor labels;
};

Batch MakeBatch() {
    Batch b;
    b.x = Tensor::Empty({8, 16, kHidden}, DType::kFloat32, TestDevice());
    FillRandom(b.x, RandomSpec{.seed = kSeed, .name = "loss_curve.x"});
    Tensor classes = Tensor::Empty({8, 16}, DType::kFloat64);
    FillRandom(classes, RandomSpec{.seed = kSeed,
                                   .name = "loss_curve.labels",
                                   .distribution = RandomDistribution::kInteger,
                                   .a = 0,
                                   .b = static_cast<double>(kHidden - 1)});
    b.labels = Tensor::FromVector(classes.ToDoubleVector(), {8, 16}, DType::kInt64).To(TestDevice());
    return b;
}

nn::ParallelMLPOptions MlpOptions() { return {.hidden = kHidden, .ffn_hidden = kFfn, .bias = true}; }

nn::ParameterOptions MlpParam() { return {.device = TestDevice(), .seed = kSeed, .name = "mlp"}; }

double Scalar(const Variable &loss) { return loss.value().FullTensor().ToDoubleVector().at(0); }

/// The dense model: fc1 (hidden -> ffn), GELU, fc2 (ffn -> hidden), named as ParallelMLP names its layers so that the
/// RNG gives the same global weights.
struct DenseMlp {
    nn::Linear fc1{{.in_features = kHidden, .out_features = kFfn},
                   {.device = TestDevice(), .seed = kSeed, .name = "mlp.fc1"}};
    nn::Linear fc2{{.in_features = kFfn, .out_features = kHidden},
                   {.device = TestDevice(), .seed = kSeed, .name = "mlp.fc2"}};
    std::vector<Variable> Parameters() const {
        std::vector<Variable> p = fc1.Parameters();
        for (const Variable &v : fc2.Parameters()) {
            p.push_back(v);
        }
        return p;
    }
    Variable Forward(const Variable &x) const { return fc2.Forward(autograd::Gelu(fc1.Forward(x))); }
};

/// kSteps of SGD on cross-entropy(model(x), labels): the loss of each step.
template <class Model> std::vector<double> Train(Model &model, const Variable &x, const Variable &labels) {
    nn::SGD sgd(model.Parameters(), kSgd);
    std::vector<double> curve;
    for (int step = 0; step < kSteps; ++step) {
        sgd.ZeroGrad();
        Variable loss = autograd::CrossEntropy(model.Forward(x), labels);
        loss.Backward();
        sgd.Step();
        curve.push_back(Scalar(loss));
    }
    return curve;
}

std::vector<double> TrainDense(const Batch &batch, DenseMlp &model) {
    return Train(model, Variable(batch.x), Variable(batch.labels));
}

std::vector<double> TrainParallel(const Batch &batch, nn::ParallelMLP &model, DeviceMesh &mesh) {
    return Train(model, Variable(DistTensor::FromFull(batch.x, spmd::Layout::Replicated(3), mesh)),
                 Variable(DistTensor::FromFull(batch.labels, spmd::Layout::Replicated(2), mesh)));
}

/// |got - want| <= rtol·|want| step by step.
::testing::AssertionResult SameCurve(const std::vector<double> &got, const std::vector<double> &want) {
    if (got.size() != want.size()) {
        return ::testing::AssertionFailure() << got.size() << " steps != expected " << want.size();
    }
    for (std::size_t i = 0; i < got.size(); ++i) {
        if (!(std::abs(got[i] - want[i]) <= kRtol * std::abs(want[i]))) {
            return ::testing::AssertionFailure()
                   << fmt::format("step {}: loss {:.9g} != dense {:.9g} (rel. diff {:.3g})", i, got[i], want[i],
                                  std::abs(got[i] - want[i]) / want[i]);
        }
    }
    return ::testing::AssertionSuccess();
}

/// Trained parameters agree within rtol·max(|want|, rms(want)) (20 steps of fp32 rounding in different orders).
::testing::AssertionResult SameParameter(const Tensor &got, const Tensor &want, double rtol) {
    if (got.shape() != want.shape()) {
        return ::testing::AssertionFailure() << ShapeToString(got.shape()) << " != " << ShapeToString(want.shape());
    }
    const std::vector<double> g = got.ToDoubleVector();
    const std::vector<double> w = want.ToDoubleVector();
    double rms = 0.0;
    for (double v : w) {
        rms += v * v;
    }
    rms = std::sqrt(rms / static_cast<double>(std::max<std::size_t>(1, w.size())));
    for (std::size_t i = 0; i < g.size(); ++i) {
        if (!(std::abs(g[i] - w[i]) <= rtol * std::max(std::abs(w[i]), rms))) {
            return ::testing::AssertionFailure() << "element " << i << ": " << g[i] << " != " << w[i];
        }
    }
    return ::testing::AssertionSuccess();
}

void ExpectSameParameters(nn::ParallelMLP &model, const DenseMlp &dense) {
    EXPECT_TRUE(SameParameter(model.fc1->weight.value().FullTensor(), dense.fc1.weight.local(), 1e-4));
    EXPECT_TRUE(SameParameter(model.fc1->bias.value().FullTensor(), dense.fc1.bias.local(), 1e-4));
    EXPECT_TRUE(SameParameter(model.fc2->weight.value().FullTensor(), dense.fc2.weight.local(), 1e-4));
    EXPECT_TRUE(SameParameter(model.fc2->bias.value().FullTensor(), dense.fc2.bias.local(), 1e-4));
}

TEST(ParallelMLPLossCurveTest, TwentySgdStepsFollowTheDenseCurve) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    nn::ParallelMLP model(MlpOptions(), nn::TensorParallelGroup::Named(mesh, "tp"), MlpParam());
    DenseMlp dense;
    // The RNG makes the global weights a function of (seed, name, index): identical to the dense ones at any TP.
    ASSERT_TRUE(SameValues(model.fc1->weight.value().FullTensor(), dense.fc1.weight.local()));
    ASSERT_TRUE(SameValues(model.fc1->bias.value().FullTensor(), dense.fc1.bias.local()));
    ASSERT_TRUE(SameValues(model.fc2->weight.value().FullTensor(), dense.fc2.weight.local()));
    ASSERT_TRUE(SameValues(model.fc2->bias.value().FullTensor(), dense.fc2.bias.local()));

    const Batch batch = MakeBatch();
    const std::vector<double> parallel = TrainParallel(batch, model, mesh);
    const std::vector<double> reference = TrainDense(batch, dense);
    if (World().rank() == 0) {
        std::printf("ParallelMLP(hidden %lld, ffn %lld) SGD lr %g momentum %g, TP %d vs dense:\n",
                    static_cast<long long>(kHidden), static_cast<long long>(kFfn), kSgd.lr, kSgd.momentum, w);
        std::printf("  step  loss (TP %d)   loss (dense)   rel. diff\n", w);
        for (int i = 0; i < kSteps; ++i) {
            std::printf("  %4d  %.9f    %.9f    %.2e\n", i, parallel[static_cast<std::size_t>(i)],
                        reference[static_cast<std::size_t>(i)],
                        std::abs(parallel[static_cast<std::size_t>(i)] - reference[static_cast<std::size_t>(i)]) /
                            reference[static_cast<std::size_t>(i)]);
        }
        std::fflush(stdout);
    }
    EXPECT_TRUE(SameCurve(parallel, reference));
    ExpectSameParameters(model, dense);
    // The run trains: the loss falls at every step, by a fifth or more over the run.
    for (int i = 1; i < kSteps; ++i) {
        EXPECT_LT(parallel[static_cast<std::size_t>(i)], parallel[static_cast<std::size_t>(i - 1)]) << "step " << i;
    }
    EXPECT_LT(parallel.back(), 0.8 * parallel.front());
}

TEST(ParallelMLPLossCurveTest, EveryTpSizeOfTheJobGivesTheSameCurve) {
    // TP t for every t dividing the world, in one job: a {world/t, t} mesh whose first dim only replicates, so each
    // replica trains the model with TP t (tp on mesh dim 1 of a 2-D mesh for t < world).
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    const Batch batch = MakeBatch();
    DenseMlp dense;
    const std::vector<double> reference = TrainDense(batch, dense);
    std::vector<std::pair<int, std::vector<double>>> curves;
    for (int t = 1; t <= w; ++t) {
        if (w % t != 0) {
            continue;
        }
        SCOPED_TRACE(fmt::format("TP {}", t));
        DeviceMesh mesh(World(), {w / t, t}, {"replica", "tp"});
        nn::ParallelMLP model(MlpOptions(), nn::TensorParallelGroup::Named(mesh, "tp"), MlpParam());
        curves.emplace_back(t, TrainParallel(batch, model, mesh));
        EXPECT_TRUE(SameCurve(curves.back().second, reference));
        ExpectSameParameters(model, dense);
    }
    if (World().rank() == 0) {
        std::string header = "  step";
        for (const auto &[t, curve] : curves) {
            header += fmt::format("  loss (TP {})  ", t);
        }
        std::printf("%s  loss (dense)\n", header.c_str());
        for (int i = 0; i < kSteps; ++i) {
            std::string line = fmt::format("  {:4d}", i);
            for (const auto &[t, curve] : curves) {
                line += fmt::format("  {:.9f}   ", curve[static_cast<std::size_t>(i)]);
            }
            std::printf("%s  %.9f\n", line.c_str(), reference[static_cast<std::size_t>(i)]);
        }
        std::fflush(stdout);
    }
}

} // namespace
} // namespace shardline
