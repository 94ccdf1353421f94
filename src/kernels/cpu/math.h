#pragma once

// GELU and its derivative in double precision, shared by the CPU epilogues and elementwise kernels.

#include <cmath>

namespace shardline::kernels::cpu {

inline constexpr double kSqrt2OverPi = 0.7978845608028654;
inline constexpr double kGeluCoeff = 0.044715;
inline constexpr double kInvSqrt2 = 0.7071067811865476;
inline constexpr double kInvSqrt2Pi = 0.3989422804014327;

/// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
inline double GeluTanh(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x))); }

/// d/dx of GeluTanh.
inline double GeluTanhGrad(double x) {
    const double t = std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
    const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}

/// 0.5·x·(1 + erf(x/√2)).
inline double GeluErf(double x) { return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2)); }

/// d/dx of GeluErf: Φ(x) + x·φ(x).
inline double GeluErfGrad(double x) {
    return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

} // namespace shardline::kernels::cpu
