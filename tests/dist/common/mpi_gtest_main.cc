// The main of every dist test executable (one process per rank, started by mpiexec).
//
// - MPI starts first, so the ranks can agree on the backend (SHARDLINE_DIST_TEST_BACKEND: cpu or cuda) before the
//   launch::Environment binds GPUs: a cuda executable with fewer GPUs than local ranks runs on the CPU world and every
//   test that calls SHARDLINE_DIST_REQUIRE_CUDA() skips, on every rank alike.
// - Only rank 0 prints gtest's progress; every rank prints its own failures, prefixed "[rank r/N]".
// - After each test the ranks agree on the outcome over the host world: a test that failed on one rank fails on all
//   (naming the ranks), and a skip taken on some ranks only is a failure. The agreement waits longer than a
//   collective's timeout, so a rank stuck in a collective whose peer failed early still reaches it.
// - Every rank exits non-zero when any test failed on any rank.

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <shardline/config.h>
#include <shardline/core/device.h>
#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>

#include "dist_test.h"

#ifndef SHARDLINE_DIST_TEST_BACKEND_CUDA
#define SHARDLINE_DIST_TEST_BACKEND_CUDA 0
#endif

namespace shardline::testing {
namespace {

launch::Environment *g_env = nullptr;
std::string g_cuda_skip_reason = "this test executable runs the CPU (MPI) backend";

std::string RankPrefix() { return fmt::format("[rank {}/{}]", g_env->rank(), g_env->world_size()); }

// Rank 0 forwards gtest's default printer; every rank prints its own failures with a rank prefix.
class RankPrinter : public ::testing::EmptyTestEventListener {
public:
    RankPrinter(::testing::TestEventListener *inner, bool rank0) : inner_(inner), rank0_(rank0) {}
    ~RankPrinter() override { delete inner_; }

    void OnTestProgramStart(const ::testing::UnitTest &u) override { Forward(&Listener::OnTestProgramStart, u); }
    void OnTestIterationStart(const ::testing::UnitTest &u, int i) override {
        if (rank0_) {
            inner_->OnTestIterationStart(u, i);
        }
    }
    void OnEnvironmentsSetUpStart(const ::testing::UnitTest &u) override {
        Forward(&Listener::OnEnvironmentsSetUpStart, u);
    }
    void OnEnvironmentsSetUpEnd(const ::testing::UnitTest &u) override {
        Forward(&Listener::OnEnvironmentsSetUpEnd, u);
    }
    void OnTestSuiteStart(const ::testing::TestSuite &s) override {
        if (rank0_) {
            inner_->OnTestSuiteStart(s);
        }
    }
    void OnTestStart(const ::testing::TestInfo &t) override {
        if (rank0_) {
            inner_->OnTestStart(t);
        }
    }
    void OnTestPartResult(const ::testing::TestPartResult &r) override {
        if (r.type() == ::testing::TestPartResult::kSuccess || (r.skipped() && !rank0_)) {
            return;
        }
        const std::string where =
            r.file_name() != nullptr ? fmt::format("{}:{}: ", r.file_name(), r.line_number()) : std::string();
        std::printf("%s %s%s\n%s\n", RankPrefix().c_str(), where.c_str(), r.skipped() ? "Skipped" : "Failure",
                    r.message());
        std::fflush(stdout);
    }
    void OnTestEnd(const ::testing::TestInfo &t) override {
        if (rank0_) {
            inner_->OnTestEnd(t);
        } else if (t.result()->Failed()) {
            std::printf("%s [  FAILED  ] %s.%s\n", RankPrefix().c_str(), t.test_suite_name(), t.name());
            std::fflush(stdout);
        }
    }
    void OnTestSuiteEnd(const ::testing::TestSuite &s) override {
        if (rank0_) {
            inner_->OnTestSuiteEnd(s);
        }
    }
    void OnEnvironmentsTearDownStart(const ::testing::UnitTest &u) override {
        Forward(&Listener::OnEnvironmentsTearDownStart, u);
    }
    void OnEnvironmentsTearDownEnd(const ::testing::UnitTest &u) override {
        Forward(&Listener::OnEnvironmentsTearDownEnd, u);
    }
    void OnTestIterationEnd(const ::testing::UnitTest &u, int i) override {
        if (rank0_) {
            inner_->OnTestIterationEnd(u, i);
        }
    }
    void OnTestProgramEnd(const ::testing::UnitTest &u) override { Forward(&Listener::OnTestProgramEnd, u); }

private:
    using Listener = ::testing::TestEventListener;
    void Forward(void (Listener::*method)(const ::testing::UnitTest &), const ::testing::UnitTest &u) {
        if (rank0_) {
            (inner_->*method)(u);
        }
    }
    ::testing::TestEventListener *inner_;
    bool rank0_;
};

// Appended after the printer, so gtest calls its OnTestEnd first (end events run in reverse order) and a failure it
// adds is seen by the printer (gtest allows listeners to raise failures outside OnTestPartResult).
class FailureAgreement : public ::testing::EmptyTestEventListener {
public:
    void OnTestEnd(const ::testing::TestInfo &t) override {
        enum : int { kPassed = 0, kFailed = 1, kSkipped = 2 };
        const int mine = t.result()->Failed() ? kFailed : (t.result()->Skipped() ? kSkipped : kPassed);
        std::vector<double> all(static_cast<std::size_t>(g_env->world_size()));
        try {
            // Longer than a collective's timeout: a rank stuck in a collective that a failed peer never joined gets
            // its CommError first, then arrives here.
            const auto timeout = comm::CommTimeout();
            comm::SetCommTimeout(2 * timeout + std::chrono::seconds(10));
            Tensor in = Tensor::FromVector({static_cast<double>(mine)}, {1});
            Tensor out =
                Tensor::FromBlob(all.data(), {static_cast<std::int64_t>(all.size())}, DType::kFloat64, Device::CPU());
            auto work = g_env->host_world().AllGather(in, out);
            comm::SetCommTimeout(timeout);
            work->Wait();
        } catch (const std::exception &e) {
            std::fprintf(stderr, "%s the ranks could not agree on the result of %s.%s: %s\n", RankPrefix().c_str(),
                         t.test_suite_name(), t.name(), e.what());
            std::fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        std::vector<int> failed;
        std::vector<int> skipped;
        for (int r = 0; r < g_env->world_size(); ++r) {
            if (static_cast<int>(all[r]) == kFailed) {
                failed.push_back(r);
            } else if (static_cast<int>(all[r]) == kSkipped) {
                skipped.push_back(r);
            }
        }
        if (!failed.empty() && mine != kFailed) {
            ADD_FAILURE() << "failed on rank(s) " << fmt::format("{}", fmt::join(failed, ","))
                          << " (see their messages)";
        } else if (failed.empty() && !skipped.empty() && static_cast<int>(skipped.size()) != g_env->world_size()) {
            ADD_FAILURE() << "skipped on rank(s) " << fmt::format("{}", fmt::join(skipped, ","))
                          << " only: a skip must be decided alike on every rank";
        }
    }
};

} // namespace

launch::Environment &DistEnv() { return *g_env; }
const std::string &CudaSkipReason() { return g_cuda_skip_reason; }

} // namespace shardline::testing

int main(int argc, char **argv) {
    using namespace shardline;
    ::testing::InitGoogleTest(&argc, argv);
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    launch::BackendChoice backend = launch::BackendChoice::kCpu;
#if SHARDLINE_DIST_TEST_BACKEND_CUDA
    {
        MPI_Comm node = MPI_COMM_NULL;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        int local_size = 1;
        MPI_Comm_size(node, &local_size);
        MPI_Comm_free(&node);
        const int gpus = CudaDeviceCount();
        int ok = (SHARDLINE_WITH_NCCL && gpus >= local_size) ? 1 : 0;
        int all_ok = 0;
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (all_ok != 0) {
            backend = launch::BackendChoice::kCuda;
            shardline::testing::g_cuda_skip_reason.clear();
        } else {
            shardline::testing::g_cuda_skip_reason =
                SHARDLINE_WITH_NCCL
                    ? fmt::format("needs one GPU per rank: {} ranks, but a node has fewer GPUs (this node: {} "
                                  "ranks, {} GPUs)",
                                  size, local_size, gpus)
                    : std::string("this build has no NCCL backend");
        }
    }
#endif

    std::unique_ptr<launch::Environment> env;
    try {
        env = std::make_unique<launch::Environment>(&argc, &argv, launch::BootstrapOptions{.backend = backend});
    } catch (const std::exception &e) {
        std::fprintf(stderr, "[rank %d/%d] launch::Environment failed: %s\n", rank, size, e.what());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    shardline::testing::g_env = env.get();

    auto &listeners = ::testing::UnitTest::GetInstance()->listeners();
    ::testing::TestEventListener *printer = listeners.Release(listeners.default_result_printer());
    listeners.Append(new shardline::testing::RankPrinter(printer, rank == 0));
    listeners.Append(new shardline::testing::FailureAgreement);

    const int local = RUN_ALL_TESTS();
    int any = local != 0 ? 1 : 0;
    int failed = 0;
    MPI_Allreduce(&any, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    shardline::testing::g_env = nullptr;
    env.reset();
    MPI_Finalize();
    return failed != 0 ? 1 : 0;
}
