#pragma once

// The gradient check of the autograd Functions on local Variables: float64 autograd against float64 central finite
// differences of L = Σ f(inputs) ⊙ r (r random, passed to Backward as dL/dout), then float32 autograd against the
// float64 gradients just verified. Inputs are float32-representable so both runs see the same values.

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/variable.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::autograd::gradcheck {

using dist::DistTensor;
using testing::CompareValues;
using testing::RandomTensor;
using testing::RelativeTolerance;
using testing::Values;

using Op = std::function<Variable(const std::vector<Variable> &)>;

/// Central differences in float64: truncation ~h²·f''' ≈ 1e-10, rounding ~ε·|L|/h ≈ 1e-10 for |L| ≲ 100.
inline constexpr double kStep = 1e-5;
inline constexpr double kFiniteDifferenceTolerance = 1e-6;

/// A float64 tensor of float32-representable normal(0, scale) values.
inline Tensor Data(const Shape &shape, std::string_view name, double scale = 1.0) {
    const Tensor t =
        RandomTensor(shape, DType::kFloat32, Device::CPU(), 31, name, RandomDistribution::kNormal, 0.0, scale);
    return t.To(DType::kFloat64);
}

/// int64 ids in [0, n).
inline Tensor Ids(const std::vector<double> &ids, const Shape &shape) {
    return Tensor::FromVector(ids, shape, DType::kInt64);
}

inline bool IsFloat(const Tensor &t) { return t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64; }

/// Σ out ⊙ r.
inline double Dot(const Tensor &out, const Values &r) {
    const Values o = out.ToDoubleVector();
    double s = 0.0;
    for (std::size_t i = 0; i < o.size(); ++i) {
        s += o[i] * r[i];
    }
    return s;
}

/// dL/d inputs[i] by central differences (no graph is recorded).
inline Values NumericGrad(const Op &f, const std::vector<Tensor> &inputs, std::size_t i, const Values &r) {
    NoGradGuard no_grad;
    std::vector<Variable> vars;
    for (const Tensor &t : inputs) {
        vars.emplace_back(t.Clone());
    }
    Tensor x = vars[i].local();
    double *data = x.data_as<double>();
    Values grad(static_cast<std::size_t>(x.numel()));
    for (std::int64_t j = 0; j < x.numel(); ++j) {
        const double saved = data[j];
        data[j] = saved + kStep;
        const double plus = Dot(f(vars).local(), r);
        data[j] = saved - kStep;
        const double minus = Dot(f(vars).local(), r);
        data[j] = saved;
        grad[static_cast<std::size_t>(j)] = (plus - minus) / (2 * kStep);
    }
    return grad;
}

/// Runs f on Variables made from `inputs` (converted to `dtype` where floating point), backpropagates `r`, and
/// returns each input's gradient (empty where it has none).
inline std::vector<Values> AutogradGrads(const Op &f, const std::vector<Tensor> &inputs, const std::vector<bool> &wants,
                                         const Tensor &r, DType dtype) {
    std::vector<Variable> vars;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        vars.emplace_back(IsFloat(inputs[i]) ? inputs[i].To(dtype) : inputs[i].Clone(), static_cast<bool>(wants[i]));
    }
    const Variable out = f(vars);
    EXPECT_TRUE(out.requires_grad());
    EXPECT_NE(out.grad_fn(), nullptr);
    const DistTensor dout = DistTensor::Local(r.To(dtype));
    out.Backward(&dout);
    std::vector<Values> grads;
    for (std::size_t i = 0; i < vars.size(); ++i) {
        const DistTensor &g = vars[i].grad();
        if (!wants[i]) {
            EXPECT_FALSE(g.defined()) << "input " << i << " does not require grad but got one";
            grads.emplace_back();
            continue;
        }
        EXPECT_TRUE(g.defined()) << "input " << i << " requires grad but got none";
        if (!g.defined()) {
            grads.emplace_back();
            continue;
        }
        EXPECT_EQ(g.global_shape(), inputs[i].shape()) << "input " << i;
        EXPECT_EQ(g.dtype(), dtype) << "input " << i;
        grads.push_back(g.local().ToDoubleVector());
    }
    return grads;
}

/// The check of every Function: float64 autograd vs finite differences, then float32 autograd vs float64 autograd.
inline void ExpectGradientsMatch(const Op &f, const std::vector<Tensor> &inputs, const std::vector<bool> &wants) {
    Shape out_shape;
    {
        NoGradGuard no_grad;
        std::vector<Variable> vars;
        for (const Tensor &t : inputs) {
            vars.emplace_back(t.Clone());
        }
        out_shape = f(vars).shape();
    }
    const Tensor r = Data(out_shape, "dout");
    const Values rv = r.ToDoubleVector();
    const std::vector<Values> g64 = AutogradGrads(f, inputs, wants, r, DType::kFloat64);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        if (!wants[i] || g64[i].empty()) {
            continue;
        }
        const Values numeric = NumericGrad(f, inputs, i, rv);
        ASSERT_GT(testing::AbsSum(numeric), 0.0) << "input " << i << ": a zero gradient cannot test anything";
        const std::string diff = CompareValues(g64[i], numeric, kFiniteDifferenceTolerance, kFiniteDifferenceTolerance);
        EXPECT_TRUE(diff.empty()) << "float64 grad of input " << i << " vs finite differences: " << diff;
    }
    const std::vector<Values> g32 = AutogradGrads(f, inputs, wants, r, DType::kFloat32);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        if (!wants[i] || g32[i].empty() || g64[i].empty()) {
            continue;
        }
        const std::string diff = CompareValues(g32[i], g64[i], RelativeTolerance(DType::kFloat32));
        EXPECT_TRUE(diff.empty()) << "float32 grad of input " << i << " vs float64: " << diff;
    }
}

} // namespace shardline::autograd::gradcheck
