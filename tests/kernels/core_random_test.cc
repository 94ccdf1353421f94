// The counter-based random fill: the host generator's distributions, hashes and shards (a value is a pure function
// of seed, name and global index), and on every device the same values for whole tensors and shards, bit for bit the
// host's on CUDA.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using ::testing::HasSubstr;

Tensor Fill(const Shape &shape, DType dtype, std::uint64_t seed, std::string_view name,
            RandomDistribution dist = RandomDistribution::kNormal, double a = 0.0, double b = 1.0) {
    return RandomTensor(shape, dtype, Device::CPU(), seed, name, dist, a, b);
}

bool SameBits(const Tensor &x, const Tensor &y) {
    return x.nbytes() == y.nbytes() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
}

/// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a row-major [.., n] matrix.
Values Slice(const Values &full, std::int64_t n, std::int64_t r0, std::int64_t rows, std::int64_t c0,
             std::int64_t cols) {
    Values out;
    for (std::int64_t r = r0; r < r0 + rows; ++r) {
        for (std::int64_t c = c0; c < c0 + cols; ++c) {
            out.push_back(full[r * n + c]);
        }
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------------------------
// The generator, on the host

TEST(RandomTest, SameSeedNameAndIndexGiveSameBits) {
    for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
        for (auto dist : {RandomDistribution::kNormal, RandomDistribution::kUniform, RandomDistribution::kInteger}) {
            const double b = dist == RandomDistribution::kInteger ? 8.0 : 1.0;
            const double a = dist == RandomDistribution::kInteger ? -8.0 : 0.0;
            const Tensor x = Fill({33, 17}, dtype, 7, "layer.weight", dist, a, b);
            const Tensor y = Fill({33, 17}, dtype, 7, "layer.weight", dist, a, b);
            EXPECT_TRUE(SameBits(x, y));
            EXPECT_GT(AbsSum(x.ToDoubleVector()), 0.0);
        }
    }
}

TEST(RandomTest, ValueDependsOnlyOnTheGlobalRowMajorIndex) {
    const Tensor matrix = Fill({6, 10}, DType::kFloat64, 3, "w");
    const Tensor flat = Fill({60}, DType::kFloat64, 3, "w");
    EXPECT_EQ(matrix.ToDoubleVector(), flat.ToDoubleVector());
}

TEST(RandomTest, RowShardEqualsTheSameRowsOfTheFullTensor) {
    const Shape global{10, 7};
    for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
        const Values full = Fill(global, dtype, 11, "col.weight").ToDoubleVector();
        for (std::int64_t r0 : {0, 3, 7}) {
            Tensor shard = Tensor::Empty({3, 7}, dtype);
            FillRandomShard(shard, RandomSpec{.seed = 11, .name = "col.weight"}, global, {r0, 0});
            EXPECT_EQ(shard.ToDoubleVector(), Slice(full, 7, r0, 3, 0, 7)) << "rows from " << r0;
        }
    }
}

TEST(RandomTest, ColumnShardEqualsTheSameColumnsOfTheFullTensor) {
    const Shape global{9, 8};
    for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
        const Values full =
            Fill(global, dtype, 5, "row.weight", RandomDistribution::kUniform, -0.5, 0.5).ToDoubleVector();
        for (std::int64_t c0 : {0, 2, 6}) {
            Tensor shard = Tensor::Empty({9, 2}, dtype);
            FillRandomShard(
                shard,
                RandomSpec{
                    .seed = 5, .name = "row.weight", .distribution = RandomDistribution::kUniform, .a = -0.5, .b = 0.5},
                global, {0, c0});
            EXPECT_EQ(shard.ToDoubleVector(), Slice(full, 8, 0, 9, c0, 2)) << "columns from " << c0;
        }
    }
}

TEST(RandomTest, BlockShardOfA3DTensorEqualsTheSameBlock) {
    const Shape global{4, 5, 6};
    const Values full = Fill(global, DType::kFloat64, 2, "t3").ToDoubleVector();
    Tensor shard = Tensor::Empty({2, 3, 2}, DType::kFloat64);
    FillRandomShard(shard, RandomSpec{.seed = 2, .name = "t3"}, global, {1, 2, 4});
    const Values sv = shard.ToDoubleVector();
    for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 3; ++j) {
            for (int k = 0; k < 2; ++k) {
                EXPECT_EQ(sv[(i * 3 + j) * 2 + k], full[((i + 1) * 5 + (j + 2)) * 6 + (k + 4)]);
            }
        }
    }
}

TEST(RandomTest, Float32FillIsTheFloat64FillRounded) {
    const Values f64 = Fill({1000}, DType::kFloat64, 9, "cast").ToDoubleVector();
    const Values f32 = Fill({1000}, DType::kFloat32, 9, "cast").ToDoubleVector();
    for (std::size_t i = 0; i < f64.size(); ++i) {
        ASSERT_EQ(f32[i], static_cast<double>(static_cast<float>(f64[i]))) << i;
    }
}

TEST(RandomTest, DifferentNamesOrSeedsGiveDifferentValues) {
    const Values base = Fill({1000}, DType::kFloat64, 1, "a").ToDoubleVector();
    const Values other_name = Fill({1000}, DType::kFloat64, 1, "b").ToDoubleVector();
    const Values other_seed = Fill({1000}, DType::kFloat64, 2, "a").ToDoubleVector();
    int same_name = 0;
    int same_seed = 0;
    for (std::size_t i = 0; i < base.size(); ++i) {
        same_name += base[i] == other_name[i];
        same_seed += base[i] == other_seed[i];
    }
    EXPECT_LT(same_name, 5);
    EXPECT_LT(same_seed, 5);
    EXPECT_NE(HashName("a"), HashName("b"));
}

TEST(RandomTest, HashNameIsFnv1a64) {
    EXPECT_EQ(HashName(""), 0xcbf29ce484222325ULL);
    EXPECT_EQ(HashName("a"), 0xaf63dc4c8601ec8cULL);
    EXPECT_EQ(HashName("foobar"), 0x85944171f73967e8ULL);
}

TEST(RandomTest, UniformStaysInItsHalfOpenRangeWithTheRightMean) {
    const Values v = Fill({100000}, DType::kFloat64, 21, "u", RandomDistribution::kUniform, -2.0, 3.0).ToDoubleVector();
    double sum = 0.0;
    for (double x : v) {
        ASSERT_GE(x, -2.0);
        ASSERT_LT(x, 3.0);
        sum += x;
    }
    // mean 0.5, sd 5/√12 ≈ 1.44: the standard error over 1e5 samples is ≈ 0.005.
    EXPECT_NEAR(sum / v.size(), 0.5, 0.025);
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    EXPECT_LT(*lo, -1.99);
    EXPECT_GT(*hi, 2.99);
}

TEST(RandomTest, IntegerIsIntegralInRangeAndHitsBothEnds) {
    const Values v = Fill({100000}, DType::kFloat32, 22, "i", RandomDistribution::kInteger, -3.0, 4.0).ToDoubleVector();
    std::map<int, int> counts;
    for (double x : v) {
        ASSERT_EQ(x, std::floor(x));
        ASSERT_GE(x, -3.0);
        ASSERT_LE(x, 4.0);
        ++counts[static_cast<int>(x)];
    }
    ASSERT_EQ(counts.size(), 8u);
    EXPECT_EQ(counts.begin()->first, -3);
    EXPECT_EQ(counts.rbegin()->first, 4);
    for (const auto &[value, count] : counts) {
        // 12500 expected per value; sd ≈ 105.
        EXPECT_NEAR(count, 12500, 600) << "value " << value;
    }
}

TEST(RandomTest, NormalHasMeanZeroAndUnitStdOverManySamples) {
    const Values v = Fill({100000}, DType::kFloat64, 23, "n").ToDoubleVector();
    double sum = 0.0;
    double sq = 0.0;
    double max_abs = 0.0;
    for (double x : v) {
        sum += x;
        sq += x * x;
        max_abs = std::max(max_abs, std::abs(x));
    }
    const double mean = sum / v.size();
    const double sd = std::sqrt(sq / v.size() - mean * mean);
    EXPECT_NEAR(mean, 0.0, 0.015);            // standard error 0.003
    EXPECT_NEAR(sd, 1.0, 0.01);               // standard error ≈ 0.002
    EXPECT_LE(max_abs, 2.0 * std::sqrt(3.0)); // Irwin-Hall of 4 is bounded at ±2√3
    EXPECT_GT(max_abs, 3.0);
}

TEST(RandomTest, NormalHonoursMeanAndStd) {
    const Values v = Fill({50000}, DType::kFloat64, 24, "n2", RandomDistribution::kNormal, 2.0, 0.5).ToDoubleVector();
    double sum = 0.0;
    double sq = 0.0;
    for (double x : v) {
        sum += x;
        sq += x * x;
    }
    const double mean = sum / v.size();
    EXPECT_NEAR(mean, 2.0, 0.01);
    EXPECT_NEAR(std::sqrt(sq / v.size() - mean * mean), 0.5, 0.01);
}

TEST(RandomTest, ShardOutsideTheGlobalShapeIsAShapeError) {
    Tensor shard = Tensor::Empty({3, 4}, DType::kFloat32);
    try {
        FillRandomShard(shard, RandomSpec{.seed = 1, .name = "w"}, {5, 4}, {3, 0});
        FAIL() << "accepted a shard past the end";
    } catch (const ShapeError &e) {
        const std::string msg = e.what();
        EXPECT_THAT(msg, HasSubstr("FillRandom"));
        EXPECT_THAT(msg, HasSubstr("does not fit global shape [5, 4]"));
    }
    EXPECT_THROW(FillRandomShard(shard, RandomSpec{.seed = 1, .name = "w"}, {5}, {0}), ShapeError);
}

TEST(RandomTest, IntegerBoundsMustBeIntegral) {
    Tensor t = Tensor::Empty({4}, DType::kFloat32);
    EXPECT_THROW(
        FillRandom(t, RandomSpec{.seed = 1, .name = "w", .distribution = RandomDistribution::kInteger, .a = 0.5}),
        Error);
}

// ---------------------------------------------------------------------------------------------------------------------
// Fills on every device

using RandomFillTest = DeviceTest<>;

TEST_P(RandomFillTest, ShardHoldsTheGlobalTensorsValues) {
    const Shape global{64, 96};
    const Shape shard_shape{16, 40};
    const Shape offset{32, 50};
    const RandomSpec spec{
        .seed = 7, .name = "shard.me", .distribution = RandomDistribution::kNormal, .a = 0.0, .b = 1.0};
    Tensor full_host = Tensor::Empty(global, dtype(), Device::CPU());
    FillRandom(full_host, spec);
    Tensor full_device = Tensor::Empty(global, dtype(), device());
    FillRandom(full_device, spec);
    Tensor shard_device = Tensor::Empty(shard_shape, dtype(), device());
    FillRandomShard(shard_device, spec, global, offset);
    Tensor shard_host = Tensor::Empty(shard_shape, dtype(), Device::CPU());
    FillRandomShard(shard_host, spec, global, offset);

    const std::size_t es = ElementSize(dtype());
    const std::vector<unsigned char> shard_bytes = HostBytes(shard_device);
    const std::vector<unsigned char> full_device_bytes = HostBytes(full_device);
    ASSERT_EQ(std::memcmp(shard_bytes.data(), shard_host.data(), shard_host.nbytes()), 0)
        << "device and host shard fills differ";
    const auto *full_host_bytes = static_cast<const unsigned char *>(full_host.data());
    for (std::int64_t r = 0; r < shard_shape[0]; ++r) {
        const std::size_t src = static_cast<std::size_t>((r + offset[0]) * global[1] + offset[1]) * es;
        const std::size_t dst = static_cast<std::size_t>(r * shard_shape[1]) * es;
        const std::size_t row_bytes = static_cast<std::size_t>(shard_shape[1]) * es;
        ASSERT_EQ(std::memcmp(shard_bytes.data() + dst, full_host_bytes + src, row_bytes), 0)
            << "shard row " << r << " differs from the host-filled global tensor";
        ASSERT_EQ(std::memcmp(shard_bytes.data() + dst, full_device_bytes.data() + src, row_bytes), 0)
            << "shard row " << r << " differs from the device-filled global tensor";
    }
    EXPECT_GT(AbsSum(shard_device.ToDoubleVector()), 0.0);
}

TEST_P(RandomFillTest, SeedAndNameChangeTheValues) {
    auto fill = [&](std::uint64_t seed, std::string_view name) {
        Tensor t = Tensor::Empty(Shape{256}, dtype(), device());
        FillRandom(t, RandomSpec{.seed = seed, .name = name});
        return HostBytes(t);
    };
    const auto base = fill(1, "w");
    EXPECT_EQ(base, fill(1, "w"));
    EXPECT_NE(base, fill(2, "w"));
    EXPECT_NE(base, fill(1, "v"));
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(RandomFillTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// CUDA: the device fill against the host's

struct FillCase {
    RandomDistribution distribution;
    double a;
    double b;
    const char *label;
};

constexpr FillCase kFillCases[] = {
    {RandomDistribution::kNormal, 0.25, 3.0, "normal"},
    {RandomDistribution::kUniform, -2.0, 5.0, "uniform"},
    {RandomDistribution::kInteger, -8.0, 8.0, "integer"},
};

using CudaRandomFillTest = DeviceTest<>;

TEST_P(CudaRandomFillTest, CudaFillIsBitIdenticalToCpuFill) {
    // Odd sizes (no multiple of a vector width or block) and one tensor large enough for a multi-block grid.
    for (const Shape &shape : {Shape{37, 129}, Shape{3, 5, 7, 11}, Shape{1}, Shape{(1 << 20) + 3}}) {
        for (const FillCase &c : kFillCases) {
            SCOPED_TRACE(::testing::Message() << c.label << " " << ShapeToString(shape));
            const RandomSpec spec{
                .seed = 1234, .name = "layers.3.mlp.weight", .distribution = c.distribution, .a = c.a, .b = c.b};
            Tensor host = Tensor::Empty(shape, dtype(), Device::CPU());
            FillRandom(host, spec);
            Tensor on_device = Tensor::Empty(shape, dtype(), device());
            FillRandom(on_device, spec);
            const std::vector<unsigned char> device_bytes = HostBytes(on_device);
            ASSERT_EQ(device_bytes.size(), host.nbytes());
            EXPECT_EQ(std::memcmp(device_bytes.data(), host.data(), host.nbytes()), 0)
                << "CUDA and CPU random fills differ";
            // Values, not zeros: the fill must produce varied non-zero data.
            const Values values = on_device.ToDoubleVector();
            EXPECT_GT(AbsSum(values), 0.0);
            if (values.size() > 100) {
                EXPECT_GT(std::set<double>(values.begin(), values.end()).size(), 10u);
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaRandomFillTest, DeviceDTypes(DeviceType::kCUDA), DeviceDTypeName);

} // namespace
} // namespace shardline::testing
