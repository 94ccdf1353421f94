#include "kernels/register.h"

#include <shardline/kernels/dispatcher.h>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::detail {

void RegisterCpuKernels() {
    constexpr DeviceType kCpu = DeviceType::kCPU;
    Register<GemmOp>(kCpu, kDefaultProvider, &cpu::Gemm);
    Register<LinearBackwardBiasOp>(kCpu, kDefaultProvider, &cpu::LinearBackwardBias);
    Register<GeluForwardOp>(kCpu, kDefaultProvider, &cpu::GeluForward);
    Register<GeluBackwardOp>(kCpu, kDefaultProvider, &cpu::GeluBackward);
    Register<AddOp>(kCpu, kDefaultProvider, &cpu::Add);
    Register<ScaleOp>(kCpu, kDefaultProvider, &cpu::Scale);
    Register<SumOp>(kCpu, kDefaultProvider, &cpu::Sum);
    Register<BiasAddOp>(kCpu, kDefaultProvider, &cpu::BiasAdd);
    Register<EmbeddingForwardOp>(kCpu, kDefaultProvider, &cpu::EmbeddingForward);
    Register<EmbeddingBackwardOp>(kCpu, kDefaultProvider, &cpu::EmbeddingBackward);
    Register<EmbeddingBagForwardOp>(kCpu, kDefaultProvider, &cpu::EmbeddingBagForward);
    Register<EmbeddingBagBackwardOp>(kCpu, kDefaultProvider, &cpu::EmbeddingBagBackward);
    Register<CrossEntropyRowMaxOp>(kCpu, kDefaultProvider, &cpu::CrossEntropyRowMax);
    Register<CrossEntropyStatsOp>(kCpu, kDefaultProvider, &cpu::CrossEntropyStats);
    Register<CrossEntropyLossOp>(kCpu, kDefaultProvider, &cpu::CrossEntropyLoss);
    Register<CrossEntropyBackwardOp>(kCpu, kDefaultProvider, &cpu::CrossEntropyBackward);
    Register<MoERouterForwardOp>(kCpu, kDefaultProvider, &cpu::MoERouterForward);
    Register<MoERouterBackwardOp>(kCpu, kDefaultProvider, &cpu::MoERouterBackward);
    Register<MoEPermuteMapOp>(kCpu, kDefaultProvider, &cpu::MoEPermuteMap);
    Register<MoEPermuteRowsOp>(kCpu, kDefaultProvider, &cpu::MoEPermuteRows);
    Register<MoEUnpermuteRowsOp>(kCpu, kDefaultProvider, &cpu::MoEUnpermuteRows);
    Register<MoEUnpermuteWeightsGradOp>(kCpu, kDefaultProvider, &cpu::MoEUnpermuteWeightsGrad);
    Register<SgdStepOp>(kCpu, kDefaultProvider, &cpu::SgdStep);
    Register<AdamWStepOp>(kCpu, kDefaultProvider, &cpu::AdamWStep);
    Register<SgdStepMultiOp>(kCpu, kDefaultProvider, &cpu::SgdStepMulti);
    Register<AdamWStepMultiOp>(kCpu, kDefaultProvider, &cpu::AdamWStepMulti);
}

} // namespace shardline::kernels::detail
