// A Linear layer's forward and backward through the kernels, captured into a CUDA graph on the context stream and
// replayed: the replay computes what the eager calls compute (the same bits, since the plans and their algorithms are
// the same), on new input values written into the captured buffers, with the split backward ops and with
// LinearBackward (whose separate bias grad forks a side stream inside the graph), and when accumulating into fp32 main
// grads.

#include <cmath>
#include <functional>
#include <string>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <shardline/kernels/linear.h>

#include "captured_graph.h"
#include "helpers.h"

namespace shardline::testing {
namespace {

using kernels::LinearBackward;
using kernels::LinearBackwardBias;
using kernels::LinearBackwardInput;
using kernels::LinearBackwardWeight;
using kernels::LinearForward;

/// The tensors of one layer step: inputs (overwritten between replays) and outputs.
struct Step {
    Step(std::int64_t m, std::int64_t in, std::int64_t out, DType dtype, DType grad_dtype)
        : x(Tensor::Empty({m, in}, dtype, Gpu())), w(RandomGpu({out, in}, dtype, 31, "w", 1.0 / std::sqrt(in * 1.0))),
          b(RandomGpu({out}, dtype, 31, "b")), dy(Tensor::Empty({m, out}, dtype, Gpu())),
          y(Tensor::Empty({m, out}, dtype, Gpu())), dx(Tensor::Empty({m, in}, dtype, Gpu())),
          dw(Tensor::Zeros({out, in}, grad_dtype, Gpu())), db(Tensor::Zeros({out}, grad_dtype, Gpu())) {}
    /// New input values (outside any graph), as a data loader would write them.
    void Load(std::uint64_t seed) {
        x.CopyFrom(RandomGpu(x.shape(), x.dtype(), seed, "x"));
        dy.CopyFrom(RandomGpu(dy.shape(), dy.dtype(), seed, "dy"));
    }
    Tensor x, w, b, dy, y, dx, dw, db;
};

struct Outputs {
    std::vector<unsigned char> y, dx, dw, db;
};
Outputs Read(const Step& s) {
    Synchronize(Gpu());
    return Outputs{HostBytes(s.y), HostBytes(s.dx), HostBytes(s.dw), HostBytes(s.db)};
}

void ExpectSameBits(const Outputs& replay, const Outputs& eager) {
    EXPECT_EQ(replay.y, eager.y) << "y";
    EXPECT_EQ(replay.dx, eager.dx) << "dx";
    EXPECT_EQ(replay.dw, eager.dw) << "dw";
    EXPECT_EQ(replay.db, eager.db) << "db";
}

/// With new inputs from `seed`: a replay of `graph` writes the same bits as `body` run eagerly.
template <class Body> void ExpectReplayEqualsEager(Step& s, CapturedGraph& graph, Body& body, std::uint64_t seed) {
    s.Load(seed);
    graph.Replay();
    const Outputs replay = Read(s);
    body();
    ExpectSameBits(replay, Read(s));
}

using CudaLinearGraphTest = CudaParamTest<DType>;

TEST_P(CudaLinearGraphTest, SplitOpsStepReplayEqualsEager) {
    const DType dtype = GetParam();
    Step s(512, 256, 384, dtype, dtype);
    auto body = [&] {
        LinearForward({.x = s.x, .weight = s.w, .bias = &s.b, .y = s.y});
        LinearBackwardInput({.dy = s.dy, .weight = s.w, .dx = s.dx});
        LinearBackwardWeight({.dy = s.dy, .x = s.x, .dweight = s.dw});
        LinearBackwardBias({.dy = s.dy, .dbias = s.db});
    };
    // Eager first: plans are built (and tuned) outside the capture, as in a training loop's first step.
    s.Load(1);
    body();
    CapturedGraph graph(CudaContext::Get(0).stream(), body);
    for (const std::uint64_t seed : {2, 3}) {
        SCOPED_TRACE(::testing::Message() << "inputs " << seed);
        ExpectReplayEqualsEager(s, graph, body, seed);
        // And the values are right (not the same garbage twice).
        const Values dyv = s.dy.ToDoubleVector();
        const Values bv = s.b.ToDoubleVector();
        EXPECT_TRUE(ValuesMatch(s.y, RefLinearForward(s.x.ToDoubleVector(), s.w.ToDoubleVector(), &bv, 512, 384, 256),
                                dtype, kUnfusedBiasRoundings));
        EXPECT_TRUE(ValuesMatch(s.db, RefColumnSum(dyv, 512, 384), dtype));
    }
}

TEST_P(CudaLinearGraphTest, LinearBackwardWithSideStreamReplayEqualsEager) {
    const DType dtype = GetParam();
    Step s(1024, 256, 512, dtype, dtype);
    auto body = [&] {
        LinearForward({.x = s.x, .weight = s.w, .bias = &s.b, .y = s.y});
        LinearBackward({.dy = s.dy, .x = &s.x, .weight = &s.w, .dx = &s.dx, .dweight = &s.dw, .dbias = &s.db});
    };
    s.Load(4);
    body();
    CapturedGraph graph(CudaContext::Get(0).stream(), body);
    EXPECT_GE(graph.nodes(), 3u);
    for (const std::uint64_t seed : {5, 6}) {
        SCOPED_TRACE(::testing::Message() << "inputs " << seed);
        ExpectReplayEqualsEager(s, graph, body, seed);
        const Values dyv = s.dy.ToDoubleVector();
        EXPECT_TRUE(ValuesMatch(s.db, RefColumnSum(dyv, 1024, 512), dtype, kEpilogueRoundings));
        EXPECT_TRUE(ValuesMatch(s.dw, RefLinearBackwardWeight(dyv, s.x.ToDoubleVector(), 1024, 512, 256), dtype,
                                kEpilogueRoundings));
    }
}

TEST_P(CudaLinearGraphTest, MainGradAccumulationReplaysAccumulate) {
    const DType dtype = GetParam();
    Step s(512, 128, 256, dtype, DType::kFloat32);
    auto backward = [&] {
        LinearBackward(
            {.dy = s.dy, .x = &s.x, .weight = &s.w, .dx = &s.dx, .dweight = &s.dw, .dbias = &s.db, .accumulate = true});
    };
    s.Load(7);
    backward(); // plans built and tuned eagerly
    CapturedGraph graph(CudaContext::Get(0).stream(), backward);
    // Two replays from zero: twice the step's grads, as two eager calls give.
    s.dw.Fill(0.0);
    s.db.Fill(0.0);
    graph.Replay();
    graph.Replay();
    const Outputs replay = Read(s);
    s.dw.Fill(0.0);
    s.db.Fill(0.0);
    backward();
    backward();
    const Outputs eager = Read(s);
    EXPECT_EQ(replay.dw, eager.dw) << "dw";
    EXPECT_EQ(replay.db, eager.db) << "db";
    const Values dyv = s.dy.ToDoubleVector();
    Values want = RefLinearBackwardWeight(dyv, s.x.ToDoubleVector(), 512, 256, 128);
    for (double& v : want) {
        v *= 2.0;
    }
    EXPECT_TRUE(ValuesMatch(s.dw, want, DType::kFloat32, 2));
}

INSTANTIATE_TEST_SUITE_P(DType, CudaLinearGraphTest, CudaDTypes(), DTypeParamName);

} // namespace
} // namespace shardline::testing
