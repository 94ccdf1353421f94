// Bad input to the kernel ops: the exception type, and a message that names the op, the argument, its
// shape/dtype/device and what was expected.

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::MessageOf;
using testing::RandomTensor;

Tensor F32(const Shape &shape, std::string_view name = "t") {
    return RandomTensor(shape, DType::kFloat32, Device::CPU(), 1, name);
}

TEST(ErrorsTest, InFeaturesMismatchNamesBothShapes) {
    const Tensor x = F32({4, 7});
    const Tensor w = F32({5, 8});
    const std::string msg = MessageOf<ShapeError>([&] { LinearForward(x, w); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearForward"), HasSubstr("x's last dim must equal in_features 8"),
                           HasSubstr("Tensor[5, 8] float32 cpu"), HasSubstr("Tensor[4, 7] float32 cpu")));
}

TEST(ErrorsTest, OutFeaturesMismatchInBackwardInput) {
    const Tensor dy = F32({4, 6});
    const Tensor w = F32({5, 8});
    const std::string msg = MessageOf<ShapeError>([&] { LinearBackwardInput(dy, w); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearBackwardInput"), HasSubstr("out_features 5"),
                           HasSubstr("dy Tensor[4, 6] float32 cpu")));
}

TEST(ErrorsTest, DTypeMismatchNamesBothDTypes) {
    const Tensor x = RandomTensor({4, 8}, DType::kFloat64, Device::CPU(), 1, "x");
    const Tensor w = F32({5, 8});
    const std::string msg = MessageOf<DTypeError>([&] { LinearForward(x, w); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearForward"), HasSubstr("x and weight must have one dtype"),
                           HasSubstr("Tensor[4, 8] float64 cpu"), HasSubstr("Tensor[5, 8] float32 cpu")));
}

TEST(ErrorsTest, DeviceMismatchIsADeviceError) {
    // A tensor that claims to live on cuda:0; the checks reject it before anything reads its memory.
    std::vector<float> host(40);
    const Tensor w_cuda = Tensor::FromBlob(host.data(), {5, 8}, DType::kFloat32, Device::CUDA(0));
    const Tensor x = F32({4, 8});
    Tensor y = Tensor::Empty({4, 5}, DType::kFloat32);
    const std::string msg =
        MessageOf<DeviceError>([&] { LinearForward(LinearForwardArgs{.x = x, .weight = w_cuda, .y = y}); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearForward"), HasSubstr("must be on one device"),
                           HasSubstr("Tensor[4, 8] float32 cpu"), HasSubstr("Tensor[5, 8] float32 cuda:0")));
}

TEST(ErrorsTest, NonContiguousInputAsksForContiguous) {
    const Tensor x = F32({8, 4}).Transpose(0, 1); // [4, 8] strided
    const Tensor w = F32({5, 8});
    const std::string msg = MessageOf<ShapeError>([&] { LinearForward(x, w); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearForward"), HasSubstr("x must be contiguous"),
                           HasSubstr("Tensor[4, 8] float32 cpu with strides [1, 4]"), HasSubstr("Contiguous()")));
    const Tensor a = F32({3, 4}).Transpose(0, 1);
    EXPECT_THAT(MessageOf<ShapeError>([&] { MatmulForward(a, F32({3, 2})); }),
                AllOf(HasSubstr("MatmulForward"), HasSubstr("a must be contiguous")));
}

TEST(ErrorsTest, UndefinedTensorIsNamed) {
    const Tensor w = F32({5, 8});
    EXPECT_THAT(MessageOf<Error>([&] { LinearForward(Tensor(), w); }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("x is an undefined (empty) tensor")));
    EXPECT_THAT(MessageOf<Error>([&] { LinearBackwardBias(Tensor()); }),
                AllOf(HasSubstr("LinearBackwardBias"), HasSubstr("dy is an undefined")));
    EXPECT_THAT(MessageOf<Error>([&] { GeluForward(Tensor()); }), HasSubstr("GeluForward: x is an undefined"));
}

TEST(ErrorsTest, NullDataPointerIsNamed) {
    const Tensor x = Tensor::FromBlob(nullptr, {4, 8}, DType::kFloat32, Device::CPU());
    EXPECT_THAT(MessageOf<Error>([&] { LinearForward(x, F32({5, 8})); }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("x Tensor[4, 8] float32 cpu has a null data pointer")));
}

TEST(ErrorsTest, BiasLengthMustEqualOutFeatures) {
    const Tensor x = F32({4, 8});
    const Tensor w = F32({5, 8});
    const Tensor b = F32({4});
    const std::string msg = MessageOf<ShapeError>([&] { LinearForward(x, w, &b); });
    EXPECT_THAT(msg, AllOf(HasSubstr("LinearForward"), HasSubstr("bias must be [out_features] = [5]"),
                           HasSubstr("Tensor[4] float32 cpu")));
}

TEST(ErrorsTest, HalfDTypeOnCpuIsADTypeErrorNamingFloat16) {
    const Tensor x = Tensor::Empty({4, 8}, DType::kFloat16);
    const Tensor w = Tensor::Empty({5, 8}, DType::kFloat16);
    EXPECT_THAT(MessageOf<DTypeError>([&] { LinearForward(x, w); }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("float16"),
                      HasSubstr("CPU kernels take float32 or float64"), HasSubstr("CUDA only")));
    const Tensor bf = Tensor::Empty({4, 8}, DType::kBFloat16);
    EXPECT_THAT(MessageOf<DTypeError>([&] { GeluForward(bf); }),
                AllOf(HasSubstr("GeluForward"), HasSubstr("bfloat16")));
    EXPECT_THAT(MessageOf<DTypeError>([&] { MatmulForward(x, Tensor::Empty({8, 2}, DType::kFloat16)); }),
                AllOf(HasSubstr("MatmulForward"), HasSubstr("float16")));
    EXPECT_THAT(MessageOf<DTypeError>([&] { Sum(x); }), AllOf(HasSubstr("Sum"), HasSubstr("float16")));
}

TEST(ErrorsTest, WeightMustBeAMatrix) {
    EXPECT_THAT(MessageOf<ShapeError>([&] { LinearForward(F32({4, 8}), F32({8})); }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("weight must be [out_features, in_features]"),
                      HasSubstr("Tensor[8] float32 cpu")));
}

TEST(ErrorsTest, OutputOfTheWrongShapeIsNamed) {
    const Tensor x = F32({4, 8});
    const Tensor w = F32({5, 8});
    Tensor y = Tensor::Empty({4, 6}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { LinearForward(LinearForwardArgs{.x = x, .weight = w, .y = y}); }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("y must have shape [4, 5]"), HasSubstr("Tensor[4, 6]")));
}

TEST(ErrorsTest, GeluActivationNeedsAPreActivationTensor) {
    const Tensor x = F32({4, 8});
    const Tensor w = F32({5, 8});
    Tensor y = Tensor::Empty({4, 5}, DType::kFloat32);
    EXPECT_THAT(MessageOf<Error>([&] {
                    LinearForward(
                        LinearForwardArgs{.x = x, .weight = w, .y = y, .activation = LinearActivation::kGeluTanh});
                }),
                AllOf(HasSubstr("LinearForward"), HasSubstr("needs a pre_activation tensor")));
}

TEST(ErrorsTest, BackwardWeightChecksRowsAndGradDType) {
    const Tensor dy = F32({4, 5});
    EXPECT_THAT(MessageOf<ShapeError>([&] { LinearBackwardWeight(dy, F32({3, 8})); }),
                AllOf(HasSubstr("LinearBackwardWeight"), HasSubstr("must agree on the leading (row) dims"),
                      HasSubstr("Tensor[4, 5]"), HasSubstr("Tensor[3, 8]")));
    const Tensor x = F32({4, 8});
    Tensor dw64 = Tensor::Empty({5, 8}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>(
                    [&] { LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw64}); }),
                AllOf(HasSubstr("LinearBackwardWeight"), HasSubstr("dweight must have x's dtype float32"),
                      HasSubstr("Tensor[5, 8] float64 cpu")));
}

TEST(ErrorsTest, Float32MainGradForFloat64OperandsIsRejectedOnCpu) {
    const Tensor dy = RandomTensor({4, 5}, DType::kFloat64, Device::CPU(), 1, "dy");
    const Tensor x = RandomTensor({4, 8}, DType::kFloat64, Device::CPU(), 1, "x");
    Tensor main_grad = Tensor::Zeros({5, 8}, DType::kFloat32);
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    LinearBackwardWeight(
                        LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = main_grad, .accumulate = true});
                }),
                AllOf(HasSubstr("Gemm"), HasSubstr("A float64, B float64, C float32")));
}

TEST(ErrorsTest, MatmulContractedDimMismatchNamesBothShapes) {
    EXPECT_THAT(MessageOf<ShapeError>([&] { MatmulForward(F32({2, 3, 4}), F32({5, 6})); }),
                AllOf(HasSubstr("MatmulForward"), HasSubstr("contracted dims differ"), HasSubstr("[2, 3, 4]"),
                      HasSubstr("[5, 6]")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { MatmulForward(F32({2, 3, 4}), F32({3, 4, 6})); }),
                AllOf(HasSubstr("MatmulForward"), HasSubstr("do not broadcast"), HasSubstr("2 vs 3")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { MatmulForward(F32({4}), F32({4, 6})); }),
                AllOf(HasSubstr("MatmulForward"), HasSubstr("rank >= 2")));
}

TEST(ErrorsTest, MatmulBackwardChecksTheGradShape) {
    const Tensor dout = F32({3, 5});
    const Tensor b = F32({4, 6});
    Tensor da = Tensor::Empty({3, 4}, DType::kFloat32);
    EXPECT_THAT(
        MessageOf<ShapeError>([&] { MatmulBackwardInput(MatmulBackwardInputArgs{.dout = dout, .b = b, .da = da}); }),
        AllOf(HasSubstr("MatmulBackwardInput"), HasSubstr("dout must have shape [3, 6]"), HasSubstr("Tensor[3, 5]")));
}

TEST(ErrorsTest, OuterTakesNonEmptyVectors) {
    EXPECT_THAT(MessageOf<ShapeError>([&] { OuterForward(F32({2, 2}), F32({3})); }),
                AllOf(HasSubstr("OuterForward"), HasSubstr("x must be a non-empty vector"), HasSubstr("Tensor[2, 2]")));
}

TEST(ErrorsTest, ElementwiseShapesMustMatch) {
    EXPECT_THAT(MessageOf<ShapeError>([&] { Add(F32({2, 3}), F32({3, 2})); }),
                AllOf(HasSubstr("Add"), HasSubstr("b must have shape [2, 3]"), HasSubstr("Tensor[3, 2]")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { GeluBackward(F32({4}), F32({5})); }),
                AllOf(HasSubstr("GeluBackward"), HasSubstr("dy must have shape [5]")));
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { Add(F32({2}), RandomTensor({2}, DType::kFloat64, Device::CPU(), 1, "b")); }),
        AllOf(HasSubstr("Add"), HasSubstr("a and b must have one dtype")));
}

TEST(ErrorsTest, SumDimsAreValidated) {
    EXPECT_THAT(MessageOf<ShapeError>([&] { Sum(F32({2, 3}), {.dims = {2}}); }),
                AllOf(HasSubstr("Sum"), HasSubstr("dim 2 out of range for shape [2, 3]")));
    EXPECT_THAT(MessageOf<ShapeError>([&] { Sum(F32({2, 3}), {.dims = {1, -1}}); }),
                AllOf(HasSubstr("Sum"), HasSubstr("listed twice")));
    Tensor out = Tensor::Empty({3}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { Sum(SumArgs{.x = F32({2, 3}), .out = out, .dims = {1}}); }),
                AllOf(HasSubstr("Sum"), HasSubstr("out must have shape [2]")));
}

TEST(ErrorsTest, BiasGradDTypeAndShapeAreChecked) {
    const Tensor dy = F32({4, 5});
    Tensor db = Tensor::Empty({4}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db}); }),
                AllOf(HasSubstr("LinearBackwardBias"), HasSubstr("dbias must have shape [5]")));
    Tensor db64 = Tensor::Empty({5}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>([&] { LinearBackwardBias(LinearBackwardBiasArgs{.dy = dy, .dbias = db64}); }),
                AllOf(HasSubstr("LinearBackwardBias"), HasSubstr("dbias must have dy's dtype float32"),
                      HasSubstr("Tensor[5] float64 cpu")));
}

TEST(ErrorsTest, Int64IsRejectedByEveryFloatKernel) {
    // int64 is a storage type for ids and labels: a float kernel handed one must say so, never reinterpret the bits.
    const Tensor i = Tensor::Zeros({4, 8}, DType::kInt64);
    const Tensor w = Tensor::Zeros({5, 8}, DType::kInt64);
    const auto rejects = [](const std::string &msg, std::string_view op) {
        return msg.find(op) != std::string::npos &&
               msg.find("CPU kernels take float32 or float64") != std::string::npos &&
               msg.find("int64") != std::string::npos;
    };
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { LinearForward(i, w); }), "LinearForward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { LinearBackwardInput(Tensor::Zeros({4, 5}, DType::kInt64), w); }),
                        "LinearBackwardInput"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { LinearBackwardWeight(Tensor::Zeros({4, 5}, DType::kInt64), i); }),
                        "LinearBackwardWeight"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { LinearBackwardBias(i); }), "LinearBackwardBias"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { MatmulForward(i, Tensor::Zeros({8, 2}, DType::kInt64)); }),
                        "MatmulForward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { GeluForward(i); }), "GeluForward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { GeluBackward(i, i); }), "GeluBackward"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { Add(i, i); }), "Add"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { Scale(i, 2.0); }), "Scale"));
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { Sum(i); }), "Sum"));
    Tensor out = Tensor::Empty({}, DType::kInt64);
    EXPECT_TRUE(rejects(MessageOf<DTypeError>([&] { Sum(SumArgs{.x = F32({2}), .out = out, .dims = {}}); }), "Sum"));
    // A raw GEMM problem never reaches BLAS with int64 operands.
    const Tensor a = F32({2, 2});
    Tensor c = Tensor::Zeros({2, 2}, DType::kInt64);
    EXPECT_THAT(MessageOf<DTypeError>([&] {
                    Gemm(GemmParams{.m = 2,
                                    .n = 2,
                                    .k = 2,
                                    .a = a.data(),
                                    .lda = 2,
                                    .a_type = DType::kFloat32,
                                    .b = a.data(),
                                    .ldb = 2,
                                    .b_type = DType::kFloat32,
                                    .c = c.data(),
                                    .ldc = 2,
                                    .c_type = DType::kInt64,
                                    .device = Device::CPU()});
                }),
                AllOf(HasSubstr("Gemm"), HasSubstr("float dtypes"), HasSubstr("C int64")));
}

} // namespace
} // namespace shardline::kernels
