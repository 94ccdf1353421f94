// CPU cross-entropy stages. Logits float32 or float64; statistics float32 (float64 for float64 logits). All math in
// fp64, one rounding to each output. The wrappers have settled N == 0 and C_local == 0.

#include <cmath>
#include <cstdint>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::cpu {
namespace {

/// Calls f.template operator()<T, S>() with T the logits' C++ type and S the statistics' (float for float32 logits).
template <class F> void WithLogitTypes(DType logits, F &&f) {
    if (logits == DType::kFloat64) {
        f.template operator()<double, double>();
    } else {
        f.template operator()<float, float>();
    }
}

struct RowsOf {
    std::int64_t n;
    std::int64_t c;
};
RowsOf Rows(const Tensor &logits) {
    const std::int64_t c = logits.shape().back();
    return RowsOf{logits.numel() / c, c};
}

/// The column of global class `label` in a shard starting at class_start with c classes, or -1.
std::int64_t LocalClass(std::int64_t label, std::int64_t class_start, std::int64_t c) {
    return label >= class_start && label - class_start < c ? label - class_start : -1;
}

} // namespace

void CrossEntropyRowMax(const CrossEntropyRowMaxArgs &args) {
    const auto [n, c] = Rows(args.logits);
    WithLogitTypes(args.logits.dtype(), [&]<class T, class S>() {
        const T *x = static_cast<const T *>(args.logits.data());
        S *out = static_cast<S *>(args.row_max.data());
        for (std::int64_t i = 0; i < n; ++i) {
            const T *row = x + i * c;
            double m = static_cast<double>(row[0]);
            for (std::int64_t j = 1; j < c; ++j) {
                const double v = static_cast<double>(row[j]);
                m = (v > m || std::isnan(v)) ? v : m; // a NaN logit makes the row NaN, as torch's max
            }
            out[i] = static_cast<S>(m);
        }
    });
}

void CrossEntropyStats(const CrossEntropyStatsArgs &args) {
    const auto [n, c] = Rows(args.logits);
    const auto *labels = static_cast<const std::int64_t *>(args.labels.data());
    WithLogitTypes(args.logits.dtype(), [&]<class T, class S>() {
        const T *x = static_cast<const T *>(args.logits.data());
        const S *row_max = static_cast<const S *>(args.row_max.data());
        S *sum_exp = static_cast<S *>(args.sum_exp.data());
        S *target = static_cast<S *>(args.target_logit.data());
        for (std::int64_t i = 0; i < n; ++i) {
            const T *row = x + i * c;
            const double m = static_cast<double>(row_max[i]);
            double s = 0.0;
            for (std::int64_t j = 0; j < c; ++j) {
                s += std::exp(static_cast<double>(row[j]) - m);
            }
            const std::int64_t t = LocalClass(labels[i], args.class_start, c);
            sum_exp[i] = static_cast<S>(s);
            target[i] = t < 0 ? S{0} : static_cast<S>(row[t]);
        }
    });
}

void CrossEntropyLoss(const CrossEntropyLossArgs &args) {
    const std::int64_t n = args.row_max.numel();
    WithLogitTypes(args.row_max.dtype(), [&]<class T, class S>() {
        const S *row_max = static_cast<const S *>(args.row_max.data());
        const S *sum_exp = static_cast<const S *>(args.sum_exp.data());
        const S *target = static_cast<const S *>(args.target_logit.data());
        S *loss = static_cast<S *>(args.loss.data());
        for (std::int64_t i = 0; i < n; ++i) {
            loss[i] = static_cast<S>(std::log(static_cast<double>(sum_exp[i])) + static_cast<double>(row_max[i]) -
                                     static_cast<double>(target[i]));
        }
    });
}

void CrossEntropyBackward(const CrossEntropyBackwardArgs &args) {
    const auto [n, c] = Rows(args.logits);
    const auto *labels = static_cast<const std::int64_t *>(args.labels.data());
    const bool dloss64 = args.dloss.dtype() == DType::kFloat64;
    const bool broadcast = args.dloss.numel() == 1;
    auto dloss_at = [&](std::int64_t i) {
        const std::int64_t k = broadcast ? 0 : i;
        return dloss64 ? static_cast<const double *>(args.dloss.data())[k]
                       : static_cast<double>(static_cast<const float *>(args.dloss.data())[k]);
    };
    WithLogitTypes(args.logits.dtype(), [&]<class T, class S>() {
        const T *x = static_cast<const T *>(args.logits.data());
        const S *row_max = static_cast<const S *>(args.row_max.data());
        const S *sum_exp = static_cast<const S *>(args.sum_exp.data());
        T *dx = static_cast<T *>(args.dlogits.data()); // may alias x: each element is read before it is written
        for (std::int64_t i = 0; i < n; ++i) {
            const double m = static_cast<double>(row_max[i]);
            const double inv_sum = 1.0 / static_cast<double>(sum_exp[i]);
            const double g = args.scale * dloss_at(i);
            const std::int64_t t = LocalClass(labels[i], args.class_start, c);
            for (std::int64_t j = 0; j < c; ++j) {
                const double p = std::exp(static_cast<double>(x[i * c + j]) - m) * inv_sum;
                dx[i * c + j] = static_cast<T>(g * (j == t ? p - 1.0 : p));
            }
        }
    });
}

} // namespace shardline::kernels::cpu
