// Providers and the typed dispatcher: a "counting" provider that supplies only Gemm (forwarding to the default CPU
// Gemm) proves that Gemm is an op of its own, that nested ops inherit the provider of the op that calls them, that
// per-op overrides beat the global choice, and that missing kernels fall back to "default".

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>

#include <shardline/core/logging.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::kernels {
namespace {

using testing::RandomTensor;
using testing::RefBatchedMatmul;
using testing::RefLinearBackwardInput;
using testing::RefLinearBackwardWeight;
using testing::RefLinearForward;
using testing::Values;
using testing::ValuesMatch;

constexpr std::string_view kCounting = "counting";
constexpr std::string_view kPartial = "partial";

std::atomic<int> g_gemm_calls{0};
GemmOp::Fn g_default_gemm = nullptr;
std::atomic<int> g_linear_forward_calls{0};
LinearForwardOp::Fn g_default_linear_forward = nullptr;

void CountingGemm(const GemmParams& params) {
    ++g_gemm_calls;
    g_default_gemm(params);
}

void PartialLinearForward(const LinearForwardArgs& args) {
    ++g_linear_forward_calls;
    g_default_linear_forward(args);
}

bool HasKernel(std::string_view op, DeviceType device, std::string_view provider) {
    const std::vector<KernelInfo> kernels = RegisteredKernels();
    return std::any_of(kernels.begin(), kernels.end(),
                       [&](const KernelInfo& k) { return k.op == op && k.device == device && k.provider == provider; });
}

class DispatcherTest : public ::testing::Test {
protected:
    void SetUp() override {
        unsetenv("SHARDLINE_PROVIDER");
        unsetenv("SHARDLINE_LINEAR_IMPL");
        // Capture the default kernels before any test provider exists.
        SetOpProvider("Gemm", kDefaultProvider);
        SetOpProvider("LinearForward", kDefaultProvider);
        const Resolved<GemmOp> gemm = OpTable<GemmOp>::Resolve(DeviceType::kCPU);
        const Resolved<LinearForwardOp> linear = OpTable<LinearForwardOp>::Resolve(DeviceType::kCPU);
        ResetProviderSelection();
        ASSERT_EQ(gemm.provider, kDefaultProvider);
        ASSERT_EQ(linear.provider, kDefaultProvider);
        g_default_gemm = gemm.fn;
        g_default_linear_forward = linear.fn;
        Register<GemmOp>(DeviceType::kCPU, kCounting, &CountingGemm);
        Register<LinearForwardOp>(DeviceType::kCPU, kPartial, &PartialLinearForward);
        g_gemm_calls = 0;
        g_linear_forward_calls = 0;

        x_ = RandomTensor({6, 9}, DType::kFloat32, Device::CPU(), 1, "x");
        w_ = RandomTensor({5, 9}, DType::kFloat32, Device::CPU(), 1, "w");
        dy_ = RandomTensor({6, 5}, DType::kFloat32, Device::CPU(), 1, "dy");
        a_ = RandomTensor({2, 4, 9}, DType::kFloat32, Device::CPU(), 1, "a");
        b_ = RandomTensor({9, 3}, DType::kFloat32, Device::CPU(), 1, "b");
    }

    void TearDown() override {
        UnregisterProviderEverywhere(kCounting);
        UnregisterProviderEverywhere(kPartial);
        unsetenv("SHARDLINE_LINEAR_IMPL");
        ResetProviderSelection();
    }

    /// Runs LinearForward and checks its values; returns how many Gemm calls the counting provider saw.
    int LinearForwardGemms() {
        const int before = g_gemm_calls;
        const Tensor y = LinearForward(x_, w_);
        EXPECT_TRUE(ValuesMatch(y, RefLinearForward(x_.ToDoubleVector(), w_.ToDoubleVector(), nullptr, 6, 5, 9),
                                DType::kFloat32));
        return g_gemm_calls - before;
    }

    int MatmulForwardGemms() {
        const int before = g_gemm_calls;
        const Tensor out = MatmulForward(a_, b_);
        EXPECT_TRUE(ValuesMatch(
            out,
            RefBatchedMatmul(a_.ToDoubleVector(), a_.shape(), b_.ToDoubleVector(), b_.shape(), false, false, nullptr),
            DType::kFloat32));
        return g_gemm_calls - before;
    }

    Tensor x_, w_, dy_, a_, b_;
};

/// The library logger's lines (level, message) while in scope, at debug level and above.
class CapturedLog {
public:
    struct Line {
        spdlog::level::level_enum level;
        std::string text;
    };

    CapturedLog() : sink_(std::make_shared<Sink>()), level_(Logger().level()) {
        Logger().sinks().push_back(sink_);
        Logger().set_level(spdlog::level::debug);
    }
    ~CapturedLog() {
        Logger().set_level(level_);
        auto& sinks = Logger().sinks();
        sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    }
    CapturedLog(const CapturedLog&) = delete;
    CapturedLog& operator=(const CapturedLog&) = delete;

    std::vector<std::string> At(spdlog::level::level_enum level) const {
        std::lock_guard lock(sink_->lines_mutex);
        std::vector<std::string> texts;
        for (const Line& line : sink_->lines) {
            if (line.level == level) {
                texts.push_back(line.text);
            }
        }
        return texts;
    }

private:
    struct Sink : spdlog::sinks::base_sink<std::mutex> {
        mutable std::mutex lines_mutex;
        std::vector<Line> lines;
        void sink_it_(const spdlog::details::log_msg& msg) override {
            std::lock_guard lock(lines_mutex);
            lines.push_back({msg.level, std::string(msg.payload.data(), msg.payload.size())});
        }
        void flush_() override {}
    };
    std::shared_ptr<Sink> sink_;
    spdlog::level::level_enum level_;
};

std::size_t RegisteredOpCount() {
    std::set<std::string> ops;
    for (const KernelInfo& k : RegisteredKernels()) {
        ops.insert(k.op);
    }
    return ops.size();
}

TEST_F(DispatcherTest, GemmOnlyProviderServesLinearMatmulAndOuter) {
    SetProvider(kCounting);
    EXPECT_EQ(LinearForwardGemms(), 1);

    int before = g_gemm_calls;
    const Tensor dx = LinearBackwardInput(dy_, w_);
    EXPECT_EQ(g_gemm_calls - before, 1);
    EXPECT_TRUE(
        ValuesMatch(dx, RefLinearBackwardInput(dy_.ToDoubleVector(), w_.ToDoubleVector(), 6, 5, 9), DType::kFloat32));

    before = g_gemm_calls;
    const Tensor dw = LinearBackwardWeight(dy_, x_);
    EXPECT_EQ(g_gemm_calls - before, 1);
    EXPECT_TRUE(
        ValuesMatch(dw, RefLinearBackwardWeight(dy_.ToDoubleVector(), x_.ToDoubleVector(), 6, 5, 9), DType::kFloat32));

    EXPECT_EQ(MatmulForwardGemms(), 1); // [2,4,9]·[9,3]: one strided-batched GEMM with B broadcast

    before = g_gemm_calls;
    const Tensor u = RandomTensor({4}, DType::kFloat32, Device::CPU(), 2, "u");
    const Tensor v = RandomTensor({3}, DType::kFloat32, Device::CPU(), 2, "v");
    const Tensor outer = OuterForward(u, v);
    EXPECT_EQ(g_gemm_calls - before, 1);
    const Values uv = u.ToDoubleVector();
    const Values vv = v.ToDoubleVector();
    Values want;
    for (double ui : uv) {
        for (double vj : vv) {
            want.push_back(ui * vj);
        }
    }
    EXPECT_TRUE(ValuesMatch(outer, want, DType::kFloat32));
}

TEST_F(DispatcherTest, PerOpOverrideCountsOnlyThatOpsGemm) {
    SetOpProvider("LinearForward", kCounting);
    EXPECT_EQ(LinearForwardGemms(), 1);
    EXPECT_EQ(MatmulForwardGemms(), 0);
    int before = g_gemm_calls;
    LinearBackwardInput(dy_, w_);
    EXPECT_EQ(g_gemm_calls - before, 0);
}

TEST_F(DispatcherTest, PerOpOverrideBeatsGlobalProvider) {
    SetProvider(kCounting);
    SetOpProvider("MatmulForward", kDefaultProvider);
    EXPECT_EQ(MatmulForwardGemms(), 0); // the nested Gemm inherits MatmulForward's "default"
    EXPECT_EQ(LinearForwardGemms(), 1);
    SetOpProvider("Gemm", kDefaultProvider); // an override on the nested op itself wins over inheritance
    EXPECT_EQ(LinearForwardGemms(), 0);
    EXPECT_EQ(SelectedProvider("MatmulForward"), kDefaultProvider);
    EXPECT_EQ(SelectedProvider("LinearForward"), kCounting);
}

TEST_F(DispatcherTest, GemmOverrideServesEveryCompositionThroughIt) {
    SetOpProvider("Gemm", kCounting);
    EXPECT_EQ(LinearForwardGemms(), 1);
    EXPECT_EQ(MatmulForwardGemms(), 1);
}

TEST_F(DispatcherTest, ProviderWithSomeOpsFallsBackToDefaultForTheRest) {
    SetProvider(kPartial); // supplies only LinearForward
    EXPECT_EQ(SelectedProvider("LinearBackwardInput"), kPartial);
    const Tensor y = LinearForward(x_, w_);
    EXPECT_EQ(g_linear_forward_calls, 1);
    EXPECT_TRUE(
        ValuesMatch(y, RefLinearForward(x_.ToDoubleVector(), w_.ToDoubleVector(), nullptr, 6, 5, 9), DType::kFloat32));
    // LinearBackwardInput and its Gemm have no "partial" kernel: "default" serves them.
    EXPECT_EQ(OpTable<LinearBackwardInputOp>::Resolve(DeviceType::kCPU).provider, kDefaultProvider);
    EXPECT_EQ(OpTable<LinearForwardOp>::Resolve(DeviceType::kCPU).provider, kPartial);
    const Tensor dx = LinearBackwardInput(dy_, w_);
    EXPECT_TRUE(
        ValuesMatch(dx, RefLinearBackwardInput(dy_.ToDoubleVector(), w_.ToDoubleVector(), 6, 5, 9), DType::kFloat32));
    EXPECT_EQ(g_linear_forward_calls, 1);
    EXPECT_EQ(g_gemm_calls, 0);
}

TEST_F(DispatcherTest, ResetRestoresTheDefaultSelection) {
    SetProvider(kCounting);
    SetOpProvider("MatmulForward", kPartial);
    EXPECT_EQ(SelectedProvider("Gemm"), kCounting);
    EXPECT_EQ(SelectedProvider("MatmulForward"), kPartial);
    ResetProviderSelection();
    EXPECT_EQ(SelectedProvider("Gemm"), kDefaultProvider);
    EXPECT_EQ(SelectedProvider("MatmulForward"), kDefaultProvider);
    EXPECT_EQ(LinearForwardGemms(), 0);
    EXPECT_EQ(MatmulForwardGemms(), 0);
}

TEST_F(DispatcherTest, EnvironmentProviderIsReadOnReset) {
    setenv("SHARDLINE_PROVIDER", std::string(kCounting).c_str(), 1);
    ResetProviderSelection();
    EXPECT_EQ(SelectedProvider("LinearForward"), kCounting);
    EXPECT_EQ(LinearForwardGemms(), 1);
    unsetenv("SHARDLINE_PROVIDER");
    ResetProviderSelection();
    EXPECT_EQ(SelectedProvider("LinearForward"), kDefaultProvider);
}

TEST_F(DispatcherTest, LinearImplLegacySwitchesOnlyTheLinearOps) {
    setenv("SHARDLINE_LINEAR_IMPL", "legacy", 1);
    ResetProviderSelection();
    for (const char* op : {"LinearForward", "LinearBackwardInput", "LinearBackwardWeight", "LinearBackwardBias"}) {
        EXPECT_EQ(SelectedProvider(op), kLegacyProvider) << op;
    }
    EXPECT_EQ(SelectedProvider("MatmulForward"), kDefaultProvider);
    EXPECT_EQ(SelectedProvider("Gemm"), kDefaultProvider);
    // The CPU has no legacy kernels: "default" still serves, with the right values.
    EXPECT_EQ(LinearForwardGemms(), 0);
    unsetenv("SHARDLINE_LINEAR_IMPL");
    ResetProviderSelection();
    EXPECT_EQ(SelectedProvider("LinearForward"), kDefaultProvider);
}

TEST_F(DispatcherTest, RegisteredKernelsListsEveryProvider) {
    EXPECT_TRUE(HasKernel("Gemm", DeviceType::kCPU, kCounting));
    EXPECT_TRUE(HasKernel("Gemm", DeviceType::kCPU, kDefaultProvider));
    EXPECT_TRUE(HasKernel("LinearForward", DeviceType::kCPU, kPartial));
    EXPECT_FALSE(HasKernel("LinearForward", DeviceType::kCPU, kCounting));
    for (const char* op : {"LinearForward", "LinearBackwardInput", "LinearBackwardWeight", "LinearBackwardBias",
                           "MatmulForward", "MatmulBackwardInput", "MatmulBackwardOther", "OuterForward",
                           "OuterBackward", "GeluForward", "GeluBackward", "Add", "Scale", "Sum"}) {
        EXPECT_TRUE(HasKernel(op, DeviceType::kCPU, kDefaultProvider)) << op;
    }
    UnregisterProviderEverywhere(kCounting);
    EXPECT_FALSE(HasKernel("Gemm", DeviceType::kCPU, kCounting));
    // Selecting a provider that no longer exists falls back to default.
    SetProvider(kCounting);
    EXPECT_EQ(LinearForwardGemms(), 0);
}

TEST_F(DispatcherTest, RegisteringAgainReplacesTheKernel) {
    Register<GemmOp>(DeviceType::kCPU, kCounting, g_default_gemm); // same key, new function
    SetProvider(kCounting);
    EXPECT_EQ(LinearForwardGemms(), 0);
    Register<GemmOp>(DeviceType::kCPU, kCounting, &CountingGemm);
    EXPECT_EQ(LinearForwardGemms(), 1);
}

// Resolutions are cached per thread: a selection changed on another thread reaches a thread that resolved before.
TEST_F(DispatcherTest, ThreadCachedResolutionFollowsASelectionChangedElsewhere) {
    std::mutex mutex;
    std::condition_variable cv;
    int step = 0; // 1: the worker resolved under the default; 2: the main thread switched to the counting provider
    std::string before, after;
    int gemms_after = -1;
    std::thread worker([&] {
        before = OpTable<GemmOp>::Resolve(DeviceType::kCPU).provider;
        EXPECT_EQ(LinearForwardGemms(), 0);
        {
            std::unique_lock lock(mutex);
            step = 1;
            cv.notify_all();
            cv.wait(lock, [&] { return step == 2; });
        }
        after = OpTable<GemmOp>::Resolve(DeviceType::kCPU).provider;
        gemms_after = LinearForwardGemms();
    });
    {
        std::unique_lock lock(mutex);
        cv.wait(lock, [&] { return step == 1; });
        SetProvider(kCounting);
        step = 2;
        cv.notify_all();
    }
    worker.join();
    EXPECT_EQ(before, kDefaultProvider);
    EXPECT_EQ(after, kCounting);
    EXPECT_EQ(gemms_after, 1);
}

TEST_F(DispatcherTest, ProviderChoiceIsOneInfoLineAndPerOpDetailIsDebug) {
    using ::testing::HasSubstr;
    using ::testing::StartsWith;
    // A selection no earlier dispatch saw, so its summary is new: several ops, then one info line for all of them.
    SetProvider(kPartial); // supplies only LinearForward (on the CPU)
    CapturedLog log;
    (void)LinearForward(x_, w_);
    (void)LinearBackwardInput(dy_, w_);
    (void)MatmulForward(a_, b_);
    (void)Sum(x_);
    const std::vector<std::string> info = log.At(spdlog::level::info);
    ASSERT_EQ(info.size(), 1u) << ::testing::PrintToString(info);
    EXPECT_THAT(info[0], StartsWith("kernels: provider 'default' serves "));
    EXPECT_THAT(info[0], HasSubstr(fmt::format(" of {} ops; 'partial' serves LinearForward", RegisteredOpCount())));
    // The per-op resolutions are debug lines, one per (op, device, choice).
    const std::vector<std::string> debug = log.At(spdlog::level::debug);
    EXPECT_THAT(debug, ::testing::Contains("kernel LinearForward on cpu: provider 'partial'"));
    EXPECT_THAT(debug, ::testing::Contains("kernel LinearBackwardInput on cpu: provider 'partial' has none, 'default' "
                                           "serves it"));
    EXPECT_EQ(std::count(debug.begin(), debug.end(), "kernel LinearForward on cpu: provider 'partial'"), 1);

    // Back to the default selection: one new info line, naming the default provider for every op.
    ResetProviderSelection();
    (void)LinearForward(x_, w_);
    (void)MatmulForward(a_, b_);
    const std::vector<std::string> after = log.At(spdlog::level::info);
    ASSERT_EQ(after.size(), 2u) << ::testing::PrintToString(after);
    EXPECT_EQ(after[1], fmt::format("kernels: provider 'default' serves all {} ops", RegisteredOpCount()));
    for (const std::string& line : after) {
        EXPECT_THAT(line, ::testing::Not(StartsWith("kernel "))) << "a per-op line at info level";
    }
}

} // namespace
} // namespace shardline::kernels
