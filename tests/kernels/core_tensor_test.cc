// Tensors: the host API (shapes, strides, views, casts, copies, int64 ids, borrowed memory) and, on CUDA, host/device
// round trips, device-side dtype casts against the host conversion, fills and strided copies. These are one device's
// own behaviour each: a CUDA case compares the device with the host, which on the host alone could not fail.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------------------------------
// The host

TEST(TensorTest, EmptyIsContiguousAlignedWithRowMajorStrides) {
    const Tensor t = Tensor::Empty({2, 3, 4}, DType::kFloat32);
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
    EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
    EXPECT_EQ(t.rank(), 3);
    EXPECT_EQ(t.numel(), 24);
    EXPECT_EQ(t.nbytes(), 96u);
    EXPECT_EQ(t.size(-1), 4);
    EXPECT_EQ(t.size(0), 2);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.device(), Device::CPU());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
    EXPECT_EQ(t.ToString(), "Tensor[2, 3, 4] float32 cpu");
    EXPECT_FALSE(Tensor().defined());
    EXPECT_EQ(Tensor().ToString(), "Tensor(undefined)");
    EXPECT_THROW(t.size(3), ShapeError);
}

TEST(TensorTest, EveryFactoryGivesRowMajorStridesAndEdgeShapesToo) {
    EXPECT_EQ(Tensor().strides(), Shape{});
    const Tensor scalar = Tensor::Empty({}, DType::kFloat32);
    EXPECT_EQ(scalar.strides(), Shape{});
    EXPECT_TRUE(scalar.is_contiguous());
    const Tensor none = Tensor::Zeros({0, 3}, DType::kFloat32);
    EXPECT_EQ(none.strides(), (Shape{3, 1}));
    EXPECT_TRUE(none.is_contiguous());
    const Tensor full = Tensor::Full({2, 3}, 1.5, DType::kFloat32);
    EXPECT_EQ(full.strides(), (Shape{3, 1}));
    const Tensor v = Tensor::FromVector({1, 2, 3, 4, 5, 6}, {3, 2});
    EXPECT_EQ(v.strides(), (Shape{2, 1}));
    EXPECT_EQ(v.To(DType::kFloat32).strides(), (Shape{2, 1}));
    EXPECT_EQ(v.Clone().strides(), (Shape{2, 1}));
    // A transpose's contiguous copy is row-major in its own order, with the values moved.
    const Tensor tc = v.Transpose(0, 1).Clone();
    EXPECT_EQ(tc.strides(), (Shape{3, 1}));
    EXPECT_EQ(tc.ToDoubleVector(), (Values{1, 3, 5, 2, 4, 6}));
    std::vector<float> blob(6, 0.0f);
    const Tensor b = Tensor::FromBlob(blob.data(), {2, 3}, DType::kFloat32, Device::CPU());
    EXPECT_EQ(b.strides(), (Shape{3, 1}));
}

TEST(TensorTest, FullZerosAndFromVectorHoldTheirValues) {
    EXPECT_EQ(Tensor::Full({2, 2}, 1.5, DType::kFloat32).ToDoubleVector(), (Values{1.5, 1.5, 1.5, 1.5}));
    EXPECT_EQ(Tensor::Zeros({3}, DType::kFloat64).ToDoubleVector(), (Values{0, 0, 0}));
    const Tensor v = Tensor::FromVector({1, -2, 3.25, 4, 5, 6}, {2, 3}, DType::kFloat32);
    EXPECT_EQ(v.dtype(), DType::kFloat32);
    EXPECT_EQ(v.ToDoubleVector(), (Values{1, -2, 3.25, 4, 5, 6}));
    EXPECT_THROW(Tensor::FromVector({1, 2, 3}, {2, 2}), ShapeError);
}

TEST(TensorTest, ViewSharesStorageAndInfersOneDim) {
    Tensor t = RandomTensor({2, 3, 4}, DType::kFloat64, Device::CPU(), 1, "view");
    const Values before = t.ToDoubleVector();
    Tensor v = t.View({6, -1});
    EXPECT_EQ(v.shape(), (Shape{6, 4}));
    EXPECT_EQ(v.data(), t.data());
    EXPECT_EQ(v.ToDoubleVector(), before);
    v.data_as<double>()[5] = 42.0;
    EXPECT_EQ(t.data_as<double>()[5], 42.0);
    EXPECT_THROW(t.View({5, 5}), ShapeError);
    EXPECT_THROW(t.View({-1, -1}), ShapeError);
    EXPECT_THROW(t.View({7, -1}), ShapeError);
}

TEST(TensorTest, ToDTypeRoundsToNearestFloat32AndBack) {
    const Tensor x = RandomTensor({257}, DType::kFloat64, Device::CPU(), 4, "cast");
    const Tensor f = x.To(DType::kFloat32);
    EXPECT_EQ(f.dtype(), DType::kFloat32);
    const Values xv = x.ToDoubleVector();
    const Values fv = f.ToDoubleVector();
    int changed = 0;
    for (std::size_t i = 0; i < xv.size(); ++i) {
        EXPECT_EQ(fv[i], static_cast<double>(static_cast<float>(xv[i])));
        changed += fv[i] != xv[i];
    }
    EXPECT_GT(changed, 0); // the cast really rounded something
    EXPECT_EQ(f.To(DType::kFloat64).ToDoubleVector(), fv);
    // Same dtype: a deep copy.
    const Tensor same = x.To(DType::kFloat64);
    EXPECT_NE(same.data(), x.data());
    EXPECT_EQ(same.ToDoubleVector(), xv);
}

TEST(TensorTest, FromBlobWrapsCallerMemoryWithoutCopying) {
    std::vector<float> buffer = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
    Tensor t = Tensor::FromBlob(buffer.data(), {2, 3}, DType::kFloat32, Device::CPU());
    EXPECT_EQ(t.data(), buffer.data());
    EXPECT_EQ(t.ToDoubleVector(), (Values{1, 2, 3, 4, 5, 6}));
    t.data_as<float>()[4] = -7.f;
    EXPECT_EQ(buffer[4], -7.f);
    buffer[0] = 9.f;
    EXPECT_EQ(t.ToDoubleVector()[0], 9.0);
    { Tensor copy = t; } // dropping a borrowed tensor never frees the caller's memory
    EXPECT_EQ(buffer[1], 2.f);
}

TEST(TensorTest, DataAsRejectsTheWrongElementType) {
    const Tensor t = Tensor::Zeros({2}, DType::kFloat32);
    EXPECT_NE(t.data_as<float>(), nullptr);
    try {
        (void)t.data_as<double>();
        FAIL() << "data_as<double> accepted a float32 tensor";
    } catch (const DTypeError &e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("requested float64 but the tensor is float32"));
    }
}

TEST(TensorTest, RankZeroTensorHoldsOneElement) {
    Tensor s = Tensor::Full({}, 2.5, DType::kFloat64);
    EXPECT_EQ(s.rank(), 0);
    EXPECT_EQ(s.numel(), 1);
    EXPECT_TRUE(s.is_contiguous());
    EXPECT_EQ(s.ToDoubleVector(), (Values{2.5}));
}

TEST(TensorTest, Int64TensorHoldsIdsBeyondFloat32Precision) {
    // 2^40 + 1 and -(2^33 + 3) have no float32 representation: an int64 tensor must not round them.
    const Values ids = {0, 1, -7, 1099511627777.0, -8589934595.0, 31999};
    const Tensor t = Tensor::FromVector(ids, {2, 3}, DType::kInt64);
    EXPECT_EQ(t.dtype(), DType::kInt64);
    EXPECT_EQ(t.nbytes(), 48u);
    EXPECT_EQ(t.ToString(), "Tensor[2, 3] int64 cpu");
    EXPECT_EQ(t.ToDoubleVector(), ids);
    EXPECT_EQ(t.data_as<std::int64_t>()[3], (std::int64_t{1} << 40) + 1);
    EXPECT_EQ(t.data_as<std::int64_t>()[4], -((std::int64_t{1} << 33) + 3));
    EXPECT_THROW((void)t.data_as<double>(), DTypeError);

    EXPECT_EQ(Tensor::Zeros({3}, DType::kInt64).ToDoubleVector(), (Values{0, 0, 0}));
    EXPECT_EQ(Tensor::Full({2}, -5.0, DType::kInt64).ToDoubleVector(), (Values{-5, -5}));
    Tensor e = Tensor::Empty({4}, DType::kInt64);
    e.Fill(1e15);
    EXPECT_EQ(e.data_as<std::int64_t>()[2], std::int64_t{1000000000000000});
}

TEST(TensorTest, Int64CopiesViewsAndClonesKeepTheValues) {
    const Tensor t = Tensor::FromVector({3, -1, 4, 1, -5, 9}, {2, 3}, DType::kInt64);
    const Tensor v = t.View({3, -1});
    EXPECT_EQ(v.shape(), (Shape{3, 2}));
    EXPECT_EQ(v.data(), t.data());
    Tensor c = t.Clone();
    EXPECT_NE(c.data(), t.data());
    EXPECT_EQ(c.ToDoubleVector(), t.ToDoubleVector());
    Tensor dst = Tensor::Zeros({3, 2}, DType::kInt64);
    dst.CopyFrom(t.Transpose(0, 1)); // a strided int64 source is materialised element by element
    EXPECT_EQ(dst.ToDoubleVector(), (Values{3, 1, -1, -5, 4, 9}));
    EXPECT_EQ(t.To(Device::CPU()).ToDoubleVector(), t.ToDoubleVector());
    Tensor wrong = Tensor::Zeros({2, 3}, DType::kFloat64);
    EXPECT_THROW(wrong.CopyFrom(t), ShapeError); // no implicit conversion in a copy
}

TEST(TensorTest, Int64CastsTruncateTowardZeroAndRejectWhatCannotBeStored) {
    const Tensor f = Tensor::FromVector({2.7, -2.7, 0.5, -0.5, 1e12, -3.0}, {6}, DType::kFloat64);
    const Tensor i = f.To(DType::kInt64);
    EXPECT_EQ(i.dtype(), DType::kInt64);
    EXPECT_EQ(i.ToDoubleVector(), (Values{2, -2, 0, 0, 1e12, -3}));
    EXPECT_EQ(i.To(DType::kFloat64).ToDoubleVector(), (Values{2, -2, 0, 0, 1e12, -3}));
    // int64 → float32 rounds to the nearest float32 (through double, exact below 2^53).
    const Tensor big = Tensor::FromVector({16777217.0, -3.0}, {2}, DType::kInt64);
    EXPECT_EQ(big.To(DType::kFloat32).ToDoubleVector(), (Values{16777216.0, -3.0}));
    EXPECT_EQ(Tensor::FromVector({7.9f}, {1}, DType::kFloat32).To(DType::kInt64).ToDoubleVector(), (Values{7}));

    const auto message = [](const std::function<void()> &f) {
        try {
            f();
        } catch (const DTypeError &e) {
            return std::string(e.what());
        }
        return std::string("no DTypeError");
    };
    const double nan = std::nan("");
    EXPECT_THAT(message([&] { (void)Tensor::FromVector({1, nan}, {2}, DType::kFloat64).To(DType::kInt64); }),
                HasSubstr("cannot store nan as int64"));
    EXPECT_THAT(message([&] { (void)Tensor::Full({1}, INFINITY, DType::kInt64); }),
                HasSubstr("cannot store inf as int64"));
    EXPECT_THAT(message([&] { (void)Tensor::FromVector({9.3e18}, {1}, DType::kInt64); }),
                HasSubstr("expected a finite value in [-2^63, 2^63)"));
    // -2^63 itself is representable.
    EXPECT_EQ(Tensor::FromVector({-9223372036854775808.0}, {1}, DType::kInt64).data_as<std::int64_t>()[0],
              std::numeric_limits<std::int64_t>::min());
}

TEST(TensorTest, Int64RandomIntegersFillTheRequestedRange) {
    const Tensor labels =
        RandomTensor({1000}, DType::kInt64, Device::CPU(), 3, "labels", RandomDistribution::kInteger, -3, 40);
    const Values v = labels.ToDoubleVector();
    std::vector<int> seen(44, 0);
    for (double x : v) {
        ASSERT_GE(x, -3);
        ASSERT_LE(x, 40);
        ASSERT_EQ(x, std::floor(x));
        ++seen[static_cast<std::size_t>(x + 3)];
    }
    for (std::size_t k = 0; k < seen.size(); ++k) {
        EXPECT_GT(seen[k], 0) << "value " << static_cast<int>(k) - 3 << " never drawn";
    }
    // The same values as a float64 tensor of the same name and seed, truncated: the counter-based generator does
    // not depend on the dtype.
    const Tensor f =
        RandomTensor({1000}, DType::kFloat64, Device::CPU(), 3, "labels", RandomDistribution::kInteger, -3, 40);
    EXPECT_EQ(f.ToDoubleVector(), v);
}

TEST(TensorTest, HalfTensorCanBeAllocatedOnTheHost) {
    const Tensor h = Tensor::Empty({3, 2}, DType::kFloat16);
    EXPECT_EQ(h.nbytes(), 12u);
    EXPECT_EQ(h.ToString(), "Tensor[3, 2] float16 cpu");
}

// ---------------------------------------------------------------------------------------------------------------------
// Views, copies and clones on every device

using TensorOnDeviceTest = DeviceTest<>;

TEST_P(TensorOnDeviceTest, TransposeIsAStridedViewThatContiguousMaterialises) {
    const Tensor x = Random({3, 5}, dtype(), 2, "transpose");
    const Values xv = x.ToDoubleVector();
    ASSERT_GT(AbsSum(xv), 0.0);
    const Tensor t = x.Transpose(0, 1);
    EXPECT_EQ(t.shape(), (Shape{5, 3}));
    EXPECT_EQ(t.strides(), (Shape{1, 5}));
    EXPECT_FALSE(t.is_contiguous());
    EXPECT_EQ(t.data(), x.data());
    const Tensor c = t.Contiguous();
    EXPECT_TRUE(c.is_contiguous());
    EXPECT_EQ(c.device(), device());
    EXPECT_NE(c.data(), x.data());
    const Values cv = c.ToDoubleVector();
    for (int i = 0; i < 5; ++i) {
        for (int j = 0; j < 3; ++j) {
            EXPECT_EQ(cv[i * 3 + j], xv[j * 5 + i]);
        }
    }
    // ToDoubleVector of the strided view reads logical order too.
    EXPECT_EQ(t.ToDoubleVector(), cv);
    EXPECT_THROW(t.View({15}), ShapeError);
    EXPECT_EQ(x.Contiguous().data(), x.data()); // already contiguous: no copy
}

TEST_P(TensorOnDeviceTest, StridesFollowViewsCopiesAndTransposesBack) {
    // A contiguous tensor reports row-major strides; a transpose keeps its own, through copies; transposing back is
    // contiguous again (with the strides it carries), and views of it read the original values.
    const Tensor x = Random({2, 3, 4}, dtype(), 5, "strides");
    const Values xv = x.ToDoubleVector();
    ASSERT_GT(AbsSum(xv), 0.0);
    const Tensor copy = x; // NOLINT(performance-unnecessary-copy-initialization): a copy reports the same
    EXPECT_EQ(copy.strides(), (Shape{12, 4, 1}));
    EXPECT_TRUE(copy.is_contiguous());
    const Tensor t = x.Transpose(0, 2);
    const Tensor t_copy = t; // NOLINT(performance-unnecessary-copy-initialization)
    EXPECT_EQ(t_copy.shape(), (Shape{4, 3, 2}));
    EXPECT_EQ(t_copy.strides(), (Shape{1, 4, 12}));
    EXPECT_FALSE(t_copy.is_contiguous());
    const Tensor back = t_copy.Transpose(0, 2);
    EXPECT_EQ(back.strides(), (Shape{12, 4, 1}));
    EXPECT_TRUE(back.is_contiguous());
    EXPECT_EQ(back.data(), x.data());
    EXPECT_EQ(back.Contiguous().data(), x.data()); // contiguous: no copy
    const Tensor flat = back.View({6, 4});
    EXPECT_EQ(flat.strides(), (Shape{4, 1}));
    EXPECT_EQ(flat.ToDoubleVector(), xv);
    // A size-1 dim's stride does not matter: swapping it with its neighbour stays contiguous.
    const Tensor row = Random({1, 5}, dtype(), 6, "row");
    const Tensor col = row.Transpose(0, 1);
    EXPECT_EQ(col.shape(), (Shape{5, 1}));
    EXPECT_EQ(col.strides(), (Shape{1, 5})); // a transpose's own, though contiguous
    EXPECT_TRUE(col.is_contiguous());
    EXPECT_EQ(col.Contiguous().strides(), (Shape{1, 5})); // contiguous: the same tensor
    EXPECT_EQ(col.View({5}).strides(), (Shape{1}));
    EXPECT_EQ(col.View({5}).ToDoubleVector(), row.ToDoubleVector());
    // Transposing a dim with itself keeps the tensor as it was.
    const Tensor same = x.Transpose(1, 1);
    EXPECT_EQ(same.strides(), (Shape{12, 4, 1}));
    EXPECT_TRUE(same.is_contiguous());
    EXPECT_EQ(same.ToDoubleVector(), xv);
    // A view of a transpose's contiguous copy is row-major in the transposed order.
    const Tensor tc = t.Contiguous().View({4, 6});
    EXPECT_EQ(tc.strides(), (Shape{6, 1}));
    const Values tv = tc.ToDoubleVector();
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 3; ++j) {
            for (int k = 0; k < 2; ++k) {
                EXPECT_EQ(tv[static_cast<std::size_t>(i * 6 + j * 2 + k)],
                          xv[static_cast<std::size_t>(k * 12 + j * 4 + i)]);
            }
        }
    }
}

TEST_P(TensorOnDeviceTest, TransposeOfBatchedTensorSwapsInnerDims) {
    const Tensor x = Random({2, 3, 4}, dtype(), 3, "transpose3");
    const Values xv = x.ToDoubleVector();
    const Values tv = x.Transpose(-1, -2).Contiguous().ToDoubleVector();
    for (int b = 0; b < 2; ++b) {
        for (int i = 0; i < 4; ++i) {
            for (int j = 0; j < 3; ++j) {
                EXPECT_EQ(tv[b * 12 + i * 3 + j], xv[b * 12 + j * 4 + i]);
            }
        }
    }
}

TEST_P(TensorOnDeviceTest, CopyFromCopiesValuesAndRejectsMismatches) {
    const Tensor src = Random({4, 6}, dtype(), 5, "copy");
    Tensor dst = Tensor::Zeros({4, 6}, dtype(), device());
    dst.CopyFrom(src);
    EXPECT_EQ(dst.ToDoubleVector(), src.ToDoubleVector());
    EXPECT_NE(dst.data(), src.data());

    Tensor dst_t = Tensor::Zeros({6, 4}, dtype(), device());
    dst_t.CopyFrom(src.Transpose(0, 1)); // a strided source is materialised
    EXPECT_EQ(dst_t.ToDoubleVector(), src.Transpose(0, 1).Contiguous().ToDoubleVector());

    Tensor wrong_shape = Tensor::Zeros({6, 4}, dtype(), device());
    EXPECT_THROW(wrong_shape.CopyFrom(src), ShapeError);
    const DType other = dtype() == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32;
    Tensor wrong_dtype = Tensor::Zeros({4, 6}, other, device());
    EXPECT_THAT(MessageOf<ShapeError>([&] { wrong_dtype.CopyFrom(src); }),
                AllOf(HasSubstr("Tensor::CopyFrom"), HasSubstr(std::string(DTypeName(dtype()))),
                      HasSubstr(std::string(DTypeName(other)))));
}

TEST_P(TensorOnDeviceTest, CloneIsADeepCopy) {
    Tensor x = Random({10}, dtype(), 6, "clone");
    const Values xv = x.ToDoubleVector();
    Tensor c = x.Clone();
    EXPECT_EQ(c.device(), device());
    x.Fill(0.0);
    EXPECT_EQ(c.ToDoubleVector(), xv);
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(TensorOnDeviceTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// CUDA against the host

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
    for (const Shape &shape : {Shape{1}, Shape{33, 17}, Shape{2, 3, 1001}, Shape{0, 5}}) {
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

    for (const auto &[d0, d1] : {std::pair{0, 2}, std::pair{1, 2}, std::pair{0, 1}, std::pair{-1, -3}}) {
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
        const Shape &os = out.shape();
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

INSTANTIATE_TEST_SUITE_P(Cuda, CudaFillValueTest, CudaDTypes(), DTypeParamName);
INSTANTIATE_TEST_SUITE_P(Cuda, CudaTensorTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64),
                         DTypeParamName);

} // namespace
} // namespace shardline::testing
