#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::RandomTensor;
using testing::Values;
using testing::ValuesMatch;

/// Σ over `dims` (empty = all) of a row-major tensor, as a row-major tensor of the kept dims.
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
    for (std::int64_t flat = 0; flat < static_cast<std::int64_t>(x.size()); ++flat) {
        // Unravel flat, then ravel the kept coordinates.
        std::vector<std::int64_t> coord(shape.size());
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

class SumTest : public ::testing::TestWithParam<std::tuple<DType, SumCase, bool>> {};

TEST_P(SumTest, MatchesReferenceAndShape) {
    const auto &[dtype, c, keepdim] = GetParam();
    const Tensor x = RandomTensor(c.shape, dtype, Device::CPU(), 12, "sum.x");
    const Values xv = x.ToDoubleVector();
    ASSERT_GT(AbsSum(xv), 0.0);
    const Tensor out = Sum(x, c.dims, keepdim);
    EXPECT_EQ(out.shape(), SumOutputShape(c.shape, c.dims, keepdim, "test"));
    EXPECT_EQ(out.dtype(), dtype);
    EXPECT_TRUE(ValuesMatch(out, RefSum(xv, c.shape, c.dims), dtype));
}

INSTANTIATE_TEST_SUITE_P(
    Dims, SumTest,
    ::testing::Combine(CpuDTypes(),
                       ::testing::Values(SumCase{{3, 4, 5}, {}, "all"}, SumCase{{3, 4, 5}, {0}, "d0"},
                                         SumCase{{3, 4, 5}, {1}, "d1"}, SumCase{{3, 4, 5}, {2}, "d2"},
                                         SumCase{{3, 4, 5}, {-1}, "dm1"}, SumCase{{3, 4, 5}, {0, 2}, "d02"},
                                         SumCase{{3, 4, 5}, {2, 1}, "d21"}, SumCase{{3, 4, 5}, {0, 1, 2}, "d012"},
                                         SumCase{{2, 3, 4, 5}, {-3, -1}, "r4_dm3_dm1"},
                                         SumCase{{2, 3, 4, 5}, {0, 3}, "r4_d03"}, SumCase{{1000}, {0}, "long"},
                                         SumCase{{7, 1, 3}, {1}, "size1"}, SumCase{{6}, {}, "vector_all"}),
                       ::testing::Bool()),
    [](const auto &info) {
        return std::string(DTypeName(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name +
               (std::get<2>(info.param) ? "_keepdim" : "");
    });

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

TEST(SumDTypeTest, EmptyReducedDimGivesZeros) {
    const Tensor x = Tensor::Empty({0, 3}, DType::kFloat32);
    EXPECT_EQ(Sum(x, {0}).ToDoubleVector(), Values(3, 0.0));
}

} // namespace
} // namespace shardline::kernels
