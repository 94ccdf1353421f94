// EmbeddingForward / EmbeddingBackward on every device against float64 references: the lookup bit for bit (on CUDA
// every copy width), the backward with repeats, accumulation (also into a float32 main grad) and determinism, the
// vocab-parallel split (shards of the table, combined by the sum an all-reduce would compute) against the unsplit
// table, and the error messages.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/embedding.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::EmbeddingBackward;
using kernels::EmbeddingBackwardArgs;
using kernels::EmbeddingForward;
using kernels::EmbeddingForwardArgs;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// out[i, :] = table[ids[i] - start, :] for ids in [start, start + rows), else zeros.
Values RefForward(const Values &ids, const Values &table, std::int64_t rows, std::int64_t hidden, std::int64_t start) {
    Values out(ids.size() * static_cast<std::size_t>(hidden), 0.0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto id = static_cast<std::int64_t>(ids[i]);
        if (id < start || id >= start + rows) {
            continue;
        }
        for (std::int64_t h = 0; h < hidden; ++h) {
            out[i * hidden + h] = table[(id - start) * hidden + h];
        }
    }
    return out;
}

/// dweight[v, :] = Σ_{i : ids[i] - start == v} dout[i, :].
Values RefBackward(const Values &ids, const Values &dout, std::int64_t rows, std::int64_t hidden, std::int64_t start) {
    Values dw(static_cast<std::size_t>(rows * hidden), 0.0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto id = static_cast<std::int64_t>(ids[i]);
        if (id < start || id >= start + rows) {
            continue;
        }
        for (std::int64_t h = 0; h < hidden; ++h) {
            dw[(id - start) * hidden + h] += dout[i * hidden + h];
        }
    }
    return dw;
}

Shape WithHidden(Shape shape, std::int64_t hidden) {
    shape.push_back(hidden);
    return shape;
}

/// torch.chunk sizes: the first shards take ceil(v / p), the last may be short or empty.
std::vector<std::int64_t> ChunkSizes(std::int64_t v, std::int64_t p) {
    const std::int64_t chunk = (v + p - 1) / p;
    std::vector<std::int64_t> sizes;
    for (std::int64_t s = 0; s < p; ++s) {
        sizes.push_back(std::max<std::int64_t>(0, std::min(chunk, v - s * chunk)));
    }
    return sizes;
}

/// Rows [start, start + rows) of a [V, H] table as their own tensor, on the table's device.
Tensor RowSlice(const Tensor &table, std::int64_t start, std::int64_t rows) {
    const std::int64_t hidden = table.size(1);
    const Values all = table.ToDoubleVector();
    const Values part(all.begin() + start * hidden, all.begin() + (start + rows) * hidden);
    return Tensor::FromVector(part, {rows, hidden}, DType::kFloat64).To(table.dtype()).To(table.device());
}

struct Case {
    Shape ids_shape;
    std::int64_t vocab;
    std::int64_t hidden;
};
// Empty ids, one id, odd sizes, leading dims, more ids than rows (repeats), a one-row table; on CUDA row sizes of 1, 2,
// 4, 8 and 16+ bytes' multiples in every dtype (the copy picks its word from them) and a large batch that spans many
// blocks and sort passes.
const std::vector<Case> kCases = {{{0}, 5, 3},  {{1}, 4, 8},   {{7}, 11, 13}, {{3, 5}, 6, 4},  {{2, 3, 4}, 9, 1},
                                  {{40}, 3, 5}, {{200}, 3, 5}, {{6}, 1, 7},   {{64}, 1000, 2}, {{4, 1025}, 50257, 64}};

class EmbeddingTest : public DeviceTest<> {
protected:
    /// Global ids in [lo, hi] on the case's device, some outside any shard when lo < 0 or hi >= V.
    Tensor RandomIds(const Shape &shape, std::int64_t lo, std::int64_t hi, std::uint64_t seed) const {
        return RandomTensor(shape, DType::kInt64, device(), seed, "ids", RandomDistribution::kInteger,
                            static_cast<double>(lo), static_cast<double>(hi));
    }
};

TEST_P(EmbeddingTest, ForwardCopiesTheRowOfEachIdAndZeroesIdsOutsideTheTable) {
    for (const Case &c : kCases) {
        SCOPED_TRACE(::testing::Message()
                     << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H " << c.hidden);
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 50);
        const Tensor weight = Random({c.vocab, c.hidden}, dtype(), 50, "weight");
        ASSERT_GT(AbsSum(weight.ToDoubleVector()), 0.0);
        Tensor out = Poison(WithHidden(c.ids_shape, c.hidden), dtype());
        EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out});
        const Values want = RefForward(ids.ToDoubleVector(), weight.ToDoubleVector(), c.vocab, c.hidden, 0);
        EXPECT_EQ(out.ToDoubleVector(), want) << "a lookup is a copy: bit-exact";
        const Tensor alloc = EmbeddingForward(ids, weight);
        EXPECT_EQ(alloc.shape(), WithHidden(c.ids_shape, c.hidden));
        EXPECT_EQ(alloc.dtype(), dtype());
        EXPECT_EQ(alloc.ToDoubleVector(), want) << "allocating wrapper";
    }
}

TEST_P(EmbeddingTest, ForwardIntoAMisalignedOutput) {
    // An output that does not start on a 16-byte boundary (on CUDA: a narrower copy word).
    const Tensor ids = RandomIds({37}, 0, 20, 51);
    const Tensor weight = Random({20, 24}, dtype(), 51, "weight");
    MisalignedTensor out = MisalignedCopy(Random({37, 24}, dtype(), 99, "poison"));
    EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out.view});
    EXPECT_EQ(out.view.ToDoubleVector(), RefForward(ids.ToDoubleVector(), weight.ToDoubleVector(), 20, 24, 0))
        << "misaligned output";
}

TEST_P(EmbeddingTest, ForwardOfVocabShardsSumsToTheUnsplitLookup) {
    const std::int64_t vocab = 11;
    for (const std::int64_t hidden : {6, 12}) {
        const Tensor ids = RandomIds({4, 9}, -3, vocab + 3, 52); // ids beyond the vocabulary hit no shard
        const Tensor table = Random({vocab, hidden}, dtype(), 52, "table");
        const Values unsplit = EmbeddingForward(ids, table).ToDoubleVector();
        for (std::int64_t tp : {1, 2, 3, 4, 12}) { // 12 shards of 11 rows: the last one is empty
            SCOPED_TRACE(::testing::Message() << "H " << hidden << ", tp " << tp);
            Values sum(unsplit.size(), 0.0);
            std::int64_t start = 0;
            for (std::int64_t rows : ChunkSizes(vocab, tp)) {
                const Tensor shard = RowSlice(table, start, rows);
                const Values part = EmbeddingForward(ids, shard, start).ToDoubleVector();
                for (std::size_t i = 0; i < sum.size(); ++i) {
                    sum[i] += part[i]; // the all-reduce: exactly one shard contributes a non-zero row
                }
                start += rows;
            }
            EXPECT_EQ(sum, unsplit);
        }
    }
}

TEST_P(EmbeddingTest, BackwardSumsTheGradientsOfRepeatedIds) {
    for (const Case &c : kCases) {
        for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H "
                                              << c.hidden << (accumulate ? ", accumulate" : ""));
            const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 53);
            const Tensor dout = Random(WithHidden(c.ids_shape, c.hidden), dtype(), 53, "dout");
            // Poison (=) or a previous gradient (+=): rows no id hits must come out zero, or unchanged.
            Tensor dweight = Random({c.vocab, c.hidden}, dtype(), 53, "dweight");
            const Values before = dweight.ToDoubleVector();
            EmbeddingBackward(
                EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = accumulate});
            Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), c.vocab, c.hidden, 0);
            if (accumulate) {
                want = AddScaled(want, before);
            }
            if (dout.numel() > 0) {
                ASSERT_GT(AbsSum(dout.ToDoubleVector()), 0.0);
            }
            // Sums of exact inputs (fp32 on CUDA), one rounding to the output dtype.
            EXPECT_TRUE(ValuesMatch(dweight, want, dtype()));
        }
    }
}

TEST_P(EmbeddingTest, BackwardOfIntegerGradientsIsExactAndDeterministic) {
    // |dout| <= 8 and about 10 repeats per row (a few more at most): every partial sum is an integer of magnitude
    // below 256, exact in every dtype, so any summation order gives the reference exactly.
    const std::int64_t vocab = 300;
    const std::int64_t hidden = 40;
    const Tensor ids = RandomIds({3000}, -5, vocab + 5, 54);
    const Tensor dout =
        RandomTensor({3000, hidden}, dtype(), device(), 54, "dout", RandomDistribution::kInteger, -8, 8);
    Tensor first = Tensor::Empty({vocab, hidden}, dtype(), device());
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = first});
    const Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), vocab, hidden, 0);
    ASSERT_GT(AbsSum(want), 0.0);
    EXPECT_EQ(first.ToDoubleVector(), want);
    Tensor second = Random({vocab, hidden}, dtype(), 99, "poison");
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = second});
    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ: the backward must be deterministic";
}

TEST_P(EmbeddingTest, BackwardOfFewFrequentIdsSumsLongRunsExactlyAndDeterministically) {
    // The README model's distribution: a few ids take most positions (half of them one id, a quarter another), the
    // rest spread over 64 rows, some outside the table. Long runs are split over warps and blocks; integer gradients
    // (|dout| <= 8, runs of at most 20000: partial sums below 2^24) keep every fp32 sum exact in any order, so the
    // result is the reference with one rounding to the dtype. hidden 300 leaves a partial column tile.
    const std::int64_t vocab = 70;
    const std::int64_t hidden = 300;
    const std::int64_t n = 20000;
    Values id_values(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t r = (i * 7919) % 100; // a fixed scatter of the positions over the buckets
        id_values[static_cast<std::size_t>(i)] = r < 50   ? 3.0
                                                 : r < 75 ? 41.0
                                                 : r < 97 ? static_cast<double>(i % 64)
                                                 : r < 99 ? -1.0
                                                          : static_cast<double>(vocab);
    }
    const Tensor ids = Tensor::FromVector(id_values, {n}, DType::kInt64).To(device());
    const Tensor int_dout =
        RandomTensor({n, hidden}, dtype(), device(), 55, "dout", RandomDistribution::kInteger, -8, 8);
    Tensor dweight = Random({vocab, hidden}, dtype(), 55, "poison");
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = int_dout, .dweight = dweight});
    const Values want = RefBackward(id_values, int_dout.ToDoubleVector(), vocab, hidden, 0);
    ASSERT_GT(AbsSum(want), 0.0);
    EXPECT_TRUE(ValuesMatch(dweight, want, dtype()));

    // Real-valued gradients: the summation order matters, and it must be the same on every run.
    const Tensor dout = Random({n, hidden}, dtype(), 56, "dout");
    Tensor first = Random({vocab, hidden}, dtype(), 57, "poison");
    Tensor second = Random({vocab, hidden}, dtype(), 58, "poison");
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = first});
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = second});
    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ: the backward must be deterministic";
    // And close to the float64 sum. On CUDA each warp adds ~2500 normal terms in fp32: rounding errors of partial sums
    // of magnitude ~50 random-walk to ~1e-4 absolute, which is also the error where the sum itself is near zero, so
    // the bound is on |error| / (1 + |sum|): 1e-3 for fp32 (10x that estimate), 1e-2 for one rounding to a half type.
    const Values want_real = RefBackward(id_values, dout.ToDoubleVector(), vocab, hidden, 0);
    const Values got = first.ToDoubleVector();
    double worst = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, std::abs(got[i] - want_real[i]) / (1.0 + std::abs(want_real[i])));
    }
    EXPECT_LT(worst, dtype() == DType::kFloat32 || dtype() == DType::kFloat64 ? 1e-3 : 1e-2) << "worst error " << worst;
}

struct SplitCase {
    Shape ids_shape;
    std::int64_t vocab;
    std::int64_t hidden;
    std::vector<std::int64_t> tps;
};

TEST_P(EmbeddingTest, BackwardOfVocabShardsConcatenatesToTheUnsplitGradient) {
    const std::vector<SplitCase> cases = {{{50}, 13, 5, {2, 3, 5}}, {{2, 700}, 1001, 24, {2, 3, 8}}};
    for (const SplitCase &c : cases) {
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 2, 55);
        const Tensor dout = Random(WithHidden(c.ids_shape, c.hidden), dtype(), 55, "dout");
        Tensor full = Tensor::Empty({c.vocab, c.hidden}, dtype(), device());
        EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = full});
        const Values unsplit = full.ToDoubleVector();
        EXPECT_TRUE(ValuesMatch(unsplit, RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), c.vocab, c.hidden, 0),
                                dtype()));
        for (std::int64_t tp : c.tps) {
            SCOPED_TRACE(::testing::Message() << "V " << c.vocab << ", tp " << tp);
            Values concatenated;
            std::int64_t start = 0;
            for (std::int64_t rows : ChunkSizes(c.vocab, tp)) {
                Tensor shard = Tensor::Empty({rows, c.hidden}, dtype(), device());
                EmbeddingBackward(
                    EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = shard, .vocab_start = start});
                const Values part = shard.ToDoubleVector();
                concatenated.insert(concatenated.end(), part.begin(), part.end());
                start += rows;
            }
            // Each row sums the same terms in the same (position) order on every split: bit-exact.
            EXPECT_EQ(concatenated, unsplit);
        }
    }
}

TEST_P(EmbeddingTest, BackwardAccumulatesIntoAFloat32MainGrad) {
    const std::vector<Case> cases = {{{30}, 7, 7}, {{500}, 64, 33}};
    for (const Case &c : cases) {
        SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab);
        const Tensor ids = RandomIds(c.ids_shape, 0, c.vocab - 1, 56);
        const Tensor dout = Random(WithHidden(c.ids_shape, c.hidden), dtype(), 56, "dout");
        Tensor main_grad = Random({c.vocab, c.hidden}, DType::kFloat32, 56, "main_grad");
        const Values want = AddScaled(main_grad.ToDoubleVector(),
                                      RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), c.vocab, c.hidden, 0));
        EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
        EXPECT_TRUE(ValuesMatch(main_grad, want, DType::kFloat32));
    }
}

TEST_P(EmbeddingTest, BackwardWithNoIdsZeroesOrKeepsTheGradient) {
    const Tensor ids = Tensor::Empty({0}, DType::kInt64, device());
    const Tensor dout = Tensor::Empty({0, 4}, dtype(), device());
    Tensor dweight = Random({3, 4}, dtype(), 57, "dweight");
    const Values before = dweight.ToDoubleVector();
    ASSERT_GT(AbsSum(before), 0.0);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = true});
    EXPECT_EQ(dweight.ToDoubleVector(), before);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
    EXPECT_EQ(dweight.ToDoubleVector(), Values(12, 0.0));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(EmbeddingTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Errors (the CPU's messages)

TEST(EmbeddingErrorsTest, IdsMustBeInt64) {
    const Tensor ids = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { EmbeddingForward(ids, weight); }),
        AllOf(HasSubstr("EmbeddingForward"), HasSubstr("ids must be int64"), HasSubstr("Tensor[4] float32 cpu")));
    const Tensor dout = Tensor::Zeros({4, 3}, DType::kFloat32);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight}); }),
                AllOf(HasSubstr("EmbeddingBackward"), HasSubstr("ids must be int64")));
}

TEST(EmbeddingErrorsTest, TableMustBeAFloatMatrix) {
    const Tensor ids = Tensor::Zeros({4}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>([&] { EmbeddingForward(ids, Tensor::Zeros({5, 3}, DType::kInt64)); }),
                AllOf(HasSubstr("EmbeddingForward"), HasSubstr("CPU kernels take float32 or float64"),
                      HasSubstr("weight Tensor[5, 3] int64 cpu")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { EmbeddingForward(ids, Tensor::Zeros({15}, DType::kFloat32)); }),
                AllOf(HasSubstr("EmbeddingForward"), HasSubstr("weight must be [V_local, H]"),
                      HasSubstr("Tensor[15] float32 cpu")));
}

TEST(EmbeddingErrorsTest, OutputAndGradientShapesAreNamed) {
    const Tensor ids = Tensor::Zeros({2, 4}, DType::kInt64);
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    Tensor out = Tensor::Empty({8, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out}); }),
                AllOf(HasSubstr("EmbeddingForward"), HasSubstr("out must have shape [2, 4, 3]"),
                      HasSubstr("Tensor[8, 3] float32 cpu")));
    const Tensor dout = Tensor::Zeros({2, 4, 2}, DType::kFloat32);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight}); }),
                AllOf(HasSubstr("EmbeddingBackward"), HasSubstr("dout must have shape [2, 4, 3]"),
                      HasSubstr("Tensor[2, 4, 2] float32 cpu")));
}

TEST(EmbeddingErrorsTest, GradientDTypeAndVocabStartAreChecked) {
    const Tensor ids = Tensor::Zeros({4}, DType::kInt64);
    const Tensor dout = Tensor::Zeros({4, 3}, DType::kFloat64);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight}); }),
                AllOf(HasSubstr("EmbeddingBackward"), HasSubstr("dweight must have dout's dtype float64"),
                      HasSubstr("or be a float32 main grad"), HasSubstr("Tensor[5, 3] int64 cpu")));
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<Error>([&] { EmbeddingForward(ids, weight, -5); }),
                AllOf(HasSubstr("EmbeddingForward"), HasSubstr("vocab_start must be >= 0"), HasSubstr("got -5")));
}

TEST(EmbeddingErrorsTest, IdsOnAnotherDeviceAreADeviceError) {
    std::vector<std::int64_t> host(4, 0);
    const Tensor ids = Tensor::FromBlob(host.data(), {4}, DType::kInt64, Device::CUDA(0));
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DeviceError>([&] { EmbeddingForward(ids, weight); }),
                AllOf(HasSubstr("EmbeddingForward"), HasSubstr("must be on one device"),
                      HasSubstr("Tensor[4] int64 cuda:0"), HasSubstr("Tensor[5, 3] float32 cpu")));
}

} // namespace
} // namespace shardline::testing
