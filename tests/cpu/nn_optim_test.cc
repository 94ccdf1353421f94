// SGD and AdamW on nn::Linear parameters over several steps, against a float64 re-implementation of torch.optim's
// formulas fed with the gradients the optimizer saw. Each step's gradients come from a real backward
// (gelu(x·Wᵀ + b) with a random output gradient), so they change with the parameters. A counting kernel provider shows
// that a step is one multi-tensor kernel call over the gradients themselves, with each parameter's own step count.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/ops.h>
#include <shardline/kernels/optim.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/optim.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::nn {
namespace {

using dist::DistTensor;
using testing::CompareValues;
using testing::RandomTensor;
using testing::Values;

constexpr int kSteps = 6;

/// torch.optim state of one parameter, in float64.
struct RefState {
    Values param;
    Values buf;  ///< SGD momentum_buffer / AdamW exp_avg
    Values buf2; ///< AdamW exp_avg_sq
    std::int64_t step = 0;
};

/// torch.optim.SGD's step for one parameter with gradient g.
void RefSgd(RefState &s, const Values &grad, const SgdOptions &o, double lr) {
    const bool first = s.step == 0;
    ++s.step;
    if (first) {
        s.buf.assign(grad.size(), 0.0);
    }
    for (std::size_t i = 0; i < grad.size(); ++i) {
        double g = grad[i] + o.weight_decay * s.param[i];
        if (o.momentum != 0.0) {
            s.buf[i] = first ? g : o.momentum * s.buf[i] + (1.0 - o.dampening) * g;
            g = o.nesterov ? g + o.momentum * s.buf[i] : s.buf[i];
        }
        s.param[i] -= lr * g;
    }
}

/// torch.optim.AdamW's step (amsgrad off) for one parameter with gradient g.
void RefAdamW(RefState &s, const Values &grad, const AdamWOptions &o, double lr) {
    if (s.step == 0) {
        s.buf.assign(grad.size(), 0.0);
        s.buf2.assign(grad.size(), 0.0);
    }
    const double t = static_cast<double>(++s.step);
    const double bias_correction1 = 1.0 - std::pow(o.beta1, t);
    const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, t));
    for (std::size_t i = 0; i < grad.size(); ++i) {
        s.param[i] *= 1.0 - lr * o.weight_decay;
        s.buf[i] = o.beta1 * s.buf[i] + (1.0 - o.beta1) * grad[i];
        s.buf2[i] = o.beta2 * s.buf2[i] + (1.0 - o.beta2) * grad[i] * grad[i];
        const double denom = std::sqrt(s.buf2[i]) / bias_correction2_sqrt + o.eps;
        s.param[i] -= lr / bias_correction1 * s.buf[i] / denom;
    }
}

/// Backpropagates gelu(x·Wᵀ + b) of step `step`'s batch with a random output gradient.
void Backpropagate(const Linear &layer, DType dtype, int step) {
    const std::string xname = fmt::format("x{}", step);
    const std::string gname = fmt::format("dy{}", step);
    autograd::Variable x(RandomTensor({4, 5}, dtype, Device::CPU(), 5, xname));
    autograd::Variable y = autograd::Gelu(layer.Forward(x));
    const DistTensor dy = DistTensor::Local(RandomTensor({4, 3}, dtype, Device::CPU(), 5, gname));
    y.Backward(&dy);
}

double Tolerance(DType dtype) { return dtype == DType::kFloat64 ? 1e-12 : 1e-5; }

/// Runs kSteps of `optimizer` on a fresh Linear(5 -> 3) and `reference` on float64 copies; compares every step.
/// `bias_joins_at`: the bias needs no grad before that step (its optimizer state starts late, as in torch).
template <class Opt, class Options, class RefStep>
void RunAgainstReference(DType dtype, const Options &options, RefStep reference, int bias_joins_at = 0,
                         int lr_halved_at = -1) {
    Linear layer({.in_features = 5, .out_features = 3}, {.dtype = dtype, .seed = 11, .name = "lin"});
    const std::vector<Variable> params = layer.Parameters();
    ASSERT_EQ(params.size(), 2u);
    Opt optimizer(params, options);
    std::vector<RefState> refs(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
        refs[i].param = params[i].local().ToDoubleVector();
    }
    double lr = options.lr;
    for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        if (step == lr_halved_at) {
            lr *= 0.5;
            optimizer.set_lr(lr);
        }
        layer.bias.set_requires_grad(step >= bias_joins_at);
        optimizer.ZeroGrad();
        Backpropagate(layer, dtype, step);
        for (std::size_t i = 0; i < params.size(); ++i) {
            if (params[i].grad().defined()) {
                reference(refs[i], params[i].grad().local().ToDoubleVector(), options, lr);
            }
        }
        optimizer.Step();
        for (std::size_t i = 0; i < params.size(); ++i) {
            const std::string diff = CompareValues(params[i].local().ToDoubleVector(), refs[i].param, Tolerance(dtype));
            EXPECT_TRUE(diff.empty()) << params[i].name() << ": " << diff;
        }
    }
    EXPECT_EQ(optimizer.steps(), kSteps);
    // The parameters moved (a test whose optimizer does nothing must fail).
    Linear initial({.in_features = 5, .out_features = 3}, {.dtype = dtype, .seed = 11, .name = "lin"});
    EXPECT_NE(layer.weight.local().ToDoubleVector(), initial.weight.local().ToDoubleVector());
}

class OptimizerTest : public ::testing::TestWithParam<DType> {};

TEST_P(OptimizerTest, SgdPlain) { RunAgainstReference<SGD>(GetParam(), SgdOptions{.lr = 0.1}, RefSgd); }

TEST_P(OptimizerTest, SgdMomentum) {
    RunAgainstReference<SGD>(GetParam(), SgdOptions{.lr = 0.05, .momentum = 0.9}, RefSgd);
}

TEST_P(OptimizerTest, SgdMomentumDampeningWeightDecay) {
    RunAgainstReference<SGD>(GetParam(),
                             SgdOptions{.lr = 0.05, .momentum = 0.8, .dampening = 0.3, .weight_decay = 0.01}, RefSgd);
}

TEST_P(OptimizerTest, SgdNesterovWeightDecay) {
    RunAgainstReference<SGD>(GetParam(),
                             SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.05, .nesterov = true}, RefSgd);
}

TEST_P(OptimizerTest, SgdWeightDecayWithoutMomentumAndAnLrChange) {
    RunAgainstReference<SGD>(GetParam(), SgdOptions{.lr = 0.1, .weight_decay = 0.1}, RefSgd, 0, /*lr_halved_at=*/3);
}

TEST_P(OptimizerTest, SgdMomentumStateStartsAtAParametersFirstGradient) {
    // The bias has no gradient in steps 0 and 1: torch skips it and starts its momentum buffer (buf = g) at step 2.
    RunAgainstReference<SGD>(GetParam(), SgdOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.5}, RefSgd,
                             /*bias_joins_at=*/2);
}

TEST_P(OptimizerTest, AdamWDefaults) { RunAgainstReference<AdamW>(GetParam(), AdamWOptions{.lr = 1e-2}, RefAdamW); }

TEST_P(OptimizerTest, AdamWBetasEpsWeightDecay) {
    RunAgainstReference<AdamW>(GetParam(),
                               AdamWOptions{.lr = 2e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1},
                               RefAdamW, 0, /*lr_halved_at=*/4);
}

TEST_P(OptimizerTest, AdamWBiasCorrectionCountsAParametersOwnSteps) {
    // The bias joins at step 3: its first update uses t = 1 in the bias corrections, as torch's per-parameter state.
    RunAgainstReference<AdamW>(GetParam(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.02}, RefAdamW,
                               /*bias_joins_at=*/3);
}

INSTANTIATE_TEST_SUITE_P(CpuMasterDTypes, OptimizerTest, testing::CpuDTypes(), testing::DTypeParamName);

TEST(OptimizerErrorTest, NesterovNeedsMomentumWithoutDampening) {
    Linear layer({.in_features = 5, .out_features = 3}, {.name = "lin"});
    SGD sgd(layer.Parameters(), {.lr = 0.1, .momentum = 0.0, .nesterov = true});
    Backpropagate(layer, DType::kFloat32, 0);
    EXPECT_THROW(sgd.Step(), Error);
}

// ---- which kernels a step calls ------------------------------------------------------------------------------------

constexpr std::string_view kCounting = "optim-counting";

struct OptimKernelCalls {
    int sgd = 0;
    int sgd_multi = 0;
    int adamw = 0;
    int adamw_multi = 0;
    std::vector<const void *> grads; ///< the last Multi call's gradients, entry by entry
    std::vector<std::int64_t> steps; ///< its AdamW step counts
    std::vector<bool> first_steps;   ///< its SGD first_step flags
};
OptimKernelCalls g_calls;
kernels::SgdStepOp::Fn g_sgd = nullptr;
kernels::SgdStepMultiOp::Fn g_sgd_multi = nullptr;
kernels::AdamWStepOp::Fn g_adamw = nullptr;
kernels::AdamWStepMultiOp::Fn g_adamw_multi = nullptr;

void CountSgd(const kernels::SgdStepArgs &args) {
    ++g_calls.sgd;
    g_sgd(args);
}
void CountSgdMulti(const kernels::SgdStepMultiArgs &args) {
    ++g_calls.sgd_multi;
    g_calls.grads.clear();
    g_calls.first_steps.clear();
    for (const kernels::SgdStepTensor &t : args.tensors) {
        g_calls.grads.push_back(t.grad.data());
        g_calls.first_steps.push_back(t.first_step);
    }
    g_sgd_multi(args);
}
void CountAdamW(const kernels::AdamWStepArgs &args) {
    ++g_calls.adamw;
    g_adamw(args);
}
void CountAdamWMulti(const kernels::AdamWStepMultiArgs &args) {
    ++g_calls.adamw_multi;
    g_calls.grads.clear();
    g_calls.steps.clear();
    for (const kernels::AdamWStepTensor &t : args.tensors) {
        g_calls.grads.push_back(t.grad.data());
        g_calls.steps.push_back(t.step);
    }
    g_adamw_multi(args);
}

/// Serves the four optimizer ops on the CPU through counting wrappers around the default kernels.
class OptimizerKernelCallsTest : public ::testing::Test {
protected:
    void SetUp() override {
        kernels::ResetProviderSelection();
        g_sgd = kernels::OpTable<kernels::SgdStepOp>::Resolve(DeviceType::kCPU).fn;
        g_sgd_multi = kernels::OpTable<kernels::SgdStepMultiOp>::Resolve(DeviceType::kCPU).fn;
        g_adamw = kernels::OpTable<kernels::AdamWStepOp>::Resolve(DeviceType::kCPU).fn;
        g_adamw_multi = kernels::OpTable<kernels::AdamWStepMultiOp>::Resolve(DeviceType::kCPU).fn;
        kernels::Register<kernels::SgdStepOp>(DeviceType::kCPU, kCounting, &CountSgd);
        kernels::Register<kernels::SgdStepMultiOp>(DeviceType::kCPU, kCounting, &CountSgdMulti);
        kernels::Register<kernels::AdamWStepOp>(DeviceType::kCPU, kCounting, &CountAdamW);
        kernels::Register<kernels::AdamWStepMultiOp>(DeviceType::kCPU, kCounting, &CountAdamWMulti);
        for (const std::string_view op : {kernels::SgdStepOp::kName, kernels::SgdStepMultiOp::kName,
                                          kernels::AdamWStepOp::kName, kernels::AdamWStepMultiOp::kName}) {
            kernels::SetOpProvider(op, kCounting);
        }
        g_calls = {};
    }
    void TearDown() override {
        kernels::UnregisterProviderEverywhere(kCounting);
        kernels::ResetProviderSelection();
    }
};

TEST_F(OptimizerKernelCallsTest, AdamWStepIsOneMultiCallOverTheGradientsWithEachParametersOwnStep) {
    Linear layer({.in_features = 5, .out_features = 3}, {.seed = 11, .name = "lin"});
    AdamW adamw(layer.Parameters(), {.lr = 1e-2});
    // The bias has no gradient in step 1: it is left out of that call, and its step count lags the weight's after.
    const std::vector<std::vector<std::int64_t>> steps = {{1, 1}, {2}, {3, 2}};
    for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        layer.bias.set_requires_grad(step != 1);
        adamw.ZeroGrad();
        Backpropagate(layer, DType::kFloat32, step);
        adamw.Step();
        EXPECT_EQ(g_calls.adamw_multi, step + 1);
        EXPECT_EQ(g_calls.adamw, 0);
        EXPECT_EQ(g_calls.steps, steps[static_cast<std::size_t>(step)]);
        // The gradients themselves: no copy or cast on the way.
        std::vector<const void *> grads = {layer.weight.grad().local().data()};
        if (step != 1) {
            grads.push_back(layer.bias.grad().local().data());
        }
        EXPECT_EQ(g_calls.grads, grads);
    }
    EXPECT_EQ(adamw.steps(), 3);
}

TEST_F(OptimizerKernelCallsTest, SgdStepIsOneMultiCallWithEachParametersFirstStep) {
    Linear layer({.in_features = 5, .out_features = 3}, {.seed = 11, .name = "lin"});
    SGD sgd(layer.Parameters(), {.lr = 0.05, .momentum = 0.9});
    // The bias joins at step 1: its momentum buffer starts then (first_step), the weight's at step 0.
    const std::vector<std::vector<bool>> first = {{true}, {false, true}, {false, false}};
    for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        layer.bias.set_requires_grad(step >= 1);
        sgd.ZeroGrad();
        Backpropagate(layer, DType::kFloat32, step);
        sgd.Step();
        EXPECT_EQ(g_calls.sgd_multi, step + 1);
        EXPECT_EQ(g_calls.sgd, 0);
        EXPECT_EQ(g_calls.first_steps, first[static_cast<std::size_t>(step)]);
        EXPECT_EQ(g_calls.grads.front(), layer.weight.grad().local().data());
    }
}

TEST_F(OptimizerKernelCallsTest, AStepWithoutGradientsCallsNoKernel) {
    Linear layer({.in_features = 5, .out_features = 3}, {.seed = 11, .name = "lin"});
    AdamW adamw(layer.Parameters(), {.lr = 1e-2});
    adamw.Step(); // no backward yet
    EXPECT_EQ(g_calls.adamw_multi, 0);
    EXPECT_EQ(adamw.steps(), 1);
}

TEST(OptimizerErrorTest, ParametersMustBeLeaves) {
    Linear layer({.in_features = 2, .out_features = 2}, {.name = "lin"});
    Variable y = autograd::Scale(layer.weight, 2.0);
    EXPECT_THROW(SGD({y}, {}), Error);
}

} // namespace
} // namespace shardline::nn
