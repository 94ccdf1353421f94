// The README GPU job's block on one GPU: autograd::ParallelMLPWithResidual (x + MLP(x), tp 1) on CUDA, where fc2's
// GEMM adds x (its C, beta = 1) and fc1's dgrad GEMM adds x's pass-through gradient, against a float64 host reference
// of y and of every gradient on random data (fp32 and bf16; the first call, which tunes the plans, and the second),
// with no Add kernel run (a counting provider). The mesh is one rank over the test's own single-rank ncclComm_t
// (Communicator::FromNcclComm): no MPI. Skips without a GPU.

#include <cmath>
#include <cstdlib>
#include <numbers>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <shardline/autograd/functions.h>
#include <shardline/autograd/variable.h>
#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/ops.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::testing {
namespace {

using autograd::Variable;
using dist::DistTensor;

// Sizes whose GEMMs take cuBLASLt's fused epilogues (multiples of 8).
constexpr std::int64_t kRows = 256; ///< tokens: [kSeq, kBatch] flattened
constexpr std::int64_t kSeq = 4;
constexpr std::int64_t kBatch = kRows / kSeq;
constexpr std::int64_t kHidden = 64;
constexpr std::int64_t kFfn = 256;

double Gelu(double x) {
    const double c = std::sqrt(2.0 / std::numbers::pi);
    return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
double GeluGrad(double x) {
    const double c = std::sqrt(2.0 / std::numbers::pi);
    const double t = std::tanh(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

/// y = x + gelu(x·W1ᵀ + b1)·W2ᵀ + b2 and its gradients for dy, in float64 (row-major).
struct Reference {
    Values y, dx, dw1, db1, dw2, db2;
};
Reference Compute(const Values &x, const Values &w1, const Values &b1, const Values &w2, const Values &b2,
                  const Values &dy) {
    const Values pre = RefLinearForward(x, w1, &b1, kRows, kFfn, kHidden);
    Values h(pre.size());
    for (std::size_t i = 0; i < pre.size(); ++i) {
        h[i] = Gelu(pre[i]);
    }
    Reference r;
    r.y = AddScaled(RefLinearForward(h, w2, &b2, kRows, kHidden, kFfn), x);
    Values dpre = RefLinearBackwardInput(dy, w2, kRows, kHidden, kFfn);
    for (std::size_t i = 0; i < dpre.size(); ++i) {
        dpre[i] *= GeluGrad(pre[i]);
    }
    r.dx = AddScaled(RefLinearBackwardInput(dpre, w1, kRows, kFfn, kHidden), dy);
    r.dw1 = RefLinearBackwardWeight(dpre, x, kRows, kFfn, kHidden);
    r.db1 = RefColumnSum(dpre, kRows, kFfn);
    r.dw2 = RefLinearBackwardWeight(dy, h, kRows, kHidden, kFfn);
    r.db2 = RefColumnSum(dy, kRows, kHidden);
    return r;
}

constexpr std::string_view kCountingAdd = "residual-cuda-counting-add";
int g_adds = 0;
kernels::AddOp::Fn g_add = nullptr;
void CountAdd(const kernels::AddArgs &args) {
    ++g_adds;
    g_add(args);
}

bool HaveGpu() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

TEST(ParallelMlpResidualCudaTest, OneGpuMatchesFloat64WithTheAddsInTheGemms) {
    if (!HaveGpu()) {
        GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    ncclComm_t nccl = nullptr;
    ASSERT_EQ(ncclCommInitRank(&nccl, 1, id, 0), ncclSuccess);
    {
        auto world = comm::Communicator::FromNcclComm(nccl, {.name = "one-gpu"});
        comm::DeviceMesh mesh(*world, {1}, {"tp"});
        const auto tp = functional::TensorParallelGroup::Named(mesh, "tp");
        const functional::ColumnParallelLinearOptions fc1{.in_features = kHidden, .out_features = kFfn};
        const functional::RowParallelLinearOptions fc2{
            .in_features = kFfn, .out_features = kHidden, .input_is_parallel = true};
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
            SCOPED_TRACE(DTypeName(dtype));
            // Random values (weights ~ N(0, 1/fan_in)), rounded to the dtype once; the reference takes those values.
            const Tensor x = RandomGpu({kSeq, kBatch, kHidden}, dtype, 61, "x");
            const Tensor w1 = RandomGpu({kFfn, kHidden}, dtype, 61, "w1", 1.0 / std::sqrt(double(kHidden)));
            const Tensor b1 = RandomGpu({kFfn}, dtype, 61, "b1");
            const Tensor w2 = RandomGpu({kHidden, kFfn}, dtype, 61, "w2", 1.0 / std::sqrt(double(kFfn)));
            const Tensor b2 = RandomGpu({kHidden}, dtype, 61, "b2");
            const Tensor dy = RandomGpu({kSeq, kBatch, kHidden}, dtype, 62, "dy");
            const Reference want = Compute(x.ToDoubleVector(), w1.ToDoubleVector(), b1.ToDoubleVector(),
                                           w2.ToDoubleVector(), b2.ToDoubleVector(), dy.ToDoubleVector());

            g_add = kernels::OpTable<kernels::AddOp>::Resolve(DeviceType::kCUDA).fn;
            kernels::Register<kernels::AddOp>(DeviceType::kCUDA, kCountingAdd, &CountAdd);
            kernels::SetProvider(kCountingAdd);
            // Twice: the first call builds and tunes the plans, the second runs the cached ones.
            std::vector<std::vector<Values>> runs;
            for (int run = 0; run < 2; ++run) {
                Variable vx(DistTensor::Replicated(x, mesh), true);
                Variable vw1(DistTensor::Replicated(w1, mesh), true);
                Variable vb1(DistTensor::Replicated(b1, mesh), true);
                Variable vw2(DistTensor::Replicated(w2, mesh), true);
                Variable vb2(DistTensor::Replicated(b2, mesh), true);
                g_adds = 0;
                Variable y = autograd::ParallelMLPWithResidual(vx, vw1, vb1, vw2, vb2, fc1, fc2, tp);
                const DistTensor g = DistTensor::Replicated(dy, mesh);
                y.Backward(&g);
                EXPECT_EQ(g_adds, 0) << "run " << run << ": an Add kernel ran; the GEMMs should add the residual";
                runs.push_back({y.value().local().ToDoubleVector(), vx.grad().local().ToDoubleVector(),
                                vw1.grad().local().ToDoubleVector(), vb1.grad().local().ToDoubleVector(),
                                vw2.grad().local().ToDoubleVector(), vb2.grad().local().ToDoubleVector()});
            }
            kernels::UnregisterProviderEverywhere(kCountingAdd);
            kernels::ResetProviderSelection();

            const std::vector<const Values *> refs = {&want.y, &want.dx, &want.dw1, &want.db1, &want.dw2, &want.db2};
            const char *const names[] = {"y", "dx", "dW1", "db1", "dW2", "db2"};
            // Against the rms of each output: fp32 within cuBLASLt's GELU/DGELU approximation (kGeluEpilogueRoundings)
            // times the few roundings in a row; bf16 with h and the pre-activation rounded to bf16 on the way.
            const double rtol = Tolerance(dtype, dtype == DType::kFloat32 ? 16.0 : 4.0);
            for (std::size_t i = 0; i < refs.size(); ++i) {
                for (std::size_t run = 0; run < runs.size(); ++run) {
                    const std::string diff = CompareValues(runs[run][i], *refs[i], rtol, rtol);
                    EXPECT_TRUE(diff.empty()) << names[i] << " (run " << run << ") vs float64: " << diff;
                }
            }
        }
    }
    ncclCommDestroy(nccl);
}

} // namespace
} // namespace shardline::testing
