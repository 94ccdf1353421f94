// The tensor-parallel modules' initialisation and construction errors (DESIGN.md §6): gathered parameters equal the
// single-process Linear's for every tp size, uneven shards (torch.chunk) included; sizes that leave a rank without
// features and flag combinations Megatron rejects fail on every rank alike, in the constructor, before any collective.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_DIST_TENSOR_TEST_CUDA adds the bf16 and fp16
// cases) build this file, with the shared sizes, meshes, counts and comparisons of nn_test_util.h.

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/spmd/layout.h>

#include "nn_test_util.h"

namespace shardline {
namespace {

using namespace nn_test;

// ---- initialisation and errors -------------------------------------------------------------------------------------

// The counter-based RNG makes a parameter a function of (seed, name, global index): the gathered shards equal the
// single-process Linear's parameters of the same name, whatever tp is.
TEST(ParallelLinearInitTest, GatheredParametersEqualTheSingleProcessLinearForEveryTpSize) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const nn::ParameterOptions param = Param(DType::kFloat32);
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kFfn}, Tp(mesh),
                                    WithName(param, "init.c"));
    nn::RowParallelLinear row({.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true}, Tp(mesh),
                              WithName(param, "init.r"));
    nn::Linear dense_column({.in_features = kHidden, .out_features = kFfn}, WithName(param, "init.c"));
    nn::Linear dense_row({.in_features = kFfn, .out_features = kHidden}, WithName(param, "init.r"));
    EXPECT_TRUE(dist_test::SameValues(column.weight.value().FullTensor(), dense_column.weight.local()));
    EXPECT_TRUE(dist_test::SameValues(column.bias.value().FullTensor(), dense_column.bias.local()));
    EXPECT_TRUE(dist_test::SameValues(row.weight.value().FullTensor(), dense_row.weight.local()));
    EXPECT_TRUE(dist_test::SameValues(row.bias.value().FullTensor(), dense_row.bias.local()));
}

// The same with sizes no tp of the test divides (22 = 8 + 8 + 6 over tp 3, 6 + 6 + 6 + 4 over tp 4; 17 = 6 + 6 + 5, 5 +
// 5 + 5 + 2): the uneven shards hold exactly the single-process values at their global offsets.
TEST(ParallelLinearInitTest, UnevenShardsGatherToTheSingleProcessLinear) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const nn::ParameterOptions param = Param(DType::kFloat32);
    constexpr std::int64_t kOut = 22;
    constexpr std::int64_t kIn = 17;
    nn::ColumnParallelLinear column({.in_features = kIn, .out_features = kOut}, Tp(mesh), WithName(param, "uneven.c"));
    nn::RowParallelLinear row({.in_features = kOut, .out_features = kIn, .input_is_parallel = true}, Tp(mesh),
                              WithName(param, "uneven.r"));
    const std::int64_t tp = SizeOf(mesh, "tp");
    const std::int64_t r = mesh.coordinate()[0];
    const std::int64_t rows = spmd::ChunkRange(kOut, tp, r).second;
    EXPECT_EQ(column.weight.local().shape(), (Shape{rows, kIn})) << "torch.chunk rows of rank " << r;
    EXPECT_EQ(column.bias.local().shape(), (Shape{rows}));
    EXPECT_EQ(row.weight.local().shape(), (Shape{kIn, rows}));
    nn::Linear dense_column({.in_features = kIn, .out_features = kOut}, WithName(param, "uneven.c"));
    nn::Linear dense_row({.in_features = kOut, .out_features = kIn}, WithName(param, "uneven.r"));
    EXPECT_TRUE(dist_test::SameValues(column.weight.value().FullTensor(), dense_column.weight.local()));
    EXPECT_TRUE(dist_test::SameValues(column.bias.value().FullTensor(), dense_column.bias.local()));
    EXPECT_TRUE(dist_test::SameValues(row.weight.value().FullTensor(), dense_row.weight.local()));
    EXPECT_TRUE(dist_test::SameValues(row.bias.value().FullTensor(), dense_row.bias.local()));
}

/// Runs `make` (a constructor that must fail) and returns its ShapeError's message, or a note that it did not throw.
template <class F> std::string ShapeErrorOf(F &&make) {
    try {
        make();
    } catch (const ShapeError &e) {
        return e.what();
    } catch (const std::exception &e) {
        return fmt::format("<not a ShapeError: {}>", e.what());
    }
    return "<no error>";
}

void ExpectNames(const std::string &message, const std::vector<std::string> &parts) {
    for (const std::string &part : parts) {
        EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
    }
}

/// A size that leaves the last of tp ranks without features under torch.chunk: fewer than tp (tp 2: 1), or tp + 1 for
/// tp >= 3 (ceil((tp+1)/tp) = 2 per rank runs out before the last: tp 3 gives 2, 2, 0; tp 4 gives 2, 2, 1, 0).
std::int64_t SizeLeavingARankEmpty(std::int64_t tp) { return tp >= 3 ? tp + 1 : tp - 1; }

// Uneven sizes are accepted (torch.chunk), but one that leaves a rank without features fails on every rank alike, in
// the constructor, before any collective: the message names the layer, its name, the dim, the size and tp.
TEST(ParallelLinearErrorsTest, ColumnOutFeaturesLeavingARankEmptyNamesLayerDimSizeAndTp) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 gives every size to one rank";
    }
    const std::int64_t out = SizeLeavingARankEmpty(tp);
    ResetCounts(mesh);
    const std::string message = ShapeErrorOf(
        [&] { nn::ColumnParallelLinear({.in_features = kHidden, .out_features = out}, Tp(mesh), {.name = "qkv"}); });
    ExpectNames(message, {"ColumnParallelLinear", "'qkv'", fmt::format("out_features ({})", out),
                          fmt::format("tp ({})", tp), "every rank needs at least one"});
    ExpectCalls(mesh, {}, "the failed constructor");
}

TEST(ParallelLinearErrorsTest, RowInFeaturesLeavingARankEmptyNamesLayerDimSizeAndTp) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 gives every size to one rank";
    }
    const std::int64_t in = SizeLeavingARankEmpty(tp);
    ResetCounts(mesh);
    const std::string message = ShapeErrorOf(
        [&] { nn::RowParallelLinear({.in_features = in, .out_features = kHidden}, Tp(mesh), {.name = "proj"}); });
    ExpectNames(message, {"RowParallelLinear", "'proj'", fmt::format("in_features ({})", in),
                          fmt::format("tp ({})", tp), "every rank needs at least one"});
    ExpectCalls(mesh, {}, "the failed constructor");
}

TEST(ParallelLinearErrorsTest, MlpFfnHiddenLeavingARankEmptyNamesItsColumnLayer) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = DpTpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 gives every size to one rank";
    }
    const std::int64_t ffn = SizeLeavingARankEmpty(tp);
    ResetCounts(mesh);
    const std::string message =
        ShapeErrorOf([&] { nn::ParallelMLP({.hidden = kHidden, .ffn_hidden = ffn}, Tp(mesh), {.name = "mlp"}); });
    ExpectNames(message, {"ColumnParallelLinear", "'mlp.fc1'", fmt::format("out_features ({})", ffn),
                          fmt::format("tp ({})", tp)});
    ExpectCalls(mesh, {}, "the failed constructor");
}

// Megatron's flags exclude each other: a sequence-parallel output stays sharded on the sequence.
TEST(ParallelLinearErrorsTest, ColumnGatherOutputWithSequenceParallelIsRejected) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    ResetCounts(mesh);
    std::string message = "<no error>";
    try {
        nn::ColumnParallelLinear(
            {.in_features = kHidden, .out_features = kFfn, .gather_output = true, .sequence_parallel = true}, Tp(mesh),
            {.name = "both"});
    } catch (const Error &e) {
        message = e.what();
    }
    ExpectNames(message, {"ColumnParallelLinear", "'both'", "gather_output", "sequence_parallel"});
    ExpectCalls(mesh, {}, "the failed constructor");
}

// Megatron's rule (and the functional layer's): a sequence-parallel row layer takes a column layer's tp-sharded output.
TEST(ParallelLinearErrorsTest, RowSequenceParallelWithoutInputIsParallelIsRejected) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    ResetCounts(mesh);
    std::string message = "<no error>";
    try {
        nn::RowParallelLinear(
            {.in_features = kFfn, .out_features = kHidden, .input_is_parallel = false, .sequence_parallel = true},
            Tp(mesh), {.name = "proj"});
    } catch (const Error &e) {
        message = e.what();
    }
    ExpectNames(message, {"RowParallelLinear", "'proj'", "sequence_parallel needs input_is_parallel"});
    ExpectCalls(mesh, {}, "the failed constructor");
}

} // namespace
} // namespace shardline
