// Sum over any set of dims (keepdim or not) on every device against a float64 reference, into an output of the input's
// dtype or float32, and the CPU's float64 accumulation.

#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::Sum;
using kernels::SumArgs;
using kernels::SumOutputShape;

/// Σ over `dims` (empty = all) of a row-major tensor, as a row-major tensor of the kept dims (keepdim only changes the
/// shape).
Values RefSum(const Values &x, const Shape &shape, const std::vector<int> &dims) {
    const int rank = static_cast<int>(shape.size());
    std::vector<bool> reduced(shape.size(), dims.empty());
    for (int d : dims) {
        reduced[d < 0 ? d + rank : d] = true;
    }
    Shape kept;
    for (int d = 0; d < rank; ++d) {
        if (!reduced[d]) {
            kept.push_back(shape[d]);
        }
    }
    Values out(static_cast<std::size_t>(Numel(kept)), 0.0);
    std::vector<std::int64_t> coord(shape.size());
    for (std::int64_t flat = 0; flat < static_cast<std::int64_t>(x.size()); ++flat) {
        // Unravel flat, then ravel the kept coordinates.
        std::int64_t rem = flat;
        for (int d = rank - 1; d >= 0; --d) {
            coord[d] = rem % shape[d];
            rem /= shape[d];
        }
        std::int64_t o = 0;
        for (int d = 0; d < rank; ++d) {
            if (!reduced[d]) {
                o = o * shape[d] + coord[d];
            }
        }
        out[o] += x[flat];
    }
    return out;
}

struct SumCase {
    Shape shape;
    std::vector<int> dims;
    std::string name;
};
void PrintTo(const SumCase &c, std::ostream *os) { *os << c.name; }

using SumParam = std::tuple<DeviceDType, SumCase, bool>;
using SumTest = DeviceTest<SumParam>;

TEST_P(SumTest, MatchesReferenceAndShape) {
    const SumCase &c = std::get<1>(GetParam());
    const bool keepdim = std::get<2>(GetParam());
    // CUDA accumulates in fp32: there the data has a mean, so that a sum cannot cancel to near zero, where a relative
    // check of a single output would be meaningless. The CPU accumulates in float64 and keeps mean-0 data.
    const double mean = device().is_cuda() ? 0.5 : 0.0;
    const Tensor x = Random(c.shape, dtype(), 12, "sum.x", 1.0, mean);
    const Values xv = x.ToDoubleVector();
    ASSERT_GT(AbsSum(xv), 0.0);
    const Tensor out = Sum(x, {.dims = c.dims, .keepdim = keepdim});
    EXPECT_EQ(out.shape(), SumOutputShape(c.shape, {.dims = c.dims, .keepdim = keepdim}, "test"));
    EXPECT_EQ(out.dtype(), dtype());
    EXPECT_TRUE(ValuesMatch(out, RefSum(xv, c.shape, c.dims), dtype()));
}

auto SumCases(DeviceType type) {
    return DeviceCases(type,
                       ::testing::Values(SumCase{{3, 4, 5}, {}, "all"}, SumCase{{3, 4, 5}, {0}, "d0"},
                                         SumCase{{3, 4, 5}, {1}, "d1"}, SumCase{{3, 4, 5}, {2}, "d2"},
                                         SumCase{{3, 4, 5}, {-1}, "dm1"}, SumCase{{3, 4, 5}, {0, 2}, "d02"},
                                         SumCase{{3, 4, 5}, {2, 1}, "d21"}, SumCase{{3, 4, 5}, {0, 1, 2}, "d012"},
                                         SumCase{{2, 3, 4, 5}, {-3, -1}, "r4_dm3_dm1"},
                                         SumCase{{2, 3, 4, 5}, {0, 3}, "r4_d03"}, SumCase{{1000}, {0}, "long"},
                                         SumCase{{7, 1, 3}, {1}, "size1"}, SumCase{{6}, {}, "vector_all"}),
                       ::testing::Bool());
}
std::string SumCaseName(const ::testing::TestParamInfo<SumParam> &info) {
    return std::string(DTypeName(std::get<0>(info.param).dtype)) + "_" + std::get<1>(info.param).name +
           (std::get<2>(info.param) ? "_keepdim" : "");
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(SumTest, SumCases, SumCaseName);

using SumShapesTest = DeviceTest<>;

struct ShapeCase {
    Shape shape;
    std::vector<int> dims;
    bool keepdim;
    double mean; ///< of the data: a sum dominated by its mean cannot cancel to near zero, where a relative check of a
                 ///< single output would be meaningless; small enough that float16 outputs stay finite
};

TEST_P(SumShapesTest, MatchesFloat64IntoTheInputDTypeAndFloat32) {
    const std::vector<ShapeCase> cases = {
        {{3, 5, 129}, {}, false, 1.0},    {{3, 5, 129}, {0}, false, 0.5}, {{3, 5, 129}, {-1}, false, 0.5},
        {{3, 5, 129}, {0, 2}, true, 0.5}, {{3, 5, 129}, {1}, true, 0.5},  {{4096, 33}, {0}, false, 0.5},
        {{33, 4096}, {1}, false, 0.5},    {{1, 1}, {}, false, 0.5},       {{(1 << 20) + 1}, {}, false, 0.05},
    };
    for (const ShapeCase &c : cases) {
        const Tensor x = Random(c.shape, dtype(), 45, "x", 1.0, c.mean);
        const Values ref = RefSum(x.ToDoubleVector(), c.shape, c.dims);
        const Shape out_shape = SumOutputShape(c.shape, {.dims = c.dims, .keepdim = c.keepdim}, "test");
        for (const DType out_dtype : {dtype(), DType::kFloat32}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(c.shape) << " dims " << ::testing::PrintToString(c.dims)
                                              << (c.keepdim ? " keepdim" : "") << " -> " << DTypeName(out_dtype));
            Tensor out = Poison(out_shape, out_dtype);
            Sum(SumArgs{.x = x, .out = out, .dims = c.dims, .keepdim = c.keepdim});
            EXPECT_TRUE(ValuesMatch(out, ref, out_dtype));
        }
        const Tensor wrapped = Sum(x, {.dims = c.dims, .keepdim = c.keepdim});
        EXPECT_EQ(wrapped.shape(), out_shape);
        EXPECT_TRUE(ValuesMatch(wrapped, ref, dtype())) << "allocating wrapper";
    }
}

TEST_P(SumShapesTest, EmptyReducedDimGivesZeros) {
    const Tensor x = Tensor::Empty({0, 3}, dtype(), device());
    EXPECT_EQ(Sum(x, {.dims = {0}}).ToDoubleVector(), Values(3, 0.0));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(SumShapesTest, DeviceCases, DeviceDTypeName);

TEST(SumDTypeTest, OutputDTypeMayDifferFromInput) {
    const Tensor x32 = RandomTensor({5, 64}, DType::kFloat32, Device::CPU(), 13, "x32");
    Tensor out64 = Tensor::Empty({5}, DType::kFloat64);
    Sum(SumArgs{.x = x32, .out = out64, .dims = {1}});
    const Values want = RefSum(x32.ToDoubleVector(), {5, 64}, {1});
    // Accumulated in float64 and never rounded to float32: equal to the reference up to fp64 rounding.
    EXPECT_TRUE(ValuesMatch(out64, want, DType::kFloat64));

    const Tensor x64 = RandomTensor({5, 64}, DType::kFloat64, Device::CPU(), 13, "x64");
    Tensor out32 = Tensor::Empty({1, 64}, DType::kFloat32);
    Sum(SumArgs{.x = x64, .out = out32, .dims = {0}, .keepdim = true});
    EXPECT_TRUE(ValuesMatch(out32, RefSum(x64.ToDoubleVector(), {5, 64}, {0}), DType::kFloat32));
}

} // namespace
} // namespace shardline::testing
