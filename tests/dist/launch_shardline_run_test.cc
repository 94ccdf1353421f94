// shardline-run: the mpirun command line it builds, the environment reaching every rank, and a missing mpirun.

#include <chrono>
#include <string>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "process.h"

namespace shardline::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr auto kDeadline = std::chrono::seconds(60);

TEST(ShardlineRunTest, DryRunPrintsMpirunWithTheFlagsOfACpuRun) {
    const auto r =
        RunProcess({SHARDLINE_RUN_EXE, "-n", "3", "--cpu", "--timeout", "30", "--dry-run", "--", "/bin/echo", "a b"},
                   {"SHARDLINE_TEST_VALUE=1", "NCCL_NVLS_ENABLE=0"}, kDeadline);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("mpirun -n 3 --bind-to none"));
    EXPECT_THAT(r.output, HasSubstr("--oversubscribe"));
    EXPECT_THAT(r.output, HasSubstr("--timeout 30"));
    EXPECT_THAT(r.output, HasSubstr("-x SHARDLINE_BACKEND=cpu"));
    EXPECT_THAT(r.output, HasSubstr("-x SHARDLINE_TEST_VALUE"));
    EXPECT_THAT(r.output, HasSubstr("-x NCCL_NVLS_ENABLE"));
    EXPECT_THAT(r.output, HasSubstr("/bin/echo 'a b'"));
    if (geteuid() == 0) {
        EXPECT_THAT(r.output, HasSubstr("--allow-run-as-root"));
    } else {
        EXPECT_THAT(r.output, Not(HasSubstr("--allow-run-as-root")));
    }
}

TEST(ShardlineRunTest, EveryRankSeesTheCallersShardlineAndNcclVariables) {
    const auto r =
        RunProcess({SHARDLINE_RUN_EXE, "-n", "2", "--cpu", "--timeout", "60", "--", SHARDLINE_DIST_HELPER_EXE, "env"},
                   {"SHARDLINE_TEST_VALUE=hello world", "NCCL_TEST_VALUE=42", "NCCL_NVLS_ENABLE=0"}, kDeadline);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (int rank = 0; rank < 2; ++rank) {
        EXPECT_THAT(r.output, HasSubstr(fmt::format("rank {}/2 SHARDLINE_TEST_VALUE=hello world NCCL_TEST_VALUE=42 "
                                                    "NCCL_NVLS_ENABLE=0 SHARDLINE_BACKEND=cpu backend=mpi",
                                                    rank)))
            << r.output;
    }
}

TEST(ShardlineRunTest, ProgramExitCodeIsTheJobsExitCode) {
    const auto ok = RunProcess({SHARDLINE_RUN_EXE, "-n", "2", "--cpu", "--", "/bin/true"}, {}, kDeadline);
    EXPECT_EQ(ok.exit_code, 0) << ok.output;
    const auto bad = RunProcess({SHARDLINE_RUN_EXE, "-n", "2", "--cpu", "--", "/bin/false"}, {}, kDeadline);
    EXPECT_NE(bad.exit_code, 0) << bad.output;
}

TEST(ShardlineRunTest, MissingMpirunExitsWith127AndSaysSo) {
    const auto r = RunProcess({SHARDLINE_RUN_EXE, "-n", "2", "--", "/bin/true"},
                              {"SHARDLINE_MPIRUN=/nonexistent/mpirun"}, kDeadline);
    EXPECT_EQ(r.exit_code, 127) << r.output;
    EXPECT_THAT(r.output, HasSubstr("mpirun not found"));
}

TEST(ShardlineRunTest, MissingCommandIsAUsageError) {
    const auto r = RunProcess({SHARDLINE_RUN_EXE, "-n", "2"}, {}, kDeadline);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.output, HasSubstr("command"));
}

} // namespace
} // namespace shardline::testing
