#pragma once

// Shared by the gradient-consistency tests of the tensor-parallel modules (nn_*_test.cc: column, row, column -> row,
// ParallelMLP, dp x tp, init and errors): Megatron's [s, b, h] sizes, meshes built once per process, exact collective
// counts per mesh dim, full tensors from one seed, and the comparison with the dense float64 reference (bitwise for
// integer-valued operands; see HalfFactor for bf16 / fp16). BACKEND cpu (MPI) and BACKEND cuda (NCCL;
// SHARDLINE_DIST_TENSOR_TEST_CUDA) build them.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/autograd/variable.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/nn/linear.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

#include "dist_tensor_test_util.h"
#include "reference.h"

namespace shardline::nn_test {

using namespace dist_test;
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
inline Meshes &TheMeshes() {
    static Meshes meshes;
    return meshes;
}
class MeshEnvironment : public ::testing::Environment {
public:
    void TearDown() override { TheMeshes() = Meshes{}; }
};
inline const auto *const kMeshEnvironment = ::testing::AddGlobalTestEnvironment(new MeshEnvironment);

/// [W] {"tp"}: tp = world size.
inline DeviceMesh &TpMesh() {
    Meshes &m = TheMeshes();
    if (!m.tp) {
        m.tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{World().size()},
                                            std::vector<std::string>{"tp"});
    }
    return *m.tp;
}

/// [2, W/2] {"dp", "tp"} (rank = dp·TP + tp); [1, 1] on one rank.
inline DeviceMesh &DpTpMesh() {
    Meshes &m = TheMeshes();
    if (!m.dp_tp) {
        const std::int64_t dp = World().size() >= 2 ? 2 : 1;
        m.dp_tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{dp, World().size() / dp},
                                               std::vector<std::string>{"dp", "tp"});
    }
    return *m.dp_tp;
}

inline std::int64_t SizeOf(DeviceMesh &mesh, std::string_view dim) {
    return mesh.shape()[static_cast<std::size_t>(mesh.dim_index(dim))];
}

inline nn::TensorParallelGroup Tp(DeviceMesh &mesh) { return nn::TensorParallelGroup::Named(mesh, "tp"); }

/// A layout of a rank-`rank` tensor: tensor dim d sharded over the mesh dims `shards[d]` (major first).
inline spmd::Layout LayoutOf(int rank, const std::map<int, std::vector<int>> &shards) {
    std::vector<std::vector<int>> dims(static_cast<std::size_t>(rank));
    for (const auto &[d, mesh_dims] : shards) {
        dims[static_cast<std::size_t>(d)] = mesh_dims;
    }
    return spmd::Layout(std::move(dims));
}

/// Whether two layouts place every element alike on `mesh` (a mesh dim of one rank shards nothing).
inline bool SameLayout(DeviceMesh &mesh, const spmd::Layout &a, const spmd::Layout &b) {
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
inline Calls Planned(std::int64_t group_size, Calls calls) { return group_size > 1 ? calls : Calls{}; }

/// Zeroes the counters of the world and of every group of the mesh (creating them: every rank asks in one order).
inline void ResetCounts(DeviceMesh &mesh) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
    mesh.world().ResetCounts();
}

/// Exactly `want[name]` on each named mesh dim's group, nothing on the other groups, nothing on the world.
inline void ExpectCalls(DeviceMesh &mesh, const std::map<std::string, Calls> &want, std::string_view phase) {
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
inline Tensor MakeFull(const Shape &shape, std::string_view name, Data data, DType dtype, std::uint64_t seed) {
    if (data == Data::kInteger) {
        return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kInteger, -8, 8);
    }
    return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kNormal, 0.0, 1.0);
}

/// Overwrites this rank's shard of parameter `p` with its part of `full` (the module's own init is uniform random).
inline void SetFull(Variable &p, const Tensor &full) {
    const DistTensor shard = DistTensor::FromFull(full, p.value().layout(), p.value().mesh());
    Tensor local = p.local();
    local.CopyFrom(shard.local());
}

inline nn::ParameterOptions Param(DType dtype) { return {.dtype = dtype, .device = TestDevice(), .seed = 3}; }

inline nn::ParameterOptions WithName(nn::ParameterOptions param, std::string name) {
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
inline double HalfFactor(std::int64_t reduced_over, int extra_roundings = 0) {
    return static_cast<double>(reduced_over + extra_roundings);
}

/// Bitwise (shape and every value) for integer data; otherwise testing::CompareValues with the dtype's rtol (times
/// `half_factor` for bf16 / fp16, `fp32_factor` for float32).
inline ::testing::AssertionResult Matches(const Tensor &got, const Shape &shape, const Values &want, Data data,
                                          DType dtype, double half_factor = 1.0, double fp32_factor = 1.0) {
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
    const double rtol = testing::RelativeTolerance(dtype) * (IsHalf(dtype) ? half_factor : fp32_factor);
    const std::string message = testing::CompareValues(g, want, rtol);
    if (!message.empty()) {
        return ::testing::AssertionFailure() << message;
    }
    return ::testing::AssertionSuccess();
}

/// The full gradient of `v` (every rank; a collective when it is sharded), or undefined when it has none.
inline Tensor FullGrad(const Variable &v) { return v.grad().defined() ? v.grad().FullTensor() : Tensor(); }

inline std::string DataName(Data data) { return data == Data::kInteger ? "integer" : "random"; }

inline std::string DTypeTag(DType dtype) { return std::string(DTypeName(dtype)); }

/// The dense problem of one Linear, y[rows, out] = x[rows, in]·W[out, in]ᵀ + b, in float64.
struct DenseLinear {
    Values y, dx, dw, db;
};
inline DenseLinear ReferenceLinear(const Tensor &x, const Tensor &w, const Tensor *b, const Tensor &dy, std::int64_t in,
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

inline std::string BiasName(Bias bias) {
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

/// Dense float64 column → row: h = x·W1ᵀ + b1, y = h·W2ᵀ + b2 (gelu: y = gelu(h)·W2ᵀ + b2, ParallelMLP), and every
/// gradient.
using DensePair = testing::RefMlpResult;
inline DensePair ReferencePair(const Tensor &x, const Tensor &w1, const Tensor *b1, const Tensor &w2, const Tensor *b2,
                               const Tensor &dy, bool gelu = false) {
    const Values b1v = b1 != nullptr ? b1->ToDoubleVector() : Values();
    const Values b2v = b2 != nullptr ? b2->ToDoubleVector() : Values();
    return testing::RefMlp(x.ToDoubleVector(), w1.ToDoubleVector(), b1 != nullptr ? &b1v : nullptr, w2.ToDoubleVector(),
                           b2 != nullptr ? &b2v : nullptr, dy.ToDoubleVector(), kRows, kHidden, kFfn, gelu);
}

/// The full tensors of a column → row pair ([s, b, h] x and dY, W1 [ffn, h], b1, W2 [h, ffn], b2), one seed.
struct PairFull {
    Tensor x, w1, b1, w2, b2, dy;
};
inline PairFull MakePairFull(Data data, DType dtype, std::uint64_t seed) {
    return {.x = MakeFull({kSeq, kBatch, kHidden}, "x", data, dtype, seed),
            .w1 = MakeFull({kFfn, kHidden}, "w1", data, dtype, seed),
            .b1 = MakeFull({kFfn}, "b1", data, dtype, seed),
            .w2 = MakeFull({kHidden, kFfn}, "w2", data, dtype, seed),
            .b2 = MakeFull({kHidden}, "b2", data, dtype, seed),
            .dy = MakeFull({kSeq, kBatch, kHidden}, "dy", data, dtype, seed)};
}
/// What a column → row run computed, gathered to full tensors (a bias's gradient only when `bias`).
struct PairGot {
    Tensor y, dx, dw1, db1, dw2, db2;
};
inline PairGot GatherPair(const Variable &x, const Variable &y, const nn::ColumnParallelLinear &column,
                          const nn::RowParallelLinear &row, bool bias) {
    return {.y = y.value().FullTensor(),
            .dx = FullGrad(x),
            .dw1 = FullGrad(column.weight),
            .db1 = bias ? FullGrad(column.bias) : Tensor(),
            .dw2 = FullGrad(row.weight),
            .db2 = bias ? FullGrad(row.bias) : Tensor()};
}
/// Sets the pair's parameters from `full` (the biases only when `bias`).
inline void SetPairFull(nn::ColumnParallelLinear &column, nn::RowParallelLinear &row, const PairFull &full, bool bias) {
    SetFull(column.weight, full.w1);
    SetFull(row.weight, full.w2);
    if (bias) {
        SetFull(column.bias, full.b1);
        SetFull(row.bias, full.b2);
    }
}

/// The tp collectives of column → row: forward one all-reduce, backward one all-reduce of dX if x requires grad; with
/// sequence parallelism an all-gather (x, then dY) and a reduce-scatter (y, then dX if x requires grad).
inline Calls PairCalls(bool sequence_parallel, bool input_grad = true) {
    const int dx = input_grad ? 1 : 0;
    return sequence_parallel ? Calls{.all_gather = 1, .reduce_scatter = dx} : Calls{.all_reduce = dx};
}

/// After a column → row forward: the tp group issued PairCalls and y came back in x's layout.
inline void ExpectPairForward(DeviceMesh &mesh, bool sequence_parallel, const Variable &x, const Variable &y) {
    ExpectCalls(mesh, {{"tp", Planned(SizeOf(mesh, "tp"), PairCalls(sequence_parallel))}}, "forward");
    EXPECT_TRUE(SameLayout(mesh, y.value().layout(), x.value().layout()))
        << "y comes back in x's layout: " << y.value().ToString() << " vs " << x.value().ToString();
}

} // namespace shardline::nn_test
