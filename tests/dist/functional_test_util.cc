// The shared part of the functional layer's dist tests (functional_test_util.h).

#include "functional_test_util.h"

#include <cmath>
#include <cstdint>
#include <cstring>
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
#include <shardline/spmd/layout.h>

namespace shardline::functional_test {

using comm::CollectiveKind;

comm::Communicator &World() { return testing::DistEnv().world(); }
Device TestDevice() { return testing::DistEnv().device(); }

namespace {

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

} // namespace

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

std::string DataName(Data data) { return data == Data::kInteger ? "integer" : "random"; }

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

namespace {
spmd::Layout SplitOn(int rank, int tensor_dim, int tp_dim) {
    std::vector<int> mapping(static_cast<std::size_t>(rank), -1);
    if (tensor_dim >= 0) {
        mapping[static_cast<std::size_t>(tensor_dim)] = tp_dim;
    }
    return spmd::Layout::FromDimsMapping(mapping);
}
} // namespace

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

namespace {
std::int64_t Rows(const Shape &lead) { return Numel(lead); }
} // namespace

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
::testing::AssertionResult Bitwise(const Tensor &a, const Tensor &b) {
    if (a.defined() != b.defined()) {
        return ::testing::AssertionFailure() << "one of the two is undefined";
    }
    if (!a.defined()) {
        return ::testing::AssertionSuccess();
    }
    const Tensor ha = a.To(Device::CPU());
    const Tensor hb = b.To(Device::CPU());
    if (ha.shape() != hb.shape() || ha.dtype() != hb.dtype()) {
        return ::testing::AssertionFailure() << ha.ToString() << " vs " << hb.ToString();
    }
    if (std::memcmp(ha.data(), hb.data(), ha.nbytes()) != 0) {
        return ::testing::AssertionFailure() << "the bytes of " << ha.ToString() << " differ";
    }
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult Matches(const Tensor &got, const Values &want, Data data, DType dtype,
                                   std::int64_t reduced_over) {
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

namespace {
Values WithoutBias(const Dense &d, const Problem &p) {
    const Values x = d.x.ToDoubleVector();
    const Values w = d.w.ToDoubleVector();
    return testing::RefLinearForward(x, w, nullptr, Rows(p.lead), kOut, kIn);
}
} // namespace

// ---- column parallel
// ---------------------------------------------------------------------------------------------------

namespace {
std::string Describe(const ColumnCase &c, std::int64_t tp) {
    return fmt::format("column tp={} lead={} {} {} bias={} gather_output={} sequence_parallel={} keep_x_total={} "
                       "dx={} dweight={} dbias={} accumulate={}",
                       tp, ShapeToString(c.problem.lead), DataName(c.problem.data), DTypeName(c.problem.dtype), c.bias,
                       c.gather_output, c.sequence_parallel, c.keep_x_total, c.wants.dx, c.wants.dweight, c.wants.dbias,
                       c.wants.mode == GradMode::kAccumulate);
}
} // namespace

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

namespace {
std::string Describe(const RowCase &c, std::int64_t tp) {
    return fmt::format("row tp={} lead={} {} {} bias={} input_is_parallel={} sequence_parallel={} dx={} dweight={} "
                       "dbias={} accumulate={}",
                       tp, ShapeToString(c.problem.lead), DataName(c.problem.data), DTypeName(c.problem.dtype), c.bias,
                       c.input_is_parallel, c.sequence_parallel, c.wants.dx, c.wants.dweight, c.wants.dbias,
                       c.wants.mode == GradMode::kAccumulate);
}
} // namespace

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
} // namespace shardline::functional_test
