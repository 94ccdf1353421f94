#pragma once

// Shared by the dist suite: the process's launch::Environment (created by mpi_gtest_main.cc before any test) and
// helpers that build every rank's data from the counter-based RNG, so each rank can compute any collective's result
// locally.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/launch/bootstrap.h>

namespace shardline::testing {

/// The environment mpi_gtest_main.cc created (MPI world of this job).
launch::Environment &DistEnv();

/// Empty when the CUDA backend runs on every rank of this job; otherwise why not — the same text on every rank, so
/// a test that skips skips everywhere.
const std::string &CudaSkipReason();

/// Rank `r`'s `n` input elements: integers in [-8, 8] (exact sums in float32 and float64) drawn from the
/// counter-based RNG with name "x" and seed 1000·salt + r.
inline Tensor RankInput(int r, std::int64_t n, DType dtype, std::uint64_t salt = 0) {
    Tensor t = Tensor::Empty({n}, dtype);
    if (n > 0) {
        FillRandom(t, RandomSpec{.seed = 1000 * salt + static_cast<std::uint64_t>(r),
                                 .name = "x",
                                 .distribution = RandomDistribution::kInteger,
                                 .a = -8,
                                 .b = 8});
    }
    return t;
}

inline std::vector<double> RankValues(int r, std::int64_t n, DType dtype, std::uint64_t salt = 0) {
    return RankInput(r, n, dtype, salt).ToDoubleVector();
}

} // namespace shardline::testing

/// Skips (on every rank alike) when the CUDA backend is not available to the whole job.
#define SHARDLINE_DIST_REQUIRE_CUDA()                                                                                  \
    do {                                                                                                               \
        if (!::shardline::testing::CudaSkipReason().empty()) {                                                         \
            GTEST_SKIP() << ::shardline::testing::CudaSkipReason();                                                    \
        }                                                                                                              \
    } while (0)
