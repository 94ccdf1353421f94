// SgdStep and AdamWStep on every device over several steps against a float64 implementation of torch.optim's formulas,
// aligned and misaligned (CUDA's vectorised and scalar paths), with the model copy refreshed bit for bit from the
// updated master; and each device's dtype rules and error messages.

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/config.h>
#include <shardline/core/error.h>
#include <shardline/kernels/optim.h>

#include "helpers.h"
#include "optim_reference.h"

namespace shardline::testing {
namespace {

using kernels::AdamWStep;
using kernels::AdamWStepArgs;
using kernels::SgdStep;
using kernels::SgdStepArgs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// On CUDA an aligned shard takes 16-byte vectors for its multiple of 4 elements and scalars for the rest (n < 4: all);
// a misaligned one takes scalars; (1 << 20) + 4 elements span 17 blocks of 64 Ki.
const std::vector<Shape> kShapes = {{1}, {7}, {3, 33}, {64}, {1025}, {(1 << 20) + 4}};
constexpr int kSteps = 5;

/// The case's dtype is the model copy's on CUDA (float32, float16, bfloat16: a float32 master refreshes it) and the
/// master's on the CPU (float32 or float64: its model copy is the other one).
class OptimTest : public DeviceTest<> {
protected:
    DType master_dtype() const { return device().is_cuda() ? DType::kFloat32 : dtype(); }
    DType model_dtype() const {
        if (device().is_cuda()) {
            return dtype();
        }
        return dtype() == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
    }
    Tensor Grad(const Shape &shape, int step) const {
        return Random(shape, master_dtype(), static_cast<std::uint64_t>(200 + step), "grad");
    }
};

TEST_P(OptimTest, SgdFollowsTorchAndRefreshesTheModelCopy) {
    const std::vector<SgdConfig> configs = {
        {.lr = 0.1, .momentum = 0, .dampening = 0, .weight_decay = 0, .nesterov = false},
        {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .nesterov = false},
        {.lr = 0.02, .momentum = 0.8, .dampening = 0, .weight_decay = 0.1, .nesterov = true},
    };
    const DType master_t = master_dtype();
    for (const SgdConfig &c : configs) {
        for (const Shape &shape : kShapes) {
            for (const bool misaligned : {false, true}) {
                SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << " momentum " << c.momentum << " nesterov "
                                                  << c.nesterov << (misaligned ? " misaligned" : ""));
                MisalignedTensor param = Place(Random(shape, master_t, 70, "param"), misaligned);
                // The buffer's first contents must not matter (first_step): poison it.
                MisalignedTensor buf = Place(Random(shape, master_t, 70, "poison", 1e3), misaligned);
                MisalignedTensor model = Place(Tensor::Zeros(shape, model_dtype(), device()), misaligned);
                Values p = param.view.ToDoubleVector();
                Values b(p.size(), 0.0);
                ASSERT_GT(AbsSum(p), 0.0);
                for (int step = 1; step <= kSteps; ++step) {
                    const Tensor grad = Grad(shape, step);
                    SgdStep(SgdStepArgs{.param = param.view,
                                        .grad = grad,
                                        .momentum_buffer = c.momentum != 0 ? &buf.view : nullptr,
                                        .lr = c.lr,
                                        .momentum = c.momentum,
                                        .dampening = c.dampening,
                                        .weight_decay = c.weight_decay,
                                        .nesterov = c.nesterov,
                                        .first_step = step == 1,
                                        .model_param = &model.view});
                    RefSgdStep(p, b, grad.ToDoubleVector(), c, step == 1);
                    const Values master = param.view.ToDoubleVector();
                    ASSERT_TRUE(ValuesMatch(master, p, master_t, step)) << "step " << step;
                    if (c.momentum != 0) {
                        ASSERT_TRUE(ValuesMatch(buf.view, b, master_t, step)) << "momentum buffer, step " << step;
                    }
                    ASSERT_EQ(model.view.ToDoubleVector(), RoundTo(master, model_dtype()))
                        << "model copy, step " << step;
                }
            }
        }
    }
}

TEST_P(OptimTest, AdamWFollowsTorchAndRefreshesTheModelCopy) {
    const std::vector<AdamWConfig> configs = {
        {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01},
        {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-3, .weight_decay = 0.5},
        {.lr = 1e-1, .beta1 = 0.0, .beta2 = 0.5, .eps = 1e-6, .weight_decay = 0.0},
    };
    const DType master_t = master_dtype();
    for (const AdamWConfig &c : configs) {
        for (const Shape &shape : kShapes) {
            for (const bool misaligned : {false, true}) {
                SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << " lr " << c.lr << " betas " << c.beta1
                                                  << ", " << c.beta2 << (misaligned ? " misaligned" : ""));
                MisalignedTensor param = Place(Random(shape, master_t, 71, "param"), misaligned);
                MisalignedTensor exp_avg = Place(Tensor::Zeros(shape, master_t, device()), misaligned);
                MisalignedTensor exp_avg_sq = Place(Tensor::Zeros(shape, master_t, device()), misaligned);
                MisalignedTensor model = Place(Tensor::Zeros(shape, model_dtype(), device()), misaligned);
                Values p = param.view.ToDoubleVector();
                Values m(p.size(), 0.0);
                Values v(p.size(), 0.0);
                for (int step = 1; step <= kSteps; ++step) {
                    const Tensor grad = Grad(shape, step);
                    AdamWStep(AdamWStepArgs{.param = param.view,
                                            .grad = grad,
                                            .exp_avg = exp_avg.view,
                                            .exp_avg_sq = exp_avg_sq.view,
                                            .lr = c.lr,
                                            .beta1 = c.beta1,
                                            .beta2 = c.beta2,
                                            .eps = c.eps,
                                            .weight_decay = c.weight_decay,
                                            .step = step,
                                            .model_param = &model.view});
                    RefAdamWStep(p, m, v, grad.ToDoubleVector(), c, step);
                    const Values master = param.view.ToDoubleVector();
                    // The rounded states, the division and the square root, over the steps.
                    ASSERT_TRUE(ValuesMatch(master, p, master_t, 2 * step)) << "step " << step;
                    ASSERT_TRUE(ValuesMatch(exp_avg.view, m, master_t, step)) << "exp_avg, step " << step;
                    ASSERT_TRUE(ValuesMatch(exp_avg_sq.view, v, master_t, step)) << "exp_avg_sq, step " << step;
                    ASSERT_EQ(model.view.ToDoubleVector(), RoundTo(master, model_dtype()))
                        << "model copy, step " << step;
                }
            }
        }
    }
}

TEST_P(OptimTest, StepsWithoutAModelCopyOnlyUpdateTheMaster) {
    Tensor param = Random({1003}, master_dtype(), 72, "param");
    Tensor m = Tensor::Zeros({1003}, master_dtype(), device());
    Tensor v = Tensor::Zeros({1003}, master_dtype(), device());
    Values p = param.ToDoubleVector();
    Values mv(p.size(), 0.0);
    Values vv(p.size(), 0.0);
    const Tensor grad = Grad({1003}, 1);
    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v});
    RefAdamWStep(p, mv, vv, grad.ToDoubleVector(),
                 AdamWConfig{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, 1);
    EXPECT_TRUE(ValuesMatch(param, p, master_dtype(), 2));
}

TEST_P(OptimTest, SgdWithoutMomentumReadsNoBuffer) {
    Tensor param = Random({9}, master_dtype(), 34, "param");
    const Tensor grad = Grad({9}, 1);
    Values p = param.ToDoubleVector();
    Values unused;
    SgdStep(SgdStepArgs{.param = param, .grad = grad, .lr = 0.25, .weight_decay = 0.5});
    RefSgdStep(p, unused, grad.ToDoubleVector(),
               SgdConfig{.lr = 0.25, .momentum = 0, .dampening = 0, .weight_decay = 0.5, .nesterov = false}, true);
    EXPECT_TRUE(ValuesMatch(param, p, master_dtype()));
}

TEST_P(OptimTest, EmptyShardIsANoOp) {
    Tensor param = Tensor::Empty({0, 3}, master_dtype(), device());
    const Tensor grad = Tensor::Empty({0, 3}, master_dtype(), device());
    Tensor m = Tensor::Empty({0, 3}, master_dtype(), device());
    Tensor v = Tensor::Empty({0, 3}, master_dtype(), device());
    SgdStep(SgdStepArgs{.param = param, .grad = grad, .momentum_buffer = &m, .lr = 0.1, .momentum = 0.9});
    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v});
    EXPECT_EQ(param.numel(), 0);
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(OptimTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Each device's masters

TEST(OptimTest, StepsRefreshTheModelCopyFromTheUpdatedMaster) {
    // A float64 master with a float32 model copy: the copy is the master rounded once, bit for bit.
    auto grad = [](const Shape &shape, DType dtype, int step) {
        return RandomTensor(shape, dtype, Device::CPU(), static_cast<std::uint64_t>(100 + step), "grad");
    };
    Tensor master = RandomTensor({129}, DType::kFloat64, Device::CPU(), 32, "param");
    Tensor model = Tensor::Zeros({129}, DType::kFloat32);
    Tensor buf = Tensor::Zeros({129}, DType::kFloat64);
    Tensor m = Tensor::Zeros({129}, DType::kFloat64);
    Tensor v = Tensor::Zeros({129}, DType::kFloat64);
    for (int step = 1; step <= 3; ++step) {
        const Tensor g = grad({129}, DType::kFloat64, step);
        SgdStep(SgdStepArgs{.param = master,
                            .grad = g,
                            .momentum_buffer = &buf,
                            .lr = 0.1,
                            .momentum = 0.9,
                            .first_step = step == 1,
                            .model_param = &model});
        EXPECT_EQ(model.ToDoubleVector(), master.To(DType::kFloat32).ToDoubleVector()) << "SGD step " << step;
        AdamWStep(AdamWStepArgs{
            .param = master, .grad = g, .exp_avg = m, .exp_avg_sq = v, .step = step, .model_param = &model});
        EXPECT_EQ(model.ToDoubleVector(), master.To(DType::kFloat32).ToDoubleVector()) << "AdamW step " << step;
    }
    ASSERT_GT(AbsSum(model.ToDoubleVector()), 0.0);
    // A float32 master with a float64 copy: exact.
    Tensor master32 = RandomTensor({17}, DType::kFloat32, Device::CPU(), 33, "param");
    Tensor model64 = Tensor::Zeros({17}, DType::kFloat64);
    SgdStep(SgdStepArgs{.param = master32, .grad = grad({17}, DType::kFloat32, 1), .lr = 0.5, .model_param = &model64});
    EXPECT_EQ(model64.ToDoubleVector(), master32.ToDoubleVector());
}

TEST_F(CudaTest, OptimizerMasterMustBeFloat32OnCuda) {
    for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        Tensor param = Tensor::Zeros({8}, dtype, Gpu());
        const Tensor grad = Tensor::Zeros({8}, dtype, Gpu());
        EXPECT_THAT(MessageOf<DTypeError>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .lr = 0.1}); }),
                    AllOf(HasSubstr("SgdStep: param must be a float32 master on CUDA"),
                          HasSubstr(std::string(DTypeName(dtype)))))
            << DTypeName(dtype) << " master";
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Errors (the CPU's messages)

TEST(OptimErrorsTest, SgdHyperParametersFollowTorchsChecks) {
    Tensor param = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor grad = Tensor::Zeros({4}, DType::kFloat32);
    Tensor buf = Tensor::Zeros({4}, DType::kFloat32);
    EXPECT_THAT(
        MessageOf<Error>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .lr = 0.1, .momentum = 0.9}); }),
        AllOf(HasSubstr("SgdStep"), HasSubstr("momentum 0.9 needs a momentum_buffer")));
    EXPECT_THAT(MessageOf<Error>([&] {
                    SgdStep(SgdStepArgs{.param = param,
                                        .grad = grad,
                                        .momentum_buffer = &buf,
                                        .momentum = 0.9,
                                        .dampening = 0.1,
                                        .nesterov = true});
                }),
                AllOf(HasSubstr("SgdStep"), HasSubstr("nesterov needs momentum > 0 and dampening == 0"),
                      HasSubstr("dampening 0.1")));
    EXPECT_THAT(MessageOf<Error>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .lr = -1}); }),
                AllOf(HasSubstr("SgdStep"), HasSubstr("lr must be >= 0, got -1")));
    EXPECT_THAT(MessageOf<Error>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .weight_decay = -0.5}); }),
                AllOf(HasSubstr("SgdStep"), HasSubstr("weight_decay must be >= 0")));
}

TEST(OptimErrorsTest, StateMustMatchTheMaster) {
    Tensor param = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor grad64 = Tensor::Zeros({4}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad64}); }),
                AllOf(HasSubstr("SgdStep"), HasSubstr("grad and param must have one dtype"),
                      HasSubstr("Tensor[4] float64 cpu")));
    const Tensor grad = Tensor::Zeros({4}, DType::kFloat32);
    Tensor m = Tensor::Zeros({4}, DType::kFloat32);
    Tensor v5 = Tensor::Zeros({5}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v5}); }),
                AllOf(HasSubstr("AdamWStep"), HasSubstr("exp_avg_sq must have shape [4]"), HasSubstr("Tensor[5]")));
    Tensor i64 = Tensor::Zeros({4}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>([&] { SgdStep(SgdStepArgs{.param = i64, .grad = i64}); }),
                AllOf(HasSubstr("SgdStep"), HasSubstr("param must be a float32 or float64 master on the CPU"),
                      HasSubstr("Tensor[4] int64 cpu")));
#if SHARDLINE_HAVE_CUDA
    // A bf16 host tensor needs the CUDA headers' conversions: a CUDA-off build cannot make one.
    Tensor half = Tensor::Zeros({4}, DType::kBFloat16);
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .model_param = &half}); }),
        AllOf(HasSubstr("SgdStep"), HasSubstr("CPU kernels take float32 or float64"),
              HasSubstr("model_param Tensor[4] bfloat16 cpu")));
#endif
    Tensor model3 = Tensor::Zeros({3}, DType::kFloat64);
    EXPECT_THAT(
        MessageOf<ShapeError>([&] { SgdStep(SgdStepArgs{.param = param, .grad = grad, .model_param = &model3}); }),
        AllOf(HasSubstr("SgdStep"), HasSubstr("model_param must have shape [4]")));
}

TEST(OptimErrorsTest, AdamWHyperParametersFollowTorchsChecks) {
    Tensor param = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor grad = Tensor::Zeros({4}, DType::kFloat32);
    Tensor m = Tensor::Zeros({4}, DType::kFloat32);
    Tensor v = Tensor::Zeros({4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<Error>([&] {
                    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v, .beta1 = 1.0});
                }),
                AllOf(HasSubstr("AdamWStep"), HasSubstr("beta1 must be in [0, 1), got 1")));
    EXPECT_THAT(MessageOf<Error>([&] {
                    AdamWStep(
                        AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v, .beta2 = -0.1});
                }),
                AllOf(HasSubstr("AdamWStep"), HasSubstr("beta2 must be in [0, 1)")));
    EXPECT_THAT(MessageOf<Error>([&] {
                    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v, .step = 0});
                }),
                AllOf(HasSubstr("AdamWStep"), HasSubstr("step must be >= 1"), HasSubstr("got 0")));
    EXPECT_THAT(MessageOf<Error>([&] {
                    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v, .eps = -1e-8});
                }),
                AllOf(HasSubstr("AdamWStep"), HasSubstr("eps must be >= 0")));
}

} // namespace
} // namespace shardline::testing
