// int64 tensors on CUDA (token ids, labels): host/device round trips, fills, the counter-based integer fill, casts
// against the host conversion, and the float kernels' refusal of int64.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using CudaInt64Test = CudaTest;

TEST_F(CudaInt64Test, RoundTripKeepsIdsBeyondFloatPrecision) {
    const Values ids = {0, 1, -7, 1099511627777.0, -8589934595.0, 31999, 50256, -1};
    const Tensor host = Tensor::FromVector(ids, {2, 4}, DType::kInt64);
    const Tensor device = host.To(Gpu());
    EXPECT_EQ(device.dtype(), DType::kInt64);
    EXPECT_EQ(device.ToString(), "Tensor[2, 4] int64 cuda:0");
    EXPECT_EQ(device.ToDoubleVector(), ids);
    EXPECT_EQ(HostBytes(device), HostBytes(host));
    // A strided device view is materialised on the device, 8 bytes per element.
    EXPECT_EQ(device.Transpose(0, 1).Contiguous().ToDoubleVector(),
              (Values{0, -8589934595.0, 1, 31999, -7, 50256, 1099511627777.0, -1}));
    Tensor copy = Tensor::Zeros({2, 4}, DType::kInt64, Gpu());
    copy.CopyFrom(device);
    EXPECT_EQ(copy.Clone().ToDoubleVector(), ids);
    EXPECT_EQ(device.View({8}).ToDoubleVector(), ids);
}

TEST_F(CudaInt64Test, FillAndIntegerRandomFillMatchTheHostBitForBit) {
    for (double value : {0.0, -3.0, 7.9, 1.0e15}) {
        EXPECT_EQ(HostBytes(Tensor::Full({5, 3}, value, DType::kInt64, Gpu())),
                  HostBytes(Tensor::Full({5, 3}, value, DType::kInt64, Device::CPU())))
            << "value " << value;
    }
    const Tensor device =
        RandomTensor({4097}, DType::kInt64, Gpu(), 5, "labels", RandomDistribution::kInteger, 0, 50256);
    const Tensor host =
        RandomTensor({4097}, DType::kInt64, Device::CPU(), 5, "labels", RandomDistribution::kInteger, 0, 50256);
    EXPECT_EQ(HostBytes(device), HostBytes(host));
    EXPECT_GT(AbsSum(host.ToDoubleVector()), 0.0);
    // A fill the host would reject is rejected before the device kernel runs.
    Tensor t = Tensor::Empty({3}, DType::kInt64, Gpu());
    EXPECT_THROW(t.Fill(std::nan("")), DTypeError);
}

TEST_F(CudaInt64Test, DeviceCastsMatchTheHostConversion) {
    // Values every source dtype holds as finite numbers (an infinity is a host error, a device saturation).
    const Tensor f64 = Tensor::FromVector({2.7, -2.7, 0.5, -0.5, 1000.5, -3.0, 30001.0}, {7}, DType::kFloat64);
    for (const DType src : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
        SCOPED_TRACE(DTypeName(src));
        const Tensor host = f64.To(src);
        EXPECT_EQ(HostBytes(host.To(Gpu()).To(DType::kInt64)), HostBytes(host.To(DType::kInt64)));
    }
    const Tensor ids = Tensor::FromVector({16777217.0, -3.0, 65519.0, 300.0, 0.0}, {5}, DType::kInt64);
    for (const DType dst : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
        SCOPED_TRACE(DTypeName(dst));
        EXPECT_EQ(HostBytes(ids.To(Gpu()).To(dst)), HostBytes(ids.To(dst)));
    }
}

template <class ErrorType> std::string MessageOf(const std::function<void()>& f) {
    try {
        f();
    } catch (const ErrorType& e) {
        return e.what();
    } catch (const std::exception& e) {
        ADD_FAILURE() << "threw the wrong type: " << e.what();
        return {};
    }
    ADD_FAILURE() << "threw nothing";
    return {};
}

TEST_F(CudaInt64Test, FloatKernelsRejectInt64) {
    const Tensor i = Tensor::Zeros({4, 8}, DType::kInt64, Gpu());
    const Tensor w = Tensor::Zeros({5, 8}, DType::kInt64, Gpu());
    const auto rejects = [](const std::string& msg, std::string_view op) {
        return msg.find(op) != std::string::npos &&
               msg.find("CUDA kernels take float32, float16 or bfloat16") != std::string::npos &&
               msg.find("int64") != std::string::npos;
    };
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { kernels::LinearForward(i, w); }), "LinearForward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { kernels::Add(i, i); }), "Add"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { kernels::GeluForward(i); }), "GeluForward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { kernels::Sum(i); }), "Sum"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { kernels::LinearBackwardBias(i); }), "LinearBackwardBias"));
    EXPECT_TRUE(
        rejects(MessageOf<DTypeError>([&] { kernels::MatmulForward(i, Tensor::Zeros({8, 2}, DType::kInt64, Gpu())); }),
                "MatmulForward"));
}

} // namespace
} // namespace shardline::testing
