// The backward's comm/GEMM overlap (ColumnParallelLinearOptions::overlap_grad_comm, DESIGN.md §10): the dgrad GEMM
// first, dx's collective in flight while the parameter grads run. Every case runs the same backward with the overlap
// on and off and asserts
//   - the gradients bitwise equal between the two (random data too: the same kernels on the same operands),
//   - both equal to the dense float64 reference (bitwise for integer-valued operands),
//   - the tp group's collectives identical: calls and bytes of every kind, and BackwardInfo::collectives,
//     against the absolute counts and bytes of DESIGN.md §6.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4, skipped without one GPU per rank) build this file.

#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/context.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/linear.h>

#include "functional_test_util.h"

namespace shardline {
namespace {

using namespace functional_test;
using comm::CollectiveCounts;
using comm::CollectiveKind;

struct Grads {
    Tensor dx, dw, db;
    CollectiveCounts counts; ///< the tp group's
    int collectives = 0;     ///< BackwardInfo::collectives
};

void ExpectSameCollectives(const Grads &on, const Grads &off) {
    for (int k = 0; k < comm::kNumCollectiveKinds; ++k) {
        const auto kind = static_cast<CollectiveKind>(k);
        EXPECT_EQ(on.counts.Calls(kind), off.counts.Calls(kind)) << comm::CollectiveName(kind) << " calls";
        EXPECT_EQ(on.counts.Bytes(kind), off.counts.Bytes(kind)) << comm::CollectiveName(kind) << " bytes";
    }
    EXPECT_EQ(on.collectives, off.collectives);
}

void ExpectSameGrads(const Grads &on, const Grads &off) {
    EXPECT_TRUE(Bitwise(on.dx, off.dx)) << "dx, overlap on vs off";
    EXPECT_TRUE(Bitwise(on.dw, off.dw)) << "dweight, overlap on vs off";
    EXPECT_TRUE(Bitwise(on.db, off.db)) << "dbias, overlap on vs off";
}

/// What the tp group must have run: calls and bytes per kind (nothing at tp = 1).
struct Want {
    std::int64_t all_reduce = 0, all_reduce_bytes = 0;
    std::int64_t all_gather = 0, all_gather_bytes = 0;
    std::int64_t reduce_scatter = 0, reduce_scatter_bytes = 0;
};

void ExpectCollectives(const Grads &g, Want want, std::int64_t tp) {
    if (tp == 1) {
        want = {};
    }
    EXPECT_EQ(g.counts.Calls(CollectiveKind::kAllReduce), want.all_reduce);
    EXPECT_EQ(g.counts.Bytes(CollectiveKind::kAllReduce), want.all_reduce_bytes);
    EXPECT_EQ(g.counts.Calls(CollectiveKind::kAllGather), want.all_gather);
    EXPECT_EQ(g.counts.Bytes(CollectiveKind::kAllGather), want.all_gather_bytes);
    EXPECT_EQ(g.counts.Calls(CollectiveKind::kReduceScatter), want.reduce_scatter);
    EXPECT_EQ(g.counts.Bytes(CollectiveKind::kReduceScatter), want.reduce_scatter_bytes);
    EXPECT_EQ(g.counts.TotalCalls(), want.all_reduce + want.all_gather + want.reduce_scatter);
    EXPECT_EQ(g.collectives, g.counts.TotalCalls());
}

/// Accumulation goes into float32 main grads for half operands, else into the operands' dtype.
DType GradDType(const Problem &p, bool accumulate) { return accumulate && IsHalf(p.dtype) ? DType::kFloat32 : p.dtype; }

// ---- column parallel
// ----------------------------------------------------------------------------------------------------

struct ColumnOverlapCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool bias = true;
    bool gather_output = false;
    bool sequence_parallel = false;
    bool keep_x_total = true;
    Wants wants{};
};

std::string Describe(const ColumnOverlapCase &c, std::int64_t tp) {
    return fmt::format("column overlap tp={} lead={} {} {} bias={} gather_output={} sequence_parallel={} "
                       "keep_x_total={} dx={} dweight={} dbias={} accumulate={}",
                       tp, ShapeToString(c.problem.lead), DataName(c.problem.data), DTypeName(c.problem.dtype), c.bias,
                       c.gather_output, c.sequence_parallel, c.keep_x_total, c.wants.dx, c.wants.dweight, c.wants.dbias,
                       c.wants.mode == GradMode::kAccumulate);
}

Grads ColumnBackward(const ColumnOverlapCase &c, const MeshAndDim &m, const Dense &d, bool overlap) {
    const Problem &p = c.problem;
    const std::int64_t tp = m.tp();
    const int rank = static_cast<int>(p.lead.size()) + 1;
    const ColumnParallelLinearOptions options{.in_features = kIn,
                                              .out_features = kOut,
                                              .bias = c.bias,
                                              .gather_output = c.gather_output,
                                              .sequence_parallel = c.sequence_parallel,
                                              .overlap_grad_comm = overlap};
    const Tensor x = c.sequence_parallel ? Shard(d.x, 0, m) : d.x;
    const Tensor x_total = c.sequence_parallel && c.keep_x_total ? d.x : Tensor(); // what the forward gathered
    const Tensor w = Shard(d.w, 0, m);
    const Tensor dy = c.gather_output ? d.dy : Shard(d.dy, rank - 1, m);
    const bool accumulate = c.wants.mode == GradMode::kAccumulate;
    const DType grad_dtype = GradDType(p, accumulate);
    Grads g;
    g.dx = c.wants.dx ? Poisoned(x.shape(), p.dtype) : Tensor();
    g.dw = c.wants.dweight ? (accumulate ? Shard(MakeFull({kOut, kIn}, "main_dw", Data::kInteger, grad_dtype, 7), 0, m)
                                         : Poisoned({kOut / tp, kIn}, grad_dtype))
                           : Tensor();
    g.db = c.wants.dbias && c.bias
               ? (accumulate ? Shard(MakeFull({kOut}, "main_db", Data::kInteger, grad_dtype, 7), 0, m)
                             : Poisoned({kOut / tp}, grad_dtype))
               : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo info =
        ColumnParallelLinearBackward(options,
                                     {.dy = ViewOf(dy),
                                      .x = ViewOf(x),
                                      .x_total = x_total.defined() ? ViewOf(x_total) : TensorView{},
                                      .weight = ViewOf(w),
                                      .dx = g.dx.defined() ? ViewOf(g.dx) : TensorView{},
                                      .dweight = g.dw.defined() ? ViewOf(g.dw) : TensorView{},
                                      .dbias = g.db.defined() ? ViewOf(g.db) : TensorView{},
                                      .param_grads = c.wants.mode},
                                     m.group());
    Synchronize(TestDevice());
    g.counts = m.mesh.group(m.tp_dim).Counts();
    g.collectives = info.collectives;
    return g;
}

void RunColumnOverlap(const ColumnOverlapCase &c) {
    const MeshAndDim m = GetMesh(c.mesh);
    const std::int64_t tp = m.tp();
    SCOPED_TRACE(Describe(c, tp));
    const Problem &p = c.problem;
    const Dense d = MakeDense(p, m);
    const Grads on = ColumnBackward(c, m, d, true);
    const Grads off = ColumnBackward(c, m, d, false);
    ExpectSameGrads(on, off);
    ExpectSameCollectives(on, off);

    // §6 with bytes: dx is all-reduced whole (reduce-scattered from the whole under sequence parallelism); x is
    // gathered again for dweight when the forward did not keep it (this rank's [s/tp, ..., K] contributed).
    const auto elem = static_cast<std::int64_t>(ElementSize(p.dtype));
    const std::int64_t x_bytes = Numel(d.x.shape()) * elem;
    const bool dx = c.wants.dx;
    const bool gather_x = c.wants.dweight && c.sequence_parallel && !c.keep_x_total;
    ExpectCollectives(on,
                      Want{.all_reduce = dx && !c.sequence_parallel ? 1 : 0,
                           .all_reduce_bytes = dx && !c.sequence_parallel ? x_bytes : 0,
                           .all_gather = gather_x ? 1 : 0,
                           .all_gather_bytes = gather_x ? x_bytes / tp : 0,
                           .reduce_scatter = dx && c.sequence_parallel ? 1 : 0,
                           .reduce_scatter_bytes = dx && c.sequence_parallel ? x_bytes : 0},
                      tp);

    const bool accumulate = c.wants.mode == GradMode::kAccumulate;
    const DType grad_dtype = GradDType(p, accumulate);
    // The coarser of the parameter's dtype and its grad's (a float64 layer with float32 main grads).
    const DType tol_dtype = ElementSize(grad_dtype) < ElementSize(p.dtype) ? grad_dtype : p.dtype;
    if (on.dx.defined()) {
        EXPECT_TRUE(Matches(Gather(on.dx, d.x.shape(), c.sequence_parallel ? 0 : -1, m), d.dx, p.data, p.dtype, tp))
            << "dx";
    }
    if (on.dw.defined()) {
        const Values want =
            accumulate ? Plus(MakeFull({kOut, kIn}, "main_dw", Data::kInteger, grad_dtype, 7).ToDoubleVector(), d.dw)
                       : d.dw;
        EXPECT_TRUE(Matches(Gather(on.dw, {kOut, kIn}, 0, m), want, p.data, tol_dtype)) << "dweight";
    }
    if (on.db.defined()) {
        const Values want =
            accumulate ? Plus(MakeFull({kOut}, "main_db", Data::kInteger, grad_dtype, 7).ToDoubleVector(), d.db) : d.db;
        EXPECT_TRUE(Matches(Gather(on.db, {kOut}, 0, m), want, p.data, tol_dtype)) << "dbias";
    }
}

TEST(BackwardOverlapTest, ColumnAllReduceOfDxOverlapsTheParameterGradsBitwiseWithTheSameCollectives) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunColumnOverlap({.problem = p, .bias = bias});
            RunColumnOverlap({.mesh = MeshKind::kDpTp, .problem = p, .bias = bias});
        }
    }
    // Only one parameter grad beside dx; only dx (nothing to overlap: the plain order).
    RunColumnOverlap({.problem = Fp32Problems()[0], .wants = {.dweight = false}});
    RunColumnOverlap({.problem = Fp32Problems()[0], .wants = {.dbias = false}});
    RunColumnOverlap({.problem = Fp32Problems()[0], .wants = {.dweight = false, .dbias = false}});
    RunColumnOverlap({.problem = Fp32Problems()[0], .wants = {.dx = false}});
}

TEST(BackwardOverlapTest, ColumnReduceScatterOfDxAndGatherOfXOverlapUnderSequenceParallel) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool keep : {true, false}) {
            RunColumnOverlap({.problem = p, .sequence_parallel = true, .keep_x_total = keep});
            RunColumnOverlap({.mesh = MeshKind::kTpDp, .problem = p, .sequence_parallel = true, .keep_x_total = keep});
        }
    }
    RunColumnOverlap({.problem = Fp32Problems()[1], .bias = false, .sequence_parallel = true, .keep_x_total = false});
    RunColumnOverlap(
        {.problem = Fp32Problems()[0], .sequence_parallel = true, .keep_x_total = false, .wants = {.dweight = false}});
}

TEST(BackwardOverlapTest, ColumnGatherOutputAndAccumulatedMainGradsOverlapBitwise) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        RunColumnOverlap({.problem = p, .gather_output = true});
        RunColumnOverlap({.problem = p, .wants = {.mode = GradMode::kAccumulate}});
        RunColumnOverlap({.problem = p, .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
    }
}

// Other dtypes on random data, which leaves nothing exact, so only the same kernels give the same bits: half precision
// on CUDA, accumulating into float32 main grads (the bias grad then runs apart from the wgrad GEMM, its dtype differing
// from the parameter's); float64 on CPU, whose MPI meshes take no half types.
TEST(BackwardOverlapTest, ColumnOtherDTypesOverlapBitwise) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
#if SHARDLINE_FUNCTIONAL_TEST_CUDA
    const std::vector<DType> dtypes = {DType::kBFloat16, DType::kFloat16};
#else
    const std::vector<DType> dtypes = {DType::kFloat64};
#endif
    for (DType dtype : dtypes) {
        const Problem p{.lead = {8, 2}, .data = Data::kRandom, .dtype = dtype, .seed = 21};
        RunColumnOverlap({.problem = p, .wants = {.mode = GradMode::kAccumulate}});
        RunColumnOverlap({.problem = p, .sequence_parallel = true, .keep_x_total = false});
    }
}

// ---- the order: which kernels run, and which collectives were already issued when they ran
// ----------------------

/// A LinearBackward provider that records each call (which gradients it computes, and how many collectives the tp
/// group had issued by then) and runs the default kernel.
struct KernelCall {
    bool dx = false, dweight = false, dbias = false;
    std::int64_t issued = 0;
    bool operator==(const KernelCall &) const = default;
};
struct Probe {
    kernels::LinearBackwardOp::Fn fallback = nullptr;
    comm::Communicator *tp = nullptr;
    std::vector<KernelCall> calls;
};
Probe &TheProbe() {
    static Probe probe;
    return probe;
}
constexpr std::string_view kProbe = "overlap_probe";

void ProbeLinearBackward(const kernels::LinearBackwardArgs &args) {
    Probe &probe = TheProbe();
    probe.calls.push_back(KernelCall{.dx = args.dx != nullptr,
                                     .dweight = args.dweight != nullptr,
                                     .dbias = args.dbias != nullptr,
                                     .issued = probe.tp->Counts().TotalCalls()});
    const kernels::detail::ProviderScope scope(kernels::kDefaultProvider);
    probe.fallback(args);
}

class ProbeScope {
public:
    explicit ProbeScope(comm::Communicator &tp) {
        const DeviceType device = TestDevice().type;
        TheProbe() =
            Probe{.fallback = kernels::OpTable<kernels::LinearBackwardOp>::Resolve(device).fn, .tp = &tp, .calls = {}};
        kernels::Register<kernels::LinearBackwardOp>(device, kProbe, &ProbeLinearBackward);
        kernels::SetOpProvider(kernels::LinearBackwardOp::kName, kProbe);
    }
    ~ProbeScope() {
        kernels::ResetProviderSelection();
        kernels::UnregisterProvider<kernels::LinearBackwardOp>(kProbe);
    }
    ProbeScope(const ProbeScope &) = delete;
    ProbeScope &operator=(const ProbeScope &) = delete;
};

// With the overlap the dgrad GEMM runs alone first and the parameter grads run after dx's collective was issued (and,
// under sequence parallelism without x_total, x's all-gather before the dgrad GEMM); without it one LinearBackward
// computes everything before dx's collective.
TEST(BackwardOverlapTest, TheDgradRunsFirstAndTheParameterGradsRunWithDxsCollectiveIssued) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    const Problem &p = Fp32Problems()[0];
    const Dense d = MakeDense(p, m);
    const std::int64_t one = tp > 1 ? 1 : 0; // one collective, none at tp = 1
    struct Expect {
        ColumnOverlapCase c;
        std::vector<KernelCall> on, off;
    };
    auto column = [&p](bool sequence_parallel, Wants wants) {
        ColumnOverlapCase c;
        c.problem = p;
        c.sequence_parallel = sequence_parallel;
        c.keep_x_total = !sequence_parallel; // under sequence parallelism x is gathered again for dweight
        c.wants = wants;
        return c;
    };
    const KernelCall dx_only{.dx = true};
    const std::vector<Expect> expects = {
        {column(false, {}),
         {dx_only, {.dweight = true, .dbias = true, .issued = one}},
         {{.dx = true, .dweight = true, .dbias = true}}},
        {column(true, {}),
         {{.dx = true, .issued = one}, {.dweight = true, .dbias = true, .issued = 2 * one}},
         {{.dx = true, .dweight = true, .dbias = true, .issued = one}}},
        {column(false, {.dweight = false}), {dx_only, {.dbias = true, .issued = one}}, {{.dx = true, .dbias = true}}},
        // Nothing to overlap: dx alone, or no dx.
        {column(false, {.dweight = false, .dbias = false}), {dx_only}, {dx_only}},
        {column(false, {.dx = false}), {{.dweight = true, .dbias = true}}, {{.dweight = true, .dbias = true}}},
    };
    for (const Expect &e : expects) {
        SCOPED_TRACE(Describe(e.c, tp));
        for (bool overlap : {true, false}) {
            std::vector<KernelCall> calls;
            {
                const ProbeScope probe(m.mesh.group(m.tp_dim));
                ColumnBackward(e.c, m, d, overlap);
                calls = TheProbe().calls;
            }
            // At tp = 1 nothing moves dx: the plain order.
            const std::vector<KernelCall> &want = overlap && tp > 1 ? e.on : e.off;
            ASSERT_EQ(calls.size(), want.size()) << "overlap=" << overlap;
            for (std::size_t i = 0; i < calls.size(); ++i) {
                EXPECT_TRUE(calls[i] == want[i])
                    << "overlap=" << overlap << " call " << i << ": dx=" << calls[i].dx
                    << " dweight=" << calls[i].dweight << " dbias=" << calls[i].dbias << " issued=" << calls[i].issued
                    << ", expected dx=" << want[i].dx << " dweight=" << want[i].dweight << " dbias=" << want[i].dbias
                    << " issued=" << want[i].issued;
            }
        }
    }
}

// ---- row parallel with a non-parallel input: dx's all-gather overlaps the parameter grads
// ------------------------

Grads RowBackward(const Problem &p, const MeshAndDim &m, const Dense &d, bool bias, bool overlap) {
    const std::int64_t tp = m.tp();
    const RowParallelLinearOptions options{.in_features = kIn,
                                           .out_features = kOut,
                                           .bias = bias,
                                           .input_is_parallel = false,
                                           .overlap_grad_comm = overlap};
    const Tensor w = Shard(d.w, 1, m);
    Grads g;
    g.dx = Poisoned(d.x.shape(), p.dtype);
    g.dw = Poisoned({kOut, kIn / tp}, p.dtype);
    g.db = bias ? Poisoned({kOut}, p.dtype) : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo info = RowParallelLinearBackward(options,
                                                                    {.dy = ViewOf(d.dy),
                                                                     .x = ViewOf(d.x),
                                                                     .weight = ViewOf(w),
                                                                     .dx = ViewOf(g.dx),
                                                                     .dweight = ViewOf(g.dw),
                                                                     .dbias = bias ? ViewOf(g.db) : TensorView{}},
                                                                    m.group());
    Synchronize(TestDevice());
    g.counts = m.mesh.group(m.tp_dim).Counts();
    g.collectives = info.collectives;
    return g;
}

TEST(BackwardOverlapTest, RowAllGatherOfANonParallelInputsDxOverlapsBitwiseWithTheSameCollectives) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            const MeshAndDim m = GetMesh(MeshKind::kTp);
            const std::int64_t tp = m.tp();
            SCOPED_TRACE(
                fmt::format("row overlap tp={} lead={} {} bias={}", tp, ShapeToString(p.lead), DataName(p.data), bias));
            const Dense d = MakeDense(p, m);
            const Grads on = RowBackward(p, m, d, bias, true);
            const Grads off = RowBackward(p, m, d, bias, false);
            ExpectSameGrads(on, off);
            ExpectSameCollectives(on, off);
            const std::int64_t x_bytes = Numel(d.x.shape()) * static_cast<std::int64_t>(ElementSize(p.dtype));
            ExpectCollectives(on, Want{.all_gather = 1, .all_gather_bytes = x_bytes / tp}, tp);
            EXPECT_TRUE(Matches(on.dx, d.dx, p.data, p.dtype)) << "dx";
            EXPECT_TRUE(Matches(Gather(on.dw, {kOut, kIn}, 1, m), d.dw, p.data, p.dtype)) << "dweight";
            if (bias) {
                EXPECT_TRUE(Matches(on.db, d.db, p.data, p.dtype)) << "dbias";
            }
        }
    }
}

} // namespace
} // namespace shardline
