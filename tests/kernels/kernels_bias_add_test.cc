// BiasAdd on every device against a float64 reference: in place and allocating, odd widths and tall shapes (CUDA's
// 16-byte vector path and its scalar path), misaligned pointers; and each device's error messages.

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::BiasAdd;
using kernels::BiasAddArgs;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// out[r, j] = x[r, j] + bias[j].
Values RefBiasAdd(const Values &x, const Values &bias) {
    Values out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
        out[i] = x[i] + bias[i % bias.size()];
    }
    return out;
}

// A vector; widths that are and are not multiples of every vector width (4 floats, 8 halves); leading dims; a tall
// shape spanning many blocks; no rows; no columns.
const std::vector<Shape> kShapes = {{1},        {9},        {5, 7}, {3, 64}, {2, 3, 9},
                                    {2, 3, 24}, {4097, 40}, {0, 4}, {0, 8},  {4, 0}};

using BiasAddTest = DeviceTest<>;

TEST_P(BiasAddTest, AddsTheBiasToEveryRow) {
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = Random(shape, dtype(), 80, "x");
        const Tensor bias = Random({shape.back()}, dtype(), 80, "bias");
        const Values want = RefBiasAdd(x.ToDoubleVector(), bias.ToDoubleVector());
        if (!want.empty()) {
            ASSERT_GT(AbsSum(bias.ToDoubleVector()), 0.0);
        }
        Tensor out = Poison(shape, dtype());
        BiasAdd(BiasAddArgs{.x = x, .bias = bias, .out = out});
        EXPECT_TRUE(ValuesMatch(out, want, dtype()));
        EXPECT_TRUE(ValuesMatch(BiasAdd(x, bias), want, dtype())) << "allocating wrapper";
        Tensor inplace = x.Clone();
        BiasAdd(BiasAddArgs{.x = inplace, .bias = bias, .out = inplace});
        EXPECT_TRUE(ValuesMatch(inplace, want, dtype())) << "out aliases x";
    }
}

TEST_P(BiasAddTest, MisalignedPointersTakeTheScalarPath) {
    // Vector-friendly widths with pointers off the 16-byte boundary.
    const Tensor x0 = Random({33, 64}, dtype(), 81, "x");
    const Tensor b0 = Random({64}, dtype(), 81, "bias");
    MisalignedTensor x = MisalignedCopy(x0);
    MisalignedTensor b = MisalignedCopy(b0);
    MisalignedTensor out = MisalignedCopy(Random({33, 64}, dtype(), 99, "poison"));
    BiasAdd(BiasAddArgs{.x = x.view, .bias = b.view, .out = out.view});
    EXPECT_TRUE(ValuesMatch(out.view, RefBiasAdd(x0.ToDoubleVector(), b0.ToDoubleVector()), dtype()));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(BiasAddTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Errors

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
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { BiasAdd(Tensor::Zeros({4, 6}, DType::kInt64), Tensor::Zeros({6}, DType::kInt64)); }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("CPU kernels take float32 or float64"),
                      HasSubstr("Tensor[4, 6] int64 cpu")));
    Tensor out = Tensor::Zeros({6, 4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { BiasAdd(BiasAddArgs{.x = x, .bias = Tensor::Zeros({6}, DType::kFloat32), .out = out}); }),
                AllOf(HasSubstr("BiasAdd"), HasSubstr("out must have shape [4, 6]")));
}

TEST_F(CudaTest, BiasAddRejectsInt64AndFloat64) {
    for (const DType dtype : {DType::kInt64, DType::kFloat64}) {
        const Tensor x = Tensor::Zeros({4, 6}, dtype, Gpu());
        const Tensor bias = Tensor::Zeros({6}, dtype, Gpu());
        EXPECT_THAT(MessageOf<DTypeError>([&] { (void)BiasAdd(x, bias); }),
                    AllOf(HasSubstr("BiasAdd"), HasSubstr("CUDA kernels take float32, float16 or bfloat16")))
            << DTypeName(dtype);
    }
}

} // namespace
} // namespace shardline::testing
