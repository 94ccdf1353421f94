// MoE checkpoints (issues 16/17): an nn::MoEMLP with its AdamW state (nn::TrainingTensors, as the char-LM example
// saves them) saved on one (dp, ep, tp) mesh of the world and loaded on every other — ep 2 -> 1, 1 -> 2, ep 2 × tp 2 ->
// ep 4, dp changing with them (dp = world / (ep·tp)), and at tp 2 etp = tp <-> etp 1 (the experts split over tp or
// whole on every tp rank). The loaded parameters and moments, gathered, equal the saved full
// tensors bitwise; the training steps after it on the new mesh give the outputs of the same steps on the save mesh
// and the state after them within rtol 1e-5 (the router's and the reductions' sums run in another order on another
// mesh). No auxiliary loss: Megatron's is per rank (f and P of this rank's tokens, averaged over the data-parallel
// ranks), so its value and gradient depend on the number of data-parallel ranks, which changes with the mesh.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/ckpt/checkpoint.h>
#include <shardline/nn/checkpoint.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/moe.h>
#include <shardline/nn/optim.h>

#include "ckpt_test_util.h"
#include "moe_test_util.h"

namespace shardline {
namespace {

using namespace moe_test;

constexpr std::int64_t kT = 16; ///< global tokens
constexpr std::int64_t kH = 8;
constexpr std::int64_t kF = 8;
constexpr std::int64_t kE = 4;

using Full = std::map<std::string, std::vector<double>>;

/// A mesh shape and the experts' tensor parallelism on it (etp = tp, or 1 with whole experts).
struct Layer {
    std::int64_t ep = 1;
    std::int64_t tp = 1;
    std::int64_t etp = 1;
};

std::string MeshName(const Layer &l) {
    return fmt::format("dp{}_ep{}_tp{}_etp{}", World().size() / (l.ep * l.tp), l.ep, l.tp, l.etp);
}

/// Every (ep, tp) of the world with etp = tp, and with etp 1 where tp > 1.
std::vector<Layer> Layers() {
    std::vector<Layer> layers;
    for (const auto &[ep, tp] : MeshShapes()) {
        layers.push_back({.ep = ep, .tp = tp, .etp = tp});
        if (tp > 1) {
            layers.push_back({.ep = ep, .tp = tp, .etp = 1});
        }
    }
    return layers;
}

/// The layer (dropless, no aux loss: see above), GradSync (when there is more than one data-parallel rank, as in the
/// char-LM example) and AdamW on the (dp, ep, tp) mesh of the world. `seed` sets the initial values (a load must
/// overwrite all of them).
struct MoeTrainer {
    MoeTrainer(const Layer &l, std::uint64_t seed)
        : mesh(MoeMesh(l.ep, l.tp)),
          layer({.hidden = kH, .ffn = kF, .num_experts = kE, .topk = 2, .ep = l.ep, .etp = l.etp}, mesh,
                {.dtype = DType::kFloat32, .device = TestDevice(), .seed = seed, .name = "moe"}),
          params(layer.Parameters()),
          // The ranks with different tokens: dp·ep, and tp too at etp 1 (whose parameters then reduce over it).
          sync(World().size() / l.etp > 1
                   ? std::make_unique<nn::GradSync>(params, mesh,
                                                    nn::GradSyncOptions{.dp_dim = "dp",
                                                                        .dp_dims = {"dp", "ep"},
                                                                        .extra_dp_dims = layer.ExtraDataParallelDims()})
                   : nullptr),
          optimizer(params, {.lr = 0.01, .weight_decay = 0.01}) {}

    /// One training step on batch `step` (x sharded over dp and ep, loss = Σ y·v for a fixed v);
    /// returns the output, full.
    std::vector<double> Step(int step) {
        if (sync) {
            sync->ZeroGrad();
        } else {
            optimizer.ZeroGrad();
        }
        const Tensor x_full = MakeFull({kT, kH}, fmt::format("ckpt_moe.x{}", step), Data::kRandom, DType::kFloat32, 5);
        const Tensor v_full = MakeFull({kH, 1}, fmt::format("ckpt_moe.v{}", step), Data::kRandom, DType::kFloat32, 5);
        const Variable x(DistTensor::Sharded(x_full, mesh, {{.dim = 0, .over = {"dp", "ep"}}}), false);
        const Variable v(DistTensor::Replicated(v_full, mesh), false);
        const nn::MoEOutput out = layer.Forward(x);
        autograd::Sum(autograd::Matmul(out.output, v)).Backward(); // every row of y gets the gradient v

        if (sync) {
            sync->Finish();
        }
        optimizer.Step();
        return out.output.value().FullTensor().ToDoubleVector();
    }

    ckpt::TensorList Tensors() { return nn::TrainingTensors(params, &optimizer); }

    /// Every checkpoint tensor (parameters and moments), gathered.
    Full Gather() {
        Full full;
        for (const auto &[name, tensor] : Tensors()) {
            full[name] = tensor.FullTensor().ToDoubleVector();
        }
        return full;
    }

    DeviceMesh &mesh;
    nn::MoEMLP layer;
    std::vector<Variable> params;
    std::unique_ptr<nn::GradSync> sync;
    nn::AdamW optimizer;
};

/// |got - want| <= rtol·max(|want_i|, 1 % of the tensor's largest entry) elementwise.
::testing::AssertionResult Close(const std::vector<double> &got, const std::vector<double> &want, double rtol) {
    if (got.size() != want.size()) {
        return ::testing::AssertionFailure() << got.size() << " values, " << want.size() << " expected";
    }
    double largest = 0.0;
    for (double w : want) {
        largest = std::max(largest, std::abs(w));
    }
    for (std::size_t i = 0; i < got.size(); ++i) {
        const double scale = std::max(std::abs(want[i]), 0.01 * largest);
        if (std::abs(got[i] - want[i]) > rtol * scale) {
            return ::testing::AssertionFailure() << "index " << i << ": " << got[i] << " vs " << want[i];
        }
    }
    return ::testing::AssertionSuccess();
}

TEST(MoECheckpointTest, ResumesOnEveryOtherExpertAndTensorParallelMesh) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = ckpt_test::SharedTempDir("moe");
    const std::vector<Layer> layers = Layers();
    for (const Layer &saved_on : layers) {
        const std::string root = dir + "/" + MeshName(saved_on);
        Full saved, after;
        std::vector<double> y2, y3;
        nlohmann::json scalars;
        {
            MoeTrainer a(saved_on, 3);
            a.Step(1);
            scalars = nn::OptimizerScalars(a.optimizer);
            ckpt::Save(root, 1, a.Tensors(), {{"optimizer", scalars}}, &World());
            saved = a.Gather();
            y2 = a.Step(2);
            after = a.Gather();
            y3 = a.Step(3);
        }
        ASSERT_EQ(saved.size(), 15u) << "5 parameters, each with exp_avg and exp_avg_sq";
        for (const Layer &loaded_on : layers) {
            SCOPED_TRACE(fmt::format("saved on {}, loaded on {}", MeshName(saved_on), MeshName(loaded_on)));
            MoeTrainer b(loaded_on, 11); // other initial values, zero moments
            const ckpt::CheckpointInfo info = ckpt::Load(root, b.Tensors(), &World());
            nn::LoadOptimizerScalars(b.optimizer, info.extra.at("optimizer"));
            const Full loaded = b.Gather();
            ASSERT_EQ(loaded.size(), saved.size());
            for (const auto &[name, want] : saved) {
                EXPECT_EQ(loaded.at(name), want) << name << " gathered after the load (bitwise)";
            }
            EXPECT_TRUE(Close(b.Step(2), y2, 1e-5)) << "step 2's output";
            const Full got = b.Gather();
            for (const auto &[name, want] : after) {
                EXPECT_TRUE(Close(got.at(name), want, 1e-5)) << name << " after step 2";
            }
            EXPECT_TRUE(Close(b.Step(3), y3, 1e-5)) << "step 3's output";
        }
    }
}

} // namespace
} // namespace shardline
