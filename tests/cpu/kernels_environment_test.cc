// The dispatcher reads SHARDLINE_PROVIDER / SHARDLINE_LINEAR_IMPL at its first use, the EmbeddingBag choice
// SHARDLINE_EMBEDDING_BAG at its first read. This file is its own executable and CTest runs each test in its own
// process, so that first use really happens inside the test.

#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::RefLinearForward;
using testing::ValuesMatch;

TEST(EnvironmentTest, BadLinearImplAtFirstUseIsReportedAndTheNextCallRecovers) {
    setenv("SHARDLINE_LINEAR_IMPL", "fast", 1);
    try {
        (void)SelectedProvider("LinearForward");
        FAIL() << "SHARDLINE_LINEAR_IMPL=fast was accepted";
    } catch (const Error& e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("SHARDLINE_LINEAR_IMPL"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("'fast'"));
    }
    unsetenv("SHARDLINE_LINEAR_IMPL");
    // The failed first use must not leave the dispatcher without kernels.
    EXPECT_EQ(SelectedProvider("LinearForward"), kDefaultProvider);
    const Tensor x = RandomTensor({3, 4}, DType::kFloat64, Device::CPU(), 1, "x");
    const Tensor w = RandomTensor({2, 4}, DType::kFloat64, Device::CPU(), 1, "w");
    EXPECT_TRUE(ValuesMatch(LinearForward(x, w),
                            RefLinearForward(x.ToDoubleVector(), w.ToDoubleVector(), nullptr, 3, 2, 4),
                            DType::kFloat64));
}

TEST(EnvironmentTest, BadEmbeddingBagChoiceIsReportedAndAGoodOneIsReadOnce) {
    setenv("SHARDLINE_EMBEDDING_BAG", "fused", 1);
    try {
        (void)GetEmbeddingBagImpl();
        FAIL() << "SHARDLINE_EMBEDDING_BAG=fused was accepted";
    } catch (const Error& e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("SHARDLINE_EMBEDDING_BAG"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("expected one of auto, gemm, gather, got 'fused'"));
    }
    setenv("SHARDLINE_EMBEDDING_BAG", "gather", 1);
    EXPECT_EQ(GetEmbeddingBagImpl(), EmbeddingBagImpl::kGather);
    // Read once: a later change of the environment changes nothing; SetEmbeddingBagImpl does.
    setenv("SHARDLINE_EMBEDDING_BAG", "gemm", 1);
    EXPECT_EQ(GetEmbeddingBagImpl(), EmbeddingBagImpl::kGather);
    unsetenv("SHARDLINE_EMBEDDING_BAG");
    SetEmbeddingBagImpl(EmbeddingBagImpl::kGemm);
    EXPECT_EQ(GetEmbeddingBagImpl(), EmbeddingBagImpl::kGemm);
}

} // namespace
} // namespace shardline::kernels
