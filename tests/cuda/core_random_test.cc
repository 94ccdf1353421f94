// Counter-based random fill on CUDA: the same bits as on the CPU, for whole tensors and for shards.

#include <cstring>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

struct FillCase {
    RandomDistribution distribution;
    double a;
    double b;
    const char* label;
};

constexpr FillCase kFillCases[] = {
    {RandomDistribution::kNormal, 0.25, 3.0, "normal"},
    {RandomDistribution::kUniform, -2.0, 5.0, "uniform"},
    {RandomDistribution::kInteger, -8.0, 8.0, "integer"},
};

using CudaRandomFillTest = CudaParamTest<DType>;

TEST_P(CudaRandomFillTest, CudaFillIsBitIdenticalToCpuFill) {
    const DType dtype = GetParam();
    // Odd sizes (no multiple of a vector width or block) and one tensor large enough for a multi-block grid.
    for (const Shape& shape : {Shape{37, 129}, Shape{3, 5, 7, 11}, Shape{1}, Shape{(1 << 20) + 3}}) {
        for (const FillCase& c : kFillCases) {
            SCOPED_TRACE(::testing::Message() << c.label << " " << ShapeToString(shape));
            const RandomSpec spec{
                .seed = 1234, .name = "layers.3.mlp.weight", .distribution = c.distribution, .a = c.a, .b = c.b};
            Tensor host = Tensor::Empty(shape, dtype, Device::CPU());
            FillRandom(host, spec);
            Tensor device = Tensor::Empty(shape, dtype, Gpu());
            FillRandom(device, spec);
            const std::vector<unsigned char> device_bytes = HostBytes(device);
            ASSERT_EQ(device_bytes.size(), host.nbytes());
            EXPECT_EQ(std::memcmp(device_bytes.data(), host.data(), host.nbytes()), 0)
                << "CUDA and CPU random fills differ";
            // Values, not zeros: the fill must produce varied non-zero data.
            const Values values = device.ToDoubleVector();
            EXPECT_GT(AbsSum(values), 0.0);
            if (values.size() > 100) {
                EXPECT_GT(std::set<double>(values.begin(), values.end()).size(), 10u);
            }
        }
    }
}

TEST_P(CudaRandomFillTest, CudaShardHoldsTheGlobalTensorsValues) {
    const DType dtype = GetParam();
    const Shape global{64, 96};
    const Shape shard_shape{16, 40};
    const Shape offset{32, 50};
    const RandomSpec spec{
        .seed = 7, .name = "shard.me", .distribution = RandomDistribution::kNormal, .a = 0.0, .b = 1.0};
    Tensor full_host = Tensor::Empty(global, dtype, Device::CPU());
    FillRandom(full_host, spec);
    Tensor full_device = Tensor::Empty(global, dtype, Gpu());
    FillRandom(full_device, spec);
    Tensor shard_device = Tensor::Empty(shard_shape, dtype, Gpu());
    FillRandomShard(shard_device, spec, global, offset);
    Tensor shard_host = Tensor::Empty(shard_shape, dtype, Device::CPU());
    FillRandomShard(shard_host, spec, global, offset);

    const std::size_t es = ElementSize(dtype);
    const std::vector<unsigned char> shard_bytes = HostBytes(shard_device);
    const std::vector<unsigned char> full_device_bytes = HostBytes(full_device);
    ASSERT_EQ(std::memcmp(shard_bytes.data(), shard_host.data(), shard_host.nbytes()), 0)
        << "CUDA and CPU shard fills differ";
    const auto* full_host_bytes = static_cast<const unsigned char*>(full_host.data());
    for (std::int64_t r = 0; r < shard_shape[0]; ++r) {
        const std::size_t src = static_cast<std::size_t>((r + offset[0]) * global[1] + offset[1]) * es;
        const std::size_t dst = static_cast<std::size_t>(r * shard_shape[1]) * es;
        const std::size_t row_bytes = static_cast<std::size_t>(shard_shape[1]) * es;
        ASSERT_EQ(std::memcmp(shard_bytes.data() + dst, full_host_bytes + src, row_bytes), 0)
            << "shard row " << r << " differs from the CPU-filled global tensor";
        ASSERT_EQ(std::memcmp(shard_bytes.data() + dst, full_device_bytes.data() + src, row_bytes), 0)
            << "shard row " << r << " differs from the CUDA-filled global tensor";
    }
    EXPECT_GT(AbsSum(shard_device.ToDoubleVector()), 0.0);
}

TEST_P(CudaRandomFillTest, SeedAndNameChangeTheValues) {
    const DType dtype = GetParam();
    auto fill = [&](std::uint64_t seed, std::string_view name) {
        Tensor t = Tensor::Empty(Shape{256}, dtype, Gpu());
        FillRandom(t, RandomSpec{.seed = seed, .name = name});
        return HostBytes(t);
    };
    const auto base = fill(1, "w");
    EXPECT_EQ(base, fill(1, "w"));
    EXPECT_NE(base, fill(2, "w"));
    EXPECT_NE(base, fill(1, "v"));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaRandomFillTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
