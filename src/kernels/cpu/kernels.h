#pragma once

// The CPU kernels of the "default" provider, registered by RegisterCpuKernels() (register.cc).

#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/gemm.h>
#include <shardline/kernels/linear.h>

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

} // namespace shardline::kernels::cpu
