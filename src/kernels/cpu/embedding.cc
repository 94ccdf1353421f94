// CPU embedding lookup, bag sum and weight gradients, float32 and float64. Rows are copied as they are (the output has
// the table's dtype); the bag sums and the gradients sum in fp64, in increasing t / position order, and round once.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::cpu {
namespace {

/// ids[i] - vocab_start when the id falls in [vocab_start, vocab_start + rows), else -1. Compares before subtracting:
/// ids are arbitrary int64 values and vocab_start >= 0, so id - vocab_start could overflow for very negative ids.
std::int64_t LocalRow(std::int64_t id, std::int64_t vocab_start, std::int64_t rows) {
    return id >= vocab_start && id - vocab_start < rows ? id - vocab_start : -1;
}

/// The weight gradient of both lookups: position i of ids reads dout row i mod dout_rows (EmbeddingBackward: i itself;
/// EmbeddingBagBackward of ids [T, N]: n for position t·N + n).
struct RowSums {
    const Tensor &ids;
    const Tensor &dout;
    std::int64_t dout_rows;
    Tensor &dweight;
    std::int64_t vocab_start;
    bool accumulate;
};

template <class In, class Out> void AccumulateRows(const RowSums &args) {
    const std::int64_t rows = args.dweight.size(0);
    const std::int64_t hidden = args.dweight.size(1);
    const std::int64_t n = args.ids.numel();
    const auto *ids = static_cast<const std::int64_t *>(args.ids.data());
    const In *dout = static_cast<const In *>(args.dout.data());
    Out *dw = static_cast<Out *>(args.dweight.data());
    std::vector<double> acc(static_cast<std::size_t>(rows * hidden), 0.0);
    std::vector<bool> hit(static_cast<std::size_t>(rows), false);
    for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t r = LocalRow(ids[i], args.vocab_start, rows);
        if (r < 0) {
            continue;
        }
        hit[static_cast<std::size_t>(r)] = true;
        double *dst = acc.data() + r * hidden;
        const In *src = dout + (i % args.dout_rows) * hidden;
        for (std::int64_t h = 0; h < hidden; ++h) {
            dst[h] += static_cast<double>(src[h]);
        }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
        Out *dst = dw + r * hidden;
        if (!hit[static_cast<std::size_t>(r)]) {
            if (!args.accumulate) {
                std::fill(dst, dst + hidden, Out{0});
            }
            continue;
        }
        const double *src = acc.data() + r * hidden;
        for (std::int64_t h = 0; h < hidden; ++h) {
            dst[h] = static_cast<Out>(args.accumulate ? static_cast<double>(dst[h]) + src[h] : src[h]);
        }
    }
}

void RunRowSums(const RowSums &args) {
    // The wrappers admit dout float32/float64 and dweight of dout's dtype, or float32 with accumulate.
    const bool in64 = args.dout.dtype() == DType::kFloat64;
    const bool out64 = args.dweight.dtype() == DType::kFloat64;
    if (in64 && out64) {
        AccumulateRows<double, double>(args);
    } else if (in64) {
        AccumulateRows<double, float>(args);
    } else {
        AccumulateRows<float, float>(args);
    }
}

template <class T> void SumBags(const EmbeddingBagForwardArgs &args) {
    const std::int64_t rows = args.weight.size(0);
    const std::int64_t hidden = args.weight.size(1);
    const std::int64_t bag = args.ids.size(0);
    const std::int64_t count = args.out.numel() / hidden; // the wrapper guarantees hidden > 0
    const auto *ids = static_cast<const std::int64_t *>(args.ids.data());
    const T *w = static_cast<const T *>(args.weight.data());
    T *out = static_cast<T *>(args.out.data());
    std::vector<double> acc(static_cast<std::size_t>(hidden));
    for (std::int64_t n = 0; n < count; ++n) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t t = 0; t < bag; ++t) {
            const std::int64_t r = LocalRow(ids[t * count + n], args.vocab_start, rows);
            if (r < 0) {
                continue;
            }
            const T *src = w + r * hidden;
            for (std::int64_t h = 0; h < hidden; ++h) {
                acc[static_cast<std::size_t>(h)] += static_cast<double>(src[h]);
            }
        }
        T *dst = out + n * hidden;
        for (std::int64_t h = 0; h < hidden; ++h) {
            dst[h] = static_cast<T>(acc[static_cast<std::size_t>(h)]);
        }
    }
}

} // namespace

void EmbeddingForward(const EmbeddingForwardArgs &args) {
    const std::int64_t rows = args.weight.size(0);
    const std::int64_t hidden = args.weight.size(1);
    const std::int64_t n = args.ids.numel();
    const std::size_t row_bytes = static_cast<std::size_t>(hidden) * ElementSize(args.weight.dtype());
    const auto *ids = static_cast<const std::int64_t *>(args.ids.data());
    const char *w = static_cast<const char *>(args.weight.data());
    char *out = static_cast<char *>(args.out.data());
    for (std::int64_t i = 0; i < n; ++i) {
        char *dst = out + static_cast<std::size_t>(i) * row_bytes;
        const std::int64_t r = LocalRow(ids[i], args.vocab_start, rows);
        if (r < 0) {
            std::memset(dst, 0, row_bytes); // all-zero bits are 0.0 in float32 and float64
        } else {
            std::memcpy(dst, w + static_cast<std::size_t>(r) * row_bytes, row_bytes);
        }
    }
}

void EmbeddingBackward(const EmbeddingBackwardArgs &args) {
    RunRowSums({.ids = args.ids,
                .dout = args.dout,
                .dout_rows = args.ids.numel(),
                .dweight = args.dweight,
                .vocab_start = args.vocab_start,
                .accumulate = args.accumulate});
}

void EmbeddingBagForward(const EmbeddingBagForwardArgs &args) {
    // The wrapper admits a float32/float64 table and settles out.numel() == 0.
    if (args.weight.dtype() == DType::kFloat64) {
        SumBags<double>(args);
    } else {
        SumBags<float>(args);
    }
}

void EmbeddingBagBackward(const EmbeddingBagBackwardArgs &args) {
    // The wrapper settles T = 0 and N = 0 (no ids): every bag here is non-empty.
    RunRowSums({.ids = args.ids,
                .dout = args.dout,
                .dout_rows = args.ids.numel() / args.ids.size(0),
                .dweight = args.dweight,
                .vocab_start = args.vocab_start,
                .accumulate = args.accumulate});
}

} // namespace shardline::kernels::cpu
