// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h), and
// every phase's collectives are asserted from the mesh groups' counters against the table of DESIGN.md §6.
// This file: RowParallelLinear with a parallel or replicated input, sequence parallel off/on, bias none / added /
// skip_bias_add.
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

// ---- RowParallelLinear ---------------------------------------------------------------------------------------------

enum class RowInput {
    kParallel,         ///< input_is_parallel: x sharded on its last dim over tp (a column layer's output)
    kReplicated,       ///< input_is_parallel = false: x replicated, split locally
    kSequenceParallel, ///< input_is_parallel, sequence_parallel: y reduce-scattered on dim 0
};

struct RowCase {
    RowInput input = RowInput::kParallel;
    Bias bias = Bias::kAdded;
    bool input_grad = true;
    Data data = Data::kInteger;
    DType dtype = DType::kFloat32;
};

std::string RowCaseName(const ::testing::TestParamInfo<RowCase> &info) {
    const RowCase &c = info.param;
    const char *input = c.input == RowInput::kParallel     ? "parallelinput"
                        : c.input == RowInput::kReplicated ? "replicatedinput"
                                                           : "sequenceparallel";
    return fmt::format("{}_{}_{}_{}_{}", input, BiasName(c.bias), c.input_grad ? "xgrad" : "noxgrad", DataName(c.data),
                       DTypeTag(c.dtype));
}

void PrintTo(const RowCase &c, std::ostream *os) { *os << RowCaseName({c, 0}); }

class RowParallelLinearTest : public ::testing::TestWithParam<RowCase> {};

// Row parallel: W [out, in] S(1) on tp, b [out] replicated, added once after the reduction.
//   parallel input:   forward all-reduce y (Partial over tp); backward none (dY replicated, dX stays S(-1)).
//   replicated input: forward the local split (free) + all-reduce y; backward all-gather dX if x requires grad.
//   sequence parallel: forward reduce-scatter y on dim 0; backward all-gather dY (dW needs every row; db is summed
//                      from the gathered dY too, so it needs no collective of its own).
TEST_P(RowParallelLinearTest, OutputAndGradientsMatchDenseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const RowCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.input == RowInput::kSequenceParallel;
    nn::RowParallelLinear layer({.in_features = kFfn,
                                 .out_features = kHidden,
                                 .bias = c.bias != Bias::kNone,
                                 .input_is_parallel = c.input != RowInput::kReplicated,
                                 .sequence_parallel = sp,
                                 .skip_bias_add = c.bias == Bias::kSkipped},
                                Tp(mesh), WithName(Param(c.dtype), "row"));
    const std::uint64_t seed = 12;
    const Tensor x_full = MakeFull({kSeq, kBatch, kFfn}, "x", c.data, c.dtype, seed);
    const Tensor w_full = MakeFull({kHidden, kFfn}, "w", c.data, c.dtype, seed);
    const Tensor b_full = MakeFull({kHidden}, "b", c.data, c.dtype, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", c.data, c.dtype, seed);
    SetFull(layer.weight, w_full);
    if (c.bias != Bias::kNone) {
        SetFull(layer.bias, b_full);
    }
    const spmd::Layout x_layout =
        c.input == RowInput::kReplicated ? spmd::Layout::Replicated(3) : LayoutOf(3, {{2, {0}}});
    Variable x(DistTensor::FromFull(x_full, x_layout, mesh), c.input_grad);

    ResetCounts(mesh);
    nn::LinearOutput out = layer.Forward(x);
    Variable y = out.output;
    if (c.bias == Bias::kSkipped) {
        EXPECT_EQ(out.bias.impl(), layer.bias.impl()) << "skip_bias_add returns the layer's bias";
        y = autograd::BiasAdd(y, out.bias);
    } else {
        EXPECT_FALSE(out.bias.defined()) << "only skip_bias_add returns the bias";
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, {.all_reduce = sp ? 0 : 1, .reduce_scatter = sp ? 1 : 0})}}, "forward");
    EXPECT_FALSE(y.value().layout().IsPartial()) << y.value().ToString();
    if (sp && tp > 1) {
        EXPECT_EQ(y.value().layout().MeshDims(0), std::vector<int>{0}) << "sharded on seq: " << y.value().ToString();
    }

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    Calls backward;
    if (sp) {
        backward.all_gather = 1;
        // The bias grad comes from the all-gathered dY (which dW needs anyway): no extra collective. Only a bias the
        // caller adds itself (skip_bias_add + BiasAdd) is summed over this rank's rows, Partial over tp: one
        // all-reduce.
        backward.all_reduce = c.bias == Bias::kSkipped ? 1 : 0;
    } else if (c.input == RowInput::kReplicated && c.input_grad) {
        backward.all_gather = 1;
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, backward)}}, "backward");
    if (c.input_grad) {
        EXPECT_EQ(x.grad().layout(), x.value().layout()) << "dX returns to the input's layout";
    }

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw_got = FullGrad(layer.weight);
    const Tensor db_got = c.bias != Bias::kNone ? FullGrad(layer.bias) : Tensor();
    const DenseLinear ref =
        ReferenceLinear(x_full, w_full, c.bias != Bias::kNone ? &b_full : nullptr, dy_full, kFfn, kHidden);
    // Half: y sums tp rounded partials, then the bias rounds once more; db under SP sums tp rounded partials.
    EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, ref.y, c.data, c.dtype, HalfFactor(tp, 1))) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kFfn}, ref.dx, c.data, c.dtype)) << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw_got, {kHidden, kFfn}, ref.dw, c.data, c.dtype)) << "dW";
    if (c.bias != Bias::kNone) {
        EXPECT_TRUE(Matches(db_got, {kHidden}, ref.db, c.data, c.dtype, HalfFactor(sp ? tp : 1))) << "db";
    }
}

std::vector<RowCase> RowCases() {
    std::vector<RowCase> cases;
    for (RowInput input : {RowInput::kParallel, RowInput::kReplicated, RowInput::kSequenceParallel}) {
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
        for (RowInput input : {RowInput::kParallel, RowInput::kReplicated, RowInput::kSequenceParallel}) {
            for (Bias bias : {Bias::kAdded, Bias::kSkipped}) {
                cases.push_back(
                    {.input = input, .bias = bias, .input_grad = true, .data = Data::kRandom, .dtype = dtype});
            }
        }
    }
#endif
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, RowParallelLinearTest, ::testing::ValuesIn(RowCases()), RowCaseName);

} // namespace
} // namespace shardline
