// GELU (tanh and erf), Add, Scale and Sum on CUDA against float64 references.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/elementwise.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::Add;
using kernels::AddArgs;
using kernels::GeluApproximation;
using kernels::GeluBackward;
using kernels::GeluBackwardArgs;
using kernels::GeluForward;
using kernels::GeluForwardArgs;
using kernels::Scale;
using kernels::ScaleArgs;
using kernels::Sum;
using kernels::SumArgs;

// Odd element counts leave a tail after any vector width; one tensor spans many blocks.
const std::vector<Shape> kShapes = {{1}, {7, 33}, {3, 5, 129}, {(1 << 18) + 7}};

Tensor Poison(const Shape& shape, DType dtype) {
    return RandomGpu(shape, dtype, 999, "poison", 100.0);
}

using CudaGeluTest = CudaParamTest<std::tuple<DType, GeluApproximation>>;

std::string GeluParamName(const ::testing::TestParamInfo<std::tuple<DType, GeluApproximation>>& info) {
    return std::string(DTypeName(std::get<0>(info.param))) +
           (std::get<1>(info.param) == GeluApproximation::kTanh ? "_tanh" : "_erf");
}

TEST_P(CudaGeluTest, ForwardMatchesFloat64) {
    const auto [dtype, approx] = GetParam();
    for (const Shape& shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = RandomGpu(shape, dtype, 40, "x");
        Tensor y = Poison(shape, dtype);
        GeluForward(GeluForwardArgs{.x = x, .y = y, .approximation = approx});
        Values ref = x.ToDoubleVector();
        for (double& v : ref) {
            v = approx == GeluApproximation::kTanh ? RefGeluTanh(v) : RefGeluErf(v);
        }
        EXPECT_TRUE(ValuesMatch(y, ref, dtype));
        EXPECT_TRUE(ValuesMatch(GeluForward(x, approx), ref, dtype)) << "allocating wrapper";
    }
    // An input that does not start on a vector boundary.
    const Tensor x0 = RandomGpu({1029}, dtype, 41, "x");
    MisalignedTensor x = MisalignedCopy(x0);
    MisalignedTensor y = MisalignedCopy(Poison({1029}, dtype));
    GeluForward(GeluForwardArgs{.x = x.view, .y = y.view, .approximation = approx});
    Values ref = x0.ToDoubleVector();
    for (double& v : ref) {
        v = approx == GeluApproximation::kTanh ? RefGeluTanh(v) : RefGeluErf(v);
    }
    EXPECT_TRUE(ValuesMatch(y.view, ref, dtype)) << "misaligned";
}

TEST_P(CudaGeluTest, BackwardMatchesFloat64) {
    const auto [dtype, approx] = GetParam();
    for (const Shape& shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor x = RandomGpu(shape, dtype, 42, "x");
        const Tensor dy = RandomGpu(shape, dtype, 42, "dy");
        Tensor dx = Poison(shape, dtype);
        GeluBackward(GeluBackwardArgs{.dy = dy, .x = x, .dx = dx, .approximation = approx});
        const Values xv = x.ToDoubleVector();
        const Values dyv = dy.ToDoubleVector();
        Values ref(xv.size());
        for (std::size_t i = 0; i < xv.size(); ++i) {
            ref[i] = dyv[i] * (approx == GeluApproximation::kTanh ? RefGeluTanhGrad(xv[i]) : RefGeluErfGrad(xv[i]));
        }
        EXPECT_TRUE(ValuesMatch(dx, ref, dtype));
        EXPECT_TRUE(ValuesMatch(GeluBackward(dy, x, approx), ref, dtype)) << "allocating wrapper";
    }
}

INSTANTIATE_TEST_SUITE_P(DType, CudaGeluTest,
                         ::testing::Combine(CudaDTypes(),
                                            ::testing::Values(GeluApproximation::kTanh, GeluApproximation::kErf)),
                         GeluParamName);

using CudaElementwiseTest = CudaParamTest<DType>;

TEST_P(CudaElementwiseTest, AddMatchesFloat64) {
    const DType dtype = GetParam();
    for (const Shape& shape : kShapes) {
        for (const double alpha : {1.0, -0.5, 2.5}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << ", alpha " << alpha);
            const Tensor a = RandomGpu(shape, dtype, 43, "a");
            const Tensor b = RandomGpu(shape, dtype, 43, "b");
            const Values av = a.ToDoubleVector();
            const Values bv = b.ToDoubleVector();
            Values ref(av.size());
            for (std::size_t i = 0; i < av.size(); ++i) {
                ref[i] = av[i] + alpha * bv[i];
            }
            Tensor out = Poison(shape, dtype);
            Add(AddArgs{.a = a, .b = b, .out = out, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(out, ref, dtype));
            EXPECT_TRUE(ValuesMatch(Add(a, b, alpha), ref, dtype)) << "allocating wrapper";
            // In place: out aliases a.
            Tensor inplace = a.Clone();
            Add(AddArgs{.a = inplace, .b = b, .out = inplace, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(inplace, ref, dtype)) << "out aliases a";
        }
    }
}

TEST_P(CudaElementwiseTest, ScaleMatchesFloat64) {
    const DType dtype = GetParam();
    for (const Shape& shape : kShapes) {
        for (const double alpha : {0.37, -3.0}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << ", alpha " << alpha);
            const Tensor x = RandomGpu(shape, dtype, 44, "x");
            Values ref = x.ToDoubleVector();
            for (double& v : ref) {
                v *= alpha;
            }
            Tensor out = Poison(shape, dtype);
            Scale(ScaleArgs{.x = x, .out = out, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(out, ref, dtype));
            EXPECT_TRUE(ValuesMatch(Scale(x, alpha), ref, dtype)) << "allocating wrapper";
            Tensor inplace = x.Clone();
            Scale(ScaleArgs{.x = inplace, .out = inplace, .alpha = alpha});
            EXPECT_TRUE(ValuesMatch(inplace, ref, dtype)) << "out aliases x";
        }
    }
}

/// Σ over `dims` of x (row-major, shape), as Sum's output (reduced dims removed; keepdim only changes the shape).
Values RefSum(const Values& x, const Shape& shape, std::vector<int> dims) {
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
    std::vector<std::int64_t> idx(shape.size());
    for (std::size_t f = 0; f < x.size(); ++f) {
        std::int64_t rem = static_cast<std::int64_t>(f);
        for (int d = rank; d-- > 0;) {
            idx[d] = rem % shape[d];
            rem /= shape[d];
        }
        std::int64_t o = 0;
        for (int d = 0; d < rank; ++d) {
            if (!reduced[d]) {
                o = o * shape[d] + idx[d];
            }
        }
        out[static_cast<std::size_t>(o)] += x[f];
    }
    return out;
}

struct SumCase {
    Shape shape;
    std::vector<int> dims;
    bool keepdim;
    double mean; ///< of the data: a sum dominated by its mean cannot cancel to near zero, where a relative check of a
                 ///< single output would be meaningless; small enough that float16 outputs stay finite
};

TEST_P(CudaElementwiseTest, SumMatchesFloat64) {
    const DType dtype = GetParam();
    const std::vector<SumCase> cases = {
        {{3, 5, 129}, {}, false, 1.0},    {{3, 5, 129}, {0}, false, 0.5}, {{3, 5, 129}, {-1}, false, 0.5},
        {{3, 5, 129}, {0, 2}, true, 0.5}, {{3, 5, 129}, {1}, true, 0.5},  {{4096, 33}, {0}, false, 0.5},
        {{33, 4096}, {1}, false, 0.5},    {{1, 1}, {}, false, 0.5},       {{(1 << 20) + 1}, {}, false, 0.05},
    };
    for (const SumCase& c : cases) {
        const Tensor x = RandomGpu(c.shape, dtype, 45, "x", 1.0, c.mean);
        const Values ref = RefSum(x.ToDoubleVector(), c.shape, c.dims);
        const Shape out_shape = kernels::SumOutputShape(c.shape, c.dims, c.keepdim, "test");
        for (const DType out_dtype : {dtype, DType::kFloat32}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(c.shape) << " dims " << ::testing::PrintToString(c.dims)
                                              << (c.keepdim ? " keepdim" : "") << " -> " << DTypeName(out_dtype));
            Tensor out = Poison(out_shape, out_dtype);
            Sum(SumArgs{.x = x, .out = out, .dims = c.dims, .keepdim = c.keepdim});
            EXPECT_TRUE(ValuesMatch(out, ref, out_dtype));
        }
        const Tensor wrapped = Sum(x, c.dims, c.keepdim);
        EXPECT_EQ(wrapped.shape(), out_shape);
        EXPECT_TRUE(ValuesMatch(wrapped, ref, dtype)) << "allocating wrapper";
    }
}

INSTANTIATE_TEST_SUITE_P(DType, CudaElementwiseTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
