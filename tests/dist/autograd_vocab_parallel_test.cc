// Vocab-parallel cross-entropy, embedding and embedding bag through autograd on a tp mesh, against the same Functions
// on local Variables (the dense reference, itself checked against finite differences in
// tests/cpu/autograd_functions_test.cc). Every rank builds the same full tensors from one seed; the distributed loss
// and gradients are gathered and compared (fp32, rtol 1e-5), and the communicator counters show the communication the
// rules give.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/nn/linear.h>

#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;
using dist::LossReduction;

constexpr double kRtol = 1e-5;

/// A full tensor of normal(0, scale) values, the same on every rank.
Tensor NormalFull(const Shape &shape, std::string_view name, double scale = 1.0) {
    Tensor t = Tensor::Empty(shape, DType::kFloat32, TestDevice());
    FillRandom(t, RandomSpec{.seed = 99, .name = name, .b = scale});
    return t;
}

/// int64 ids in [0, n), the same on every rank.
Tensor IdsFull(const Shape &shape, std::int64_t n, std::string_view name) {
    Tensor d = Tensor::Empty(shape, DType::kFloat64);
    FillRandom(d, RandomSpec{.seed = 99,
                             .name = name,
                             .distribution = RandomDistribution::kInteger,
                             .a = 0,
                             .b = static_cast<double>(n - 1)});
    return Tensor::FromVector(d.ToDoubleVector(), shape, DType::kInt64).To(TestDevice());
}

/// S(-1) over mesh dim 0 for a rank-`rank` tensor.
spmd::Layout ShardLast(int rank) {
    std::vector<std::vector<int>> dims(static_cast<std::size_t>(rank));
    dims.back() = {0};
    return spmd::Layout(std::move(dims));
}

std::string Name(LossReduction r) {
    switch (r) {
    case LossReduction::kMean:
        return "Mean";
    case LossReduction::kSum:
        return "Sum";
    case LossReduction::kNone:
        return "None";
    }
    return "Unknown";
}

struct CrossEntropyCase {
    LossReduction reduction = LossReduction::kMean;
    std::int64_t classes_per_rank = 5; ///< C = classes_per_rank·tp + extra
    std::int64_t extra = 0;            ///< > 0: uneven shards (torch.chunk: the last ones short)
};

class VocabParallelCrossEntropyTest : public ::testing::TestWithParam<CrossEntropyCase> {};

TEST_P(VocabParallelCrossEntropyTest, LossAndLogitsGradMatchDense) {
    // logits [4, 3, C] S(-1) on tp (a column-parallel head's output), labels [4, 3] replicated.
    //   forward: all-reduce MAX of the row max, one all-reduce SUM of (Σ exp, target logit); no all-gather.
    //   backward: none: dlogits stays S(-1), each rank's softmax columns minus its part of the one-hot.
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const CrossEntropyCase c = GetParam();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const std::int64_t classes = c.classes_per_rank * w + c.extra;
    const Tensor logits_full = NormalFull({4, 3, classes}, "logits", 2.0);
    const Tensor labels_full = IdsFull({4, 3}, classes, "labels");
    const Tensor dloss_full = c.reduction == LossReduction::kNone ? NormalFull({4, 3}, "dloss") : Tensor();

    Variable logits(DistTensor::FromFull(logits_full, ShardLast(3), mesh), true);
    Variable labels(DistTensor::FromFull(labels_full, spmd::Layout::Replicated(2), mesh));
    mesh.group(0).ResetCounts();
    Variable loss = autograd::CrossEntropy(logits, labels, {.reduction = c.reduction, .vocab_parallel = true});
    const auto forward = mesh.group(0).Counts();
    EXPECT_EQ(forward.Calls(CollectiveKind::kAllReduce), w > 1 ? 2 : 0);
    EXPECT_EQ(forward.TotalCalls(), w > 1 ? 2 : 0);
    mesh.group(0).ResetCounts();
    if (dloss_full.defined()) {
        const DistTensor dloss = DistTensor::FromFull(dloss_full, loss.value().layout(), mesh);
        loss.Backward(&dloss);
    } else {
        loss.Backward();
    }
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), 0);
    EXPECT_EQ(logits.grad().layout().ToString(), logits.value().layout().ToString());

    Variable dense_logits(logits_full.Clone(), true);
    Variable dense_loss = autograd::CrossEntropy(dense_logits, Variable(labels_full), {.reduction = c.reduction});
    if (dloss_full.defined()) {
        const DistTensor dloss = DistTensor::Local(dloss_full);
        dense_loss.Backward(&dloss);
    } else {
        dense_loss.Backward();
    }
    EXPECT_TRUE(CloseValues(loss.value().FullTensor(), dense_loss.local(), kRtol)) << "loss";
    EXPECT_TRUE(CloseValues(logits.grad().FullTensor(), dense_logits.grad().local(), kRtol)) << "dlogits";
}

INSTANTIATE_TEST_SUITE_P(
    Reductions, VocabParallelCrossEntropyTest,
    ::testing::Values(CrossEntropyCase{LossReduction::kMean}, CrossEntropyCase{LossReduction::kSum},
                      CrossEntropyCase{LossReduction::kNone}, CrossEntropyCase{LossReduction::kMean, 2, 1}),
    [](const auto &info) { return Name(info.param.reduction) + (info.param.extra > 0 ? "_UnevenShards" : ""); });

class VocabParallelCrossEntropyHeadTest : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(VocabParallelCrossEntropyHeadTest, GradientFlowsBackThroughAColumnParallelHead) {
    // h [6, 8] replicated -> ColumnParallelLinear(8 -> V) without gather_output -> logits S(-1) -> vocab-parallel
    // cross-entropy, V = 4·tp + extra: extra 1 splits the vocabulary unevenly (torch.chunk; tp 3: 5, 5, 3), as the
    // char-LM's unpadded vocabulary. Backward: one all-reduce (dH, Partial over tp), since h requires grad.
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const std::int64_t vocab = 4 * w + GetParam();
    nn::ColumnParallelLinear head({.in_features = 8, .out_features = vocab}, nn::TensorParallelGroup::Named(mesh, "tp"),
                                  {.device = TestDevice(), .seed = 3, .name = "head"});
    nn::Linear dense_head({.in_features = 8, .out_features = vocab},
                          {.device = TestDevice(), .seed = 3, .name = "head"});
    const Tensor h_full = NormalFull({6, 8}, "h");
    const Tensor labels_full = IdsFull({6}, vocab, "labels");

    Variable h(DistTensor::FromFull(h_full, spmd::Layout::Replicated(2), mesh), true);
    Variable labels(DistTensor::FromFull(labels_full, spmd::Layout::Replicated(1), mesh));
    Variable logits = head.Forward(h).output;
    if (w > 1) {
        EXPECT_EQ(logits.value().layout().ToString(), ShardLast(2).ToString()) << logits.value().ToString();
    }
    Variable loss = autograd::CrossEntropy(logits, labels);
    mesh.group(0).ResetCounts();
    loss.Backward();
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), w > 1 ? 1 : 0);

    Variable dense_h(h_full.Clone(), true);
    Variable dense_loss = autograd::CrossEntropy(dense_head.Forward(dense_h), Variable(labels_full));
    dense_loss.Backward();
    EXPECT_TRUE(CloseValues(loss.value().FullTensor(), dense_loss.local(), kRtol)) << "loss";
    EXPECT_TRUE(CloseValues(h.grad().FullTensor(), dense_h.grad().local(), kRtol)) << "dH";
    EXPECT_TRUE(CloseValues(head.weight.grad().FullTensor(), dense_head.weight.grad().local(), kRtol)) << "dW";
    EXPECT_TRUE(CloseValues(head.bias.grad().FullTensor(), dense_head.bias.grad().local(), kRtol)) << "db";
}

INSTANTIATE_TEST_SUITE_P(Vocab, VocabParallelCrossEntropyHeadTest, ::testing::Values(0, 1),
                         [](const auto &info) { return info.param == 0 ? "EvenShards" : "UnevenShards"; });

class VocabParallelEmbeddingTest : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(VocabParallelEmbeddingTest, PartialLookupThenAllReduceMatchesDense) {
    // table [V, 3] S(0) on tp (rows split by vocab), ids [2, 5] replicated: each rank looks up its rows (zeros for the
    // others) -> Partial(sum) -> Redistribute to replicated: one all-reduce forward. Backward: dOut is replicated and
    // each rank scatters it into its own rows: no communication, dTable S(0). V = 3·tp + extra: extra 1 splits the rows
    // unevenly (torch.chunk; tp 3: 4, 4, 2). Integer-valued table and dOut: the lookups and the row sums are exact, so
    // the comparison is bitwise.
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const std::int64_t vocab = 3 * w + GetParam();
    const Tensor table_full = RandomFull({vocab, 3}, "table");
    const Tensor ids_full = IdsFull({2, 5}, vocab, "ids");
    const Tensor dout_full = RandomFull({2, 5, 3}, "dout");

    Variable table(DistTensor::FromFull(table_full, spmd::Layout(std::vector<std::vector<int>>{{0}, {}}), mesh), true);
    Variable ids(DistTensor::FromFull(ids_full, spmd::Layout::Replicated(2), mesh));
    mesh.group(0).ResetCounts();
    Variable partial = autograd::Embedding(ids, table);
    EXPECT_EQ(partial.value().layout().IsPartial(), w > 1) << partial.value().ToString();
    Variable out = autograd::Redistribute(partial, spmd::Layout::Replicated(3));
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), w > 1 ? 1 : 0);
    mesh.group(0).ResetCounts();
    const DistTensor dout = DistTensor::FromFull(dout_full, spmd::Layout::Replicated(3), mesh);
    out.Backward(&dout);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), 0);
    EXPECT_EQ(table.grad().layout().ToString(), table.value().layout().ToString());

    Variable dense_table(table_full.Clone(), true);
    Variable dense_out = autograd::Embedding(Variable(ids_full), dense_table);
    const DistTensor dense_dout = DistTensor::Local(dout_full);
    dense_out.Backward(&dense_dout);
    EXPECT_TRUE(SameValues(out.value().FullTensor(), dense_out.local())) << "out";
    EXPECT_TRUE(SameValues(table.grad().FullTensor(), dense_table.grad().local())) << "dTable";
}

INSTANTIATE_TEST_SUITE_P(Vocab, VocabParallelEmbeddingTest, ::testing::Values(0, 1),
                         [](const auto &info) { return info.param == 0 ? "EvenShards" : "UnevenShards"; });

/// A tp mesh dim sharding dim 0 of a rank-2 table.
spmd::Layout ShardRows() { return spmd::Layout(std::vector<std::vector<int>>{{0}, {}}); }

struct BagCase {
    std::int64_t rows_per_rank = 3; ///< V = rows_per_rank·tp + extra
    std::int64_t extra = 0;         ///< > 0: uneven shards (torch.chunk: the last ones short)
    bool main_grad = false;         ///< accumulate into a preallocated float32 main grad (twice: 2·dTable)
};

class VocabParallelEmbeddingBagTest : public ::testing::TestWithParam<BagCase> {};

TEST_P(VocabParallelEmbeddingBagTest, PartialBagSumThenAllReduceMatchesDense) {
    // table [V, 5] S(0) on tp, ids [T=6, 4, 2] replicated: each rank sums the rows it holds over every bag -> [4, 2, 5]
    // Partial(sum) -> Redistribute to replicated: one all-reduce forward. Backward: dOut is replicated and each rank
    // sums it into its own rows: no communication, dTable S(0).
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const BagCase c = GetParam();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const std::int64_t vocab = c.rows_per_rank * w + c.extra;
    const Tensor table_full = NormalFull({vocab, 5}, "table");
    const Tensor ids_full = IdsFull({6, 4, 2}, vocab, "ids");
    const Tensor dout_full = NormalFull({4, 2, 5}, "dout");

    Variable table(DistTensor::FromFull(table_full, ShardRows(), mesh), true);
    if (c.main_grad) {
        table.AllocateMainGrad(DType::kFloat32);
    }
    Variable ids(DistTensor::FromFull(ids_full, spmd::Layout::Replicated(3), mesh));
    mesh.group(0).ResetCounts();
    Variable partial = autograd::EmbeddingBag(ids, table);
    EXPECT_EQ(partial.value().layout().IsPartial(), w > 1) << partial.value().ToString();
    EXPECT_EQ(partial.shape(), (Shape{4, 2, 5}));
    Variable out = autograd::Redistribute(partial, spmd::Layout::Replicated(3));
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), w > 1 ? 1 : 0);
    mesh.group(0).ResetCounts();
    const DistTensor dout = DistTensor::FromFull(dout_full, spmd::Layout::Replicated(3), mesh);
    out.Backward(&dout, /*retain_graph=*/c.main_grad);
    if (c.main_grad) {
        out.Backward(&dout); // a second micro-batch accumulates into the main grad
    }
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), 0);
    EXPECT_EQ(table.grad().layout().ToString(), table.value().layout().ToString());

    // The dense reference: the fused op on local Variables (checked against finite differences and against
    // Sum(Embedding) in tests/cpu/autograd_functions_test.cc).
    Variable dense_table(table_full.Clone(), true);
    Variable dense_out = autograd::EmbeddingBag(Variable(ids_full), dense_table);
    const DistTensor dense_dout = DistTensor::Local(dout_full);
    dense_out.Backward(&dense_dout);
    Tensor want_grad = dense_table.grad().local();
    if (c.main_grad) {
        want_grad = kernels::Scale(want_grad, 2.0);
    }
    EXPECT_TRUE(CloseValues(out.value().FullTensor(), dense_out.local(), kRtol)) << "out";
    EXPECT_TRUE(CloseValues(table.grad().FullTensor(), want_grad, kRtol)) << "dTable";
}

INSTANTIATE_TEST_SUITE_P(Shards, VocabParallelEmbeddingBagTest,
                         ::testing::Values(BagCase{}, BagCase{.rows_per_rank = 2, .extra = 1},
                                           BagCase{.main_grad = true}),
                         [](const auto &info) {
                             return std::string(info.param.extra > 0 ? "UnevenShards" : "EvenShards") +
                                    (info.param.main_grad ? "_MainGrad" : "");
                         });

TEST(VocabParallelEmbeddingBagTest, BagShardedIdsGiveAPartialSumAndAPartialTableGrad) {
    // ids [T = 2·tp, 3] S(0) on tp (each rank holds some positions of every bag), table [7, 4] replicated: each rank
    // sums its positions -> Partial(sum) -> one all-reduce. Backward: each rank's rows get its positions' dOut ->
    // dTable Partial(sum), which the replicated table's gradient layout reduces: one all-reduce.
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const int w = World().size();
    DeviceMesh mesh(World(), {w}, {"tp"});
    const Tensor table_full = NormalFull({7, 4}, "table");
    const Tensor ids_full = IdsFull({2 * w, 3}, 7, "ids");
    const Tensor dout_full = NormalFull({3, 4}, "dout");

    Variable table(DistTensor::FromFull(table_full, spmd::Layout::Replicated(2), mesh), true);
    Variable ids(DistTensor::FromFull(ids_full, ShardRows(), mesh));
    mesh.group(0).ResetCounts();
    Variable out = autograd::Redistribute(autograd::EmbeddingBag(ids, table), spmd::Layout::Replicated(2));
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    mesh.group(0).ResetCounts();
    const DistTensor dout = DistTensor::FromFull(dout_full, spmd::Layout::Replicated(2), mesh);
    out.Backward(&dout);
    EXPECT_EQ(mesh.group(0).Counts().Calls(CollectiveKind::kAllReduce), w > 1 ? 1 : 0);
    EXPECT_EQ(mesh.group(0).Counts().TotalCalls(), w > 1 ? 1 : 0);

    Variable dense_table(table_full.Clone(), true);
    Variable dense_out = autograd::EmbeddingBag(Variable(ids_full), dense_table);
    const DistTensor dense_dout = DistTensor::Local(dout_full);
    dense_out.Backward(&dense_dout);
    EXPECT_TRUE(CloseValues(out.value().FullTensor(), dense_out.local(), kRtol)) << "out";
    EXPECT_TRUE(CloseValues(table.grad().FullTensor(), dense_table.grad().local(), kRtol)) << "dTable";
}

} // namespace
} // namespace shardline
