// The cross-entropy stages on CUDA against a float64 log-softmax reference (warp-per-row and block-per-row kernels),
// and the vocab-parallel split: stages per class shard combined as the all-reduces would, against the unsplit loss
// and gradient.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/cross_entropy.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::CrossEntropyBackward;
using kernels::CrossEntropyBackwardArgs;
using kernels::CrossEntropyLoss;
using kernels::CrossEntropyLossArgs;
using kernels::CrossEntropyRowMax;
using kernels::CrossEntropyRowMaxArgs;
using kernels::CrossEntropyStats;
using kernels::CrossEntropyStatsArgs;

/// The budget of dlogits: the float32 statistics (exp, the row sum) then the rounding to the logits' dtype.
constexpr int kStatsRoundings = 2;

struct Forward {
    Tensor row_max, sum_exp, target, loss;
};
Forward RunForward(const Tensor& logits, const Tensor& labels, std::int64_t class_start = 0) {
    const std::int64_t n = labels.numel();
    Forward f{Tensor::Empty({n}, DType::kFloat32, Gpu()), Tensor::Empty({n}, DType::kFloat32, Gpu()),
              Tensor::Empty({n}, DType::kFloat32, Gpu()), Tensor::Empty({n}, DType::kFloat32, Gpu())};
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = f.row_max});
    CrossEntropyStats(CrossEntropyStatsArgs{.logits = logits,
                                            .row_max = f.row_max,
                                            .labels = labels,
                                            .class_start = class_start,
                                            .sum_exp = f.sum_exp,
                                            .target_logit = f.target});
    CrossEntropyLoss(
        CrossEntropyLossArgs{.row_max = f.row_max, .sum_exp = f.sum_exp, .target_logit = f.target, .loss = f.loss});
    return f;
}

Tensor RandomLogits(const Shape& shape, DType dtype, std::uint64_t seed) {
    return RandomGpu(shape, dtype, seed, "logits", 3.0);
}

Tensor RandomLabels(std::int64_t n, std::int64_t lo, std::int64_t hi, std::uint64_t seed) {
    return RandomTensor({n}, DType::kInt64, Gpu(), seed, "labels", RandomDistribution::kInteger,
                        static_cast<double>(lo), static_cast<double>(hi));
}

std::int64_t LeadingRows(const Shape& shape) {
    return Numel(Shape(shape.begin(), shape.end() - 1));
}

// One class; odd widths on the warp-per-row path (C <= 1024) and the block-per-row path (C > 1024, including a GPT-2
// vocabulary); leading dims; no rows; more rows than one grid pass covers.
const std::vector<Shape> kShapes = {{1, 1}, {5, 7}, {3, 4, 33}, {6, 1000}, {4, 1025}, {3, 50257}, {0, 5}, {300000, 3}};

using CudaCrossEntropyTest = CudaParamTest<DType>;

TEST_P(CudaCrossEntropyTest, StagesComputeTheLossOfLogSoftmax) {
    const DType dtype = GetParam();
    for (const Shape& shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const std::int64_t c = shape.back();
        const std::int64_t n = LeadingRows(shape);
        const Tensor logits = RandomLogits(shape, dtype, 60);
        const Tensor labels = RandomLabels(n, 0, c - 1, 60);
        const Forward f = RunForward(logits, labels);
        const Values x = logits.ToDoubleVector();
        const Values lv = labels.ToDoubleVector();
        EXPECT_TRUE(ValuesMatch(f.loss, RefCrossEntropyLoss(x, lv, n, c), DType::kFloat32));
        // The row max is one of the logits and the target is the label's logit: both exact.
        const Values row_max = f.row_max.ToDoubleVector();
        const Values target = f.target.ToDoubleVector();
        for (std::int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(row_max[i], *std::max_element(x.begin() + i * c, x.begin() + (i + 1) * c)) << "row " << i;
            ASSERT_EQ(target[i], x[i * c + static_cast<std::int64_t>(lv[i])]) << "row " << i;
        }
    }
}

TEST_P(CudaCrossEntropyTest, BackwardIsSoftmaxMinusOneHotScaledByDloss) {
    const DType dtype = GetParam();
    for (const Shape& shape : kShapes) {
        for (const bool broadcast : {false, true}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << (broadcast ? ", scalar dloss" : ""));
            const std::int64_t c = shape.back();
            const std::int64_t n = LeadingRows(shape);
            const Tensor logits = RandomLogits(shape, dtype, 61);
            const Tensor labels = RandomLabels(n, 0, c - 1, 61);
            const Forward f = RunForward(logits, labels);
            const Tensor dloss = RandomGpu({broadcast ? 1 : n}, DType::kFloat32, 61, "dloss");
            Tensor dlogits = RandomLogits(shape, dtype, 99);
            const double scale = broadcast ? 1.0 / std::max<std::int64_t>(n, 1) : 0.75;
            CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                          .row_max = f.row_max,
                                                          .sum_exp = f.sum_exp,
                                                          .labels = labels,
                                                          .dloss = dloss,
                                                          .scale = scale,
                                                          .dlogits = dlogits});
            const Values want =
                RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(),
                                    scale, n, c);
            EXPECT_TRUE(ValuesMatch(dlogits, want, dtype, kStatsRoundings));
        }
    }
}

TEST_P(CudaCrossEntropyTest, BackwardMayOverwriteTheLogits) {
    const DType dtype = GetParam();
    for (const Shape& shape : {Shape{9, 17}, Shape{5, 3000}}) {
        SCOPED_TRACE(ShapeToString(shape));
        Tensor logits = RandomLogits(shape, dtype, 62);
        const Tensor labels = RandomLabels(shape[0], 0, shape[1] - 1, 62);
        const Forward f = RunForward(logits, labels);
        const Tensor dloss = RandomGpu({shape[0]}, DType::kFloat32, 62, "dloss");
        const Values want =
            RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(),
                                1.0, shape[0], shape[1]);
        CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                      .row_max = f.row_max,
                                                      .sum_exp = f.sum_exp,
                                                      .labels = labels,
                                                      .dloss = dloss,
                                                      .dlogits = logits});
        EXPECT_TRUE(ValuesMatch(logits, want, dtype, kStatsRoundings));
    }
}

/// Columns [start, start + width) of an [n, c] GPU matrix.
Tensor Columns(const Tensor& m, std::int64_t start, std::int64_t width) {
    const std::int64_t n = m.size(0);
    const std::int64_t c = m.size(1);
    const Values all = m.ToDoubleVector();
    Values part;
    for (std::int64_t i = 0; i < n; ++i) {
        part.insert(part.end(), all.begin() + i * c + start, all.begin() + i * c + start + width);
    }
    return Tensor::FromVector(part, {n, width}, DType::kFloat64).To(m.dtype()).To(Gpu());
}

TEST_P(CudaCrossEntropyTest, VocabParallelStagesCombineToTheUnsplitLossAndGradient) {
    const DType dtype = GetParam();
    const std::int64_t n = 24;
    const std::int64_t classes = 3001; // unsplit and 2 shards: a block per row; 3, 4 and 8 shards: a warp per row
    const Tensor logits = RandomLogits({n, classes}, dtype, 63);
    const Tensor labels = RandomLabels(n, 0, classes - 1, 63);
    const Tensor dloss = RandomGpu({n}, DType::kFloat32, 63, "dloss");
    const Values x = logits.ToDoubleVector();
    const Values ref_loss = RefCrossEntropyLoss(x, labels.ToDoubleVector(), n, classes);
    const Values ref_grad = RefCrossEntropyGrad(x, labels.ToDoubleVector(), dloss.ToDoubleVector(), 1.0, n, classes);
    const Forward unsplit = RunForward(logits, labels);
    EXPECT_TRUE(ValuesMatch(unsplit.loss, ref_loss, DType::kFloat32));

    for (const std::int64_t tp : {2, 3, 4, 8}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        const std::int64_t chunk = (classes + tp - 1) / tp;
        std::vector<Tensor> shards;
        std::vector<std::int64_t> starts;
        for (std::int64_t start = 0; start < classes; start += chunk) {
            starts.push_back(start);
            shards.push_back(Columns(logits, start, std::min(chunk, classes - start)));
        }
        Values row_max(n, -std::numeric_limits<double>::infinity());
        for (const Tensor& shard : shards) {
            Tensor m = Tensor::Empty({n}, DType::kFloat32, Gpu());
            CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = shard, .row_max = m});
            const Values mv = m.ToDoubleVector();
            for (std::int64_t i = 0; i < n; ++i) {
                row_max[i] = std::max(row_max[i], mv[i]); // all-reduce(max)
            }
        }
        EXPECT_EQ(row_max, unsplit.row_max.ToDoubleVector());
        const Tensor global_max = Tensor::FromVector(row_max, {n}, DType::kFloat32).To(Gpu());
        Values sum_exp(n, 0.0);
        Values target(n, 0.0);
        for (std::size_t s = 0; s < shards.size(); ++s) {
            Tensor se = Tensor::Empty({n}, DType::kFloat32, Gpu());
            Tensor t = Tensor::Empty({n}, DType::kFloat32, Gpu());
            CrossEntropyStats(CrossEntropyStatsArgs{.logits = shards[s],
                                                    .row_max = global_max,
                                                    .labels = labels,
                                                    .class_start = starts[s],
                                                    .sum_exp = se,
                                                    .target_logit = t});
            const Values sev = se.ToDoubleVector();
            const Values tv = t.ToDoubleVector();
            for (std::int64_t i = 0; i < n; ++i) {
                sum_exp[i] += sev[i]; // all-reduce(sum)
                target[i] += tv[i];
            }
        }
        EXPECT_EQ(target, unsplit.target.ToDoubleVector()) << "exactly one shard holds each label";
        EXPECT_TRUE(ValuesMatch(sum_exp, unsplit.sum_exp.ToDoubleVector(), DType::kFloat32));
        const Tensor se_t = Tensor::FromVector(sum_exp, {n}, DType::kFloat32).To(Gpu());
        Tensor loss = Tensor::Empty({n}, DType::kFloat32, Gpu());
        CrossEntropyLoss(
            CrossEntropyLossArgs{.row_max = global_max,
                                 .sum_exp = se_t,
                                 .target_logit = Tensor::FromVector(target, {n}, DType::kFloat32).To(Gpu()),
                                 .loss = loss});
        EXPECT_TRUE(ValuesMatch(loss, ref_loss, DType::kFloat32));
        Values grad(static_cast<std::size_t>(n * classes));
        for (std::size_t s = 0; s < shards.size(); ++s) {
            const std::int64_t width = shards[s].size(1);
            Tensor dshard = Tensor::Empty({n, width}, dtype, Gpu());
            CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = shards[s],
                                                          .row_max = global_max,
                                                          .sum_exp = se_t,
                                                          .labels = labels,
                                                          .class_start = starts[s],
                                                          .dloss = dloss,
                                                          .dlogits = dshard});
            const Values dv = dshard.ToDoubleVector();
            for (std::int64_t i = 0; i < n; ++i) {
                std::copy(dv.begin() + i * width, dv.begin() + (i + 1) * width, grad.begin() + i * classes + starts[s]);
            }
        }
        EXPECT_TRUE(ValuesMatch(grad, ref_grad, dtype, kStatsRoundings));
    }
}

TEST_P(CudaCrossEntropyTest, ShardWithoutClassesGivesTheIdentitiesOfMaxAndSum) {
    const DType dtype = GetParam();
    const Tensor logits = Tensor::Empty({4, 0}, dtype, Gpu());
    const Tensor labels = RandomLabels(4, 0, 9, 64);
    Tensor row_max = Tensor::Zeros({4}, DType::kFloat32, Gpu());
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max});
    EXPECT_EQ(row_max.ToDoubleVector(), Values(4, -std::numeric_limits<double>::infinity()));
    Tensor sum_exp = Tensor::Full({4}, 7.0, DType::kFloat32, Gpu());
    Tensor target = Tensor::Full({4}, 7.0, DType::kFloat32, Gpu());
    const Tensor global_max = RandomGpu({4}, DType::kFloat32, 64, "max");
    CrossEntropyStats(CrossEntropyStatsArgs{
        .logits = logits, .row_max = global_max, .labels = labels, .sum_exp = sum_exp, .target_logit = target});
    EXPECT_EQ(sum_exp.ToDoubleVector(), Values(4, 0.0));
    EXPECT_EQ(target.ToDoubleVector(), Values(4, 0.0));
}

TEST_P(CudaCrossEntropyTest, NanLogitMakesItsRowNan) {
    const DType dtype = GetParam();
    Values v = RandomLogits({2, 2000}, dtype, 65).ToDoubleVector();
    v[2000 + 1234] = std::nan(""); // row 1
    const Tensor logits = Tensor::FromVector(v, {2, 2000}, DType::kFloat64).To(dtype).To(Gpu());
    Tensor row_max = Tensor::Empty({2}, DType::kFloat32, Gpu());
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max});
    const Values m = row_max.ToDoubleVector();
    EXPECT_FALSE(std::isnan(m[0]));
    EXPECT_TRUE(std::isnan(m[1])) << "fmax would have dropped the NaN";
}

INSTANTIATE_TEST_SUITE_P(DType, CudaCrossEntropyTest, CudaDTypes(), DTypeParamName);

TEST_F(CudaTest, CrossEntropyStatisticsAndDlossAreFloat32OnCuda) {
    const Tensor logits = Tensor::Zeros({4, 5}, DType::kBFloat16, Gpu());
    const Tensor labels = Tensor::Zeros({4}, DType::kInt64, Gpu());
    const Tensor stat = Tensor::Zeros({4}, DType::kFloat32, Gpu());
    const Tensor dloss64 = Tensor::Zeros({4}, DType::kFloat64, Gpu());
    Tensor dlogits = Tensor::Zeros({4, 5}, DType::kBFloat16, Gpu());
    try {
        CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                      .row_max = stat,
                                                      .sum_exp = stat,
                                                      .labels = labels,
                                                      .dloss = dloss64,
                                                      .dlogits = dlogits});
        ADD_FAILURE() << "a float64 dloss was accepted on CUDA";
    } catch (const DTypeError& e) {
        EXPECT_NE(std::string(e.what()).find("dloss must be float32 on CUDA"), std::string::npos) << e.what();
    }
    Tensor half_max = Tensor::Zeros({4}, DType::kBFloat16, Gpu());
    try {
        CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = half_max});
        ADD_FAILURE() << "bfloat16 statistics were accepted";
    } catch (const DTypeError& e) {
        EXPECT_NE(std::string(e.what()).find("row_max must be float32"), std::string::npos) << e.what();
    }
}

} // namespace
} // namespace shardline::testing
