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
}

} // namespace shardline::kernels::detail
