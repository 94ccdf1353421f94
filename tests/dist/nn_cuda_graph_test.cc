// A ParallelMLP forward + backward step through shardline autograd, captured into a CUDA graph on the compute stream
// and replayed (issue 7). Over tp = the world (NCCL), with and without sequence parallelism, fp32 and bf16 with fp32
// main grads: the replay gives what the eager step gives on the same inputs, and follows new input values written
// into the captured buffers. The collectives are captured too (the NCCL communicator joins the capture).
//
// What a capturable step needs (docs/autograd.md): every buffer that outlives the step is allocated before capture
// (inputs, dY, the main grads that backward accumulates into, the output copy); the step's temporaries are allocated
// and freed inside it (stream-ordered, so they become the graph's own memory); GEMM plans are built and tuned by an
// eager step first.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/nn/mlp.h>
#include <shardline/nn/moe.h>

#include "captured_graph.h"
#include "dist_tensor_test_util.h"

namespace shardline {
namespace {

using namespace dist_test;

/// A random normal tensor (not integers: the GELU makes the sums inexact anyway), the same on every rank.
Tensor RandomNormal(const Shape &shape, std::string_view name, std::uint64_t seed) {
    Tensor t = Tensor::Empty(shape, DType::kFloat32, TestDevice());
    FillRandom(t, RandomSpec{.seed = seed, .name = name});
    return t;
}

/// Everything one step reads and writes, allocated before capture.
struct StepState {
    DeviceMesh *mesh = nullptr;
    std::unique_ptr<nn::ParallelMLP> mlp;
    Variable x;    ///< leaf requiring grad (main grad allocated: dX accumulates into it)
    DistTensor dy; ///< in the output's layout
    Tensor y_out;  ///< the step copies its output here
    spmd::Layout io_layout;
    DType dtype = DType::kFloat32;
};

/// Writes new full values of x and dY (cast to the model dtype) into the existing buffers, in place.
void SetInputs(StepState &s, std::uint64_t seed, std::int64_t tokens, std::int64_t hidden) {
    const DistTensor xs =
        DistTensor::FromFull(RandomNormal({tokens, hidden}, "x", seed).To(s.dtype), s.io_layout, *s.mesh);
    const DistTensor dys =
        DistTensor::FromFull(RandomNormal({tokens, hidden}, "dy", seed).To(s.dtype), s.io_layout, *s.mesh);
    Tensor xl = s.x.local();
    xl.CopyFrom(xs.local());
    Tensor dyl = s.dy.local();
    dyl.CopyFrom(dys.local());
}

/// One training step's forward and backward (no optimizer: its step count lives on the host).
void Step(StepState &s) {
    s.x.ZeroGrad();
    for (auto &[name, p] : s.mlp->NamedParameters()) {
        p.ZeroGrad();
    }
    Variable y = s.mlp->Forward(s.x);
    y.Backward(&s.dy);
    s.y_out.CopyFrom(y.local());
}

/// Copies of what a step produced: y, dX and every parameter's main grad (local shards).
std::vector<std::pair<std::string, Tensor>> Results(const StepState &s) {
    std::vector<std::pair<std::string, Tensor>> out;
    out.emplace_back("y", s.y_out.Clone());
    out.emplace_back("x.grad", s.x.grad().local().Clone());
    for (const auto &[name, p] : s.mlp->NamedParameters()) {
        out.emplace_back(name + ".grad", p.grad().local().Clone());
    }
    return out;
}

void ExpectSameResults(const std::vector<std::pair<std::string, Tensor>> &got,
                       const std::vector<std::pair<std::string, Tensor>> &want, const std::string &what) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
        SCOPED_TRACE(what + ": " + want[i].first);
        // The replay runs the eager step's kernels (same plans, same algorithms) and the same NCCL collectives:
        // the same bits.
        EXPECT_TRUE(dist_test::SameValues(got[i].second, want[i].second));
    }
}

struct GraphCase {
    bool sequence_parallel = false;
    DType dtype = DType::kFloat32;
};

class ParallelMLPCudaGraphTest : public ::testing::TestWithParam<GraphCase> {};

TEST_P(ParallelMLPCudaGraphTest, ReplayMatchesEagerAndFollowsNewInputs) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const GraphCase c = GetParam();
    const int tp = World().size();
    constexpr std::int64_t kTokens = 64;
    constexpr std::int64_t kHidden = 96;
    constexpr std::int64_t kFfn = 256;
    DeviceMesh mesh(World(), {tp}, {"tp"});
    StepState s;
    s.mesh = &mesh;
    s.dtype = c.dtype;
    s.mlp = std::make_unique<nn::ParallelMLP>(
        nn::ParallelMLPOptions{.hidden = kHidden, .ffn_hidden = kFfn, .sequence_parallel = c.sequence_parallel},
        nn::TensorParallelGroup::Named(mesh, "tp"),
        nn::ParameterOptions{.dtype = c.dtype, .device = TestDevice(), .seed = 7});
    // Sequence parallel: x and y sharded on the tokens over tp; else replicated.
    s.io_layout =
        c.sequence_parallel ? spmd::Layout(std::vector<std::vector<int>>{{0}, {}}) : spmd::Layout::Replicated(2);
    s.x = Variable(DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "x", 1).To(c.dtype), s.io_layout, mesh), true);
    s.dy = DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "dy", 1).To(c.dtype), s.io_layout, mesh);
    s.y_out = Tensor::Empty(s.dy.local().shape(), c.dtype, TestDevice());
    // fp32 main grads (Megatron's main_grad): persistent buffers that backward accumulates into with beta = 1.
    s.x.AllocateMainGrad(DType::kFloat32);
    for (auto &[name, p] : s.mlp->NamedParameters()) {
        p.AllocateMainGrad(DType::kFloat32);
    }

    // Eager warm-up: plans built, algorithms tuned, the communicators' lazy state created.
    Step(s);
    Step(s);
    SetInputs(s, 11, kTokens, kHidden);
    Step(s);
    const auto eager_a = Results(s);

    testing::CapturedGraph graph(CudaContext::Get(TestDevice().index).stream(), [&] { Step(s); });
    EXPECT_GT(graph.nodes(), 5U);
    graph.Replay();
    ExpectSameResults(Results(s), eager_a, "replay, inputs A");

    SetInputs(s, 12, kTokens, kHidden);
    graph.Replay();
    const auto replay_b = Results(s);
    graph.Replay(); // idempotent: the grads are zeroed inside the graph
    ExpectSameResults(Results(s), replay_b, "second replay, inputs B");
    Step(s);
    ExpectSameResults(replay_b, Results(s), "replay vs eager, inputs B");
    // Inputs B really changed the results (the graph read the buffers, not captured values).
    EXPECT_FALSE(dist_test::SameValues(replay_b[0].second, eager_a[0].second));
}

std::string CaseName(const ::testing::TestParamInfo<GraphCase> &info) {
    return std::string(info.param.sequence_parallel ? "SequenceParallel" : "AllReduce") +
           (info.param.dtype == DType::kBFloat16 ? "Bf16" : "Fp32");
}

INSTANTIATE_TEST_SUITE_P(Cases, ParallelMLPCudaGraphTest,
                         ::testing::Values(GraphCase{false, DType::kFloat32}, GraphCase{true, DType::kFloat32},
                                           GraphCase{false, DType::kBFloat16}, GraphCase{true, DType::kBFloat16}),
                         CaseName);

// nn::MoEMLP's fwd+bwd at ep 1 (router, permutation, the experts' grouped GEMMs with the group sizes on the device,
// the combine, the auxiliary losses) captured into a CUDA graph and replayed: the layer makes no host sync there
// (docs/moe.md), so the routing is computed inside the graph and new token values route differently on replay.
// Experts over tp (etp = tp: fc1 column-, fc2 row-parallel, NCCL all-reduces captured) or whole on every tp rank
// (etp 1: the tp ranks split the tokens, an all-gather captured); bf16 and fp16, the dtypes of the CUTLASS grouped
// GEMM (the only grouped path that reads device sizes without a host copy).
struct MoEGraphCase {
    DType dtype = DType::kBFloat16;
    std::int64_t etp = 0;
};

class MoEMLPCudaGraphTest : public ::testing::TestWithParam<MoEGraphCase> {};

TEST_P(MoEMLPCudaGraphTest, ReplayMatchesEagerAndFollowsNewRoutings) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const MoEGraphCase c = GetParam();
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, TestDevice().index), cudaSuccess);
    if (!SHARDLINE_HAVE_CUTLASS || prop.major != 9 || prop.minor != 0) {
        GTEST_SKIP() << "device group sizes without the CUTLASS grouped GEMM (this build: "
                     << (SHARDLINE_HAVE_CUTLASS ? "CUTLASS" : "no CUTLASS") << ", sm_" << prop.major << prop.minor
                     << ") are read on the host: the layer cannot be captured";
    }
    const int tp = World().size();
    constexpr std::int64_t kTokens = 64;
    constexpr std::int64_t kHidden = 128;
    constexpr std::int64_t kFfn = 256;
    constexpr std::int64_t kExperts = 8;
    DeviceMesh mesh(World(), {1, 1, tp}, {"dp", "ep", "tp"});
    nn::MoEMLP moe({.hidden = kHidden,
                    .ffn = kFfn,
                    .num_experts = kExperts,
                    .topk = 2,
                    .etp = c.etp,
                    .aux_loss_coeff = 0.01,
                    .z_loss_coeff = 0.001},
                   mesh, nn::ParameterOptions{.dtype = c.dtype, .device = TestDevice(), .seed = 5, .name = "moe"});
    const spmd::Layout io = spmd::Layout::Replicated(2);
    auto set_inputs = [&](Variable &x, DistTensor &dy, std::uint64_t seed) {
        Tensor xl = x.local();
        xl.CopyFrom(DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "x", seed).To(c.dtype), io, mesh).local());
        Tensor dyl = dy.local();
        dyl.CopyFrom(DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "dy", seed).To(c.dtype), io, mesh).local());
    };
    Variable x(DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "x", 1).To(c.dtype), io, mesh), true);
    DistTensor dy = DistTensor::FromFull(RandomNormal({kTokens, kHidden}, "dy", 1).To(c.dtype), io, mesh);
    // Persistent buffers (allocated before capture): the main grads backward accumulates into, and copies of y, the
    // auxiliary loss and the per-expert load.
    x.AllocateMainGrad(DType::kFloat32);
    for (auto &[name, p] : moe.NamedParameters()) {
        p.AllocateMainGrad(DType::kFloat32);
    }
    Tensor y_out = Tensor::Empty(x.local().shape(), c.dtype, TestDevice());
    Tensor aux_out = Tensor::Empty({}, DType::kFloat32, TestDevice());
    Tensor load_out = Tensor::Empty({kExperts}, DType::kInt64, TestDevice());
    auto step = [&] {
        x.ZeroGrad();
        for (auto &[name, p] : moe.NamedParameters()) {
            p.ZeroGrad();
        }
        const nn::MoEOutput out = moe.Forward(x);
        ASSERT_TRUE(out.stats.expert_load.defined());
        ASSERT_FALSE(out.stats.expert_load.device().is_cpu()) << "ep 1 on CUDA keeps the loads on the device";
        autograd::Backward({out.output, out.aux_loss}, {dy, DistTensor()});
        y_out.CopyFrom(out.output.local());
        aux_out.CopyFrom(out.aux_loss.local());
        load_out.CopyFrom(out.stats.expert_load);
    };
    auto results = [&] {
        std::vector<std::pair<std::string, Tensor>> r;
        r.emplace_back("y", y_out.Clone());
        r.emplace_back("aux_loss", aux_out.Clone());
        r.emplace_back("expert_load", load_out.Clone());
        r.emplace_back("x.grad", x.grad().local().Clone());
        for (const auto &[name, p] : moe.NamedParameters()) {
            r.emplace_back(name + ".grad", p.grad().local().Clone());
        }
        return r;
    };

    // Eager warm-up: GEMM plans built, the grouped GEMMs' shape classes tuned, the communicators' lazy state.
    step();
    step();
    set_inputs(x, dy, 21);
    step();
    const auto eager_a = results();
    // The loads add up to T·topk: the routing really ran.
    const std::vector<double> load_a = load_out.ToDoubleVector();
    double copies = 0;
    for (double l : load_a) {
        copies += l;
    }
    EXPECT_EQ(copies, static_cast<double>(kTokens * 2 / (c.etp == 1 ? tp : 1)));

    const cudaStream_t stream = CudaContext::Get(TestDevice().index).stream();
    testing::CapturedGraph graph(stream, [&] { step(); });
    EXPECT_GT(graph.nodes(), 20U);
    // Capturing runs nothing, so the buffers still hold the eager step's values: NaN bytes first, so that only a replay
    // that really writes every output and gradient matches.
    std::vector<Tensor> written = {y_out, aux_out, load_out, x.grad().local()};
    for (const auto &[name, p] : moe.NamedParameters()) {
        written.push_back(p.grad().local());
    }
    for (const Tensor &t : written) {
        ASSERT_EQ(cudaMemsetAsync(t.data(), 0xFF, t.nbytes(), stream), cudaSuccess);
    }
    graph.Replay();
    ExpectSameResults(results(), eager_a, "replay, inputs A");

    set_inputs(x, dy, 22);
    graph.Replay();
    const auto replay_b = results();
    graph.Replay(); // idempotent: the grads are zeroed inside the graph
    ExpectSameResults(results(), replay_b, "second replay, inputs B");
    step();
    ExpectSameResults(replay_b, results(), "replay vs eager, inputs B");
    // Inputs B routed differently inside the graph: other loads per expert, other outputs.
    EXPECT_NE(replay_b[2].second.ToDoubleVector(), load_a) << "the routing was computed in the replay";
    EXPECT_FALSE(dist_test::SameValues(replay_b[0].second, eager_a[0].second));
}

std::string MoECaseName(const ::testing::TestParamInfo<MoEGraphCase> &info) {
    return std::string(info.param.dtype == DType::kBFloat16 ? "Bf16" : "Fp16") +
           (info.param.etp == 1 ? "WholeExperts" : "ExpertsOverTp");
}

INSTANTIATE_TEST_SUITE_P(Cases, MoEMLPCudaGraphTest,
                         ::testing::Values(MoEGraphCase{DType::kBFloat16, 0}, MoEGraphCase{DType::kBFloat16, 1},
                                           MoEGraphCase{DType::kFloat16, 0}),
                         MoECaseName);

// The host cannot wait for a captured collective: a clear error, not a hang or a broken capture report.
TEST(NcclCaptureTest, HostWaitOnACapturedCollectiveIsAClearError) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    if (World().size() < 2) {
        GTEST_SKIP() << "needs 2 ranks for a real collective";
    }
    Tensor t = dist_test::RandomFull({256}, "t");       // integers: the sums are exact in any order
    World().AllReduce(t, comm::ReduceOp::kSum)->Wait(); // eager first: lazy NCCL state
    const cudaStream_t stream = CudaContext::Get(TestDevice().index).stream();
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    std::string message = "<no error>";
    comm::WorkHandle work = World().AllReduce(t, comm::ReduceOp::kSum);
    try {
        work->Wait(true);
    } catch (const Error &e) {
        message = e.what();
    }
    work->Wait(false); // joins the capture
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    // The captured all-reduce runs at launch: sum over ranks of the same values = size x the values.
    const std::vector<double> before = t.ToDoubleVector();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<double> after = t.ToDoubleVector();
    for (std::size_t i = 0; i < after.size(); ++i) {
        ASSERT_EQ(after[i], before[i] * World().size()) << "element " << i;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    EXPECT_NE(message.find("captured into a CUDA graph"), std::string::npos) << message;
    EXPECT_NE(message.find("Work::Wait"), std::string::npos) << message;
}

} // namespace
} // namespace shardline
