// EmbeddingBagForward / EmbeddingBagBackward (the fused gather-sum over ids' dim 0) on every device against float64
// references, for the id distributions the char-LM and a vocab-parallel model give: few distinct ids in long runs, many
// distinct ids over a 50k vocabulary, a vocab-parallel slice with ids partly outside it, empty bags and empty batches;
// integer-valued data (exact in any summation order) bit for bit, real data within an accumulation bound; accumulation
// into the gradient and into a float32 main grad; bitwise identical results from run to run; the error messages. On
// CUDA each case runs the implementation the default choice picks for its shape (several take the count-GEMM); the
// count-GEMM and the gather forced one by one are tests/cuda/kernels_embedding_bag_count_gemm_test.cc.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/embedding.h>

#include "embedding_bag_reference.h"
#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::EmbeddingBagBackward;
using kernels::EmbeddingBagBackwardArgs;
using kernels::EmbeddingBagForward;
using kernels::EmbeddingBagForwardArgs;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// Rows [start, start + rows) of a [V, H] table as their own tensor, on the table's device.
Tensor RowSlice(const Tensor &table, std::int64_t start, std::int64_t rows) {
    const std::int64_t hidden = table.size(1);
    const Values all = table.ToDoubleVector();
    const Values part(all.begin() + start * hidden, all.begin() + (start + rows) * hidden);
    return Tensor::FromVector(part, {rows, hidden}, DType::kFloat64).To(table.dtype()).To(table.device());
}

struct Case {
    Shape ids_shape; ///< [T, ...]
    std::int64_t vocab;
    std::int64_t hidden;
};
// Odd widths (CUDA's element-wise path), multiples of 8 (16-byte vectors in every dtype), one bag, rank-1 ids (out
// [H]), trailing dims, a one-row table, many distinct ids over a 50k vocabulary, the char-LM's context of 32; the empty
// cases: no bags (T = 0: zeros) and no rows (N = 0).
const std::vector<Case> kCases = {{{3, 5}, 11, 13},      {{4, 2, 3}, 9, 8}, {{1, 7}, 5, 16},
                                  {{5}, 6, 4},           {{6, 10}, 1, 3},   {{32, 64}, 200, 24},
                                  {{8, 300}, 50257, 64}, {{0, 4}, 5, 8},    {{5, 0}, 5, 8}};

class EmbeddingBagTest : public DeviceTest<> {
protected:
    Tensor RandomIds(const Shape &shape, std::int64_t lo, std::int64_t hi, std::uint64_t seed) const {
        return RandomTensor(shape, DType::kInt64, device(), seed, "ids", RandomDistribution::kInteger,
                            static_cast<double>(lo), static_cast<double>(hi));
    }
    Tensor IntegerValues(const Shape &shape, std::uint64_t seed, std::string_view name) const {
        return RandomTensor(shape, dtype(), device(), seed, name, RandomDistribution::kInteger, -8, 8);
    }
    /// The error budget of the implementation the device runs by default: on CUDA the choice's (gather or count-GEMM,
    /// kernels::ChooseEmbeddingBagImpl), so the count-GEMM's (tensor-core sums; a half epilogue that adds beta·C may
    /// round in the output precision); on the CPU one rounding of an fp64 sum.
    BagBudget Budget(bool accumulate = false) const {
        if (device().is_cpu()) {
            return {};
        }
        return {.output_roundings = accumulate ? kEpilogueRoundings : 1.0, .sum_roundings = 2};
    }
};

TEST_P(EmbeddingBagTest, ForwardOfIntegerTablesIsExact) {
    // |table| <= 8 and T <= 32: every partial sum is an integer below 256, exact in every dtype and any order.
    for (const Case &c : kCases) {
        SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab);
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 60); // some ids outside the table
        const Tensor weight = IntegerValues({c.vocab, c.hidden}, 60, "weight");
        Tensor out = Poison(BagOutShape(c.ids_shape, c.hidden), dtype());
        EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = out});
        const BagReference want =
            RefBagForward(ids.ToDoubleVector(), c.ids_shape, weight.ToDoubleVector(), c.vocab, c.hidden, 0);
        if (out.numel() > 0 && c.ids_shape[0] > 0) {
            ASSERT_GT(AbsSum(want.value), 0.0);
        }
        EXPECT_EQ(out.ToDoubleVector(), want.value);
        const Tensor alloc = EmbeddingBagForward(ids, weight);
        EXPECT_EQ(alloc.shape(), BagOutShape(c.ids_shape, c.hidden));
        EXPECT_EQ(alloc.dtype(), dtype());
        EXPECT_EQ(alloc.ToDoubleVector(), want.value) << "allocating wrapper";
    }
}

TEST_P(EmbeddingBagTest, ForwardOfRealTablesMatchesFloat64AndRepeatsBitwise) {
    for (const Case &c : kCases) {
        SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab);
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 61);
        const Tensor weight = Random({c.vocab, c.hidden}, dtype(), 61, "weight");
        Tensor first = Poison(BagOutShape(c.ids_shape, c.hidden), dtype(), "poison1");
        Tensor second = Poison(BagOutShape(c.ids_shape, c.hidden), dtype(), "poison2");
        EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = first});
        EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = second});
        const BagReference want =
            RefBagForward(ids.ToDoubleVector(), c.ids_shape, weight.ToDoubleVector(), c.vocab, c.hidden, 0);
        EXPECT_TRUE(WithinBound(first.ToDoubleVector(), want, dtype(), device(), Budget()));
        EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ";
    }
}

TEST_P(EmbeddingBagTest, ForwardIntoAMisalignedOutput) {
    // An output not on a 16-byte boundary: CUDA takes the element-wise path.
    const Tensor ids = RandomIds({5, 37}, 0, 19, 62);
    const Tensor weight = IntegerValues({20, 24}, 62, "weight");
    MisalignedTensor out = MisalignedCopy(Random({37, 24}, dtype(), 99, "poison"));
    EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = out.view});
    EXPECT_EQ(out.view.ToDoubleVector(),
              RefBagForward(ids.ToDoubleVector(), ids.shape(), weight.ToDoubleVector(), 20, 24, 0).value);
}

TEST_P(EmbeddingBagTest, ForwardOfVocabShardsSumsToTheUnsplitBagSum) {
    // A vocab-parallel table (torch.chunk shards, the last one empty at tp 12): each shard sums the ids it holds, the
    // all-reduce adds the shards. Integer values: exact.
    const std::int64_t vocab = 11;
    const Tensor ids = RandomIds({6, 9}, -3, vocab + 3, 63);
    const Tensor table = IntegerValues({vocab, 16}, 63, "table");
    const Values unsplit = EmbeddingBagForward(ids, table).ToDoubleVector();
    ASSERT_GT(AbsSum(unsplit), 0.0);
    for (std::int64_t tp : {2, 3, 4, 12}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        Values sum(unsplit.size(), 0.0);
        const std::int64_t chunk = (vocab + tp - 1) / tp;
        for (std::int64_t start = 0; start < chunk * tp; start += chunk) {
            const std::int64_t rows = std::max<std::int64_t>(0, std::min(chunk, vocab - start));
            const Values part =
                EmbeddingBagForward(ids, RowSlice(table, std::min(start, vocab), rows), start).ToDoubleVector();
            for (std::size_t i = 0; i < sum.size(); ++i) {
                sum[i] += part[i];
            }
        }
        EXPECT_EQ(sum, unsplit);
    }
}

TEST_P(EmbeddingBagTest, BackwardMatchesFloat64ForEveryCaseWithAndWithoutAccumulate) {
    for (const Case &c : kCases) {
        for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab
                                              << (accumulate ? ", accumulate" : ""));
            const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 64);
            const Tensor dout = Random(BagOutShape(c.ids_shape, c.hidden), dtype(), 64, "dout");
            Tensor dweight = Random({c.vocab, c.hidden}, dtype(), 64, "dweight"); // poison (=) or a previous grad (+=)
            const Values before = dweight.ToDoubleVector();
            EmbeddingBagBackward(
                EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = accumulate});
            BagReference want =
                RefBagBackward(ids.ToDoubleVector(), c.ids_shape, dout.ToDoubleVector(), c.vocab, c.hidden, 0);
            if (accumulate) {
                for (std::size_t i = 0; i < before.size(); ++i) {
                    want.value[i] += before[i];
                    want.terms[i] += 1.0;
                    want.abs_sum[i] += std::abs(before[i]);
                }
            }
            if (ids.numel() > 0) {
                ASSERT_GT(AbsSum(want.value), 0.0);
            }
            EXPECT_TRUE(WithinBound(dweight.ToDoubleVector(), want, dtype(), device(), Budget(accumulate)));
        }
    }
}

TEST_P(EmbeddingBagTest, BackwardOfFewDistinctIdsInLongRunsIsExactAndDeterministic) {
    // 4 distinct ids over 32 x 8192 positions (the README model's batch; runs of up to ~131072, split over warps and
    // blocks; every dout row in each run many times). hidden 136 leaves a partial column tile. Integer gradients
    // (|dout| <= 8): every partial sum is an integer below 2^20, exact in fp32 in any order, so the result is the
    // float64 sum rounded once into the dtype (sums stay below fp16's 65504).
    const std::int64_t bag = 32;
    const std::int64_t count = 8192;
    const std::int64_t vocab = 7;
    const std::int64_t hidden = 136;
    const Values id_values = FewDistinctIds(bag, count, 2);
    const Tensor ids = Tensor::FromVector(id_values, {bag, count}, DType::kInt64).To(device());
    {
        const Tensor dout = IntegerValues({count, hidden}, 65, "dout");
        Tensor dweight = Poison({vocab, hidden}, dtype());
        EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
        const BagReference want = RefBagBackward(id_values, ids.shape(), dout.ToDoubleVector(), vocab, hidden, 0);
        ASSERT_GT(AbsSum(want.value), 0.0);
        EXPECT_TRUE(ValuesMatch(dweight, want.value, dtype())) << "integer gradients";
    }
    // Real gradients: the order of the sums matters, and it must be the same on every run.
    const Tensor dout = Random({count, hidden}, dtype(), 66, "dout");
    Tensor first = Poison({vocab, hidden}, dtype(), "poison1");
    Tensor second = Poison({vocab, hidden}, dtype(), "poison2");
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = first});
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = second});
    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ: the backward must be deterministic";
    const BagReference want = RefBagBackward(id_values, ids.shape(), dout.ToDoubleVector(), vocab, hidden, 0);
    EXPECT_TRUE(WithinBound(first.ToDoubleVector(), want, dtype(), device(), Budget()));
    const Values got = first.ToDoubleVector();
    for (std::int64_t h = 0; h < hidden; ++h) { // rows 0, 1 and 6 get no id: zeros, not poison
        EXPECT_EQ(got[static_cast<std::size_t>(h)], 0.0);
        EXPECT_EQ(got[static_cast<std::size_t>(6 * hidden + h)], 0.0);
    }
}

TEST_P(EmbeddingBagTest, BackwardIsEmbeddingBackwardOfTheBroadcastGradientBitForBit) {
    // The composition the bag replaces: Sum's backward broadcasts dout [N, H] to [T, N, H], EmbeddingBackward sums it.
    // The bag backward runs the same kernels with position t·N + n reading dout row n: the same terms in the same
    // order, so the same bits, on both devices (CUDA: the gather path's promise; the count-GEMM's order is its own).
    const ScopedEmbeddingBagImpl gather(kernels::EmbeddingBagImpl::kGather);
    const std::int64_t bag = 32;
    const std::int64_t count = 300;
    const std::int64_t hidden = 136;
    const Values id_values = FewDistinctIds(bag, count, 1);
    const Tensor ids = Tensor::FromVector(id_values, {bag, count}, DType::kInt64).To(device());
    const Tensor dout = Random({count, hidden}, dtype(), 71, "dout");
    const Values d = dout.ToDoubleVector();
    Values broadcast;
    for (std::int64_t t = 0; t < bag; ++t) {
        broadcast.insert(broadcast.end(), d.begin(), d.end());
    }
    const Tensor dout_full = OnDevice(broadcast, {bag, count, hidden}, dtype());
    Tensor composed = Poison({6, hidden}, dtype(), "poison1");
    Tensor fused = Poison({6, hidden}, dtype(), "poison2");
    kernels::EmbeddingBackward({.ids = ids, .dout = dout_full, .dweight = composed});
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = fused});
    ASSERT_GT(AbsSum(composed.ToDoubleVector()), 0.0);
    EXPECT_EQ(HostBytes(fused), HostBytes(composed));
}

TEST_P(EmbeddingBagTest, BackwardOfManyDistinctIdsIsExactOnIntegersAndDeterministic) {
    // Uniform over a 50k vocabulary: mostly runs of one or two positions.
    const std::int64_t vocab = 50257;
    const Tensor ids = RandomIds({16, 1024}, 0, vocab - 1, 67);
    {
        const Tensor dout = IntegerValues({1024, 40}, 67, "dout");
        Tensor dweight = Poison({vocab, 40}, dtype());
        EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
        EXPECT_EQ(dweight.ToDoubleVector(),
                  RefBagBackward(ids.ToDoubleVector(), ids.shape(), dout.ToDoubleVector(), vocab, 40, 0).value);
    }
    const Tensor dout = Random({1024, 40}, dtype(), 67, "dout");
    Tensor first = Tensor::Empty({vocab, 40}, dtype(), device());
    Tensor second = Poison({vocab, 40}, dtype());
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = first});
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = second});
    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ";
    const BagReference want = RefBagBackward(ids.ToDoubleVector(), ids.shape(), dout.ToDoubleVector(), vocab, 40, 0);
    EXPECT_TRUE(WithinBound(first.ToDoubleVector(), want, dtype(), device(), Budget()));
}

TEST_P(EmbeddingBagTest, BackwardOfAVocabSliceTakesOnlyItsIdsAndConcatenatesToTheUnsplitGradient) {
    // vocab_start > 0 and ids partly outside the slice on both sides; each row sums the same terms in the same order
    // on every split, so the shards concatenate to the unsplit gradient bit for bit (CUDA: the gather path's promise;
    // the count-GEMM of another V_local is another GEMM).
    const ScopedEmbeddingBagImpl gather(kernels::EmbeddingBagImpl::kGather);
    const std::int64_t vocab = 1001;
    const std::int64_t hidden = 24;
    const Tensor ids = RandomIds({8, 700}, -2, vocab + 2, 68);
    const Tensor dout = Random({700, hidden}, dtype(), 68, "dout");
    Tensor full = Poison({vocab, hidden}, dtype());
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = full});
    const Values unsplit = full.ToDoubleVector();
    EXPECT_TRUE(WithinBound(unsplit,
                            RefBagBackward(ids.ToDoubleVector(), ids.shape(), dout.ToDoubleVector(), vocab, hidden, 0),
                            dtype(), device()));
    for (std::int64_t tp : {2, 3, 8}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        const std::int64_t chunk = (vocab + tp - 1) / tp;
        Values concatenated;
        for (std::int64_t start = 0; start < vocab; start += chunk) {
            const std::int64_t rows = std::min(chunk, vocab - start);
            Tensor shard = Poison({rows, hidden}, dtype());
            EmbeddingBagBackward(
                EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = shard, .vocab_start = start});
            const Values part = shard.ToDoubleVector();
            concatenated.insert(concatenated.end(), part.begin(), part.end());
        }
        EXPECT_EQ(concatenated, unsplit);
    }
}

TEST_P(EmbeddingBagTest, BackwardAccumulatesIntoAFloat32MainGrad) {
    const Tensor ids = RandomIds({32, 64}, 0, 199, 69);
    const Tensor dout = Random({64, 24}, dtype(), 69, "dout");
    Tensor main_grad = Random({200, 24}, DType::kFloat32, 69, "main_grad");
    BagReference want = RefBagBackward(ids.ToDoubleVector(), ids.shape(), dout.ToDoubleVector(), 200, 24, 0);
    const Values before = main_grad.ToDoubleVector();
    for (std::size_t i = 0; i < before.size(); ++i) {
        want.value[i] += before[i];
        want.terms[i] += 1.0;
        want.abs_sum[i] += std::abs(before[i]);
    }
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
    EXPECT_TRUE(WithinBound(main_grad.ToDoubleVector(), want, DType::kFloat32, device(), Budget()));
}

TEST_P(EmbeddingBagTest, BackwardOverwritesAFloat32MainGrad) {
    // A main grad that stands for zeros (autograd's deferred ZeroGrad) is overwritten: its stale values and the rows
    // no id touches end up as the gradient and zeros.
    const Tensor ids = RandomIds({32, 64}, 0, 199, 71);
    const Tensor dout = Random({64, 24}, dtype(), 71, "dout");
    Tensor main_grad = Random({200, 24}, DType::kFloat32, 71, "stale");
    const BagReference want = RefBagBackward(ids.ToDoubleVector(), ids.shape(), dout.ToDoubleVector(), 200, 24, 0);
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = false});
    EXPECT_TRUE(WithinBound(main_grad.ToDoubleVector(), want, DType::kFloat32, device(), Budget()));
}

TEST_P(EmbeddingBagTest, BackwardWithNoPositionsZeroesOrKeepsTheGradient) {
    for (const Shape &shape : {Shape{0, 5}, Shape{4, 0}}) {
        SCOPED_TRACE(ShapeToString(shape));
        const Tensor ids = Tensor::Empty(shape, DType::kInt64, device());
        const Tensor dout = Random(BagOutShape(shape, 4), dtype(), 70, "dout");
        Tensor dweight = Random({3, 4}, dtype(), 70, "dweight");
        const Values before = dweight.ToDoubleVector();
        ASSERT_GT(AbsSum(before), 0.0);
        EmbeddingBagBackward(
            EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = true});
        EXPECT_EQ(dweight.ToDoubleVector(), before);
        EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
        EXPECT_EQ(dweight.ToDoubleVector(), Values(12, 0.0));
    }
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(EmbeddingBagTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Errors (the CPU's messages)

TEST(EmbeddingBagErrorsTest, IdsNeedABagDim) {
    const Tensor ids = Tensor::Zeros({}, DType::kInt64);
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { EmbeddingBagForward(ids, weight); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("ids must be [T, ...] with the bag dim first"),
                      HasSubstr("Tensor[] int64 cpu")));
    const Tensor dout = Tensor::Zeros({3}, DType::kFloat32);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
                }),
                AllOf(HasSubstr("EmbeddingBagBackward"), HasSubstr("ids must be [T, ...]")));
}

TEST(EmbeddingBagErrorsTest, OutputAndGradientShapesAreNamed) {
    const Tensor ids = Tensor::Zeros({2, 4}, DType::kInt64);
    const Tensor weight = Tensor::Zeros({5, 3}, DType::kFloat32);
    Tensor out = Tensor::Empty({2, 4, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>(
                    [&] { EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = out}); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("out must have shape [4, 3]"),
                      HasSubstr("Tensor[2, 4, 3] float32 cpu")));
    const Tensor dout = Tensor::Zeros({2, 4, 3}, DType::kFloat32);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] {
                    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
                }),
                AllOf(HasSubstr("EmbeddingBagBackward"), HasSubstr("dout must have shape [4, 3]")));
}

TEST(EmbeddingBagErrorsTest, DTypesAndVocabStartAreChecked) {
    const Tensor ids = Tensor::Zeros({2, 4}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { EmbeddingBagForward(ids.To(DType::kFloat32), Tensor::Zeros({5, 3}, DType::kFloat32)); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("ids must be int64")));
    const Tensor dout = Tensor::Zeros({4, 3}, DType::kFloat64);
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kInt64); // neither dout's dtype nor a float32 main grad
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    EmbeddingBagBackward(EmbeddingBagBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
                }),
                AllOf(HasSubstr("EmbeddingBagBackward"), HasSubstr("dweight must have dout's dtype float64")));
    EXPECT_THAT(MessageOf<Error>([&] { EmbeddingBagForward(ids, Tensor::Zeros({5, 3}, DType::kFloat32), -1); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("vocab_start must be >= 0"), HasSubstr("got -1")));
}

} // namespace
} // namespace shardline::testing
