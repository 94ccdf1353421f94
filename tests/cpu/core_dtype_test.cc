#include <cstdint>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/dtype.h>
#include <shardline/core/error.h>

namespace shardline {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, ParsesCanonicalNamesAndShortForms) {
    EXPECT_EQ(ParseDType("float32"), DType::kFloat32);
    EXPECT_EQ(ParseDType("f32"), DType::kFloat32);
    EXPECT_EQ(ParseDType("fp32"), DType::kFloat32);
    EXPECT_EQ(ParseDType("float16"), DType::kFloat16);
    EXPECT_EQ(ParseDType("f16"), DType::kFloat16);
    EXPECT_EQ(ParseDType("fp16"), DType::kFloat16);
    EXPECT_EQ(ParseDType("bfloat16"), DType::kBFloat16);
    EXPECT_EQ(ParseDType("bf16"), DType::kBFloat16);
    EXPECT_EQ(ParseDType("float64"), DType::kFloat64);
    EXPECT_EQ(ParseDType("f64"), DType::kFloat64);
    EXPECT_EQ(ParseDType("fp64"), DType::kFloat64);
    EXPECT_EQ(ParseDType("int64"), DType::kInt64);
    EXPECT_EQ(ParseDType("i64"), DType::kInt64);
}

TEST(DTypeTest, NamesRoundTripThroughParse) {
    for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt64}) {
        EXPECT_EQ(ParseDType(DTypeName(d)), d) << DTypeName(d);
    }
    EXPECT_EQ(DTypeName(DType::kFloat32), "float32");
    EXPECT_EQ(DTypeName(DType::kFloat16), "float16");
    EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
    EXPECT_EQ(DTypeName(DType::kFloat64), "float64");
    EXPECT_EQ(DTypeName(DType::kInt64), "int64");
}

TEST(DTypeTest, ElementSizesAndHalfPredicate) {
    EXPECT_EQ(ElementSize(DType::kFloat32), 4u);
    EXPECT_EQ(ElementSize(DType::kFloat16), 2u);
    EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
    EXPECT_EQ(ElementSize(DType::kFloat64), 8u);
    EXPECT_TRUE(IsHalf(DType::kFloat16));
    EXPECT_TRUE(IsHalf(DType::kBFloat16));
    EXPECT_FALSE(IsHalf(DType::kFloat32));
    EXPECT_FALSE(IsHalf(DType::kFloat64));
    static_assert(DTypeOf<float>::kValue == DType::kFloat32);
    static_assert(DTypeOf<double>::kValue == DType::kFloat64);
}

TEST(DTypeTest, Int64IsAnEightByteStorageTypeThatIsNeitherHalfNorFloat) {
    EXPECT_EQ(ElementSize(DType::kInt64), 8u);
    EXPECT_FALSE(IsHalf(DType::kInt64));
    EXPECT_FALSE(IsFloatingPoint(DType::kInt64));
    for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
        EXPECT_TRUE(IsFloatingPoint(d)) << DTypeName(d);
    }
    static_assert(DTypeOf<std::int64_t>::kValue == DType::kInt64);
}

TEST(DTypeTest, UnknownNameThrowsDTypeErrorListingTheChoices) {
    try {
        ParseDType("float8");
        FAIL() << "ParseDType accepted 'float8'";
    } catch (const DTypeError &e) {
        const std::string msg = e.what();
        EXPECT_THAT(msg, HasSubstr("ParseDType"));
        EXPECT_THAT(msg, HasSubstr("'float8'"));
        EXPECT_THAT(msg, HasSubstr("float32|float16|bfloat16|float64|int64"));
    }
    EXPECT_THROW(ParseDType(""), DTypeError);
    EXPECT_THROW(ParseDType("Float32"), Error); // names are case-sensitive
}

} // namespace
} // namespace shardline
