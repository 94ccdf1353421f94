#pragma once

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline {

/// Counter-based random values: element e of a tensor named `name` gets a value that is a pure function of
/// (seed, name, e's *global* row-major index), computed with Philox-4x32-10 and exactly rounded arithmetic, so
/// CPU and CUDA produce identical bits and a shard of a tensor holds exactly the values of the same elements of
/// the full tensor, whatever the sharding or the device.
enum class RandomDistribution : std::uint8_t {
    kUniform, ///< uniform in [a, b)
    kNormal,  ///< mean a, standard deviation b; Irwin-Hall sum of 4 uniforms (bounded at ±3.46 σ)
    kInteger, ///< integers uniform in [a, b] (a, b integral): exact in every dtype for |x| ≤ 256
};

struct RandomSpec {
    std::uint64_t seed = 0;
    std::string_view name;
    RandomDistribution distribution = RandomDistribution::kNormal;
    double a = 0.0;
    double b = 1.0;
};

/// Fills a whole tensor: its row-major index is the global index.
void FillRandom(Tensor& tensor, const RandomSpec& spec);

/// Fills the shard `tensor` of a global tensor of `global_shape`, whose element (i0, i1, ...) is the global
/// element (i0 + global_offset[0], i1 + global_offset[1], ...).
void FillRandomShard(Tensor& tensor, const RandomSpec& spec, const Shape& global_shape, const Shape& global_offset);

/// The FNV-1a 64-bit hash used to turn a tensor name into the Philox key.
std::uint64_t HashName(std::string_view name);

} // namespace shardline
