// Cross-entropy stages: argument checks and dispatch. The kernels live in cpu/ and cuda/; the degenerate shapes
// (no rows, no local classes) are settled here so that the kernels see N > 0 and C_local > 0.

#include <limits>

#include <shardline/kernels/cross_entropy.h>
#include <shardline/kernels/dispatcher.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

/// logits [..., C_local] as N rows of C_local classes.
struct Rows {
    std::int64_t n = 0;
    std::int64_t c = 0;
};

Rows CheckLogits(const Tensor& logits, std::string_view op) {
    CheckTensor(logits, op, "logits");
    CheckDeviceDType(logits, op, "logits");
    SHARDLINE_CHECK_AS(ShapeError, logits.rank() >= 1, op, "logits must be [..., C_local] (rank >= 1), got {}",
                       logits.ToString());
    const Shape& shape = logits.shape();
    return Rows{.n = Numel(Shape(shape.begin(), shape.end() - 1)), .c = shape.back()};
}

/// The statistics are float32, float64 for float64 logits.
DType StatsDType(const Tensor& logits) { return logits.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

/// One statistic: N elements (any shape) of `dtype`, on `like`'s device.
void CheckStat(const Tensor& t, std::string_view name, std::int64_t n, DType dtype, const Tensor& like,
               std::string_view like_name, std::string_view op) {
    CheckTensor(t, op, name);
    CheckSameDevice(t, name, like, like_name, op);
    SHARDLINE_CHECK_AS(DTypeError, t.dtype() == dtype, op, "{} must be {} (the statistics' dtype for {} {}), got {}",
                       name, DTypeName(dtype), like_name, like.ToString(), t.ToString());
    SHARDLINE_CHECK_AS(ShapeError, t.numel() == n, op, "{} must have N = {} elements (one per row of {} {}), got {}",
                       name, n, like_name, like.ToString(), t.ToString());
}

/// logits, then the statistics of its rows that every pass after the row max reads or writes: row_max and sum_exp.
Rows CheckLogitsAndStats(const Tensor& logits, const Tensor& row_max, const Tensor& sum_exp, std::string_view op) {
    const Rows rows = CheckLogits(logits, op);
    const DType stats = StatsDType(logits);
    CheckStat(row_max, "row_max", rows.n, stats, logits, "logits", op);
    CheckStat(sum_exp, "sum_exp", rows.n, stats, logits, "logits", op);
    return rows;
}

void CheckLabels(const Tensor& labels, std::int64_t n, const Tensor& logits, std::string_view op) {
    CheckTensor(labels, op, "labels");
    CheckIndexDType(labels, op, "labels");
    CheckSameDevice(labels, "labels", logits, "logits", op);
    SHARDLINE_CHECK_AS(ShapeError, labels.numel() == n, op,
                       "labels must have N = {} elements (one per row of logits {}), got {}", n, logits.ToString(),
                       labels.ToString());
}

} // namespace

void CrossEntropyRowMax(const CrossEntropyRowMaxArgs& args) {
    constexpr std::string_view kOp = CrossEntropyRowMaxOp::kName;
    const Rows rows = CheckLogits(args.logits, kOp);
    CheckStat(args.row_max, "row_max", rows.n, StatsDType(args.logits), args.logits, "logits", kOp);
    if (rows.n == 0) {
        return;
    }
    if (rows.c == 0) { // a shard without classes: the identity of max
        args.row_max.Fill(-std::numeric_limits<double>::infinity());
        return;
    }
    Dispatch<CrossEntropyRowMaxOp>(args.logits.device().type, args);
}

void CrossEntropyStats(const CrossEntropyStatsArgs& args) {
    constexpr std::string_view kOp = CrossEntropyStatsOp::kName;
    const Rows rows = CheckLogitsAndStats(args.logits, args.row_max, args.sum_exp, kOp);
    CheckStat(args.target_logit, "target_logit", rows.n, StatsDType(args.logits), args.logits, "logits", kOp);
    CheckLabels(args.labels, rows.n, args.logits, kOp);
    if (rows.n == 0) {
        return;
    }
    if (rows.c == 0) { // empty sums; no label can hit an empty shard
        args.sum_exp.Fill(0.0);
        args.target_logit.Fill(0.0);
        return;
    }
    Dispatch<CrossEntropyStatsOp>(args.logits.device().type, args);
}

void CrossEntropyLoss(const CrossEntropyLossArgs& args) {
    constexpr std::string_view kOp = CrossEntropyLossOp::kName;
    CheckTensor(args.row_max, kOp, "row_max");
    const DType dtype = args.row_max.dtype();
    if (args.row_max.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, dtype == DType::kFloat32 || dtype == DType::kFloat64, kOp,
                           "the statistics must be float32 or float64 on the CPU, got row_max {}",
                           args.row_max.ToString());
    } else {
        SHARDLINE_CHECK_AS(DTypeError, dtype == DType::kFloat32, kOp,
                           "the statistics must be float32 on CUDA, got row_max {}", args.row_max.ToString());
    }
    const std::int64_t n = args.row_max.numel();
    CheckStat(args.sum_exp, "sum_exp", n, dtype, args.row_max, "row_max", kOp);
    CheckStat(args.target_logit, "target_logit", n, dtype, args.row_max, "row_max", kOp);
    CheckStat(args.loss, "loss", n, dtype, args.row_max, "row_max", kOp);
    if (n > 0) {
        Dispatch<CrossEntropyLossOp>(args.row_max.device().type, args);
    }
}

void CrossEntropyBackward(const CrossEntropyBackwardArgs& args) {
    constexpr std::string_view kOp = CrossEntropyBackwardOp::kName;
    const Rows rows = CheckLogitsAndStats(args.logits, args.row_max, args.sum_exp, kOp);
    CheckLabels(args.labels, rows.n, args.logits, kOp);
    CheckTensor(args.dloss, kOp, "dloss");
    CheckSameDevice(args.dloss, "dloss", args.logits, "logits", kOp);
    if (args.dloss.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, args.dloss.dtype() == DType::kFloat32 || args.dloss.dtype() == DType::kFloat64,
                           kOp, "dloss must be float32 or float64 on the CPU, got {}", args.dloss.ToString());
    } else {
        SHARDLINE_CHECK_AS(DTypeError, args.dloss.dtype() == DType::kFloat32, kOp,
                           "dloss must be float32 on CUDA, got {}", args.dloss.ToString());
    }
    SHARDLINE_CHECK_AS(ShapeError, args.dloss.numel() == rows.n || args.dloss.numel() == 1, kOp,
                       "dloss must have N = {} elements (one per row of logits {}) or 1 (broadcast), got {}", rows.n,
                       args.logits.ToString(), args.dloss.ToString());
    CheckTensor(args.dlogits, kOp, "dlogits");
    CheckSameDevice(args.dlogits, "dlogits", args.logits, "logits", kOp);
    SHARDLINE_CHECK_AS(DTypeError, args.dlogits.dtype() == args.logits.dtype(), kOp,
                       "dlogits must have logits' dtype {}, got {}", DTypeName(args.logits.dtype()),
                       args.dlogits.ToString());
    CheckShape(args.dlogits, args.logits.shape(), kOp, "dlogits");
    if (rows.n > 0 && rows.c > 0) {
        Dispatch<CrossEntropyBackwardOp>(args.logits.device().type, args);
    }
}

} // namespace shardline::kernels
