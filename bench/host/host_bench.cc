// shardline-host-bench: host µs per call of the Linear path on tensors of a tiny shape (default m = 1, k = n = 8: the
// GEMM is ~64 multiply-adds), for profiling what the host path costs apart from the kernels (issue 18 item 5).
// The same steps as shardline-linear-bench's `host` regime on the GPU: LinearForward, the fwd+bwd kernels, and autograd
// Linear fwd+bwd with fresh grads and with float32 main grads. On the CPU (the default) these are CPU-path figures;
// --device cuda runs the same steps on GPU tensors, launches included (the GPU, far faster than the host at these
// shapes, is waited for only at the end of each repetition), one step at a time with --only, for a profiler.
//
//   shardline-host-bench [--calls 20000] [--m 1] [--k 8] [--n 8] [--device cpu|cuda] [--dtype float32|bfloat16]
//                        [--only NAME]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/core/context.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/kernels/linear.h>

// GCC sees free() of what the replaced operator new returned through inlining and warns; they do match (malloc).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

// Every operator new of the process is counted (the library's too: replacing the global allocation functions is
// program-wide), so the bench reports heap allocations per call beside the time.
namespace {
std::atomic<std::uint64_t> g_allocations{0};
} // namespace

void *operator new(std::size_t bytes) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    if (void *p = std::malloc(bytes == 0 ? 1 : bytes)) {
        return p;
    }
    throw std::bad_alloc();
}
void *operator new[](std::size_t bytes) { return operator new(bytes); }
void operator delete(void *p) noexcept { std::free(p); }
void operator delete[](void *p) noexcept { std::free(p); }
void operator delete(void *p, std::size_t) noexcept { std::free(p); }
void operator delete[](void *p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace shardline;

/// operator new calls per call of `fn` (after one warm-up call).
double AllocationsPerCall(const std::function<void()> &fn) {
    fn();
    constexpr int kCalls = 100;
    const std::uint64_t before = g_allocations.load();
    for (int i = 0; i < kCalls; ++i) {
        fn();
    }
    return static_cast<double>(g_allocations.load() - before) / kCalls;
}

/// Median over 7 repetitions of `calls` back-to-back calls, µs per call, after warm-ups; each repetition ends when
/// `device` has run what it queued.
double TimeHost(int calls, Device device, const std::function<void()> &fn) {
    for (int i = 0; i < std::max(100, calls / 20); ++i) {
        fn();
    }
    Synchronize(device);
    std::vector<double> us;
    for (int rep = 0; rep < 7; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) {
            fn();
        }
        Synchronize(device);
        const auto t1 = std::chrono::steady_clock::now();
        us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"host µs of the Linear path on CPU tensors of a tiny shape"};
    int calls = 20000;
    std::int64_t m = 1, k = 8, n = 8;
    std::string only;
    std::string device_name = "cpu";
    std::string dtype_name = "float32";
    app.add_option("--calls", calls, "back-to-back calls per repetition");
    app.add_option("--m", m, "rows");
    app.add_option("--k", k, "in_features");
    app.add_option("--n", n, "out_features");
    app.add_option("--only", only, "run only the step whose name contains this (for perf record)");
    app.add_option("--device", device_name, "cpu, or cuda (GPU 0)")->check(CLI::IsMember({"cpu", "cuda"}));
    app.add_option("--dtype", dtype_name, "the tensors' dtype")->check(CLI::IsMember({"float32", "bfloat16"}));
    CLI11_PARSE(app, argc, argv);

    const DType dt = dtype_name == "bfloat16" ? DType::kBFloat16 : DType::kFloat32;
    const Device dev = device_name == "cuda" ? Device::CUDA(0) : Device::CPU();
    if (dev.is_cuda() && CudaDeviceCount() == 0) {
        std::fprintf(stderr, "shardline-host-bench: --device cuda needs a GPU (none visible)\n");
        return 1;
    }
    Tensor x = Tensor::Full({m, k}, 0.5, dt, dev), w = Tensor::Full({n, k}, 0.25, dt, dev);
    Tensor b = Tensor::Full({n}, 1.0, dt, dev), dy = Tensor::Full({m, n}, 1.0, dt, dev);
    Tensor y = Tensor::Empty({m, n}, dt, dev), dx = Tensor::Empty({m, k}, dt, dev);
    Tensor dw = Tensor::Empty({n, k}, dt, dev), db = Tensor::Empty({n}, dt, dev);

    autograd::Variable xv(x, true), wv(w, true), bv(b, true);
    const dist::DistTensor dyv = dist::DistTensor::Local(dy);
    auto autograd_step = [&] {
        xv.ZeroGrad();
        wv.ZeroGrad();
        bv.ZeroGrad();
        const autograd::Variable yv = autograd::Linear(xv, wv, bv);
        yv.Backward(&dyv);
    };
    struct Step {
        std::string name;
        std::function<void()> fn;
        std::function<void()> before; ///< setup, untimed
    };
    const std::vector<Step> steps = {
        {"LinearForward", [&] { kernels::LinearForward({.x = x, .weight = w, .bias = &b, .y = y}); }, {}},
        {"fwd+bwd kernels (LinearBackward)",
         [&] {
             kernels::LinearForward({.x = x, .weight = w, .bias = &b, .y = y});
             kernels::LinearBackward({.dy = dy, .x = &x, .weight = &w, .dx = &dx, .dweight = &dw, .dbias = &db});
         },
         {}},
        {"fwd autograd (Linear, no grad)",
         [&] {
             const autograd::NoGradGuard no_grad;
             const autograd::Variable yv = autograd::Linear(xv, wv, bv);
         },
         {}},
        {"fwd+bwd autograd (Linear)", autograd_step, {}},
        {"fwd+bwd autograd (Linear, main grads)", autograd_step,
         [&] {
             for (autograd::Variable *v : {&xv, &wv, &bv}) {
                 v->AllocateMainGrad(DType::kFloat32);
             }
         }},
    };
    std::printf("host cost on %s, %s m=%lld k=%lld n=%lld, %d calls x 7 (median)\n", ToString(dev).c_str(),
                dtype_name.c_str(), static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n),
                calls);
    for (const Step &s : steps) {
        if (s.before) {
            s.before();
        }
        if (!only.empty() && s.name.find(only) == std::string::npos) {
            continue;
        }
        const double us = TimeHost(calls, dev, s.fn);
        std::printf("host %-40s %8.2f us per call, %6.1f heap allocations per call\n", s.name.c_str(), us,
                    AllocationsPerCall(s.fn));
    }
    return 0;
}
