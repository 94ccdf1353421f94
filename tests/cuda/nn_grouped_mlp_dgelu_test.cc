// An expert MLP's GELU gradient in fc2's grouped dgrad epilogue on one GPU (issue 16): ColumnParallelGroupedLinear →
// autograd::GeluRowParallelGroupedLinear against the same layers with a separate autograd::Gelu node, bf16 and fp16,
// device and host group sizes (8 experts, one empty, one with a single row), on random data: the output bit for bit
// (the same kernels), every gradient within a few roundings of the node's and of a float64 reference, and no
// GeluBackward kernel in the fused backward (a counting provider). The mesh is one rank over the test's own
// single-rank ncclComm_t (no MPI). Skips without a GPU.

#include <cmath>
#include <cstdlib>
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

constexpr std::int64_t kExperts = 8;
constexpr std::int64_t kHidden = 128;
constexpr std::int64_t kFfn = 256;
const std::vector<std::int64_t> kSizes = {97, 0, 1, 130, 64, 211, 16, 121};

constexpr std::string_view kCountingGeluBackward = "grouped-dgelu-counting";
int g_gelu_backwards = 0;
kernels::GeluBackwardOp::Fn g_gelu_backward = nullptr;
void CountGeluBackward(const kernels::GeluBackwardArgs &args) {
    ++g_gelu_backwards;
    g_gelu_backward(args);
}

bool HaveGpu() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

/// Per expert: y = gelu(x·W1ᵀ + b1)·W2ᵀ + b2 and its gradients, in float64.
RefMlpResult Reference(const Values &x, const Values &w1, const Values &b1, const Values &w2, const Values &b2,
                       const Values &dy) {
    auto slice = [](const Values &v, std::int64_t first, std::int64_t count, std::int64_t cols) {
        return Values(v.begin() + first * cols, v.begin() + (first + count) * cols);
    };
    auto append = [](Values &to, const Values &from) { to.insert(to.end(), from.begin(), from.end()); };
    RefMlpResult all;
    std::int64_t first = 0;
    for (std::int64_t e = 0; e < kExperts; ++e) {
        const std::int64_t m = kSizes[static_cast<std::size_t>(e)];
        const Values eb1 = slice(b1, e, 1, kFfn), eb2 = slice(b2, e, 1, kHidden);
        const RefMlpResult r =
            RefMlp(slice(x, first, m, kHidden), slice(w1, e, 1, kFfn * kHidden), &eb1, slice(w2, e, 1, kHidden * kFfn),
                   &eb2, slice(dy, first, m, kHidden), m, kHidden, kFfn, /*gelu=*/true);
        append(all.y, r.y);
        append(all.dx, r.dx);
        append(all.dw1, m > 0 ? r.dw1 : Values(kFfn * kHidden, 0.0));
        append(all.db1, m > 0 ? r.db1 : Values(kFfn, 0.0));
        append(all.dw2, m > 0 ? r.dw2 : Values(kHidden * kFfn, 0.0));
        append(all.db2, m > 0 ? r.db2 : Values(kHidden, 0.0));
        first += m;
    }
    return all;
}

TEST(GroupedMlpDGeluCudaTest, FusedDGeluMatchesTheGeluNodeAndFloat64) {
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
        const functional::ColumnParallelLinearOptions fc1{
            .in_features = kHidden, .out_features = kFfn, .num_experts = kExperts};
        const functional::RowParallelLinearOptions fc2{
            .in_features = kFfn, .out_features = kHidden, .input_is_parallel = true, .num_experts = kExperts};
        std::int64_t rows = 0;
        for (std::int64_t s : kSizes) {
            rows += s;
        }
        const Tensor host_sizes =
            Tensor::FromVector(std::vector<double>(kSizes.begin(), kSizes.end()), Shape{kExperts}, DType::kInt64);
        for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
            for (const bool device_sizes : {true, false}) {
                SCOPED_TRACE(std::string(DTypeName(dtype)) + (device_sizes ? " device sizes" : " host sizes"));
                const Tensor sizes = device_sizes ? host_sizes.To(Device::CUDA(0)) : host_sizes;
                const Tensor x = RandomGpu({rows, kHidden}, dtype, 81, "x");
                const Tensor w1 =
                    RandomGpu({kExperts, kFfn, kHidden}, dtype, 81, "w1", 1.0 / std::sqrt(double(kHidden)));
                const Tensor b1 = RandomGpu({kExperts, kFfn}, dtype, 81, "b1");
                const Tensor w2 = RandomGpu({kExperts, kHidden, kFfn}, dtype, 81, "w2", 1.0 / std::sqrt(double(kFfn)));
                const Tensor b2 = RandomGpu({kExperts, kHidden}, dtype, 81, "b2");
                const Tensor dy = RandomGpu({rows, kHidden}, dtype, 82, "dy");
                const RefMlpResult want = Reference(x.ToDoubleVector(), w1.ToDoubleVector(), b1.ToDoubleVector(),
                                                    w2.ToDoubleVector(), b2.ToDoubleVector(), dy.ToDoubleVector());

                g_gelu_backward = kernels::OpTable<kernels::GeluBackwardOp>::Resolve(DeviceType::kCUDA).fn;
                kernels::Register<kernels::GeluBackwardOp>(DeviceType::kCUDA, kCountingGeluBackward,
                                                           &CountGeluBackward);
                kernels::SetProvider(kCountingGeluBackward);
                std::vector<std::vector<Values>> runs; // fused, then the GELU node
                for (const bool fused : {true, false}) {
                    Variable vx(DistTensor::Replicated(x, mesh), true);
                    Variable vw1(DistTensor::Replicated(w1, mesh), true);
                    Variable vb1(DistTensor::Replicated(b1, mesh), true);
                    Variable vw2(DistTensor::Replicated(w2, mesh), true);
                    Variable vb2(DistTensor::Replicated(b2, mesh), true);
                    g_gelu_backwards = 0;
                    const Variable pre = autograd::ColumnParallelGroupedLinear(vx, vw1, vb1, sizes, fc1, tp);
                    const Variable y =
                        fused ? autograd::GeluRowParallelGroupedLinear(pre, vw2, vb2, sizes, fc2, tp)
                              : autograd::RowParallelGroupedLinear(autograd::Gelu(pre), vw2, vb2, sizes, fc2, tp);
                    const DistTensor g = DistTensor::Replicated(dy, mesh);
                    y.Backward(&g);
                    EXPECT_EQ(g_gelu_backwards, fused ? 0 : 1)
                        << (fused ? "the fused backward ran a GeluBackward kernel" : "the GELU node's backward");
                    runs.push_back({y.value().local().ToDoubleVector(), vx.grad().local().ToDoubleVector(),
                                    vw1.grad().local().ToDoubleVector(), vb1.grad().local().ToDoubleVector(),
                                    vw2.grad().local().ToDoubleVector(), vb2.grad().local().ToDoubleVector()});
                }
                kernels::UnregisterProviderEverywhere(kCountingGeluBackward);
                kernels::ResetProviderSelection();

                EXPECT_EQ(runs[0][0], runs[1][0]) << "y: the same kernels forward";
                const std::vector<const Values *> refs = {&want.y,   &want.dx,  &want.dw1,
                                                          &want.db1, &want.dw2, &want.db2};
                const char *const names[] = {"y", "dx", "dW1", "db1", "dW2", "db2"};
                // Against the rms of each output: the pre-activation and h rounded to the dtype on the way, a few
                // roundings in a row; the fused dGELU rounds once less than the node's pair.
                const double rtol = Tolerance(dtype, 4.0);
                for (std::size_t i = 0; i < refs.size(); ++i) {
                    const std::string vs_ref = CompareValues(runs[0][i], *refs[i], rtol, rtol);
                    EXPECT_TRUE(vs_ref.empty()) << names[i] << " (fused) vs float64: " << vs_ref;
                    const std::string vs_node = CompareValues(runs[0][i], runs[1][i], rtol, rtol);
                    EXPECT_TRUE(vs_node.empty()) << names[i] << " fused vs the GELU node: " << vs_node;
                }
            }
        }
    }
    ncclCommDestroy(nccl);
}

} // namespace
} // namespace shardline::testing
