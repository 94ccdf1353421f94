#pragma once

// Softmax cross-entropy in stages, so that the vocab-parallel form (Megatron's VocabParallelCrossEntropy) can reduce
// over the tensor-parallel group between them. With the classes split over ranks, rank r holding logits[:, C_r] with
// global classes [class_start_r, class_start_r + C_local_r):
//
//     CrossEntropyRowMax(logits_r)                  -> row_max_r      all-reduce max  -> row_max
//     CrossEntropyStats(logits_r, row_max, labels)  -> sum_exp_r, target_logit_r
//                                                                     all-reduce sum  -> sum_exp, target_logit
//     CrossEntropyLoss(row_max, sum_exp, target_logit)               -> loss (identical on every rank)
//     CrossEntropyBackward(logits_r, row_max, sum_exp, labels, dloss) -> dlogits_r (no communication)
//
// On one rank (class_start = 0, C_local = C) the same calls give the plain loss. logits are [..., C_local]; their
// leading dims are N = numel(labels) rows. labels are int64 global class ids; a label outside this shard's range simply
// does not hit it (target_logit 0, no one-hot term): checking labels against the global class count is the caller's
// job. The statistics (row_max, sum_exp, target_logit, loss) have N elements (any shape) and are float32, or float64
// when the logits are float64. CPU: float32/float64 logits; CUDA: float32/float16/bfloat16 logits, fp32 math.

#include <cstdint>
#include <string_view>

#include <shardline/core/tensor.h>

namespace shardline::kernels {

struct CrossEntropyRowMaxArgs {
    const Tensor& logits; ///< [..., C_local]
    Tensor& row_max;      ///< N elements, float32 (float64 for float64 logits)
};
struct CrossEntropyRowMaxOp {
    static constexpr std::string_view kName = "CrossEntropyRowMax";
    using Fn = void (*)(const CrossEntropyRowMaxArgs&);
};
/// row_max[i] = max_c logits[i, c] (-inf when C_local == 0).
void CrossEntropyRowMax(const CrossEntropyRowMaxArgs& args);

struct CrossEntropyStatsArgs {
    const Tensor& logits;         ///< [..., C_local]
    const Tensor& row_max;        ///< N: the global max (after the all-reduce)
    const Tensor& labels;         ///< N int64 global class ids
    std::int64_t class_start = 0; ///< global class of logits' first column
    Tensor& sum_exp;              ///< N: Σ_c exp(logits[i, c] - row_max[i])
    Tensor& target_logit;         ///< N: logits[i, labels[i] - class_start] if in the local range, else 0
};
struct CrossEntropyStatsOp {
    static constexpr std::string_view kName = "CrossEntropyStats";
    using Fn = void (*)(const CrossEntropyStatsArgs&);
};
/// sum_exp[i] = Σ_c exp(logits[i, c] - row_max[i]); target_logit[i] = logits[i, labels[i] - class_start] when
/// class_start <= labels[i] < class_start + C_local, else 0.
void CrossEntropyStats(const CrossEntropyStatsArgs& args);

struct CrossEntropyLossArgs {
    const Tensor& row_max;
    const Tensor& sum_exp;
    const Tensor& target_logit;
    Tensor& loss; ///< N (may alias any input)
};
struct CrossEntropyLossOp {
    static constexpr std::string_view kName = "CrossEntropyLoss";
    using Fn = void (*)(const CrossEntropyLossArgs&);
};
/// loss[i] = log(sum_exp[i]) + row_max[i] - target_logit[i].
void CrossEntropyLoss(const CrossEntropyLossArgs& args);

struct CrossEntropyBackwardArgs {
    const Tensor& logits;  ///< [..., C_local]
    const Tensor& row_max; ///< N, global
    const Tensor& sum_exp; ///< N, global
    const Tensor& labels;  ///< N int64
    std::int64_t class_start = 0;
    const Tensor& dloss; ///< N elements, or 1 broadcast to every row; float32 (CPU: float32 or float64)
    double scale = 1.0;  ///< e.g. 1/N for a mean reduction with a scalar dloss
    Tensor& dlogits;     ///< logits' shape and dtype, overwritten (may alias logits)
};
struct CrossEntropyBackwardOp {
    static constexpr std::string_view kName = "CrossEntropyBackward";
    using Fn = void (*)(const CrossEntropyBackwardArgs&);
};
/// dlogits[i, c] = scale·dloss[i]·(exp(logits[i, c] - row_max[i]) / sum_exp[i] - [c == labels[i] - class_start]).
void CrossEntropyBackward(const CrossEntropyBackwardArgs& args);

} // namespace shardline::kernels
