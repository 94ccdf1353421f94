// LinearBackward on CUDA (dx, dweight, dbias together; the separate bias grad on a side stream) against float64
// references: every subset of outputs, fp32 main-grad accumulation, the legacy provider, and a result read on the
// compute stream right after the call (the side stream must have joined it).

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::LinearBackward;
using kernels::LinearBackwardArgs;

struct Case {
    std::int64_t m, in, out;
};
// Aligned shapes (fused BGRADB possible), odd features (scalar column sum, 2-byte alignment) and a tall one whose
// column sum takes the two-pass path.
const std::vector<Case> kCases = {{256, 128, 96}, {33, 17, 41}, {4096, 64, 1032}};

std::string Name(const Case& c) {
    return "m=" + std::to_string(c.m) + " in=" + std::to_string(c.in) + " out=" + std::to_string(c.out);
}

Tensor Poison(const Shape& shape, DType dtype) {
    return RandomGpu(shape, dtype, 999, "poison", 100.0);
}

using CudaLinearBackwardTest = CudaParamTest<DType>;

TEST_P(CudaLinearBackwardTest, EverySubsetOfGradsMatchesFloat64) {
    const DType dtype = GetParam();
    for (const Case& c : kCases) {
        const Tensor x = RandomGpu({c.m, c.in}, dtype, 41, "x");
        const Tensor w = RandomGpu({c.out, c.in}, dtype, 41, "w");
        const Tensor dy = RandomGpu({c.m, c.out}, dtype, 41, "dy");
        const Values dyv = dy.ToDoubleVector();
        const Values ref_dx = RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_db = RefColumnSum(dyv, c.m, c.out);
        for (int mask = 1; mask < 8; ++mask) {
            const bool want_dx = (mask & 1) != 0;
            const bool want_dw = (mask & 2) != 0;
            const bool want_db = (mask & 4) != 0;
            SCOPED_TRACE(::testing::Message() << Name(c) << (want_dx ? " dx" : "") << (want_dw ? " dw" : "")
                                              << (want_db ? " db" : ""));
            Tensor dx = Poison({c.m, c.in}, dtype);
            Tensor dw = Poison({c.out, c.in}, dtype);
            Tensor db = Poison({c.out}, dtype);
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .x = &x,
                                              .weight = &w,
                                              .dx = want_dx ? &dx : nullptr,
                                              .dweight = want_dw ? &dw : nullptr,
                                              .dbias = want_db ? &db : nullptr});
            // Read right away: db comes from the side stream, which must have joined the compute stream.
            if (want_db) {
                EXPECT_TRUE(ValuesMatch(db, ref_db, dtype, kEpilogueRoundings)) << "db";
            }
            if (want_dx) {
                EXPECT_TRUE(ValuesMatch(dx, ref_dx, dtype)) << "dx";
            }
            if (want_dw) {
                EXPECT_TRUE(ValuesMatch(dw, ref_dw, dtype, kEpilogueRoundings)) << "dw";
            }
        }
    }
}

TEST_P(CudaLinearBackwardTest, AccumulatesIntoFloat32MainGrads) {
    const DType dtype = GetParam();
    for (const Case& c : kCases) {
        SCOPED_TRACE(Name(c));
        const Tensor x = RandomGpu({c.m, c.in}, dtype, 42, "x");
        const Tensor w = RandomGpu({c.out, c.in}, dtype, 42, "w");
        const Tensor dy = RandomGpu({c.m, c.out}, dtype, 42, "dy");
        const double scale = std::sqrt(static_cast<double>(c.m));
        Tensor main_dw = RandomGpu({c.out, c.in}, DType::kFloat32, 42, "main_dw", scale);
        Tensor main_db = RandomGpu({c.out}, DType::kFloat32, 42, "main_db", scale);
        Tensor dx = Poison({c.m, c.in}, dtype);
        const Values old_dw = main_dw.ToDoubleVector();
        const Values old_db = main_db.ToDoubleVector();
        const Values dyv = dy.ToDoubleVector();
        const Values new_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
        const Values new_db = RefColumnSum(dyv, c.m, c.out);
        for (int step = 1; step <= 2; ++step) {
            SCOPED_TRACE(::testing::Message() << "step " << step);
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .x = &x,
                                              .weight = &w,
                                              .dx = &dx,
                                              .dweight = &main_dw,
                                              .dbias = &main_db,
                                              .accumulate = true});
            Values want_dw(old_dw.size());
            Values want_db(old_db.size());
            for (std::size_t i = 0; i < want_dw.size(); ++i) {
                want_dw[i] = old_dw[i] + step * new_dw[i];
            }
            for (std::size_t i = 0; i < want_db.size(); ++i) {
                want_db[i] = old_db[i] + step * new_db[i];
            }
            EXPECT_TRUE(ValuesMatch(main_db, want_db, DType::kFloat32, step)) << "db";
            EXPECT_TRUE(ValuesMatch(main_dw, want_dw, DType::kFloat32, step)) << "dw";
            EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype));
        }
    }
}

TEST_P(CudaLinearBackwardTest, LegacyProviderComputesTheSame) {
    const DType dtype = GetParam();
    ScopedProvider legacy("legacy");
    const Case c{512, 128, 200};
    const Tensor x = RandomGpu({c.m, c.in}, dtype, 43, "x");
    const Tensor w = RandomGpu({c.out, c.in}, dtype, 43, "w");
    const Tensor dy = RandomGpu({c.m, c.out}, dtype, 43, "dy");
    Tensor dx = Poison({c.m, c.in}, dtype);
    Tensor dw = Poison({c.out, c.in}, dtype);
    Tensor db = Poison({c.out}, dtype);
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w, .dx = &dx, .dweight = &dw, .dbias = &db});
    const Values dyv = dy.ToDoubleVector();
    EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype));
    EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in), dtype));
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv, c.m, c.out), dtype));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaLinearBackwardTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
