#pragma once

// Every kernel op of shardline, for code that wants them all.

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>
#include <shardline/kernels/matmul.h>
#include <shardline/kernels/outer.h>

namespace shardline::kernels {

/// Removes a provider from every op (tests).
inline void UnregisterProviderEverywhere(std::string_view provider) {
    UnregisterProvider<GemmOp, LinearForwardOp, LinearBackwardInputOp, LinearBackwardWeightOp, LinearBackwardBiasOp,
                       MatmulForwardOp, MatmulBackwardInputOp, MatmulBackwardOtherOp, OuterForwardOp, OuterBackwardOp,
                       GeluForwardOp, GeluBackwardOp, AddOp, ScaleOp, SumOp>(provider);
}

} // namespace shardline::kernels
