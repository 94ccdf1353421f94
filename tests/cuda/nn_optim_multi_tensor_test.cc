// nn::AdamW and nn::SGD on CUDA parameters of every dtype in one optimizer (bf16 and fp16 with fp32 masters and main
// grads, fp32): a step is one multi-tensor kernel call whose entries are the main grads themselves (no per-step cast)
// and the parameters' own tensors as model copies, and its result is bit for bit the single-tensor kernels run on
// each parameter with the same state.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/ops.h>
#include <shardline/kernels/optim.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/optim.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using autograd::Variable;
using dist::DistTensor;

constexpr std::string_view kCounting = "cuda-optim-counting";

/// What the last Multi call got, entry by entry.
struct MultiEntry {
    const void *grad = nullptr;
    DType grad_dtype = DType::kFloat32;
    const void *model = nullptr;
    std::int64_t step = 0;
    bool first_step = false;
};
struct Calls {
    int single = 0; ///< SgdStep / AdamWStep
    int multi = 0;  ///< SgdStepMulti / AdamWStepMulti
    std::vector<MultiEntry> entries;
};
Calls g_calls;
kernels::SgdStepOp::Fn g_sgd = nullptr;
kernels::SgdStepMultiOp::Fn g_sgd_multi = nullptr;
kernels::AdamWStepOp::Fn g_adamw = nullptr;
kernels::AdamWStepMultiOp::Fn g_adamw_multi = nullptr;

void CountSgd(const kernels::SgdStepArgs &args) {
    ++g_calls.single;
    g_sgd(args);
}
void CountAdamW(const kernels::AdamWStepArgs &args) {
    ++g_calls.single;
    g_adamw(args);
}
template <class Tensors> void Record(const Tensors &tensors) {
    ++g_calls.multi;
    g_calls.entries.clear();
    for (const auto &t : tensors) {
        MultiEntry e{.grad = t.grad.data(),
                     .grad_dtype = t.grad.dtype(),
                     .model = t.model_param != nullptr ? t.model_param->data() : nullptr};
        if constexpr (requires { t.step; }) {
            e.step = t.step;
        } else {
            e.first_step = t.first_step;
        }
        g_calls.entries.push_back(e);
    }
}
void CountSgdMulti(const kernels::SgdStepMultiArgs &args) {
    Record(args.tensors);
    g_sgd_multi(args);
}
void CountAdamWMulti(const kernels::AdamWStepMultiArgs &args) {
    Record(args.tensors);
    g_adamw_multi(args);
}

/// The optimizer ops on CUDA through counting wrappers around the default kernels.
class OptimizerMultiTensorTest : public CudaTest {
protected:
    void SetUp() override {
        CudaTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        constexpr DeviceType kCuda = DeviceType::kCUDA;
        g_sgd = kernels::OpTable<kernels::SgdStepOp>::Resolve(kCuda).fn;
        g_sgd_multi = kernels::OpTable<kernels::SgdStepMultiOp>::Resolve(kCuda).fn;
        g_adamw = kernels::OpTable<kernels::AdamWStepOp>::Resolve(kCuda).fn;
        g_adamw_multi = kernels::OpTable<kernels::AdamWStepMultiOp>::Resolve(kCuda).fn;
        kernels::Register<kernels::SgdStepOp>(kCuda, kCounting, &CountSgd);
        kernels::Register<kernels::SgdStepMultiOp>(kCuda, kCounting, &CountSgdMulti);
        kernels::Register<kernels::AdamWStepOp>(kCuda, kCounting, &CountAdamW);
        kernels::Register<kernels::AdamWStepMultiOp>(kCuda, kCounting, &CountAdamWMulti);
        for (const std::string_view op : {kernels::SgdStepOp::kName, kernels::SgdStepMultiOp::kName,
                                          kernels::AdamWStepOp::kName, kernels::AdamWStepMultiOp::kName}) {
            kernels::SetOpProvider(op, kCounting);
        }
        g_calls = {};
    }
    void TearDown() override {
        kernels::UnregisterProviderEverywhere(kCounting);
        CudaTest::TearDown();
    }

    /// bf16, fp16 and fp32 layers of odd sizes on the GPU.
    using Layers = std::vector<std::unique_ptr<nn::Linear>>;
    static Layers MakeLayers() {
        Layers layers;
        layers.push_back(std::make_unique<nn::Linear>(
            nn::LinearOptions{.in_features = 67, .out_features = 33},
            nn::ParameterOptions{.dtype = DType::kBFloat16, .device = Gpu(), .seed = 3, .name = "a"}));
        layers.push_back(std::make_unique<nn::Linear>(
            nn::LinearOptions{.in_features = 16, .out_features = 9},
            nn::ParameterOptions{.dtype = DType::kFloat16, .device = Gpu(), .seed = 4, .name = "b"}));
        layers.push_back(std::make_unique<nn::Linear>(
            nn::LinearOptions{.in_features = 9, .out_features = 5},
            nn::ParameterOptions{.dtype = DType::kFloat32, .device = Gpu(), .seed = 5, .name = "c"}));
        return layers;
    }
    static std::vector<Variable> ParametersOf(const Layers &layers) {
        std::vector<Variable> params;
        for (const auto &layer : layers) {
            for (const Variable &p : layer->Parameters()) {
                params.push_back(p);
            }
        }
        return params;
    }
    /// Backpropagates gelu(x·Wᵀ + b) of each layer with random x and output gradient.
    static void Backpropagate(const Layers &layers, int step) {
        for (std::size_t i = 0; i < layers.size(); ++i) {
            const nn::Linear &layer = *layers[i];
            const Shape &w = layer.weight.shape();
            const DType dtype = layer.weight.dtype();
            const auto seed = static_cast<std::uint64_t>(100 * step + i);
            Variable x(RandomGpu({6, w[1]}, dtype, seed, "x"));
            Variable y = autograd::Gelu(layer.Forward(x));
            const DistTensor dy = DistTensor::Local(RandomGpu({6, w[0]}, dtype, seed, "dy"));
            y.Backward(&dy);
        }
    }
};

/// The per-parameter reference: the optimizer's state, kept by hand and updated with the single-tensor kernels.
struct RefSlot {
    Tensor master;
    Tensor state0;
    Tensor state1;
    Tensor model; ///< defined for half parameters
    std::int64_t step = 0;
};
std::vector<RefSlot> RefSlots(const std::vector<Variable> &params) {
    std::vector<RefSlot> refs;
    for (const Variable &p : params) {
        const bool half = IsHalf(p.dtype());
        RefSlot r{.master = half ? p.local().To(DType::kFloat32) : p.local().Clone(),
                  .state0 = Tensor::Zeros(p.local().shape(), DType::kFloat32, Gpu()),
                  .state1 = Tensor::Zeros(p.local().shape(), DType::kFloat32, Gpu()),
                  .model = half ? p.local().Clone() : Tensor()};
        refs.push_back(std::move(r));
    }
    return refs;
}

/// The step's Multi call took every parameter with a gradient: its main grad itself (fp32, no cast) and, for a half
/// parameter, its own tensor as the model copy.
void ExpectEntriesAreTheParametersOwnTensors(const std::vector<Variable> &params, const std::vector<bool> &updated) {
    std::size_t k = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
        if (!updated[i]) {
            continue;
        }
        ASSERT_LT(k, g_calls.entries.size());
        const MultiEntry &e = g_calls.entries[k++];
        EXPECT_EQ(e.grad, params[i].grad().local().data()) << params[i].name() << ": the gradient was copied";
        EXPECT_EQ(e.grad_dtype, DType::kFloat32) << params[i].name();
        EXPECT_EQ(e.model, IsHalf(params[i].dtype()) ? params[i].local().data() : nullptr) << params[i].name();
    }
    EXPECT_EQ(k, g_calls.entries.size());
}

::testing::AssertionResult SameBits(const Tensor &a, const Tensor &b) {
    if (HostBytes(a) == HostBytes(b)) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << a.ToString() << " and " << b.ToString() << " differ";
}

TEST_F(OptimizerMultiTensorTest, AdamWOverMixedDTypesIsOneCallAndMatchesThePerParameterKernels) {
    const Layers layers = MakeLayers();
    const std::vector<Variable> params = ParametersOf(layers);
    nn::AdamW adamw(params, {.lr = 1e-2, .weight_decay = 0.05});
    std::vector<RefSlot> refs = RefSlots(params);
    for (int step = 0; step < 4; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        // The fp32 bias (no main grad) has no gradient in step 1; half parameters always have their main grad.
        layers[2]->bias.set_requires_grad(step != 1);
        adamw.ZeroGrad();
        Backpropagate(layers, step);
        std::vector<bool> updated;
        for (const Variable &p : params) {
            updated.push_back(p.grad().defined());
        }
        g_calls.single = 0; // the reference below calls the single-tensor kernels
        adamw.Step();
        EXPECT_EQ(g_calls.multi, step + 1);
        EXPECT_EQ(g_calls.single, 0);
        ExpectEntriesAreTheParametersOwnTensors(params, updated);
        std::size_t entry = 0;
        for (std::size_t i = 0; i < params.size(); ++i) {
            if (!updated[i]) {
                continue;
            }
            RefSlot &r = refs[i];
            kernels::AdamWStep({.param = r.master,
                                .grad = params[i].grad().local(),
                                .exp_avg = r.state0,
                                .exp_avg_sq = r.state1,
                                .lr = 1e-2,
                                .weight_decay = 0.05,
                                .step = ++r.step,
                                .model_param = r.model.defined() ? &r.model : nullptr});
            ASSERT_LT(entry, g_calls.entries.size());
            EXPECT_EQ(g_calls.entries[entry++].step, r.step) << params[i].name() << ": its own step count";
            EXPECT_TRUE(SameBits(params[i].local(), r.model.defined() ? r.model : r.master)) << params[i].name();
        }
    }
    EXPECT_GT(AbsSum(params[0].local().ToDoubleVector()), 0.0);
}

TEST_F(OptimizerMultiTensorTest, SgdOverMixedDTypesIsOneCallAndMatchesThePerParameterKernels) {
    const Layers layers = MakeLayers();
    const std::vector<Variable> params = ParametersOf(layers);
    nn::SGD sgd(params, {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
    std::vector<RefSlot> refs = RefSlots(params);
    for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        layers[2]->bias.set_requires_grad(step >= 1); // its buffer starts at step 1
        sgd.ZeroGrad();
        Backpropagate(layers, step);
        std::vector<bool> updated;
        for (const Variable &p : params) {
            updated.push_back(p.grad().defined());
        }
        g_calls.single = 0;
        sgd.Step();
        EXPECT_EQ(g_calls.multi, step + 1);
        EXPECT_EQ(g_calls.single, 0);
        ExpectEntriesAreTheParametersOwnTensors(params, updated);
        for (std::size_t i = 0; i < params.size(); ++i) {
            if (!updated[i]) {
                continue;
            }
            RefSlot &r = refs[i];
            kernels::SgdStep({.param = r.master,
                              .grad = params[i].grad().local(),
                              .momentum_buffer = &r.state0,
                              .lr = 0.05,
                              .momentum = 0.9,
                              .weight_decay = 0.01,
                              .nesterov = true,
                              .first_step = r.step++ == 0,
                              .model_param = r.model.defined() ? &r.model : nullptr});
            EXPECT_TRUE(SameBits(params[i].local(), r.model.defined() ? r.model : r.master)) << params[i].name();
        }
    }
}

} // namespace
} // namespace shardline::testing
