#pragma once

// Launchers for the embedding kernels (embedding_kernels.cu). Declarations only: host code includes this without nvcc.
// ids are int64; tables float32/float16/bfloat16. Each launcher returns the launch status for SHARDLINE_CHECK_CUDA.

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include <shardline/core/dtype.h>

namespace shardline::kernels::cuda {

/// out[i, :] = weight[ids[i] - vocab_start, :] when that row is in [0, rows), else zeros. Copies rows as bytes in the
/// widest words (16, 8, 4 or 2 bytes) that the row size and both pointers allow.
cudaError_t LaunchEmbeddingForward(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start,
                                   const void *weight, std::int64_t rows, std::int64_t hidden, DType dtype, void *out,
                                   cudaStream_t stream);

/// out[n, :] = Σ_{t < bag} weight[ids[t·count + n] - vocab_start, :] over the ids in [0, rows) of the shard, summed in
/// fp32 in increasing t and rounded once (zeros for a bag with no id in the shard, and for bag == 0). One thread per
/// 16-byte vector of an output row (one element when the row size or a pointer does not allow it): the reads of a
/// table row are coalesced, the ids of a column are one broadcast load per warp.
cudaError_t LaunchEmbeddingBagForward(const std::int64_t *ids, std::int64_t bag, std::int64_t count,
                                      std::int64_t vocab_start, const void *weight, std::int64_t rows,
                                      std::int64_t hidden, DType dtype, void *out, cudaStream_t stream);

/// The device workspace LaunchEmbeddingBackward needs for n ids over a table of `rows` rows: the sort keys and dout
/// rows (two buffers each, which CUB's double-buffered sort alternates between), the runs (keys, lengths, offsets,
/// count) and CUB's temporary storage (its histograms and tile states only). O(n + min(n, rows)) bytes: it never
/// depends on dout's size. Fills `*bytes`; returns CUB's status.
cudaError_t EmbeddingBackwardWorkspace(std::int64_t n, std::int64_t rows, std::size_t *bytes);

/// dweight[v, :] (+)= Σ_{i < n : ids[i] - vocab_start == v} dout[i mod dout_rows, :], deterministic: the local rows of
/// the ids are radix sorted (stably, so each row's positions stay in increasing order) and run-length encoded on the
/// device; then for each distinct row and each 128-column tile one block sums the row's dout rows in fp32 (4 warps over
/// every 4th position, then the warps in order) and rounds once into dweight. No host synchronisation; no atomics.
/// Rows no id hits are zeroed unless `accumulate`. dout_rows = n is EmbeddingBackward (position i reads dout row i);
/// dout_rows = N for a bag of ids [T, N] is EmbeddingBagBackward (position t·N + n reads dout row n).
/// n and rows must be below 2^31 (the sort keys are 32-bit), 0 < dout_rows <= n; `workspace` holds
/// EmbeddingBackwardWorkspace's bytes.
cudaError_t LaunchEmbeddingBackward(const std::int64_t *ids, std::int64_t n, std::int64_t vocab_start, const void *dout,
                                    std::int64_t dout_rows, DType dout_dtype, void *dweight, DType dweight_dtype,
                                    std::int64_t rows, std::int64_t hidden, bool accumulate, void *workspace,
                                    std::size_t workspace_bytes, cudaStream_t stream);

/// The leading dimension (elements) of the count matrix of a `rows`-row shard: rows rounded up to a multiple of 8, so
/// that every row of the matrix starts on a 16-byte boundary (vector stores, and cuBLASLt's aligned kernels).
std::int64_t EmbeddingBagCountsLd(std::int64_t rows);

/// counts[n, v] = #{t < bag : ids[t·count + n] - vocab_start == v} for v < rows, and 0 for rows <= v < ld
/// (ld = EmbeddingBagCountsLd(rows)): the [count, ld] row-major matrix of EmbeddingBag's count-GEMM path, in `dtype`
/// (float32/float16/bfloat16; the caller keeps every count exact in it). Zeroes and counts in one kernel: one block per
/// bag row, a shared-memory int histogram of a tile of columns (several passes when rows exceed a tile), integer
/// atomics (exact in any order), then 16-byte stores. `counts` must be 16-byte aligned.
cudaError_t LaunchEmbeddingBagCounts(const std::int64_t *ids, std::int64_t bag, std::int64_t count,
                                     std::int64_t vocab_start, std::int64_t rows, DType dtype, void *counts,
                                     cudaStream_t stream);

} // namespace shardline::kernels::cuda
