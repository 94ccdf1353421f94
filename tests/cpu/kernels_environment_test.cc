// The dispatcher reads SHARDLINE_PROVIDER / SHARDLINE_LINEAR_IMPL at its first use. This file is its own executable
// with one test, so that first use really happens inside the test.

#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
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

} // namespace
} // namespace shardline::kernels
