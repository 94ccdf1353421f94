// The cross-entropy stages on the CPU against a float64 log-softmax reference, the vocab-parallel split (stages per
// class shard, combined as the all-reduces would: max of the maxima, Σ sum_exp·exp(max_s - max), Σ target) against the
// unsplit loss and gradient, and the error messages.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/cross_entropy.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::AbsSum;
using ::testing::AllOf;
using testing::CpuDTypes;
using testing::DTypeParamName;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::RefCrossEntropyGrad;
using testing::RefCrossEntropyLoss;
using testing::Values;
using testing::ValuesMatch;

DType StatsDType(DType logits) {
    return logits == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

/// The three forward stages on one device, no communication.
struct Forward {
    Tensor row_max, sum_exp, target, loss;
};
Forward RunForward(const Tensor &logits, const Tensor &labels, std::int64_t class_start = 0) {
    const std::int64_t n = labels.numel();
    const DType s = StatsDType(logits.dtype());
    Forward f{Tensor::Empty({n}, s), Tensor::Empty({n}, s), Tensor::Empty({n}, s), Tensor::Empty({n}, s)};
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

struct Case {
    Shape logits_shape; ///< [..., C]
};
// One class, odd sizes, leading dims, no rows, a wide row.
const std::vector<Case> kCases = {{{1, 1}}, {{5, 7}}, {{3, 4, 33}}, {{0, 5}}, {{6, 1000}}, {{2, 0, 3}}};

/// N: the product of the dims before the class dim.
std::int64_t LeadingRows(const Shape &logits_shape) {
    return Numel(Shape(logits_shape.begin(), logits_shape.end() - 1));
}

Tensor RandomLogits(const Shape &shape, DType dtype, std::uint64_t seed) {
    return RandomTensor(shape, dtype, Device::CPU(), seed, "logits", RandomDistribution::kNormal, 0.0, 3.0);
}

Tensor RandomLabels(std::int64_t n, std::int64_t lo, std::int64_t hi, std::uint64_t seed) {
    return RandomTensor({n}, DType::kInt64, Device::CPU(), seed, "labels", RandomDistribution::kInteger,
                        static_cast<double>(lo), static_cast<double>(hi));
}

class CrossEntropyTest : public ::testing::TestWithParam<DType> {};

TEST_P(CrossEntropyTest, StagesComputeTheLossOfLogSoftmax) {
    const DType dtype = GetParam();
    for (const Case &k : kCases) {
        SCOPED_TRACE(ShapeToString(k.logits_shape));
        const std::int64_t c = k.logits_shape.back();
        const std::int64_t n = LeadingRows(k.logits_shape);
        const Tensor logits = RandomLogits(k.logits_shape, dtype, 20);
        const Tensor labels = RandomLabels(n, 0, std::max<std::int64_t>(c - 1, 0), 20);
        const Forward f = RunForward(logits, labels);
        const Values x = logits.ToDoubleVector();
        if (n > 0) {
            ASSERT_GT(AbsSum(x), 0.0);
        }
        EXPECT_TRUE(ValuesMatch(f.loss, RefCrossEntropyLoss(x, labels.ToDoubleVector(), n, c), StatsDType(dtype)));
        // The row max is one of the logits, and the target logit is the label's, exactly.
        const Values row_max = f.row_max.ToDoubleVector();
        const Values target = f.target.ToDoubleVector();
        const Values lv = labels.ToDoubleVector();
        for (std::int64_t i = 0; i < n; ++i) {
            EXPECT_EQ(row_max[i], *std::max_element(x.begin() + i * c, x.begin() + (i + 1) * c)) << "row " << i;
            EXPECT_EQ(target[i], x[i * c + static_cast<std::int64_t>(lv[i])]) << "row " << i;
        }
    }
}

TEST_P(CrossEntropyTest, BackwardIsSoftmaxMinusOneHotScaledByDloss) {
    const DType dtype = GetParam();
    for (const Case &k : kCases) {
        for (const bool broadcast : {false, true}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(k.logits_shape) << (broadcast ? ", scalar dloss" : ""));
            const std::int64_t c = k.logits_shape.back();
            const std::int64_t n = LeadingRows(k.logits_shape);
            const Tensor logits = RandomLogits(k.logits_shape, dtype, 21);
            const Tensor labels = RandomLabels(n, 0, std::max<std::int64_t>(c - 1, 0), 21);
            const Forward f = RunForward(logits, labels);
            const Tensor dloss = RandomTensor({broadcast ? 1 : n}, StatsDType(dtype), Device::CPU(), 21, "dloss");
            Tensor dlogits = RandomLogits(k.logits_shape, dtype, 99); // poison: every element is overwritten
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
            EXPECT_TRUE(ValuesMatch(dlogits, want, dtype, 2.0)); // through the float32 statistics, then rounded
        }
    }
}

TEST_P(CrossEntropyTest, BackwardMayOverwriteTheLogits) {
    const DType dtype = GetParam();
    Tensor logits = RandomLogits({9, 17}, dtype, 22);
    const Tensor labels = RandomLabels(9, 0, 16, 22);
    const Forward f = RunForward(logits, labels);
    const Tensor dloss = RandomTensor({9}, StatsDType(dtype), Device::CPU(), 22, "dloss");
    const Values want = RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(),
                                            1.0, 9, 17);
    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                  .row_max = f.row_max,
                                                  .sum_exp = f.sum_exp,
                                                  .labels = labels,
                                                  .dloss = dloss,
                                                  .dlogits = logits});
    EXPECT_TRUE(ValuesMatch(logits, want, dtype, 2.0));
}

/// Columns [start, start + width) of an [n, c] matrix.
Tensor Columns(const Tensor &m, std::int64_t start, std::int64_t width) {
    const std::int64_t n = m.size(0);
    const std::int64_t c = m.size(1);
    const Values all = m.ToDoubleVector();
    Values part;
    for (std::int64_t i = 0; i < n; ++i) {
        part.insert(part.end(), all.begin() + i * c + start, all.begin() + i * c + start + width);
    }
    return Tensor::FromVector(part, {n, width}, m.dtype());
}

TEST_P(CrossEntropyTest, VocabParallelStagesCombineToTheUnsplitLossAndGradient) {
    const DType dtype = GetParam();
    const DType stats = StatsDType(dtype);
    const std::int64_t n = 12;
    const std::int64_t classes = 37;
    const Tensor logits = RandomLogits({n, classes}, dtype, 23);
    // Labels over the whole vocabulary, so every shard sees rows whose label lives elsewhere.
    const Tensor labels = RandomLabels(n, 0, classes - 1, 23);
    const Tensor dloss = RandomTensor({n}, stats, Device::CPU(), 23, "dloss");
    const Forward unsplit = RunForward(logits, labels);
    Tensor unsplit_grad = Tensor::Empty({n, classes}, dtype);
    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                  .row_max = unsplit.row_max,
                                                  .sum_exp = unsplit.sum_exp,
                                                  .labels = labels,
                                                  .dloss = dloss,
                                                  .dlogits = unsplit_grad});
    const Values ref_loss = RefCrossEntropyLoss(logits.ToDoubleVector(), labels.ToDoubleVector(), n, classes);
    const Values ref_grad =
        RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(), 1.0, n, classes);
    EXPECT_TRUE(ValuesMatch(unsplit.loss, ref_loss, stats));

    for (const std::int64_t tp : {2, 3, 4, 12}) { // 12 shards of 37 classes: chunks of 4, then 1, then two empty
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        const std::int64_t chunk = (classes + tp - 1) / tp;
        std::vector<Tensor> shards;
        std::vector<std::int64_t> starts;
        for (std::int64_t s = 0; s < tp; ++s) {
            const std::int64_t start = std::min(s * chunk, classes);
            starts.push_back(start);
            shards.push_back(Columns(logits, start, std::min(chunk, classes - start)));
        }
        // Stage 1 per shard, then the all-reduce(max).
        Values row_max(n, -std::numeric_limits<double>::infinity());
        std::vector<Values> shard_max;
        for (const Tensor &shard : shards) {
            Tensor m = Tensor::Empty({n}, stats);
            CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = shard, .row_max = m});
            shard_max.push_back(m.ToDoubleVector());
            for (std::int64_t i = 0; i < n; ++i) {
                row_max[i] = std::max(row_max[i], shard_max.back()[i]);
            }
        }
        EXPECT_EQ(row_max, unsplit.row_max.ToDoubleVector());
        // Stage 2 per shard with the global max, then the all-reduce(sum) of sum_exp and target_logit.
        const Tensor global_max = Tensor::FromVector(row_max, {n}, stats);
        Values sum_exp(n, 0.0);
        Values target(n, 0.0);
        Values rescaled(n, 0.0); // Σ_s sum_exp_s(own max)·exp(max_s - max): the other way to combine
        for (std::size_t s = 0; s < shards.size(); ++s) {
            Tensor se = Tensor::Empty({n}, stats);
            Tensor t = Tensor::Empty({n}, stats);
            CrossEntropyStats(CrossEntropyStatsArgs{.logits = shards[s],
                                                    .row_max = global_max,
                                                    .labels = labels,
                                                    .class_start = starts[s],
                                                    .sum_exp = se,
                                                    .target_logit = t});
            Tensor own_se = Tensor::Empty({n}, stats);
            Tensor own_t = Tensor::Empty({n}, stats);
            CrossEntropyStats(CrossEntropyStatsArgs{.logits = shards[s],
                                                    .row_max = Tensor::FromVector(shard_max[s], {n}, stats),
                                                    .labels = labels,
                                                    .class_start = starts[s],
                                                    .sum_exp = own_se,
                                                    .target_logit = own_t});
            const Values sev = se.ToDoubleVector();
            const Values tv = t.ToDoubleVector();
            const Values own = own_se.ToDoubleVector();
            for (std::int64_t i = 0; i < n; ++i) {
                sum_exp[i] += sev[i];
                target[i] += tv[i];
                if (own[i] > 0) { // an empty shard has sum 0 and max -inf
                    rescaled[i] += own[i] * std::exp(shard_max[s][i] - row_max[i]);
                }
            }
        }
        EXPECT_EQ(target, unsplit.target.ToDoubleVector()) << "exactly one shard holds each label";
        EXPECT_TRUE(ValuesMatch(sum_exp, unsplit.sum_exp.ToDoubleVector(), stats));
        EXPECT_TRUE(ValuesMatch(rescaled, unsplit.sum_exp.ToDoubleVector(), stats, 4.0));
        // Stage 3 on the reduced statistics: the same loss on every rank.
        Tensor loss = Tensor::Empty({n}, stats);
        const Tensor se_t = Tensor::FromVector(sum_exp, {n}, stats);
        CrossEntropyLoss(CrossEntropyLossArgs{.row_max = global_max,
                                              .sum_exp = se_t,
                                              .target_logit = Tensor::FromVector(target, {n}, stats),
                                              .loss = loss});
        EXPECT_TRUE(ValuesMatch(loss, ref_loss, stats));
        EXPECT_TRUE(ValuesMatch(loss, unsplit.loss.ToDoubleVector(), stats));
        // Backward per shard, no communication: the concatenated shards are the unsplit gradient.
        Values grad(static_cast<std::size_t>(n * classes));
        for (std::size_t s = 0; s < shards.size(); ++s) {
            const std::int64_t width = shards[s].size(1);
            Tensor dshard = Tensor::Empty({n, width}, dtype);
            CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = shards[s],
                                                          .row_max = global_max,
                                                          .sum_exp = se_t,
                                                          .labels = labels,
                                                          .class_start = starts[s],
                                                          .dloss = dloss,
                                                          .dlogits = dshard});
            const Values dv = dshard.ToDoubleVector();
            for (std::int64_t i = 0; i < n; ++i) {
                for (std::int64_t j = 0; j < width; ++j) {
                    grad[i * classes + starts[s] + j] = dv[i * width + j];
                }
            }
        }
        EXPECT_TRUE(ValuesMatch(grad, ref_grad, dtype, 2.0));
        EXPECT_TRUE(ValuesMatch(grad, unsplit_grad.ToDoubleVector(), dtype, 2.0));
    }
}

TEST_P(CrossEntropyTest, ShardWithoutClassesGivesTheIdentitiesOfMaxAndSum) {
    const DType dtype = GetParam();
    const DType stats = StatsDType(dtype);
    const Tensor logits = Tensor::Empty({4, 0}, dtype);
    const Tensor labels = RandomLabels(4, 0, 9, 24);
    Tensor row_max = Tensor::Zeros({4}, stats);
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max});
    EXPECT_EQ(row_max.ToDoubleVector(), Values(4, -std::numeric_limits<double>::infinity()));
    Tensor sum_exp = Tensor::Full({4}, 7.0, stats);
    Tensor target = Tensor::Full({4}, 7.0, stats);
    const Tensor global_max = RandomTensor({4}, stats, Device::CPU(), 24, "max");
    CrossEntropyStats(CrossEntropyStatsArgs{
        .logits = logits, .row_max = global_max, .labels = labels, .sum_exp = sum_exp, .target_logit = target});
    EXPECT_EQ(sum_exp.ToDoubleVector(), Values(4, 0.0));
    EXPECT_EQ(target.ToDoubleVector(), Values(4, 0.0));
}

TEST_P(CrossEntropyTest, LabelsOutsideTheShardGiveNoTargetAndNoOneHot) {
    const DType dtype = GetParam();
    const Tensor logits = RandomLogits({3, 5}, dtype, 25);
    // This shard holds classes [10, 15): labels 9 and 15 are another shard's, 12 is column 2.
    const Tensor labels = Tensor::FromVector({9, 12, 15}, {3}, DType::kInt64);
    const Forward f = RunForward(logits, labels, 10);
    const Values x = logits.ToDoubleVector();
    EXPECT_EQ(f.target.ToDoubleVector(), (Values{0.0, x[5 + 2], 0.0}));
    const Tensor dloss = Tensor::Full({1}, 1.0, StatsDType(dtype));
    Tensor dlogits = Tensor::Empty({3, 5}, dtype);
    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                  .row_max = f.row_max,
                                                  .sum_exp = f.sum_exp,
                                                  .labels = labels,
                                                  .class_start = 10,
                                                  .dloss = dloss,
                                                  .dlogits = dlogits});
    const Values local_labels = {-1, 2, -1}; // RefGrad puts no one-hot at -1
    EXPECT_TRUE(ValuesMatch(dlogits, RefCrossEntropyGrad(x, local_labels, {1.0}, 1.0, 3, 5), dtype, 2.0));
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, CrossEntropyTest, CpuDTypes(), DTypeParamName);

TEST(CrossEntropyTest, Float64DlossIsAcceptedForFloat32LogitsOnTheCpu) {
    const Tensor logits = RandomLogits({4, 6}, DType::kFloat32, 26);
    const Tensor labels = RandomLabels(4, 0, 5, 26);
    const Forward f = RunForward(logits, labels);
    const Tensor dloss = RandomTensor({4}, DType::kFloat64, Device::CPU(), 26, "dloss");
    Tensor dlogits = Tensor::Empty({4, 6}, DType::kFloat32);
    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                  .row_max = f.row_max,
                                                  .sum_exp = f.sum_exp,
                                                  .labels = labels,
                                                  .dloss = dloss,
                                                  .dlogits = dlogits});
    EXPECT_TRUE(ValuesMatch(
        dlogits, RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(),
                                     1.0, 4, 6),
        DType::kFloat32, 2.0));
}

// ---------------------------------------------------------------------------------------------------------------------
// Errors

template <class ErrorType> std::string MessageOf(const std::function<void()> &f) {
    try {
        f();
    } catch (const ErrorType &e) {
        return e.what();
    } catch (const std::exception &e) {
        ADD_FAILURE() << "threw the wrong type: " << e.what();
        return {};
    }
    ADD_FAILURE() << "threw nothing";
    return {};
}

TEST(CrossEntropyErrorsTest, LabelsMustBeInt64WithOneLabelPerRow) {
    const Tensor logits = Tensor::Zeros({2, 3, 5}, DType::kFloat32);
    Tensor a = Tensor::Zeros({6}, DType::kFloat32);
    Tensor b = Tensor::Zeros({6}, DType::kFloat32);
    const Tensor row_max = Tensor::Zeros({6}, DType::kFloat32);
    const Tensor float_labels = Tensor::Zeros({6}, DType::kFloat32);
    EXPECT_THAT(
        MessageOf<DTypeError>([&] {
            CrossEntropyStats(CrossEntropyStatsArgs{
                .logits = logits, .row_max = row_max, .labels = float_labels, .sum_exp = a, .target_logit = b});
        }),
        AllOf(HasSubstr("CrossEntropyStats"), HasSubstr("labels must be int64"), HasSubstr("Tensor[6] float32 cpu")));
    const Tensor short_labels = Tensor::Zeros({5}, DType::kInt64);
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    CrossEntropyStats(CrossEntropyStatsArgs{
                        .logits = logits, .row_max = row_max, .labels = short_labels, .sum_exp = a, .target_logit = b});
                }),
                AllOf(HasSubstr("CrossEntropyStats"), HasSubstr("labels must have N = 6 elements"),
                      HasSubstr("logits Tensor[2, 3, 5] float32 cpu"), HasSubstr("Tensor[5] int64 cpu")));
}

TEST(CrossEntropyErrorsTest, StatisticsMustBeFloat32ForFloat32Logits) {
    const Tensor logits = Tensor::Zeros({4, 5}, DType::kFloat32);
    Tensor row_max = Tensor::Zeros({4}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max}); }),
                AllOf(HasSubstr("CrossEntropyRowMax"), HasSubstr("row_max must be float32"),
                      HasSubstr("Tensor[4] float64 cpu")));
    Tensor short_max = Tensor::Zeros({3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = short_max}); }),
                AllOf(HasSubstr("CrossEntropyRowMax"), HasSubstr("row_max must have N = 4 elements")));
    const Tensor m = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor s = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor t64 = Tensor::Zeros({4}, DType::kFloat64);
    Tensor loss = Tensor::Zeros({4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    CrossEntropyLoss(
                        CrossEntropyLossArgs{.row_max = m, .sum_exp = s, .target_logit = t64, .loss = loss});
                }),
                AllOf(HasSubstr("CrossEntropyLoss"), HasSubstr("target_logit must be float32")));
    const Tensor i64 = Tensor::Zeros({4}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    CrossEntropyLoss(
                        CrossEntropyLossArgs{.row_max = i64, .sum_exp = s, .target_logit = s, .loss = loss});
                }),
                AllOf(HasSubstr("CrossEntropyLoss"), HasSubstr("float32 or float64 on the CPU"),
                      HasSubstr("Tensor[4] int64 cpu")));
}

TEST(CrossEntropyErrorsTest, LogitsMustBeFloat) {
    const Tensor logits = Tensor::Zeros({4, 5}, DType::kInt64);
    Tensor row_max = Tensor::Zeros({4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max}); }),
                AllOf(HasSubstr("CrossEntropyRowMax"), HasSubstr("CPU kernels take float32 or float64"),
                      HasSubstr("logits Tensor[4, 5] int64 cpu")));
}

TEST(CrossEntropyErrorsTest, BackwardChecksDlossAndDlogits) {
    const Tensor logits = Tensor::Zeros({4, 5}, DType::kFloat32);
    const Tensor stat = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor labels = Tensor::Zeros({4}, DType::kInt64);
    const Tensor dloss3 = Tensor::Zeros({3}, DType::kFloat32);
    Tensor dlogits = Tensor::Zeros({4, 5}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                                  .row_max = stat,
                                                                  .sum_exp = stat,
                                                                  .labels = labels,
                                                                  .dloss = dloss3,
                                                                  .dlogits = dlogits});
                }),
                AllOf(HasSubstr("CrossEntropyBackward"), HasSubstr("dloss must have N = 4 elements"),
                      HasSubstr("or 1 (broadcast)"), HasSubstr("Tensor[3] float32 cpu")));
    const Tensor dloss = Tensor::Zeros({4}, DType::kFloat32);
    Tensor wrong = Tensor::Zeros({20}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                                  .row_max = stat,
                                                                  .sum_exp = stat,
                                                                  .labels = labels,
                                                                  .dloss = dloss,
                                                                  .dlogits = wrong});
                }),
                AllOf(HasSubstr("CrossEntropyBackward"), HasSubstr("dlogits must have shape [4, 5]")));
    Tensor wrong_dtype = Tensor::Zeros({4, 5}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                                  .row_max = stat,
                                                                  .sum_exp = stat,
                                                                  .labels = labels,
                                                                  .dloss = dloss,
                                                                  .dlogits = wrong_dtype});
                }),
                AllOf(HasSubstr("CrossEntropyBackward"), HasSubstr("dlogits must have logits' dtype float32")));
}

} // namespace
} // namespace shardline::kernels
