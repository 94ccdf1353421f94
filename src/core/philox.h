#pragma once

// Counter-based random numbers shared by the CPU and CUDA fills. Every step is exactly rounded IEEE arithmetic
// (integer ops, one exact sum, one multiply, explicit fma), so host and device produce identical bits.

#include <cmath>
#include <cstdint>

#include <shardline/core/random.h>

#if defined(__CUDACC__)
#define SHARDLINE_HOST_DEVICE __host__ __device__
#else
#define SHARDLINE_HOST_DEVICE
#endif

namespace shardline::detail {

inline constexpr int kMaxRandomRank = 8;

/// Everything a fill needs, by value (it is passed to a CUDA kernel).
struct RandomKernelArgs {
    std::uint32_t key[2];
    RandomDistribution distribution;
    double a;
    double b;
    int rank;
    std::int64_t local_shape[kMaxRandomRank];
    std::int64_t global_stride[kMaxRandomRank]; ///< row-major strides of the global shape
    std::int64_t global_offset[kMaxRandomRank];
};

struct Philox4 {
    std::uint32_t v[4];
};

/// Philox-4x32-10 (Salmon et al., SC'11) on counter (lo, hi, 0, 0).
SHARDLINE_HOST_DEVICE inline Philox4 Philox4x32(std::uint64_t counter, std::uint32_t k0, std::uint32_t k1) {
    std::uint32_t c0 = static_cast<std::uint32_t>(counter);
    std::uint32_t c1 = static_cast<std::uint32_t>(counter >> 32);
    std::uint32_t c2 = 0;
    std::uint32_t c3 = 0;
    for (int round = 0; round < 10; ++round) {
        const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c0;
        const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c2;
        const std::uint32_t n0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ k0;
        const std::uint32_t n2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ k1;
        c0 = n0;
        c1 = static_cast<std::uint32_t>(p1);
        c2 = n2;
        c3 = static_cast<std::uint32_t>(p0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return Philox4{{c0, c1, c2, c3}};
}

/// Correctly rounded a·b + c on both sides (never contracted differently).
SHARDLINE_HOST_DEVICE inline double ExactFma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
    return ::fma(a, b, c);
#else
    return std::fma(a, b, c);
#endif
}

/// A uniform in [0, 1) with 24 random bits: exact in float and double.
SHARDLINE_HOST_DEVICE inline double Unit24(std::uint32_t bits) { return static_cast<double>(bits >> 8) * 0x1p-24; }

/// The value of the element with global row-major index `global_index`.
SHARDLINE_HOST_DEVICE inline double RandomValueAt(const RandomKernelArgs& args, std::uint64_t global_index) {
    const Philox4 r = Philox4x32(global_index, args.key[0], args.key[1]);
    switch (args.distribution) {
    case RandomDistribution::kUniform:
        return ExactFma(args.b - args.a, Unit24(r.v[0]), args.a);
    case RandomDistribution::kNormal: {
        // Irwin–Hall: the sum of 4 uniforms has mean 2 and variance 1/3. The sum is exact in double.
        const double s = Unit24(r.v[0]) + Unit24(r.v[1]) + Unit24(r.v[2]) + Unit24(r.v[3]);
        const double z = (s - 2.0) * 1.7320508075688772;
        return ExactFma(z, args.b, args.a);
    }
    case RandomDistribution::kInteger: {
        const auto lo = static_cast<std::int64_t>(args.a);
        const auto span = static_cast<std::uint64_t>(static_cast<std::int64_t>(args.b) - lo + 1);
        const std::uint64_t bits = (static_cast<std::uint64_t>(r.v[0]) << 32) | r.v[1];
        return static_cast<double>(lo + static_cast<std::int64_t>(bits % span));
    }
    }
    return 0.0;
}

/// The global index of the element with local row-major index `local_index`.
SHARDLINE_HOST_DEVICE inline std::uint64_t GlobalIndexOf(const RandomKernelArgs& args, std::int64_t local_index) {
    std::int64_t global = 0;
    for (int d = args.rank - 1; d >= 0; --d) {
        const std::int64_t i = local_index % args.local_shape[d];
        local_index /= args.local_shape[d];
        global += (i + args.global_offset[d]) * args.global_stride[d];
    }
    return static_cast<std::uint64_t>(global);
}

} // namespace shardline::detail
