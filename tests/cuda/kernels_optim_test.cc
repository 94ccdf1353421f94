// SgdStep and AdamWStep on CUDA over several steps against a float64 implementation of torch.optim's formulas, on the
// vectorised and the scalar path, with the model copy in each CUDA dtype refreshed bit for bit from the fp32 master.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/optim.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::AdamWStep;
using kernels::AdamWStepArgs;
using kernels::SgdStep;
using kernels::SgdStepArgs;

struct SgdConfig {
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
    bool nesterov;
};

void RefSgdStep(Values& p, Values& buf, const Values& grad, const SgdConfig& c, bool first_step) {
    for (std::size_t i = 0; i < p.size(); ++i) {
        double d = grad[i] + c.weight_decay * p[i];
        if (c.momentum != 0) {
            buf[i] = first_step ? d : c.momentum * buf[i] + (1 - c.dampening) * d;
            d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
        }
        p[i] -= c.lr * d;
    }
}

struct AdamWConfig {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
};

void RefAdamWStep(Values& p, Values& m, Values& v, const Values& grad, const AdamWConfig& c, std::int64_t t) {
    const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(t));
    const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] *= 1 - c.lr * c.weight_decay;
        m[i] += (grad[i] - m[i]) * (1 - c.beta1);
        v[i] = v[i] * c.beta2 + (1 - c.beta2) * grad[i] * grad[i];
        p[i] -= c.lr / bias_correction1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bias_correction2) + c.eps);
    }
}

// n % 4 != 0 and n < 4 take the scalar kernel; multiples of 4 the 16-byte one; one shard spans many blocks.
const std::vector<Shape> kShapes = {{1}, {7}, {3, 33}, {64}, {(1 << 20) + 4}};
constexpr int kSteps = 5;

Tensor Grad(const Shape& shape, int step) {
    return RandomGpu(shape, DType::kFloat32, static_cast<std::uint64_t>(200 + step), "grad");
}

/// A copy of t on the GPU, 16-byte aligned (the vectorised kernel) or one element off (the scalar kernel).
MisalignedTensor Place(const Tensor& t, bool misaligned) {
    if (misaligned) {
        return MisalignedCopy(t, 1);
    }
    MisalignedTensor m;
    m.backing = t.Clone();
    m.view = m.backing;
    return m;
}

/// The test dtype is the model copy's: float32 (a plain fp32 model refreshed by the step), float16, bfloat16.
using CudaOptimTest = CudaParamTest<DType>;

TEST_P(CudaOptimTest, SgdFollowsTorchAndRefreshesTheModelCopy) {
    const DType model_dtype = GetParam();
    const std::vector<SgdConfig> configs = {
        {.lr = 0.1, .momentum = 0, .dampening = 0, .weight_decay = 0, .nesterov = false},
        {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .nesterov = false},
        {.lr = 0.02, .momentum = 0.8, .dampening = 0, .weight_decay = 0.1, .nesterov = true},
    };
    for (const SgdConfig& c : configs) {
        for (const Shape& shape : kShapes) {
            for (const bool misaligned : {false, true}) {
                SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << " momentum " << c.momentum << " nesterov "
                                                  << c.nesterov << (misaligned ? " misaligned" : ""));
                MisalignedTensor param = Place(RandomGpu(shape, DType::kFloat32, 70, "param"), misaligned);
                MisalignedTensor buf = Place(RandomGpu(shape, DType::kFloat32, 70, "poison", 1e3), misaligned);
                MisalignedTensor model = Place(Tensor::Zeros(shape, model_dtype, Gpu()), misaligned);
                Values p = param.view.ToDoubleVector();
                Values b(p.size(), 0.0);
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
                    ASSERT_TRUE(ValuesMatch(master, p, DType::kFloat32, step)) << "step " << step;
                    if (c.momentum != 0) {
                        ASSERT_TRUE(ValuesMatch(buf.view, b, DType::kFloat32, step)) << "buffer, step " << step;
                    }
                    ASSERT_EQ(model.view.ToDoubleVector(), RoundTo(master, model_dtype)) << "model copy, step " << step;
                }
            }
        }
    }
}

TEST_P(CudaOptimTest, AdamWFollowsTorchAndRefreshesTheModelCopy) {
    const DType model_dtype = GetParam();
    const std::vector<AdamWConfig> configs = {
        {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01},
        {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-3, .weight_decay = 0.5},
    };
    for (const AdamWConfig& c : configs) {
        for (const Shape& shape : kShapes) {
            for (const bool misaligned : {false, true}) {
                SCOPED_TRACE(::testing::Message()
                             << ShapeToString(shape) << " lr " << c.lr << (misaligned ? " misaligned" : ""));
                MisalignedTensor param = Place(RandomGpu(shape, DType::kFloat32, 71, "param"), misaligned);
                MisalignedTensor exp_avg = Place(Tensor::Zeros(shape, DType::kFloat32, Gpu()), misaligned);
                MisalignedTensor exp_avg_sq = Place(Tensor::Zeros(shape, DType::kFloat32, Gpu()), misaligned);
                MisalignedTensor model = Place(Tensor::Zeros(shape, model_dtype, Gpu()), misaligned);
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
                    // fp32 math: the rounded states, the division and the square root, over the steps.
                    ASSERT_TRUE(ValuesMatch(master, p, DType::kFloat32, 2 * step)) << "step " << step;
                    ASSERT_TRUE(ValuesMatch(exp_avg.view, m, DType::kFloat32, step)) << "exp_avg, step " << step;
                    ASSERT_TRUE(ValuesMatch(exp_avg_sq.view, v, DType::kFloat32, step)) << "exp_avg_sq, step " << step;
                    ASSERT_EQ(model.view.ToDoubleVector(), RoundTo(master, model_dtype)) << "model copy, step " << step;
                }
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(DType, CudaOptimTest, CudaDTypes(), DTypeParamName);

TEST_F(CudaTest, OptimizerStepsWithoutAModelCopyOnlyUpdateTheMaster) {
    Tensor param = RandomGpu({1003}, DType::kFloat32, 72, "param");
    Tensor m = Tensor::Zeros({1003}, DType::kFloat32, Gpu());
    Tensor v = Tensor::Zeros({1003}, DType::kFloat32, Gpu());
    Values p = param.ToDoubleVector();
    Values mv(p.size(), 0.0);
    Values vv(p.size(), 0.0);
    const Tensor grad = Grad({1003}, 1);
    AdamWStep(AdamWStepArgs{.param = param, .grad = grad, .exp_avg = m, .exp_avg_sq = v});
    RefAdamWStep(p, mv, vv, grad.ToDoubleVector(),
                 AdamWConfig{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, 1);
    EXPECT_TRUE(ValuesMatch(param, p, DType::kFloat32, 2));
}

TEST_F(CudaTest, OptimizerMasterMustBeFloat32OnCuda) {
    for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        Tensor param = Tensor::Zeros({8}, dtype, Gpu());
        const Tensor grad = Tensor::Zeros({8}, dtype, Gpu());
        try {
            SgdStep(SgdStepArgs{.param = param, .grad = grad, .lr = 0.1});
            ADD_FAILURE() << "SgdStep accepted a " << DTypeName(dtype) << " master";
        } catch (const DTypeError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("SgdStep: param must be a float32 master on CUDA"), std::string::npos) << msg;
            EXPECT_NE(msg.find(std::string(DTypeName(dtype))), std::string::npos) << msg;
        }
    }
}

} // namespace
} // namespace shardline::testing
