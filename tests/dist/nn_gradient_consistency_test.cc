// Gradient consistency of the tensor-parallel modules (issue 5; DESIGN.md §6–7). Every rank builds the same full
// input, parameters and output gradient from one seed; the TP run's output and dX, dW, db are gathered to full tensors
// (DistTensor::FullTensor) and compared with a single-rank dense float64 reference (tests/common/reference.h):
// bitwise with integer-valued operands (|x| <= 8, K <= 512: every fp32 sum is an exact integer, in any order), rtol
// 1e-5 for random fp32 and, on the GPU, 1.6e-2 for bf16 and 1e-3 for fp16 (see HalfFactor for where half-precision
// roundings add up). The same runs assert every phase's collectives from the mesh groups' counters against the table
// of DESIGN.md §6 (none on a group of one rank).
//
// Matrix: TP = world size (1, 2, 4) on a [W] {"tp"} mesh; DP×TP on a [2, W/2] {"dp", "tp"} mesh with GradSync;
// sequence parallel off/on; bias none / added / skip_bias_add; input requires grad or not; gather_output;
// input_is_parallel; column → row; ParallelMLP; sizes that tp does not divide.
//
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_DIST_TENSOR_TEST_CUDA adds the bf16 and fp16
// cases) build this file.

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
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
#include <shardline/spmd/mesh.h>

#include "dist_tensor_test_util.h"
#include "reference.h"

namespace shardline {
namespace {

using autograd::Variable;
using comm::CollectiveKind;
using comm::DeviceMesh;
using dist::DistTensor;
using dist_test::TestDevice;
using dist_test::World;
using testing::Values;

// Megatron's [s, b, h] activations. Every feature size divides by 1, 2 and 4, and so does the sequence (sequence
// parallelism shards dim 0 over tp); the batch divides by dp = 2. Integer bounds: a column output is at most
// 16·8·8 + 8 = 1032, a row output after it 24·8·1032 < 2^18, every gradient below 2^18: exact in fp32.
constexpr std::int64_t kSeq = 8;
constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kRows = kSeq * kBatch;
constexpr std::int64_t kHidden = 16; ///< column in, row out, MLP hidden
constexpr std::int64_t kFfn = 24;    ///< column out, row in, MLP ffn_hidden

// ---- meshes: built once per process (an NCCL split costs ~1 s on 4 ranks), torn down before the environment -------

struct Meshes {
    std::unique_ptr<DeviceMesh> tp;
    std::unique_ptr<DeviceMesh> dp_tp;
};
Meshes &TheMeshes() {
    static Meshes meshes;
    return meshes;
}
class MeshEnvironment : public ::testing::Environment {
public:
    void TearDown() override { TheMeshes() = Meshes{}; }
};
const auto *const kMeshEnvironment = ::testing::AddGlobalTestEnvironment(new MeshEnvironment);

/// [W] {"tp"}: tp = world size.
DeviceMesh &TpMesh() {
    Meshes &m = TheMeshes();
    if (!m.tp) {
        m.tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{World().size()},
                                            std::vector<std::string>{"tp"});
    }
    return *m.tp;
}

/// [2, W/2] {"dp", "tp"} (rank = dp·TP + tp); [1, 1] on one rank.
DeviceMesh &DpTpMesh() {
    Meshes &m = TheMeshes();
    if (!m.dp_tp) {
        const std::int64_t dp = World().size() >= 2 ? 2 : 1;
        m.dp_tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{dp, World().size() / dp},
                                               std::vector<std::string>{"dp", "tp"});
    }
    return *m.dp_tp;
}

std::int64_t SizeOf(DeviceMesh &mesh, std::string_view dim) {
    return mesh.shape()[static_cast<std::size_t>(mesh.dim_index(dim))];
}

nn::TensorParallelGroup Tp(DeviceMesh &mesh) {
    return nn::TensorParallelGroup::Named(mesh, "tp");
}

/// A layout of a rank-`rank` tensor: tensor dim d sharded over the mesh dims `shards[d]` (major first).
spmd::Layout LayoutOf(int rank, const std::map<int, std::vector<int>> &shards) {
    std::vector<std::vector<int>> dims(static_cast<std::size_t>(rank));
    for (const auto &[d, mesh_dims] : shards) {
        dims[static_cast<std::size_t>(d)] = mesh_dims;
    }
    return spmd::Layout(std::move(dims));
}

/// Whether two layouts place every element alike on `mesh` (a mesh dim of one rank shards nothing).
bool SameLayout(DeviceMesh &mesh, const spmd::Layout &a, const spmd::Layout &b) {
    const spmd::ProcessMesh pm(mesh.shape(), mesh.dim_names());
    return a.Canonical(pm) == b.Canonical(pm);
}

// ---- collective counts ---------------------------------------------------------------------------------------------

struct Calls {
    std::int64_t all_reduce = 0;
    std::int64_t all_gather = 0;
    std::int64_t reduce_scatter = 0;
};

/// The planner moves nothing over a mesh dim of one rank: what the table says for tp > 1, nothing for tp = 1.
Calls Planned(std::int64_t group_size, Calls calls) {
    return group_size > 1 ? calls : Calls{};
}

/// Zeroes the counters of the world and of every group of the mesh (creating them: every rank asks in one order).
void ResetCounts(DeviceMesh &mesh) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
    mesh.world().ResetCounts();
}

/// Exactly `want[name]` on each named mesh dim's group, nothing on the other groups, nothing on the world.
void ExpectCalls(DeviceMesh &mesh, const std::map<std::string, Calls> &want, std::string_view phase) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        const std::string &name = mesh.dim_names()[static_cast<std::size_t>(d)];
        const auto it = want.find(name);
        const Calls w = it == want.end() ? Calls{} : it->second;
        const comm::CollectiveCounts got = mesh.group(d).Counts();
        EXPECT_EQ(got.Calls(CollectiveKind::kAllReduce), w.all_reduce) << phase << ": all_reduce on " << name;
        EXPECT_EQ(got.Calls(CollectiveKind::kAllGather), w.all_gather) << phase << ": all_gather on " << name;
        EXPECT_EQ(got.Calls(CollectiveKind::kReduceScatter), w.reduce_scatter)
            << phase << ": reduce_scatter on " << name;
        EXPECT_EQ(got.TotalCalls(), w.all_reduce + w.all_gather + w.reduce_scatter)
            << phase << ": other collectives on " << name;
    }
    EXPECT_EQ(mesh.world().Counts().TotalCalls(), 0) << phase << ": on the world";
}

// ---- data ----------------------------------------------------------------------------------------------------------

enum class Data { kInteger, kRandom };

/// A full tensor, the same on every rank: integers in [-8, 8] or normal(0, 1), from (seed, name, index).
Tensor MakeFull(const Shape &shape, std::string_view name, Data data, DType dtype, std::uint64_t seed) {
    if (data == Data::kInteger) {
        return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kInteger, -8, 8);
    }
    return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kNormal, 0.0, 1.0);
}

/// Overwrites this rank's shard of parameter `p` with its part of `full` (the module's own init is uniform random).
void SetFull(Variable &p, const Tensor &full) {
    const DistTensor shard = DistTensor::FromFull(full, p.value().layout(), p.value().mesh());
    Tensor local = p.local();
    local.CopyFrom(shard.local());
}

nn::ParameterOptions Param(DType dtype) {
    return {.dtype = dtype, .device = TestDevice(), .seed = 3};
}

nn::ParameterOptions WithName(nn::ParameterOptions param, std::string name) {
    param.name = std::move(name);
    return param;
}

/// How many half-precision roundings separate a result from the float64 reference, beyond the one of a local GEMM:
/// each of `reduced_over` ranks rounds its partial result to the dtype and the reduction rounds each of its additions
/// (NCCL reduces in the dtype); a bias added after the GEMM, an activation or a gradient between two GEMMs round once
/// more (`extra_roundings`). A half type's rtol is multiplied by this; float32's (1e-5, ~170 roundings) needs none.
/// A numpy model of exactly these roundings on these shapes (400 seeds, tp 2 and 4) puts the worst
/// |err| / (rtol·max(|e|, rms)) at 0.5–1.6 for fp16 single layers (factors 1–5), 1.7–3.5 for the fp16 MLP (factors
/// 3–7), and at most 1.5 for bf16: every output stays below its factor.
double HalfFactor(std::int64_t reduced_over, int extra_roundings = 0) {
    return static_cast<double>(reduced_over + extra_roundings);
}

/// Bitwise (shape and every value) for integer data; otherwise testing::CompareValues with the dtype's rtol (times
/// `half_factor` for bf16 / fp16).
::testing::AssertionResult Matches(const Tensor &got, const Shape &shape, const Values &want, Data data, DType dtype,
                                   double half_factor = 1.0) {
    if (!got.defined()) {
        return ::testing::AssertionFailure() << "undefined, expected " << ShapeToString(shape);
    }
    if (got.shape() != shape) {
        return ::testing::AssertionFailure()
               << "shape " << ShapeToString(got.shape()) << ", expected " << ShapeToString(shape);
    }
    const Values g = got.ToDoubleVector();
    if (data == Data::kInteger) {
        for (std::size_t i = 0; i < g.size(); ++i) {
            if (!(g[i] == want[i])) {
                return ::testing::AssertionFailure()
                       << "element " << i << " is " << g[i] << ", expected exactly " << want[i];
            }
        }
        return ::testing::AssertionSuccess();
    }
    const double rtol = testing::RelativeTolerance(dtype) * (IsHalf(dtype) ? half_factor : 1.0);
    const std::string message = testing::CompareValues(g, want, rtol);
    if (!message.empty()) {
        return ::testing::AssertionFailure() << message;
    }
    return ::testing::AssertionSuccess();
}

/// The full gradient of `v` (every rank; a collective when it is sharded), or undefined when it has none.
Tensor FullGrad(const Variable &v) {
    return v.grad().defined() ? v.grad().FullTensor() : Tensor();
}

std::string DataName(Data data) {
    return data == Data::kInteger ? "integer" : "random";
}

std::string DTypeTag(DType dtype) {
    return std::string(DTypeName(dtype));
}

/// The dense problem of one Linear, y[rows, out] = x[rows, in]·W[out, in]ᵀ + b, in float64.
struct DenseLinear {
    Values y, dx, dw, db;
};
DenseLinear ReferenceLinear(const Tensor &x, const Tensor &w, const Tensor *b, const Tensor &dy, std::int64_t in,
                            std::int64_t out) {
    const Values xv = x.ToDoubleVector();
    const Values wv = w.ToDoubleVector();
    const Values dyv = dy.ToDoubleVector();
    const Values bv = b != nullptr ? b->ToDoubleVector() : Values();
    return {.y = testing::RefLinearForward(xv, wv, b != nullptr ? &bv : nullptr, kRows, out, in),
            .dx = testing::RefLinearBackwardInput(dyv, wv, kRows, out, in),
            .dw = testing::RefLinearBackwardWeight(dyv, xv, kRows, out, in),
            .db = testing::RefColumnSum(dyv, kRows, out)};
}

enum class Bias {
    kNone,
    kAdded,   ///< the layer adds it
    kSkipped, ///< skip_bias_add: the layer returns it and the test adds it (autograd::BiasAdd)
};

std::string BiasName(Bias bias) {
    switch (bias) {
    case Bias::kNone:
        return "nobias";
    case Bias::kAdded:
        return "bias";
    case Bias::kSkipped:
        return "skipbiasadd";
    }
    return "?";
}

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

void PrintTo(const ColumnCase &c, std::ostream *os) {
    *os << ColumnCaseName({c, 0});
}

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

void PrintTo(const RowCase &c, std::ostream *os) {
    *os << RowCaseName({c, 0});
}

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
        // caller adds itself (skip_bias_add + BiasAdd) is summed over this rank's rows, Partial over tp: one all-reduce.
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

// ---- column → row (the Megatron pair), bitwise ----------------------------------------------------------------------

struct PairCase {
    bool sequence_parallel = false;
    bool bias = true;
    bool input_grad = true;
};

std::string PairCaseName(const ::testing::TestParamInfo<PairCase> &info) {
    const PairCase &c = info.param;
    return fmt::format("{}_{}_{}", c.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       c.bias ? "bias" : "nobias", c.input_grad ? "xgrad" : "noxgrad");
}

void PrintTo(const PairCase &c, std::ostream *os) {
    *os << PairCaseName({c, 0});
}

/// Dense float64 column → row: h = x·W1ᵀ + b1, y = h·W2ᵀ + b2, and every gradient.
struct DensePair {
    Values y, dx, dw1, db1, dw2, db2;
};
DensePair ReferencePair(const Tensor &x, const Tensor &w1, const Tensor *b1, const Tensor &w2, const Tensor *b2,
                        const Tensor &dy) {
    const Values xv = x.ToDoubleVector();
    const Values w1v = w1.ToDoubleVector();
    const Values w2v = w2.ToDoubleVector();
    const Values dyv = dy.ToDoubleVector();
    const Values b1v = b1 != nullptr ? b1->ToDoubleVector() : Values();
    const Values b2v = b2 != nullptr ? b2->ToDoubleVector() : Values();
    const Values h = testing::RefLinearForward(xv, w1v, b1 != nullptr ? &b1v : nullptr, kRows, kFfn, kHidden);
    const Values dh = testing::RefLinearBackwardInput(dyv, w2v, kRows, kHidden, kFfn);
    return {.y = testing::RefLinearForward(h, w2v, b2 != nullptr ? &b2v : nullptr, kRows, kHidden, kFfn),
            .dx = testing::RefLinearBackwardInput(dh, w1v, kRows, kFfn, kHidden),
            .dw1 = testing::RefLinearBackwardWeight(dh, xv, kRows, kFfn, kHidden),
            .db1 = testing::RefColumnSum(dh, kRows, kFfn),
            .dw2 = testing::RefLinearBackwardWeight(dyv, h, kRows, kHidden, kFfn),
            .db2 = testing::RefColumnSum(dyv, kRows, kHidden)};
}

class ColumnRowPairTest : public ::testing::TestWithParam<PairCase> {};

// column → row: forward one all-reduce (SP: all-gather x + reduce-scatter y); backward one all-reduce of dX if x
// requires grad (SP: all-gather dY + reduce-scatter dX if x requires grad).
TEST_P(ColumnRowPairTest, MatchesDenseBitwiseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const PairCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ColumnParallelLinear column({.in_features = kHidden,
                                     .out_features = kFfn,
                                     .bias = c.bias,
                                     .sequence_parallel = sp},
                                    Tp(mesh), WithName(Param(DType::kFloat32), "pair.column"));
    nn::RowParallelLinear row({.in_features = kFfn,
                               .out_features = kHidden,
                               .bias = c.bias,
                               .input_is_parallel = true,
                               .sequence_parallel = sp},
                              Tp(mesh), WithName(Param(DType::kFloat32), "pair.row"));
    const Data data = Data::kInteger;
    const DType f32 = DType::kFloat32;
    const std::uint64_t seed = 13;
    const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, f32, seed);
    const Tensor w1 = MakeFull({kFfn, kHidden}, "w1", data, f32, seed);
    const Tensor b1 = MakeFull({kFfn}, "b1", data, f32, seed);
    const Tensor w2 = MakeFull({kHidden, kFfn}, "w2", data, f32, seed);
    const Tensor b2 = MakeFull({kHidden}, "b2", data, f32, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, f32, seed);
    SetFull(column.weight, w1);
    SetFull(row.weight, w2);
    if (c.bias) {
        SetFull(column.bias, b1);
        SetFull(row.bias, b2);
    }
    Variable x(DistTensor::FromFull(x_full, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = row.Forward(column.Forward(x).output).output;
    ExpectCalls(mesh, {{"tp", Planned(tp, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1})}},
                "forward");
    EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
        << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    Calls backward;
    if (sp) {
        backward = {.all_reduce = 0, .all_gather = 1, .reduce_scatter = c.input_grad ? 1 : 0};
    } else {
        backward = {.all_reduce = c.input_grad ? 1 : 0};
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, backward)}}, "backward");

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw1_got = FullGrad(column.weight);
    const Tensor dw2_got = FullGrad(row.weight);
    const Tensor db1_got = c.bias ? FullGrad(column.bias) : Tensor();
    const Tensor db2_got = c.bias ? FullGrad(row.bias) : Tensor();
    const DensePair ref = ReferencePair(x_full, w1, c.bias ? &b1 : nullptr, w2, c.bias ? &b2 : nullptr, dy_full);
    EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, ref.y, data, f32)) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden}, ref.dx, data, f32)) << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw1_got, {kFfn, kHidden}, ref.dw1, data, f32)) << "column dW";
    EXPECT_TRUE(Matches(dw2_got, {kHidden, kFfn}, ref.dw2, data, f32)) << "row dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(db1_got, {kFfn}, ref.db1, data, f32)) << "column db";
        EXPECT_TRUE(Matches(db2_got, {kHidden}, ref.db2, data, f32)) << "row db";
    }
}

std::vector<PairCase> PairCases() {
    std::vector<PairCase> cases;
    for (bool sp : {false, true}) {
        for (bool bias : {true, false}) {
            for (bool input_grad : {true, false}) {
                cases.push_back({.sequence_parallel = sp, .bias = bias, .input_grad = input_grad});
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ColumnRowPairTest, ::testing::ValuesIn(PairCases()), PairCaseName);

// ---- ParallelMLP ---------------------------------------------------------------------------------------------------

struct MlpCase {
    bool sequence_parallel = false;
    bool bias = true;
    bool input_grad = true;
    DType dtype = DType::kFloat32;
};

std::string MlpCaseName(const ::testing::TestParamInfo<MlpCase> &info) {
    const MlpCase &c = info.param;
    return fmt::format("{}_{}_{}_{}", c.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       c.bias ? "bias" : "nobias", c.input_grad ? "xgrad" : "noxgrad", DTypeTag(c.dtype));
}

void PrintTo(const MlpCase &c, std::ostream *os) {
    *os << MlpCaseName({c, 0});
}

class ParallelMLPTest : public ::testing::TestWithParam<MlpCase> {};

// ParallelMLP = column → GELU(tanh) → row on random data (GELU leaves the integers), against float64 with GELU's
// exact derivative. Collectives as column → row: GELU is elementwise on the column's sharded output.
TEST_P(ParallelMLPTest, OutputAndGradientsMatchDenseWithTheTableCollectives) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MlpCase &c = GetParam();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const bool sp = c.sequence_parallel;
    nn::ParallelMLP mlp({.hidden = kHidden,
                         .ffn_hidden = kFfn,
                         .bias = c.bias,
                         .sequence_parallel = sp},
                        Tp(mesh), WithName(Param(c.dtype), "mlp"));
    const Data data = Data::kRandom;
    const std::uint64_t seed = 14;
    const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, c.dtype, seed);
    const Tensor w1 = MakeFull({kFfn, kHidden}, "w1", data, c.dtype, seed);
    const Tensor b1 = MakeFull({kFfn}, "b1", data, c.dtype, seed);
    const Tensor w2 = MakeFull({kHidden, kFfn}, "w2", data, c.dtype, seed);
    const Tensor b2 = MakeFull({kHidden}, "b2", data, c.dtype, seed);
    const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, c.dtype, seed);
    SetFull(mlp.fc1->weight, w1);
    SetFull(mlp.fc2->weight, w2);
    if (c.bias) {
        SetFull(mlp.fc1->bias, b1);
        SetFull(mlp.fc2->bias, b2);
    }
    EXPECT_EQ(mlp.Parameters().size(), c.bias ? 4U : 2U);
    Variable x(DistTensor::FromFull(x_full, sp ? LayoutOf(3, {{0, {0}}}) : spmd::Layout::Replicated(3), mesh),
               c.input_grad);

    ResetCounts(mesh);
    Variable y = mlp.Forward(x);
    ExpectCalls(mesh, {{"tp", Planned(tp, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1})}},
                "forward");
    EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
        << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();

    ResetCounts(mesh);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
    y.Backward(&dy);
    Calls backward;
    if (sp) {
        // all-gather dY (fc2's bias grad comes from it too: no all-reduce), reduce-scatter dX if x needs a grad.
        backward = {.all_reduce = 0, .all_gather = 1, .reduce_scatter = c.input_grad ? 1 : 0};
    } else {
        backward = {.all_reduce = c.input_grad ? 1 : 0};
    }
    ExpectCalls(mesh, {{"tp", Planned(tp, backward)}}, "backward");

    const Tensor y_got = y.value().FullTensor();
    const Tensor dx_got = FullGrad(x);
    const Tensor dw1_got = FullGrad(mlp.fc1->weight);
    const Tensor dw2_got = FullGrad(mlp.fc2->weight);
    const Tensor db1_got = c.bias ? FullGrad(mlp.fc1->bias) : Tensor();
    const Tensor db2_got = c.bias ? FullGrad(mlp.fc2->bias) : Tensor();

    // Dense float64: h = x·W1ᵀ + b1, a = gelu(h), y = a·W2ᵀ + b2.
    const Values xv = x_full.ToDoubleVector();
    const Values w1v = w1.ToDoubleVector();
    const Values w2v = w2.ToDoubleVector();
    const Values b1v = b1.ToDoubleVector();
    const Values b2v = b2.ToDoubleVector();
    const Values dyv = dy_full.ToDoubleVector();
    const Values h = testing::RefLinearForward(xv, w1v, c.bias ? &b1v : nullptr, kRows, kFfn, kHidden);
    Values a(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) {
        a[i] = testing::RefGeluTanh(h[i]);
    }
    const Values y_ref = testing::RefLinearForward(a, w2v, c.bias ? &b2v : nullptr, kRows, kHidden, kFfn);
    Values dh = testing::RefLinearBackwardInput(dyv, w2v, kRows, kHidden, kFfn);
    for (std::size_t i = 0; i < dh.size(); ++i) {
        dh[i] *= testing::RefGeluTanhGrad(h[i]);
    }
    // Half: h, gelu(h) and dGELU each round once before the next GEMM; y and dX also sum tp rounded partials.
    EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, y_ref, data, c.dtype, HalfFactor(tp, 3))) << "y";
    if (c.input_grad) {
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden},
                            testing::RefLinearBackwardInput(dh, w1v, kRows, kFfn, kHidden), data, c.dtype,
                            HalfFactor(tp, 3)))
            << "dX";
    } else {
        EXPECT_FALSE(dx_got.defined()) << "x needs no grad";
    }
    EXPECT_TRUE(Matches(dw1_got, {kFfn, kHidden}, testing::RefLinearBackwardWeight(dh, xv, kRows, kFfn, kHidden), data,
                        c.dtype, HalfFactor(1, 2)))
        << "fc1 dW";
    EXPECT_TRUE(Matches(dw2_got, {kHidden, kFfn}, testing::RefLinearBackwardWeight(dyv, a, kRows, kHidden, kFfn), data,
                        c.dtype, HalfFactor(1, 2)))
        << "fc2 dW";
    if (c.bias) {
        EXPECT_TRUE(Matches(db1_got, {kFfn}, testing::RefColumnSum(dh, kRows, kFfn), data, c.dtype, HalfFactor(1, 2)))
            << "fc1 db";
        EXPECT_TRUE(Matches(db2_got, {kHidden}, testing::RefColumnSum(dyv, kRows, kHidden), data, c.dtype,
                            HalfFactor(sp ? tp : 1)))
            << "fc2 db";
    }
}

std::vector<MlpCase> MlpCases() {
    std::vector<MlpCase> cases;
    std::vector<DType> dtypes = {DType::kFloat32};
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    dtypes.push_back(DType::kBFloat16);
    dtypes.push_back(DType::kFloat16);
#endif
    for (DType dtype : dtypes) {
        for (bool sp : {false, true}) {
            for (bool bias : {true, false}) {
                for (bool input_grad : {true, false}) {
                    cases.push_back({.sequence_parallel = sp, .bias = bias, .input_grad = input_grad, .dtype = dtype});
                }
            }
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParallelMLPTest, ::testing::ValuesIn(MlpCases()), MlpCaseName);

// ---- data parallel × tensor parallel -------------------------------------------------------------------------------

struct DataParallelCase {
    bool sequence_parallel = false;
    DType dtype = DType::kFloat32; ///< float32: integer data, bitwise; bf16 / fp16: random data, fp32 main grads
};

std::string DataParallelCaseName(const ::testing::TestParamInfo<DataParallelCase> &info) {
    return fmt::format("{}_{}", info.param.sequence_parallel ? "sequenceparallel" : "tensorparallel",
                       DTypeTag(info.param.dtype));
}

void PrintTo(const DataParallelCase &c, std::ostream *os) {
    *os << DataParallelCaseName({c, 0});
}

class DataParallelTest : public ::testing::TestWithParam<DataParallelCase> {};

// column → row on the dp×tp mesh, batch (dim 1 of [s, b, h]) sharded on dp, GradSync with buckets small enough that
// there are several. Per step: the tp group runs the column → row table, the dp group exactly one all-reduce per
// bucket, all of them launched during backward (a bucket goes as soon as its gradients are complete, so Finish issues
// none), and after Finish every gradient equals the dense one over the whole batch (bitwise for fp32 integers; half
// parameters get fp32 main grads). Two steps with different data: ZeroGrad must leave nothing of the first behind.
TEST_P(DataParallelTest, GradSyncAllReducesEachBucketOnceDuringBackwardAndGradientsMatchDense) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const bool sp = GetParam().sequence_parallel;
    const DType dtype = GetParam().dtype;
    const Data data = IsHalf(dtype) ? Data::kRandom : Data::kInteger;
    DeviceMesh &mesh = DpTpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    const int dp_dim = mesh.dim_index("dp");
    const int tp_dim = mesh.dim_index("tp");
    nn::ColumnParallelLinear column({.in_features = kHidden,
                                     .out_features = kFfn,
                                     .sequence_parallel = sp},
                                    Tp(mesh), WithName(Param(dtype), "dp.column"));
    nn::RowParallelLinear row({.in_features = kFfn,
                               .out_features = kHidden,
                               .input_is_parallel = true,
                               .sequence_parallel = sp},
                              Tp(mesh), WithName(Param(dtype), "dp.row"));
    const Tensor w1 = MakeFull({kFfn, kHidden}, "w1", data, dtype, 15);
    const Tensor b1 = MakeFull({kFfn}, "b1", data, dtype, 15);
    const Tensor w2 = MakeFull({kHidden, kFfn}, "w2", data, dtype, 15);
    const Tensor b2 = MakeFull({kHidden}, "b2", data, dtype, 15);
    SetFull(column.weight, w1);
    SetFull(column.bias, b1);
    SetFull(row.weight, w2);
    SetFull(row.bias, b2);

    std::vector<Variable> params = column.Parameters();
    for (const Variable &p : row.Parameters()) {
        params.push_back(p);
    }
    std::int64_t local_bytes = 0; // the buckets are fp32 whatever the parameters' dtype
    for (const Variable &p : params) {
        local_bytes += 4 * p.local().numel();
    }
    // A bucket holds one weight shard and a bias shard at most: several buckets, and at least one with two
    // parameters (one all-reduce per bucket, not per parameter).
    const std::int64_t bucket_bytes = 4 * (column.weight.local().numel() + column.bias.local().numel());
    nn::GradSync sync(params, mesh, {.dp_dim = "dp", .bucket_bytes = bucket_bytes});
    const int buckets = sync.num_buckets();
    EXPECT_GE(buckets, 2);
    EXPECT_LT(buckets, static_cast<int>(params.size())) << "a bucket per parameter";

    // x [s, b, h]: b on dp; with sequence parallelism s on tp as well.
    const spmd::Layout x_layout = sp ? LayoutOf(3, {{0, {tp_dim}}, {1, {dp_dim}}}) : LayoutOf(3, {{1, {dp_dim}}});
    for (std::uint64_t step = 0; step < 2; ++step) {
        SCOPED_TRACE(fmt::format("step {}", step));
        const Tensor x_full = MakeFull({kSeq, kBatch, kHidden}, "x", data, dtype, 100 + step);
        const Tensor dy_full = MakeFull({kSeq, kBatch, kHidden}, "dy", data, dtype, 100 + step);
        sync.ZeroGrad();
        Variable x(DistTensor::FromFull(x_full, x_layout, mesh), true);

        ResetCounts(mesh);
        Variable y = row.Forward(column.Forward(x).output).output;
        ExpectCalls(mesh,
                    {{"tp", Planned(tp, sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1})}},
                    "forward");
        EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
            << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();

        ResetCounts(mesh);
        const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), mesh);
        y.Backward(&dy);
        // tp: the column → row table. dp: the buckets' all-reduces, already issued during backward (none over a
        // dp group of one rank).
        const Calls tp_backward =
            sp ? Calls{.all_gather = 1, .reduce_scatter = 1} : Calls{.all_reduce = 1};
        const int dp_calls = SizeOf(mesh, "dp") > 1 ? buckets : 0;
        ExpectCalls(mesh, {{"tp", Planned(tp, tp_backward)}, {"dp", {.all_reduce = dp_calls}}}, "backward");
        EXPECT_EQ(mesh.group("dp").Counts().Bytes(CollectiveKind::kAllReduce), dp_calls > 0 ? local_bytes : 0)
            << "the buckets cover every parameter's local gradient once";
        sync.Finish();
        ExpectCalls(mesh, {{"tp", Planned(tp, tp_backward)}, {"dp", {.all_reduce = dp_calls}}}, "backward + Finish");
        for (const Variable &p : params) {
            EXPECT_FALSE(p.grad().layout().IsPartial()) << p.name() << ": " << p.grad().ToString();
            EXPECT_EQ(p.grad().dtype(), DType::kFloat32) << p.name() << ": the main grad is fp32";
        }

        const Tensor y_got = y.value().FullTensor();
        const Tensor dx_got = FullGrad(x);
        const Tensor dw1_got = FullGrad(column.weight);
        const Tensor db1_got = FullGrad(column.bias);
        const Tensor dw2_got = FullGrad(row.weight);
        const Tensor db2_got = FullGrad(row.bias);
        const DensePair ref = ReferencePair(x_full, w1, &b1, w2, &b2, dy_full);
        // Half: h rounds before the row GEMM, y and dX sum tp rounded partials, and the parameter grads (summed in
        // fp32) see the rounding of h or dh; under SP the row db sums tp rounded partials.
        EXPECT_TRUE(Matches(y_got, {kSeq, kBatch, kHidden}, ref.y, data, dtype, HalfFactor(tp, 2))) << "y";
        EXPECT_TRUE(Matches(dx_got, {kSeq, kBatch, kHidden}, ref.dx, data, dtype, HalfFactor(tp, 1))) << "dX";
        EXPECT_TRUE(Matches(dw1_got, {kFfn, kHidden}, ref.dw1, data, dtype, HalfFactor(1, 2))) << "column dW";
        EXPECT_TRUE(Matches(db1_got, {kFfn}, ref.db1, data, dtype, HalfFactor(1, 2))) << "column db";
        EXPECT_TRUE(Matches(dw2_got, {kHidden, kFfn}, ref.dw2, data, dtype, HalfFactor(1, 2))) << "row dW";
        EXPECT_TRUE(Matches(db2_got, {kHidden}, ref.db2, data, dtype, HalfFactor(sp ? tp : 1))) << "row db";
    }
}

std::vector<DataParallelCase> DataParallelCases() {
    std::vector<DType> dtypes = {DType::kFloat32};
#if SHARDLINE_DIST_TENSOR_TEST_CUDA
    dtypes.push_back(DType::kBFloat16);
    dtypes.push_back(DType::kFloat16);
#endif
    std::vector<DataParallelCase> cases;
    for (DType dtype : dtypes) {
        for (bool sp : {false, true}) {
            cases.push_back({.sequence_parallel = sp, .dtype = dtype});
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Matrix, DataParallelTest, ::testing::ValuesIn(DataParallelCases()), DataParallelCaseName);

// ---- initialisation and errors -------------------------------------------------------------------------------------

// The counter-based RNG makes a parameter a function of (seed, name, global index): the gathered shards equal the
// single-process Linear's parameters of the same name, whatever tp is.
TEST(ParallelLinearInitTest, GatheredParametersEqualTheSingleProcessLinearForEveryTpSize) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const nn::ParameterOptions param = Param(DType::kFloat32);
    nn::ColumnParallelLinear column({.in_features = kHidden, .out_features = kFfn},
                                    Tp(mesh), WithName(param, "init.c"));
    nn::RowParallelLinear row({.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true},
                              Tp(mesh), WithName(param, "init.r"));
    nn::Linear dense_column({.in_features = kHidden, .out_features = kFfn}, WithName(param, "init.c"));
    nn::Linear dense_row({.in_features = kFfn, .out_features = kHidden}, WithName(param, "init.r"));
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

// Sizes that tp does not divide fail on every rank alike, in the constructor, before any collective: the message names
// the layer, its name, the dim, the size and tp.
TEST(ParallelLinearErrorsTest, ColumnOutFeaturesNotDivisibleByTpNamesLayerDimSizeAndTp) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 divides every size";
    }
    const std::int64_t out = 4 * tp + 1;
    ResetCounts(mesh);
    const std::string message = ShapeErrorOf(
        [&] { nn::ColumnParallelLinear({.in_features = kHidden, .out_features = out}, Tp(mesh), {.name = "qkv"}); });
    ExpectNames(message,
                {"ColumnParallelLinear", "'qkv'", fmt::format("out_features ({})", out), fmt::format("tp ({})", tp)});
    ExpectCalls(mesh, {}, "the failed constructor");
}

TEST(ParallelLinearErrorsTest, RowInFeaturesNotDivisibleByTpNamesLayerDimSizeAndTp) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = TpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 divides every size";
    }
    const std::int64_t in = 4 * tp + 1;
    ResetCounts(mesh);
    const std::string message = ShapeErrorOf(
        [&] { nn::RowParallelLinear({.in_features = in, .out_features = kHidden}, Tp(mesh), {.name = "proj"}); });
    ExpectNames(message,
                {"RowParallelLinear", "'proj'", fmt::format("in_features ({})", in), fmt::format("tp ({})", tp)});
    ExpectCalls(mesh, {}, "the failed constructor");
}

TEST(ParallelLinearErrorsTest, MlpFfnHiddenNotDivisibleByTpNamesItsColumnLayer) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    DeviceMesh &mesh = DpTpMesh();
    const std::int64_t tp = SizeOf(mesh, "tp");
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 divides every size";
    }
    const std::int64_t ffn = 4 * tp + 1;
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
        nn::ColumnParallelLinear({.in_features = kHidden,
                                  .out_features = kFfn,
                                  .gather_output = true,
                                  .sequence_parallel = true},
                                 Tp(mesh), {.name = "both"});
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
        nn::RowParallelLinear({.in_features = kFfn,
                               .out_features = kHidden,
                               .input_is_parallel = false,
                               .sequence_parallel = true},
                              Tp(mesh), {.name = "proj"});
    } catch (const Error &e) {
        message = e.what();
    }
    ExpectNames(message, {"RowParallelLinear", "'proj'", "sequence_parallel needs input_is_parallel"});
    ExpectCalls(mesh, {}, "the failed constructor");
}

} // namespace
} // namespace shardline
