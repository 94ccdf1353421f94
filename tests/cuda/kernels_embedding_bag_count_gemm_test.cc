// EmbeddingBag's two CUDA implementations, each forced (kernels::SetEmbeddingBagImpl, as SHARDLINE_EMBEDDING_BAG does)
// and under the default choice: the gather kernels and the count-GEMM (the per-bag id-count matrix, then one cuBLASLt
// GEMM). Forward and backward against float64 references on random data in every CUDA dtype: a vocab-parallel shard
// with ids outside it on both sides, few distinct ids in long runs, bags of one repeated id, T = 1, T at bf16's exact
// limit, trailing dims; accumulation on and off, into the gradient and into a float32 main grad; integer data exact on
// both paths; bitwise run-to-run determinism; the choice under auto (the host predicate's pick, bit for bit, and the
// count-GEMM at the README char-LM's shape); bags above the dtype's exact limit gather under auto and are refused when
// the count-GEMM is forced, as is fp32 with TF32 allowed.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/context.h>
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
using kernels::EmbeddingBagImpl;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr EmbeddingBagImpl kImpls[] = {EmbeddingBagImpl::kGather, EmbeddingBagImpl::kGemm, EmbeddingBagImpl::kAuto};

struct IdsCase {
    std::string name;
    Shape shape; ///< [T, ...]
    Values ids;
    std::int64_t vocab_start;
    std::int64_t rows; ///< V_local
    std::int64_t hidden;
};

/// ids uniform in [lo, hi] (inclusive), by the counter-based RNG.
Values UniformIds(const Shape &shape, std::int64_t lo, std::int64_t hi, std::uint64_t seed) {
    return RandomTensor(shape, DType::kInt64, Device::CPU(), seed, "ids", RandomDistribution::kInteger,
                        static_cast<double>(lo), static_cast<double>(hi))
        .ToDoubleVector();
}

std::vector<IdsCase> Cases() {
    std::vector<IdsCase> cases;
    // Rows 100..199 of a 300-row vocabulary (tp 3's middle shard): about two thirds of the ids, some negative, are
    // elsewhere.
    cases.push_back({"vocab-parallel shard", {32, 96}, UniformIds({32, 96}, -3, 302, 1), 100, 100, 40});
    // Ids 101..104 of the shard 100..106: runs of thousands; hidden 130 (not a multiple of 8: unaligned GEMM rows).
    cases.push_back({"few distinct ids in long runs", {32, 512}, FewDistinctIds(32, 512, 101), 100, 7, 130});
    // Every bag one id 64 times (counts of 64), but bag 0, which is uniform.
    {
        Values ids = UniformIds({64, 33}, 0, 49, 2);
        for (std::int64_t t = 0; t < 64; ++t) {
            for (std::int64_t n = 1; n < 33; ++n) {
                ids[static_cast<std::size_t>(t * 33 + n)] = static_cast<double>((7 * n) % 50);
            }
        }
        cases.push_back({"bags of one repeated id", {64, 33}, std::move(ids), 0, 50, 24});
    }
    cases.push_back({"T = 1", {1, 200}, UniformIds({1, 200}, 0, 44, 3), 0, 40, 16});
    // T = 256, bf16's largest exact count: bag 3 holds one id 256 times.
    {
        Values ids = UniformIds({256, 8}, 0, 4, 4);
        for (std::int64_t t = 0; t < 256; ++t) {
            ids[static_cast<std::size_t>(t * 8 + 3)] = 2.0;
        }
        cases.push_back({"T at bf16's exact limit", {256, 8}, std::move(ids), 0, 5, 32});
    }
    cases.push_back({"trailing dims", {4, 6, 5}, UniformIds({4, 6, 5}, -1, 9, 5), 0, 9, 8});
    return cases;
}

Tensor Ids(const IdsCase &c) { return Tensor::FromVector(c.ids, c.shape, DType::kInt64).To(Gpu()); }
/// Random garbage for an output the kernel must overwrite.
Tensor Poison(const Shape &shape, DType dtype) { return RandomGpu(shape, dtype, 999, "poison", 100.0); }
Tensor Integers(const Shape &shape, DType dtype, std::uint64_t seed) {
    return RandomTensor(shape, dtype, Gpu(), seed, "integers", RandomDistribution::kInteger, -8, 8);
}

Tensor Forward(EmbeddingBagImpl impl, const Tensor &ids, const Tensor &weight, std::int64_t vocab_start) {
    const ScopedEmbeddingBagImpl scope(impl);
    Tensor out = Poison(BagOutShape(ids.shape(), weight.size(1)), weight.dtype());
    EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = out, .vocab_start = vocab_start});
    return out;
}

/// The backward into a copy of `initial` (the previous gradient when accumulating, poison otherwise).
Tensor Backward(EmbeddingBagImpl impl, const Tensor &ids, const Tensor &dout, const Tensor &initial,
                std::int64_t vocab_start, bool accumulate) {
    const ScopedEmbeddingBagImpl scope(impl);
    Tensor dweight = initial.Clone();
    EmbeddingBagBackward(EmbeddingBagBackwardArgs{
        .ids = ids, .dout = dout, .dweight = dweight, .vocab_start = vocab_start, .accumulate = accumulate});
    return dweight;
}

/// The implementation the default choice takes for this problem (the host predicate the provider asks; TF32 off, as
/// the fixtures set it).
EmbeddingBagImpl Chosen(const Shape &ids_shape, std::int64_t rows, std::int64_t hidden, DType dtype) {
    const Bags b = BagsOf(ids_shape);
    return kernels::ChooseEmbeddingBagImpl(
        {.bag = b.bag, .count = b.count, .rows = rows, .hidden = hidden, .dtype = dtype}, EmbeddingBagImpl::kAuto,
        "test");
}

/// The count-GEMM's budget (auto's too, which may take it): tensor-core sums; a half epilogue adding beta·C may round
/// in the output precision. The gather's: one correct rounding of an fp32 sum.
BagBudget BudgetOf(EmbeddingBagImpl impl, bool accumulate, DType out_dtype) {
    if (impl == EmbeddingBagImpl::kGather) {
        return {};
    }
    return {.output_roundings = accumulate && out_dtype != DType::kFloat32 ? kEpilogueRoundings : 1.0,
            .sum_roundings = 2};
}

class CudaEmbeddingBagCountGemmTest : public CudaParamTest<DType> {
protected:
    DType dtype() const { return GetParam(); }
};

TEST_P(CudaEmbeddingBagCountGemmTest, ForwardMatchesFloat64OnEveryPathAndRepeatsBitwise) {
    for (const IdsCase &c : Cases()) {
        SCOPED_TRACE(c.name);
        const Tensor ids = Ids(c);
        const Tensor weight = RandomGpu({c.rows, c.hidden}, dtype(), 11, "weight");
        const BagReference want =
            RefBagForward(c.ids, c.shape, weight.ToDoubleVector(), c.rows, c.hidden, c.vocab_start);
        ASSERT_GT(AbsSum(want.value), 0.0);
        std::vector<std::vector<unsigned char>> bytes;
        for (const EmbeddingBagImpl impl : kImpls) {
            SCOPED_TRACE(std::string(kernels::EmbeddingBagImplName(impl)));
            const Tensor first = Forward(impl, ids, weight, c.vocab_start);
            const Tensor second = Forward(impl, ids, weight, c.vocab_start);
            EXPECT_TRUE(WithinBound(first.ToDoubleVector(), want, dtype(), Gpu(), BudgetOf(impl, false, dtype())));
            EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ";
            bytes.push_back(HostBytes(first));
        }
        const EmbeddingBagImpl chosen = Chosen(c.shape, c.rows, c.hidden, dtype());
        EXPECT_EQ(bytes[2], bytes[chosen == EmbeddingBagImpl::kGather ? 0 : 1])
            << "auto is not the implementation the choice names (" << kernels::EmbeddingBagImplName(chosen) << ")";
    }
}

TEST_P(CudaEmbeddingBagCountGemmTest, BackwardMatchesFloat64OnEveryPathWithAndWithoutAccumulate) {
    std::vector<DType> grad_dtypes = {dtype()};
    if (dtype() != DType::kFloat32) {
        grad_dtypes.push_back(DType::kFloat32); // a float32 main grad for half dout
    }
    for (const IdsCase &c : Cases()) {
        const Tensor ids = Ids(c);
        const Tensor dout = RandomGpu(BagOutShape(c.shape, c.hidden), dtype(), 12, "dout");
        const BagReference fresh =
            RefBagBackward(c.ids, c.shape, dout.ToDoubleVector(), c.rows, c.hidden, c.vocab_start);
        ASSERT_GT(AbsSum(fresh.value), 0.0) << c.name;
        for (const DType grad_dtype : grad_dtypes) {
            for (const bool accumulate : {false, true}) {
                // The previous gradient (accumulate) or poison that must be overwritten.
                const Tensor initial = RandomGpu({c.rows, c.hidden}, grad_dtype, 13, "initial");
                BagReference want = fresh;
                if (accumulate) {
                    AddPrevious(want, initial.ToDoubleVector());
                }
                // Accumulating into a half dweight never takes the GEMM (EmbeddingBagProblem::half_accumulate):
                // a forced gemm is an error, auto gathers.
                const bool half_accumulate = accumulate && grad_dtype != DType::kFloat32;
                std::vector<std::vector<unsigned char>> bytes;
                for (const EmbeddingBagImpl impl : kImpls) {
                    SCOPED_TRACE(::testing::Message()
                                 << c.name << ", dweight " << DTypeName(grad_dtype)
                                 << (accumulate ? ", accumulate, " : ", ") << kernels::EmbeddingBagImplName(impl));
                    if (half_accumulate && impl == EmbeddingBagImpl::kGemm) {
                        EXPECT_THROW(Backward(impl, ids, dout, initial, c.vocab_start, accumulate), Error);
                        bytes.emplace_back();
                        continue;
                    }
                    const Tensor first = Backward(impl, ids, dout, initial, c.vocab_start, accumulate);
                    const Tensor second = Backward(impl, ids, dout, initial, c.vocab_start, accumulate);
                    EXPECT_TRUE(WithinBound(first.ToDoubleVector(), want, grad_dtype, Gpu(),
                                            BudgetOf(impl, accumulate, grad_dtype)));
                    EXPECT_EQ(HostBytes(second), HostBytes(first)) << "two runs differ";
                    bytes.push_back(HostBytes(first));
                }
                const EmbeddingBagImpl chosen =
                    half_accumulate ? EmbeddingBagImpl::kGather : Chosen(c.shape, c.rows, c.hidden, dtype());
                EXPECT_EQ(bytes[2], bytes[chosen == EmbeddingBagImpl::kGather ? 0 : 1])
                    << c.name << ": auto is not the implementation the choice names";
            }
        }
    }
}

TEST_P(CudaEmbeddingBagCountGemmTest, IntegerDataIsExactOnBothPaths) {
    // |values| <= 8 and at most 64 terms a sum in the forward: every fp32 partial sum is an exact integer, so both
    // paths give the float64 sum rounded once into the dtype, bit for bit (the backward into a float32 main grad:
    // exact).
    for (const IdsCase &c : Cases()) {
        SCOPED_TRACE(c.name);
        const Tensor ids = Ids(c);
        const Tensor weight = Integers({c.rows, c.hidden}, dtype(), 14);
        const Tensor dout = Integers(BagOutShape(c.shape, c.hidden), dtype(), 15);
        const Values forward =
            RefBagForward(c.ids, c.shape, weight.ToDoubleVector(), c.rows, c.hidden, c.vocab_start).value;
        const Values backward =
            RefBagBackward(c.ids, c.shape, dout.ToDoubleVector(), c.rows, c.hidden, c.vocab_start).value;
        const Tensor main_grad = Integers({c.rows, c.hidden}, DType::kFloat32, 16);
        Values accumulated = backward;
        const Values previous = main_grad.ToDoubleVector();
        for (std::size_t i = 0; i < accumulated.size(); ++i) {
            accumulated[i] += previous[i];
        }
        for (const EmbeddingBagImpl impl : {EmbeddingBagImpl::kGather, EmbeddingBagImpl::kGemm}) {
            SCOPED_TRACE(std::string(kernels::EmbeddingBagImplName(impl)));
            EXPECT_EQ(Forward(impl, ids, weight, c.vocab_start).ToDoubleVector(), RoundTo(forward, dtype()));
            const Tensor poison = Poison({c.rows, c.hidden}, dtype());
            EXPECT_EQ(Backward(impl, ids, dout, poison, c.vocab_start, false).ToDoubleVector(),
                      RoundTo(backward, dtype()));
            EXPECT_EQ(Backward(impl, ids, dout, main_grad, c.vocab_start, true).ToDoubleVector(), accumulated);
        }
    }
}

TEST_P(CudaEmbeddingBagCountGemmTest, CountGemmIsBitwiseReproducibleAtATrainingShape) {
    // The char-LM at tp 8 (344 rows of the 2752), a quarter of its batch: the same cached GEMM plan every call.
    const std::int64_t bag = 32;
    const std::int64_t count = 2048;
    const std::int64_t rows = 344;
    const std::int64_t hidden = 512;
    const Values id_values = UniformIds({bag, count}, -10, rows + 10, 17);
    const Tensor ids = Tensor::FromVector(id_values, {bag, count}, DType::kInt64).To(Gpu());
    const Tensor weight = RandomGpu({rows, hidden}, dtype(), 17, "weight");
    const Tensor dout = RandomGpu({count, hidden}, dtype(), 17, "dout");
    const Tensor main_grad = RandomGpu({rows, hidden}, DType::kFloat32, 17, "main_grad");
    const Tensor out = Forward(EmbeddingBagImpl::kGemm, ids, weight, 0);
    const Tensor grad = Backward(EmbeddingBagImpl::kGemm, ids, dout, main_grad, 0, true);
    for (int run = 0; run < 3; ++run) {
        EXPECT_EQ(HostBytes(Forward(EmbeddingBagImpl::kGemm, ids, weight, 0)), HostBytes(out)) << "run " << run;
        EXPECT_EQ(HostBytes(Backward(EmbeddingBagImpl::kGemm, ids, dout, main_grad, 0, true)), HostBytes(grad))
            << "run " << run;
    }
    EXPECT_TRUE(WithinBound(out.ToDoubleVector(),
                            RefBagForward(id_values, {bag, count}, weight.ToDoubleVector(), rows, hidden, 0), dtype(),
                            Gpu(), BudgetOf(EmbeddingBagImpl::kGemm, false, dtype())));
    BagReference want = RefBagBackward(id_values, {bag, count}, dout.ToDoubleVector(), rows, hidden, 0);
    AddPrevious(want, main_grad.ToDoubleVector());
    EXPECT_TRUE(WithinBound(grad.ToDoubleVector(), want, DType::kFloat32, Gpu(),
                            BudgetOf(EmbeddingBagImpl::kGemm, true, DType::kFloat32)));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaEmbeddingBagCountGemmTest, CudaDTypes(), DTypeParamName);

using CudaEmbeddingBagChoiceTest = CudaTest;

TEST_F(CudaEmbeddingBagChoiceTest, AutoTakesTheCountGemmAtTheCharLmShape) {
    // examples/char_lm.cc: ids [32, 8192], id = t·86 + char, a [2752, 2048] bf16 table, the backward accumulating into
    // a float32 main grad. Auto gives the forced count-GEMM's bits; sampled rows against float64.
    const std::int64_t bag = 32;
    const std::int64_t count = 8192;
    const std::int64_t chars = 86;
    const std::int64_t rows = bag * chars;
    const std::int64_t hidden = 2048;
    ASSERT_EQ(Chosen({bag, count}, rows, hidden, DType::kBFloat16), EmbeddingBagImpl::kGemm);
    Values id_values = UniformIds({bag, count}, 0, chars - 1, 18);
    for (std::int64_t t = 0; t < bag; ++t) {
        for (std::int64_t n = 0; n < count; ++n) {
            id_values[static_cast<std::size_t>(t * count + n)] += static_cast<double>(t * chars);
        }
    }
    const Tensor ids = Tensor::FromVector(id_values, {bag, count}, DType::kInt64).To(Gpu());
    const Tensor weight = RandomGpu({rows, hidden}, DType::kBFloat16, 18, "weight");
    const Tensor dout = RandomGpu({count, hidden}, DType::kBFloat16, 18, "dout", 1e-3);
    const Tensor main_grad = RandomGpu({rows, hidden}, DType::kFloat32, 18, "main_grad", 1e-3);

    const Tensor out = Forward(EmbeddingBagImpl::kAuto, ids, weight, 0);
    EXPECT_EQ(HostBytes(out), HostBytes(Forward(EmbeddingBagImpl::kGemm, ids, weight, 0)));
    const Tensor grad = Backward(EmbeddingBagImpl::kAuto, ids, dout, main_grad, 0, true);
    EXPECT_EQ(HostBytes(grad), HostBytes(Backward(EmbeddingBagImpl::kGemm, ids, dout, main_grad, 0, true)));

    // Output rows 0..15 and gradient rows {0, 85, 86, 1000, 2751}: the references of those rows alone.
    const std::int64_t sampled = 16;
    Values sample_ids;
    for (std::int64_t t = 0; t < bag; ++t) {
        for (std::int64_t n = 0; n < sampled; ++n) {
            sample_ids.push_back(id_values[static_cast<std::size_t>(t * count + n)]);
        }
    }
    const BagReference want_out = RefBagForward(sample_ids, {bag, sampled}, weight.ToDoubleVector(), rows, hidden, 0);
    const Values got_out = out.ToDoubleVector();
    EXPECT_TRUE(WithinBound(Values(got_out.begin(), got_out.begin() + sampled * hidden), want_out, DType::kBFloat16,
                            Gpu(), BudgetOf(EmbeddingBagImpl::kGemm, false, DType::kBFloat16)));
    const Values d = dout.ToDoubleVector();
    const Values before = main_grad.ToDoubleVector();
    const Values got_grad = grad.ToDoubleVector();
    for (const std::int64_t v : {0, 85, 86, 1000, 2751}) {
        SCOPED_TRACE(::testing::Message() << "gradient row " << v);
        BagReference want{Values(before.begin() + v * hidden, before.begin() + (v + 1) * hidden),
                          Values(static_cast<std::size_t>(hidden), 1.0),
                          {}};
        for (std::size_t h = 0; h < want.value.size(); ++h) {
            want.abs_sum.push_back(std::abs(want.value[h]));
        }
        for (std::int64_t i = 0; i < bag * count; ++i) {
            if (static_cast<std::int64_t>(id_values[static_cast<std::size_t>(i)]) == v) {
                for (std::int64_t h = 0; h < hidden; ++h) {
                    const double x = d[static_cast<std::size_t>((i % count) * hidden + h)];
                    want.value[static_cast<std::size_t>(h)] += x;
                    want.terms[static_cast<std::size_t>(h)] += 1.0;
                    want.abs_sum[static_cast<std::size_t>(h)] += std::abs(x);
                }
            }
        }
        ASSERT_GT(want.terms[0], 10.0) << "the row is hit";
        EXPECT_TRUE(WithinBound(Values(got_grad.begin() + v * hidden, got_grad.begin() + (v + 1) * hidden), want,
                                DType::kFloat32, Gpu(), BudgetOf(EmbeddingBagImpl::kGemm, true, DType::kFloat32)));
    }
}

TEST_F(CudaEmbeddingBagChoiceTest, BagsAboveTheExactLimitGatherUnderAutoAndAreRefusedWhenForced) {
    // bf16 counts are exact up to 256: T = 300 takes the gather under auto, although its 8-row table would make the
    // GEMM cheap, and a forced count-GEMM is an error naming the op, the problem and the limit.
    const std::int64_t bag = 300;
    const std::int64_t count = 16;
    const Values id_values = UniformIds({bag, count}, 0, 7, 19);
    const Tensor ids = Tensor::FromVector(id_values, {bag, count}, DType::kInt64).To(Gpu());
    const Tensor weight = RandomGpu({8, 16}, DType::kBFloat16, 19, "weight");
    const Tensor dout = RandomGpu({count, 16}, DType::kBFloat16, 19, "dout");
    const Tensor zeros = Tensor::Zeros({8, 16}, DType::kBFloat16, Gpu());

    const Tensor out = Forward(EmbeddingBagImpl::kAuto, ids, weight, 0);
    EXPECT_EQ(HostBytes(out), HostBytes(Forward(EmbeddingBagImpl::kGather, ids, weight, 0)));
    EXPECT_TRUE(WithinBound(out.ToDoubleVector(),
                            RefBagForward(id_values, {bag, count}, weight.ToDoubleVector(), 8, 16, 0), DType::kBFloat16,
                            Gpu()));
    const Tensor grad = Backward(EmbeddingBagImpl::kAuto, ids, dout, zeros, 0, false);
    EXPECT_EQ(HostBytes(grad), HostBytes(Backward(EmbeddingBagImpl::kGather, ids, dout, zeros, 0, false)));
    EXPECT_TRUE(WithinBound(grad.ToDoubleVector(),
                            RefBagBackward(id_values, {bag, count}, dout.ToDoubleVector(), 8, 16, 0), DType::kBFloat16,
                            Gpu()));

    EXPECT_THAT(MessageOf<Error>([&] { (void)Forward(EmbeddingBagImpl::kGemm, ids, weight, 0); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("SHARDLINE_EMBEDDING_BAG=gemm"),
                      HasSubstr("ids [T=300, N=16] over a [8, 16] bfloat16 shard"), HasSubstr("T = 300, above 256")));
    EXPECT_THAT(MessageOf<Error>([&] { (void)Backward(EmbeddingBagImpl::kGemm, ids, dout, zeros, 0, false); }),
                AllOf(HasSubstr("EmbeddingBagBackward"), HasSubstr("T = 300, above 256")));
    // fp16 counts are exact up to 2048: the same bags may take the count-GEMM.
    EXPECT_EQ(Chosen({bag, count}, 8, 16, DType::kFloat16), EmbeddingBagImpl::kGemm);
}

TEST_F(CudaEmbeddingBagChoiceTest, Float32WithTf32AllowedGathersAndRefusesAForcedGemm) {
    // TF32 would round the table to 10 mantissa bits: the embedding keeps fp32 (the fixture restores the setting).
    CudaContext::Get(0).SetAllowTf32(true);
    const Values id_values = UniformIds({8, 32}, 0, 9, 20);
    const Tensor ids = Tensor::FromVector(id_values, {8, 32}, DType::kInt64).To(Gpu());
    const Tensor weight = RandomGpu({10, 16}, DType::kFloat32, 20, "weight");
    const Tensor out = Forward(EmbeddingBagImpl::kAuto, ids, weight, 0);
    EXPECT_EQ(HostBytes(out), HostBytes(Forward(EmbeddingBagImpl::kGather, ids, weight, 0)));
    EXPECT_THAT(MessageOf<Error>([&] { (void)Forward(EmbeddingBagImpl::kGemm, ids, weight, 0); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("TF32")));
}

TEST_F(CudaEmbeddingBagChoiceTest, AShardWithoutRowsGivesZerosUnderAForcedGemm) {
    const Tensor ids = Tensor::FromVector(UniformIds({4, 6}, 0, 9, 21), {4, 6}, DType::kInt64).To(Gpu());
    const Tensor empty = Tensor::Empty({0, 8}, DType::kBFloat16, Gpu());
    EXPECT_EQ(Forward(EmbeddingBagImpl::kGemm, ids, empty, 5).ToDoubleVector(), Values(6 * 8, 0.0));
}

} // namespace
} // namespace shardline::testing
