// EmbeddingForward / EmbeddingBackward on the CPU against float64 references, the vocab-parallel split (shards of the
// table, combined by the sum an all-reduce would compute) against the unsplit table, and the error messages.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/embedding.h>

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
using testing::Values;
using testing::ValuesMatch;

/// Global ids in [lo, hi], some outside any shard when lo < 0 or hi >= V.
Tensor RandomIds(const Shape &shape, std::int64_t lo, std::int64_t hi, std::uint64_t seed) {
    return RandomTensor(shape, DType::kInt64, Device::CPU(), seed, "ids", RandomDistribution::kInteger,
                        static_cast<double>(lo), static_cast<double>(hi));
}

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

/// Rows [start, start + rows) of a [V, H] table as their own tensor.
Tensor RowSlice(const Tensor &table, std::int64_t start, std::int64_t rows) {
    const std::int64_t hidden = table.size(1);
    const Values all = table.ToDoubleVector();
    const Values part(all.begin() + start * hidden, all.begin() + (start + rows) * hidden);
    return Tensor::FromVector(part, {rows, hidden}, table.dtype());
}

struct Case {
    Shape ids_shape;
    std::int64_t vocab;
    std::int64_t hidden;
};
// Empty ids, one id, odd sizes, leading dims, more ids than rows (repeats), a one-row table.
const std::vector<Case> kCases = {{{0}, 5, 3},       {{1}, 4, 8},  {{7}, 11, 13}, {{3, 5}, 6, 4},
                                  {{2, 3, 4}, 9, 1}, {{40}, 3, 5}, {{6}, 1, 7}};

class EmbeddingTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbeddingTest, ForwardCopiesTheRowOfEachIdAndZeroesIdsOutsideTheTable) {
    const DType dtype = GetParam();
    for (const Case &c : kCases) {
        SCOPED_TRACE(::testing::Message()
                     << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H " << c.hidden);
        const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 7);
        const Tensor weight = RandomTensor({c.vocab, c.hidden}, dtype, Device::CPU(), 7, "weight");
        ASSERT_GT(AbsSum(weight.ToDoubleVector()), 0.0);
        Tensor out = RandomTensor(WithHidden(c.ids_shape, c.hidden), dtype, Device::CPU(), 99, "poison",
                                  RandomDistribution::kNormal, 0, 100);
        EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out});
        const Values want = RefForward(ids.ToDoubleVector(), weight.ToDoubleVector(), c.vocab, c.hidden, 0);
        EXPECT_EQ(out.ToDoubleVector(), want) << "a lookup is a copy: bit-exact";
        const Tensor alloc = EmbeddingForward(ids, weight);
        EXPECT_EQ(alloc.shape(), WithHidden(c.ids_shape, c.hidden));
        EXPECT_EQ(alloc.dtype(), dtype);
        EXPECT_EQ(alloc.ToDoubleVector(), want) << "allocating wrapper";
    }
}

TEST_P(EmbeddingTest, ForwardOfVocabShardsSumsToTheUnsplitLookup) {
    const DType dtype = GetParam();
    const std::int64_t vocab = 11;
    const std::int64_t hidden = 6;
    const Tensor ids = RandomIds({4, 9}, -3, vocab + 3, 8); // ids beyond the vocabulary hit no shard
    const Tensor table = RandomTensor({vocab, hidden}, dtype, Device::CPU(), 8, "table");
    const Values unsplit = EmbeddingForward(ids, table).ToDoubleVector();
    for (std::int64_t tp : {1, 2, 3, 4, 12}) { // 12 shards of 11 rows: the last one is empty
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
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

TEST_P(EmbeddingTest, BackwardSumsTheGradientsOfRepeatedIds) {
    const DType dtype = GetParam();
    for (const Case &c : kCases) {
        for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "ids " << ShapeToString(c.ids_shape) << ", V " << c.vocab << ", H "
                                              << c.hidden << (accumulate ? ", accumulate" : ""));
            const Tensor ids = RandomIds(c.ids_shape, -2, c.vocab + 1, 9);
            const Tensor dout = RandomTensor(WithHidden(c.ids_shape, c.hidden), dtype, Device::CPU(), 9, "dout");
            // Poison (=) or a previous gradient (+=): rows no id hits must come out zero, or unchanged.
            Tensor dweight = RandomTensor({c.vocab, c.hidden}, dtype, Device::CPU(), 9, "dweight");
            const Values before = dweight.ToDoubleVector();
            EmbeddingBackward(
                EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = accumulate});
            Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), c.vocab, c.hidden, 0);
            if (accumulate) {
                for (std::size_t k = 0; k < want.size(); ++k) {
                    want[k] += before[k];
                }
            }
            if (dout.numel() > 0) {
                ASSERT_GT(AbsSum(dout.ToDoubleVector()), 0.0);
            }
            EXPECT_TRUE(ValuesMatch(dweight, want, dtype));
        }
    }
}

TEST_P(EmbeddingTest, BackwardOfVocabShardsConcatenatesToTheUnsplitGradient) {
    const DType dtype = GetParam();
    const std::int64_t vocab = 13;
    const std::int64_t hidden = 5;
    const Tensor ids = RandomIds({50}, -2, vocab + 2, 10);
    const Tensor dout = RandomTensor({50, hidden}, dtype, Device::CPU(), 10, "dout");
    Tensor full = Tensor::Empty({vocab, hidden}, dtype);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = full});
    const Values unsplit = full.ToDoubleVector();
    EXPECT_TRUE(
        ValuesMatch(unsplit, RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), vocab, hidden, 0), dtype));
    for (std::int64_t tp : {2, 3, 5}) {
        SCOPED_TRACE(::testing::Message() << "tp " << tp);
        Values concatenated;
        std::int64_t start = 0;
        for (std::int64_t rows : ChunkSizes(vocab, tp)) {
            Tensor shard = Tensor::Empty({rows, hidden}, dtype);
            EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = shard, .vocab_start = start});
            const Values part = shard.ToDoubleVector();
            concatenated.insert(concatenated.end(), part.begin(), part.end());
            start += rows;
        }
        // Each row sums the same terms in the same (position) order on every split: bit-exact.
        EXPECT_EQ(concatenated, unsplit);
    }
}

TEST_P(EmbeddingTest, BackwardWithNoIdsZeroesOrKeepsTheGradient) {
    const DType dtype = GetParam();
    const Tensor ids = Tensor::Empty({0}, DType::kInt64);
    const Tensor dout = Tensor::Empty({0, 4}, dtype);
    Tensor dweight = RandomTensor({3, 4}, dtype, Device::CPU(), 11, "dweight");
    const Values before = dweight.ToDoubleVector();
    ASSERT_GT(AbsSum(before), 0.0);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight, .accumulate = true});
    EXPECT_EQ(dweight.ToDoubleVector(), before);
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight});
    EXPECT_EQ(dweight.ToDoubleVector(), Values(12, 0.0));
}

INSTANTIATE_TEST_SUITE_P(CpuDTypes, EmbeddingTest, CpuDTypes(), DTypeParamName);

TEST(EmbeddingTest, BackwardAccumulatesFloat64GradientsIntoAFloat32MainGrad) {
    const Tensor ids = RandomIds({30}, 0, 6, 12);
    const Tensor dout = RandomTensor({30, 7}, DType::kFloat64, Device::CPU(), 12, "dout");
    Tensor main_grad = RandomTensor({7, 7}, DType::kFloat32, Device::CPU(), 12, "main_grad");
    Values want = RefBackward(ids.ToDoubleVector(), dout.ToDoubleVector(), 7, 7, 0);
    const Values before = main_grad.ToDoubleVector();
    for (std::size_t k = 0; k < want.size(); ++k) {
        want[k] += before[k];
    }
    EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = main_grad, .accumulate = true});
    EXPECT_TRUE(ValuesMatch(main_grad, want, DType::kFloat32));
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
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    EmbeddingForward(ids, Tensor::Zeros({5, 3}, DType::kInt64));
                }),
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
    Tensor dweight = Tensor::Zeros({5, 3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { EmbeddingBackward(EmbeddingBackwardArgs{.ids = ids, .dout = dout, .dweight = dweight}); }),
                AllOf(HasSubstr("EmbeddingBackward"), HasSubstr("dweight must have dout's dtype float64"),
                      HasSubstr("float32 main grad with accumulate"), HasSubstr("Tensor[5, 3] float32 cpu")));
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
} // namespace shardline::kernels
