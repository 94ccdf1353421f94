#pragma once

// Embedding lookup and its weight gradient, with Megatron's vocab-parallel form: a rank holds rows
// [vocab_start, vocab_start + V_local) of the [V, H] table; ids outside that range give zero rows (the all-reduce over
// the tensor-parallel group adds the other ranks' rows) and contribute nothing to this rank's gradient.
// ids are int64 of any shape; the table and the gradients are float (CPU float32/float64, CUDA float32/float16/bfloat16
// with fp32 accumulation).

#include <cstdint>
#include <string>
#include <string_view>

#include <shardline/core/dtype.h>
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
/// the flattened trailing dims of ids. T = 0 gives zeros. On the CPU summed over t in increasing order in fp64 and
/// rounded once. On CUDA one of two implementations (EmbeddingBagImpl below), both fp32 sums rounded once into out:
///   gather     each thread owns up to 16 bytes of one output row and adds the rows in increasing t (coalesced,
///              vectorised, no atomics): bitwise reproducible, and the same bits for any split of the vocabulary.
///   count-GEMM out = C·W, C[n, v] = #{t : ids[t, n] - vocab_start == v} (integers, exact in the weight's dtype) by
///              one cuBLASLt GEMM: the same terms summed in the GEMM's order. Bitwise reproducible run to run within
///              a process (one cached plan per GEMM key, see ChooseEmbeddingBagImpl); not bitwise equal to the gather,
///              nor across vocabulary splits (another V_local is another GEMM).
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
/// gradient dout[n] at every position (t, n), without materialising it. On the CPU, and on CUDA's gather path, the same
/// kernels as EmbeddingBackward (position i = t·N + n reads dout row i mod N), so the same determinism: each row's
/// terms in increasing position order, one rounding into dweight, the same bits as EmbeddingBackward of the broadcast
/// gradient and for any vocabulary split. CUDA's count-GEMM path: dweight = Cᵀ·dout (+ dweight with beta = 1 when
/// accumulating) by one cuBLASLt GEMM over the count matrix C in dout's dtype, fp32 sums rounded once into dweight (a
/// float32 main grad included): bitwise reproducible run to run within a process, not bitwise equal to the gather.
void EmbeddingBagBackward(const EmbeddingBagBackwardArgs& args);

// ---------------------------------------------------------------------------------------------------------------------
// Which CUDA implementation the bag ops run (the CPU has one).
//
// With C[n, v] = #{t : ids[t, n] - vocab_start == v} ([N, V_local], ids outside the shard not counted), the forward is
// out = C·W and the backward dW (+)= Cᵀ·dout: two GEMMs of 2·N·V_local·H flops instead of gathers of T·N·H elements
// (read from L2). The counts are integers <= T, exact in bf16 for T <= 256, fp16 for T <= 2048 and fp32 for T <= 2^24,
// so with fp32 accumulation the GEMM sums the gather's terms, in another order. It pays where V_local is small against
// T (the README's char-LM: T = 32, V_local = 2752, H = 2048: ~92 GFLOP per GEMM), not for a large vocabulary, whose
// GEMM does far more work than the gather's traffic. docs/kernels.md has the cost model and what was measured.

/// kAuto: the count-GEMM where it is exact and the cost model (EstimateEmbeddingBagCost) says it is cheaper, else the
/// gather. kGemm: the count-GEMM wherever it is exact (an error otherwise); kGather: always the gather. Start:
/// SHARDLINE_EMBEDDING_BAG (auto|gemm|gather, default auto), read once, at the first call.
enum class EmbeddingBagImpl : std::uint8_t { kAuto, kGemm, kGather };
std::string_view EmbeddingBagImplName(EmbeddingBagImpl impl);
EmbeddingBagImpl GetEmbeddingBagImpl();
void SetEmbeddingBagImpl(EmbeddingBagImpl impl);

/// What the choice depends on: ids [T, N] over a [V_local, H] shard, and the count matrix's dtype (the weight's in the
/// forward, dout's in the backward).
struct EmbeddingBagProblem {
    std::int64_t bag = 0;   ///< T
    std::int64_t count = 0; ///< N, the bags
    std::int64_t rows = 0;  ///< V_local
    std::int64_t hidden = 0;
    DType dtype = DType::kBFloat16;
    bool tf32 = false; ///< the device's context lets fp32 GEMMs use TF32 (SHARDLINE_ALLOW_TF32)
    /// The backward adds into a float16/bfloat16 dweight (accumulate, beta = 1). The count-GEMM is not taken there:
    /// on an H100 (2026-11-26, 830006f) it lost up to 30 ulps against float64 where the previous gradient and the sum
    /// nearly cancel (one bfloat16 element 0 instead of 0.0073), while a float32 main grad or an overwrite stays within
    /// the fp32-sum budget. Suspected cause, not yet confirmed: cuBLASLt split-K reductions in the output type.
    bool half_accumulate = false;
};

/// Why the count-GEMM would not compute the gather's sums exactly, or "" when it would: counts above the dtype's
/// exact integers (T > 256 in bf16, > 2048 in fp16, > 2^24 in fp32), fp32 with TF32 allowed (the table would be
/// rounded to TF32), a dtype CUDA does not take, or a backward accumulating into a half-precision dweight
/// (EmbeddingBagProblem::half_accumulate).
std::string CountGemmIneligibility(const EmbeddingBagProblem& problem);

/// Estimated seconds of each implementation on an H100 (constants in src/kernels/embedding.cc; estimates until
/// measured): gather = T·N·H·elem bytes at the measured 5 TB/s of L2 gather; count-GEMM = 2·N·V_local·H flops at
/// 600 TFLOP/s (bf16/fp16; fp32 50 TFLOP/s) + writing C at 3 TB/s.
struct EmbeddingBagCostEstimate {
    double gather_s = 0.0;
    double count_gemm_s = 0.0;
};
EmbeddingBagCostEstimate EstimateEmbeddingBagCost(const EmbeddingBagProblem& problem);

/// The implementation the CUDA provider runs for `problem` under `choice`: kGemm or kGather, never kAuto. A shard with
/// no rows always gathers (zeros). Under kGemm a problem CountGemmIneligibility refuses throws Error naming `op`, the
/// problem and the reason (no silent fallback). The GEMM's plan is the project's Gemm plan cache: one algorithm per
/// key (shapes, dtypes, beta == 0, pointer alignment classes) per process, tuned at its first call, so the same call
/// gives the same bits every time; across processes the tuning may pick another algorithm unless
/// SHARDLINE_GEMM_TUNING_FILE pins it (or SHARDLINE_GEMM_TUNING=0 takes the heuristic's first pick).
EmbeddingBagImpl ChooseEmbeddingBagImpl(const EmbeddingBagProblem& problem, EmbeddingBagImpl choice,
                                        std::string_view op);

} // namespace shardline::kernels
