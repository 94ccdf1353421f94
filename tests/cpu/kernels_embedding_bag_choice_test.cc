// The CUDA EmbeddingBag ops' choice between the gather and the count-GEMM (host logic, include/shardline/kernels/
// embedding.h): where the counts are exact in each dtype, the cost model at the README char-LM's shape and at a 50k
// vocabulary, and the errors of a forced count-GEMM. The kernels themselves: tests/cuda/
// kernels_embedding_bag_count_gemm_test.cc.

#include <cstdint>
#include <string>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/embedding.h>

#include "helpers.h"

namespace shardline::kernels {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::MessageOf;

/// The README job's char-LM (examples/char_lm.cc): ids [32, 8192], one 86-row block per position (2752 rows), H 2048.
EmbeddingBagProblem CharLm(DType dtype = DType::kBFloat16) {
    return {.bag = 32, .count = 8192, .rows = 32 * 86, .hidden = 2048, .dtype = dtype};
}

TEST(EmbeddingBagChoiceTest, CountsAreExactUpToTheDTypesLargestExactInteger) {
    struct Limit {
        DType dtype;
        std::int64_t bag;
    };
    for (const Limit l :
         {Limit{DType::kBFloat16, 256}, Limit{DType::kFloat16, 2048}, Limit{DType::kFloat32, std::int64_t{1} << 24}}) {
        SCOPED_TRACE(DTypeName(l.dtype));
        EmbeddingBagProblem p = CharLm(l.dtype);
        p.bag = l.bag;
        EXPECT_EQ(CountGemmIneligibility(p), "");
        p.bag = l.bag + 1;
        EXPECT_THAT(CountGemmIneligibility(p), AllOf(HasSubstr(fmt::format("T = {}", l.bag + 1)),
                                                     HasSubstr(std::to_string(l.bag)), HasSubstr(DTypeName(l.dtype))));
    }
    EmbeddingBagProblem tf32 = CharLm(DType::kFloat32);
    tf32.tf32 = true;
    EXPECT_THAT(CountGemmIneligibility(tf32), HasSubstr("TF32"));
    EXPECT_THAT(CountGemmIneligibility(CharLm(DType::kFloat64)), HasSubstr("got float64"));
}

TEST(EmbeddingBagChoiceTest, AutoTakesTheCountGemmAtTheCharLmShapeAndTheGatherForA50kVocabulary) {
    const EmbeddingBagCostEstimate char_lm = EstimateEmbeddingBagCost(CharLm());
    // 1 GiB of gathered rows at 5 TB/s; 92 GFLOP at 600 TFLOP/s + 45 MB of counts at 3 TB/s.
    EXPECT_NEAR(char_lm.gather_s, 32.0 * 8192 * 2048 * 2 / 5e12, 1e-9);
    EXPECT_NEAR(char_lm.count_gemm_s, 2.0 * 8192 * 2752 * 2048 / 600e12 + 8192.0 * 2752 * 2 / 3e12, 1e-9);
    EXPECT_LT(char_lm.count_gemm_s, char_lm.gather_s);
    EXPECT_EQ(ChooseEmbeddingBagImpl(CharLm(), EmbeddingBagImpl::kAuto, "op"), EmbeddingBagImpl::kGemm);
    EXPECT_EQ(ChooseEmbeddingBagImpl(CharLm(DType::kFloat16), EmbeddingBagImpl::kAuto, "op"), EmbeddingBagImpl::kGemm);
    // fp32 GEMMs without tensor cores: the gather.
    EXPECT_EQ(ChooseEmbeddingBagImpl(CharLm(DType::kFloat32), EmbeddingBagImpl::kAuto, "op"),
              EmbeddingBagImpl::kGather);
    // A 50257-token vocabulary over tp 4: V_local 12565, the GEMM ~3.6x the gather's time.
    EmbeddingBagProblem large = CharLm();
    large.rows = 12565;
    EXPECT_EQ(ChooseEmbeddingBagImpl(large, EmbeddingBagImpl::kAuto, "op"), EmbeddingBagImpl::kGather);
    EXPECT_EQ(ChooseEmbeddingBagImpl(large, EmbeddingBagImpl::kGemm, "op"), EmbeddingBagImpl::kGemm) << "forced";
    EXPECT_EQ(ChooseEmbeddingBagImpl(CharLm(), EmbeddingBagImpl::kGather, "op"), EmbeddingBagImpl::kGather);
}

TEST(EmbeddingBagChoiceTest, ABagAboveTheExactLimitGathersUnderAutoAndIsRefusedWhenForced) {
    EmbeddingBagProblem p = CharLm();
    p.bag = 300;
    p.rows = 8; // the cost model alone would take the GEMM
    EXPECT_EQ(ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kAuto, "EmbeddingBagForward"), EmbeddingBagImpl::kGather);
    EXPECT_THAT(MessageOf<Error>([&] { ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kGemm, "EmbeddingBagForward"); }),
                AllOf(HasSubstr("EmbeddingBagForward"), HasSubstr("SHARDLINE_EMBEDDING_BAG=gemm"),
                      HasSubstr("ids [T=300, N=8192] over a [8, 2048] bfloat16 shard"), HasSubstr("T = 300, above 256"),
                      HasSubstr("use auto or gather")));
}

TEST(EmbeddingBagChoiceTest, AccumulatingIntoAHalfGradientGathersUnderAutoAndIsRefusedWhenForced) {
    for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(DTypeName(dtype));
        EmbeddingBagProblem p = CharLm(dtype);
        ASSERT_EQ(ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kAuto, "EmbeddingBagBackward"), EmbeddingBagImpl::kGemm);
        p.half_accumulate = true;
        EXPECT_EQ(ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kAuto, "EmbeddingBagBackward"),
                  EmbeddingBagImpl::kGather);
        EXPECT_THAT(
            MessageOf<Error>([&] { ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kGemm, "EmbeddingBagBackward"); }),
            AllOf(HasSubstr("EmbeddingBagBackward"), HasSubstr("SHARDLINE_EMBEDDING_BAG=gemm"),
                  HasSubstr("accumulating into a float16/bfloat16 gradient"), HasSubstr("float32 main grad")));
    }
}

TEST(EmbeddingBagChoiceTest, AShardWithoutRowsGathersEvenWhenTheGemmIsForced) {
    EmbeddingBagProblem p = CharLm();
    p.rows = 0;
    EXPECT_EQ(ChooseEmbeddingBagImpl(p, EmbeddingBagImpl::kGemm, "op"), EmbeddingBagImpl::kGather);
}

TEST(EmbeddingBagChoiceTest, ImplNames) {
    EXPECT_EQ(EmbeddingBagImplName(EmbeddingBagImpl::kAuto), "auto");
    EXPECT_EQ(EmbeddingBagImplName(EmbeddingBagImpl::kGemm), "gemm");
    EXPECT_EQ(EmbeddingBagImplName(EmbeddingBagImpl::kGather), "gather");
}

} // namespace
} // namespace shardline::kernels
