#pragma once

// torch's multi_tensor_apply scheme: one elementwise op over a list of tensors in few launches. Each launch takes a
// table of up to kMaxTensors tensors (kDepth pointers, element count, per-tensor scalars and whether the tensor's
// pointers allow 16-byte vectors) and up to kMaxBlocks (tensor, chunk) pairs; block b updates chunk b of its tensor
// (kChunk elements, the last one shorter). The table is the kernel's argument, so no device buffer is written and
// nothing on the host has to outlive the launch. A tensor whose chunks do not fit in one launch continues in the next.
// torch keeps the table under the old 4 KB parameter limit (36 tensors / 320 blocks: a 143 M-parameter AdamW is 7
// launches, each ending in a partly idle tail, 8 % slower than one launch per tensor on an H100); CUDA 12.1 raised the
// limit to 32764 bytes, so a table here holds 110 tensors and 2560 blocks (~19 KB) and such a model is one launch.
// Included only by nvcc.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "device_utils.cuh"

namespace shardline::kernels::cuda::multi_tensor {

inline constexpr int kThreads = 512;
inline constexpr std::int64_t kChunk = 65536; ///< elements per block: a multiple of kVec, so chunks stay aligned
inline constexpr int kMaxTensors = 110;
inline constexpr int kMaxBlocks = 2560;
/// CUDA 12.1+ (Volta and later): a kernel's parameters may take up to 32764 bytes.
inline constexpr std::size_t kMaxKernelParamBytes = 32764;

/// A launch's capacity: at most this many tensors and blocks (0 or more than the table holds: the table's size). Tests
/// pass small values to run the continuation paths on small tensors.
struct Limits {
    int max_tensors = 0;
    int max_blocks = 0;
};
inline constexpr int kVec = 4; ///< elements per vector access of a 32-bit tensor: 16 bytes

/// One launch's tensors. ptr[k][t] is the k-th tensor of entry t (null for an absent optional one).
template <int kDepth, class Extra> struct Table {
    void *ptr[kDepth][kMaxTensors];
    std::int64_t n[kMaxTensors];
    Extra extra[kMaxTensors];
    bool vec[kMaxTensors];
    std::uint8_t block_tensor[kMaxBlocks];
    std::int32_t block_chunk[kMaxBlocks];
};

/// The part of one tensor that a block updates: elements [start, start + n) of tensor `tensor` of the table.
struct Chunk {
    int tensor;
    std::int64_t start;
    std::int64_t n;
};

/// Block b runs op over its chunk: Op::Bind(table, chunk) gives the chunk's pointers and scalars (a View), and
/// op.Apply<kN>(view, i) updates elements [i, i + kN) of the chunk. kN = kVec where the tensor allows vectors (the
/// chunk's last n % kVec elements one by one), 1 otherwise; Apply<kVec> and Apply<1> must compute the same values.
template <class TableT, class Op>
__global__ void __launch_bounds__(kThreads) MultiTensorApplyKernel(const TableT table, const Op op) {
    const int t = table.block_tensor[blockIdx.x];
    const std::int64_t start = static_cast<std::int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
    const std::int64_t left = table.n[t] - start;
    const Chunk chunk{.tensor = t, .start = start, .n = left < kChunk ? left : kChunk};
    const typename Op::View view = Op::Bind(table, chunk);
    std::int64_t scalar_from = 0;
    if (table.vec[t]) {
        const std::int64_t n_vec = chunk.n / kVec;
        for (std::int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
            op.template Apply<kVec>(view, i * kVec);
        }
        scalar_from = n_vec * kVec;
    }
    for (std::int64_t i = scalar_from + threadIdx.x; i < chunk.n; i += blockDim.x) {
        op.template Apply<1>(view, i);
    }
}

/// Packs the entries e = 0 .. count-1 for which fill(e, table, slot) returns true (it writes slot `slot` of the
/// table: ptr, n, extra, vec) into tables and launches MultiTensorApplyKernel<TableT, Op> for each on `stream`.
/// fill may be called again for an entry (to move a tensor that continues into the next launch to slot 0).
template <class TableT, class Op, class Fill>
cudaError_t MultiTensorApply(std::size_t count, Fill &&fill, const Op &op, cudaStream_t stream, Limits limits = {}) {
    static_assert(sizeof(TableT) + sizeof(Op) <= kMaxKernelParamBytes - 256,
                  "the table is a kernel argument: keep it under CUDA's 32764-byte parameter limit");
    static_assert(kMaxTensors <= 256, "block_tensor is a byte");
    const int max_tensors =
        limits.max_tensors > 0 && limits.max_tensors < kMaxTensors ? limits.max_tensors : kMaxTensors;
    const int max_blocks = limits.max_blocks > 0 && limits.max_blocks < kMaxBlocks ? limits.max_blocks : kMaxBlocks;
    TableT table{};
    auto launch = [&](int blocks) {
        MultiTensorApplyKernel<TableT, Op><<<blocks, kThreads, 0, stream>>>(table, op);
        return cudaGetLastError();
    };
    int slot = 0;
    int blocks = 0;
    for (std::size_t e = 0; e < count; ++e) {
        if (!fill(e, table, slot) || table.n[slot] <= 0) {
            continue;
        }
        const std::int64_t chunks = (table.n[slot] + kChunk - 1) / kChunk;
        if (chunks > INT32_MAX) {
            return cudaErrorInvalidValue;
        }
        for (std::int64_t c = 0; c < chunks; ++c) {
            table.block_tensor[blocks] = static_cast<std::uint8_t>(slot);
            table.block_chunk[blocks] = static_cast<std::int32_t>(c);
            ++blocks;
            const bool last_chunk = c + 1 == chunks;
            if (blocks == max_blocks || (last_chunk && slot + 1 == max_tensors)) {
                if (const cudaError_t err = launch(blocks); err != cudaSuccess) {
                    return err;
                }
                blocks = 0;
                if (last_chunk) {
                    slot = -1; // the next tensor starts a fresh table at slot 0
                } else {
                    fill(e, table, 0); // this tensor's remaining chunks: slot 0 of the next table
                    slot = 0;
                }
            }
        }
        ++slot;
    }
    return blocks > 0 ? launch(blocks) : cudaSuccess;
}

} // namespace shardline::kernels::cuda::multi_tensor
