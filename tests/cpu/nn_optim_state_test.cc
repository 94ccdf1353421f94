// The optimizers follow their parameters, not the tensors they saw at construction: a tensor replaced by
// Variable::SetValue (what a checkpoint load may do) or written in place is what the next step updates, and State()
// exposes the moments and step counts in place, so restoring them into a fresh optimizer continues bit for bit.
// Every case compares two runs that must agree bitwise: one that changes the parameter the way under test, and a twin
// built to hold the same values from the start.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/optim.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::nn {
namespace {

using dist::DistTensor;
using testing::RandomTensor;

/// Backpropagates gelu(x·Wᵀ + b) of step `step`'s batch with a random output gradient.
void Backpropagate(const Linear &layer, DType dtype, int step) {
    autograd::Variable x(RandomTensor({4, 5}, dtype, Device::CPU(), 7, fmt::format("x{}", step)));
    autograd::Variable y = autograd::Gelu(layer.Forward(x));
    const DistTensor dy = DistTensor::Local(RandomTensor({4, 3}, dtype, Device::CPU(), 7, fmt::format("dy{}", step)));
    y.Backward(&dy);
}

template <class Opt> void TrainSteps(Linear &layer, Opt &optimizer, DType dtype, int first, int last) {
    for (int step = first; step < last; ++step) {
        optimizer.ZeroGrad();
        Backpropagate(layer, dtype, step);
        optimizer.Step();
    }
}

/// Writes `values` into the parameter's own local tensor (a Tensor handle shares the storage).
void WriteInPlace(const autograd::Variable &param, const Tensor &values) {
    Tensor local = param.local();
    local.CopyFrom(values);
}

Linear MakeLayer(DType dtype, std::uint64_t seed = 11) {
    return Linear({.in_features = 5, .out_features = 3}, {.dtype = dtype, .seed = seed, .name = "lin"});
}

class OptimizerStateTest : public ::testing::TestWithParam<DType> {};

// Before the fix the optimizer kept updating the tensor it saw at construction, and the replaced one never moved.
TEST_P(OptimizerStateTest, AStepUpdatesTheTensorSetValuePutInPlace) {
    const DType dtype = GetParam();
    Linear replaced = MakeLayer(dtype);
    Linear twin = MakeLayer(dtype);
    AdamW replaced_opt(replaced.Parameters(), {.lr = 1e-2});
    AdamW twin_opt(twin.Parameters(), {.lr = 1e-2});
    TrainSteps(replaced, replaced_opt, dtype, 0, 2);
    TrainSteps(twin, twin_opt, dtype, 0, 2);

    const Tensor fresh = RandomTensor({3, 5}, dtype, Device::CPU(), 99, "fresh");
    replaced.weight.SetValue(DistTensor::Local(fresh.Clone()));
    WriteInPlace(twin.weight, fresh);
    TrainSteps(replaced, replaced_opt, dtype, 2, 4);
    TrainSteps(twin, twin_opt, dtype, 2, 4);

    EXPECT_NE(replaced.weight.local().ToDoubleVector(), fresh.ToDoubleVector()) << "the replaced weight never moved";
    EXPECT_EQ(replaced.weight.local().ToDoubleVector(), twin.weight.local().ToDoubleVector());
    EXPECT_EQ(replaced.bias.local().ToDoubleVector(), twin.bias.local().ToDoubleVector());
}

TEST_P(OptimizerStateTest, SgdMomentumFollowsASetValueToo) {
    const DType dtype = GetParam();
    const SgdOptions options{.lr = 0.1, .momentum = 0.9};
    Linear replaced = MakeLayer(dtype);
    Linear twin = MakeLayer(dtype);
    SGD replaced_opt(replaced.Parameters(), options);
    SGD twin_opt(twin.Parameters(), options);
    TrainSteps(replaced, replaced_opt, dtype, 0, 1);
    TrainSteps(twin, twin_opt, dtype, 0, 1);
    const Tensor fresh = RandomTensor({3}, dtype, Device::CPU(), 98, "fresh");
    replaced.bias.SetValue(DistTensor::Local(fresh.Clone()));
    WriteInPlace(twin.bias, fresh);
    TrainSteps(replaced, replaced_opt, dtype, 1, 3);
    TrainSteps(twin, twin_opt, dtype, 1, 3);
    EXPECT_NE(replaced.bias.local().ToDoubleVector(), fresh.ToDoubleVector());
    EXPECT_EQ(replaced.bias.local().ToDoubleVector(), twin.bias.local().ToDoubleVector());
}

// A checkpoint restores the moments and the step counts through State() into a fresh optimizer: the next steps are
// bitwise those of the optimizer that never stopped.
TEST_P(OptimizerStateTest, RestoringStateIntoAFreshOptimizerContinuesBitwise) {
    const DType dtype = GetParam();
    Linear original = MakeLayer(dtype);
    AdamW original_opt(original.Parameters(), {.lr = 1e-2, .weight_decay = 0.1});
    TrainSteps(original, original_opt, dtype, 0, 3);

    Linear resumed = MakeLayer(dtype, /*seed=*/12); // other initial values: everything must come from the restore
    AdamW resumed_opt(resumed.Parameters(), {.lr = 1e-2, .weight_decay = 0.1});
    const std::vector<Optimizer::ParamState> from = original_opt.State();
    std::vector<Optimizer::ParamState> to = resumed_opt.State();
    ASSERT_EQ(from.size(), to.size());
    std::vector<std::int64_t> steps;
    for (std::size_t i = 0; i < from.size(); ++i) {
        WriteInPlace(to[i].param, from[i].param.local());
        ASSERT_EQ(from[i].tensors.size(), 2u);
        ASSERT_EQ(to[i].tensors.size(), 2u);
        for (std::size_t j = 0; j < from[i].tensors.size(); ++j) {
            EXPECT_EQ(from[i].tensors[j].first, to[i].tensors[j].first);
            to[i].tensors[j].second.CopyFrom(from[i].tensors[j].second);
        }
        steps.push_back(from[i].step);
    }
    EXPECT_EQ(steps, (std::vector<std::int64_t>{3, 3}));
    resumed_opt.LoadSteps(steps, original_opt.steps());
    EXPECT_EQ(resumed_opt.steps(), 3);

    TrainSteps(original, original_opt, dtype, 3, 6);
    TrainSteps(resumed, resumed_opt, dtype, 3, 6);
    EXPECT_EQ(resumed.weight.local().ToDoubleVector(), original.weight.local().ToDoubleVector());
    EXPECT_EQ(resumed.bias.local().ToDoubleVector(), original.bias.local().ToDoubleVector());
    const std::vector<Optimizer::ParamState> after = resumed_opt.State();
    const std::vector<Optimizer::ParamState> expected = original_opt.State();
    EXPECT_EQ(after[0].tensors[1].second.ToDoubleVector(), expected[0].tensors[1].second.ToDoubleVector());
}

INSTANTIATE_TEST_SUITE_P(CpuMasterDTypes, OptimizerStateTest, testing::CpuDTypes(), testing::DTypeParamName);

TEST(OptimizerStateErrorTest, LoadStepsNamesTheCountsItExpects) {
    Linear layer = MakeLayer(DType::kFloat32);
    AdamW optimizer(layer.Parameters(), {});
    try {
        optimizer.LoadSteps({1}, 1);
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("one step count per parameter (2) expected, got 1"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(optimizer.LoadSteps({2, 5}, 4), Error);
}

TEST(OptimizerStateTest, StateNamesSgdMomentumBuffers) {
    Linear layer = MakeLayer(DType::kFloat32);
    SGD optimizer(layer.Parameters(), {.lr = 0.1, .momentum = 0.9});
    TrainSteps(layer, optimizer, DType::kFloat32, 0, 2);
    const std::vector<Optimizer::ParamState> state = optimizer.State();
    ASSERT_EQ(state.size(), 2u);
    ASSERT_EQ(state[0].tensors.size(), 1u);
    EXPECT_EQ(state[0].tensors[0].first, "momentum_buffer");
    EXPECT_EQ(state[0].tensors[0].second.shape(), (Shape{3, 5}));
    EXPECT_EQ(state[0].step, 2);
    EXPECT_EQ(state[0].param.name(), "lin.weight");
}

} // namespace
} // namespace shardline::nn
