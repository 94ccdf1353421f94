// Faults, each with its observed outcome: a job started with shardline-run on the CPU (MPI backend) where one rank
//   exits mid-step               → the job ends non-zero within 5 s of the exit;
//   skips a collective / SIGSTOPs → the healthy ranks raise CommError (op, seq, count, group, elapsed) within the
//                                   timeout + 5 s (SHARDLINE_COMM_TIMEOUT_S=5), and the job ends non-zero;
//   passes another count under SHARDLINE_COMM_CHECK=1 → every rank reports the mismatch.
// Times are measured from the faulty rank's "FAULT_AT <unix ms>" line to the exit of shardline-run (mpirun).
// The same faults run over NCCL, one rank per GPU (NcclFaultJobTest; skipped when the host has fewer GPUs than
// ranks): a SIGKILLed rank ends the job within 5 s, a SIGSTOPped or silent one makes the others' watchdog raise
// CommError within the timeout + 5 s.

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <shardline/core/device.h>

#include "process.h"

namespace shardline::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct FaultRun {
    ProcessResult result;
    double seconds_after_fault = -1; ///< job end minus the fault's time stamp
    int faulty_pid = -1;
};

enum class Backend { kCpu, kGpu };

FaultRun RunFault(int np, const std::string &scenario, std::vector<std::string> env, Backend backend = Backend::kCpu) {
    env.emplace_back("SHARDLINE_LOG_LEVEL=warn");
    env.emplace_back("NCCL_NVLS_ENABLE=0");
    FaultRun run;
    // mpirun --timeout 60 is the last resort; the deadline here kills everything if even that fails.
    std::vector<std::string> argv = {SHARDLINE_RUN_EXE, "-n", std::to_string(np)};
    if (backend == Backend::kCpu) {
        argv.emplace_back("--cpu");
    }
    for (const char *a : {"--timeout", "60", "--", SHARDLINE_DIST_HELPER_EXE}) {
        argv.emplace_back(a);
    }
    argv.push_back(scenario);
    run.result = RunProcess(argv, env, std::chrono::seconds(80));
    std::smatch m;
    if (std::regex_search(run.result.output, m, std::regex("FAULT_AT ([0-9]+) PID ([0-9]+)"))) {
        run.seconds_after_fault = static_cast<double>(run.result.end_unix_ms - std::stoll(m[1].str())) / 1000.0;
        run.faulty_pid = std::stoi(m[2].str());
    }
    std::printf("[ measured ] %s %s np=%d: exit %d, %.2f s after the fault, %.2f s in all\n",
                backend == Backend::kCpu ? "mpi" : "nccl", scenario.c_str(), np, run.result.exit_code,
                run.seconds_after_fault, run.result.seconds);
    return run;
}

// The stopped rank must not outlive the job; if it does, it is reported and killed (it is this test's own child).
void ExpectFaultyRankGone(const FaultRun &run) {
    if (run.faulty_pid <= 0) {
        return;
    }
    bool alive = false;
    for (int i = 0; i < 50 && (alive = kill(run.faulty_pid, 0) == 0); ++i) {
        usleep(100 * 1000);
    }
    if (alive) {
        kill(run.faulty_pid, SIGKILL);
    }
    EXPECT_FALSE(alive) << "the faulty rank (pid " << run.faulty_pid << ") outlived the job by 5 s";
}

// The healthy ranks' CommError: op, sequence number, count, group and elapsed time of a 5 s timeout — from the MPI
// backend's wait, or over NCCL from the watchdog that aborted the communicator.
void ExpectTimeoutReport(const FaultRun &run, int np, Backend backend) {
    const std::string &out = run.result.output;
    const std::regex report =
        backend == Backend::kCpu
            ? std::regex(
                  "\\[rank ([0-9]+)/([0-9]+)\\] mpi_communicator\\.cc:[0-9]+ MPI all_reduce: seq 2 \\(count 1024 "
                  "float32\\) on group 'world' \\([0-9]+ ranks\\) did not complete within the timeout of "
                  "5\\.0 s \\(elapsed ([0-9.]+) s\\)")
            : std::regex("\\[rank ([0-9]+)/([0-9]+)\\][^\\n]*all_reduce\\(sum\\) #[0-9]+ \\(count 1024, float32\\) on "
                         "group 'world' \\(rank [0-9]+ of [0-9]+\\) did not finish within 5\\.0 s[^\\n]*elapsed "
                         "([0-9.]+) s");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, report)) << out;
    EXPECT_NE(std::stoi(m[1].str()), np - 1) << "the report must come from a healthy rank";
    const double elapsed = std::stod(m[3].str());
    EXPECT_GE(elapsed, 5.0);
    EXPECT_LT(elapsed, 10.0);
    EXPECT_THAT(out, Not(HasSubstr("all_reduce completed")));
}

/// The job ended by itself (no harness timeout) with a non-zero exit code.
void ExpectJobFailed(const FaultRun &run) {
    EXPECT_FALSE(run.result.timed_out) << run.result.output;
    EXPECT_NE(run.result.exit_code, 0) << run.result.output;
}

/// A rank that never joins the collective (skips it or is stopped): the job fails, the healthy ranks raise CommError
/// after the 5 s timeout (ExpectTimeoutReport) and the faulty rank does not outlive the job.
void ExpectTimeoutFault(const FaultRun &run, int np, Backend backend = Backend::kCpu) {
    ExpectJobFailed(run);
    ASSERT_GE(run.seconds_after_fault, 0) << run.result.output;
    EXPECT_GE(run.seconds_after_fault, 4.5) << run.result.output;
    EXPECT_LT(run.seconds_after_fault, 10.0) << run.result.output;
    ExpectTimeoutReport(run, np, backend);
    ExpectFaultyRankGone(run);
}

class FaultTest : public ::testing::TestWithParam<int> {};

TEST_P(FaultTest, RankExitingMidStepEndsTheJobNonZeroWithinFiveSeconds) {
    const int np = GetParam();
    const auto run = RunFault(np, "exit", {"SHARDLINE_COMM_TIMEOUT_S=60"});
    ExpectJobFailed(run);
    ASSERT_GE(run.seconds_after_fault, 0) << run.result.output;
    EXPECT_LT(run.seconds_after_fault, 5.0) << run.result.output;
    EXPECT_THAT(run.result.output, Not(HasSubstr("all_reduce completed")));
}

TEST_P(FaultTest, RankSkippingACollectiveMakesTheOthersRaiseCommErrorAfterTheTimeout) {
    const int np = GetParam();
    const auto run = RunFault(np, "skip", {"SHARDLINE_COMM_TIMEOUT_S=5"});
    ExpectTimeoutFault(run, np);
}

TEST_P(FaultTest, StoppedRankMakesTheOthersRaiseCommErrorAfterTheTimeout) {
    const int np = GetParam();
    const auto run = RunFault(np, "stop", {"SHARDLINE_COMM_TIMEOUT_S=5"});
    ExpectTimeoutFault(run, np);
}

TEST_P(FaultTest, CountMismatchUnderTheDebugCheckIsReportedByEveryRank) {
    const int np = GetParam();
    const auto run = RunFault(np, "mismatch", {"SHARDLINE_COMM_CHECK=1", "SHARDLINE_COMM_TIMEOUT_S=30"});
    ExpectJobFailed(run);
    const std::string &out = run.result.output;
    for (int r = 0; r < np; ++r) {
        EXPECT_THAT(out, HasSubstr(fmt::format("CAUGHT [rank {}/{}]", r, np))) << out;
    }
    EXPECT_THAT(out, HasSubstr(fmt::format("rank {}: all_reduce seq 2 count 1025 float32 op sum", np - 1)));
    EXPECT_THAT(out, HasSubstr("rank 0: all_reduce seq 2 count 1024 float32 op sum"));
    EXPECT_THAT(out, HasSubstr(fmt::format("mismatching ranks: {}", np - 1)));
    EXPECT_THAT(out, Not(HasSubstr("NO ERROR")));
    EXPECT_LT(run.result.seconds, 30.0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FaultTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int> &info) { return fmt::format("np{}", info.param); });

class NcclFaultJobTest : public ::testing::TestWithParam<int> {
protected:
    void SetUp() override {
        if (CudaDeviceCount() < GetParam()) {
            GTEST_SKIP() << "needs " << GetParam() << " GPUs (one rank per GPU), " << CudaDeviceCount() << " visible";
        }
    }
};

TEST_P(NcclFaultJobTest, KilledRankEndsTheJobNonZeroWithinFiveSeconds) {
    const int np = GetParam();
    const auto run = RunFault(np, "kill", {"SHARDLINE_COMM_TIMEOUT_S=60"}, Backend::kGpu);
    ExpectJobFailed(run);
    ASSERT_GE(run.seconds_after_fault, 0) << run.result.output;
    EXPECT_LT(run.seconds_after_fault, 5.0) << run.result.output;
    EXPECT_THAT(run.result.output, Not(HasSubstr("all_reduce completed")));
}

TEST_P(NcclFaultJobTest, SilentRankMakesTheOthersRaiseCommErrorAfterTheTimeout) {
    const int np = GetParam();
    ExpectTimeoutFault(RunFault(np, "skip", {"SHARDLINE_COMM_TIMEOUT_S=5"}, Backend::kGpu), np, Backend::kGpu);
}

TEST_P(NcclFaultJobTest, StoppedRankMakesTheOthersRaiseCommErrorAfterTheTimeout) {
    const int np = GetParam();
    ExpectTimeoutFault(RunFault(np, "stop", {"SHARDLINE_COMM_TIMEOUT_S=5"}, Backend::kGpu), np, Backend::kGpu);
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclFaultJobTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int> &info) { return fmt::format("np{}", info.param); });

} // namespace
} // namespace shardline::testing
