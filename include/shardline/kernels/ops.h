#pragma once

// Every kernel op of shardline, for code that wants them all.

#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>
#include <shardline/kernels/linear.h>
#include <shardline/kernels/matmul.h>
#include <shardline/kernels/moe.h>
#include <shardline/kernels/optim.h>
#include <shardline/kernels/outer.h>

namespace shardline::kernels {

/// Removes a provider from every op (tests).
inline void UnregisterProviderEverywhere(std::string_view provider) {
    UnregisterProvider<GemmOp, LinearForwardOp, LinearBackwardOp, LinearBackwardInputOp, LinearBackwardWeightOp,
                       LinearBackwardBiasOp, MatmulForwardOp, MatmulBackwardInputOp, MatmulBackwardOtherOp,
                       OuterForwardOp, OuterBackwardOp, GeluForwardOp, GeluBackwardOp, AddOp, ScaleOp, SumOp, BiasAddOp,
                       EmbeddingForwardOp, EmbeddingBackwardOp, EmbeddingBagForwardOp, EmbeddingBagBackwardOp,
                       CrossEntropyRowMaxOp, CrossEntropyStatsOp, CrossEntropyLossOp, CrossEntropyBackwardOp, SgdStepOp,
                       AdamWStepOp, SgdStepMultiOp, AdamWStepMultiOp, GroupedGemmOp, GroupedLinearForwardOp,
                       GroupedLinearBackwardInputOp, GroupedLinearBackwardWeightOp, GroupedLinearBackwardBiasOp,
                       GroupedBiasAddOp, MoERouterForwardOp, MoERouterBackwardOp, MoEPermuteMapOp, MoEPermuteRowsOp,
                       MoEUnpermuteRowsOp, MoEUnpermuteWeightsGradOp>(provider);
}

} // namespace shardline::kernels
