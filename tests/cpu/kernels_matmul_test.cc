// Batched matmul with torch.matmul broadcasting, all transposes, forward and both backward kernels, against a
// float64 reference that also computes the analytic gradients (summed over the dims an operand was broadcast on).

#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include <shardline/kernels/matmul.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using testing::CpuDTypes;
using testing::RandomTensor;
using testing::RefBatchedMatmul;
using testing::Values;
using testing::ValuesMatch;

struct BatchCase {
    Shape a_batch;
    Shape b_batch;
    std::int64_t m, k, n;
    std::string name;
};

/// Offset of the operand matrix used at broadcast batch index `flat` (right-aligned dims, size 1 broadcasts).
std::int64_t OperandOffset(std::int64_t flat, const Shape &batch, const Shape &own, std::int64_t matrix) {
    std::int64_t index = 0;
    std::int64_t scale = 1;
    for (std::size_t d = batch.size(); d-- > 0;) {
        const std::int64_t i = flat % batch[d];
        flat /= batch[d];
        const std::size_t pad = batch.size() - own.size();
        if (d >= pad) {
            const std::int64_t size = own[d - pad];
            index += (size == 1 ? 0 : i) * scale;
            scale *= size;
        }
    }
    return index * matrix;
}

struct MatmulGrads {
    Values da;
    Values db;
};

/// dA and dB of L = Σ dC ⊙ (op(A)·op(B)) by the chain rule, element by element: each product term
/// a[i,p]·b[p,j] sends dC[i,j]·b to a's stored element and dC[i,j]·a to b's.
MatmulGrads RefMatmulGrads(const Values &a, const Shape &a_shape, const Values &b, const Shape &b_shape,
                           const Values &dc, bool ta, bool tb, const Shape &batch, std::int64_t m, std::int64_t k,
                           std::int64_t n) {
    MatmulGrads g{Values(a.size(), 0.0), Values(b.size(), 0.0)};
    const Shape a_batch(a_shape.begin(), a_shape.end() - 2);
    const Shape b_batch(b_shape.begin(), b_shape.end() - 2);
    for (std::int64_t bi = 0; bi < Numel(batch); ++bi) {
        const std::int64_t oa = OperandOffset(bi, batch, a_batch, m * k);
        const std::int64_t ob = OperandOffset(bi, batch, b_batch, k * n);
        for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < n; ++j) {
                const double g_out = dc[(bi * m + i) * n + j];
                for (std::int64_t p = 0; p < k; ++p) {
                    const std::int64_t ia = oa + (ta ? p * m + i : i * k + p);
                    const std::int64_t ib = ob + (tb ? j * k + p : p * n + j);
                    g.da[ia] += g_out * b[ib];
                    g.db[ib] += g_out * a[ia];
                }
            }
        }
    }
    return g;
}

class MatmulTest : public ::testing::TestWithParam<std::tuple<DType, bool, bool, BatchCase>> {
protected:
    void SetUp() override {
        BatchCase c;
        std::tie(dtype_, ta_, tb_, c) = GetParam();
        m_ = c.m;
        k_ = c.k;
        n_ = c.n;
        a_shape_ = c.a_batch;
        a_shape_.push_back(ta_ ? k_ : m_);
        a_shape_.push_back(ta_ ? m_ : k_);
        b_shape_ = c.b_batch;
        b_shape_.push_back(tb_ ? n_ : k_);
        b_shape_.push_back(tb_ ? k_ : n_);
        a_ = RandomTensor(a_shape_, dtype_, Device::CPU(), 11, "a");
        b_ = RandomTensor(b_shape_, dtype_, Device::CPU(), 11, "b");
        av_ = a_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        out_ = RefBatchedMatmul(av_, a_shape_, bv_, b_shape_, ta_, tb_, &out_shape_);
        batch_ = Shape(out_shape_.begin(), out_shape_.end() - 2);
        dout_ = RandomTensor(out_shape_, dtype_, Device::CPU(), 11, "dout");
        doutv_ = dout_.ToDoubleVector();
        ASSERT_GT(AbsSum(av_) * AbsSum(bv_) * AbsSum(doutv_), 0.0);
        grads_ = RefMatmulGrads(av_, a_shape_, bv_, b_shape_, doutv_, ta_, tb_, batch_, m_, k_, n_);
    }

    DType dtype_ = DType::kFloat32;
    bool ta_ = false, tb_ = false;
    std::int64_t m_ = 0, k_ = 0, n_ = 0;
    Shape a_shape_, b_shape_, out_shape_, batch_;
    Tensor a_, b_, dout_;
    Values av_, bv_, out_, doutv_;
    MatmulGrads grads_;
};

TEST_P(MatmulTest, ForwardMatchesBroadcastReference) {
    const Tensor out = MatmulForward(a_, b_, ta_, tb_);
    EXPECT_EQ(out.shape(), out_shape_);
    EXPECT_TRUE(ValuesMatch(out, out_, dtype_));
}

TEST_P(MatmulTest, BackwardInputMatchesAnalyticGradient) {
    Tensor da = Tensor::Full(a_shape_, 7.0, dtype_); // overwritten
    MatmulBackwardInput(MatmulBackwardInputArgs{.dout = dout_, .b = b_, .da = da, .trans_a = ta_, .trans_b = tb_});
    EXPECT_TRUE(ValuesMatch(da, grads_.da, dtype_));
}

TEST_P(MatmulTest, BackwardOtherMatchesAnalyticGradient) {
    Tensor db = Tensor::Full(b_shape_, 7.0, dtype_); // overwritten
    MatmulBackwardOther(MatmulBackwardOtherArgs{.a = a_, .dout = dout_, .db = db, .trans_a = ta_, .trans_b = tb_});
    EXPECT_TRUE(ValuesMatch(db, grads_.db, dtype_));
}

INSTANTIATE_TEST_SUITE_P(Broadcasts, MatmulTest,
                         ::testing::Combine(CpuDTypes(), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(BatchCase{{}, {}, 5, 7, 3, "mk_kn"},
                                                              BatchCase{{2, 3}, {}, 4, 9, 6, "b23mk_kn"},
                                                              BatchCase{{}, {4}, 3, 5, 17, "mk_b4kn"},
                                                              BatchCase{{2, 1}, {1, 3}, 6, 4, 5, "b21mk_b13kn"},
                                                              BatchCase{{1}, {5}, 1, 33, 2, "b1mk_b5kn"},
                                                              BatchCase{{3}, {3}, 8, 1, 9, "b3mk_b3kn"})),
                         [](const auto &info) {
                             return std::string(DTypeName(std::get<0>(info.param))) +
                                    (std::get<1>(info.param) ? "_TA_" : "_NA_") +
                                    (std::get<2>(info.param) ? "TB_" : "NB_") + std::get<3>(info.param).name;
                         });

} // namespace
} // namespace shardline::kernels

namespace shardline::kernels {
namespace {

TEST(MatmulEdgeTest, ZeroInnerDimGivesZeros) {
    for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
            const Tensor a = Tensor::Empty(ta ? Shape{2, 0, 3} : Shape{2, 3, 0}, DType::kFloat32);
            const Tensor b = Tensor::Empty(tb ? Shape{4, 0} : Shape{0, 4}, DType::kFloat32);
            Tensor out = Tensor::Full({2, 3, 4}, 5.0, DType::kFloat32);
            MatmulForward(MatmulForwardArgs{.a = a, .b = b, .out = out, .trans_a = ta, .trans_b = tb});
            EXPECT_EQ(out.ToDoubleVector(), testing::Values(24, 0.0)) << "ta=" << ta << " tb=" << tb;
        }
    }
}

} // namespace
} // namespace shardline::kernels
