// Outer products on CUDA against float64 references.

#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/outer.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::OuterBackward;
using kernels::OuterBackwardArgs;
using kernels::OuterForward;
using kernels::OuterForwardArgs;

struct OuterDims {
    std::int64_t m;
    std::int64_t n;
};
const std::vector<OuterDims> kOuterDims = {{1, 1}, {17, 33}, {128, 7}, {1000, 3}, {64, 256}};

using CudaOuterTest = CudaParamTest<DType>;

TEST_P(CudaOuterTest, ForwardMatchesFloat64) {
    const DType dtype = GetParam();
    for (const OuterDims& d : kOuterDims) {
        SCOPED_TRACE(::testing::Message() << "x [" << d.m << "], y [" << d.n << "]");
        const Tensor x = RandomGpu({d.m}, dtype, 30, "x");
        const Tensor y = RandomGpu({d.n}, dtype, 30, "y");
        Tensor out = RandomGpu({d.m, d.n}, dtype, 999, "poison", 100.0);
        OuterForward(OuterForwardArgs{.x = x, .y = y, .out = out});
        const Values xv = x.ToDoubleVector();
        const Values yv = y.ToDoubleVector();
        Values ref(static_cast<std::size_t>(d.m * d.n));
        for (std::int64_t i = 0; i < d.m; ++i) {
            for (std::int64_t j = 0; j < d.n; ++j) {
                ref[i * d.n + j] = xv[i] * yv[j];
            }
        }
        EXPECT_TRUE(ValuesMatch(out, ref, dtype));
        EXPECT_TRUE(ValuesMatch(OuterForward(x, y), ref, dtype)) << "allocating wrapper";
    }
}

TEST_P(CudaOuterTest, BackwardMatchesFloat64) {
    const DType dtype = GetParam();
    for (const OuterDims& d : kOuterDims) {
        SCOPED_TRACE(::testing::Message() << "x [" << d.m << "], y [" << d.n << "]");
        const Tensor x = RandomGpu({d.m}, dtype, 31, "x");
        const Tensor y = RandomGpu({d.n}, dtype, 31, "y");
        const Tensor dout = RandomGpu({d.m, d.n}, dtype, 31, "dout");
        const Values xv = x.ToDoubleVector();
        const Values yv = y.ToDoubleVector();
        const Values gv = dout.ToDoubleVector();
        Values dx_ref(static_cast<std::size_t>(d.m), 0.0);
        Values dy_ref(static_cast<std::size_t>(d.n), 0.0);
        for (std::int64_t i = 0; i < d.m; ++i) {
            for (std::int64_t j = 0; j < d.n; ++j) {
                dx_ref[i] += gv[i * d.n + j] * yv[j];
                dy_ref[j] += gv[i * d.n + j] * xv[i];
            }
        }
        Tensor dx = RandomGpu({d.m}, dtype, 999, "poison_x", 100.0);
        Tensor dy = RandomGpu({d.n}, dtype, 999, "poison_y", 100.0);
        OuterBackward(OuterBackwardArgs{.dout = dout, .x = x, .y = y, .dx = &dx, .dy = &dy});
        EXPECT_TRUE(ValuesMatch(dx, dx_ref, dtype)) << "dx = dout·y";
        EXPECT_TRUE(ValuesMatch(dy, dy_ref, dtype)) << "dy = doutᵀ·x";

        // Either gradient alone (the other pointer null).
        Tensor dx_only = RandomGpu({d.m}, dtype, 998, "poison_x", 100.0);
        OuterBackward(OuterBackwardArgs{.dout = dout, .x = x, .y = y, .dx = &dx_only});
        EXPECT_TRUE(ValuesMatch(dx_only, dx_ref, dtype)) << "dx only";
        Tensor dy_only = RandomGpu({d.n}, dtype, 997, "poison_y", 100.0);
        OuterBackward(OuterBackwardArgs{.dout = dout, .x = x, .y = y, .dy = &dy_only});
        EXPECT_TRUE(ValuesMatch(dy_only, dy_ref, dtype)) << "dy only";
    }
}

INSTANTIATE_TEST_SUITE_P(DType, CudaOuterTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
