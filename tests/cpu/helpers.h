#pragma once

// Small helpers shared by the CPU test files: dtype-parameterised suites and value checks against the float64
// references of tests/common/reference.h.

#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include <shardline/core/dtype.h>
#include <shardline/core/tensor.h>

#include "reference.h"

namespace shardline {
/// gtest prints DType parameters by name.
inline void PrintTo(DType dtype, std::ostream* os) { *os << DTypeName(dtype); }
} // namespace shardline

namespace shardline::testing {

/// The CPU kernel dtypes.
inline auto CpuDTypes() {
    return ::testing::Values(DType::kFloat32, DType::kFloat64);
}

/// "float32" / "float64" as the parameter's test name.
inline std::string DTypeParamName(const ::testing::TestParamInfo<DType> &info) {
    return std::string(DTypeName(info.param));
}

/// actual (any dtype, read back as float64) against a float64 reference with the dtype's relative tolerance
/// scaled by `rtol_scale` (for results that chain several rounded steps).
inline ::testing::AssertionResult ValuesMatch(const Values &actual, const Values &expected, DType dtype,
                                              double rtol_scale = 1.0) {
    const std::string diff = CompareValues(actual, expected, RelativeTolerance(dtype) * rtol_scale);
    if (diff.empty()) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << diff;
}

inline ::testing::AssertionResult ValuesMatch(const Tensor &actual, const Values &expected, DType dtype,
                                              double rtol_scale = 1.0) {
    return ValuesMatch(actual.ToDoubleVector(), expected, dtype, rtol_scale);
}

/// Σ|v|: a random test operand must not be all zeros (a test on zeros cannot fail).
inline double AbsSum(const Values &v) {
    double s = 0.0;
    for (double x : v) {
        s += x < 0 ? -x : x;
    }
    return s;
}

} // namespace shardline::testing
