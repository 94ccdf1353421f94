// EmbeddingForward / EmbeddingBackward on CUDA against float64 references: the lookup bit for bit (every copy width),
// the sorted deterministic backward (repeats, shards, accumulation into an fp32 main grad), and the vocab-parallel
// split against the unsplit table.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/kernels/embedding.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::EmbeddingBackward;
using kernels::EmbeddingBackwardArgs;
using kernels::EmbeddingForward;
using kernels::EmbeddingForwardArgs;

/// Global ids in [lo, hi] on the GPU (the counter-based integer fill, identical to the host's).
Tensor RandomIds(const Shape& shape, std::int64_t lo, std::int64_t hi, std::uint64_t seed) {
    return RandomTensor(shape, DType::kInt64, Gpu(), seed, "ids", RandomDistribution::kInteger, static_cast<double>(lo),
                        static_cast<double>(hi));
}

Values RefForward(const Values& ids, const Values& table, std::int64_t rows, std::int64_t hidden, std::int64_t start) {
    Values out(ids.size() * static_cast<std::size_t>(hidden), 0.0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto id = static_cast<std::int64_t>(ids[i]);
        if (id >= start && id < start + rows) {
            for (std::int64_t h = 0; h < hidden; ++h) {
                out[i * hidden + h] = table[(id - start) * hidden + h];
            }
        }
    }
    return out;
}

Values RefBackward(const Values& ids, const Values& dout, std::int64_t rows, std::int64_t hidden, std::int64_t start) {
    Values dw(static_cast<std::size_t>(rows * hidden), 0.0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto id = static_cast<std::int64_t>(ids[i]);
        if (id >= start && id < start + rows) {
            for (std::int64_t h = 0; h < hidden; ++h) {
                dw[(id - start) * hidden + h] += dout[i * hidden + h];
            }
        }
    }
    return dw;
}

Shape WithHidden(Shape shape, std::int64_t hidden) {
    shape.push_back(hidden);
    return shape;
}

/// Rows [start, start + rows) of a [V, H] table as their own GPU tensor.
Tensor RowSlice(const Tensor& table, std::int64_t start, std::int64_t rows) {
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
// Row sizes of 1, 2, 4, 8 and 16+ bytes' multiples in every dtype (the copy picks its word from them), odd hidden
// sizes, empty ids, leading dims, many repeats, a large batch that spans many blocks and sort passes.
const std::vector<Case> kCases = {{{0}, 5, 3},   {{1}, 4, 8}, {{7}, 11, 13},   {{3, 5}, 6, 4},        {{2, 3, 4}, 9, 1},
                                  {{200}, 3, 5}, {{6}, 1, 7}, {{64}, 1000, 2}, {{4, 1025}, 50257, 64}};

using CudaEmbeddingTest = CudaParamTest<DType>;

TEST_P(CudaEmbeddingTest, ForwardCopiesRowsBitForBit) {
    const DType dtype = GetParam();
    for (const Case& c : kCases) {
        SCOPED_TRACE(::testing::Message()
                     << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H " << c.hidden);
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 50);
        const Tensor weight = RandomGpu({c.vocab, c.hidden}, dtype, 50, "weight");
        Tensor out = RandomGpu(WithHidden(c.ids_shape, c.hidden), dtype, 99, "poison", 100.0);
        EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out});
        const Values want = RefForward(ids.ToDoubleVector(), weight.ToDoubleVector(), c.vocab, c.hidden, 0);
        EXPECT_EQ(out.ToDoubleVector(), want);
        EXPECT_EQ(EmbeddingForward(ids, weight).ToDoubleVector(), want) << "allocating wrapper";
    }
    // An output that does not start on a 16-byte boundary takes a narrower copy word.
    const Tensor ids = RandomIds({37}, 0, 20, 51);
    const Tensor weight = RandomGpu({20, 24}, dtype, 51, "weight");
    MisalignedTensor out = MisalignedCopy(RandomGpu({37, 24}, dtype, 99, "poison"));
    EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out.view});
    EXPECT_EQ(out.view.ToDoubleVector(), RefForward(ids.ToDoubleVector(), weight.ToDoubleVector(), 20, 24, 0))
        << "misaligned output";
}

TEST_P(CudaEmbeddingTest, ForwardOfVocabShardsSumsToTheUnsplitLookup) {
    const DType dtype = GetParam();
    const std::int64_t vocab = 11;
    const std::int64_t hidden = 12;
    const Tensor ids = RandomIds({4, 9}, -3, vocab + 3, 52);
    const Tensor table = RandomGpu({vocab, hidden}, dtype, 52, "table");
    const Values unsplit = EmbeddingForward(ids, table).ToDoubleVector();
    for (std::int64_t tp : {2, 3, 12}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        const std::int64_t chunk = (vocab + tp - 1) / tp;
        Values sum(unsplit.size(), 0.0);
        for (std::int64_t start = 0; start < vocab + chunk; start += chunk) {
            const std::int64_t rows = std::max<std::int64_t>(0, std::min(chunk, vocab - start));
            const Values part =
                EmbeddingForward(ids, RowSlice(table, std::min(start, vocab), rows), start).ToDoubleVector();
            for (std::size_t i = 0; i < sum.size(); ++i) {
                sum[i] += part[i];
            }
        }
        EXPECT_EQ(sum, unsplit);
    }
}

TEST_P(CudaEmbeddingTest, BackwardSumsRepeatedIdsInFloat32AndRoundsOnce) {
    const DType dtype = GetParam();
    for (const Case& c : kCases) {
        for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H "
                                              << c.hidden << (accumulate ? ", accumulate" : ""));
            const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 53);
            const Tensor dout = RandomGpu(WithHidden(c.ids_shape, c.hidden), dtype, 53, "dout");
            Tensor dweight = RandomGpu({c.vocab, c.hidden}, dtype, 53, "dweight");
            const Values before = dweight.ToDoubleVector();
            EmbeddingBackward(
                EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = accumulate});
            Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), c.vocab, c.hidden, 0);
            if (accumulate) {
                for (std::size_t k = 0; k < want.size(); ++k) {
                    want[k] += before[k];
                }
            }
            // fp32 sums of exact inputs, one rounding to the output dtype.
            EXPECT_TRUE(ValuesMatch(dweight, want, dtype));
        }
    }
}

TEST_P(CudaEmbeddingTest, BackwardOfIntegerGradientsIsExactAndDeterministic) {
    const DType dtype = GetParam();
    // |dout| <= 8 and about 10 repeats per row (a few more at most): every partial sum is an integer of magnitude
    // below 256, exact in every dtype, so any summation order gives the reference exactly.
    const std::int64_t vocab = 300;
    const std::int64_t hidden = 40;
    const Tensor ids = RandomIds({3000}, -5, vocab + 5, 54);
    const Tensor dout = RandomTensor({3000, hidden}, dtype, Gpu(), 54, "dout", RandomDistribution::kInteger, -8, 8);
    Tensor first = Tensor::Empty({vocab, hidden}, dtype, Gpu());
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = first});
    const Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), vocab, hidden, 0);
    ASSERT_GT(AbsSum(want), 0.0);
    EXPECT_EQ(first.ToDoubleVector(), want);
    Tensor second = RandomGpu({vocab, hidden}, dtype, 99, "poison");
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = second});
    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ: the backward must be deterministic";
}

TEST_P(CudaEmbeddingTest, BackwardOfVocabShardsConcatenatesToTheUnsplitGradientBitForBit) {
    const DType dtype = GetParam();
    const std::int64_t vocab = 1001;
    const std::int64_t hidden = 24;
    const Tensor ids = RandomIds({2, 700}, -2, vocab + 2, 55);
    const Tensor dout = RandomGpu({2, 700, hidden}, dtype, 55, "dout");
    Tensor full = Tensor::Empty({vocab, hidden}, dtype, Gpu());
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = full});
    const Values unsplit = full.ToDoubleVector();
    EXPECT_TRUE(
        ValuesMatch(unsplit, RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), vocab, hidden, 0), dtype));
    for (std::int64_t tp : {2, 3, 8}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        const std::int64_t chunk = (vocab + tp - 1) / tp;
        Values concatenated;
        for (std::int64_t start = 0; start < vocab; start += chunk) {
            const std::int64_t rows = std::min(chunk, vocab - start);
            Tensor shard = Tensor::Empty({rows, hidden}, dtype, Gpu());
            EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = shard, .vocab_start = start});
            const Values part = shard.ToDoubleVector();
            concatenated.insert(concatenated.end(), part.begin(), part.end());
        }
        EXPECT_EQ(concatenated, unsplit) << "each row sums the same terms in the same order on every split";
    }
}

TEST_P(CudaEmbeddingTest, BackwardAccumulatesIntoAFloat32MainGrad) {
    const DType dtype = GetParam();
    const Tensor ids = RandomIds({500}, 0, 63, 56);
    const Tensor dout = RandomGpu({500, 33}, dtype, 56, "dout");
    Tensor main_grad = RandomGpu({64, 33}, DType::kFloat32, 56, "main_grad");
    Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), 64, 33, 0);
    const Values before = main_grad.ToDoubleVector();
    for (std::size_t k = 0; k < want.size(); ++k) {
        want[k] += before[k];
    }
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(main_grad, want, DType::kFloat32));
}

TEST_P(CudaEmbeddingTest, BackwardWithNoIdsZeroesOrKeepsTheGradient) {
    const DType dtype = GetParam();
    const Tensor ids = Tensor::Empty({0}, DType::kInt64, Gpu());
    const Tensor dout = Tensor::Empty({0, 4}, dtype, Gpu());
    Tensor dweight = RandomGpu({3, 4}, dtype, 57, "dweight");
    const Values before = dweight.ToDoubleVector();
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = true});
    EXPECT_EQ(dweight.ToDoubleVector(), before);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
    EXPECT_EQ(dweight.ToDoubleVector(), Values(12, 0.0));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaEmbeddingTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
