// BiasAdd on the CPU against a float64 reference, in place and allocating, and its error messages.

#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using ::testing::AllOf;
using testing::CpuDTypes;
using testing::DTypeParamName;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::Values;
using testing::ValuesMatch;

/// out[r, j] = x[r, j] + bias[j].
Values RefBiasAdd(const Values &x, const Values &bias) {
    Values out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
        out[i] = x[i] + bias[i % bias.size()];
    }
    return out;
}

// A vector, odd sizes, leading dims, no rows, no columns.
const std::vector<Shape> kShapes = {{1}, {9}, {5, 7}, {2, 3, 9}, {0, 4}, {4, 0}};

class BiasAddTest : public ::testing::TestWithParam<DType> {};

TEST_P(BiasAddTest, AddsTheBiasToEveryRow) {
    const DType dtype = GetParam();
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = RandomTensor(shape, dtype, Device::CPU(), 40, "x");
        const Tensor bias = RandomTensor({shape.back()}, dtype, Device::CPU(), 40, "bias");
        const Values want = RefBiasAdd(x.ToDoubleVector(), bias.ToDoubleVector());
        if (!want.empty()) {
            ASSERT_GT(AbsSum(bias.ToDoubleVector()), 0.0);
        }
        Tensor out = RandomTensor(shape, dtype, Device::CPU(), 99, "poison");
        BiasAdd(BiasAddArgs{.x = x, .bias = bias, .out = out});
        EXPECT_TRUE(ValuesMatch(out, want, dtype));
        EXPECT_TRUE(ValuesMatch(BiasAdd(x, bias), want, dtype)) << "allocating wrapper";
        Tensor inplace = x.Clone();
        BiasAdd(BiasAddArgs{.x = inplace, .bias = bias, .out = inplace});
        EXPECT_TRUE(ValuesMatch(inplace, want, dtype)) << "out aliases x";
    }
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, BiasAddTest, CpuDTypes(), DTypeParamName);

template <class ErrorType> std::string MessageOf(const std::function<void()> &f) {
    try {
        f();
    } catch (const ErrorType &e) {
        return e.what();
    } catch (const std::exception &e) {
        ADD_FAILURE() << "threw the wrong type: " << e.what();
        return {};
    }
    ADD_FAILURE() << "threw nothing";
    return {};
}

TEST(BiasAddErrorsTest, BiasMustMatchTheLastDimAndTheDType) {
    const Tensor x = Tensor::Zeros({4, 6}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { BiasAdd(x, Tensor::Zeros({4}, DType::kFloat32)); }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("bias must have shape [6]"), HasSubstr("Tensor[4] float32 cpu")));
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { BiasAdd(x, Tensor::Zeros({6}, DType::kFloat64)); }),
        AllOf(HasSubstr("BiasAdd"), HasSubstr("bias and x must have one dtype"), HasSubstr("Tensor[6] float64 cpu")));
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { BiasAdd(Tensor::Full({}, 1.0, DType::kFloat32), Tensor::Zeros({1}, DType::kFloat32)); }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("x must have rank >= 1")));
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    BiasAdd(Tensor::Zeros({4, 6}, DType::kInt64), Tensor::Zeros({6}, DType::kInt64));
                }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("CPU kernels take float32 or float64"),
                      HasSubstr("Tensor[4, 6] int64 cpu")));
    Tensor out = Tensor::Zeros({6, 4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { BiasAdd(BiasAddArgs{.x = x, .bias = Tensor::Zeros({6}, DType::kFloat32), .out = out}); }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("out must have shape [4, 6]")));
}

} // namespace
} // namespace shardline::kernels
