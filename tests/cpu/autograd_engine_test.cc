// The autograd machinery on local Variables: needs_input_grad decides which Linear backward kernels run (observed
// through a counting kernel provider), SetupContext saves only what the requested gradients need (observed through
// the saved tensors' storage use counts), topological order in diamond graphs, gradient accumulation across backward
// calls, main-grad accumulation (beta = 1 into the preallocated buffer), NoGradGuard, and the errors.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/function.h>
#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using testing::RandomTensor;
using testing::RefColumnSum;
using testing::RefLinearBackwardInput;
using testing::RefLinearBackwardWeight;
using testing::Values;
using testing::ValuesMatch;

Tensor Data(const Shape &shape, std::string_view name, DType dtype = DType::kFloat32) {
    return RandomTensor(shape, dtype, Device::CPU(), 17, name);
}

Values Add(const Values &a, const Values &b) {
    Values out(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
        out[i] = a[i] + b[i];
    }
    return out;
}

/// The storage holders of a tensor: how many tensors (the caller's, the Variable's, the graph's) share its memory.
long Holders(const Tensor &t) { return t.storage().use_count(); }

// ---- a counting provider for the Linear backward kernels ---------------------------------------------------------

constexpr std::string_view kCounting = "autograd-counting";

struct LinearKernelCalls {
    int input = 0;
    int weight = 0;
    int weight_with_bias = 0; ///< LinearBackwardWeight calls that also computed the bias grad (fused)
    int bias = 0;
    bool weight_accumulated = false;
    const void *weight_out = nullptr;
    bool bias_accumulated = false;
    const void *bias_out = nullptr;
};
LinearKernelCalls g_calls;
kernels::LinearBackwardInputOp::Fn g_default_input = nullptr;
kernels::LinearBackwardWeightOp::Fn g_default_weight = nullptr;
kernels::LinearBackwardBiasOp::Fn g_default_bias = nullptr;

void CountingInput(const kernels::LinearBackwardInputArgs &args) {
    ++g_calls.input;
    g_default_input(args);
}

void CountingWeight(const kernels::LinearBackwardWeightArgs &args) {
    ++g_calls.weight;
    g_calls.weight_with_bias += args.dbias != nullptr ? 1 : 0;
    g_calls.weight_accumulated = args.accumulate;
    g_calls.weight_out = args.dweight.data();
    g_default_weight(args);
}

void CountingBias(const kernels::LinearBackwardBiasArgs &args) {
    ++g_calls.bias;
    g_calls.bias_accumulated = args.accumulate;
    g_calls.bias_out = args.dbias.data();
    g_default_bias(args);
}

/// Serves LinearBackwardInput/Weight/Bias through counting wrappers around the default CPU kernels.
class CountingKernelsTest : public ::testing::Test {
protected:
    void SetUp() override {
        unsetenv("SHARDLINE_PROVIDER");
        unsetenv("SHARDLINE_LINEAR_IMPL");
        kernels::ResetProviderSelection();
        const auto input = kernels::OpTable<kernels::LinearBackwardInputOp>::Resolve(DeviceType::kCPU);
        const auto weight = kernels::OpTable<kernels::LinearBackwardWeightOp>::Resolve(DeviceType::kCPU);
        const auto bias = kernels::OpTable<kernels::LinearBackwardBiasOp>::Resolve(DeviceType::kCPU);
        ASSERT_EQ(input.provider, kernels::kDefaultProvider);
        ASSERT_EQ(weight.provider, kernels::kDefaultProvider);
        ASSERT_EQ(bias.provider, kernels::kDefaultProvider);
        g_default_input = input.fn;
        g_default_weight = weight.fn;
        g_default_bias = bias.fn;
        kernels::Register<kernels::LinearBackwardInputOp>(DeviceType::kCPU, kCounting, &CountingInput);
        kernels::Register<kernels::LinearBackwardWeightOp>(DeviceType::kCPU, kCounting, &CountingWeight);
        kernels::Register<kernels::LinearBackwardBiasOp>(DeviceType::kCPU, kCounting, &CountingBias);
        kernels::SetProvider(kCounting);
        g_calls = {};
    }

    void TearDown() override {
        kernels::UnregisterProviderEverywhere(kCounting);
        kernels::ResetProviderSelection();
    }
};

// ---- needs_input_grad decides which backward kernels run
// -------------------------------------------------------------

struct Needs {
    bool x = false;
    bool w = false;
    bool b = false;
};

void PrintTo(const Needs &n, std::ostream *os) {
    *os << "x " << (n.x ? "needs" : "no") << " grad, W " << (n.w ? "needs" : "no") << " grad, b "
        << (n.b ? "needs" : "no") << " grad";
}

std::string NeedsName(const ::testing::TestParamInfo<Needs> &info) {
    std::string s;
    s += info.param.x ? "X" : "";
    s += info.param.w ? "W" : "";
    s += info.param.b ? "B" : "";
    return s;
}

const auto kEveryNeed = ::testing::Values(Needs{true, false, false}, Needs{false, true, false},
                                          Needs{false, false, true}, Needs{true, true, false}, Needs{true, false, true},
                                          Needs{false, true, true}, Needs{true, true, true});

class LinearBackwardKernelsTest : public CountingKernelsTest, public ::testing::WithParamInterface<Needs> {};

TEST_P(LinearBackwardKernelsTest, RunsOnlyTheKernelsOfTheGradientsNeeded) {
    // y[6,4] = x[6,5]·W[4,5]ᵀ + b[4]: dX = dY·W only if x needs a grad, dW = dYᵀ·x only if W does, db = Σ_rows dY only
    // if b does (alone, or fused into the weight-grad GEMM).
    const Needs n = GetParam();
    Variable x(Data({6, 5}, "x"), n.x);
    Variable w(Data({4, 5}, "w"), n.w);
    Variable b(Data({4}, "b"), n.b);
    const Tensor dy = Data({6, 4}, "dy");
    Variable y = Linear(x, w, b);
    ASSERT_TRUE(y.requires_grad());
    g_calls = {};
    const DistTensor g = DistTensor::Local(dy);
    y.Backward(&g);

    EXPECT_EQ(g_calls.input, n.x ? 1 : 0);
    EXPECT_EQ(g_calls.weight, n.w ? 1 : 0);
    EXPECT_EQ(g_calls.bias + g_calls.weight_with_bias, n.b ? 1 : 0)
        << "separate " << g_calls.bias << ", fused " << g_calls.weight_with_bias;
    const Values dyv = dy.ToDoubleVector();
    EXPECT_EQ(x.grad().defined(), n.x);
    EXPECT_EQ(w.grad().defined(), n.w);
    EXPECT_EQ(b.grad().defined(), n.b);
    if (n.x) {
        EXPECT_TRUE(ValuesMatch(x.grad().local(), RefLinearBackwardInput(dyv, w.local().ToDoubleVector(), 6, 4, 5),
                                DType::kFloat32));
    }
    if (n.w) {
        EXPECT_TRUE(ValuesMatch(w.grad().local(), RefLinearBackwardWeight(dyv, x.local().ToDoubleVector(), 6, 4, 5),
                                DType::kFloat32));
    }
    if (n.b) {
        EXPECT_TRUE(ValuesMatch(b.grad().local(), RefColumnSum(dyv, 6, 4), DType::kFloat32));
    }
}

INSTANTIATE_TEST_SUITE_P(EverySubset, LinearBackwardKernelsTest, kEveryNeed, NeedsName);

// ---- SetupContext saves only what the requested gradients need --------------------------------------------------

class LinearSavedTensorsTest : public ::testing::TestWithParam<Needs> {};

TEST_P(LinearSavedTensorsTest, SavesXOnlyForTheWeightGradAndWOnlyForTheInputGrad) {
    // The graph holds a reference to x's storage exactly when W needs a grad (dW = dYᵀ·x), and to W's exactly when x
    // needs one (dX = dY·W); backward without retain_graph releases both.
    const Needs n = GetParam();
    const Tensor xt = Data({3, 5}, "x");
    const Tensor wt = Data({2, 5}, "w");
    Variable x(xt, n.x);
    Variable w(wt, n.w);
    Variable b(Data({2}, "b"), n.b);
    const long x_before = Holders(xt);
    const long w_before = Holders(wt);
    Variable y = Linear(x, w, b);
    EXPECT_EQ(Holders(xt) - x_before, n.w ? 1 : 0) << "x saved";
    EXPECT_EQ(Holders(wt) - w_before, n.x ? 1 : 0) << "W saved";
    y.Backward(nullptr);
    EXPECT_EQ(Holders(xt), x_before);
    EXPECT_EQ(Holders(wt), w_before);
}

INSTANTIATE_TEST_SUITE_P(EverySubset, LinearSavedTensorsTest, kEveryNeed, NeedsName);

TEST(LinearSavedTensorsTest, RetainGraphKeepsTheSavedInputUntilTheLastBackward) {
    const Tensor xt = Data({3, 5}, "x");
    Variable x(xt, false);
    Variable w(Data({2, 5}, "w"), true);
    const long before = Holders(xt);
    Variable y = Linear(x, w);
    y.Backward(nullptr, /*retain_graph=*/true);
    EXPECT_EQ(Holders(xt), before + 1);
    y.Backward(nullptr);
    EXPECT_EQ(Holders(xt), before);
}

// Add's, BiasAdd's and Sum's gradients read no operand value (da = dy, db = alpha·dy; the bias grad is Σ_rows dy; a
// sum's is dy broadcast), so their nodes keep no operand's memory: a residual's or a skip_bias_add GEMM's output is
// freed when the caller drops it.
TEST(AddSavedTensorsTest, AddBiasAddAndSumKeepNoOperandsMemory) {
    const Tensor at = Data({3, 4}, "a");
    const Tensor bt = Data({3, 4}, "b");
    const Tensor xt = Data({3, 4}, "x");
    const Tensor biast = Data({4}, "bias");
    const Tensor st = Data({3, 4}, "s");
    Variable a(at, true);
    Variable b(bt, true);
    Variable x(xt, true);
    Variable bias(biast, true);
    Variable s(st, true);
    const long a_before = Holders(at);
    const long b_before = Holders(bt);
    const long x_before = Holders(xt);
    const long bias_before = Holders(biast);
    const long s_before = Holders(st);
    Variable sum = autograd::Add(a, b, -2.0);
    Variable shifted = autograd::BiasAdd(x, bias);
    Variable total = autograd::Sum(s, {1});
    EXPECT_EQ(Holders(at), a_before) << "a saved by Add";
    EXPECT_EQ(Holders(bt), b_before) << "b saved by Add";
    EXPECT_EQ(Holders(xt), x_before) << "x saved by BiasAdd";
    EXPECT_EQ(Holders(biast), bias_before) << "bias saved by BiasAdd";
    EXPECT_EQ(Holders(st), s_before) << "s saved by Sum";

    const Tensor dy = Data({3, 4}, "dy");
    const DistTensor g = DistTensor::Local(dy);
    sum.Backward(&g);
    shifted.Backward(&g);
    // Saving no tensor does not make a released node reusable: a second backward through Add is the same error.
    std::string again = "<no error>";
    try {
        sum.Backward(&g);
    } catch (const Error &e) {
        again = e.what();
    }
    EXPECT_NE(again.find("AddBackward: it was released"), std::string::npos) << again;
    EXPECT_NE(again.find("retain_graph = true"), std::string::npos) << again;
    const Values dyv = dy.ToDoubleVector();
    Values scaled = dyv;
    for (double &v : scaled) {
        v *= -2.0;
    }
    // (the failed backward above added nothing: a's and b's gradients are still the first backward's)
    EXPECT_EQ(a.grad().local().ToDoubleVector(), dyv);
    EXPECT_EQ(b.grad().local().ToDoubleVector(), scaled) << "db = alpha·dy (a power of two: exact)";
    EXPECT_EQ(x.grad().local().ToDoubleVector(), dyv);
    EXPECT_TRUE(ValuesMatch(bias.grad().local(), RefColumnSum(dyv, 3, 4), DType::kFloat32)) << "dbias = Σ_rows dy";
    const Tensor dt = Data({3}, "dtotal");
    const DistTensor gt = DistTensor::Local(dt);
    total.Backward(&gt);
    const Values dtv = dt.ToDoubleVector();
    Values ds(12);
    for (std::size_t i = 0; i < ds.size(); ++i) {
        ds[i] = dtv[i / 4];
    }
    EXPECT_EQ(s.grad().local().ToDoubleVector(), ds) << "ds = dy broadcast over the summed dim";
}

// ---- topological order --------------------------------------------------------------------------------------------

/// An identity Function that records its backward calls and the gradient it received.
class Probe final : public Function {
public:
    Probe(std::string tag, std::vector<std::string> *log) : tag_(std::move(tag)), log_(log) {}
    std::string name() const override { return "Probe"; }
    int calls = 0;
    Values received;

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override { return {in[0]}; }
    void SetupContext(const Inputs &, const std::vector<DistTensor> &) override {}
    std::vector<dist::Grad> Backward(const std::vector<DistTensor> &g) override {
        ++calls;
        log_->push_back(tag_);
        received = g[0].local().ToDoubleVector();
        return {dist::Grad{.value = g[0]}};
    }

private:
    std::string tag_;
    std::vector<std::string> *log_;
};

Variable Through(const std::shared_ptr<Probe> &probe, const Variable &x) { return Function::Apply(probe, {x}).at(0); }

std::ptrdiff_t Position(const std::vector<std::string> &log, const std::string &tag) {
    return std::find(log.begin(), log.end(), tag) - log.begin();
}

//        x
//        |
//        A            A's output is used by a long path (C -> B) and a short one (Scale 3):
//      /   \          A must wait for both, run once, and receive 1 + 3 = 4.
//     C    Scale(3)
//     |     |
//     B     |
//      \   /
//       Add -> z
void ExpectDiamondBackward() {
    std::vector<std::string> log;
    auto a = std::make_shared<Probe>("A", &log);
    auto b = std::make_shared<Probe>("B", &log);
    auto c = std::make_shared<Probe>("C", &log);
    Variable x(Data({2, 3}, "x"), true);
    Variable h = Through(a, x);
    Variable z = autograd::Add(Through(b, Through(c, h)), Scale(h, 3.0));
    z.Backward(nullptr);
    EXPECT_EQ(a->calls, 1);
    EXPECT_EQ(b->calls, 1);
    EXPECT_EQ(c->calls, 1);
    EXPECT_EQ(log, (std::vector<std::string>{"B", "C", "A"}));
    EXPECT_EQ(a->received, Values(6, 4.0));
    EXPECT_EQ(x.grad().local().ToDoubleVector(), Values(6, 4.0));
}

TEST(AutogradEngineTest, DiamondRunsEachNodeOnceWithTheSummedGradient) { ExpectDiamondBackward(); }

TEST(AutogradEngineTest, GraphOfMoreNodesThanTheLinearTableRunsEachOnceInOrder) {
    // 40 probes in a ladder (the engine searches its tasks linearly up to 16 nodes, then through a hash index):
    // h_i = P_i(h_{i-1} + (i % 3 == 0 ? x : h_{i-1})), so dz/dx follows c_i = c_{i-1} + 1 or 2·c_{i-1}, c_0 = 1, and
    // every probe runs once, after the one above it.
    std::vector<std::string> log;
    std::vector<std::shared_ptr<Probe>> probes;
    Variable x(Data({2, 3}, "x"), true);
    Variable h = x;
    double c = 1.0;
    for (int i = 1; i <= 40; ++i) {
        probes.push_back(std::make_shared<Probe>(fmt::format("P{}", i), &log));
        const bool skip = i % 3 == 0;
        h = Through(probes.back(), autograd::Add(h, skip ? x : h));
        c = skip ? c + 1.0 : 2.0 * c;
    }
    const Tensor dz = Data({2, 3}, "dz");
    const DistTensor dzv = DistTensor::Local(dz);
    h.Backward(&dzv);
    ASSERT_EQ(log.size(), 40u);
    for (int i = 0; i < 40; ++i) {
        EXPECT_EQ(probes[static_cast<std::size_t>(i)]->calls, 1) << i;
        EXPECT_EQ(log[static_cast<std::size_t>(i)], fmt::format("P{}", 40 - i));
    }
    Values expected = dz.ToDoubleVector();
    for (double &v : expected) {
        v *= c;
    }
    EXPECT_TRUE(ValuesMatch(x.grad().local(), expected, DType::kFloat32));
}

// ---- the engine's per-thread working storage (reused between backwards) ---------------------------------------

/// A chain of `probes` probes from leaf x, every other one of the first 20 after a Scale(2), run backward from ones:
/// each probe runs once, in order, and x's gradient is 2 to the number of Scales. More than 16 nodes take the task
/// table's hash index.
void ExpectChainBackward(int probes) {
    std::vector<std::string> log;
    std::vector<std::shared_ptr<Probe>> chain;
    Variable x(Data({2, 3}, "chain x"), true);
    Variable h = x;
    for (int i = 0; i < probes; ++i) {
        chain.push_back(std::make_shared<Probe>(fmt::format("P{}", i), &log));
        h = Through(chain.back(), i < 20 && i % 2 == 0 ? Scale(h, 2.0) : h);
    }
    h.Backward(nullptr);
    ASSERT_EQ(log.size(), static_cast<std::size_t>(probes));
    for (int i = 0; i < probes; ++i) {
        EXPECT_EQ(chain[static_cast<std::size_t>(i)]->calls, 1);
        EXPECT_EQ(log[static_cast<std::size_t>(i)], fmt::format("P{}", probes - 1 - i));
    }
    const int scales = (std::min(probes, 20) + 1) / 2;
    EXPECT_EQ(x.grad().local().ToDoubleVector(), Values(6, static_cast<double>(1LL << scales)));
}

TEST(AutogradEngineTest, SmallGraphsAfterLargeOnesOnTheSameThread) {
    // A large graph's tasks (hash index) or one past the kept size (256 nodes) must leave nothing behind for the next.
    for (int probes : {40, 300, 7}) {
        SCOPED_TRACE(probes);
        ExpectChainBackward(probes);
        ExpectDiamondBackward();
    }
    // And on a thread of its own, which ends with its storage.
    std::thread worker([] {
        ExpectChainBackward(40);
        ExpectDiamondBackward();
    });
    worker.join();
}

TEST(AutogradEngineTest, BackwardInAPostAccumulateHookRunsItsOwnGraph) {
    // The outer graph z = Add(P1(x0), P2(P3(w))): x0's accumulation runs before P3 and w's. Its hook runs a backward
    // of another graph, whose leaf's hook runs another, five deep (past the four idle scratches a thread keeps).
    constexpr int kDepth = 5;
    std::vector<std::string> log;
    std::vector<Variable> inner_leaves;
    std::vector<std::vector<std::shared_ptr<Probe>>> inner_probes(kDepth);
    std::function<void(Variable &)> nested = [&](Variable &) {
        const std::size_t d = inner_leaves.size();
        if (d >= static_cast<std::size_t>(kDepth)) {
            return;
        }
        inner_leaves.emplace_back(Data({2, 3}, fmt::format("inner {}", d)), true);
        inner_leaves.back().AddPostAccumulateHook(nested);
        Variable h = inner_leaves.back();
        for (int i = 0; i < 20; ++i) {
            inner_probes[d].push_back(std::make_shared<Probe>(fmt::format("I{}.{}", d, i), &log));
            h = Through(inner_probes[d].back(), i % 2 == 0 ? Scale(h, 2.0) : h);
        }
        h.Backward(nullptr);
    };
    Variable x0(Data({2, 3}, "x0"), true);
    Variable w(Data({2, 3}, "w"), true);
    x0.AddPostAccumulateHook(nested);
    auto p1 = std::make_shared<Probe>("P1", &log);
    auto p2 = std::make_shared<Probe>("P2", &log);
    auto p3 = std::make_shared<Probe>("P3", &log);
    Variable z = autograd::Add(Through(p1, x0), Through(p2, Through(p3, w)));
    const Tensor dz = Data({2, 3}, "dz");
    const DistTensor dzv = DistTensor::Local(dz);
    z.Backward(&dzv);

    ASSERT_EQ(inner_leaves.size(), static_cast<std::size_t>(kDepth));
    for (int d = 0; d < kDepth; ++d) {
        SCOPED_TRACE(d);
        for (const auto &p : inner_probes[static_cast<std::size_t>(d)]) {
            EXPECT_EQ(p->calls, 1);
        }
        EXPECT_EQ(inner_leaves[static_cast<std::size_t>(d)].grad().local().ToDoubleVector(), Values(6, 1024.0));
    }
    for (const auto &p : {p1, p2, p3}) {
        EXPECT_EQ(p->calls, 1);
    }
    // P3 ran after the nested backwards returned.
    EXPECT_GT(Position(log, "P3"), Position(log, fmt::format("I{}.0", kDepth - 1)));
    EXPECT_EQ(x0.grad().local().ToDoubleVector(), dz.ToDoubleVector());
    EXPECT_EQ(w.grad().local().ToDoubleVector(), dz.ToDoubleVector());
}

/// An identity Function whose backward throws.
class Thrower final : public Function {
public:
    std::string name() const override { return "Thrower"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override { return {in[0]}; }
    void SetupContext(const Inputs &, const std::vector<DistTensor> &) override {}
    std::vector<dist::Grad> Backward(const std::vector<DistTensor> &) override {
        throw Error("Thrower: the backward fails");
    }
};

TEST(AutogradEngineTest, ANodeThatThrowsLeavesNoGradientOrNodeAliveAndTheNextBackwardRuns) {
    // z = Add(Thrower(x), P(x)): Add's backward hands its gradient (shared with dz) to both branches; the thrower runs
    // first, while P's gradient waits in its task. After the throw nothing may hold that gradient or any node.
    std::vector<std::string> log;
    Variable x(Data({2, 3}, "x"), true);
    std::weak_ptr<Node> add_node, thrower_node, probe_node;
    Variable z;
    {
        auto thrower = std::make_shared<Thrower>();
        auto probe = std::make_shared<Probe>("P", &log);
        thrower_node = thrower;
        probe_node = probe;
        z = autograd::Add(Function::Apply(thrower, {x}).at(0), Through(probe, x));
        add_node = z.grad_fn();
    }
    const Tensor dz = Data({2, 3}, "dz");
    const long before = Holders(dz);
    {
        const DistTensor dzv = DistTensor::Local(dz);
        EXPECT_THROW(z.Backward(&dzv), Error);
    }
    EXPECT_TRUE(log.empty()) << "P must not have run";
    EXPECT_EQ(Holders(dz), before) << "a gradient of the failed backward is still held";
    z = Variable();
    EXPECT_TRUE(add_node.expired());
    EXPECT_TRUE(thrower_node.expired());
    EXPECT_TRUE(probe_node.expired());
    ExpectDiamondBackward();
}

/// Records what Forward and SetupContext see of their inputs: each value's address and whether it is defined.
class InputsProbe final : public Function {
public:
    std::string name() const override { return "InputsProbe"; }
    std::vector<const DistTensor *> forward_seen, setup_seen;
    std::vector<bool> defined;

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        for (std::size_t i = 0; i < in.size(); ++i) {
            forward_seen.push_back(&in[i]);
            defined.push_back(in[i].defined());
        }
        return {dist::Add(in[0], in[2], 1.0)};
    }
    void SetupContext(const Inputs &in, const std::vector<DistTensor> &) override {
        for (std::size_t i = 0; i < in.size(); ++i) {
            setup_seen.push_back(&in[i]);
        }
    }
    std::vector<dist::Grad> Backward(const std::vector<DistTensor> &g) override {
        return {dist::Grad{.value = g[0]}, dist::Grad{}, dist::Grad{.value = g[0]}};
    }
};

TEST(AutogradEngineTest, ForwardAndSetupContextReadTheInputsValuesWithoutCopies) {
    // Inputs is a view: input i is the Variable's own value (the same object, not a copy), an undefined Variable reads
    // as an undefined DistTensor, and the gradients still reach the defined inputs.
    Variable a(Data({4}, "a"), true);
    Variable none;
    Variable b(Data({4}, "b"), true);
    auto probe = std::make_shared<InputsProbe>();
    Variable z = Function::Apply(probe, {a, none, b}).at(0);
    ASSERT_EQ(probe->forward_seen.size(), 3u);
    EXPECT_EQ(probe->forward_seen[0], &a.value());
    EXPECT_EQ(probe->forward_seen[2], &b.value());
    EXPECT_EQ(probe->defined, (std::vector<bool>{true, false, true}));
    EXPECT_EQ(probe->setup_seen, probe->forward_seen);
    Values expected = a.value().local().ToDoubleVector();
    const Values bv = b.value().local().ToDoubleVector();
    for (std::size_t i = 0; i < expected.size(); ++i) {
        expected[i] += bv[i];
    }
    EXPECT_TRUE(ValuesMatch(z.value().local(), expected, DType::kFloat32));
    z.Backward(nullptr);
    EXPECT_EQ(a.grad().local().ToDoubleVector(), Values(4, 1.0));
    EXPECT_EQ(b.grad().local().ToDoubleVector(), Values(4, 1.0));

    // Without grad, Forward reads the same objects (and SetupContext does not run).
    auto no_grad_probe = std::make_shared<InputsProbe>();
    {
        const NoGradGuard no_grad;
        const Variable y = Function::Apply(no_grad_probe, {a, none, b}).at(0);
        EXPECT_FALSE(y.requires_grad());
    }
    ASSERT_EQ(no_grad_probe->forward_seen.size(), 3u);
    EXPECT_EQ(no_grad_probe->forward_seen[0], &a.value());
    EXPECT_EQ(no_grad_probe->forward_seen[2], &b.value());
    EXPECT_TRUE(no_grad_probe->setup_seen.empty());
}

TEST(AutogradEngineTest, InputUsedTwiceByOneFunctionGetsBothGradients) {
    // z = x + 3·x: dz/dx = 4.
    Variable x(Data({5}, "x"), true);
    Variable z = autograd::Add(x, x, 3.0);
    z.Backward(nullptr);
    EXPECT_EQ(x.grad().local().ToDoubleVector(), Values(5, 4.0));
}

TEST_F(CountingKernelsTest, LinearInADiamondRunsItsBackwardOnce) {
    // h = x·Wᵀ; z = 2·h + gelu(h): dh = dz·(2 + gelu'(h)), dX = dh·W, dW = dhᵀ·x, each GEMM once.
    const Tensor xt = Data({4, 3}, "x");
    const Tensor wt = Data({5, 3}, "w");
    const Tensor dzt = Data({4, 5}, "dz");
    Variable x(xt, true);
    Variable w(wt, true);
    Variable h = Linear(x, w);
    Variable z = autograd::Add(Scale(h, 2.0), Gelu(h));
    g_calls = {};
    const DistTensor dz = DistTensor::Local(dzt);
    z.Backward(&dz);
    EXPECT_EQ(g_calls.input, 1);
    EXPECT_EQ(g_calls.weight, 1);
    const Values hv = h.local().ToDoubleVector();
    const Values dzv = dzt.ToDoubleVector();
    Values dh(hv.size());
    for (std::size_t i = 0; i < hv.size(); ++i) {
        dh[i] = dzv[i] * (2.0 + testing::RefGeluTanhGrad(hv[i]));
    }
    EXPECT_TRUE(
        ValuesMatch(x.grad().local(), RefLinearBackwardInput(dh, wt.ToDoubleVector(), 4, 5, 3), DType::kFloat32, 4.0));
    EXPECT_TRUE(
        ValuesMatch(w.grad().local(), RefLinearBackwardWeight(dh, xt.ToDoubleVector(), 4, 5, 3), DType::kFloat32, 4.0));
}

TEST(AutogradEngineTest, RootThatFeedsAnotherRootRunsOnce) {
    // y = A(x), z = 3·y; Backward({y, z}, {gy, gz}): A runs once, after z's gradient reached it: dx = gy + 3·gz.
    std::vector<std::string> log;
    auto a = std::make_shared<Probe>("A", &log);
    Variable x(Data({4}, "x"), true);
    Variable y = Through(a, x);
    Variable z = Scale(y, 3.0);
    const Tensor gy = Data({4}, "gy");
    const Tensor gz = Data({4}, "gz");
    Backward({y, z}, {DistTensor::Local(gy), DistTensor::Local(gz)});
    EXPECT_EQ(a->calls, 1);
    const Values gyv = gy.ToDoubleVector();
    const Values gzv = gz.ToDoubleVector();
    Values expected(4);
    for (std::size_t i = 0; i < 4; ++i) {
        expected[i] = gyv[i] + 3.0 * gzv[i];
    }
    EXPECT_TRUE(ValuesMatch(x.grad().local(), expected, DType::kFloat32));
}

/// Two outputs of one input: out0 = x, out1 = 2·x (a Function with several outputs, as the MoE router's).
class TwoOutputs final : public Function {
public:
    std::string name() const override { return "TwoOutputs"; }
    std::vector<Values> received;

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override { return {in[0], dist::Scale(in[0], 2.0)}; }
    void SetupContext(const Inputs &, const std::vector<DistTensor> &) override {}
    std::vector<dist::Grad> Backward(const std::vector<DistTensor> &g) override {
        received.clear();
        for (const DistTensor &gi : g) {
            received.push_back(gi.defined() ? gi.local().ToDoubleVector() : Values{});
        }
        DistTensor dx = g[0].defined() ? g[0] : dist::Scale(g[1], 0.0);
        if (g[1].defined()) {
            dx = dist::Add(dx, g[1], 2.0);
        }
        return {dist::Grad{.value = dx}};
    }
};

TEST(AutogradEngineTest, EachOutputOfAFunctionSendsItsGradientToItsOwnSlot) {
    // Backward from out1 alone: the gradient arrives as output 1's (output 0's undefined), dx = 2·g.
    auto fn = std::make_shared<TwoOutputs>();
    Variable x(Data({3}, "x"), true);
    const std::vector<Variable> out = Function::Apply(fn, {x});
    ASSERT_EQ(out.size(), 2u);
    const Tensor g = Data({3}, "g");
    const DistTensor gd = DistTensor::Local(g);
    out[1].Backward(&gd);
    ASSERT_EQ(fn->received.size(), 2u);
    EXPECT_TRUE(fn->received[0].empty()) << "output 0 got output 1's gradient";
    EXPECT_EQ(fn->received[1], g.ToDoubleVector());
    const Values gv = g.ToDoubleVector();
    const Values dx = x.grad().local().ToDoubleVector();
    for (std::size_t i = 0; i < gv.size(); ++i) {
        EXPECT_EQ(dx[i], 2.0 * gv[i]);
    }
}

// ---- accumulation --------------------------------------------------------------------------------------------------

TEST(AutogradAccumulationTest, TwoBackwardCallsSumIntoTheLeafGrads) {
    const Tensor xt = Data({3, 4}, "x");
    const Tensor wt = Data({2, 4}, "w");
    Variable x(xt, true);
    Variable w(wt, true);
    Variable b(Data({2}, "b"), true);
    const Tensor dy1 = Data({3, 2}, "dy1");
    const Tensor dy2 = Data({3, 2}, "dy2");
    const DistTensor g1 = DistTensor::Local(dy1);
    const DistTensor g2 = DistTensor::Local(dy2);
    Linear(x, w, b).Backward(&g1);
    const Tensor dw1 = w.grad().local().Clone();
    Linear(x, w, b).Backward(&g2);
    const Values sum = Add(dy1.ToDoubleVector(), dy2.ToDoubleVector());
    EXPECT_TRUE(
        ValuesMatch(w.grad().local(), RefLinearBackwardWeight(sum, xt.ToDoubleVector(), 3, 2, 4), DType::kFloat32));
    EXPECT_TRUE(
        ValuesMatch(x.grad().local(), RefLinearBackwardInput(sum, wt.ToDoubleVector(), 3, 2, 4), DType::kFloat32));
    EXPECT_TRUE(ValuesMatch(b.grad().local(), RefColumnSum(sum, 3, 2), DType::kFloat32));
    // The first gradient was not modified in place by the second backward (it is the caller's to keep).
    EXPECT_TRUE(
        ValuesMatch(dw1, RefLinearBackwardWeight(dy1.ToDoubleVector(), xt.ToDoubleVector(), 3, 2, 4), DType::kFloat32));

    w.ZeroGrad();
    EXPECT_FALSE(w.grad().defined());
    Linear(x, w, b).Backward(&g2);
    EXPECT_TRUE(ValuesMatch(w.grad().local(),
                            RefLinearBackwardWeight(dy2.ToDoubleVector(), xt.ToDoubleVector(), 3, 2, 4),
                            DType::kFloat32));
}

TEST(AutogradAccumulationTest, RetainedGraphBackpropagatesTwice) {
    Variable x(Data({6}, "x"), true);
    Variable y = Gelu(Scale(x, 2.0));
    y.Backward(nullptr, /*retain_graph=*/true);
    const Values once = x.grad().local().ToDoubleVector();
    y.Backward(nullptr);
    Values twice = once;
    for (double &v : twice) {
        v *= 2.0;
    }
    EXPECT_TRUE(ValuesMatch(x.grad().local(), twice, DType::kFloat32));
    // The saved input was released by the last backward: a third one is an error that says so, not a wrong gradient
    // or an op's complaint about an undefined tensor.
    std::string message = "<no error>";
    try {
        y.Backward(nullptr);
    } catch (const Error &e) {
        message = e.what();
    }
    EXPECT_NE(message.find("released, with anything it saved, by an earlier backward"), std::string::npos) << message;
    EXPECT_NE(message.find("retain_graph = true"), std::string::npos) << message;
    EXPECT_NE(message.find("Gelu"), std::string::npos) << message;
}

// ---- main grads ----------------------------------------------------------------------------------------------------

TEST_F(CountingKernelsTest, MainGradAccumulatesTheWeightGradWithBetaOne) {
    // W and b have main grads: the weight-grad GEMM writes into W's buffer with accumulate (beta = 1) and the bias grad
    // into b's; no gradient tensor is allocated and added afterwards.
    const Tensor xt = Data({5, 3}, "x");
    Variable x(xt, false);
    Variable w(Data({4, 3}, "w"), true);
    Variable b(Data({4}, "b"), true);
    w.AllocateMainGrad(DType::kFloat32);
    b.AllocateMainGrad(DType::kFloat32);
    ASSERT_TRUE(w.has_main_grad());
    const void *w_buffer = w.grad().local().data();
    const void *b_buffer = b.grad().local().data();
    EXPECT_EQ(w.grad().local().ToDoubleVector(), Values(12, 0.0));

    const Tensor dy1 = Data({5, 4}, "dy1");
    const Tensor dy2 = Data({5, 4}, "dy2");
    const DistTensor g1 = DistTensor::Local(dy1);
    const DistTensor g2 = DistTensor::Local(dy2);
    Linear(x, w, b).Backward(&g1);
    EXPECT_EQ(g_calls.weight, 1);
    EXPECT_TRUE(g_calls.weight_accumulated);
    EXPECT_EQ(g_calls.weight_out, w_buffer);
    EXPECT_TRUE(g_calls.bias_accumulated);
    EXPECT_EQ(g_calls.bias_out, b_buffer);
    Linear(x, w, b).Backward(&g2);
    EXPECT_EQ(g_calls.weight, 2);
    EXPECT_EQ(g_calls.weight_out, w_buffer);

    EXPECT_EQ(w.grad().local().data(), w_buffer);
    EXPECT_EQ(b.grad().local().data(), b_buffer);
    const Values sum = Add(dy1.ToDoubleVector(), dy2.ToDoubleVector());
    EXPECT_TRUE(
        ValuesMatch(w.grad().local(), RefLinearBackwardWeight(sum, xt.ToDoubleVector(), 5, 4, 3), DType::kFloat32));
    EXPECT_TRUE(ValuesMatch(b.grad().local(), RefColumnSum(sum, 5, 4), DType::kFloat32));

    // ZeroGrad keeps the buffer and zeroes it.
    w.ZeroGrad();
    EXPECT_EQ(w.grad().local().data(), w_buffer);
    EXPECT_EQ(w.grad().local().ToDoubleVector(), Values(12, 0.0));
}

TEST_F(CountingKernelsTest, ZeroGradIsDeferredToTheFirstWriterWhichOverwrites) {
    // After ZeroGrad the buffers hold stale values and stand for zeros: the next backward's weight and bias kernels
    // overwrite them (accumulate false: no zero fill ran), the one after accumulates; a leaf nothing wrote reads zeros.
    const Tensor xt = Data({5, 3}, "x");
    Variable x(xt, false);
    Variable w(Data({4, 3}, "w"), true);
    Variable b(Data({4}, "b"), true);
    Variable unused(Data({7}, "unused"), true);
    for (Variable *v : {&w, &b, &unused}) {
        v->AllocateMainGrad(DType::kFloat32);
        Tensor buffer = v->grad().local();          // the main grad (shares its storage)
        buffer.CopyFrom(Data(v->shape(), "stale")); // nonzero values the zeroing must hide
        v->ZeroGrad();
        ASSERT_TRUE(v->impl()->main_grad_zero_pending);
    }
    const void *w_buffer = w.impl()->main_grad.data();
    const Tensor dy1 = Data({5, 4}, "dy1");
    const Tensor dy2 = Data({5, 4}, "dy2");
    const DistTensor g1 = DistTensor::Local(dy1);
    const DistTensor g2 = DistTensor::Local(dy2);
    Linear(x, w, b).Backward(&g1);
    EXPECT_EQ(g_calls.weight, 1);
    EXPECT_FALSE(g_calls.weight_accumulated) << "the fresh buffer is overwritten";
    EXPECT_EQ(g_calls.weight_out, w_buffer);
    EXPECT_FALSE(w.impl()->main_grad_zero_pending);
    EXPECT_TRUE(ValuesMatch(w.grad().local(),
                            RefLinearBackwardWeight(dy1.ToDoubleVector(), xt.ToDoubleVector(), 5, 4, 3),
                            DType::kFloat32));
    EXPECT_TRUE(ValuesMatch(b.grad().local(), RefColumnSum(dy1.ToDoubleVector(), 5, 4), DType::kFloat32));
    Linear(x, w, b).Backward(&g2);
    EXPECT_TRUE(g_calls.weight_accumulated) << "the second backward adds";
    const Values sum = Add(dy1.ToDoubleVector(), dy2.ToDoubleVector());
    EXPECT_TRUE(
        ValuesMatch(w.grad().local(), RefLinearBackwardWeight(sum, xt.ToDoubleVector(), 5, 4, 3), DType::kFloat32));
    EXPECT_TRUE(ValuesMatch(b.grad().local(), RefColumnSum(sum, 5, 4), DType::kFloat32));
    // Nothing wrote `unused`: reading its gradient fills the zeros it stands for.
    EXPECT_EQ(unused.grad().local().ToDoubleVector(), Values(7, 0.0));
    EXPECT_FALSE(unused.impl()->main_grad_zero_pending);
    // ZeroGrad(false) fills at once.
    w.ZeroGrad(/*defer=*/false);
    EXPECT_FALSE(w.impl()->main_grad_zero_pending);
    EXPECT_EQ(w.impl()->main_grad.ToDoubleVector(), Values(12, 0.0));
}

TEST(AutogradMainGradTest, DeferredZeroGradOfAReturnedGradientCopiesAndOfABufferSlotOverwrites) {
    // A gradient that comes back as a tensor (Gelu's) is copied into a fresh buffer, not added to its stale values; an
    // embedding backward overwrites its whole fresh table, so rows no id touched become zeros.
    Variable v(Data({6}, "v"), true);
    v.AllocateMainGrad(DType::kFloat32);
    Gelu(v).Backward(nullptr);
    const Values once = v.grad().local().ToDoubleVector();
    Gelu(v).Backward(nullptr); // stale: 2x
    v.ZeroGrad();
    Gelu(v).Backward(nullptr);
    EXPECT_EQ(v.grad().local().ToDoubleVector(), once);

    Variable e(Data({4, 2}, "table"), true);
    e.AllocateMainGrad(DType::kFloat32);
    Variable ids(Tensor::FromVector({1, 1, 3}, {3}, DType::kInt64));
    Embedding(ids, e).Backward(nullptr);
    Embedding(Variable(Tensor::FromVector({0, 2}, {2}, DType::kInt64)), e).Backward(nullptr);
    e.ZeroGrad();
    Embedding(ids, e).Backward(nullptr);
    EXPECT_EQ(e.grad().local().ToDoubleVector(), (Values{0, 0, 2, 2, 0, 0, 1, 1}));
}

TEST(AutogradMainGradTest, CallerBufferReceivesTheGradient) {
    // A view into a caller-owned flat buffer (as GradSync's buckets): the gradients land in it.
    Tensor flat = Tensor::Zeros({20}, DType::kFloat32);
    Variable w(Data({3, 4}, "w"), true);
    Variable e(Data({8}, "table").View({4, 2}), true);
    w.AllocateMainGrad(DType::kFloat32, Tensor::FromBlob(flat.data(), {3, 4}, DType::kFloat32, Device::CPU()));
    e.AllocateMainGrad(DType::kFloat32, Tensor::FromBlob(static_cast<float *>(flat.data()) + 12, {4, 2},
                                                         DType::kFloat32, Device::CPU()));
    const Tensor xt = Data({2, 4}, "x");
    Variable x(xt, false);
    Linear(x, w).Backward(nullptr);
    Variable ids(Tensor::FromVector({1, 1, 3}, {3}, DType::kInt64));
    Embedding(ids, e).Backward(nullptr);
    Embedding(ids, e).Backward(nullptr);
    const Values f = flat.ToDoubleVector();
    const Values want_w = RefLinearBackwardWeight(Values(6, 1.0), xt.ToDoubleVector(), 2, 3, 4);
    EXPECT_TRUE(ValuesMatch(Values(f.begin(), f.begin() + 12), want_w, DType::kFloat32));
    // Two backward calls, id 1 twice and id 3 once each: rows 1 and 3 get 4 and 2, rows 0 and 2 nothing.
    EXPECT_EQ(Values(f.begin() + 12, f.end()), (Values{0, 0, 4, 4, 0, 0, 2, 2}));
}

TEST(AutogradMainGradTest, WrongBufferIsRejected) {
    Variable w(Data({3, 4}, "w"), true);
    EXPECT_THROW(w.AllocateMainGrad(DType::kFloat32, Tensor::Zeros({4, 3}, DType::kFloat32)), ShapeError);
    EXPECT_THROW(w.AllocateMainGrad(DType::kFloat32, Tensor::Zeros({3, 4}, DType::kFloat64)), ShapeError);
}

// ---- no-grad mode --------------------------------------------------------------------------------------------------

TEST(NoGradGuardTest, RecordsNothing) {
    const Tensor xt = Data({3, 5}, "x");
    const Tensor wt = Data({2, 5}, "w");
    Variable x(xt, true);
    Variable w(wt, true);
    Variable b(Data({2}, "b"), true);
    const long x_before = Holders(xt);
    const long w_before = Holders(wt);
    EXPECT_TRUE(GradEnabled());
    {
        NoGradGuard outer;
        EXPECT_FALSE(GradEnabled());
        {
            NoGradGuard inner;
            EXPECT_FALSE(GradEnabled());
        }
        EXPECT_FALSE(GradEnabled());
        Variable y = Gelu(Linear(x, w, b));
        EXPECT_FALSE(y.requires_grad());
        EXPECT_EQ(y.grad_fn(), nullptr);
        EXPECT_TRUE(y.is_leaf());
        EXPECT_EQ(Holders(xt), x_before);
        EXPECT_EQ(Holders(wt), w_before);
        EXPECT_THROW(y.Backward(nullptr), Error);
        EXPECT_EQ(y.local().ToDoubleVector(),
                  kernels::GeluForward(kernels::LinearForward(xt, wt, &b.local()), kernels::GeluApproximation::kTanh)
                      .ToDoubleVector());
    }
    EXPECT_TRUE(GradEnabled());
    Variable y = Linear(x, w, b);
    EXPECT_TRUE(y.requires_grad());
    EXPECT_NE(y.grad_fn(), nullptr);
    EXPECT_FALSE(x.grad().defined());
}

// ---- errors --------------------------------------------------------------------------------------------------------

template <class E, class F> std::string Message(F &&f) {
    try {
        f();
    } catch (const E &e) {
        return e.what();
    }
    ADD_FAILURE() << "expected an exception";
    return {};
}

TEST(AutogradErrorTest, BackwardFromAVariableThatDoesNotRequireGrad) {
    Variable x(Data({3}, "x"), false);
    Variable y = Scale(x, 2.0);
    EXPECT_FALSE(y.requires_grad());
    const std::string m = Message<Error>([&] { y.Backward(nullptr); });
    EXPECT_NE(m.find("does not require grad"), std::string::npos) << m;
}

TEST(AutogradErrorTest, GradientOfTheWrongShape) {
    Variable x(Data({3, 2}, "x"), true);
    Variable y = Scale(x, 2.0);
    const DistTensor g = DistTensor::Local(Data({2, 3}, "g"));
    const std::string m = Message<ShapeError>([&] { y.Backward(&g); });
    EXPECT_NE(m.find("[3, 2]"), std::string::npos) << m;
    EXPECT_FALSE(x.grad().defined());
    EXPECT_THROW(x.set_grad(DistTensor::Local(Data({6}, "g"))), ShapeError);
}

TEST(AutogradErrorTest, OneGradientPerRoot) {
    Variable x(Data({3}, "x"), true);
    Variable y = Scale(x, 2.0);
    Variable z = Scale(x, 3.0);
    EXPECT_THROW(Backward({y, z}, {DistTensor::Local(Data({3}, "g"))}), Error);
}

TEST(AutogradErrorTest, OnlyLeavesChangeRequiresGrad) {
    Variable x(Data({3}, "x"), true);
    Variable y = Scale(x, 2.0);
    EXPECT_FALSE(y.is_leaf());
    EXPECT_THROW(y.set_requires_grad(false), Error);
}

TEST(AutogradErrorTest, IdsAndLabelsHaveNoGradient) {
    Variable ids(Tensor::FromVector({0, 1}, {2}, DType::kInt64), true);
    Variable w(Data({3, 2}, "w"), true);
    EXPECT_THROW(Embedding(ids, w), Error);
    Variable logits(Data({2, 3}, "z"), true);
    EXPECT_THROW(CrossEntropy(logits, ids), Error);
}

TEST(AutogradErrorTest, UndefinedVariable) {
    Variable v;
    EXPECT_FALSE(v.defined());
    EXPECT_FALSE(v.requires_grad());
    EXPECT_THROW(v.value(), Error);
    EXPECT_THROW(v.Backward(nullptr), Error);
}

} // namespace
} // namespace shardline::autograd
