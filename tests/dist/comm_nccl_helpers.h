#pragma once

// Shared by the NCCL communicator tests: the world communicator (NCCL when every rank has its GPU, else the tests
// skip on every rank with the reason), counter-RNG inputs that every rank can rebuild for every other rank, and the
// float64 expectations.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/launch/bootstrap.h>

#include "dist_test.h"

namespace shardline::testing {

inline launch::Environment& Env() { return DistEnv(); }

/// Why the NCCL tests cannot run here, or "" when they can: the dist main's agreement (one GPU per local rank on every
/// node, NCCL built), so every rank skips together and no rank waits in a collective for a skipped peer.
inline std::string NcclSkipReason() {
    if (!CudaSkipReason().empty()) {
        return CudaSkipReason();
    }
    if (Env().world().backend() != "nccl") {
        return fmt::format("the world communicator is '{}', not NCCL", Env().world().backend());
    }
    return {};
}

#define SHARDLINE_SKIP_WITHOUT_NCCL()                                                                                  \
    do {                                                                                                               \
        if (const std::string reason = ::shardline::testing::NcclSkipReason(); !reason.empty()) {                      \
            GTEST_SKIP() << reason;                                                                                    \
        }                                                                                                              \
    } while (0)

inline Device MyGpu() { return Env().device(); }

/// Integers in [-8, 8]: exact in float32, float16 and bfloat16, and so are their sums, maxima, minima over ≤ 4 ranks
/// and their averages over 2 or 4 ranks (multiples of 1/4 below 32).
inline RandomSpec IntegerSpec(const std::string& name) {
    return RandomSpec{.seed = 2026, .name = name, .distribution = RandomDistribution::kInteger, .a = -8, .b = 8};
}

/// Rank r's input named `what`: the same values on whichever rank builds it.
inline std::vector<double> InputValues(const std::string& what, int r, std::int64_t n) {
    const std::string name = fmt::format("{}/rank{}", what, r);
    Tensor t = Tensor::Empty({n}, DType::kFloat64, Device::CPU());
    FillRandom(t, IntegerSpec(name));
    return t.ToDoubleVector();
}

/// The same values as InputValues, as a `dtype` tensor on this rank's GPU.
inline Tensor InputTensor(const std::string& what, int r, std::int64_t n, DType dtype) {
    const std::string name = fmt::format("{}/rank{}", what, r);
    Tensor t = Tensor::Empty({n}, dtype, MyGpu());
    FillRandom(t, IntegerSpec(name));
    return t;
}

inline double Combine(comm::ReduceOp op, const std::vector<double>& values) {
    double acc = values.front();
    for (std::size_t i = 1; i < values.size(); ++i) {
        switch (op) {
        case comm::ReduceOp::kSum:
        case comm::ReduceOp::kAvg:
            acc += values[i];
            break;
        case comm::ReduceOp::kMax:
            acc = std::max(acc, values[i]);
            break;
        case comm::ReduceOp::kMin:
            acc = std::min(acc, values[i]);
            break;
        }
    }
    return op == comm::ReduceOp::kAvg ? acc / static_cast<double>(values.size()) : acc;
}

/// Element-wise op over the ranks' inputs of `what` (each n long).
inline std::vector<double> ReduceOverRanks(const std::string& what, int size, std::int64_t n, comm::ReduceOp op,
                                           std::int64_t offset = 0, std::int64_t total = -1) {
    std::vector<std::vector<double>> inputs;
    for (int r = 0; r < size; ++r) {
        inputs.push_back(InputValues(what, r, total < 0 ? n : total));
    }
    std::vector<double> out(static_cast<std::size_t>(n));
    std::vector<double> column(static_cast<std::size_t>(size));
    for (std::int64_t e = 0; e < n; ++e) {
        for (int r = 0; r < size; ++r) {
            column[r] = inputs[r][static_cast<std::size_t>(offset + e)];
        }
        out[static_cast<std::size_t>(e)] = Combine(op, column);
    }
    return out;
}

/// Exact equality (the inputs make every result exact); the first mismatches are printed with their index.
inline ::testing::AssertionResult SameValues(const std::vector<double>& actual, const std::vector<double>& expected) {
    if (actual.size() != expected.size()) {
        return ::testing::AssertionFailure() << "size " << actual.size() << " != expected " << expected.size();
    }
    int shown = 0;
    std::int64_t bad = 0;
    std::string first;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        if (actual[i] != expected[i]) {
            ++bad;
            if (shown++ < 5) {
                first += fmt::format(" [{}] {} != {}", i, actual[i], expected[i]);
            }
        }
    }
    if (bad == 0) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << bad << " of " << actual.size() << " elements differ:" << first;
}

inline std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) {
    return std::string(DTypeName(info.param));
}

} // namespace shardline::testing
