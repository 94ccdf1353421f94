// embed_functional: a foreign training loop on shardline's functional layer (docs/functional.md). The program owns
// every buffer (std::vector on the CPU, cudaMalloc on GPUs) and its CUDA stream, and has no shardline autograd, module
// or DistTensor: Megatron's sequence-parallel MLP block — column-parallel fc1 -> GELU -> row-parallel fc2 — runs
// forward and backward through shardline::functional on raw pointers, followed by an MSE loss and plain SGD. The
// elementwise steps (GELU, the loss gradient, SGD) are shardline kernels on the program's memory and stream.
//
//   shardline-run -n 2 build/examples/embed_functional [--steps 20] [--seq 16] [--batch 2] [--hidden 32] [--ffn 64]
//
// Tensor parallel over every rank (tp = the world size). Each checked step (--check-every, default every step) gathers
// the gradients dX, dW1, db1, dW2, db2 and the loss to full tensors on every rank and compares them with a dense
// float64 computation on the host from the same (gathered) float32 weights and data: max |got - ref| <= rtol ·
// max |ref| per tensor, rtol 1e-5 in float32 (a few roundings of sums over at most `ffn` terms; DESIGN.md §7), 1e-3
// when CUDA runs float32 GEMMs in TF32 (SHARDLINE_ALLOW_TF32=1). Any mismatch raises an Error naming the tensor, and
// launch::RunMain ends the job with a non-zero exit. NCCL on GPUs when present (one per rank), MPI on the CPU
// otherwise; --backend cuda --skip-without-gpus exits 77 on every rank (CTest's skip code) when a node has fewer GPUs
// than ranks.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <mpi.h>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/optim.h>
#include <shardline/launch/bootstrap.h>

#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using namespace shardline;
namespace fn = shardline::functional;

constexpr const char *kProgram = "embed_functional";

struct Options {
    int steps = 20;
    std::int64_t seq = 16;    ///< S: the sequence, split over tp between the blocks (sequence parallel)
    std::int64_t batch = 2;   ///< B
    std::int64_t hidden = 32; ///< H
    std::int64_t ffn = 64;    ///< F, split over tp inside the block
    double lr = 2.0;
    std::uint64_t seed = 7;
    int check_every = 1;
};

// ---- The program's own memory and stream ---------------------------------------------------------------------------

/// float32 memory the program owns: a host vector on the CPU, cudaMalloc'd device memory on a GPU.
class Buffer {
public:
    Buffer(Shape shape, Device device) : shape_(std::move(shape)), device_(device) {
        n_ = 1;
        for (std::int64_t s : shape_) {
            n_ *= s;
        }
        if (device_.is_cuda()) {
#if SHARDLINE_HAVE_CUDA
            void *data = nullptr;
            SHARDLINE_CHECK_CUDA(cudaMalloc(&data, bytes()));
            device_data_ = static_cast<float *>(data);
#endif
        } else {
            host_.assign(static_cast<std::size_t>(n_), 0.0f);
        }
    }
    ~Buffer() {
#if SHARDLINE_HAVE_CUDA
        if (device_data_ != nullptr) {
            cudaFree(device_data_);
        }
#endif
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;

    float *data() { return device_.is_cuda() ? device_data_ : host_.data(); }
    const Shape &shape() const { return shape_; }
    std::int64_t numel() const { return n_; }

    /// The buffer as a functional-layer view (up to four dims).
    fn::TensorView view() {
        fn::TensorView v{.data = data(), .dtype = DType::kFloat32, .ndim = static_cast<int>(shape_.size())};
        for (std::size_t d = 0; d < shape_.size(); ++d) {
            v.shape[d] = shape_[d];
        }
        return v;
    }
    /// The buffer as a shardline Tensor for a kernel call (wraps the memory; frees nothing).
    Tensor tensor() { return Tensor::FromBlob(data(), shape_, DType::kFloat32, device_); }

    /// Copies `values` in; returns when the copy is done.
    void Upload(const std::vector<float> &values, fn::CudaStream stream) {
        SHARDLINE_CHECK(static_cast<std::int64_t>(values.size()) == n_, kProgram, "upload of {} values into {}",
                        values.size(), n_);
        if (device_.is_cuda()) {
#if SHARDLINE_HAVE_CUDA
            SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(device_data_, values.data(), bytes(), cudaMemcpyHostToDevice, stream));
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
#endif
        } else {
            host_ = values;
        }
    }
    /// The values, after the work queued on `stream` has finished.
    std::vector<float> Download(fn::CudaStream stream) const {
        if (!device_.is_cuda()) {
            return host_;
        }
        std::vector<float> values(static_cast<std::size_t>(n_));
#if SHARDLINE_HAVE_CUDA
        SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(values.data(), device_data_, bytes(), cudaMemcpyDeviceToHost, stream));
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream));
#endif
        return values;
    }
    void Zero(fn::CudaStream stream) {
        if (device_.is_cuda()) {
#if SHARDLINE_HAVE_CUDA
            SHARDLINE_CHECK_CUDA(cudaMemsetAsync(device_data_, 0, bytes(), stream));
#endif
        } else {
            std::fill(host_.begin(), host_.end(), 0.0f);
        }
    }

private:
    std::size_t bytes() const { return static_cast<std::size_t>(n_) * sizeof(float); }
    Shape shape_;
    Device device_;
    std::int64_t n_ = 0;
    std::vector<float> host_;
    float *device_data_ = nullptr;
};

/// The program's CUDA stream (none on the CPU).
class Stream {
public:
    explicit Stream(Device device) {
#if SHARDLINE_HAVE_CUDA
        if (device.is_cuda()) {
            SHARDLINE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        }
#endif
    }
    ~Stream() {
#if SHARDLINE_HAVE_CUDA
        if (stream_ != nullptr) {
            cudaStreamSynchronize(stream_);
            cudaStreamDestroy(stream_);
        }
#endif
    }
    Stream(const Stream &) = delete;
    Stream &operator=(const Stream &) = delete;
    fn::CudaStream get() const { return stream_; }
    /// Waits for the work queued on the stream.
    void Synchronize() const {
#if SHARDLINE_HAVE_CUDA
        if (stream_ != nullptr) {
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(stream_));
        }
#endif
    }

private:
    fn::CudaStream stream_ = nullptr;
};

/// Runs shardline kernels on the program's stream for the length of a scope (the functional calls take the stream as
/// an argument; the kernels use the device context's stream, which this overrides). Nothing on the CPU.
class OnStream {
public:
    OnStream(Device device, fn::CudaStream stream) {
#if SHARDLINE_HAVE_CUDA
        if (device.is_cuda()) {
            scope_.emplace(CudaContext::Current(), stream, nullptr, 0);
        }
#endif
    }

private:
#if SHARDLINE_HAVE_CUDA
    std::optional<ScopedCudaOverride> scope_;
#endif
};

// ---- The MLP block on the functional layer -------------------------------------------------------------------------

/// Megatron's MLP block, sequence parallel: x [S/tp, B, H] -> fc1 (column parallel: all-gathers x) -> GELU -> fc2 (row
/// parallel: reduce-scatters z, + b2 once) -> z [S/tp, B, H]. The parameters are this rank's shards; their gradients
/// are float32 main grads that the backward accumulates into (GradMode::kAccumulate, Megatron's gradient-accumulation
/// fusion), zeroed by the trainer before each step.
struct MlpBlock {
    MlpBlock(std::int64_t S, std::int64_t B, std::int64_t H, std::int64_t F, std::int64_t tp, Device device)
        : fc1{.in_features = H, .out_features = F, .sequence_parallel = true},
          fc2{.in_features = F, .out_features = H, .input_is_parallel = true, .sequence_parallel = true},
          w1({F / tp, H}, device), b1({F / tp}, device), w2({H, F / tp}, device), b2({H}, device),
          w1_grad({F / tp, H}, device), b1_grad({F / tp}, device), w2_grad({H, F / tp}, device), b2_grad({H}, device),
          x_total({S, B, H}, device), h({S, B, F / tp}, device), a({S, B, F / tp}, device), da({S, B, F / tp}, device),
          dh({S, B, F / tp}, device), device_(device) {}

    /// z = fc2(gelu(fc1(x))); keeps x_total, h and a for the backward.
    void Forward(Buffer &x, Buffer &z, const fn::TensorParallelGroup &group, fn::CudaStream stream) {
        const fn::CudaExecution cuda{.stream = stream}; // the program's stream; the context's cuBLASLt workspace
        fn::ColumnParallelLinearForward(
            fc1, {.x = x.view(), .weight = w1.view(), .bias = b1.view(), .y = h.view(), .x_total = x_total.view()},
            group, cuda); // all-gather x (into x_total)
        {
            OnStream on(device_, stream);
            Tensor h_t = h.tensor();
            Tensor a_t = a.tensor();
            kernels::GeluForward({.x = h_t, .y = a_t, .approximation = kernels::GeluApproximation::kTanh});
        }
        fn::RowParallelLinearForward(fc2, {.x = a.view(), .weight = w2.view(), .bias = b2.view(), .y = z.view()}, group,
                                     cuda); // reduce-scatter z, + b2 once
    }

    /// dx (when given) and the parameter gradients (+=) from dz.
    void Backward(Buffer &dz, Buffer *dx, const fn::TensorParallelGroup &group, fn::CudaStream stream) {
        const fn::CudaExecution cuda{.stream = stream};
        fn::RowParallelLinearBackward(fc2,
                                      {.dy = dz.view(),
                                       .x = a.view(),
                                       .weight = w2.view(),
                                       .dx = da.view(),
                                       .dweight = w2_grad.view(),
                                       .dbias = b2_grad.view(),
                                       .param_grads = fn::GradMode::kAccumulate},
                                      group, cuda); // all-gather dz
        {
            OnStream on(device_, stream);
            Tensor da_t = da.tensor();
            Tensor h_t = h.tensor();
            Tensor dh_t = dh.tensor();
            kernels::GeluBackward(
                {.dy = da_t, .x = h_t, .dx = dh_t, .approximation = kernels::GeluApproximation::kTanh});
        }
        fn::ColumnParallelLinearBackward(fc1,
                                         {.dy = dh.view(),
                                          .x_total = x_total.view(),
                                          .weight = w1.view(),
                                          .dx = dx != nullptr ? dx->view() : fn::TensorView{},
                                          .dweight = w1_grad.view(),
                                          .dbias = b1_grad.view(),
                                          .param_grads = fn::GradMode::kAccumulate},
                                         group, cuda); // reduce-scatter dx, when wanted
    }

    fn::ColumnParallelLinearOptions fc1;
    fn::RowParallelLinearOptions fc2;
    Buffer w1, b1, w2, b2;                     // [F/tp, H], [F/tp], [H, F/tp], [H]
    Buffer w1_grad, b1_grad, w2_grad, b2_grad; // the same shapes, float32
    Buffer x_total, h, a;                      // saved by the forward: [S, B, H], [S, B, F/tp], [S, B, F/tp]
    Buffer da, dh;                             // backward temporaries

private:
    Device device_;
};

// ---- The dense float64 reference on the host -----------------------------------------------------------------------

constexpr double kGeluK = 0.7978845608028654; // sqrt(2 / pi)

double Gelu(double x) {
    const double k = kGeluK;
    return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double GeluGrad(double x) {
    const double k = kGeluK;
    const double t = std::tanh(k * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

/// The full MLP, its MSE loss and every gradient, in float64: rows R = S·B, X [R, H], W1 [F, H], W2 [H, F].
struct Reference {
    double loss = 0.0;
    std::vector<double> dx, dw1, db1, dw2, db2;
};

Reference DenseMlp(std::int64_t R, std::int64_t H, std::int64_t F, const std::vector<float> &x,
                   const std::vector<float> &target, const std::vector<float> &w1, const std::vector<float> &b1,
                   const std::vector<float> &w2, const std::vector<float> &b2) {
    auto at = [](std::int64_t i, std::int64_t j, std::int64_t cols) { return static_cast<std::size_t>(i * cols + j); };
    std::vector<double> h(static_cast<std::size_t>(R * F)), a(h.size()), z(static_cast<std::size_t>(R * H));
    for (std::int64_t r = 0; r < R; ++r) {
        for (std::int64_t f = 0; f < F; ++f) {
            double s = b1[static_cast<std::size_t>(f)];
            for (std::int64_t k = 0; k < H; ++k) {
                s += static_cast<double>(x[at(r, k, H)]) * w1[at(f, k, H)];
            }
            h[at(r, f, F)] = s;
            a[at(r, f, F)] = Gelu(s);
        }
        for (std::int64_t o = 0; o < H; ++o) {
            double s = b2[static_cast<std::size_t>(o)];
            for (std::int64_t f = 0; f < F; ++f) {
                s += a[at(r, f, F)] * w2[at(o, f, F)];
            }
            z[at(r, o, H)] = s;
        }
    }
    Reference ref;
    const double n = static_cast<double>(R * H);
    std::vector<double> dz(z.size());
    for (std::size_t i = 0; i < z.size(); ++i) {
        const double d = z[i] - target[i];
        ref.loss += d * d / n;
        dz[i] = 2.0 * d / n;
    }
    ref.dw2.assign(static_cast<std::size_t>(H * F), 0.0);
    ref.db2.assign(static_cast<std::size_t>(H), 0.0);
    ref.dw1.assign(static_cast<std::size_t>(F * H), 0.0);
    ref.db1.assign(static_cast<std::size_t>(F), 0.0);
    ref.dx.assign(static_cast<std::size_t>(R * H), 0.0);
    std::vector<double> dh(h.size());
    for (std::int64_t r = 0; r < R; ++r) {
        for (std::int64_t o = 0; o < H; ++o) {
            ref.db2[static_cast<std::size_t>(o)] += dz[at(r, o, H)];
            for (std::int64_t f = 0; f < F; ++f) {
                ref.dw2[at(o, f, F)] += dz[at(r, o, H)] * a[at(r, f, F)];
            }
        }
        for (std::int64_t f = 0; f < F; ++f) {
            double da = 0.0;
            for (std::int64_t o = 0; o < H; ++o) {
                da += dz[at(r, o, H)] * w2[at(o, f, F)];
            }
            dh[at(r, f, F)] = da * GeluGrad(h[at(r, f, F)]);
        }
        for (std::int64_t f = 0; f < F; ++f) {
            const double g = dh[at(r, f, F)];
            ref.db1[static_cast<std::size_t>(f)] += g;
            for (std::int64_t k = 0; k < H; ++k) {
                ref.dw1[at(f, k, H)] += g * x[at(r, k, H)];
                ref.dx[at(r, k, H)] += g * w1[at(f, k, H)];
            }
        }
    }
    return ref;
}

/// max |got - ref| / max |ref|; raises Error naming the tensor when it exceeds rtol.
double Check(const char *name, const std::vector<float> &got, const std::vector<double> &ref, double rtol, int step) {
    SHARDLINE_CHECK(got.size() == ref.size(), kProgram, "{}: {} values gathered, the reference has {}", name,
                    got.size(), ref.size());
    double err = 0.0;
    double scale = 0.0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
        err = std::fmax(err, std::fabs(static_cast<double>(got[i]) - ref[i]));
        scale = std::fmax(scale, std::fabs(ref[i]));
    }
    const double rel = scale > 0.0 ? err / scale : err;
    SHARDLINE_CHECK(rel <= rtol, kProgram,
                    "step {}: {} differs from the float64 reference: max |got - ref| = {:.3e}, max |ref| = {:.3e}, "
                    "relative {:.3e} > rtol {:.1e}",
                    step, name, err, scale, rel, rtol);
    return rel;
}

/// Every rank's `mine`, concatenated in rank order, on every rank (the trainer's own MPI, host memory).
std::vector<float> AllGather(const std::vector<float> &mine, int world) {
    std::vector<float> all(mine.size() * static_cast<std::size_t>(world));
    SHARDLINE_CHECK_MPI(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_FLOAT, all.data(),
                                      static_cast<int>(mine.size()), MPI_FLOAT, MPI_COMM_WORLD));
    return all;
}

std::vector<float> RandomValues(std::int64_t n, double scale, std::mt19937_64 &rng) {
    std::uniform_real_distribution<double> u(-scale, scale);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float &x : v) {
        x = static_cast<float>(u(rng));
    }
    return v;
}

/// Rows [begin, end) of a row-major [rows, cols] matrix.
std::vector<float> Rows(const std::vector<float> &m, std::int64_t cols, std::int64_t begin, std::int64_t end) {
    return {m.begin() + begin * cols, m.begin() + end * cols};
}
/// Columns [begin, end) of a row-major [rows, cols] matrix.
std::vector<float> Columns(const std::vector<float> &m, std::int64_t cols, std::int64_t begin, std::int64_t end) {
    std::vector<float> out;
    for (std::size_t r = 0; r < m.size() / static_cast<std::size_t>(cols); ++r) {
        out.insert(out.end(), m.begin() + static_cast<std::int64_t>(r) * cols + begin,
                   m.begin() + static_cast<std::int64_t>(r) * cols + end);
    }
    return out;
}
/// The inverse of Columns over tp equal shards gathered in rank order: [tp][rows][cols/tp] -> [rows][cols].
std::vector<float> JoinColumns(const std::vector<float> &gathered, std::int64_t rows, std::int64_t cols, int tp) {
    const std::int64_t part = cols / tp;
    std::vector<float> m(gathered.size());
    for (int r = 0; r < tp; ++r) {
        for (std::int64_t i = 0; i < rows; ++i) {
            for (std::int64_t j = 0; j < part; ++j) {
                m[static_cast<std::size_t>(i * cols + r * part + j)] =
                    gathered[static_cast<std::size_t>((r * rows + i) * part + j)];
            }
        }
    }
    return m;
}

/// The full inputs, targets and initial weights, the same on every rank (one seed): x, target [S·B, H], W1 [F, H],
/// b1 [F], W2 [H, F], b2 [H]. The target is a fixed linear map of x plus noise.
struct Data {
    std::vector<float> x, target, w1, b1, w2, b2;
};

Data MakeData(const Options &o) {
    const std::int64_t R = o.seq * o.batch, H = o.hidden, F = o.ffn;
    std::mt19937_64 rng(o.seed);
    Data d;
    d.x = RandomValues(R * H, 1.0, rng);
    d.target = RandomValues(R * H, 0.5, rng);
    const std::vector<float> teacher = RandomValues(H * H, 1.0 / std::sqrt(static_cast<double>(H)), rng);
    for (std::int64_t r = 0; r < R; ++r) {
        for (std::int64_t i = 0; i < H; ++i) {
            double s = 0.0;
            for (std::int64_t k = 0; k < H; ++k) {
                s += static_cast<double>(d.x[static_cast<std::size_t>(r * H + k)]) *
                     teacher[static_cast<std::size_t>(i * H + k)];
            }
            d.target[static_cast<std::size_t>(r * H + i)] += static_cast<float>(s);
        }
    }
    d.w1 = RandomValues(F * H, 1.0 / std::sqrt(static_cast<double>(H)), rng);
    d.b1 = RandomValues(F, 0.1, rng);
    d.w2 = RandomValues(H * F, 1.0 / std::sqrt(static_cast<double>(F)), rng);
    d.b2 = RandomValues(H, 0.1, rng);
    return d;
}

/// Gathers this step's weights and gradients to full tensors on every rank (row shards concatenate, W2's column shards
/// are re-interleaved) and checks the gradients and the loss against the dense float64 MLP on the same float32 weights
/// and data. Returns the largest relative error; raises Error naming the first tensor that misses rtol.
double CheckGradients(const Options &o, int tp, const Data &full, MlpBlock &mlp, Buffer &dx, double loss, double rtol,
                      int step, fn::CudaStream stream) {
    const std::int64_t H = o.hidden, F = o.ffn;
    const std::vector<float> w1 = AllGather(mlp.w1.Download(stream), tp);
    const std::vector<float> b1 = AllGather(mlp.b1.Download(stream), tp);
    const std::vector<float> w2 = JoinColumns(AllGather(mlp.w2.Download(stream), tp), H, F, tp);
    const std::vector<float> b2 = mlp.b2.Download(stream);
    const Reference ref = DenseMlp(o.seq * o.batch, H, F, full.x, full.target, w1, b1, w2, b2);
    double worst = Check("loss", {static_cast<float>(loss)}, {ref.loss}, rtol, step);
    worst = std::fmax(worst, Check("dX", AllGather(dx.Download(stream), tp), ref.dx, rtol, step));
    worst = std::fmax(worst, Check("dW1", AllGather(mlp.w1_grad.Download(stream), tp), ref.dw1, rtol, step));
    worst = std::fmax(worst, Check("db1", AllGather(mlp.b1_grad.Download(stream), tp), ref.db1, rtol, step));
    worst = std::fmax(
        worst, Check("dW2", JoinColumns(AllGather(mlp.w2_grad.Download(stream), tp), H, F, tp), ref.dw2, rtol, step));
    // db2 is replicated: every rank's copy must be the whole bias gradient.
    const std::vector<float> db2_all = AllGather(mlp.b2_grad.Download(stream), tp);
    for (int r = 0; r < tp; ++r) {
        worst = std::fmax(worst, Check("db2", Rows(db2_all, H, r, r + 1), ref.db2, rtol, step));
    }
    return worst;
}

// ---- The training loop ---------------------------------------------------------------------------------------------

int Run(launch::Environment &env, const Options &o) {
    const int tp = env.world_size();
    const int rank = env.rank();
    const std::int64_t S = o.seq, B = o.batch, H = o.hidden, F = o.ffn;
    // Checked here, alike on every rank, before any collective (the functional layer checks them too).
    SHARDLINE_CHECK(o.steps >= 1 && S > 0 && B > 0 && H > 0 && F > 0 && o.lr > 0 && o.check_every >= 1, kProgram,
                    "steps, seq, batch, hidden, ffn, lr and check-every must be positive, got steps {} seq {} batch {} "
                    "hidden {} ffn {} lr {} check-every {}",
                    o.steps, S, B, H, F, o.lr, o.check_every);
    SHARDLINE_CHECK(S % tp == 0 && F % tp == 0, kProgram,
                    "seq ({}) and ffn ({}) must be divisible by tp ({}): the sequence is split between the blocks and "
                    "ffn inside them",
                    S, F, tp);
    const Device device = env.device();
    double rtol = 1e-5;
#if SHARDLINE_HAVE_CUDA
    if (device.is_cuda() && CudaContext::Current().allow_tf32()) {
        rtol = 1e-3;
    }
#endif

    // The group: a 1-d mesh over the world, all of it tensor parallel.
    comm::DeviceMesh mesh(env.world(), {tp}, {"tp"});
    const fn::TensorParallelGroup group{.mesh = &mesh, .tp_dim = 0};
    Stream stream_owner(device);
    const fn::CudaStream stream = stream_owner.get();

    // The full data and weights, the same on every rank (one seed); each rank keeps its shard.
    const Data full = MakeData(o);
    const std::int64_t s_local = S / tp;
    const std::int64_t f_local = F / tp;
    const std::int64_t rows0 = rank * s_local * B; // this rank's first row of the [S·B, H] activations
    const std::int64_t rows1 = rows0 + s_local * B;
    MlpBlock mlp(S, B, H, F, tp, device);
    Buffer x({s_local, B, H}, device), target({s_local, B, H}, device);
    Buffer z({s_local, B, H}, device), dz({s_local, B, H}, device), dx({s_local, B, H}, device);
    x.Upload(Rows(full.x, H, rows0, rows1), stream);
    target.Upload(Rows(full.target, H, rows0, rows1), stream);
    mlp.w1.Upload(Rows(full.w1, H, rank * f_local, (rank + 1) * f_local), stream);
    mlp.b1.Upload(Rows(full.b1, 1, rank * f_local, (rank + 1) * f_local), stream);
    mlp.w2.Upload(Columns(full.w2, F, rank * f_local, (rank + 1) * f_local), stream);
    mlp.b2.Upload(full.b2, stream);

    if (rank == 0) {
        fmt::print(
            "{}: {} rank(s), tp {}, {} ({}), x [{}, {}, {}] split on the sequence, ffn {}: fc1 column parallel -> "
            "GELU -> fc2 row parallel, sequence parallel; MSE loss, SGD lr {}; gradients checked against float64 "
            "every {} step(s), rtol {:.0e}\n",
            kProgram, tp, tp, device.is_cuda() ? "GPUs" : "CPU", env.world().backend(), S, B, H, F, o.lr, o.check_every,
            rtol);
        std::fflush(stdout);
    }

    const double n = static_cast<double>(S * B * H);
    double first_loss = 0.0;
    double loss = 0.0;
    for (int step = 1; step <= o.steps; ++step) {
        for (Buffer *g : {&mlp.w1_grad, &mlp.b1_grad, &mlp.w2_grad, &mlp.b2_grad}) {
            g->Zero(stream);
        }
        mlp.Forward(x, z, group, stream);

        // MSE: loss = Σ (z - target)² / n over the whole sequence; dz = 2 (z - target) / n.
        {
            OnStream on(device, stream);
            Tensor z_t = z.tensor();
            Tensor target_t = target.tensor();
            Tensor dz_t = dz.tensor();
            kernels::Add({.a = z_t, .b = target_t, .out = dz_t, .alpha = -1.0});
        }
        double local = 0.0;
        for (float d : dz.Download(stream)) {
            local += static_cast<double>(d) * d;
        }
        double total = 0.0;
        SHARDLINE_CHECK_MPI(MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        loss = total / n;
        {
            OnStream on(device, stream);
            Tensor dz_t = dz.tensor();
            kernels::Scale({.x = dz_t, .out = dz_t, .alpha = 2.0 / n});
        }

        mlp.Backward(dz, &dx, group, stream);

        std::string checked;
        if (step == 1 || step == o.steps || step % o.check_every == 0) {
            const double worst = CheckGradients(o, tp, full, mlp, dx, loss, rtol, step, stream);
            checked = fmt::format(" | dX dW1 db1 dW2 db2 match float64 (max rel err {:.1e})", worst);
        }

        // SGD on this rank's shards (b2, replicated, gets the same update on every rank).
        {
            OnStream on(device, stream);
            for (auto [p, g] : {std::pair{&mlp.w1, &mlp.w1_grad}, std::pair{&mlp.b1, &mlp.b1_grad},
                                std::pair{&mlp.w2, &mlp.w2_grad}, std::pair{&mlp.b2, &mlp.b2_grad}}) {
                Tensor p_t = p->tensor();
                Tensor g_t = g->tensor();
                kernels::SgdStep({.param = p_t, .grad = g_t, .lr = o.lr});
            }
        }
        if (step == 1) {
            first_loss = loss;
        }
        if (rank == 0) {
            fmt::print("step {:>3}/{} | loss {:.6f}{}\n", step, o.steps, loss, checked);
            std::fflush(stdout);
        }
    }
    stream_owner.Synchronize();
    SHARDLINE_CHECK(o.steps == 1 || loss < first_loss, kProgram, "the loss did not fall: {} at step 1, {} at step {}",
                    first_loss, loss, o.steps);
    if (rank == 0) {
        fmt::print("{}: loss {:.6f} -> {:.6f} in {} steps; gradients matched the float64 reference\n", kProgram,
                   first_loss, loss, o.steps);
    }
    return 0;
}

/// With --skip-without-gpus: whether every node has a GPU per local rank (and the build has NCCL), agreed by all
/// ranks over MPI before the bootstrap binds GPUs, as the dist tests' main decides. MPI is initialised here.
bool EnoughGpus(int *argc, char ***argv, std::string &reason) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int local_size = 1;
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    const int gpus = CudaDeviceCount();
    int ok = (SHARDLINE_WITH_NCCL && gpus >= local_size) ? 1 : 0;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all_ok == 0) {
        reason = SHARDLINE_WITH_NCCL ? fmt::format("needs one GPU per rank: {} ranks, but a node has fewer GPUs (this "
                                                   "node: {} ranks, {} GPUs)",
                                                   size, local_size, gpus)
                                     : std::string("this build has no NCCL backend");
    }
    return all_ok != 0;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"a foreign training loop on shardline::functional: column -> GELU -> row MLP, checked in float64"};
    Options o;
    std::string backend = "auto";
    bool skip_without_gpus = false;
    app.add_option("--steps", o.steps, "SGD steps");
    app.add_option("--seq", o.seq, "sequence length S (divisible by the ranks)");
    app.add_option("--batch", o.batch, "batch B");
    app.add_option("--hidden", o.hidden, "hidden size H");
    app.add_option("--ffn", o.ffn, "MLP inner size F (divisible by the ranks)");
    app.add_option("--lr", o.lr, "SGD learning rate");
    app.add_option("--seed", o.seed, "seed of the data and the weights");
    app.add_option("--check-every", o.check_every, "steps between gradient checks (the first and last always)");
    app.add_option("--backend", backend, "auto (NCCL on GPUs when present), cpu (MPI) or cuda (NCCL)")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    app.add_flag(
        "--skip-without-gpus", skip_without_gpus,
        "with --backend cuda: exit 77 on every rank (CTest's skip code) when a node has fewer GPUs than ranks");
    CLI11_PARSE(app, argc, argv);

    const launch::BootstrapOptions bootstrap{.backend = backend == "cpu"    ? launch::BackendChoice::kCpu
                                                        : backend == "cuda" ? launch::BackendChoice::kCuda
                                                                            : launch::BackendChoice::kAuto};
    if (skip_without_gpus && backend == "cuda") {
        std::string reason;
        if (!EnoughGpus(&argc, &argv, reason)) {
            int rank = 0;
            MPI_Comm_rank(MPI_COMM_WORLD, &rank);
            if (rank == 0) {
                std::printf("%s: skipped: %s\n", kProgram, reason.c_str());
                std::fflush(stdout);
            }
            MPI_Finalize();
            return 77;
        }
        // MPI is up: the Environment uses it and leaves finalizing to us.
        const int code =
            launch::RunMain(&argc, &argv, bootstrap, [&](launch::Environment &env) { return Run(env, o); });
        MPI_Finalize();
        return code;
    }
    return launch::RunMain(&argc, &argv, bootstrap, [&](launch::Environment &env) { return Run(env, o); });
}
