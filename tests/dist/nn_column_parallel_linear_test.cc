// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h), and
// every phase's collectives are asserted from the mesh groups' counters against the table of DESIGN.md §6.
// This file: ColumnParallelLinear with a replicated, sequence-parallel or gather_output input, bias none / added /
// skip_bias_add, input requiring grad or not.
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

// ---- ColumnParallelLinear ------------------------------------------------------------------------------------------

enum class ColumnInput {
    kReplicated,       ///< x replicated over tp
    kSequenceParallel, ///< x sharded on dim 0 (sequence) over tp
    kGatherOutput,     ///< x replicated, gather_output
};

struct ColumnCase {
    ColumnInput input = ColumnInput::kReplicated;
    Bias bias = Bias::kAdded;
    bool input_grad = true;
    Data data = Data::kInteger;
    DType dtype = DType::kFloat32;
};

std::string ColumnCaseName(const ::testing::TestParamInfo<ColumnCase> &info) {
    const ColumnCase &c = info.param;
    const char *input = c.input == ColumnInput::kReplicated         ? "replicated"
                        : c.input == ColumnInput::kSequenceParallel ? "sequenceparallel"
                                                                    : "gatheroutput";
    return fmt::format("{}_{}_{}_{}_{}", input, BiasName(c.bias), c.input_grad ? "xgrad" : "noxgrad", DataName(c.data),
                       DTypeTag(c.dtype));
}

void PrintTo(const ColumnCase &c, std::ostream *os) { *os << ColumnCaseName({c, 0}); }

class ColumnParallelLinearTest : public ::testing::TestWithParam<ColumnCase> {};

// Column parallel: W [out, in] S(0) on tp, b [out] S(0).
//   replicated x:  forward none; backward all-reduce of dX only if x requires grad (dX is Partial over tp).
//   sequence parallel (x S(0) on tp): forward all-gather x; backward reduce-scatter dX only if x requires grad.
//   gather_output: forward + all-gather y; backward takes its slice of dY (free).
// dW and db are complete shards on every rank: no collective.
TEST_P(ColumnParallelLinearTest, OutputAndGradientsMatchDenseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const ColumnCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.input == ColumnInput::kSequenceParallel;
    const bool gather = c.input == ColumnInput::kGatherOutput;
    nn::ColumnParallelLinear layer({.in_features = kHidden,
                                    .out_features = kFfn,
                                    .bias = c.bias != Bias::kNone,
                                    .gather_output = gather,
                                    .sequence_parallel = sp,
                                    .skip_bias_add = c.bias == Bias::kSkipped},
                                   Tp(mesh), WithName(Param(c.dtype), "column"));
    const std::uint64_t seed = 11;
    const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", c.data, c.dtype, seed);
    const Tensor w_full = MakeFull({kFfn, kHidden}, "w", c.data, c.dtype, seed);
    const Tensor b_full = MakeFull({kFfn}, "b", c.data, c.dtype, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kFfn}, "dy", c.data, c.dtype, seed);
    SetFull(layer.weight, w_full);
    if (c.bias != Bias::kNone) {
        SetFull(layer.bias, b_full);
    }
    const spmd::Layout x_layout = sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3);
    Variable x(DistTensor::FromFull(x_full, x_layout, mesh), c.input_grad);

    ResetCounts(mesh);
    nn::LinearOutput out = layer.Forward(x);
    Variable y = out.output;
    // skip_bias_add hands the bias back for the caller to fuse; here it is added unfused, where its shard matches
    // (a gathered output with a sharded bias is Megatron's caller's business: the bias then gets no gradient).
    const bool bias_in_y = c.bias == Bias::kAdded || (c.bias == Bias::kSkipped && !gather);
    if (c.bias == Bias::kSkipped) {
        EXPECT_EQ(out.bias.impl(), layer.bias.impl()) << "skip_bias_add returns the layer's bias";
        if (!gather) {
            y = autograd::BiasAdd(y, out.bias);
        }
    } else {
        EXPECT_FALSE(out.bias.defined()) << "only skip_bias_add returns the bias";
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_gather = sp || gather ? 1 : 0})}}, "forward");
    if (gather) {
        EXPECT_TRUE(y.value().layout().IsReplicated()) << y.value().ToString();
    } else if (tp > 1) {
        EXPECT_EQ(y.value().layout().MeshDims(2), std::vector<int>{0}) << "sharded on out: " << y.value().ToString();
    }

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    ExpectCalls(mesh,
                {{"tp", Planned(tp, {.all_reduce = c.input_grad && !sp ? 1 : 0,
                                     .reduce_scatter = c.input_grad && sp ? 1 : 0})}},
                "backward");
    if (c.input_grad) {
        EXPECT_EQ(x.grad().layout(), x.value().layout()) << "dX returns to the input's layout";
    }

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw_got = FullGrad(layer.weight);
    const Tensor db_got = c.bias != Bias::kNone ? FullGrad(layer.bias) : Tensor();
    const DenseLinear ref = ReferenceLinear(x_full, w_full, bias_in_y ? &b_full : nullptr, dy_full, kHidden, kFfn);
    // Half: y rounds once (bias in the GEMM epilogue), twice with an unfused BiasAdd; dX sums tp rounded partials.
    EXPECT_TRUE(
        Matches(y_got, {kSeq, kBatch, kFfn}, ref.y, c.data, c.dtype, HalfFactor(1, c.bias == Bias::kSkipped ? 1 : 0)))
        << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden}, ref.dx, c.data, c.dtype, HalfFactor(tp))) << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw_got, {kFfn, kHidden}, ref.dw, c.data, c.dtype)) << "dW";
    if (bias_in_y) {
        EXPECT_TRUE(Matches(db_got, {kFfn}, ref.db, c.data, c.dtype)) << "db";
    } else if (c.bias != Bias::kNone) {
        EXPECT_FALSE(db_got.defined()) << "a bias left out of y has no gradient";
    }
}

std::vector<ColumnCase> ColumnCases() {
    std::vector<ColumnCase> cases;
    for (ColumnInput input : {ColumnInput::kReplicated, ColumnInput::kSequenceParallel, ColumnInput::kGatherOutput}) {
        for (Bias bias : {Bias::kNone, Bias::kAdded, Bias::kSkipped}) {
            for (bool input_grad : {true, false}) {
                for (Data data : {Data::kInteger, Data::kRandom}) {
                    cases.push_back({.input = input, .bias = bias, .input_grad = input_grad, .data = data});
                }
            }
        }
    }
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        for (ColumnInput input :
             {ColumnInput::kReplicated, ColumnInput::kSequenceParallel, ColumnInput::kGatherOutput}) {
            for (Bias bias : {Bias::kAdded, Bias::kSkipped}) {
                cases.push_back(
                    {.input = input, .bias = bias, .input_grad = true, .data = Data::kRandom, .dtype = dtype});
            }
        }
    }
#endif
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ColumnParallelLinearTest, ::testing::ValuesIn(ColumnCases()), ColumnCaseName);

} // namespace
} // namespace shardline
