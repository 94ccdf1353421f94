// Invalid arguments raise on the calling rank before any MPI call: every rank passes the same bad call, every rank
// raises, nothing is issued or counted, and the communicator stays usable.

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>

#include "dist_test.h"

namespace shardline::testing {
namespace {

using comm::ReduceOp;
using ::testing::HasSubstr;

template <class E, class F> std::string ExpectRaises(F &&call) {
    try {
        call();
    } catch (const E &e) {
        return e.what();
    } catch (const std::exception &e) {
        ADD_FAILURE() << "raised another exception type: " << e.what();
        return {};
    }
    ADD_FAILURE() << "did not raise";
    return {};
}

// After a test's rejected calls, the group still agrees on the sequence: a real collective works and only it counts.
void ExpectStillUsable(comm::Communicator &group) {
    EXPECT_EQ(group.Counts().TotalCalls(), 0);
    Tensor x = Tensor::Full({3}, 1.0, DType::kFloat32);
    group.AllReduce(x, ReduceOp::kSum)->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(3, group.size()));
    EXPECT_EQ(group.Counts().TotalCalls(), 1);
}

std::unique_ptr<comm::Communicator> Group(std::string name) {
    auto &world = DistEnv().world();
    return world.Split(0, world.rank(), std::move(name));
}

TEST(MpiErrorsTest, HalfPrecisionRaisesDTypeErrorNamingOpAndDType) {
    auto group = Group("dtype errors");
    // Empty: filling a half tensor on the CPU needs a CUDA build.
    Tensor h = Tensor::Empty({4}, DType::kFloat16);
    std::string what = ExpectRaises<DTypeError>([&] { group->AllReduce(h, ReduceOp::kSum); });
    EXPECT_THAT(what, HasSubstr("all_reduce"));
    EXPECT_THAT(what, HasSubstr("float16"));
    Tensor bf = Tensor::Empty({4}, DType::kBFloat16);
    Tensor out = Tensor::Empty({4 * group->size()}, DType::kBFloat16);
    what = ExpectRaises<DTypeError>([&] { group->AllGather(bf, out); });
    EXPECT_THAT(what, HasSubstr("all_gather"));
    EXPECT_THAT(what, HasSubstr("bfloat16"));
    what = ExpectRaises<DTypeError>([&] { group->Broadcast(bf, 0); });
    EXPECT_THAT(what, HasSubstr("broadcast"));
    // Mixed input/output dtypes.
    Tensor f32 = Tensor::Zeros({4}, DType::kFloat32);
    Tensor f64 = Tensor::Zeros({4 * group->size()}, DType::kFloat64);
    what = ExpectRaises<DTypeError>([&] { group->AllGather(f32, f64); });
    EXPECT_THAT(what, HasSubstr("float32"));
    EXPECT_THAT(what, HasSubstr("float64"));
    ExpectStillUsable(*group);
}

TEST(MpiErrorsTest, CudaTensorRaisesDeviceError) {
    auto group = Group("device errors");
    float fake[4] = {};
    Tensor on_gpu = Tensor::FromBlob(fake, {4}, DType::kFloat32, Device::CUDA(0)); // never dereferenced
    std::string what = ExpectRaises<DeviceError>([&] { group->AllReduce(on_gpu, ReduceOp::kSum); });
    EXPECT_THAT(what, HasSubstr("all_reduce"));
    EXPECT_THAT(what, HasSubstr("cuda:0"));
    Tensor out = Tensor::Zeros({4}, DType::kFloat32);
    what = ExpectRaises<DeviceError>([&] { group->AllToAll(on_gpu, out); });
    EXPECT_THAT(what, HasSubstr("all_to_all"));
    ExpectStillUsable(*group);
}

TEST(MpiErrorsTest, WrongSizesAndCountsRaiseShapeErrorWithTheValues) {
    auto group = Group("size errors");
    const int p = group->size();
    Tensor in = Tensor::Zeros({4}, DType::kFloat32);
    Tensor short_out = Tensor::Zeros({4 * p - 1}, DType::kFloat32);
    std::string what = ExpectRaises<ShapeError>([&] { group->AllGather(in, short_out); });
    EXPECT_THAT(what, HasSubstr(fmt::format("{}", 4 * p)));
    EXPECT_THAT(what, HasSubstr(fmt::format("{}", 4 * p - 1)));

    Tensor rs_in = Tensor::Zeros({4 * p + 1}, DType::kFloat32);
    Tensor rs_out = Tensor::Zeros({4}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->ReduceScatter(rs_in, rs_out, ReduceOp::kSum); }),
                HasSubstr("reduce_scatter"));

    std::vector<std::int64_t> too_few(p - 1, 1);
    Tensor v_out = Tensor::Zeros({p}, DType::kFloat32);
    Tensor one = Tensor::Zeros({1}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->AllGatherV(one, v_out, too_few); }),
                HasSubstr("one entry per rank"));
    std::vector<std::int64_t> negative(p, 1);
    negative[p - 1] = -1;
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->AllGatherV(one, v_out, negative); }), HasSubstr("non-negative"));
    std::vector<std::int64_t> ones(p, 1);
    Tensor two = Tensor::Zeros({2}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->AllGatherV(two, v_out, ones); }), HasSubstr("counts[rank"));
    Tensor too_long = Tensor::Zeros({p + 1}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->ReduceScatterV(too_long, one, ones, ReduceOp::kSum); }),
                HasSubstr("sum(counts)"));

    Tensor odd = Tensor::Zeros({p + 1}, DType::kFloat32);
    Tensor odd_out = Tensor::Zeros({p + 1}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->AllToAll(odd, odd_out); }), HasSubstr("divisible"));
    std::vector<std::int64_t> send(p, 1);
    std::vector<std::int64_t> recv(p, 2);
    Tensor a2a_in = Tensor::Zeros({p}, DType::kFloat32);
    Tensor a2a_out = Tensor::Zeros({p}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<ShapeError>([&] { group->AllToAllV(a2a_in, send, a2a_out, recv); }),
                HasSubstr("sum(recv_counts)"));

    EXPECT_THAT(ExpectRaises<Error>([&] { group->Broadcast(in, p); }), HasSubstr("root"));
    EXPECT_THAT(ExpectRaises<Error>([&] { group->Broadcast(in, -1); }), HasSubstr("root"));
    ExpectStillUsable(*group);
}

TEST(MpiErrorsTest, StridedOverlappingAndUndefinedTensorsRaise) {
    auto group = Group("layout errors");
    const int p = group->size();
    Tensor m = Tensor::Zeros({2, 3}, DType::kFloat32);
    Tensor t = m.Transpose(0, 1);
    EXPECT_THAT(ExpectRaises<Error>([&] { group->AllReduce(t, ReduceOp::kSum); }), HasSubstr("contiguous"));
    Tensor undefined;
    EXPECT_THAT(ExpectRaises<Error>([&] { group->AllReduce(undefined, ReduceOp::kSum); }), HasSubstr("defined"));
    // An all_to_all whose output is its input.
    Tensor same = Tensor::Zeros({2 * p}, DType::kFloat32);
    EXPECT_THAT(ExpectRaises<Error>([&] { group->AllToAll(same, same); }), HasSubstr("overlap"));
    ExpectStillUsable(*group);
}

} // namespace
} // namespace shardline::testing
