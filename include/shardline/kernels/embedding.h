#pragma once

// Embedding lookup and its weight gradient, with Megatron's vocab-parallel form: a rank holds rows
// [vocab_start, vocab_start + V_local) of the [V, H] table; ids outside that range give zero rows (the all-reduce over
// the tensor-parallel group adds the other ranks' rows) and contribute nothing to this rank's gradient.
// ids are int64 of any shape; the table and the gradients are float (CPU float32/float64, CUDA float32/float16/bfloat16
// with fp32 accumulation).

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

struct EmbeddingForwardArgs {
    const Tensor& ids;            ///< [...] int64, global token ids
    const Tensor& weight;         ///< [V_local, H]: rows vocab_start .. vocab_start + V_local - 1 of the table
    Tensor& out;                  ///< [..., H] (ids' shape + H), weight's dtype, overwritten
    std::int64_t vocab_start = 0; ///< global id of weight's first row (>= 0)
};
struct EmbeddingForwardOp {
    static constexpr std::string_view kName = "EmbeddingForward";
    using Fn = void (*)(const EmbeddingForwardArgs&);
};
/// out[i, :] = weight[ids[i] - vocab_start, :] when vocab_start <= ids[i] < vocab_start + V_local, else 0
/// (Megatron's VocabParallelEmbedding: the rows of other ranks are zeros, the all-reduce adds them). Range checking of
/// the global ids against the whole vocabulary is the caller's job.
void EmbeddingForward(const EmbeddingForwardArgs& args);
Tensor EmbeddingForward(const Tensor& ids, const Tensor& weight, std::int64_t vocab_start = 0);

struct EmbeddingBackwardArgs {
    const Tensor& ids;  ///< [...] int64
    const Tensor& dout; ///< [..., H]
    Tensor& dweight;    ///< [V_local, H]: dout's dtype, or float32 when accumulating a main grad
    std::int64_t vocab_start = 0;
    bool accumulate = false; ///< dweight += instead of =
};
struct EmbeddingBackwardOp {
    static constexpr std::string_view kName = "EmbeddingBackward";
    using Fn = void (*)(const EmbeddingBackwardArgs&);
};
/// dweight[v, :] (+)= Σ_{i : ids[i] - vocab_start == v} dout[i, :]; ids outside the local range contribute nothing.
/// Each sum runs in a fixed order and rounds once into dweight, so results are bitwise reproducible on both devices:
/// on the CPU over the positions i in increasing order in fp64; on CUDA in fp32, the ids radix-sorted (stable, no
/// atomics) and each row's positions split over 4 warps (warp w takes every 4th from the w-th) whose sums are then
/// added in warp order, so that a frequent id's long run is summed in parallel.
void EmbeddingBackward(const EmbeddingBackwardArgs& args);

// EmbeddingBag, mode sum (torch.nn.EmbeddingBag(mode="sum") with equal-length bags): the lookup of ids [T, ...] summed
// over the bag dim 0 without the [T, ..., H] intermediate. Same vocab-parallel range as EmbeddingForward: ids outside
// this rank's rows add nothing (a bag of only such ids gives a zero row).

struct EmbeddingBagForwardArgs {
    const Tensor& ids;            ///< [T, ...] int64: bag dim 0 (T ids per output row), any trailing dims
    const Tensor& weight;         ///< [V_local, H]
    Tensor& out;                  ///< [..., H] (ids' shape without dim 0, + H), weight's dtype, overwritten
    std::int64_t vocab_start = 0; ///< global id of weight's first row (>= 0)
};
struct EmbeddingBagForwardOp {
    static constexpr std::string_view kName = "EmbeddingBagForward";
    using Fn = void (*)(const EmbeddingBagForwardArgs&);
};
/// out[n, :] = Σ_{t < T : vocab_start <= ids[t, n] < vocab_start + V_local} weight[ids[t, n] - vocab_start, :], n over
/// the flattened trailing dims of ids. Summed over t in increasing order and rounded once into out: on the CPU in
/// fp64, on CUDA in fp32 (each thread owns up to 16 bytes of one output row: coalesced, vectorised, no atomics), so
/// the result is bitwise reproducible. T = 0 gives zeros.
void EmbeddingBagForward(const EmbeddingBagForwardArgs& args);
Tensor EmbeddingBagForward(const Tensor& ids, const Tensor& weight, std::int64_t vocab_start = 0);

struct EmbeddingBagBackwardArgs {
    const Tensor& ids;  ///< [T, ...] int64
    const Tensor& dout; ///< [..., H] (ids' shape without dim 0, + H)
    Tensor& dweight;    ///< [V_local, H]: dout's dtype, or float32 when accumulating a main grad
    std::int64_t vocab_start = 0;
    bool accumulate = false; ///< dweight += instead of =
};
struct EmbeddingBagBackwardOp {
    static constexpr std::string_view kName = "EmbeddingBagBackward";
    using Fn = void (*)(const EmbeddingBagBackwardArgs&);
};
/// dweight[v, :] (+)= Σ_{(t, n) : ids[t, n] - vocab_start == v} dout[n, :]: EmbeddingBackward of the broadcast
/// gradient dout[n] at every position (t, n), without materialising it. The same kernels as EmbeddingBackward (position
/// i = t·N + n reads dout row i mod N), so the same determinism: each row's terms in increasing position order, one
/// rounding into dweight.
void EmbeddingBagBackward(const EmbeddingBagBackwardArgs& args);

} // namespace shardline::kernels
