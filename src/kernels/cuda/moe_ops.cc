// The default provider's CUDA mixture-of-experts ops (kernels/moe.h) and their registration. The op wrappers in
// src/kernels/moe.cc have validated shapes, dtypes, devices and contiguity; these size the scratch (stream-ordered,
// from the device's pool), pick the launch and run it on the context stream. No host synchronisation.

#include <cstdint>
#include <limits>
#include <memory>

#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/moe.h>

#include "cuda_ops.h"
#include "moe_kernels.h"

namespace shardline::kernels::cuda {
namespace {

const std::int64_t *I64(const Tensor &t) { return static_cast<const std::int64_t *>(t.data()); }
std::int64_t *I64(Tensor &t) { return static_cast<std::int64_t *>(t.data()); }
const float *F32(const Tensor *t) { return t != nullptr ? static_cast<const float *>(t->data()) : nullptr; }

cudaStream_t StreamOf(const Tensor &t) { return CudaContext::Get(t.device().index).stream(); }

MoERouterShape ShapeOf(const Tensor &logits, const MoERouterConfig &c) {
    return {.tokens = logits.size(0),
            .experts = c.num_experts,
            .topk = c.topk,
            .sigmoid = c.score_function == MoEScoreFunction::kSigmoid,
            .normalize = NormalizesTopk(c)};
}

/// coeff·E / (T²·topk): d aux / d p[t, e] per routed copy of e.
float AuxScale(const MoERouterConfig &c, std::int64_t tokens) {
    const auto t = static_cast<double>(tokens);
    return tokens == 0 ? 0.0f : static_cast<float>(c.aux_loss_coeff * c.num_experts / (t * t * c.topk));
}

void CudaMoERouterForward(const MoERouterForwardArgs &args) {
    const MoERouterShape shape = ShapeOf(args.logits, args.config);
    const bool losses = args.aux_loss != nullptr || args.z_loss != nullptr;
    const std::size_t bytes = MoERouterForwardWorkspace(shape, losses);
    const std::shared_ptr<Storage> workspace = bytes > 0 ? Storage::Allocate(bytes, args.logits.device()) : nullptr;
    const float z_scale =
        shape.tokens == 0 ? 0.0f : static_cast<float>(args.config.z_loss_coeff / static_cast<double>(shape.tokens));
    SHARDLINE_CHECK_CUDA(LaunchMoERouterForward(
        static_cast<const float *>(args.logits.data()), shape, static_cast<float *>(args.weights.data()),
        I64(args.indices), I64(args.tokens_per_expert),
        args.aux_loss != nullptr ? static_cast<float *>(args.aux_loss->data()) : nullptr,
        AuxScale(args.config, shape.tokens),
        args.z_loss != nullptr ? static_cast<float *>(args.z_loss->data()) : nullptr, z_scale,
        workspace != nullptr ? workspace->data() : nullptr, bytes, StreamOf(args.logits)));
}

void CudaMoERouterBackward(const MoERouterBackwardArgs &args) {
    const MoERouterShape shape = ShapeOf(args.logits, args.config);
    const float z_scale = static_cast<float>(args.config.z_loss_coeff * 2.0 / static_cast<double>(shape.tokens));
    SHARDLINE_CHECK_CUDA(LaunchMoERouterBackward(
        static_cast<const float *>(args.logits.data()), shape, I64(args.indices), I64(args.tokens_per_expert),
        F32(args.dweights), F32(args.daux_loss), AuxScale(args.config, shape.tokens), F32(args.dz_loss), z_scale,
        static_cast<float *>(args.dlogits.data()), StreamOf(args.logits)));
}

void CudaMoEPermuteMap(const MoEPermuteMapArgs &args) {
    const std::int64_t copies = args.indices.numel();
    SHARDLINE_CHECK_AS(ShapeError, copies < std::numeric_limits<int>::max(), MoEPermuteMapOp::kName,
                       "the CUDA kernel sorts fewer than 2^31 - 1 copies (32-bit copy indices), got indices {}",
                       args.indices.ToString());
    std::size_t bytes = 0;
    SHARDLINE_CHECK_CUDA(MoEPermuteMapWorkspace(copies, args.num_experts, &bytes));
    // Stream-ordered scratch (O(copies + E)): freed after the kernels are queued, reused by the next step.
    const std::shared_ptr<Storage> workspace = Storage::Allocate(bytes, args.indices.device());
    SHARDLINE_CHECK_CUDA(LaunchMoEPermuteMap(I64(args.indices), copies, args.num_experts, args.capacity,
                                             I64(args.row_map), I64(args.group_sizes), workspace->data(), bytes,
                                             StreamOf(args.indices)));
}

void CudaMoEPermuteRows(const MoEPermuteRowsArgs &args) {
    SHARDLINE_CHECK_CUDA(LaunchMoEPermuteRows(
        args.x.data(), args.x.size(0), static_cast<int>(args.row_map.size(1)), args.x.size(1), args.x.dtype(),
        I64(args.row_map), args.weights != nullptr ? args.weights->data() : nullptr,
        args.weights != nullptr ? args.weights->dtype() : DType::kFloat32, args.out.data(), StreamOf(args.x)));
}

void CudaMoEUnpermuteRows(const MoEUnpermuteRowsArgs &args) {
    SHARDLINE_CHECK_CUDA(LaunchMoEUnpermuteRows(
        args.tokens.data(), args.tokens.size(1), args.tokens.dtype(), I64(args.row_map), args.row_map.size(0),
        static_cast<int>(args.row_map.size(1)), args.weights != nullptr ? args.weights->data() : nullptr,
        args.weights != nullptr ? args.weights->dtype() : DType::kFloat32, args.y.data(), StreamOf(args.tokens)));
}

void CudaMoEUnpermuteWeightsGrad(const MoEUnpermuteWeightsGradArgs &args) {
    SHARDLINE_CHECK_CUDA(LaunchMoEUnpermuteWeightsGrad(
        args.dy.data(), args.tokens.data(), args.dy.size(1), args.dy.dtype(), I64(args.row_map), args.row_map.size(0),
        static_cast<int>(args.row_map.size(1)), args.dweights.data(), args.dweights.dtype(), StreamOf(args.dy)));
}

} // namespace

void RegisterCudaMoEKernels() {
    constexpr DeviceType kCuda = DeviceType::kCUDA;
    Register<MoERouterForwardOp>(kCuda, kDefaultProvider, &CudaMoERouterForward);
    Register<MoERouterBackwardOp>(kCuda, kDefaultProvider, &CudaMoERouterBackward);
    Register<MoEPermuteMapOp>(kCuda, kDefaultProvider, &CudaMoEPermuteMap);
    Register<MoEPermuteRowsOp>(kCuda, kDefaultProvider, &CudaMoEPermuteRows);
    Register<MoEUnpermuteRowsOp>(kCuda, kDefaultProvider, &CudaMoEUnpermuteRows);
    Register<MoEUnpermuteWeightsGradOp>(kCuda, kDefaultProvider, &CudaMoEUnpermuteWeightsGrad);
}

} // namespace shardline::kernels::cuda
