#pragma once

// The CPU kernels of the "default" provider, registered by RegisterCpuKernels() (register.cc).

#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/embedding.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>
#include <shardline/kernels/moe.h>
#include <shardline/kernels/optim.h>

namespace shardline::kernels::cpu {

/// OpenBLAS cblas_sgemm / cblas_dgemm per batch entry, then the epilogue loops of gemm.h.
void Gemm(const GemmParams &params);
/// dbias (+)= Σ_rows dy, accumulated in fp64.
void LinearBackwardBias(const LinearBackwardBiasArgs &args);
void GeluForward(const GeluForwardArgs &args);
void GeluBackward(const GeluBackwardArgs &args);
void Add(const AddArgs &args);
void Scale(const ScaleArgs &args);
void Sum(const SumArgs &args);
void BiasAdd(const BiasAddArgs &args);
/// embedding.cc: row copies; the backward sums in fp64 in position order and rounds once.
void EmbeddingForward(const EmbeddingForwardArgs &args);
void EmbeddingBackward(const EmbeddingBackwardArgs &args);
/// The bag sums: the forward in fp64 over t in increasing order; the backward is EmbeddingBackward's loop with
/// position t·N + n reading dout row n.
void EmbeddingBagForward(const EmbeddingBagForwardArgs &args);
void EmbeddingBagBackward(const EmbeddingBagBackwardArgs &args);
/// cross_entropy.cc: fp64 math, one rounding to each output.
void CrossEntropyRowMax(const CrossEntropyRowMaxArgs &args);
void CrossEntropyStats(const CrossEntropyStatsArgs &args);
void CrossEntropyLoss(const CrossEntropyLossArgs &args);
void CrossEntropyBackward(const CrossEntropyBackwardArgs &args);
/// moe.cc: router, permutation map, gather, combine and the combine's weight grad; fp64 math, fixed-order sums.
void MoERouterForward(const MoERouterForwardArgs &args);
void MoERouterBackward(const MoERouterBackwardArgs &args);
void MoEPermuteMap(const MoEPermuteMapArgs &args);
void MoEPermuteRows(const MoEPermuteRowsArgs &args);
void MoEUnpermuteRows(const MoEUnpermuteRowsArgs &args);
void MoEUnpermuteWeightsGrad(const MoEUnpermuteWeightsGradArgs &args);
/// optim.cc: fp64 math per element, states stored in the master's dtype.
void SgdStep(const SgdStepArgs &args);
void AdamWStep(const AdamWStepArgs &args);
/// The single-tensor steps on each entry in turn.
void SgdStepMulti(const SgdStepMultiArgs &args);
void AdamWStepMulti(const AdamWStepMultiArgs &args);

} // namespace shardline::kernels::cpu
