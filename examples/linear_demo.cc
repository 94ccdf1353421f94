// linear_demo: one fused Linear forward + backward on the GPU when present (else the CPU), checked against a
// float64 CPU computation, with the time per step. A single-process stand-in for the README's main job until the
// mpirun training example (step 5) exists.
//
//   linear_demo [--tokens 4096] [--in 4096] [--out 4096] [--dtype bf16] [--device auto|cpu|cuda] [--steps 20]

#include <chrono>
#include <cmath>
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <shardline/core/context.h>
#include <shardline/core/random.h>
#include <shardline/kernels/linear.h>

namespace {

using namespace shardline;
using namespace shardline::kernels;

/// max |a - b| / max(1, max |b|): one number that says whether a result is right.
double RelativeMaxError(const std::vector<double>& a, const std::vector<double>& b) {
    double err = 0.0;
    double scale = 1.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        err = std::fmax(err, std::fabs(a[i] - b[i]));
        scale = std::fmax(scale, std::fabs(b[i]));
    }
    return err / scale;
}

} // namespace

int main(int argc, char** argv) {
    CLI::App app{"shardline fused Linear demo: forward (bias in the GEMM epilogue) + backward, checked in float64"};
    std::int64_t tokens = 1024;
    std::int64_t in = 1024;
    std::int64_t out = 2048;
    std::string dtype_name = "auto";
    std::string device_name = "auto";
    int steps = 20;
    app.add_option("--tokens", tokens, "rows of X")->check(CLI::PositiveNumber);
    app.add_option("--in", in, "in_features")->check(CLI::PositiveNumber);
    app.add_option("--out", out, "out_features")->check(CLI::PositiveNumber);
    app.add_option("--dtype", dtype_name, "auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16");
    app.add_option("--device", device_name, "auto, cpu or cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
    CLI11_PARSE(app, argc, argv);

    try {
        const bool gpu = device_name == "cuda" || (device_name == "auto" && CudaDeviceCount() > 0);
        const Device device = gpu ? Device::CUDA(0) : Device::CPU();
        const DType dtype = dtype_name == "auto" ? (gpu ? DType::kBFloat16 : DType::kFloat32) : ParseDType(dtype_name);
        fmt::print("linear_demo: Y[{},{}] = X[{},{}]·W[{},{}]ᵀ + b on {} in {}\n", tokens, out, tokens, in, out, in,
                   ToString(device), DTypeName(dtype));

        auto make = [&](Shape shape, std::string_view name) {
            Tensor t = Tensor::Empty(std::move(shape), dtype, device);
            FillRandom(t, RandomSpec{.seed = 1234, .name = name, .a = 0.0, .b = 0.5});
            return t;
        };
        const Tensor x = make({tokens, in}, "x");
        const Tensor w = make({out, in}, "w");
        const Tensor b = make({out}, "b");
        const Tensor dy = make({tokens, out}, "dy");
        Tensor y = Tensor::Empty({tokens, out}, dtype, device);
        Tensor dx = Tensor::Empty({tokens, in}, dtype, device);
        Tensor dw = Tensor::Empty({out, in}, dtype, device);
        Tensor db = Tensor::Empty({out}, dtype, device);

        auto step = [&] {
            LinearForward(LinearForwardArgs{.x = x, .weight = w, .bias = &b, .y = y});
            LinearBackwardInput(LinearBackwardInputArgs{.dy = dy, .weight = w, .dx = dx});
            LinearBackwardWeight(LinearBackwardWeightArgs{.dy = dy, .x = x, .dweight = dw, .dbias = &db});
        };
        step();
        Synchronize(device);

        // Check one step against float64 on the host, on the values as rounded to the dtype.
        const auto xv = x.ToDoubleVector();
        const auto wv = w.ToDoubleVector();
        const auto bv = b.ToDoubleVector();
        const auto dyv = dy.ToDoubleVector();
        const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
        std::vector<double> y_ref(check_rows * out);
        std::vector<double> y_got(check_rows * out);
        const auto yv = y.ToDoubleVector();
        for (std::int64_t i = 0; i < check_rows; ++i) {
            for (std::int64_t j = 0; j < out; ++j) {
                double acc = bv[j];
                for (std::int64_t k = 0; k < in; ++k) {
                    acc += xv[i * in + k] * wv[j * in + k];
                }
                y_ref[i * out + j] = acc;
                y_got[i * out + j] = yv[i * out + j];
            }
        }
        std::vector<double> db_ref(out, 0.0);
        for (std::int64_t i = 0; i < tokens; ++i) {
            for (std::int64_t j = 0; j < out; ++j) {
                db_ref[j] += dyv[i * out + j];
            }
        }
        const double y_err = RelativeMaxError(y_got, y_ref);
        const double db_err = RelativeMaxError(db.ToDoubleVector(), db_ref);
        const double tol = dtype == DType::kBFloat16 ? 2e-2 : dtype == DType::kFloat16 ? 2e-3 : 1e-4;

        const auto start = std::chrono::steady_clock::now();
        for (int s = 0; s < steps; ++s) {
            step();
        }
        Synchronize(device);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
        const double tflops = 6.0 * static_cast<double>(tokens) * in * out / (ms * 1e-3) / 1e12;
        fmt::print("check vs float64: forward rel err {:.2e}, bias grad rel err {:.2e} (tolerance {:.0e}) -> {}\n",
                   y_err, db_err, tol, y_err <= tol && db_err <= tol ? "ok" : "FAILED");
        fmt::print("fwd+bwd: {:.3f} ms/step, {:.3g} TFLOP/s over {} steps\n", ms, tflops, steps);
        return y_err <= tol && db_err <= tol ? 0 : 1;
    } catch (const std::exception& e) {
        fmt::print(stderr, "linear_demo: {}\n", e.what());
        return 1;
    }
}
