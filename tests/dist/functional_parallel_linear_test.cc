// The functional column/row-parallel Linear (docs/functional.md) on caller-owned memory, against a single-rank dense
// float64 reference (tests/common/reference.h). Every rank builds the same full X [s, b, K], W [N, K], b [N] and dY
// from one seed, takes its shard, calls the functional API on raw pointers, gathers the outputs and gradients to full
// tensors and compares: bitwise with integer-valued operands (|x| <= 8, K <= 512: every fp32 sum is exact), rtol 1e-5
// for random fp32, and on the GPU rtol 1.6e-2 for bf16 and 1e-3 for fp16. Each call's collectives are asserted from
// the tp group's counters against DESIGN.md §6 (none at all when tp = 1).
//
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_FUNCTIONAL_TEST_CUDA) build this file.

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/spmd/layout.h>

#include "dist_test.h"
#include "reference.h"

#if SHARDLINE_FUNCTIONAL_TEST_CUDA
#include <cuda_runtime_api.h>
#define SHARDLINE_FUNCTIONAL_TEST_BACKEND() SHARDLINE_DIST_REQUIRE_CUDA()
#else
#define SHARDLINE_FUNCTIONAL_TEST_BACKEND()                                                                            \
    do {                                                                                                               \
    } while (0)
#endif

namespace shardline {
namespace {

using comm::CollectiveKind;
using comm::DeviceMesh;
using functional::ColumnParallelLinearBackward;
using functional::ColumnParallelLinearForward;
using functional::ColumnParallelLinearOptions;
using functional::GradMode;
using functional::RowParallelLinearBackward;
using functional::RowParallelLinearForward;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using functional::TensorView;
using testing::Values;

constexpr std::int64_t kIn = 16;  // K: divides by 1, 2 and 4
constexpr std::int64_t kOut = 24; // N: divides by 1, 2 and 4

comm::Communicator &World() {
    return testing::DistEnv().world();
}
Device TestDevice() {
    return testing::DistEnv().device();
}

// ---- meshes: built once per process (an NCCL split costs ~1 s on 4 ranks), torn down before the environment
// ----------

enum class MeshKind {
    kTp,   ///< [W] {"tp"}: every rank in one tp group
    kDpTp, ///< [W/2, 2] {"dp", "tp"}, tp_dim 1 ([1, 1] on one rank)
    kTpDp, ///< [2, W/2] {"tp", "dp"}, tp_dim 0 ([1, 1] on one rank)
};

struct Meshes {
    std::unique_ptr<DeviceMesh> tp;
    std::unique_ptr<DeviceMesh> dp_tp;
    std::unique_ptr<DeviceMesh> tp_dp;
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

struct MeshAndDim {
    DeviceMesh &mesh;
    int tp_dim;
    std::int64_t tp() const { return mesh.shape()[static_cast<std::size_t>(tp_dim)]; }
    /// This rank's coordinate on the mesh dim that is not tp (0 on a 1-D mesh): the data-parallel replica.
    std::int64_t replica() const {
        return mesh.ndim() == 1 ? 0 : mesh.coordinate()[static_cast<std::size_t>(1 - tp_dim)];
    }
    TensorParallelGroup group() const { return TensorParallelGroup{.mesh = &mesh, .tp_dim = tp_dim}; }
};

MeshAndDim GetMesh(MeshKind kind) {
    Meshes &m = TheMeshes();
    const std::int64_t w = World().size();
    const std::int64_t half = w >= 2 ? w / 2 : 1;
    const std::int64_t two = w >= 2 ? 2 : 1;
    switch (kind) {
    case MeshKind::kTp:
        if (!m.tp) {
            m.tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{w}, std::vector<std::string>{"tp"});
        }
        return {*m.tp, 0};
    case MeshKind::kDpTp:
        if (!m.dp_tp) {
            m.dp_tp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{half, two},
                                                   std::vector<std::string>{"dp", "tp"});
        }
        return {*m.dp_tp, 1};
    case MeshKind::kTpDp:
        if (!m.tp_dp) {
            m.tp_dp = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{two, half},
                                                   std::vector<std::string>{"tp", "dp"});
        }
        return {*m.tp_dp, 0};
    }
    throw Error("unknown mesh kind");
}

// ---- tensors
// ---------------------------------------------------------------------------------------------------------

enum class Data { kInteger, kRandom };

std::string DataName(Data data) {
    return data == Data::kInteger ? "integer" : "random";
}

/// A full tensor, the same on every rank of one data-parallel replica: a pure function of (seed, name, index).
Tensor MakeFull(const Shape &shape, std::string_view name, Data data, DType dtype, std::uint64_t seed) {
    if (data == Data::kInteger) {
        return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kInteger, -8, 8);
    }
    return testing::RandomTensor(shape, dtype, TestDevice(), seed, name, RandomDistribution::kNormal, 0.0, 1.0);
}

/// An output buffer filled with NaN, so an element the call does not write fails every comparison.
Tensor Poisoned(const Shape &shape, DType dtype) {
    return Tensor::Full(shape, std::numeric_limits<double>::quiet_NaN(), dtype, TestDevice());
}

spmd::Layout SplitOn(int rank, int tensor_dim, int tp_dim) {
    std::vector<int> mapping(static_cast<std::size_t>(rank), -1);
    if (tensor_dim >= 0) {
        mapping[static_cast<std::size_t>(tensor_dim)] = tp_dim;
    }
    return spmd::Layout::FromDimsMapping(mapping);
}

/// This rank's part of `full` split on `tensor_dim` over tp (a copy; -1: the whole tensor, copied).
Tensor Shard(const Tensor &full, int tensor_dim, const MeshAndDim &m) {
    return dist::DistTensor::FromFull(full, SplitOn(full.rank(), tensor_dim, m.tp_dim), m.mesh).local();
}

/// The full tensor from every tp rank's `local` split on `tensor_dim` (all-gathers over tp; -1: local is full).
Tensor Gather(const Tensor &local, const Shape &global, int tensor_dim, const MeshAndDim &m) {
    if (tensor_dim < 0) {
        return local;
    }
    return dist::DistTensor(local, global, SplitOn(static_cast<int>(global.size()), tensor_dim, m.tp_dim), m.mesh)
        .FullTensor();
}

TensorView ViewOf(const Tensor &t) {
    TensorView v{.data = t.data(), .dtype = t.dtype(), .ndim = t.rank()};
    for (int d = 0; d < t.rank(); ++d) {
        v.shape[d] = t.size(d);
    }
    return v;
}

Shape WithLast(Shape shape, std::int64_t last) {
    shape.push_back(last);
    return shape;
}

std::int64_t Rows(const Shape &lead) {
    return Numel(lead);
}

Values Plus(Values a, const Values &b) {
    for (std::size_t i = 0; i < a.size(); ++i) {
        a[i] += b[i];
    }
    return a;
}

/// Bitwise for integer data, CompareValues (rtol by dtype) for random data. `reduced_over` is the number of ranks whose
/// half-precision partial results were summed into `got` (row y, column dx): each partial is rounded to the dtype and
/// the reduction rounds each of its additions (NCCL reduces in the dtype), about 2·tp roundings instead of the one of a
/// local GEMM, so a half type's rtol is multiplied by tp there (simulated on these shapes: fp16 at tp 4 reaches 2.5x
/// its rtol, bf16 1.1x). float32's rtol (1e-5, some 170 roundings) needs no scaling.
::testing::AssertionResult Matches(const Tensor &got, const Values &want, Data data, DType dtype,
                                   std::int64_t reduced_over = 1) {
    const Values g = got.ToDoubleVector();
    if (g.size() != want.size()) {
        return ::testing::AssertionFailure()
               << got.ToString() << " has " << g.size() << " values, expected " << want.size();
    }
    if (data == Data::kInteger) {
        for (std::size_t i = 0; i < g.size(); ++i) {
            if (!(g[i] == want[i])) {
                return ::testing::AssertionFailure() << "element " << i << " is " << g[i] << ", expected exactly "
                                                     << want[i] << " (" << got.ToString() << ")";
            }
        }
        return ::testing::AssertionSuccess();
    }
    const double rtol = testing::RelativeTolerance(dtype) * (IsHalf(dtype) ? static_cast<double>(reduced_over) : 1.0);
    const std::string message = testing::CompareValues(g, want, rtol);
    if (!message.empty()) {
        return ::testing::AssertionFailure() << message << " (" << got.ToString() << ")";
    }
    return ::testing::AssertionSuccess();
}

// ---- collective counts
// -----------------------------------------------------------------------------------------------

struct Calls {
    std::int64_t all_reduce = 0;
    std::int64_t all_gather = 0;
    std::int64_t reduce_scatter = 0;
};

/// Zeroes the counters of every group of the mesh (creating them: every rank asks in the same order).
void ResetCounts(const MeshAndDim &m) {
    for (int d = 0; d < m.mesh.ndim(); ++d) {
        m.mesh.group(d).ResetCounts();
    }
    m.mesh.world().ResetCounts();
}

/// The tp group ran exactly `want` (nothing when tp = 1); every other group and the world ran nothing.
void ExpectCalls(const MeshAndDim &m, Calls want, std::string_view what) {
    if (m.tp() == 1) {
        want = {};
    }
    const comm::CollectiveCounts tp = m.mesh.group(m.tp_dim).Counts();
    EXPECT_EQ(tp.Calls(CollectiveKind::kAllReduce), want.all_reduce) << what << ": all_reduce on tp";
    EXPECT_EQ(tp.Calls(CollectiveKind::kAllGather), want.all_gather) << what << ": all_gather on tp";
    EXPECT_EQ(tp.Calls(CollectiveKind::kReduceScatter), want.reduce_scatter) << what << ": reduce_scatter on tp";
    EXPECT_EQ(tp.TotalCalls(), want.all_reduce + want.all_gather + want.reduce_scatter) << what << ": other on tp";
    for (int d = 0; d < m.mesh.ndim(); ++d) {
        if (d != m.tp_dim) {
            EXPECT_EQ(m.mesh.group(d).Counts().TotalCalls(), 0) << what << ": mesh dim " << d << " is not tp";
        }
    }
    EXPECT_EQ(m.mesh.world().Counts().TotalCalls(), 0) << what << ": world";
}

// ---- the dense problem
// -------------------------------------------------------------------------------------------------

struct Problem {
    Shape lead; ///< global leading dims [s, ...]
    Data data = Data::kInteger;
    DType dtype = DType::kFloat32;
    std::uint64_t seed = 1;
};

struct Dense {
    Tensor x, w, b, dy;   ///< full tensors on the test device
    Values y, dx, dw, db; ///< float64 references
};

Dense MakeDense(const Problem &p, const MeshAndDim &m) {
    // Each data-parallel replica has its own data: a collective that leaked across replicas would mix them.
    const std::uint64_t seed = p.seed + 1000 * static_cast<std::uint64_t>(m.replica());
    Dense d;
    d.x = MakeFull(WithLast(p.lead, kIn), "x", p.data, p.dtype, seed);
    d.w = MakeFull({kOut, kIn}, "w", p.data, p.dtype, seed);
    d.b = MakeFull({kOut}, "b", p.data, p.dtype, seed);
    d.dy = MakeFull(WithLast(p.lead, kOut), "dy", p.data, p.dtype, seed);
    const std::int64_t rows = Rows(p.lead);
    const Values x = d.x.ToDoubleVector();
    const Values w = d.w.ToDoubleVector();
    const Values b = d.b.ToDoubleVector();
    const Values dy = d.dy.ToDoubleVector();
    d.y = testing::RefLinearForward(x, w, &b, rows, kOut, kIn);
    d.dx = testing::RefLinearBackwardInput(dy, w, rows, kOut, kIn);
    d.dw = testing::RefLinearBackwardWeight(dy, x, rows, kOut, kIn);
    d.db = testing::RefColumnSum(dy, rows, kOut);
    return d;
}

Values WithoutBias(const Dense &d, const Problem &p) {
    const Values x = d.x.ToDoubleVector();
    const Values w = d.w.ToDoubleVector();
    return testing::RefLinearForward(x, w, nullptr, Rows(p.lead), kOut, kIn);
}

/// Which gradients a backward asks for, and how the parameter grads are written.
struct Wants {
    bool dx = true;
    bool dweight = true;
    bool dbias = true;
    GradMode mode = GradMode::kOverwrite;
};

// ---- column parallel
// ---------------------------------------------------------------------------------------------------

struct ColumnCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool bias = true;
    bool gather_output = false;
    bool sequence_parallel = false;
    bool keep_x_total = true; ///< sequence_parallel: the forward fills x_total and the backward reuses it
    Wants wants{};
};

std::string Describe(const ColumnCase &c, std::int64_t tp) {
    return fmt::format("column tp={} lead={} {} {} bias={} gather_output={} sequence_parallel={} keep_x_total={} "
                       "dx={} dweight={} dbias={} accumulate={}",
                       tp, ShapeToString(c.problem.lead), DataName(c.problem.data), DTypeName(c.problem.dtype), c.bias,
                       c.gather_output, c.sequence_parallel, c.keep_x_total, c.wants.dx, c.wants.dweight, c.wants.dbias,
                       c.wants.mode == GradMode::kAccumulate);
}

void RunColumn(const ColumnCase &c) {
    const MeshAndDim m = GetMesh(c.mesh);
    const std::int64_t tp = m.tp();
    const std::string what = Describe(c, tp);
    SCOPED_TRACE(what);
    const Problem &p = c.problem;
    const Dense d = MakeDense(p, m);
    const int rank = static_cast<int>(p.lead.size()) + 1;
    const ColumnParallelLinearOptions options{.in_features = kIn,
                                              .out_features = kOut,
                                              .bias = c.bias,
                                              .gather_output = c.gather_output,
                                              .sequence_parallel = c.sequence_parallel};

    // Forward.
    const Tensor x = c.sequence_parallel ? Shard(d.x, 0, m) : d.x;
    const Tensor w = Shard(d.w, 0, m);
    const Tensor b = Shard(d.b, 0, m);
    const Shape y_global = WithLast(p.lead, kOut);
    const int y_split = c.gather_output ? -1 : rank - 1;
    Tensor y = Poisoned(WithLast(p.lead, c.gather_output ? kOut : kOut / tp), p.dtype);
    Tensor x_total;
    if (c.sequence_parallel && c.keep_x_total) {
        x_total = Poisoned(d.x.shape(), p.dtype);
    }
    ResetCounts(m);
    const functional::ForwardInfo fwd =
        ColumnParallelLinearForward(options,
                                    {.x = ViewOf(x),
                                     .weight = ViewOf(w),
                                     .bias = c.bias ? ViewOf(b) : TensorView{},
                                     .y = ViewOf(y),
                                     .x_total = x_total.defined() ? ViewOf(x_total) : TensorView{}},
                                    m.group());
    Synchronize(TestDevice());
    const Calls fwd_calls{.all_gather = (c.sequence_parallel ? 1 : 0) + (c.gather_output ? 1 : 0)};
    ExpectCalls(m, fwd_calls, "forward");
    EXPECT_EQ(fwd.collectives, tp == 1 ? 0 : fwd_calls.all_gather);
    EXPECT_EQ(fwd.saved_input,
              x_total.defined() ? functional::SavedInput::kGatheredInput : functional::SavedInput::kInput);
    EXPECT_TRUE(Matches(Gather(y, y_global, y_split, m), c.bias ? d.y : WithoutBias(d, p), p.data, p.dtype)) << "y";
    if (x_total.defined()) {
        EXPECT_TRUE(Matches(x_total, d.x.ToDoubleVector(), Data::kInteger, p.dtype)) << "x_total is the gathered x";
    }

    // Backward.
    const Tensor dy = c.gather_output ? d.dy : Shard(d.dy, rank - 1, m);
    Tensor dx = c.wants.dx ? Poisoned(x.shape(), p.dtype) : Tensor();
    const bool accumulate = c.wants.mode == GradMode::kAccumulate;
    // Accumulation goes into fp32 main grads holding earlier values; overwriting into the parameters' dtype.
    const DType grad_dtype = accumulate ? DType::kFloat32 : p.dtype;
    const Tensor dw_before = MakeFull({kOut, kIn}, "main_dw", Data::kInteger, grad_dtype, 7);
    const Tensor db_before = MakeFull({kOut}, "main_db", Data::kInteger, grad_dtype, 7);
    Tensor dw =
        c.wants.dweight ? (accumulate ? Shard(dw_before, 0, m) : Poisoned({kOut / tp, kIn}, grad_dtype)) : Tensor();
    Tensor db =
        c.wants.dbias && c.bias ? (accumulate ? Shard(db_before, 0, m) : Poisoned({kOut / tp}, grad_dtype)) : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo bwd =
        ColumnParallelLinearBackward(options,
                                     {.dy = ViewOf(dy),
                                      .x = ViewOf(x),
                                      .x_total = x_total.defined() ? ViewOf(x_total) : TensorView{},
                                      .weight = ViewOf(w),
                                      .dx = dx.defined() ? ViewOf(dx) : TensorView{},
                                      .dweight = dw.defined() ? ViewOf(dw) : TensorView{},
                                      .dbias = db.defined() ? ViewOf(db) : TensorView{},
                                      .param_grads = c.wants.mode},
                                     m.group());
    Synchronize(TestDevice());
    // §6: dx is all-reduced (reduce-scattered under sequence parallelism) only when requested; dY's slice for
    // gather_output is local; dweight needs the gathered input again only when the forward did not keep it.
    const bool any = dx.defined() || dw.defined() || db.defined();
    const Calls bwd_calls{.all_reduce = dx.defined() && !c.sequence_parallel ? 1 : 0,
                          .all_gather = any && dw.defined() && c.sequence_parallel && !x_total.defined() ? 1 : 0,
                          .reduce_scatter = dx.defined() && c.sequence_parallel ? 1 : 0};
    ExpectCalls(m, bwd_calls, "backward");
    EXPECT_EQ(bwd.collectives, tp == 1 ? 0 : bwd_calls.all_reduce + bwd_calls.all_gather + bwd_calls.reduce_scatter);
    if (dx.defined()) {
        EXPECT_TRUE(Matches(Gather(dx, d.x.shape(), c.sequence_parallel ? 0 : -1, m), d.dx, p.data, p.dtype, tp))
            << "dx";
    }
    if (dw.defined()) {
        const Values want = accumulate ? Plus(dw_before.ToDoubleVector(), d.dw) : d.dw;
        EXPECT_TRUE(Matches(Gather(dw, {kOut, kIn}, 0, m), want, p.data, p.dtype)) << "dweight";
    }
    if (db.defined()) {
        const Values want = accumulate ? Plus(db_before.ToDoubleVector(), d.db) : d.db;
        EXPECT_TRUE(Matches(Gather(db, {kOut}, 0, m), want, p.data, p.dtype)) << "dbias";
    }
}

// ---- row parallel
// ------------------------------------------------------------------------------------------------------

struct RowCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool bias = true;
    bool input_is_parallel = true;
    bool sequence_parallel = false;
    Wants wants{};
};

std::string Describe(const RowCase &c, std::int64_t tp) {
    return fmt::format("row tp={} lead={} {} {} bias={} input_is_parallel={} sequence_parallel={} dx={} dweight={} "
                       "dbias={} accumulate={}",
                       tp, ShapeToString(c.problem.lead), DataName(c.problem.data), DTypeName(c.problem.dtype), c.bias,
                       c.input_is_parallel, c.sequence_parallel, c.wants.dx, c.wants.dweight, c.wants.dbias,
                       c.wants.mode == GradMode::kAccumulate);
}

void RunRow(const RowCase &c) {
    const MeshAndDim m = GetMesh(c.mesh);
    const std::int64_t tp = m.tp();
    const std::string what = Describe(c, tp);
    SCOPED_TRACE(what);
    const Problem &p = c.problem;
    const Dense d = MakeDense(p, m);
    const int rank = static_cast<int>(p.lead.size()) + 1;
    const RowParallelLinearOptions options{.in_features = kIn,
                                           .out_features = kOut,
                                           .bias = c.bias,
                                           .input_is_parallel = c.input_is_parallel,
                                           .sequence_parallel = c.sequence_parallel};

    // Forward.
    const int x_split = c.input_is_parallel ? rank - 1 : -1;
    const Tensor x = c.input_is_parallel ? Shard(d.x, rank - 1, m) : d.x;
    const Tensor w = Shard(d.w, 1, m);
    const Tensor &b = d.b;
    const Shape y_global = WithLast(p.lead, kOut);
    const int y_split = c.sequence_parallel ? 0 : -1;
    Shape y_shape = y_global;
    if (c.sequence_parallel) {
        y_shape[0] /= tp;
    }
    Tensor y = Poisoned(y_shape, p.dtype);
    ResetCounts(m);
    const functional::ForwardInfo fwd = RowParallelLinearForward(
        options, {.x = ViewOf(x), .weight = ViewOf(w), .bias = c.bias ? ViewOf(b) : TensorView{}, .y = ViewOf(y)},
        m.group());
    Synchronize(TestDevice());
    // §6: the Partial output is all-reduced (reduce-scattered on the sequence) and the bias added once afterwards.
    const Calls fwd_calls{.all_reduce = c.sequence_parallel ? 0 : 1, .reduce_scatter = c.sequence_parallel ? 1 : 0};
    ExpectCalls(m, fwd_calls, "forward");
    EXPECT_EQ(fwd.collectives, tp == 1 ? 0 : 1);
    EXPECT_EQ(fwd.saved_input, functional::SavedInput::kInput);
    EXPECT_TRUE(Matches(Gather(y, y_global, y_split, m), c.bias ? d.y : WithoutBias(d, p), p.data, p.dtype, tp)) << "y";

    // Backward.
    const Tensor dy = c.sequence_parallel ? Shard(d.dy, 0, m) : d.dy;
    Tensor dx = c.wants.dx ? Poisoned(x.shape(), p.dtype) : Tensor();
    const bool accumulate = c.wants.mode == GradMode::kAccumulate;
    const DType grad_dtype = accumulate ? DType::kFloat32 : p.dtype;
    const Tensor dw_before = MakeFull({kOut, kIn}, "main_dw", Data::kInteger, grad_dtype, 7);
    const Tensor db_before = MakeFull({kOut}, "main_db", Data::kInteger, grad_dtype, 7);
    Tensor dw =
        c.wants.dweight ? (accumulate ? Shard(dw_before, 1, m) : Poisoned({kOut, kIn / tp}, grad_dtype)) : Tensor();
    Tensor db = c.wants.dbias && c.bias ? (accumulate ? db_before.Clone() : Poisoned({kOut}, grad_dtype)) : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo bwd = RowParallelLinearBackward(options,
                                                                   {.dy = ViewOf(dy),
                                                                    .x = ViewOf(x),
                                                                    .weight = ViewOf(w),
                                                                    .dx = dx.defined() ? ViewOf(dx) : TensorView{},
                                                                    .dweight = dw.defined() ? ViewOf(dw) : TensorView{},
                                                                    .dbias = db.defined() ? ViewOf(db) : TensorView{},
                                                                    .param_grads = c.wants.mode},
                                                                   m.group());
    Synchronize(TestDevice());
    // §6: none for a parallel input; all-gather dY under sequence parallelism; a replicated input's dx is all-gathered
    // back to [s, ..., K] (only when requested). The bias grad is the rule's: Replicate, from the gathered dY.
    const bool any = dx.defined() || dw.defined() || db.defined();
    const Calls bwd_calls{.all_gather =
                              (any && c.sequence_parallel ? 1 : 0) + (dx.defined() && !c.input_is_parallel ? 1 : 0)};
    ExpectCalls(m, bwd_calls, "backward");
    EXPECT_EQ(bwd.collectives, tp == 1 ? 0 : bwd_calls.all_gather);
    if (dx.defined()) {
        EXPECT_TRUE(Matches(Gather(dx, d.x.shape(), x_split, m), d.dx, p.data, p.dtype)) << "dx";
    }
    if (dw.defined()) {
        const Values want = accumulate ? Plus(dw_before.ToDoubleVector(), d.dw) : d.dw;
        EXPECT_TRUE(Matches(Gather(dw, {kOut, kIn}, 1, m), want, p.data, p.dtype)) << "dweight";
    }
    if (db.defined()) {
        const Values want = accumulate ? Plus(db_before.ToDoubleVector(), d.db) : d.db;
        EXPECT_TRUE(Matches(db, want, p.data, p.dtype)) << "dbias, on every rank";
    }
}

const std::vector<Problem> &Fp32Problems() {
    static const std::vector<Problem> problems = {
        {.lead = {8, 2}, .data = Data::kInteger, .seed = 11},
        {.lead = {8, 2}, .data = Data::kRandom, .seed = 12},
        {.lead = {12}, .data = Data::kInteger, .seed = 13},
    };
    return problems;
}

// ---- column parallel: DESIGN.md §6 rows 1-3
// ----------------------------------------------------------------------------

// x R, W S(0), b S(0) -> y S(-1); backward dx P(sum) -> R: one all-reduce.
TEST(ColumnParallelLinearTest, ReplicatedInputMatchesDenseWithNoForwardCollectiveAndOneDxAllReduce) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunColumn({.problem = p, .bias = bias});
        }
    }
}

// needs_input_grad = false: no dx, so no all-reduce at all (Megatron's backward all-reduce is dx's).
TEST(ColumnParallelLinearTest, BackwardSkipsInputAllReduceWhenDxIsNotRequested) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false, .dbias = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = true, .dweight = false, .dbias = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false, .dweight = false, .dbias = false}});
}

// x S(0) -> R: all-gather (kept in x_total); backward dx P(sum) -> S(0): reduce-scatter.
TEST(ColumnParallelLinearTest, SequenceParallelAllGathersInputAndReduceScattersDx) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunColumn({.problem = p, .bias = bias, .sequence_parallel = true});
        }
    }
    RunColumn({.problem = Fp32Problems()[0], .sequence_parallel = true, .wants = {.dx = false}});
}

// Without x_total the rule's grad input plan gathers x again for dweight: one more all-gather, and none without
// dweight.
TEST(ColumnParallelLinearTest, SequenceParallelGathersInputAgainWhenTheForwardDidNotKeepIt) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[1], .sequence_parallel = true, .keep_x_total = false});
    RunColumn({.problem = Fp32Problems()[0], .sequence_parallel = true, .keep_x_total = false, .wants = {.dx = false}});
    RunColumn({.problem = Fp32Problems()[0],
               .sequence_parallel = true,
               .keep_x_total = false,
               .wants = {.dx = true, .dweight = false}});
}

// y S(-1) -> R: + all-gather; backward dY R -> S(-1): a local slice, no collective.
TEST(ColumnParallelLinearTest, GatherOutputAllGathersYAndSlicesDyLocally) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        RunColumn({.problem = p, .gather_output = true});
    }
    RunColumn({.problem = Fp32Problems()[0], .gather_output = true, .wants = {.dx = false}});
}

TEST(ColumnParallelLinearTest, AccumulatesParameterGradsIntoMainGrads) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[0], .wants = {.mode = GradMode::kAccumulate}});
    RunColumn({.problem = Fp32Problems()[1], .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dweight = false, .mode = GradMode::kAccumulate}});
}

// ---- row parallel: DESIGN.md §6 rows 4-5
// -------------------------------------------------------------------------------

// x S(-1), W S(1) -> y P(sum) -> R: one all-reduce, then + bias once; backward: nothing.
TEST(RowParallelLinearTest, InputIsParallelAllReducesYThenAddsBiasOnce) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunRow({.problem = p, .bias = bias});
        }
    }
    RunRow({.problem = Fp32Problems()[0], .wants = {.dx = false}});
}

// y P(sum) -> S(0): reduce-scatter, then + bias; backward dY S(0) -> R: all-gather. dbias comes out Replicate (the rule
// sums the gathered dY), so it needs no collective of its own.
TEST(RowParallelLinearTest, SequenceParallelReduceScattersYAndAllGathersDy) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunRow({.problem = p, .bias = bias, .sequence_parallel = true});
        }
    }
    RunRow({.problem = Fp32Problems()[0], .sequence_parallel = true, .wants = {.dx = false, .dweight = false}});
}

// x R -> S(-1): a local slice; backward dx S(-1) -> R: all-gather, only when dx is requested.
TEST(RowParallelLinearTest, ReplicatedInputIsSlicedLocallyAndItsDxAllGathered) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        RunRow({.problem = p, .input_is_parallel = false});
    }
    RunRow({.problem = Fp32Problems()[0], .input_is_parallel = false, .wants = {.dx = false}});
}

TEST(RowParallelLinearTest, AccumulatesParameterGradsIntoMainGrads) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunRow({.problem = Fp32Problems()[0], .wants = {.mode = GradMode::kAccumulate}});
    RunRow({.problem = Fp32Problems()[1], .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
}

// ---- meshes with a data-parallel dim
// -----------------------------------------------------------------------------------

// dp x tp with tp the minor dim, and tp x dp with tp the major one: each replica has its own data, collectives run on
// the tp group only and the results match each replica's dense reference.
TEST(FunctionalLinearTest, DataParallelMeshCommunicatesOverTheTpDimOnly) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (MeshKind mesh : {MeshKind::kDpTp, MeshKind::kTpDp}) {
        RunColumn({.mesh = mesh, .problem = Fp32Problems()[0]});
        RunColumn({.mesh = mesh, .problem = Fp32Problems()[0], .sequence_parallel = true});
        RunRow({.mesh = mesh, .problem = Fp32Problems()[0]});
        RunRow({.mesh = mesh, .problem = Fp32Problems()[1], .sequence_parallel = true});
    }
}

// ---- the cache
// ---------------------------------------------------------------------------------------------------------

TEST(FunctionalLinearTest, SteadyStateCallsFindTheirRuleAndPlansWithoutInferring) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    functional::ClearPlanCache();
    const ColumnCase c{.problem = Fp32Problems()[0], .sequence_parallel = true};
    RunColumn(c); // forward infers (forward + grad rule at once); backward finds them
    const functional::PlanCacheStats first = functional::GetPlanCacheStats();
    EXPECT_EQ(first.misses, 1u);
    EXPECT_EQ(first.hits, 1u);
    EXPECT_EQ(first.size, 1u);
    RunColumn(c);
    RunColumn(c);
    const functional::PlanCacheStats later = functional::GetPlanCacheStats();
    EXPECT_EQ(later.misses, 1u) << "a steady-state call infers nothing";
    EXPECT_EQ(later.hits, 5u);
    RunRow({.problem = Fp32Problems()[0]}); // another configuration: one more inference
    EXPECT_EQ(functional::GetPlanCacheStats().misses, 2u);
    EXPECT_EQ(functional::GetPlanCacheStats().size, 2u);
}

// ---- an MLP in a foreign training loop (docs/functional.md's example)
// -------------------------------------------------

// Column (sequence parallel) -> GELU -> row (sequence parallel), forward and backward with the caller's own buffers
// and "autograd" (the caller keeps x_total and h), against the dense MLP.
TEST(FunctionalLinearTest, ColumnThenRowMlpMatchesTheDenseMlp) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    constexpr std::int64_t kS = 8;
    constexpr std::int64_t kH = 16;
    constexpr std::int64_t kF = 32;
    const DType f32 = DType::kFloat32;
    const Tensor x_full = MakeFull({kS, kH}, "x", Data::kRandom, f32, 5);
    const Tensor w1_full = MakeFull({kF, kH}, "w1", Data::kRandom, f32, 5);
    const Tensor b1_full = MakeFull({kF}, "b1", Data::kRandom, f32, 5);
    const Tensor w2_full = MakeFull({kH, kF}, "w2", Data::kRandom, f32, 5);
    const Tensor b2_full = MakeFull({kH}, "b2", Data::kRandom, f32, 5);
    const Tensor dz_full = MakeFull({kS, kH}, "dz", Data::kRandom, f32, 5);

    // The trainer's own tensors: this rank's shards.
    const Tensor x = Shard(x_full, 0, m);
    const Tensor w1 = Shard(w1_full, 0, m);
    const Tensor b1 = Shard(b1_full, 0, m);
    const Tensor w2 = Shard(w2_full, 1, m);
    const Tensor &b2 = b2_full;
    const Tensor dz = Shard(dz_full, 0, m);
    const ColumnParallelLinearOptions fc1{.in_features = kH, .out_features = kF, .sequence_parallel = true};
    const RowParallelLinearOptions fc2{
        .in_features = kF, .out_features = kH, .input_is_parallel = true, .sequence_parallel = true};

    Tensor x_total = Tensor::Empty({kS, kH}, f32, TestDevice());
    Tensor h = Tensor::Empty({kS, kF / tp}, f32, TestDevice());
    ColumnParallelLinearForward(
        fc1, {.x = ViewOf(x), .weight = ViewOf(w1), .bias = ViewOf(b1), .y = ViewOf(h), .x_total = ViewOf(x_total)},
        m.group());
    const Tensor a = kernels::GeluForward(h);
    Tensor z = Tensor::Empty({kS / tp, kH}, f32, TestDevice());
    RowParallelLinearForward(fc2, {.x = ViewOf(a), .weight = ViewOf(w2), .bias = ViewOf(b2), .y = ViewOf(z)},
                             m.group());

    Tensor da = Tensor::Empty(a.shape(), f32, TestDevice());
    Tensor dw2 = Tensor::Empty(w2.shape(), f32, TestDevice());
    Tensor db2 = Tensor::Empty(b2.shape(), f32, TestDevice());
    RowParallelLinearBackward(fc2,
                              {.dy = ViewOf(dz),
                               .x = ViewOf(a),
                               .weight = ViewOf(w2),
                               .dx = ViewOf(da),
                               .dweight = ViewOf(dw2),
                               .dbias = ViewOf(db2)},
                              m.group());
    const Tensor dh = kernels::GeluBackward(da, h);
    Tensor dx = Tensor::Empty(x.shape(), f32, TestDevice());
    Tensor dw1 = Tensor::Empty(w1.shape(), f32, TestDevice());
    Tensor db1 = Tensor::Empty(b1.shape(), f32, TestDevice());
    ColumnParallelLinearBackward(fc1,
                                 {.dy = ViewOf(dh),
                                  .x_total = ViewOf(x_total),
                                  .weight = ViewOf(w1),
                                  .dx = ViewOf(dx),
                                  .dweight = ViewOf(dw1),
                                  .dbias = ViewOf(db1)},
                                 m.group());

    // The dense MLP in float64.
    const Values xv = x_full.ToDoubleVector();
    const Values w1v = w1_full.ToDoubleVector();
    const Values b1v = b1_full.ToDoubleVector();
    const Values w2v = w2_full.ToDoubleVector();
    const Values b2v = b2_full.ToDoubleVector();
    const Values dzv = dz_full.ToDoubleVector();
    const Values hv = testing::RefLinearForward(xv, w1v, &b1v, kS, kF, kH);
    Values av(hv.size());
    for (std::size_t i = 0; i < hv.size(); ++i) {
        av[i] = testing::RefGeluTanh(hv[i]);
    }
    const Values zv = testing::RefLinearForward(av, w2v, &b2v, kS, kH, kF);
    const Values dav = testing::RefLinearBackwardInput(dzv, w2v, kS, kH, kF);
    Values dhv(dav.size());
    for (std::size_t i = 0; i < dav.size(); ++i) {
        dhv[i] = dav[i] * testing::RefGeluTanhGrad(hv[i]);
    }
    const DType t = f32;
    EXPECT_TRUE(Matches(Gather(z, {kS, kH}, 0, m), zv, Data::kRandom, t)) << "z";
    EXPECT_TRUE(
        Matches(Gather(dw2, {kH, kF}, 1, m), testing::RefLinearBackwardWeight(dzv, av, kS, kH, kF), Data::kRandom, t))
        << "dw2";
    EXPECT_TRUE(Matches(db2, testing::RefColumnSum(dzv, kS, kH), Data::kRandom, t)) << "db2";
    EXPECT_TRUE(
        Matches(Gather(dx, {kS, kH}, 0, m), testing::RefLinearBackwardInput(dhv, w1v, kS, kF, kH), Data::kRandom, t))
        << "dx";
    EXPECT_TRUE(
        Matches(Gather(dw1, {kF, kH}, 0, m), testing::RefLinearBackwardWeight(dhv, xv, kS, kF, kH), Data::kRandom, t))
        << "dw1";
    EXPECT_TRUE(Matches(Gather(db1, {kF}, 0, m), testing::RefColumnSum(dhv, kS, kF), Data::kRandom, t)) << "db1";
}

// ---- errors: every rank raises the same Error before any collective; the group stays usable
// ----------------------------

/// Runs `call`, which must throw shardline::Error whose message contains every one of `parts`, on every rank, with no
/// collective issued; then a valid call on the same group still works (nothing is left waiting).
template <class F> void ExpectErrorBeforeAnyCollective(const MeshAndDim &m, F &&call, std::vector<std::string> parts) {
    ResetCounts(m);
    try {
        call();
        ADD_FAILURE() << "no error raised; expected one containing '" << parts.front() << "'";
    } catch (const Error &e) {
        for (const std::string &part : parts) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
                << "message: " << e.what() << "\nexpected to contain: " << part;
        }
    }
    ExpectCalls(m, {}, "after the error");
    RunColumn({.problem = Fp32Problems()[0]});
}

struct Buffers {
    Tensor x, w, b, y;
};

Buffers ColumnBuffers(std::int64_t tp, DType dtype = DType::kFloat32) {
    return {Tensor::Zeros({8, kIn}, dtype, TestDevice()), Tensor::Zeros({kOut / tp, kIn}, dtype, TestDevice()),
            Tensor::Zeros({kOut / tp}, dtype, TestDevice()), Tensor::Zeros({8, kOut / tp}, dtype, TestDevice())};
}

TEST(FunctionalLinearErrorTest, SizesThatDoNotDivideByTpRaiseNamingSizeAndTp) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    if (tp == 1) {
        GTEST_SKIP() << "every size divides by tp = 1";
    }
    const Tensor x = Tensor::Zeros({8, kIn}, DType::kFloat32, TestDevice());
    const Tensor w = Tensor::Zeros({1, kIn}, DType::kFloat32, TestDevice());
    const Tensor y = Tensor::Zeros({8, 1}, DType::kFloat32, TestDevice());
    const std::int64_t bad_out = tp + 1;
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward({.in_features = kIn, .out_features = bad_out, .bias = false},
                                        {.x = ViewOf(x), .weight = ViewOf(w), .y = ViewOf(y)}, m.group());
        },
        {"ColumnParallelLinearForward", fmt::format("out_features ({}) must be divisible by tp ({})", bad_out, tp)});
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearForward({.in_features = bad_out, .out_features = kOut, .input_is_parallel = true},
                                     {.x = ViewOf(x), .weight = ViewOf(w), .y = ViewOf(y)}, m.group());
        },
        {"RowParallelLinearForward", fmt::format("in_features ({}) must be divisible by tp ({})", bad_out, tp)});
    // A sequence that does not split into tp equal parts under sequence parallelism.
    const std::int64_t s = 2 * tp + 1;
    const Tensor xr = Tensor::Zeros({s, kIn / tp}, DType::kFloat32, TestDevice());
    const Tensor wr = Tensor::Zeros({kOut, kIn / tp}, DType::kFloat32, TestDevice());
    const Tensor yr = Tensor::Zeros({2, kOut}, DType::kFloat32, TestDevice());
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearForward({.in_features = kIn,
                                      .out_features = kOut,
                                      .bias = false,
                                      .input_is_parallel = true,
                                      .sequence_parallel = true},
                                     {.x = ViewOf(xr), .weight = ViewOf(wr), .y = ViewOf(yr)}, m.group());
        },
        {"RowParallelLinearForward",
         fmt::format("the sequence length x.shape[0] ({}) must be divisible by tp ({})", s, tp)});
}

TEST(FunctionalLinearErrorTest, ShapeAndDTypeMismatchesRaiseNamingTheTensorAndTheExpectation) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    Buffers t = ColumnBuffers(tp);
    const ColumnParallelLinearOptions options{.in_features = kIn, .out_features = kOut};
    // The full weight where this rank's rows are expected.
    const Tensor w_full = Tensor::Zeros({kOut + tp, kIn}, DType::kFloat32, TestDevice());
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                options, {.x = ViewOf(t.x), .weight = ViewOf(w_full), .bias = ViewOf(t.b), .y = ViewOf(t.y)},
                m.group());
        },
        {"ColumnParallelLinearForward", "weight must be [out_features/tp, in_features]",
         fmt::format("= [{}, {}]", kOut / tp, kIn), fmt::format("got [{}, {}]", kOut + tp, kIn)});
    // A weight of another dtype than x. On the CPU the other dtype is float64, on CUDA bfloat16.
    const DType other = TestDevice().is_cpu() ? DType::kFloat64 : DType::kBFloat16;
    const Tensor w_other = Tensor::Zeros({kOut / tp, kIn}, other, TestDevice());
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                options, {.x = ViewOf(t.x), .weight = ViewOf(w_other), .bias = ViewOf(t.b), .y = ViewOf(t.y)},
                m.group());
        },
        {"ColumnParallelLinearForward", fmt::format("weight must have x's dtype float32, got {}", DTypeName(other))});
    // A float32 main grad for float64 parameters needs GradMode::kAccumulate (CPU only: float64 is not a CUDA dtype).
    if (TestDevice().is_cpu()) {
        const Tensor dy = Tensor::Zeros({8, kOut / tp}, DType::kFloat64, TestDevice());
        const Tensor x64 = Tensor::Zeros({8, kIn}, DType::kFloat64, TestDevice());
        const Tensor dw32 = Tensor::Zeros({kOut / tp, kIn}, DType::kFloat32, TestDevice());
        ExpectErrorBeforeAnyCollective(m,
                                       [&] {
                                           ColumnParallelLinearBackward(
                                               options, {.dy = ViewOf(dy), .x = ViewOf(x64), .dweight = ViewOf(dw32)},
                                               m.group());
                                       },
                                       {"ColumnParallelLinearBackward", "dweight must have the compute dtype float64",
                                        "got float32 with GradMode::kOverwrite"});
    }
    // A half type on a CPU mesh (MPI and the CPU kernels take float32 and float64).
    if (TestDevice().is_cpu()) {
        TensorView x = ViewOf(t.x);
        x.dtype = DType::kBFloat16;
        ExpectErrorBeforeAnyCollective(
            m,
            [&] {
                ColumnParallelLinearForward(
                    options, {.x = x, .weight = ViewOf(t.w), .bias = ViewOf(t.b), .y = ViewOf(t.y)}, m.group());
            },
            {"ColumnParallelLinearForward", "a CPU (MPI) mesh takes float32 or float64, got x bfloat16"});
    }
}

TEST(FunctionalLinearErrorTest, NullRequiredPointersRaiseNamingTheTensor) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    Buffers t = ColumnBuffers(tp);
    const ColumnParallelLinearOptions options{.in_features = kIn, .out_features = kOut};
    TensorView null_x = ViewOf(t.x);
    null_x.data = nullptr;
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                options, {.x = null_x, .weight = ViewOf(t.w), .bias = ViewOf(t.b), .y = ViewOf(t.y)}, m.group());
        },
        {"ColumnParallelLinearForward", "x is required, got a null data pointer", fmt::format("[8, {}]", kIn)});
    ExpectErrorBeforeAnyCollective(m,
                                   [&] {
                                       ColumnParallelLinearForward(
                                           options, {.x = ViewOf(t.x), .weight = ViewOf(t.w), .y = ViewOf(t.y)},
                                           m.group());
                                   },
                                   {"ColumnParallelLinearForward", "bias is required (options.bias is set)"});
    // dx requested without the weight it needs.
    ExpectErrorBeforeAnyCollective(
        m, [&] { ColumnParallelLinearBackward(options, {.dy = ViewOf(t.y), .dx = ViewOf(t.x)}, m.group()); },
        {"ColumnParallelLinearBackward", "weight is required for dx"});
    // dweight without x (or x_total).
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearBackward(
                {.in_features = kIn, .out_features = kOut, .input_is_parallel = true},
                {.dy = ViewOf(Tensor::Zeros({8, kOut}, DType::kFloat32, TestDevice())),
                 .dweight = ViewOf(Tensor::Zeros({kOut, kIn / tp}, DType::kFloat32, TestDevice()))},
                m.group());
        },
        {"RowParallelLinearBackward", "x is required for dweight"});
}

TEST(FunctionalLinearErrorTest, AMeshDimOutsideTheMeshRaisesNamingIt) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    Buffers t = ColumnBuffers(m.tp());
    for (int bad : {1, -1}) {
        ExpectErrorBeforeAnyCollective(
            m,
            [&] {
                ColumnParallelLinearForward(
                    {.in_features = kIn, .out_features = kOut},
                    {.x = ViewOf(t.x), .weight = ViewOf(t.w), .bias = ViewOf(t.b), .y = ViewOf(t.y)},
                    {.mesh = &m.mesh, .tp_dim = bad});
            },
            {"ColumnParallelLinearForward",
             fmt::format("tp_dim ({}) must name a dim of the mesh [{}]", bad, World().size())});
    }
}

TEST(FunctionalLinearErrorTest, FlagCombinationsMegatronRejectsRaise) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    Buffers t = ColumnBuffers(m.tp());
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                {.in_features = kIn, .out_features = kOut, .gather_output = true, .sequence_parallel = true},
                {.x = ViewOf(t.x), .weight = ViewOf(t.w), .bias = ViewOf(t.b), .y = ViewOf(t.y)}, m.group());
        },
        {"ColumnParallelLinearForward", "gather_output and sequence_parallel exclude each other"});
    ExpectErrorBeforeAnyCollective(m,
                                   [&] {
                                       RowParallelLinearForward(
                                           {.in_features = kIn, .out_features = kOut, .sequence_parallel = true},
                                           {.x = ViewOf(t.x), .weight = ViewOf(t.w), .y = ViewOf(t.y)}, m.group());
                                   },
                                   {"RowParallelLinearForward", "sequence_parallel needs input_is_parallel"});
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                {.in_features = kIn, .out_features = kOut, .bias = false},
                {.x = ViewOf(t.x), .weight = ViewOf(t.w), .bias = ViewOf(t.b), .y = ViewOf(t.y)}, m.group());
        },
        {"ColumnParallelLinearForward", "bias is given but options.bias is false"});
}

// ---- CUDA: half precision, the caller's stream and workspace
// -------------------------------------------------------------

#if SHARDLINE_FUNCTIONAL_TEST_CUDA

TEST(FunctionalCudaTest, HalfPrecisionMatchesDenseWithinTheDTypeTolerance) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        const Problem p{.lead = {8, 2}, .data = Data::kRandom, .dtype = dtype, .seed = 21};
        RunColumn({.problem = p});
        RunColumn({.problem = p, .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
        RunColumn({.problem = p, .gather_output = true});
        RunRow({.problem = p});
        RunRow({.problem = p, .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
        RunRow({.problem = p, .input_is_parallel = false});
    }
}

TEST(FunctionalCudaTest, RunsOnTheCallersStreamAndWorkspaceAndRestoresTheContext) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    CudaContext &ctx = CudaContext::Get(TestDevice().index);
    const cudaStream_t before = ctx.stream();
    void *const workspace_before = ctx.workspace();
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;
    void *workspace = nullptr;
    ASSERT_EQ(cudaMalloc(&workspace, kWorkspaceBytes), cudaSuccess);

    const Problem p{.lead = {8, 2}, .data = Data::kInteger, .seed = 31};
    const Dense d = MakeDense(p, m);
    Synchronize(TestDevice());
    const Tensor x = Shard(d.x, 0, m);
    const Tensor w = Shard(d.w, 0, m);
    const Tensor b = Shard(d.b, 0, m);
    Tensor y = Poisoned({8, 2, kOut / tp}, p.dtype);
    Tensor x_total = Poisoned(d.x.shape(), p.dtype);
    Synchronize(TestDevice());
    const functional::CudaExecution exec{.stream = stream, .workspace = workspace, .workspace_bytes = kWorkspaceBytes};
    ColumnParallelLinearForward(
        {.in_features = kIn, .out_features = kOut, .sequence_parallel = true},
        {.x = ViewOf(x), .weight = ViewOf(w), .bias = ViewOf(b), .y = ViewOf(y), .x_total = ViewOf(x_total)}, m.group(),
        exec);
    EXPECT_EQ(ctx.stream(), before) << "the context's stream is restored";
    EXPECT_EQ(ctx.workspace(), workspace_before) << "the context's workspace is restored";
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(Matches(Gather(y, {8, 2, kOut}, 2, m), d.y, p.data, p.dtype));
    Synchronize(TestDevice());
    ASSERT_EQ(cudaFree(workspace), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

#endif

} // namespace
} // namespace shardline
