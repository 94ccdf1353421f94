// Batched matmul with torch.matmul broadcasting on every device, all transposes, forward and both backward kernels,
// against a float64 reference that also computes the analytic gradients (summed over the dims an operand was broadcast
// on). On CUDA, uniform strides run one strided-batched GEMM (stride 0 for a broadcast operand) and mixed broadcasting
// one GEMM per batch entry.

#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
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
    std::int64_t m, k, n;
    std::string name;
};
void PrintTo(const BatchCase &c, std::ostream *os) { *os << c.name; }

/// The cases: each batch case its own, and the sweep, one case over several.
struct BatchCases {
    std::vector<BatchCase> cases;
    std::string name;
};
void PrintTo(const BatchCases &c, std::ostream *os) { *os << c.name; }

std::vector<BatchCases> MatmulBatchCases() {
    // No batch, batch dims on one side, size-1 broadcasting on both, M = 1, K = 1.
    const std::vector<BatchCase> own = {
        {{}, {}, 5, 7, 3, "mk_kn"},        {{2, 3}, {}, 4, 9, 6, "b23mk_kn"},
        {{}, {4}, 3, 5, 17, "mk_b4kn"},    {{2, 1}, {1, 3}, 6, 4, 5, "b21mk_b13kn"},
        {{1}, {5}, 1, 33, 2, "b1mk_b5kn"}, {{3}, {3}, 8, 1, 9, "b3mk_b3kn"},
    };
    std::vector<BatchCases> cases;
    for (const BatchCase &c : own) {
        cases.push_back({{c}, c.name});
    }
    // The sweep: uniform strides (one strided-batched GEMM on CUDA, stride 0 for a broadcast operand) and mixed
    // broadcasting (one GEMM per batch entry), at an odd and an aligned size.
    struct Batches {
        Shape a;
        Shape b;
        const char *name;
    };
    const Batches batches[] = {{{}, {}, "mk_kn"},       {{2, 3}, {2, 3}, "b23mk_b23kn"}, {{2, 3}, {}, "b23mk_kn"},
                               {{1}, {4}, "b1mk_b4kn"}, {{2, 1}, {1, 3}, "b21mk_b13kn"}, {{4}, {2, 1}, "b4mk_b21kn"}};
    BatchCases sweep{{}, "sweep"};
    for (const auto &[m, k, n] : {std::tuple{7, 17, 33}, std::tuple{32, 64, 48}}) {
        for (const Batches &b : batches) {
            sweep.cases.push_back({b.a, b.b, m, k, n, fmt::format("{}_{}x{}x{}", b.name, m, k, n)});
        }
    }
    cases.push_back(sweep);
    return cases;
}

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

using MatmulParam = std::tuple<DeviceDType, bool, bool, BatchCases>;

/// For each batch case of the case (ForEachCase): its operands and references (Prepare), then one kernel's check.
class MatmulTest : public DeviceTest<MatmulParam> {
protected:
    template <class Check> void ForEachCase(Check check) {
        const auto &[unused, ta, tb, cases] = GetParam();
        for (const BatchCase &c : cases.cases) {
            SCOPED_TRACE(c.name);
            ASSERT_NO_FATAL_FAILURE(Prepare(c, ta, tb));
            check();
        }
    }
    void Prepare(const BatchCase &c, bool ta, bool tb) {
        ta_ = ta;
        tb_ = tb;
        m_ = c.m;
        k_ = c.k;
        n_ = c.n;
        a_shape_ = c.a_batch;
        a_shape_.push_back(ta_ ? k_ : m_);
        a_shape_.push_back(ta_ ? m_ : k_);
        b_shape_ = c.b_batch;
        b_shape_.push_back(tb_ ? n_ : k_);
        b_shape_.push_back(tb_ ? k_ : n_);
        a_ = Random(a_shape_, dtype(), 11, "a");
        b_ = Random(b_shape_, dtype(), 11, "b");
        av_ = a_.ToDoubleVector();
        bv_ = b_.ToDoubleVector();
        out_ = RefBatchedMatmul(av_, a_shape_, bv_, b_shape_, ta_, tb_, &out_shape_);
        batch_ = Shape(out_shape_.begin(), out_shape_.end() - 2);
        dout_ = Random(out_shape_, dtype(), 11, "dout");
        doutv_ = dout_.ToDoubleVector();
        ASSERT_GT(AbsSum(av_) * AbsSum(bv_) * AbsSum(doutv_), 0.0);
        grads_ = RefMatmulGrads(av_, a_shape_, bv_, b_shape_, doutv_, ta_, tb_, batch_, m_, k_, n_);
    }
    /// The budget of an operand's gradient: on CUDA a broadcast operand's grad is rounded per batch entry, then summed
    /// and rounded again.
    double GradRoundings(const Shape &operand_shape) const {
        const bool broadcast =
            Numel(operand_shape) != Numel(batch_) * operand_shape[operand_shape.size() - 2] * operand_shape.back();
        return OnCuda(broadcast ? 2 : 1);
    }

    void CheckForward() const {
        Tensor out = Poison(out_shape_, dtype());
        MatmulForward(MatmulForwardArgs{.a = a_, .b = b_, .out = out, .trans_a = ta_, .trans_b = tb_});
        EXPECT_TRUE(ValuesMatch(out, out_, dtype()));
        const Tensor allocated = MatmulForward(a_, b_, {.trans_a = ta_, .trans_b = tb_});
        EXPECT_EQ(allocated.shape(), out_shape_);
        EXPECT_TRUE(ValuesMatch(allocated, out_, dtype())) << "allocating wrapper";
    }
    void CheckBackwardInput() const {
        Tensor da = Poison(a_shape_, dtype()); // overwritten
        MatmulBackwardInput(MatmulBackwardInputArgs{.dout = dout_, .b = b_, .da = da, .trans_a = ta_, .trans_b = tb_});
        EXPECT_TRUE(ValuesMatch(da, grads_.da, dtype(), GradRoundings(a_shape_)));
    }
    void CheckBackwardOther() const {
        Tensor db = Poison(b_shape_, dtype()); // overwritten
        MatmulBackwardOther(MatmulBackwardOtherArgs{.a = a_, .dout = dout_, .db = db, .trans_a = ta_, .trans_b = tb_});
        EXPECT_TRUE(ValuesMatch(db, grads_.db, dtype(), GradRoundings(b_shape_)));
    }

    bool ta_ = false, tb_ = false;
    std::int64_t m_ = 0, k_ = 0, n_ = 0;
    Shape a_shape_, b_shape_, out_shape_, batch_;
    Tensor a_, b_, dout_;
    Values av_, bv_, out_, doutv_;
    MatmulGrads grads_;
};

TEST_P(MatmulTest, ForwardMatchesBroadcastReference) {
    ForEachCase([&] { CheckForward(); });
}

TEST_P(MatmulTest, BackwardInputMatchesAnalyticGradient) {
    ForEachCase([&] { CheckBackwardInput(); });
}

TEST_P(MatmulTest, BackwardOtherMatchesAnalyticGradient) {
    ForEachCase([&] { CheckBackwardOther(); });
}

auto MatmulCases(DeviceType type) {
    return DeviceCases(type, ::testing::Bool(), ::testing::Bool(), ::testing::ValuesIn(MatmulBatchCases()));
}
std::string MatmulCaseName(const ::testing::TestParamInfo<MatmulParam> &info) {
    return std::string(DTypeName(std::get<0>(info.param).dtype)) + (std::get<1>(info.param) ? "_TA_" : "_NA_") +
           (std::get<2>(info.param) ? "TB_" : "NB_") + std::get<3>(info.param).name;
}
SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(MatmulTest, MatmulCases, MatmulCaseName);

using MatmulEdgeTest = DeviceTest<>;

TEST_P(MatmulEdgeTest, ZeroInnerDimGivesZeros) {
    for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
            const Tensor a = Tensor::Empty(ta ? Shape{2, 0, 3} : Shape{2, 3, 0}, dtype(), device());
            const Tensor b = Tensor::Empty(tb ? Shape{4, 0} : Shape{0, 4}, dtype(), device());
            Tensor out = Tensor::Full({2, 3, 4}, 5.0, dtype(), device());
            MatmulForward(MatmulForwardArgs{.a = a, .b = b, .out = out, .trans_a = ta, .trans_b = tb});
            EXPECT_EQ(out.ToDoubleVector(), Values(24, 0.0)) << "ta=" << ta << " tb=" << tb;
        }
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(MatmulEdgeTest, DeviceCases, DeviceDTypeName);

} // namespace
} // namespace shardline::testing
