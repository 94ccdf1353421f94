// launch::Environment on the CPU: rank, size, local rank, device, world communicators.

#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <shardline/core/error.h>
#include <shardline/launch/bootstrap.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

TEST(BootstrapTest, EnvironmentMatchesMpiAndOpenMpiVariables) {
    auto &env = DistEnv();
    int rank = -1;
    int size = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    EXPECT_EQ(env.rank(), rank);
    EXPECT_EQ(env.world_size(), size);
    EXPECT_EQ(ProcessRank(), rank);
    EXPECT_EQ(ProcessWorldSize(), size);
    if (const char *lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"); lr != nullptr) {
        EXPECT_EQ(env.local_rank(), std::atoi(lr));
    }
    EXPECT_GE(env.local_rank(), 0);
    EXPECT_LT(env.local_rank(), size);
    EXPECT_EQ(&launch::Environment::Get(), &env);
}

TEST(BootstrapTest, CpuBackendGivesMpiWorldAndHostWorld) {
    auto &env = DistEnv();
    EXPECT_EQ(env.device(), Device::CPU());
    EXPECT_EQ(env.world().backend(), "mpi");
    EXPECT_EQ(env.world().name(), "world");
    EXPECT_EQ(env.world().size(), env.world_size());
    EXPECT_EQ(env.world().rank(), env.rank());
    EXPECT_EQ(env.host_world().backend(), "mpi");
    EXPECT_EQ(env.host_world().name(), "host world");
    EXPECT_NE(&env.world(), &env.host_world());
}

TEST(BootstrapTest, ASecondEnvironmentIsRejected) {
    int argc = 0;
    char **argv = nullptr;
    try {
        launch::Environment second(&argc, &argv);
        ADD_FAILURE() << "a second Environment was created";
    } catch (const Error &e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("one Environment per process"));
    }
}

TEST(BootstrapTest, ErrorsCarryTheRankPrefix) {
    auto &env = DistEnv();
    if (env.world_size() < 2) {
        GTEST_SKIP() << "needs 2 ranks";
    }
    try {
        SHARDLINE_THROW(Error, "Probe", "value {}", 1);
    } catch (const Error &e) {
        EXPECT_THAT(e.what(), ::testing::StartsWith(fmt::format("[rank {}/{}]", env.rank(), env.world_size())));
    }
}

} // namespace
} // namespace shardline::testing
