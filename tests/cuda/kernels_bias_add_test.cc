// BiasAdd on CUDA against a float64 reference: the 16-byte vector path, the scalar path (odd widths, misaligned
// pointers), in place.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::BiasAdd;
using kernels::BiasAddArgs;

Values RefBiasAdd(const Values& x, const Values& bias) {
    Values out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
        out[i] = x[i] + bias[i % bias.size()];
    }
    return out;
}

// Widths that are and are not multiples of every vector width (4 floats, 8 halves); a tall shape spanning many blocks;
// no rows; no columns.
const std::vector<Shape> kShapes = {{1}, {9}, {5, 7}, {3, 64}, {2, 3, 24}, {4097, 40}, {0, 8}, {4, 0}};

using CudaBiasAddTest = CudaParamTest<DType>;

TEST_P(CudaBiasAddTest, AddsTheBiasToEveryRow) {
    const DType dtype = GetParam();
    for (const Shape& shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = RandomGpu(shape, dtype, 80, "x");
        const Tensor bias = RandomGpu({shape.back()}, dtype, 80, "bias");
        const Values want = RefBiasAdd(x.ToDoubleVector(), bias.ToDoubleVector());
        Tensor out = RandomGpu(shape, dtype, 99, "poison", 100.0);
        BiasAdd(BiasAddArgs{.x = x, .bias = bias, .out = out});
        EXPECT_TRUE(ValuesMatch(out, want, dtype));
        EXPECT_TRUE(ValuesMatch(BiasAdd(x, bias), want, dtype)) << "allocating wrapper";
        Tensor inplace = x.Clone();
        BiasAdd(BiasAddArgs{.x = inplace, .bias = bias, .out = inplace});
        EXPECT_TRUE(ValuesMatch(inplace, want, dtype)) << "out aliases x";
    }
    // Vector-friendly widths with pointers off the 16-byte boundary take the scalar kernel.
    const Tensor x0 = RandomGpu({33, 64}, dtype, 81, "x");
    const Tensor b0 = RandomGpu({64}, dtype, 81, "bias");
    MisalignedTensor x = MisalignedCopy(x0);
    MisalignedTensor b = MisalignedCopy(b0);
    MisalignedTensor out = MisalignedCopy(RandomGpu({33, 64}, dtype, 99, "poison"));
    BiasAdd(BiasAddArgs{.x = x.view, .bias = b.view, .out = out.view});
    EXPECT_TRUE(ValuesMatch(out.view, RefBiasAdd(x0.ToDoubleVector(), b0.ToDoubleVector()), dtype)) << "misaligned";
}

INSTANTIATE_TEST_SUITE_P(DType, CudaBiasAddTest, CudaDTypes(), DTypeParamName);

TEST_F(CudaTest, BiasAddRejectsInt64AndFloat64) {
    for (const DType dtype : {DType::kInt64, DType::kFloat64}) {
        const Tensor x = Tensor::Zeros({4, 6}, dtype, Gpu());
        const Tensor bias = Tensor::Zeros({6}, dtype, Gpu());
        try {
            (void)BiasAdd(x, bias);
            ADD_FAILURE() << "BiasAdd accepted " << DTypeName(dtype) << " on CUDA";
        } catch (const DTypeError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("BiasAdd"), std::string::npos) << msg;
            EXPECT_NE(msg.find("CUDA kernels take float32, float16 or bfloat16"), std::string::npos) << msg;
        }
    }
}

} // namespace
} // namespace shardline::testing
