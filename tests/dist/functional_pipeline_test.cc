// The chunked collective-GEMM pipelines (options.comm_chunks = C, DESIGN.md §10, docs/functional.md "Chunked
// pipelines"): GEMM + all-reduce / reduce-scatter (row forward, column backward's dx) and all-gather + GEMM (column
// forward under sequence parallelism, row backward's dy). Every case runs the same forward and backward with C chunks
// and unchunked (C = 0) and asserts
//   - every output and gradient bitwise equal between the two on integer-valued operands (the GEMMs run on fewer rows,
//     so random data may round differently: there both match the dense reference within tolerance),
//   - both equal to the dense float64 reference (bitwise for integer-valued operands),
//   - the tp group's collectives: the pipelined collective C times instead of once, the same bytes in all, and
//     ForwardInfo / BackwardInfo::collectives equal to the counters;
// C in {2, 3, 4}, including C that does not divide the rows (the first rows % C chunks take one more row), on a tp
// mesh and both dp x tp meshes; and that the kernels of chunk c run with chunk c's collective issued (the pipeline's
// order). Bad C (< 0, > the rows, with num_experts): functional_linear_error_test.cc.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4, skipped without one GPU per rank) build this file.

#include <algorithm>
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

/// One forward + backward: its outputs, gradients and the tp group's collectives per direction.
struct Outcome {
    Tensor y, pre, x_total, dx, dw, db, pre_db;
    CollectiveCounts forward, backward;
    int forward_collectives = 0, backward_collectives = 0;
};

/// Calls and bytes per kind that one direction must have run on the tp group (nothing at tp = 1).
struct Want {
    std::int64_t all_reduce = 0, all_reduce_bytes = 0;
    std::int64_t all_gather = 0, all_gather_bytes = 0;
    std::int64_t reduce_scatter = 0, reduce_scatter_bytes = 0;
};

void ExpectCollectives(const CollectiveCounts &got, int info_collectives, Want want, std::int64_t tp,
                       std::string_view what) {
    if (tp == 1) {
        want = {};
    }
    SCOPED_TRACE(std::string(what));
    EXPECT_EQ(got.Calls(CollectiveKind::kAllReduce), want.all_reduce);
    EXPECT_EQ(got.Bytes(CollectiveKind::kAllReduce), want.all_reduce_bytes);
    EXPECT_EQ(got.Calls(CollectiveKind::kAllGather), want.all_gather);
    EXPECT_EQ(got.Bytes(CollectiveKind::kAllGather), want.all_gather_bytes);
    EXPECT_EQ(got.Calls(CollectiveKind::kReduceScatter), want.reduce_scatter);
    EXPECT_EQ(got.Bytes(CollectiveKind::kReduceScatter), want.reduce_scatter_bytes);
    EXPECT_EQ(got.TotalCalls(), want.all_reduce + want.all_gather + want.reduce_scatter);
    EXPECT_EQ(info_collectives, got.TotalCalls());
}

/// Bitwise on integer problems. `gelu_grad`: dx and pre_activation_dbias went through GELU's gradient, so they are not
/// integer-valued and the caller compares them within rounding instead: the chunked path's per-block DGELU GEMMs and
/// its separate column sum may round differently from the plain path's one fused DGELU_BGRAD GEMM (seen on CUDA at
/// np 2, 4xH100; bitwise on the CPU).
void ExpectSameResults(const Outcome &chunked, const Outcome &plain, bool gelu_grad = false) {
    EXPECT_TRUE(Bitwise(chunked.y, plain.y)) << "y, chunked vs plain";
    EXPECT_TRUE(Bitwise(chunked.pre, plain.pre)) << "pre_activation, chunked vs plain";
    EXPECT_TRUE(Bitwise(chunked.x_total, plain.x_total)) << "x_total, chunked vs plain";
    if (!gelu_grad) {
        EXPECT_TRUE(Bitwise(chunked.dx, plain.dx)) << "dx, chunked vs plain";
        EXPECT_TRUE(Bitwise(chunked.pre_db, plain.pre_db)) << "pre_activation_dbias, chunked vs plain";
    }
    EXPECT_TRUE(Bitwise(chunked.dw, plain.dw)) << "dweight, chunked vs plain";
    EXPECT_TRUE(Bitwise(chunked.db, plain.db)) << "dbias, chunked vs plain";
}

/// Integer problems whose rows give C = 2, 3, 4 dividing and not dividing them at tp 1, 2 and 4 (sequence parallel:
/// 16·2/tp and 12/tp rows per rank), a random one, and one of another element size (random: the views of chunk rows
/// are byte offsets) — bf16 on CUDA, float64 on the CPU, whose MPI meshes take no half types.
const std::vector<Problem> &PipelineProblems() {
    static const std::vector<Problem> problems = {
        {.lead = {16, 2}, .data = Data::kInteger, .seed = 31},
        {.lead = {12}, .data = Data::kInteger, .seed = 32},
        {.lead = {8, 2}, .data = Data::kRandom, .seed = 33},
#if SHARDLINE_FUNCTIONAL_TEST_CUDA
        {.lead = {16, 2}, .data = Data::kRandom, .dtype = DType::kBFloat16, .seed = 34},
#else
        {.lead = {16, 2}, .data = Data::kRandom, .dtype = DType::kFloat64, .seed = 34},
#endif
    };
    return problems;
}

/// The rows a call's pipelines split: x's leading dims, over tp under sequence parallelism.
std::int64_t ChunkedRows(const Problem &p, bool sequence_parallel, std::int64_t tp) {
    return Numel(p.lead) / (sequence_parallel ? tp : 1);
}

// ---- column parallel
// ----------------------------------------------------------------------------------------------------

struct ColumnPipeCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool sequence_parallel = false;
    bool keep_x_total = true;
    bool overlap = true;
    bool activation = false; ///< the forward's GELU epilogue
    bool want_params = true; ///< dweight and dbias besides dx
};

std::string Describe(const ColumnPipeCase &c, std::int64_t tp, int chunks) {
    return fmt::format("column tp={} chunks={} lead={} {} sequence_parallel={} keep_x_total={} overlap={} "
                       "activation={} params={}",
                       tp, chunks, ShapeToString(c.problem.lead), DataName(c.problem.data), c.sequence_parallel,
                       c.keep_x_total, c.overlap, c.activation, c.want_params);
}

Outcome ColumnRun(const ColumnPipeCase &c, const MeshAndDim &m, const Dense &d, int chunks) {
    const Problem &p = c.problem;
    const std::int64_t tp = m.tp();
    const int rank = static_cast<int>(p.lead.size()) + 1;
    const bool sp = c.sequence_parallel;
    const ColumnParallelLinearOptions options{.in_features = kIn,
                                              .out_features = kOut,
                                              .sequence_parallel = sp,
                                              .overlap_grad_comm = c.overlap,
                                              .comm_chunks = chunks};
    const Tensor x = sp ? Shard(d.x, 0, m) : d.x;
    const Tensor w = Shard(d.w, 0, m);
    const Tensor b = Shard(d.b, 0, m);
    Outcome r;
    r.y = Poisoned(WithLast(p.lead, kOut / tp), p.dtype);
    r.pre = c.activation ? Poisoned(r.y.shape(), p.dtype) : Tensor();
    r.x_total = sp && c.keep_x_total ? Poisoned(d.x.shape(), p.dtype) : Tensor();
    ResetCounts(m);
    const functional::ForwardInfo fwd = ColumnParallelLinearForward(
        options,
        {.x = ViewOf(x),
         .weight = ViewOf(w),
         .bias = ViewOf(b),
         .y = ViewOf(r.y),
         .x_total = r.x_total.defined() ? ViewOf(r.x_total) : TensorView{},
         .activation = c.activation ? kernels::LinearActivation::kGeluTanh : kernels::LinearActivation::kNone,
         .pre_activation = c.activation ? ViewOf(r.pre) : TensorView{}},
        m.group());
    Synchronize(TestDevice());
    r.forward = m.mesh.group(m.tp_dim).Counts();
    r.forward_collectives = fwd.collectives;

    const Tensor dy = Shard(d.dy, rank - 1, m);
    r.dx = Poisoned(x.shape(), p.dtype);
    r.dw = c.want_params ? Poisoned({kOut / tp, kIn}, p.dtype) : Tensor();
    r.db = c.want_params ? Poisoned({kOut / tp}, p.dtype) : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo bwd =
        ColumnParallelLinearBackward(options,
                                     {.dy = ViewOf(dy),
                                      .x = ViewOf(x),
                                      .x_total = r.x_total.defined() ? ViewOf(r.x_total) : TensorView{},
                                      .weight = ViewOf(w),
                                      .dx = ViewOf(r.dx),
                                      .dweight = r.dw.defined() ? ViewOf(r.dw) : TensorView{},
                                      .dbias = r.db.defined() ? ViewOf(r.db) : TensorView{}},
                                     m.group());
    Synchronize(TestDevice());
    r.backward = m.mesh.group(m.tp_dim).Counts();
    r.backward_collectives = bwd.collectives;
    return r;
}

void RunColumnPipeline(const ColumnPipeCase &c) {
    const MeshAndDim m = GetMesh(c.mesh);
    const std::int64_t tp = m.tp();
    const Problem &p = c.problem;
    const Dense d = MakeDense(p, m);
    const Outcome plain = ColumnRun(c, m, d, 0);
    const auto elem = static_cast<std::int64_t>(ElementSize(p.dtype));
    const std::int64_t x_bytes = Numel(d.x.shape()) * elem;
    const bool sp = c.sequence_parallel;
    for (int chunks : {2, 3, 4}) {
        if (chunks > ChunkedRows(p, sp, tp)) {
            continue; // an error (FunctionalPipelineTest.BadChunkCountsRaiseBeforeAnyCollective)
        }
        SCOPED_TRACE(Describe(c, tp, chunks));
        const Outcome run = ColumnRun(c, m, d, chunks);
        if (p.data == Data::kInteger) {
            ExpectSameResults(run, plain);
        }
        // Forward: x all-gathered in C chunks under sequence parallelism (this rank's [s/tp, ..., K] in all).
        ExpectCollectives(run.forward, run.forward_collectives,
                          Want{.all_gather = sp ? chunks : 0, .all_gather_bytes = sp ? x_bytes / tp : 0}, tp,
                          "forward");
        // Backward: dx all-reduced (reduce-scattered) in C chunks, from the whole partial dx; x gathered again, once,
        // for dweight when the forward did not keep it.
        const bool gather_x = sp && !c.keep_x_total && c.want_params;
        ExpectCollectives(run.backward, run.backward_collectives,
                          Want{.all_reduce = sp ? 0 : chunks,
                               .all_reduce_bytes = sp ? 0 : x_bytes,
                               .all_gather = gather_x ? 1 : 0,
                               .all_gather_bytes = gather_x ? x_bytes / tp : 0,
                               .reduce_scatter = sp ? chunks : 0,
                               .reduce_scatter_bytes = sp ? x_bytes : 0},
                          tp, "backward");
        // The dense reference.
        const int rank = static_cast<int>(p.lead.size()) + 1;
        if (!c.activation) {
            EXPECT_TRUE(Matches(Gather(run.y, WithLast(p.lead, kOut), rank - 1, m), d.y, p.data, p.dtype)) << "y";
        } else {
            EXPECT_TRUE(Matches(Gather(run.pre, WithLast(p.lead, kOut), rank - 1, m), d.y, p.data, p.dtype))
                << "pre_activation";
            EXPECT_TRUE(Matches(run.y, plain.y.ToDoubleVector(), Data::kRandom, p.dtype)) << "gelu(y)";
        }
        if (run.x_total.defined()) {
            EXPECT_TRUE(Matches(run.x_total, d.x.ToDoubleVector(), p.data, p.dtype)) << "x_total";
        }
        EXPECT_TRUE(Matches(Gather(run.dx, d.x.shape(), sp ? 0 : -1, m), d.dx, p.data, p.dtype, tp)) << "dx";
        if (c.want_params) {
            EXPECT_TRUE(Matches(Gather(run.dw, {kOut, kIn}, 0, m), d.dw, p.data, p.dtype)) << "dweight";
            EXPECT_TRUE(Matches(Gather(run.db, {kOut}, 0, m), d.db, p.data, p.dtype)) << "dbias";
        }
    }
}

TEST(FunctionalPipelineTest, ColumnBackwardAllReducesDxInChunksBitwiseWithCChunkedCalls) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : PipelineProblems()) {
        RunColumnPipeline({.problem = p});
        RunColumnPipeline({.mesh = MeshKind::kDpTp, .problem = p});
    }
    RunColumnPipeline({.problem = PipelineProblems()[0], .overlap = false});
    RunColumnPipeline({.problem = PipelineProblems()[0], .want_params = false});
}

TEST(FunctionalPipelineTest, ColumnSequenceParallelGathersXAndReduceScattersDxInChunks) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : PipelineProblems()) {
        for (bool keep : {true, false}) {
            RunColumnPipeline({.problem = p, .sequence_parallel = true, .keep_x_total = keep});
            RunColumnPipeline({.mesh = MeshKind::kTpDp, .problem = p, .sequence_parallel = true, .keep_x_total = keep});
        }
    }
    RunColumnPipeline({.problem = PipelineProblems()[0], .sequence_parallel = true, .overlap = false});
    RunColumnPipeline(
        {.problem = PipelineProblems()[1], .sequence_parallel = true, .keep_x_total = false, .overlap = false});
    RunColumnPipeline({.problem = PipelineProblems()[0], .sequence_parallel = true, .want_params = false});
}

TEST(FunctionalPipelineTest, ColumnSequenceParallelGeluEpilogueRunsPerChunkBitwise) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumnPipeline({.problem = PipelineProblems()[0], .sequence_parallel = true, .activation = true});
    RunColumnPipeline({.problem = PipelineProblems()[1], .sequence_parallel = true, .activation = true});
    RunColumnPipeline({.problem = PipelineProblems()[3], .sequence_parallel = true, .activation = true});
}

// ---- row parallel
// -------------------------------------------------------------------------------------------------------

struct RowPipeCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool input_is_parallel = true;
    bool sequence_parallel = false;
    bool overlap = true;
    bool input_activation = false; ///< the backward's GELU grad (x taken as the pre-activation) and its bias grad
    bool want_dx = true;
};

std::string Describe(const RowPipeCase &c, std::int64_t tp, int chunks) {
    return fmt::format("row tp={} chunks={} lead={} {} input_is_parallel={} sequence_parallel={} overlap={} "
                       "input_activation={} dx={}",
                       tp, chunks, ShapeToString(c.problem.lead), DataName(c.problem.data), c.input_is_parallel,
                       c.sequence_parallel, c.overlap, c.input_activation, c.want_dx);
}

Outcome RowRun(const RowPipeCase &c, const MeshAndDim &m, const Dense &d, int chunks) {
    const Problem &p = c.problem;
    const std::int64_t tp = m.tp();
    const int rank = static_cast<int>(p.lead.size()) + 1;
    const bool sp = c.sequence_parallel;
    const RowParallelLinearOptions options{.in_features = kIn,
                                           .out_features = kOut,
                                           .input_is_parallel = c.input_is_parallel,
                                           .sequence_parallel = sp,
                                           .overlap_grad_comm = c.overlap,
                                           .comm_chunks = chunks};
    const Tensor x = c.input_is_parallel ? Shard(d.x, rank - 1, m) : d.x;
    const Tensor w = Shard(d.w, 1, m);
    Shape y_lead = p.lead;
    y_lead[0] /= sp ? tp : 1;
    Outcome r;
    r.y = Poisoned(WithLast(y_lead, kOut), p.dtype);
    ResetCounts(m);
    const functional::ForwardInfo fwd = RowParallelLinearForward(
        options, {.x = ViewOf(x), .weight = ViewOf(w), .bias = ViewOf(d.b), .y = ViewOf(r.y)}, m.group());
    Synchronize(TestDevice());
    r.forward = m.mesh.group(m.tp_dim).Counts();
    r.forward_collectives = fwd.collectives;

    const Tensor dy = sp ? Shard(d.dy, 0, m) : d.dy;
    r.dx = c.want_dx ? Poisoned(x.shape(), p.dtype) : Tensor();
    r.dw = Poisoned({kOut, kIn / tp}, p.dtype);
    r.db = Poisoned({kOut}, p.dtype);
    r.pre_db = c.input_activation && c.want_dx ? Poisoned({kIn / tp}, p.dtype) : Tensor();
    ResetCounts(m);
    const functional::BackwardInfo bwd =
        RowParallelLinearBackward(options,
                                  {.dy = ViewOf(dy),
                                   .x = ViewOf(x),
                                   .weight = ViewOf(w),
                                   .dx = r.dx.defined() ? ViewOf(r.dx) : TensorView{},
                                   .dweight = ViewOf(r.dw),
                                   .dbias = ViewOf(r.db),
                                   .input_activation = c.input_activation ? kernels::LinearActivation::kGeluTanh
                                                                          : kernels::LinearActivation::kNone,
                                   .pre_activation = c.input_activation ? ViewOf(x) : TensorView{},
                                   .pre_activation_dbias = r.pre_db.defined() ? ViewOf(r.pre_db) : TensorView{}},
                                  m.group());
    Synchronize(TestDevice());
    r.backward = m.mesh.group(m.tp_dim).Counts();
    r.backward_collectives = bwd.collectives;
    return r;
}

void RunRowPipeline(const RowPipeCase &c) {
    const MeshAndDim m = GetMesh(c.mesh);
    const std::int64_t tp = m.tp();
    const Problem &p = c.problem;
    const Dense d = MakeDense(p, m);
    const Outcome plain = RowRun(c, m, d, 0);
    const auto elem = static_cast<std::int64_t>(ElementSize(p.dtype));
    const std::int64_t y_bytes = Numel(p.lead) * kOut * elem;
    const std::int64_t x_bytes = Numel(d.x.shape()) * elem;
    const bool sp = c.sequence_parallel;
    const int rank = static_cast<int>(p.lead.size()) + 1;
    for (int chunks : {2, 3, 4}) {
        if (chunks > ChunkedRows(p, sp, tp)) {
            continue;
        }
        SCOPED_TRACE(Describe(c, tp, chunks));
        const Outcome run = RowRun(c, m, d, chunks);
        if (p.data == Data::kInteger) {
            ExpectSameResults(run, plain, c.input_activation);
        }
        // Forward: y all-reduced (reduce-scattered) in C chunks, from the whole partial y.
        ExpectCollectives(run.forward, run.forward_collectives,
                          Want{.all_reduce = sp ? 0 : chunks,
                               .all_reduce_bytes = sp ? 0 : y_bytes,
                               .reduce_scatter = sp ? chunks : 0,
                               .reduce_scatter_bytes = sp ? y_bytes : 0},
                          tp, "forward");
        // Backward: dy all-gathered in C chunks under sequence parallelism when a dgrad consumes them (else once); a
        // non-parallel input's dx all-gathered once (not pipelined).
        const std::int64_t gathers = sp ? (c.want_dx ? chunks : 1) : (!c.input_is_parallel && c.want_dx ? 1 : 0);
        const std::int64_t gather_bytes = sp ? y_bytes / tp : (gathers > 0 ? x_bytes / tp : 0);
        ExpectCollectives(run.backward, run.backward_collectives,
                          Want{.all_gather = gathers, .all_gather_bytes = gather_bytes}, tp, "backward");
        Shape y_shape = WithLast(p.lead, kOut);
        EXPECT_TRUE(Matches(Gather(run.y, y_shape, sp ? 0 : -1, m), d.y, p.data, p.dtype, tp)) << "y";
        if (run.dx.defined() && !c.input_activation) {
            EXPECT_TRUE(
                Matches(Gather(run.dx, d.x.shape(), c.input_is_parallel ? rank - 1 : -1, m), d.dx, p.data, p.dtype))
                << "dx";
        }
        EXPECT_TRUE(Matches(Gather(run.dw, {kOut, kIn}, 1, m), d.dw, p.data, p.dtype)) << "dweight";
        EXPECT_TRUE(Matches(run.db, d.db, p.data, p.dtype)) << "dbias";
        if (c.input_activation) {
            // Not integer-valued after the GELU grad: chunked and plain agree within rounding at least.
            EXPECT_TRUE(Matches(run.dx, plain.dx.ToDoubleVector(), Data::kRandom, p.dtype)) << "dx (gelu grad)";
            EXPECT_TRUE(Matches(run.pre_db, plain.pre_db.ToDoubleVector(), Data::kRandom, p.dtype))
                << "pre_activation_dbias";
        }
    }
}

TEST(FunctionalPipelineTest, RowForwardAllReducesYInChunksThenAddsTheBiasOnce) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : PipelineProblems()) {
        RunRowPipeline({.problem = p});
        RunRowPipeline({.mesh = MeshKind::kDpTp, .problem = p});
    }
    RunRowPipeline({.problem = PipelineProblems()[0], .input_is_parallel = false});
    RunRowPipeline({.problem = PipelineProblems()[1], .input_is_parallel = false, .overlap = false});
}

TEST(FunctionalPipelineTest, RowSequenceParallelReduceScattersYAndGathersDyInChunks) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : PipelineProblems()) {
        RunRowPipeline({.problem = p, .sequence_parallel = true});
        RunRowPipeline({.mesh = MeshKind::kTpDp, .problem = p, .sequence_parallel = true});
    }
    RunRowPipeline({.problem = PipelineProblems()[0], .sequence_parallel = true, .overlap = false});
    RunRowPipeline({.problem = PipelineProblems()[1], .sequence_parallel = true, .want_dx = false});
}

TEST(FunctionalPipelineTest, RowSequenceParallelGeluGradAndItsBiasGradRunPerChunk) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunRowPipeline({.problem = PipelineProblems()[0], .sequence_parallel = true, .input_activation = true});
    RunRowPipeline({.problem = PipelineProblems()[1], .sequence_parallel = true, .input_activation = true});
    RunRowPipeline({.problem = PipelineProblems()[0], .input_activation = true});
    RunRowPipeline({.problem = PipelineProblems()[3], .sequence_parallel = true, .input_activation = true});
}

// ---- the order: each chunk's collective issued as soon as its GEMM is queued
// --------------------------------------

/// A LinearForward provider that records, per call, how many collectives the tp group had issued by then.
struct Probe {
    kernels::LinearForwardOp::Fn fallback = nullptr;
    comm::Communicator *tp = nullptr;
    std::vector<std::int64_t> issued;
};
Probe &TheProbe() {
    static Probe probe;
    return probe;
}
constexpr std::string_view kProbe = "pipeline_probe";

void ProbeLinearForward(const kernels::LinearForwardArgs &args) {
    Probe &probe = TheProbe();
    probe.issued.push_back(probe.tp->Counts().TotalCalls());
    const kernels::detail::ProviderScope scope(kernels::kDefaultProvider);
    probe.fallback(args);
}

class ProbeScope {
public:
    explicit ProbeScope(comm::Communicator &tp) {
        const DeviceType device = TestDevice().type;
        TheProbe() =
            Probe{.fallback = kernels::OpTable<kernels::LinearForwardOp>::Resolve(device).fn, .tp = &tp, .issued = {}};
        kernels::Register<kernels::LinearForwardOp>(device, kProbe, &ProbeLinearForward);
        kernels::SetOpProvider(kernels::LinearForwardOp::kName, kProbe);
    }
    ~ProbeScope() {
        kernels::ResetProviderSelection();
        kernels::UnregisterProvider<kernels::LinearForwardOp>(kProbe);
    }
    ProbeScope(const ProbeScope &) = delete;
    ProbeScope &operator=(const ProbeScope &) = delete;
};

// Row forward: chunk c's GEMMs (one per rank block under sequence parallelism) run with the c collectives of the
// chunks before issued. Column forward under sequence parallelism: every chunk's all-gather is issued before the first
// GEMM, which then run one per rank block as the chunks arrive.
TEST(FunctionalPipelineTest, EachChunksCollectiveIsIssuedAsSoonAsItsGemmIsQueued) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 moves nothing: no pipeline";
    }
    const Problem &p = PipelineProblems()[0];
    const Dense d = MakeDense(p, m);
    constexpr int kChunks = 3;
    for (bool sp : {false, true}) {
        SCOPED_TRACE(fmt::format("row forward sequence_parallel={}", sp));
        std::vector<std::int64_t> issued;
        {
            const ProbeScope probe(m.mesh.group(m.tp_dim));
            RowRun({.problem = p, .sequence_parallel = sp}, m, d, kChunks);
            issued = TheProbe().issued;
        }
        std::vector<std::int64_t> want;
        for (int c = 0; c < kChunks; ++c) {
            for (std::int64_t block = 0; block < (sp ? tp : 1); ++block) {
                want.push_back(c);
            }
        }
        EXPECT_EQ(issued, want);
    }
    {
        SCOPED_TRACE("column forward sequence_parallel=true");
        std::vector<std::int64_t> issued;
        {
            const ProbeScope probe(m.mesh.group(m.tp_dim));
            ColumnRun({.problem = p, .sequence_parallel = true}, m, d, kChunks);
            issued = TheProbe().issued;
        }
        EXPECT_EQ(issued, std::vector<std::int64_t>(static_cast<std::size_t>(kChunks * tp), kChunks));
    }
}

// 0 and 1 are both off; C = rows (one row per chunk) is the finest pipeline. (Bad counts: FunctionalLinearErrorTest.)
TEST(FunctionalPipelineTest, OneChunkIsOffAndOneRowPerChunkIsTheFinest) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    const Problem &p = PipelineProblems()[1]; // [12]: 12 / tp rows per rank under sequence parallelism
    const Dense d = MakeDense(p, m);
    const std::int64_t rows = 12 / tp;
    const Outcome plain = ColumnRun({.problem = p, .sequence_parallel = true}, m, d, 0);
    for (int chunks : {1, static_cast<int>(rows)}) {
        SCOPED_TRACE(fmt::format("comm_chunks {}", chunks));
        const Outcome run = ColumnRun({.problem = p, .sequence_parallel = true}, m, d, chunks);
        ExpectSameResults(run, plain);
        const std::int64_t x_bytes = Numel(d.x.shape()) * static_cast<std::int64_t>(ElementSize(p.dtype));
        const std::int64_t calls = chunks > 1 ? chunks : 1;
        ExpectCollectives(run.forward, run.forward_collectives,
                          Want{.all_gather = calls, .all_gather_bytes = x_bytes / tp}, tp, "forward");
        ExpectCollectives(run.backward, run.backward_collectives,
                          Want{.reduce_scatter = calls, .reduce_scatter_bytes = x_bytes}, tp, "backward");
    }
}

} // namespace
} // namespace shardline
