// The cross-entropy stages on every device against a float64 log-softmax reference (on CUDA the warp-per-row and
// block-per-row kernels), the vocab-parallel split (stages per class shard, combined as the all-reduces would: max of
// the maxima, Σ sum_exp·exp(max_s - max), Σ target) against the unsplit loss and gradient, and each device's error
// messages.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
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
using ::testing::AllOf;
using ::testing::HasSubstr;

/// The statistics' dtype: float64 for float64 logits (CPU), else float32.
DType StatsDType(DType logits) { return logits == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

/// The budget of dlogits: the float32 statistics (exp, the row sum) then the rounding to the logits' dtype.
constexpr int kStatsRoundings = 2;

/// The three forward stages on the logits' device, no communication.
struct Forward {
    Tensor row_max, sum_exp, target, loss;
};
Forward RunForward(const Tensor &logits, const Tensor &labels, std::int64_t class_start = 0) {
    const std::int64_t n = labels.numel();
    const DType s = StatsDType(logits.dtype());
    const Device d = logits.device();
    Forward f{Tensor::Empty({n}, s, d), Tensor::Empty({n}, s, d), Tensor::Empty({n}, s, d), Tensor::Empty({n}, s, d)};
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

/// N: the product of the dims before the class dim.
std::int64_t LeadingRows(const Shape &logits_shape) {
    return Numel(Shape(logits_shape.begin(), logits_shape.end() - 1));
}

// One class; odd widths on CUDA's warp-per-row path (C <= 1024) and its block-per-row path (C > 1024, including a GPT-2
// vocabulary); leading dims; no rows; no classes; more rows than one grid pass covers.
const std::vector<Shape> kShapes = {{1, 1},    {5, 7},    {3, 4, 33}, {0, 5},     {6, 1000},
                                    {2, 0, 3}, {4, 1025}, {3, 50257}, {300000, 3}};

class CrossEntropyTest : public DeviceTest<> {
protected:
    Tensor RandomLogits(const Shape &shape, std::uint64_t seed) const {
        return Random(shape, dtype(), seed, "logits", 3.0);
    }
    Tensor RandomLabels(std::int64_t n, std::int64_t lo, std::int64_t hi, std::uint64_t seed) const {
        return RandomTensor({n}, DType::kInt64, device(), seed, "labels", RandomDistribution::kInteger,
                            static_cast<double>(lo), static_cast<double>(hi));
    }
    DType stats() const { return StatsDType(dtype()); }
};

TEST_P(CrossEntropyTest, StagesComputeTheLossOfLogSoftmax) {
    for (const Shape &shape : kShapes) {
        SCOPED_TRACE(ShapeToString(shape));
        const std::int64_t c = shape.back();
        const std::int64_t n = LeadingRows(shape);
        const Tensor logits = RandomLogits(shape, 60);
        const Tensor labels = RandomLabels(n, 0, std::max<std::int64_t>(c - 1, 0), 60);
        const Forward f = RunForward(logits, labels);
        const Values x = logits.ToDoubleVector();
        const Values lv = labels.ToDoubleVector();
        if (!x.empty()) {
            ASSERT_GT(AbsSum(x), 0.0);
        }
        EXPECT_TRUE(ValuesMatch(f.loss, RefCrossEntropyLoss(x, lv, n, c), stats()));
        // The row max is one of the logits, and the target logit is the label's: both exact.
        const Values row_max = f.row_max.ToDoubleVector();
        const Values target = f.target.ToDoubleVector();
        for (std::int64_t i = 0; i < n && c > 0; ++i) {
            ASSERT_EQ(row_max[i], *std::max_element(x.begin() + i * c, x.begin() + (i + 1) * c)) << "row " << i;
            ASSERT_EQ(target[i], x[i * c + static_cast<std::int64_t>(lv[i])]) << "row " << i;
        }
    }
}

TEST_P(CrossEntropyTest, BackwardIsSoftmaxMinusOneHotScaledByDloss) {
    for (const Shape &shape : kShapes) {
        for (const bool broadcast : {false, true}) {
            SCOPED_TRACE(::testing::Message() << ShapeToString(shape) << (broadcast ? ", scalar dloss" : ""));
            const std::int64_t c = shape.back();
            const std::int64_t n = LeadingRows(shape);
            const Tensor logits = RandomLogits(shape, 61);
            const Tensor labels = RandomLabels(n, 0, std::max<std::int64_t>(c - 1, 0), 61);
            const Forward f = RunForward(logits, labels);
            const Tensor dloss = Random({broadcast ? 1 : n}, stats(), 61, "dloss");
            Tensor dlogits = RandomLogits(shape, 99); // poison: every element is overwritten
            const double scale = broadcast ? 1.0 / std::max<std::int64_t>(n, 1) : 0.75;
            CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                          .row_max = f.row_max,
                                                          .sum_exp = f.sum_exp,
                                                          .labels = labels,
                                                          .dloss = dloss,
                                                          .scale = scale,
                                                          .dlogits = dlogits});
            const Values want = RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(),
                                                    dloss.ToDoubleVector(), scale, n, c);
            EXPECT_TRUE(ValuesMatch(dlogits, want, dtype(), kStatsRoundings));
        }
    }
}

TEST_P(CrossEntropyTest, BackwardMayOverwriteTheLogits) {
    for (const Shape &shape : {Shape{9, 17}, Shape{5, 3000}}) {
        SCOPED_TRACE(ShapeToString(shape));
        Tensor logits = RandomLogits(shape, 62);
        const Tensor labels = RandomLabels(shape[0], 0, shape[1] - 1, 62);
        const Forward f = RunForward(logits, labels);
        const Tensor dloss = Random({shape[0]}, stats(), 62, "dloss");
        const Values want = RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(),
                                                dloss.ToDoubleVector(), 1.0, shape[0], shape[1]);
        CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                      .row_max = f.row_max,
                                                      .sum_exp = f.sum_exp,
                                                      .labels = labels,
                                                      .dloss = dloss,
                                                      .dlogits = logits});
        EXPECT_TRUE(ValuesMatch(logits, want, dtype(), kStatsRoundings));
    }
}

/// Columns [start, start + width) of an [n, c] matrix, on its device.
Tensor Columns(const Tensor &m, std::int64_t start, std::int64_t width) {
    const std::int64_t n = m.size(0);
    const std::int64_t c = m.size(1);
    const Values all = m.ToDoubleVector();
    Values part;
    for (std::int64_t i = 0; i < n; ++i) {
        part.insert(part.end(), all.begin() + i * c + start, all.begin() + i * c + start + width);
    }
    return Tensor::FromVector(part, {n, width}, DType::kFloat64).To(m.dtype()).To(m.device());
}

struct SplitCase {
    std::int64_t n;
    std::int64_t classes;
    std::vector<std::int64_t> tps;
    std::uint64_t seed;
};

TEST_P(CrossEntropyTest, VocabParallelStagesCombineToTheUnsplitLossAndGradient) {
    const std::vector<SplitCase> cases = {
        // 12 shards of 37 classes: chunks of 4, then 1, then two empty.
        {.n = 12, .classes = 37, .tps = {2, 3, 4, 12}, .seed = 23},
        // Unsplit and 2 shards: CUDA's block per row; 3, 4 and 8 shards: a warp per row.
        {.n = 24, .classes = 3001, .tps = {2, 3, 4, 8}, .seed = 63},
    };
    for (const SplitCase &k : cases) {
        const std::int64_t n = k.n;
        const std::int64_t classes = k.classes;
        const Tensor logits = RandomLogits({n, classes}, k.seed);
        // Labels over the whole vocabulary, so every shard sees rows whose label lives elsewhere.
        const Tensor labels = RandomLabels(n, 0, classes - 1, k.seed);
        const Tensor dloss = Random({n}, stats(), k.seed, "dloss");
        const Forward unsplit = RunForward(logits, labels);
        Tensor unsplit_grad = Tensor::Empty({n, classes}, dtype(), device());
        CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                      .row_max = unsplit.row_max,
                                                      .sum_exp = unsplit.sum_exp,
                                                      .labels = labels,
                                                      .dloss = dloss,
                                                      .dlogits = unsplit_grad});
        const Values x = logits.ToDoubleVector();
        const Values ref_loss = RefCrossEntropyLoss(x, labels.ToDoubleVector(), n, classes);
        const Values ref_grad =
            RefCrossEntropyGrad(x, labels.ToDoubleVector(), dloss.ToDoubleVector(), 1.0, n, classes);
        EXPECT_TRUE(ValuesMatch(unsplit.loss, ref_loss, stats()));

        for (const std::int64_t tp : k.tps) {
            SCOPED_TRACE(::testing::Message() << classes << " classes, tp " << tp);
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
                Tensor m = Tensor::Empty({n}, stats(), device());
                CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = shard, .row_max = m});
                shard_max.push_back(m.ToDoubleVector());
                for (std::int64_t i = 0; i < n; ++i) {
                    row_max[i] = std::max(row_max[i], shard_max.back()[i]);
                }
            }
            EXPECT_EQ(row_max, unsplit.row_max.ToDoubleVector());
            // Stage 2 per shard with the global max, then the all-reduce(sum) of sum_exp and target_logit.
            const Tensor global_max = OnDevice(row_max, {n}, stats());
            Values sum_exp(n, 0.0);
            Values target(n, 0.0);
            Values rescaled(n, 0.0); // Σ_s sum_exp_s(own max)·exp(max_s - max): the other way to combine
            for (std::size_t s = 0; s < shards.size(); ++s) {
                Tensor se = Tensor::Empty({n}, stats(), device());
                Tensor t = Tensor::Empty({n}, stats(), device());
                CrossEntropyStats(CrossEntropyStatsArgs{.logits = shards[s],
                                                        .row_max = global_max,
                                                        .labels = labels,
                                                        .class_start = starts[s],
                                                        .sum_exp = se,
                                                        .target_logit = t});
                Tensor own_se = Tensor::Empty({n}, stats(), device());
                Tensor own_t = Tensor::Empty({n}, stats(), device());
                CrossEntropyStats(CrossEntropyStatsArgs{.logits = shards[s],
                                                        .row_max = OnDevice(shard_max[s], {n}, stats()),
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
            EXPECT_TRUE(ValuesMatch(sum_exp, unsplit.sum_exp.ToDoubleVector(), stats()));
            EXPECT_TRUE(ValuesMatch(rescaled, unsplit.sum_exp.ToDoubleVector(), stats(), 4.0));
            // Stage 3 on the reduced statistics: the same loss on every rank.
            Tensor loss = Tensor::Empty({n}, stats(), device());
            const Tensor se_t = OnDevice(sum_exp, {n}, stats());
            CrossEntropyLoss(CrossEntropyLossArgs{
                .row_max = global_max, .sum_exp = se_t, .target_logit = OnDevice(target, {n}, stats()), .loss = loss});
            EXPECT_TRUE(ValuesMatch(loss, ref_loss, stats()));
            EXPECT_TRUE(ValuesMatch(loss, unsplit.loss.ToDoubleVector(), stats()));
            // Backward per shard, no communication: the concatenated shards are the unsplit gradient.
            Values grad(static_cast<std::size_t>(n * classes));
            for (std::size_t s = 0; s < shards.size(); ++s) {
                const std::int64_t width = shards[s].size(1);
                Tensor dshard = Tensor::Empty({n, width}, dtype(), device());
                CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = shards[s],
                                                              .row_max = global_max,
                                                              .sum_exp = se_t,
                                                              .labels = labels,
                                                              .class_start = starts[s],
                                                              .dloss = dloss,
                                                              .dlogits = dshard});
                const Values dv = dshard.ToDoubleVector();
                for (std::int64_t i = 0; i < n; ++i) {
                    std::copy(dv.begin() + i * width, dv.begin() + (i + 1) * width,
                              grad.begin() + i * classes + starts[s]);
                }
            }
            EXPECT_TRUE(ValuesMatch(grad, ref_grad, dtype(), kStatsRoundings));
            EXPECT_TRUE(ValuesMatch(grad, unsplit_grad.ToDoubleVector(), dtype(), kStatsRoundings));
        }
    }
}

TEST_P(CrossEntropyTest, ShardWithoutClassesGivesTheIdentitiesOfMaxAndSum) {
    const Tensor logits = Tensor::Empty({4, 0}, dtype(), device());
    const Tensor labels = RandomLabels(4, 0, 9, 64);
    Tensor row_max = Tensor::Zeros({4}, stats(), device());
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max});
    EXPECT_EQ(row_max.ToDoubleVector(), Values(4, -std::numeric_limits<double>::infinity()));
    Tensor sum_exp = Tensor::Full({4}, 7.0, stats(), device());
    Tensor target = Tensor::Full({4}, 7.0, stats(), device());
    const Tensor global_max = Random({4}, stats(), 64, "max");
    CrossEntropyStats(CrossEntropyStatsArgs{
        .logits = logits, .row_max = global_max, .labels = labels, .sum_exp = sum_exp, .target_logit = target});
    EXPECT_EQ(sum_exp.ToDoubleVector(), Values(4, 0.0));
    EXPECT_EQ(target.ToDoubleVector(), Values(4, 0.0));
}

TEST_P(CrossEntropyTest, LabelsOutsideTheShardGiveNoTargetAndNoOneHot) {
    const Tensor logits = RandomLogits({3, 5}, 25);
    // This shard holds classes [10, 15): labels 9 and 15 are another shard's, 12 is column 2.
    const Tensor labels = Tensor::FromVector({9, 12, 15}, {3}, DType::kInt64).To(device());
    const Forward f = RunForward(logits, labels, 10);
    const Values x = logits.ToDoubleVector();
    EXPECT_EQ(f.target.ToDoubleVector(), (Values{0.0, x[5 + 2], 0.0}));
    const Tensor dloss = Tensor::Full({1}, 1.0, stats(), device());
    Tensor dlogits = Tensor::Empty({3, 5}, dtype(), device());
    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                  .row_max = f.row_max,
                                                  .sum_exp = f.sum_exp,
                                                  .labels = labels,
                                                  .class_start = 10,
                                                  .dloss = dloss,
                                                  .dlogits = dlogits});
    const Values local_labels = {-1, 2, -1}; // RefGrad puts no one-hot at -1
    EXPECT_TRUE(ValuesMatch(dlogits, RefCrossEntropyGrad(x, local_labels, {1.0}, 1.0, 3, 5), dtype(), kStatsRoundings));
}

TEST_P(CrossEntropyTest, NanLogitMakesItsRowNan) {
    Values v = RandomLogits({2, 2000}, 65).ToDoubleVector();
    v[2000 + 1234] = std::nan(""); // row 1
    const Tensor logits = OnDevice(v, {2, 2000}, dtype());
    Tensor row_max = Tensor::Empty({2}, stats(), device());
    CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = row_max});
    const Values m = row_max.ToDoubleVector();
    EXPECT_FALSE(std::isnan(m[0]));
    EXPECT_TRUE(std::isnan(m[1])) << "fmax would have dropped the NaN";
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(CrossEntropyTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Each device's dtypes and errors

TEST(CrossEntropyTest, Float64DlossIsAcceptedForFloat32LogitsOnTheCpu) {
    const Tensor logits =
        RandomTensor({4, 6}, DType::kFloat32, Device::CPU(), 26, "logits", RandomDistribution::kNormal, 0.0, 3.0);
    const Tensor labels =
        RandomTensor({4}, DType::kInt64, Device::CPU(), 26, "labels", RandomDistribution::kInteger, 0.0, 5.0);
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
        dlogits,
        RefCrossEntropyGrad(logits.ToDoubleVector(), labels.ToDoubleVector(), dloss.ToDoubleVector(), 1.0, 4, 6),
        DType::kFloat32, kStatsRoundings));
}

TEST_F(CudaTest, CrossEntropyStatisticsAndDlossAreFloat32OnCuda) {
    const Tensor logits = Tensor::Zeros({4, 5}, DType::kBFloat16, Gpu());
    const Tensor labels = Tensor::Zeros({4}, DType::kInt64, Gpu());
    const Tensor stat = Tensor::Zeros({4}, DType::kFloat32, Gpu());
    const Tensor dloss64 = Tensor::Zeros({4}, DType::kFloat64, Gpu());
    Tensor dlogits = Tensor::Zeros({4, 5}, DType::kBFloat16, Gpu());
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    CrossEntropyBackward(CrossEntropyBackwardArgs{.logits = logits,
                                                                  .row_max = stat,
                                                                  .sum_exp = stat,
                                                                  .labels = labels,
                                                                  .dloss = dloss64,
                                                                  .dlogits = dlogits});
                }),
                HasSubstr("dloss must be float32 on CUDA"))
        << "a float64 dloss on CUDA";
    Tensor half_max = Tensor::Zeros({4}, DType::kBFloat16, Gpu());
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { CrossEntropyRowMax(CrossEntropyRowMaxArgs{.logits = logits, .row_max = half_max}); }),
                HasSubstr("row_max must be float32"))
        << "bfloat16 statistics";
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
} // namespace shardline::testing
