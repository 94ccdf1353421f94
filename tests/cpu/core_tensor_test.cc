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
#include "reference.h"

namespace shardline {
namespace {

using testing::AbsSum;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::Values;

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

TEST(TensorTest, TransposeIsAStridedViewThatContiguousMaterialises) {
    const Tensor x = RandomTensor({3, 5}, DType::kFloat32, Device::CPU(), 2, "transpose");
    const Values xv = x.ToDoubleVector();
    ASSERT_GT(AbsSum(xv), 0.0);
    const Tensor t = x.Transpose(0, 1);
    EXPECT_EQ(t.shape(), (Shape{5, 3}));
    EXPECT_EQ(t.strides(), (Shape{1, 5}));
    EXPECT_FALSE(t.is_contiguous());
    EXPECT_EQ(t.data(), x.data());
    const Tensor c = t.Contiguous();
    EXPECT_TRUE(c.is_contiguous());
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

TEST(TensorTest, TransposeOfBatchedTensorSwapsInnerDims) {
    const Tensor x = RandomTensor({2, 3, 4}, DType::kFloat64, Device::CPU(), 3, "transpose3");
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

TEST(TensorTest, CopyFromCopiesValuesAndRejectsMismatches) {
    const Tensor src = RandomTensor({4, 6}, DType::kFloat32, Device::CPU(), 5, "copy");
    Tensor dst = Tensor::Zeros({4, 6}, DType::kFloat32);
    dst.CopyFrom(src);
    EXPECT_EQ(dst.ToDoubleVector(), src.ToDoubleVector());
    EXPECT_NE(dst.data(), src.data());

    Tensor dst_t = Tensor::Zeros({6, 4}, DType::kFloat32);
    dst_t.CopyFrom(src.Transpose(0, 1)); // a strided source is materialised
    EXPECT_EQ(dst_t.ToDoubleVector(), src.Transpose(0, 1).Contiguous().ToDoubleVector());

    Tensor wrong_shape = Tensor::Zeros({6, 4}, DType::kFloat32);
    EXPECT_THROW(wrong_shape.CopyFrom(src), ShapeError);
    Tensor wrong_dtype = Tensor::Zeros({4, 6}, DType::kFloat64);
    try {
        wrong_dtype.CopyFrom(src);
        FAIL() << "CopyFrom accepted a dtype mismatch";
    } catch (const ShapeError &e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("Tensor::CopyFrom"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("float32"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("float64"));
    }
}

TEST(TensorTest, CloneIsADeepCopy) {
    Tensor x = RandomTensor({10}, DType::kFloat64, Device::CPU(), 6, "clone");
    const Values xv = x.ToDoubleVector();
    Tensor c = x.Clone();
    x.Fill(0.0);
    EXPECT_EQ(c.ToDoubleVector(), xv);
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

    const auto message = [](const std::function<void()>& f) {
        try {
            f();
        } catch (const DTypeError& e) {
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
    const Tensor labels = RandomTensor({1000}, DType::kInt64, Device::CPU(), 3, "labels",
                                       RandomDistribution::kInteger, -3, 40);
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
    const Tensor f = RandomTensor({1000}, DType::kFloat64, Device::CPU(), 3, "labels", RandomDistribution::kInteger,
                                  -3, 40);
    EXPECT_EQ(f.ToDoubleVector(), v);
}

TEST(TensorTest, HalfTensorCanBeAllocatedOnTheHost) {
    const Tensor h = Tensor::Empty({3, 2}, DType::kFloat16);
    EXPECT_EQ(h.nbytes(), 12u);
    EXPECT_EQ(h.ToString(), "Tensor[3, 2] float16 cpu");
}

} // namespace
} // namespace shardline
