#include <regex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

namespace shardline {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

/// Restores the single-process rank even when an assertion fails mid-test.
class RankGuard {
public:
    RankGuard(int rank, int world_size) { SetProcessRank(rank, world_size); }
    ~RankGuard() { SetProcessRank(0, 1); }
};

/// Throws through SHARDLINE_CHECK and returns the message and the line of the check.
std::string FailingCheckMessage(int *line) {
    try {
        const int expected = 3;
        const int got = 5;
        *line = __LINE__ + 1;
        SHARDLINE_CHECK(got == expected, "MyOp", "count must be {}, got {}", expected, got);
    } catch (const Error &e) {
        return e.what();
    }
    return {};
}

TEST(ErrorTest, CheckMessageReadsFileLineOpExpectation) {
    int line = 0;
    const std::string msg = FailingCheckMessage(&line);
    EXPECT_EQ(msg, "core_error_test.cc:" + std::to_string(line) + " MyOp: count must be 3, got 5");
}

TEST(ErrorTest, CheckAsThrowsTheRequestedSubclass) {
    EXPECT_THROW(SHARDLINE_CHECK_AS(ShapeError, false, "Op", "x"), ShapeError);
    EXPECT_THROW(SHARDLINE_CHECK_AS(DTypeError, false, "Op", "x"), DTypeError);
    EXPECT_THROW(SHARDLINE_CHECK_AS(DeviceError, false, "Op", "x"), DeviceError);
    EXPECT_THROW(SHARDLINE_CHECK_AS(CommError, false, "Op", "x"), Error);
    EXPECT_NO_THROW(SHARDLINE_CHECK_AS(ShapeError, true, "Op", "x"));
    static_assert(std::is_base_of_v<std::runtime_error, Error>);
    static_assert(std::is_base_of_v<Error, ShapeError> && std::is_base_of_v<Error, DTypeError> &&
                  std::is_base_of_v<Error, DeviceError> && std::is_base_of_v<Error, CudaError> &&
                  std::is_base_of_v<Error, CommError>);
}

TEST(ErrorTest, MessageCarriesRankPrefixInADistributedJob) {
    {
        RankGuard guard(1, 4);
        EXPECT_EQ(ProcessRank(), 1);
        EXPECT_EQ(ProcessWorldSize(), 4);
        int line = 0;
        const std::string msg = FailingCheckMessage(&line);
        EXPECT_EQ(msg, "[rank 1/4] core_error_test.cc:" + std::to_string(line) + " MyOp: count must be 3, got 5");
    }
    EXPECT_EQ(ProcessRank(), 0);
    EXPECT_EQ(ProcessWorldSize(), 1);
    int line = 0;
    EXPECT_THAT(FailingCheckMessage(&line), StartsWith("core_error_test.cc:"));
}

TEST(ErrorTest, LibraryErrorNamesItsSourceOpAndValues) {
    try {
        Tensor::Empty({2, -3}, DType::kFloat32);
        FAIL() << "Tensor::Empty accepted a negative dim";
    } catch (const ShapeError &e) {
        const std::string msg = e.what();
        EXPECT_TRUE(std::regex_search(msg, std::regex(R"(^tensor\.cc:[0-9]+ Tensor::Empty: )"))) << msg;
        EXPECT_THAT(msg, HasSubstr("[2, -3]"));
        EXPECT_THAT(msg, HasSubstr(">= 0"));
    }
}

TEST(ErrorTest, BaseNameStripsDirectories) {
    EXPECT_EQ(detail::BaseName("/a/b/c.cc"), "c.cc");
    EXPECT_EQ(detail::BaseName("c.cc"), "c.cc");
}

} // namespace
} // namespace shardline
