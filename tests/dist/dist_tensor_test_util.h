#pragma once

// Helpers of the DeviceMesh / DistTensor tests: the world of the MPI-aware test main, full tensors from the
// counter-based RNG, value comparisons.

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/variable.h>
#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/launch/bootstrap.h>
#include <shardline/spmd/layout.h>

#include "dist_test.h"

// The cuda executables skip (on every rank alike) when the job has no GPU per rank; the cpu ones always run.
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
#define SHARDLINE_DIST_TENSOR_TEST_BACKEND() SHARDLINE_DIST_REQUIRE_CUDA()
#else
#define SHARDLINE_DIST_TENSOR_TEST_BACKEND()                                                                           \
    do {                                                                                                               \
    } while (0)
#endif

namespace shardline::dist_test {

// The names every dist test file spells: `using namespace dist_test;` brings them in with the helpers below.
using autograd::Variable;
using comm::CollectiveKind;
using comm::DeviceMesh;
using dist::DistTensor;

inline launch::Environment &Env() { return testing::DistEnv(); }
inline comm::Communicator &World() { return Env().world(); }
/// Where this rank's tensors live (cuda:<local rank> for the NCCL variant, cpu for MPI).
inline Device TestDevice() { return Env().device(); }

/// A full tensor of integers in [-8, 8] (exact sums in fp32), the same on every rank: a pure function of
/// (seed, name, element index).
inline Tensor RandomFull(const Shape &shape, std::string_view name, DType dtype = DType::kFloat32,
                         std::uint64_t seed = 2024) {
    Tensor t = Tensor::Empty(shape, dtype, TestDevice());
    FillRandom(t,
               RandomSpec{.seed = seed, .name = name, .distribution = RandomDistribution::kInteger, .a = -8, .b = 8});
    return t;
}

/// "S(0),R" -> a Layout of a rank-`tensor_rank` tensor (one placement per mesh dim).
inline spmd::Layout ParsePlacements(std::string_view text, int tensor_rank) {
    std::vector<spmd::Placement> placements;
    std::size_t start = 0;
    while (start <= text.size()) {
        const std::size_t comma = text.find(',', start);
        const std::size_t end = comma == std::string_view::npos ? text.size() : comma;
        placements.push_back(spmd::Placement::Parse(text.substr(start, end - start)));
        if (comma == std::string_view::npos) {
            break;
        }
        start = comma + 1;
    }
    return spmd::Layout::FromPlacements(placements, tensor_rank);
}

/// `got` against `want`, shape first, then element by element: `differ(g, w)` true fails at that element.
template <class Differ>::testing::AssertionResult CompareValues(const Tensor &got, const Tensor &want, Differ differ) {
    if (got.shape() != want.shape()) {
        return ::testing::AssertionFailure()
               << "shape " << ShapeToString(got.shape()) << " != expected " << ShapeToString(want.shape());
    }
    const std::vector<double> g = got.ToDoubleVector();
    const std::vector<double> w = want.ToDoubleVector();
    for (std::size_t i = 0; i < g.size(); ++i) {
        if (differ(g[i], w[i])) {
            return ::testing::AssertionFailure() << "element " << i << " of " << ShapeToString(got.shape()) << ": "
                                                 << g[i] << " != expected " << w[i];
        }
    }
    return ::testing::AssertionSuccess();
}

/// Bitwise equality of two tensors' values (shape first).
inline ::testing::AssertionResult SameValues(const Tensor &got, const Tensor &want) {
    return CompareValues(got, want, [](double g, double w) { return g != w; });
}

/// Equality within fp32 rounding (relative 1e-6) for values that went through a reduction.
inline ::testing::AssertionResult CloseValues(const Tensor &got, const Tensor &want, double rtol = 1e-6) {
    return CompareValues(got, want,
                         [rtol](double g, double w) { return std::abs(g - w) > rtol * std::max(1.0, std::abs(w)); });
}

} // namespace shardline::dist_test
