// CUDA tensors: host/device round trips, device-side dtype casts against the host conversion, strided copies.

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

/// A host tensor of `dtype` with normal values of a wide spread plus values that probe the conversions: fp16
/// overflow (65520 rounds to inf, 65519 to 65504), fp16 subnormals, ±inf, -0, a round-to-even tie in bf16 (1 + 2^-8)
/// and in fp16 (1 + 2^-11), and magnitudes near the float limit.
Tensor ProbeTensor(DType dtype, std::int64_t n, std::uint64_t seed) {
    Values v =
        RandomTensor(Shape{n}, DType::kFloat64, Device::CPU(), seed, "probe", RandomDistribution::kNormal, 0.0, 300.0)
            .ToDoubleVector();
    const double inf = std::numeric_limits<double>::infinity();
    const double specials[] = {65519.0, 65520.0,      -65520.0,      3.0e-5,           -1.0e-7, 6.0e-8,  inf,     -inf,
                               -0.0,    1.0 + 0x1p-8, 1.0 + 0x1p-11, 1.0 + 3 * 0x1p-9, 3.0e38,  -3.3e38, 1.0e-30, 0.1};
    for (std::size_t i = 0; i < std::size(specials) && i < v.size(); ++i) {
        v[i * 3] = specials[i];
    }
    return Tensor::FromVector(v, Shape{n}, DType::kFloat64).To(dtype);
}

using CudaTensorTest = CudaParamTest<DType>;

TEST_P(CudaTensorTest, HostDeviceRoundTripKeepsTheBytes) {
    const DType dtype = GetParam();
    for (const Shape& shape : {Shape{1}, Shape{33, 17}, Shape{2, 3, 1001}, Shape{0, 5}}) {
        SCOPED_TRACE(ShapeToString(shape));
        Tensor host = Tensor::Empty(shape, dtype, Device::CPU());
        FillRandom(host, RandomSpec{.seed = 3, .name = "roundtrip"});
        const Tensor device = host.To(Gpu());
        EXPECT_TRUE(device.device().is_cuda());
        EXPECT_EQ(device.shape(), shape);
        EXPECT_EQ(device.dtype(), dtype);
        const Tensor back = device.To(Device::CPU());
        ASSERT_EQ(back.nbytes(), host.nbytes());
        if (host.nbytes() > 0) {
            EXPECT_EQ(std::memcmp(back.data(), host.data(), host.nbytes()), 0);
            EXPECT_GT(AbsSum(back.ToDoubleVector()), 0.0);
        }
    }
}

TEST_P(CudaTensorTest, CopyFromMovesBytesBetweenAnyTwoDevices) {
    const DType dtype = GetParam();
    const Shape shape{17, 65};
    Tensor host = Tensor::Empty(shape, dtype, Device::CPU());
    FillRandom(host, RandomSpec{.seed = 4, .name = "copyfrom"});

    Tensor device = Tensor::Empty(shape, dtype, Gpu());
    device.CopyFrom(host); // host → device
    Tensor device2 = Tensor::Full(shape, 5.0, dtype, Gpu());
    device2.CopyFrom(device); // device → device
    Tensor host2 = Tensor::Zeros(shape, dtype, Device::CPU());
    host2.CopyFrom(device2); // device → host
    EXPECT_EQ(std::memcmp(host2.data(), host.data(), host.nbytes()), 0);
    EXPECT_NE(device.data(), device2.data());

    // A deep copy on the same device does not share storage with its source.
    Tensor clone = device.To(Gpu());
    EXPECT_NE(clone.data(), device.data());
    device.Fill(0.0);
    EXPECT_EQ(HostBytes(clone), HostBytes(device2));

    // Copying from a transposed (strided) CUDA view writes the view's row-major order.
    Tensor square_host = Tensor::Empty(Shape{9, 9}, dtype, Device::CPU());
    FillRandom(square_host, RandomSpec{.seed = 5, .name = "square"});
    const Tensor square = square_host.To(Gpu());
    Tensor transposed = Tensor::Empty(Shape{9, 9}, dtype, Gpu());
    transposed.CopyFrom(square.Transpose(0, 1));
    const Values src = square_host.ToDoubleVector();
    const Values dst = transposed.ToDoubleVector();
    for (int i = 0; i < 9; ++i) {
        for (int j = 0; j < 9; ++j) {
            ASSERT_EQ(dst[i * 9 + j], src[j * 9 + i]) << "at (" << i << ", " << j << ")";
        }
    }
}

TEST_P(CudaTensorTest, DeviceCastMatchesHostConversionBitForBit) {
    const DType src_dtype = GetParam();
    for (const DType dst_dtype : kAllDTypes) {
        if (dst_dtype == src_dtype) {
            continue;
        }
        SCOPED_TRACE(::testing::Message() << DTypeName(src_dtype) << " -> " << DTypeName(dst_dtype));
        const Tensor host = ProbeTensor(src_dtype, 4099, 11);
        const Tensor expected = host.To(dst_dtype);
        const Tensor device = host.To(Gpu()).To(dst_dtype);
        EXPECT_TRUE(device.device().is_cuda());
        ASSERT_EQ(device.dtype(), dst_dtype);
        const std::vector<unsigned char> got = HostBytes(device);
        ASSERT_EQ(got.size(), expected.nbytes());
        if (std::memcmp(got.data(), expected.data(), expected.nbytes()) != 0) {
            const Values g = device.ToDoubleVector();
            const Values e = expected.ToDoubleVector();
            const Values s = host.ToDoubleVector();
            for (std::size_t i = 0; i < g.size(); ++i) {
                const bool same = (std::isnan(g[i]) && std::isnan(e[i])) ||
                                  (g[i] == e[i] && std::signbit(g[i]) == std::signbit(e[i]));
                if (!same) {
                    ADD_FAILURE() << "element " << i << ": source " << s[i] << ", device cast " << g[i]
                                  << ", host conversion " << e[i];
                    break;
                }
            }
            ADD_FAILURE() << "device cast and host conversion differ in their bytes";
        }
    }
}

// Full() on the kernel dtypes (a float64 device fill is documented to go through float, unlike the host's).
using CudaFillValueTest = CudaParamTest<DType>;

TEST_P(CudaFillValueTest, FullOnDeviceMatchesHost) {
    const DType dtype = GetParam();
    for (double value : {0.1, -3.75, 1.0e5, 0.0}) {
        const Tensor device = Tensor::Full(Shape{7, 13}, value, dtype, Gpu());
        const Tensor host = Tensor::Full(Shape{7, 13}, value, dtype, Device::CPU());
        EXPECT_EQ(HostBytes(device), HostBytes(host)) << "value " << value;
    }
}

TEST_P(CudaTensorTest, TransposeContiguousOnDeviceMatchesHost) {
    const DType dtype = GetParam();
    const Shape shape{5, 7, 9};
    Tensor host = Tensor::Empty(shape, dtype, Device::CPU());
    FillRandom(host, RandomSpec{.seed = 6, .name = "transpose"});
    const Tensor device = host.To(Gpu());
    const Values in = host.ToDoubleVector();

    for (const auto& [d0, d1] : {std::pair{0, 2}, std::pair{1, 2}, std::pair{0, 1}, std::pair{-1, -3}}) {
        SCOPED_TRACE(::testing::Message() << "Transpose(" << d0 << ", " << d1 << ")");
        const Tensor view = device.Transpose(d0, d1);
        EXPECT_FALSE(view.is_contiguous());
        const Tensor out = view.Contiguous();
        EXPECT_TRUE(out.is_contiguous());
        EXPECT_TRUE(out.device().is_cuda());
        EXPECT_EQ(out.shape(), host.Transpose(d0, d1).shape());
        // Same bytes as the host's strided copy ...
        EXPECT_EQ(HostBytes(out), HostBytes(host.Transpose(d0, d1).Contiguous()));
        // ... and the right elements: out[i0, i1, i2] = in[the same index with dims d0 and d1 swapped].
        const Values got = out.ToDoubleVector();
        const Shape& os = out.shape();
        const int a = d0 < 0 ? d0 + 3 : d0;
        const int b = d1 < 0 ? d1 + 3 : d1;
        for (std::int64_t i0 = 0; i0 < os[0]; ++i0) {
            for (std::int64_t i1 = 0; i1 < os[1]; ++i1) {
                for (std::int64_t i2 = 0; i2 < os[2]; ++i2) {
                    std::int64_t idx[3] = {i0, i1, i2};
                    std::swap(idx[a], idx[b]);
                    const double want = in[(idx[0] * shape[1] + idx[1]) * shape[2] + idx[2]];
                    ASSERT_EQ(got[(i0 * os[1] + i1) * os[2] + i2], want) << "at " << i0 << "," << i1 << "," << i2;
                }
            }
        }
    }
    // A transposed view feeds Contiguous() then a dtype cast on the device.
    const Tensor cast = device.Transpose(0, 2).To(DType::kFloat32);
    EXPECT_EQ(HostBytes(cast), HostBytes(host.Transpose(0, 2).Contiguous().To(DType::kFloat32)));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaFillValueTest, CudaDTypes(), DTypeParamName);
INSTANTIATE_TEST_SUITE_P(DType, CudaTensorTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64),
                         DTypeParamName);

} // namespace
} // namespace shardline::testing
