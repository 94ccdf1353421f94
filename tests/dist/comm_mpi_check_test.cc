// The debug mode (SHARDLINE_COMM_CHECK=1, here SetCommCheck): the ranks exchange (op, seq, count, dtype, op/root,
// counts) before each collective; on a disagreement every rank raises CommError listing the mismatching ranks and
// no rank issues the collective.

#include <numeric>
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

class MpiCheckTest : public ::testing::Test {
protected:
    void SetUp() override {
        auto &world = DistEnv().world();
        group_ = world.Split(0, world.rank(), "checked");
        comm::SetCommCheck(true);
    }
    void TearDown() override { comm::SetCommCheck(false); }

    // Runs `call` expecting CommError on every rank; returns its message.
    template <class F> std::string ExpectCheckFailure(F &&call) {
        try {
            call();
        } catch (const CommError &e) {
            EXPECT_TRUE(group_->aborted());
            EXPECT_EQ(group_->Counts().TotalCalls(), 0) << "the mismatched collective must not be issued";
            return e.what();
        }
        ADD_FAILURE() << "no CommError";
        return {};
    }

    std::unique_ptr<comm::Communicator> group_;
};

TEST_F(MpiCheckTest, MatchingCallsPassTheCheck) {
    const int p = group_->size();
    Tensor x = Tensor::Full({8}, 1.0, DType::kFloat64);
    group_->AllReduce(x, ReduceOp::kSum)->Wait();
    std::vector<std::int64_t> counts(p, 2);
    counts[0] = 0;
    Tensor in = Tensor::Zeros({counts[group_->rank()]}, DType::kFloat32);
    Tensor out = Tensor::Zeros({2 * (p - 1)}, DType::kFloat32);
    group_->AllGatherV(in, out, counts)->Wait();
    group_->Broadcast(x, p - 1)->Wait();
    group_->Barrier()->Wait();
    EXPECT_EQ(x.ToDoubleVector(), std::vector<double>(8, p));
    EXPECT_FALSE(group_->aborted());
    EXPECT_EQ(group_->Counts().TotalCalls(), 4);
}

TEST_F(MpiCheckTest, CountMismatchRaisesOnEveryRankNamingTheRanks) {
    const int p = group_->size();
    const int last = p - 1;
    Tensor x = Tensor::Zeros({group_->rank() == last ? 17 : 16}, DType::kFloat32);
    const std::string what = ExpectCheckFailure([&] { group_->AllReduce(x, ReduceOp::kSum); });
    EXPECT_THAT(what, HasSubstr("SHARDLINE_COMM_CHECK"));
    EXPECT_THAT(what, HasSubstr("'checked'"));
    EXPECT_THAT(what, HasSubstr(fmt::format("rank {}: all_reduce seq 1 count 17 float32", last)));
    EXPECT_THAT(what, HasSubstr("rank 0: all_reduce seq 1 count 16 float32"));
    EXPECT_THAT(what, HasSubstr(fmt::format("mismatching ranks: {}", last)));
    EXPECT_THROW(group_->Barrier(), CommError);
}

TEST_F(MpiCheckTest, RootAndOpAndDTypeMismatchesAreCaught) {
    const int p = group_->size();
    Tensor x = Tensor::Zeros({4}, DType::kFloat32);
    const std::string root = ExpectCheckFailure([&] { group_->Broadcast(x, group_->rank() == 0 ? 0 : p - 1); });
    EXPECT_THAT(root, HasSubstr("root 0"));
    EXPECT_THAT(root, HasSubstr(fmt::format("root {}", p - 1)));

    auto &world = DistEnv().world();
    auto g2 = world.Split(0, world.rank(), "checked op");
    try {
        g2->AllReduce(x, group_->rank() == 0 ? ReduceOp::kMax : ReduceOp::kSum);
        ADD_FAILURE() << "no CommError";
    } catch (const CommError &e) {
        EXPECT_THAT(e.what(), HasSubstr("op max"));
        EXPECT_THAT(e.what(), HasSubstr("op sum"));
    }
    auto g3 = world.Split(0, world.rank(), "checked dtype");
    Tensor y = Tensor::Zeros({4}, group_->rank() == 0 ? DType::kFloat64 : DType::kFloat32);
    EXPECT_THROW(g3->AllReduce(y, ReduceOp::kSum), CommError);
}

TEST_F(MpiCheckTest, DifferentCollectivesAtOneSequenceNumberAreCaught) {
    Tensor x = Tensor::Zeros({4}, DType::kFloat32);
    const std::string what = ExpectCheckFailure([&] {
        if (group_->rank() == 0) {
            group_->Barrier();
        } else {
            group_->AllReduce(x, ReduceOp::kSum);
        }
    });
    EXPECT_THAT(what, HasSubstr("rank 0: barrier seq 1"));
    EXPECT_THAT(what, HasSubstr("rank 1: all_reduce seq 1"));
}

TEST_F(MpiCheckTest, InconsistentAllToAllVCountsAreCaught) {
    const int p = group_->size();
    std::vector<std::int64_t> send(p, 1);
    std::vector<std::int64_t> recv(p, 1);
    if (group_->rank() == 0) {
        send[p - 1] = 2; // rank p-1 expects 1 from rank 0
    }
    const std::int64_t send_total = std::accumulate(send.begin(), send.end(), std::int64_t{0});
    Tensor in = Tensor::Zeros({send_total}, DType::kFloat32);
    Tensor out = Tensor::Zeros({p}, DType::kFloat32);
    const std::string what = ExpectCheckFailure([&] { group_->AllToAllV(in, send, out, recv); });
    EXPECT_THAT(what, HasSubstr(fmt::format("rank 0 sends 2 to rank {}, which expects 1", p - 1)));
}

} // namespace
} // namespace shardline::testing
