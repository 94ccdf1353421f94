// LinearBackward (dx, dweight and dbias together; on CUDA the separate bias grad on a side stream) on every device
// against the float64 references: every subset of the outputs, overwrite and accumulate (also into float32 main grads),
// a result read right after the call (CUDA's side stream must have joined the compute stream), no rows, CUDA's legacy
// provider, and the argument checks. Then a layer after a GELU (input_activation): dx = (dy·W) ⊙ gelu_tanh'(pre) and
// the previous layer's bias grad Σ_rows dx (DGELU / DGELU_BGRAD on CUDA), with every subset of the other grads, into
// main grads, through the split LinearBackwardInput, and run to run bitwise.

#include <cmath>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/gemm_tuning.h>
#include <shardline/kernels/linear.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::LinearActivation;
using kernels::LinearBackward;
using kernels::LinearBackwardArgs;
using kernels::LinearBackwardInput;
using kernels::LinearBackwardInputArgs;
using ::testing::HasSubstr;

class LinearBackwardTest : public DeviceTest<> {
protected:
    // x [2, 3, in] (M = 6 rows), weight [out, in].
    static constexpr std::int64_t kRows = 6;
    static constexpr std::int64_t kIn = 5;
    static constexpr std::int64_t kOut = 7;

    void SetUp() override {
        DeviceTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        x_ = Random({2, 3, kIn}, dtype(), 11, "x");
        w_ = Random({kOut, kIn}, dtype(), 11, "w");
        dy_ = Random({2, 3, kOut}, dtype(), 11, "dy");
        ASSERT_GT(AbsSum(x_.ToDoubleVector()) * AbsSum(w_.ToDoubleVector()) * AbsSum(dy_.ToDoubleVector()), 0.0);
    }
    /// Garbage the op must overwrite (or, when accumulating, add to).
    Tensor Start(const Shape &shape, std::string_view name) const { return Random(shape, dtype(), 99, name); }
    Values RefDx() const { return RefLinearBackwardInput(dy_.ToDoubleVector(), w_.ToDoubleVector(), kRows, kOut, kIn); }
    Values RefDw() const {
        return RefLinearBackwardWeight(dy_.ToDoubleVector(), x_.ToDoubleVector(), kRows, kOut, kIn);
    }
    Values RefDb() const { return RefColumnSum(dy_.ToDoubleVector(), kRows, kOut); }

    Tensor x_, w_, dy_;
};

TEST_P(LinearBackwardTest, AllThreeGradsMatchFloat64) {
    Tensor dx = Start({2, 3, kIn}, "dx");
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .weight = &w_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype(), OnCuda(kEpilogueRoundings)));
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(LinearBackwardTest, OnlyTheGivenOutputsAreComputed) {
    // dx alone: x is not needed.
    Tensor dx = Start({2, 3, kIn}, "dx");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx});
    EXPECT_TRUE(ValuesMatch(dx, RefDx(), dtype()));
    // dweight alone: the weight is not needed.
    Tensor dw = Start({kOut, kIn}, "dw");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw});
    EXPECT_TRUE(ValuesMatch(dw, RefDw(), dtype(), OnCuda(kEpilogueRoundings)));
    // dbias alone: neither is needed.
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .dbias = &db});
    EXPECT_TRUE(ValuesMatch(db, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
    // dx and dbias (a frozen weight): dbias without the wgrad GEMM.
    Tensor dx2 = Start({2, 3, kIn}, "dx2");
    Tensor db2 = Start({kOut}, "db2");
    LinearBackward(LinearBackwardArgs{.dy = dy_, .weight = &w_, .dx = &dx2, .dbias = &db2});
    EXPECT_TRUE(ValuesMatch(dx2, RefDx(), dtype()));
    EXPECT_TRUE(ValuesMatch(db2, RefDb(), dtype(), OnCuda(kEpilogueRoundings)));
}

TEST_P(LinearBackwardTest, AccumulateAddsToWeightAndBiasGrads) {
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    const Values dw0 = dw.ToDoubleVector();
    const Values db0 = db.ToDoubleVector();
    LinearBackward(LinearBackwardArgs{.dy = dy_, .x = &x_, .dweight = &dw, .dbias = &db, .accumulate = true});
    // The new grad and the sum each rounded (beta = 1).
    EXPECT_TRUE(ValuesMatch(dw, AddScaled(dw0, RefDw()), dtype(), 2.0));
    EXPECT_TRUE(ValuesMatch(db, AddScaled(db0, RefDb()), dtype(), 2.0));
}

TEST_P(LinearBackwardTest, NoRowsZeroesTheParameterGradsUnlessAccumulating) {
    const Tensor dy = Tensor::Empty({0, kOut}, dtype(), device());
    const Tensor x = Tensor::Empty({0, kIn}, dtype(), device());
    Tensor dx = Tensor::Empty({0, kIn}, dtype(), device());
    Tensor dw = Start({kOut, kIn}, "dw");
    Tensor db = Start({kOut}, "db");
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w_, .dx = &dx, .dweight = &dw, .dbias = &db});
    EXPECT_EQ(AbsSum(dw.ToDoubleVector()), 0.0);
    EXPECT_EQ(AbsSum(db.ToDoubleVector()), 0.0);
    Tensor dw2 = Start({kOut, kIn}, "dw2");
    const Values before = dw2.ToDoubleVector();
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .dweight = &dw2, .accumulate = true});
    EXPECT_EQ(dw2.ToDoubleVector(), before);
}

TEST_P(LinearBackwardTest, OneTokensWeightAndBiasGradsAreOneRankOneLaunchOnCuda) {
    // One row: dW = dyᵀ·x is a rank-1 update and db = dy. On CUDA (default provider) the wgrad GEMM runs as one launch
    // of the rank-1 kernel and builds no cuBLASLt plan. (That its bias grad rides in that launch, so that no column sum
    // runs, is tests/cuda/kernels_gemm_tuning_test.cc's ARankOneBGradBIsFusedWithoutAPlan.)
    const Tensor x = Random({1, 256}, dtype(), 43, "x");
    const Tensor dy = Random({1, 96}, dtype(), 43, "dy");
    const Values ref_dw = RefLinearBackwardWeight(dy.ToDoubleVector(), x.ToDoubleVector(), 1, 96, 256);
    const Values ref_db = RefColumnSum(dy.ToDoubleVector(), 1, 96);
    Tensor dw = Start({96, 256}, "dw");
    Tensor db = Start({96}, "db");
    const kernels::GemmPlanStats before = kernels::GetGemmPlanStats();
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .dweight = &dw, .dbias = &db});
    const kernels::GemmPlanStats after = kernels::GetGemmPlanStats();
    EXPECT_TRUE(ValuesMatch(dw, ref_dw, dtype()));
    EXPECT_TRUE(ValuesMatch(db, ref_db, dtype()));
    if (device().is_cuda()) {
        EXPECT_EQ(after.rank_one - before.rank_one, 1U) << "dW and db in one rank-1 launch";
        EXPECT_EQ(after.plans_built, before.plans_built) << "no cuBLASLt plan for the wgrad";
    } else {
        EXPECT_EQ(after.rank_one, before.rank_one);
    }
}

struct Case {
    std::int64_t m, in, out;
};
// Aligned shapes (CUDA's fused BGRADB possible), odd features (scalar column sum, 2-byte alignment), a tall one
// whose column sum takes the two-pass path, and one token, aligned and odd (on CUDA the wgrad and its bias grad are
// then one rank-1 kernel launch, vectorised and scalar).
const std::vector<Case> kCases = {{256, 128, 96}, {33, 17, 41}, {4096, 64, 1032}, {1, 256, 96}, {1, 17, 41}};

std::string Name(const Case &c) {
    return "m=" + std::to_string(c.m) + " in=" + std::to_string(c.in) + " out=" + std::to_string(c.out);
}

TEST_P(LinearBackwardTest, EverySubsetOfGradsMatchesFloat64) {
    for (const Case &c : kCases) {
        const Tensor x = Random({c.m, c.in}, dtype(), 41, "x");
        const Tensor w = Random({c.out, c.in}, dtype(), 41, "w");
        const Tensor dy = Random({c.m, c.out}, dtype(), 41, "dy");
        const Values dyv = dy.ToDoubleVector();
        const Values ref_dx = RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
        const Values ref_db = RefColumnSum(dyv, c.m, c.out);
        for (int mask = 1; mask < 8; ++mask) {
            const bool want_dx = (mask & 1) != 0;
            const bool want_dw = (mask & 2) != 0;
            const bool want_db = (mask & 4) != 0;
            SCOPED_TRACE(::testing::Message()
                         << Name(c) << (want_dx ? " dx" : "") << (want_dw ? " dw" : "") << (want_db ? " db" : ""));
            Tensor dx = Poison({c.m, c.in}, dtype());
            Tensor dw = Poison({c.out, c.in}, dtype());
            Tensor db = Poison({c.out}, dtype());
            LinearBackward(LinearBackwardArgs{.dy = dy,
                                              .x = &x,
                                              .weight = &w,
                                              .dx = want_dx ? &dx : nullptr,
                                              .dweight = want_dw ? &dw : nullptr,
                                              .dbias = want_db ? &db : nullptr});
            // Read right away: on CUDA db comes from the side stream, which must have joined the compute stream.
            if (want_db) {
                EXPECT_TRUE(ValuesMatch(db, ref_db, dtype(), OnCuda(kEpilogueRoundings))) << "db";
            }
            if (want_dx) {
                EXPECT_TRUE(ValuesMatch(dx, ref_dx, dtype())) << "dx";
            }
            if (want_dw) {
                EXPECT_TRUE(ValuesMatch(dw, ref_dw, dtype(), OnCuda(kEpilogueRoundings))) << "dw";
            }
        }
    }
}

TEST_P(LinearBackwardTest, AccumulatesIntoMainGrads) {
    const DType main_dtype = MainGradDType(device(), dtype());
    for (const Case &c : kCases) {
        SCOPED_TRACE(Name(c));
        const Tensor x = Random({c.m, c.in}, dtype(), 42, "x");
        const Tensor w = Random({c.out, c.in}, dtype(), 42, "w");
        const Tensor dy = Random({c.m, c.out}, dtype(), 42, "dy");
        const double scale = std::sqrt(static_cast<double>(c.m));
        Tensor main_dw = Random({c.out, c.in}, main_dtype, 42, "main_dw", scale);
        Tensor main_db = Random({c.out}, main_dtype, 42, "main_db", scale);
        Tensor dx = Poison({c.m, c.in}, dtype());
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
            EXPECT_TRUE(ValuesMatch(main_db, AddScaled(old_db, new_db, step), main_dtype, step)) << "db";
            EXPECT_TRUE(ValuesMatch(main_dw, AddScaled(old_dw, new_dw, step), main_dtype, step)) << "dw";
            EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype()));
        }
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearBackwardTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// A layer after a GELU (Megatron's fc2): dx = (dy·W) ⊙ gelu_tanh'(pre), the previous layer's bias grad Σ_rows dx

/// The float64 expectations of a layer after a GELU.
struct GeluRef {
    Values dx, pre_db, dw, db;
    Values g_abs;        ///< |dy·W| per element of dx, the scale of cuBLASLt's fp32 gelu' error (GeluGradMatch)
    Values pre_db_g_abs; ///< Σ_rows |dy·W|, the same for pre_db
};
GeluRef RefAfterGelu(const Tensor &dy, const Tensor &x, const Tensor &w, const Tensor &pre, const Case &c) {
    const Values dyv = dy.ToDoubleVector();
    const Values prev = pre.ToDoubleVector();
    GeluRef r;
    r.dx = RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in);
    r.g_abs = r.dx;
    for (std::size_t i = 0; i < r.dx.size(); ++i) {
        r.g_abs[i] = std::abs(r.g_abs[i]);
        r.dx[i] *= RefGeluTanhGrad(prev[i]);
    }
    r.pre_db_g_abs = RefColumnSum(r.g_abs, c.m, c.in);
    r.pre_db = RefColumnSum(r.dx, c.m, c.in);
    r.dw = RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in);
    r.db = RefColumnSum(dyv, c.m, c.out);
    return r;
}

class LinearBackwardGeluTest : public DeviceTest<> {
protected:
    /// The operands of case c; the pre-activation ~ N(0, 1.5²) covers GELU's curved region and both tails.
    void Prepare(const Case &c, std::uint64_t seed) {
        x_ = Random({c.m, c.in}, dtype(), seed, "x");
        w_ = Random({c.out, c.in}, dtype(), seed, "w", 1.0 / std::sqrt(static_cast<double>(c.out)));
        dy_ = Random({c.m, c.out}, dtype(), seed, "dy");
        pre_ = Random({c.m, c.in}, dtype(), seed, "pre", 1.5);
        ASSERT_GT(AbsSum(pre_.ToDoubleVector()) * AbsSum(dy_.ToDoubleVector()), 0.0);
        ref_ = RefAfterGelu(dy_, x_, w_, pre_, c);
    }
    Tensor x_, w_, dy_, pre_;
    GeluRef ref_;
};

// On CUDA the aligned case may run DGELU_BGRAD fused (a per-shape measurement), the odd one (in = 17: aux ld not a
// multiple of 8) the GEMM and separate kernels, the tall one's column sum two passes.
TEST_P(LinearBackwardGeluTest, GeluGradAndPreviousBiasGradMatchFloat64WithEverySubset) {
    for (const Case &c : kCases) {
        Prepare(c, 51);
        for (int mask = 0; mask < 8; ++mask) {
            const bool want_dw = (mask & 1) != 0;
            const bool want_db = (mask & 2) != 0;
            const bool want_pre_db = (mask & 4) != 0;
            SCOPED_TRACE(::testing::Message() << Name(c) << " dx" << (want_dw ? " dw" : "") << (want_db ? " db" : "")
                                              << (want_pre_db ? " pre_db" : ""));
            Tensor dx = Poison({c.m, c.in}, dtype(), "poison_dx");
            Tensor dw = Poison({c.out, c.in}, dtype(), "poison_dw");
            Tensor db = Poison({c.out}, dtype(), "poison_db");
            Tensor pre_db = Poison({c.in}, dtype(), "poison_pre_db");
            LinearBackward(LinearBackwardArgs{.dy = dy_,
                                              .x = &x_,
                                              .weight = &w_,
                                              .dx = &dx,
                                              .dweight = want_dw ? &dw : nullptr,
                                              .dbias = want_db ? &db : nullptr,
                                              .input_activation = LinearActivation::kGeluTanh,
                                              .pre_activation = &pre_,
                                              .pre_activation_dbias = want_pre_db ? &pre_db : nullptr});
            // Read right away: on CUDA a separate sum runs on the side stream, which must have joined.
            if (want_pre_db) {
                EXPECT_TRUE(GeluGradMatch(pre_db, ref_.pre_db, ref_.pre_db_g_abs, dtype(), kGeluEpilogueRoundings))
                    << "pre_db = Σ_rows dx";
            }
            EXPECT_TRUE(GeluGradMatch(dx, ref_.dx, ref_.g_abs, dtype(), kGeluEpilogueRoundings))
                << "dx = dy·W ⊙ gelu'(pre)";
            if (want_dw) {
                EXPECT_TRUE(ValuesMatch(dw, ref_.dw, dtype(), OnCuda(kEpilogueRoundings))) << "dw";
            }
            if (want_db) {
                EXPECT_TRUE(ValuesMatch(db, ref_.db, dtype(), OnCuda(kEpilogueRoundings))) << "db";
            }
        }
    }
}

TEST_P(LinearBackwardGeluTest, PreviousBiasGradAccumulatesIntoAMainGrad) {
    const DType main_dtype = MainGradDType(device(), dtype());
    for (const Case &c : kCases) {
        SCOPED_TRACE(Name(c));
        Prepare(c, 52);
        const double scale = std::sqrt(static_cast<double>(c.m));
        Tensor main_dw = Random({c.out, c.in}, main_dtype, 52, "main_dw", scale);
        Tensor main_db = Random({c.out}, main_dtype, 52, "main_db", scale);
        Tensor main_pre_db = Random({c.in}, main_dtype, 52, "main_pre_db", scale);
        const Values old_dw = main_dw.ToDoubleVector();
        const Values old_db = main_db.ToDoubleVector();
        const Values old_pre_db = main_pre_db.ToDoubleVector();
        Tensor dx = Poison({c.m, c.in}, dtype());
        Values first_dx;
        for (int step = 1; step <= 2; ++step) {
            SCOPED_TRACE(::testing::Message() << "step " << step);
            LinearBackward(LinearBackwardArgs{.dy = dy_,
                                              .x = &x_,
                                              .weight = &w_,
                                              .dx = &dx,
                                              .dweight = &main_dw,
                                              .dbias = &main_db,
                                              .accumulate = true,
                                              .input_activation = LinearActivation::kGeluTanh,
                                              .pre_activation = &pre_,
                                              .pre_activation_dbias = &main_pre_db});
            const Values got_dx = dx.ToDoubleVector();
            EXPECT_TRUE(GeluGradMatch(got_dx, ref_.dx, ref_.g_abs, dtype(), kGeluEpilogueRoundings)) << "dx";
            if (step == 1) {
                first_dx = got_dx;
            }
            // The main grad sums the dx the kernel returned, in its own precision (never rounded to dx's dtype
            // first), and against the exact gradient it is as good as dx.
            EXPECT_TRUE(ValuesMatch(main_pre_db, AddScaled(old_pre_db, RefColumnSum(first_dx, c.m, c.in), step),
                                    main_dtype, step))
                << "pre_db = old + Σ_rows dx (the returned dx)";
            EXPECT_TRUE(GeluGradMatch(main_pre_db, AddScaled(old_pre_db, ref_.pre_db, step),
                                      AddScaled(Values(ref_.pre_db_g_abs.size(), 0.0), ref_.pre_db_g_abs, step),
                                      dtype(), kGeluEpilogueRoundings))
                << "pre_db = old + Σ_rows dx (exact)";
            EXPECT_TRUE(ValuesMatch(main_db, AddScaled(old_db, ref_.db, step), main_dtype, step)) << "db";
            EXPECT_TRUE(ValuesMatch(main_dw, AddScaled(old_dw, ref_.dw, step), main_dtype, step)) << "dw";
        }
    }
}

TEST_P(LinearBackwardGeluTest, SplitBackwardInputTakesTheActivationToo) {
    const Case c = kCases.front();
    Prepare(c, 53);
    for (const DType pre_db_dtype : {dtype(), MainGradDType(device(), dtype())}) {
        for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << "pre_db " << DTypeName(pre_db_dtype) << (accumulate ? " accumulate" : " overwrite"));
            Tensor dx = Poison({c.m, c.in}, dtype());
            Tensor pre_db = Random({c.in}, pre_db_dtype, 53, "old", std::sqrt(static_cast<double>(c.m)));
            const Values old = pre_db.ToDoubleVector();
            LinearBackwardInput(LinearBackwardInputArgs{.dy = dy_,
                                                        .weight = w_,
                                                        .dx = dx,
                                                        .input_activation = LinearActivation::kGeluTanh,
                                                        .pre_activation = &pre_,
                                                        .pre_activation_dbias = &pre_db,
                                                        .accumulate = accumulate});
            EXPECT_TRUE(GeluGradMatch(dx, ref_.dx, ref_.g_abs, dtype(), kGeluEpilogueRoundings)) << "dx";
            const Values want = accumulate ? AddScaled(old, ref_.pre_db) : ref_.pre_db;
            EXPECT_TRUE(GeluGradMatch(pre_db, want, ref_.pre_db_g_abs, dtype(), kGeluEpilogueRoundings)) << "pre_db";
        }
    }
    // Without the bias grad: DGELU alone.
    Tensor dx = Poison({c.m, c.in}, dtype());
    LinearBackwardInput(LinearBackwardInputArgs{
        .dy = dy_, .weight = w_, .dx = dx, .input_activation = LinearActivation::kGeluTanh, .pre_activation = &pre_});
    EXPECT_TRUE(GeluGradMatch(dx, ref_.dx, ref_.g_abs, dtype(), kGeluEpilogueRoundings)) << "dx alone";
}

TEST_P(LinearBackwardGeluTest, RepeatedCallsGiveTheSameBits) {
    // The fused epilogues and the column sums are deterministic: a second call returns the same bytes.
    const Case c = kCases.back();
    Prepare(c, 54);
    auto run = [&] {
        std::vector<Tensor> out = {Poison({c.m, c.in}, dtype()), Poison({c.out, c.in}, dtype()),
                                   Poison({c.out}, dtype()), Poison({c.in}, dtype())};
        LinearBackward(LinearBackwardArgs{.dy = dy_,
                                          .x = &x_,
                                          .weight = &w_,
                                          .dx = &out[0],
                                          .dweight = &out[1],
                                          .dbias = &out[2],
                                          .input_activation = LinearActivation::kGeluTanh,
                                          .pre_activation = &pre_,
                                          .pre_activation_dbias = &out[3]});
        std::vector<std::vector<unsigned char>> bytes;
        for (const Tensor &t : out) {
            bytes.push_back(HostBytes(t));
        }
        return bytes;
    };
    const auto first = run();
    EXPECT_EQ(run(), first);
}

TEST_P(LinearBackwardGeluTest, NoRowsZeroesThePreviousBiasGradUnlessAccumulating) {
    const Tensor dy = Tensor::Empty({0, 7}, dtype(), device());
    const Tensor w = Random({7, 5}, dtype(), 55, "w");
    const Tensor pre = Tensor::Empty({0, 5}, dtype(), device());
    Tensor dx = Tensor::Empty({0, 5}, dtype(), device());
    Tensor pre_db = Random({5}, dtype(), 55, "pre_db");
    const Values before = pre_db.ToDoubleVector();
    const LinearBackwardArgs args{.dy = dy,
                                  .weight = &w,
                                  .dx = &dx,
                                  .accumulate = true,
                                  .input_activation = LinearActivation::kGeluTanh,
                                  .pre_activation = &pre,
                                  .pre_activation_dbias = &pre_db};
    LinearBackward(args);
    EXPECT_EQ(pre_db.ToDoubleVector(), before);
    LinearBackwardArgs overwrite = args;
    overwrite.accumulate = false;
    LinearBackward(overwrite);
    EXPECT_EQ(AbsSum(pre_db.ToDoubleVector()), 0.0);
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(LinearBackwardGeluTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// CUDA's legacy provider (cublasGemmEx and separate bias-grad kernels)

using LinearBackwardLegacyTest = DeviceTest<>;

TEST_P(LinearBackwardLegacyTest, LegacyProviderRunsTheGeluGradAndPreviousBiasGradApart) {
    ScopedProvider legacy(kernels::kLegacyProvider);
    const Case c{512, 128, 200};
    const Tensor x = Random({c.m, c.in}, dtype(), 44, "x");
    const Tensor w = Random({c.out, c.in}, dtype(), 44, "w", 1.0 / std::sqrt(static_cast<double>(c.out)));
    const Tensor dy = Random({c.m, c.out}, dtype(), 44, "dy");
    const Tensor pre = Random({c.m, c.in}, dtype(), 44, "pre", 1.5);
    Tensor dx = Poison({c.m, c.in}, dtype());
    Tensor pre_db = Poison({c.in}, dtype());
    LinearBackward(LinearBackwardArgs{.dy = dy,
                                      .weight = &w,
                                      .dx = &dx,
                                      .input_activation = LinearActivation::kGeluTanh,
                                      .pre_activation = &pre,
                                      .pre_activation_dbias = &pre_db});
    const GeluRef ref = RefAfterGelu(dy, x, w, pre, c);
    EXPECT_TRUE(GeluGradMatch(dx, ref.dx, ref.g_abs, dtype(), kGeluEpilogueRoundings));
    EXPECT_TRUE(GeluGradMatch(pre_db, ref.pre_db, ref.pre_db_g_abs, dtype(), kGeluEpilogueRoundings));
}

TEST_P(LinearBackwardLegacyTest, LegacyProviderComputesTheSame) {
    ScopedProvider legacy(kernels::kLegacyProvider);
    const Case c{512, 128, 200};
    const Tensor x = Random({c.m, c.in}, dtype(), 43, "x");
    const Tensor w = Random({c.out, c.in}, dtype(), 43, "w");
    const Tensor dy = Random({c.m, c.out}, dtype(), 43, "dy");
    Tensor dx = Poison({c.m, c.in}, dtype());
    Tensor dw = Poison({c.out, c.in}, dtype());
    Tensor db = Poison({c.out}, dtype());
    LinearBackward(LinearBackwardArgs{.dy = dy, .x = &x, .weight = &w, .dx = &dx, .dweight = &dw, .dbias = &db});
    const Values dyv = dy.ToDoubleVector();
    EXPECT_TRUE(ValuesMatch(dx, RefLinearBackwardInput(dyv, w.ToDoubleVector(), c.m, c.out, c.in), dtype()));
    EXPECT_TRUE(ValuesMatch(dw, RefLinearBackwardWeight(dyv, x.ToDoubleVector(), c.m, c.out, c.in), dtype()));
    EXPECT_TRUE(ValuesMatch(db, RefColumnSum(dyv, c.m, c.out), dtype()));
}

INSTANTIATE_TEST_SUITE_P(Cuda, LinearBackwardLegacyTest, DeviceDTypes(DeviceType::kCUDA), DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Argument checks

TEST(LinearBackwardArgsTest, MissingInputsAndWrongShapesAreNamed) {
    const Tensor dy = RandomTensor({4, 3}, DType::kFloat32, Device::CPU(), 1, "dy");
    const Tensor x = RandomTensor({4, 2}, DType::kFloat32, Device::CPU(), 1, "x");
    Tensor dx = Tensor::Empty({4, 2}, DType::kFloat32);
    Tensor dw = Tensor::Empty({3, 2}, DType::kFloat32);
    Tensor bad_db = Tensor::Empty({2}, DType::kFloat32);
    auto error = [](const LinearBackwardArgs &args) -> std::string {
        try {
            LinearBackward(args);
        } catch (const Error &e) {
            return e.what();
        }
        return "accepted";
    };
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dx = &dx}), HasSubstr("LinearBackward: dx needs the weight"));
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dweight = &dw}),
                HasSubstr("LinearBackward: dweight needs the input x"));
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .dbias = &bad_db}), HasSubstr("dbias must have shape [3]"));
    Tensor wrong_dw = Tensor::Empty({2, 3}, DType::kFloat32);
    EXPECT_THAT(error(LinearBackwardArgs{.dy = dy, .x = &x, .dweight = &wrong_dw}),
                HasSubstr("dweight must have shape [3, 2]"));
    // Nothing asked: nothing done, no error.
    EXPECT_EQ(error(LinearBackwardArgs{.dy = dy}), "accepted");
}

TEST(LinearBackwardArgsTest, InputActivationOperandsAreChecked) {
    const Tensor dy = RandomTensor({4, 3}, DType::kFloat32, Device::CPU(), 1, "dy");
    const Tensor w = RandomTensor({3, 2}, DType::kFloat32, Device::CPU(), 1, "w");
    const Tensor pre = RandomTensor({4, 2}, DType::kFloat32, Device::CPU(), 1, "pre");
    const Tensor wrong_pre = RandomTensor({4, 3}, DType::kFloat32, Device::CPU(), 1, "pre");
    const Tensor pre64 = RandomTensor({4, 2}, DType::kFloat64, Device::CPU(), 1, "pre");
    Tensor dx = Tensor::Empty({4, 2}, DType::kFloat32);
    Tensor pre_db = Tensor::Empty({2}, DType::kFloat32);
    Tensor wrong_pre_db = Tensor::Empty({3}, DType::kFloat32);
    Tensor pre_db64 = Tensor::Empty({2}, DType::kFloat64);
    constexpr auto kGelu = LinearActivation::kGeluTanh;
    auto error = [](const LinearBackwardArgs &args) -> std::string {
        try {
            LinearBackward(args);
        } catch (const Error &e) {
            return e.what();
        }
        return "accepted";
    };
    EXPECT_THAT(error({.dy = dy, .weight = &w, .dx = &dx, .input_activation = kGelu}),
                HasSubstr("LinearBackward: input_activation gelu_tanh needs the pre_activation tensor"));
    EXPECT_THAT(error({.dy = dy, .weight = &w, .dx = &dx, .pre_activation = &pre}),
                HasSubstr("pre_activation is given but input_activation is none"));
    EXPECT_THAT(error({.dy = dy, .weight = &w, .dx = &dx, .pre_activation_dbias = &pre_db}),
                HasSubstr("pre_activation_dbias (the bias grad of the layer before the activation) needs"));
    EXPECT_THAT(error({.dy = dy, .input_activation = kGelu, .pre_activation = &pre, .pre_activation_dbias = &pre_db}),
                HasSubstr("pre_activation_dbias is Σ_rows dx: it needs dx"));
    EXPECT_THAT(error({.dy = dy, .weight = &w, .dx = &dx, .input_activation = kGelu, .pre_activation = &wrong_pre}),
                HasSubstr("pre_activation must have shape [4, 2]"));
    EXPECT_THAT(error({.dy = dy, .weight = &w, .dx = &dx, .input_activation = kGelu, .pre_activation = &pre64}),
                HasSubstr("pre_activation and dx must have one dtype"));
    EXPECT_THAT(error({.dy = dy,
                       .weight = &w,
                       .dx = &dx,
                       .input_activation = kGelu,
                       .pre_activation = &pre,
                       .pre_activation_dbias = &wrong_pre_db}),
                HasSubstr("pre_activation_dbias must have shape [2]"));
    EXPECT_THAT(error({.dy = dy,
                       .weight = &w,
                       .dx = &dx,
                       .input_activation = kGelu,
                       .pre_activation = &pre,
                       .pre_activation_dbias = &pre_db64}),
                HasSubstr("pre_activation_dbias must have dx's dtype float32 or float32, got"));
    EXPECT_EQ(error({.dy = dy,
                     .weight = &w,
                     .dx = &dx,
                     .input_activation = kGelu,
                     .pre_activation = &pre,
                     .pre_activation_dbias = &pre_db}),
              "accepted");
}

} // namespace
} // namespace shardline::testing
