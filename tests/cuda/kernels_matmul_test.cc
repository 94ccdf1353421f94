// Batched matmul on CUDA with torch.matmul broadcasting, all four transposes, against float64 references.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/matmul.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::MatmulBackwardInput;
using kernels::MatmulBackwardInputArgs;
using kernels::MatmulBackwardOther;
using kernels::MatmulBackwardOtherArgs;
using kernels::MatmulForward;
using kernels::MatmulForwardArgs;

struct BatchCase {
    Shape a_batch;
    Shape b_batch;
    const char* name;
};

// Uniform strides (one strided-batched GEMM, stride 0 for a broadcast operand) and mixed broadcasting (one GEMM per
// batch entry).
const std::vector<BatchCase> kBatchCases = {
    {{}, {}, "2-d"},
    {{2, 3}, {2, 3}, "same batch"},
    {{2, 3}, {}, "b has no batch dims (stride 0)"},
    {{1}, {4}, "a batch of 1 (stride 0)"},
    {{2, 1}, {1, 3}, "mixed [2,1]x[1,3]"},
    {{4}, {2, 1}, "[4]x[2,1]"},
};

struct Dims {
    std::int64_t m;
    std::int64_t k;
    std::int64_t n;
};
const std::vector<Dims> kDims = {{7, 17, 33}, {32, 64, 48}};

Shape Operand(Shape batch, std::int64_t rows, std::int64_t cols) {
    batch.push_back(rows);
    batch.push_back(cols);
    return batch;
}

/// Sums `full` (shape full_shape) down to `target`, whose batch dims are right-aligned and broadcast (size 1 or
/// missing): the reduction a broadcast operand's gradient needs.
Values ReduceToShape(const Values& full, const Shape& full_shape, const Shape& target) {
    if (full_shape == target) {
        return full;
    }
    Values out(static_cast<std::size_t>(Numel(target)), 0.0);
    const std::size_t rank = full_shape.size();
    const std::size_t pad = rank - target.size();
    std::vector<std::int64_t> idx(rank);
    for (std::size_t f = 0; f < full.size(); ++f) {
        std::int64_t rem = static_cast<std::int64_t>(f);
        for (std::size_t d = rank; d-- > 0;) {
            idx[d] = rem % full_shape[d];
            rem /= full_shape[d];
        }
        std::int64_t t = 0;
        for (std::size_t d = pad; d < rank; ++d) {
            const std::int64_t size = target[d - pad];
            t = t * size + (size == 1 ? 0 : idx[d]);
        }
        out[static_cast<std::size_t>(t)] += full[f];
    }
    return out;
}

using CudaMatmulTest = CudaParamTest<DType>;

/// Runs `body(a_shape, b_shape, trans_a, trans_b, label)` for every batch case, size and transpose pair.
template <class Body> void ForEachCase(Body body) {
    for (const Dims& d : kDims) {
        for (const BatchCase& c : kBatchCases) {
            for (const bool ta : {false, true}) {
                for (const bool tb : {false, true}) {
                    const Shape a_shape = Operand(c.a_batch, ta ? d.k : d.m, ta ? d.m : d.k);
                    const Shape b_shape = Operand(c.b_batch, tb ? d.n : d.k, tb ? d.k : d.n);
                    SCOPED_TRACE(::testing::Message() << c.name << ": a " << ShapeToString(a_shape) << (ta ? "ᵀ" : "")
                                                      << " · b " << ShapeToString(b_shape) << (tb ? "ᵀ" : ""));
                    body(a_shape, b_shape, ta, tb);
                }
            }
        }
    }
}

TEST_P(CudaMatmulTest, ForwardMatchesFloat64) {
    const DType dtype = GetParam();
    ForEachCase([&](const Shape& a_shape, const Shape& b_shape, bool ta, bool tb) {
        const Tensor a = RandomGpu(a_shape, dtype, 20, "a");
        const Tensor b = RandomGpu(b_shape, dtype, 20, "b");
        Shape out_shape;
        const Values ref =
            RefBatchedMatmul(a.ToDoubleVector(), a_shape, b.ToDoubleVector(), b_shape, ta, tb, &out_shape);
        Tensor out = RandomGpu(out_shape, dtype, 999, "poison", 100.0);
        MatmulForward(MatmulForwardArgs{.a = a, .b = b, .out = out, .trans_a = ta, .trans_b = tb});
        EXPECT_TRUE(ValuesMatch(out, ref, dtype));
        const Tensor out2 = MatmulForward(a, b, ta, tb);
        EXPECT_EQ(out2.shape(), out_shape);
        EXPECT_TRUE(ValuesMatch(out2, ref, dtype)) << "allocating wrapper";
    });
}

TEST_P(CudaMatmulTest, BackwardInputMatchesFloat64) {
    const DType dtype = GetParam();
    ForEachCase([&](const Shape& a_shape, const Shape& b_shape, bool ta, bool tb) {
        const Shape out_shape = kernels::MatmulOutputShape(a_shape, b_shape, ta, tb, "test");
        const Tensor b = RandomGpu(b_shape, dtype, 21, "b");
        const Tensor dout = RandomGpu(out_shape, dtype, 21, "dout");
        Tensor da = RandomGpu(a_shape, dtype, 999, "poison", 100.0);
        MatmulBackwardInput(MatmulBackwardInputArgs{.dout = dout, .b = b, .da = da, .trans_a = ta, .trans_b = tb});
        // d op(A) = dC·op(B)ᵀ; stored transposed (trans_a): dA = op(B)·dCᵀ. Then summed over a's broadcast dims.
        const Values bv = b.ToDoubleVector();
        const Values dv = dout.ToDoubleVector();
        Shape full_shape;
        const Values full = ta ? RefBatchedMatmul(bv, b_shape, dv, out_shape, tb, true, &full_shape)
                               : RefBatchedMatmul(dv, out_shape, bv, b_shape, false, !tb, &full_shape);
        const Values ref = ReduceToShape(full, full_shape, a_shape);
        // A broadcast operand's grad is rounded per batch entry, then summed and rounded again.
        EXPECT_TRUE(ValuesMatch(da, ref, dtype, full_shape == a_shape ? 1 : 2));
    });
}

TEST_P(CudaMatmulTest, BackwardOtherMatchesFloat64) {
    const DType dtype = GetParam();
    ForEachCase([&](const Shape& a_shape, const Shape& b_shape, bool ta, bool tb) {
        const Shape out_shape = kernels::MatmulOutputShape(a_shape, b_shape, ta, tb, "test");
        const Tensor a = RandomGpu(a_shape, dtype, 22, "a");
        const Tensor dout = RandomGpu(out_shape, dtype, 22, "dout");
        Tensor db = RandomGpu(b_shape, dtype, 999, "poison", 100.0);
        MatmulBackwardOther(MatmulBackwardOtherArgs{.a = a, .dout = dout, .db = db, .trans_a = ta, .trans_b = tb});
        // d op(B) = op(A)ᵀ·dC; stored transposed (trans_b): dB = dCᵀ·op(A). Then summed over b's broadcast dims.
        const Values av = a.ToDoubleVector();
        const Values dv = dout.ToDoubleVector();
        Shape full_shape;
        const Values full = tb ? RefBatchedMatmul(dv, out_shape, av, a_shape, true, ta, &full_shape)
                               : RefBatchedMatmul(av, a_shape, dv, out_shape, !ta, false, &full_shape);
        const Values ref = ReduceToShape(full, full_shape, b_shape);
        EXPECT_TRUE(ValuesMatch(db, ref, dtype, full_shape == b_shape ? 1 : 2));
    });
}

INSTANTIATE_TEST_SUITE_P(DType, CudaMatmulTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
