#pragma once

// EmbeddingBag's float64 references and their accumulation bound, shared by the device-parameterised suite
// (tests/kernels/kernels_embedding_bag_test.cc) and CUDA's count-GEMM suite
// (tests/cuda/kernels_embedding_bag_count_gemm_test.cc); and a scope that forces one CUDA implementation.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <gtest/gtest.h>

#include <shardline/kernels/embedding.h>

#include "helpers.h"

namespace shardline::testing {

/// A float64 reference and, per element, what bounds the error of summing it in fp32: the number of terms and Σ|term|.
struct BagReference {
    Values value;
    Values terms;
    Values abs_sum;
};

/// The row of global id `id` in the shard [start, start + rows), or -1.
inline std::int64_t LocalRow(double id, std::int64_t start, std::int64_t rows) {
    const auto i = static_cast<std::int64_t>(id);
    return i >= start && i - start < rows ? i - start : -1;
}

/// The bags and the rows of ids [T, ...]: T, and N = the product of the trailing dims.
struct Bags {
    std::int64_t bag;
    std::int64_t count;
};
inline Bags BagsOf(const Shape &ids_shape) {
    std::int64_t count = 1;
    for (std::size_t d = 1; d < ids_shape.size(); ++d) {
        count *= ids_shape[d];
    }
    return {ids_shape.at(0), count};
}

/// ids' shape without the bag dim, + hidden.
inline Shape BagOutShape(const Shape &ids_shape, std::int64_t hidden) {
    Shape out(ids_shape.begin() + 1, ids_shape.end());
    out.push_back(hidden);
    return out;
}

/// out[n, :] = Σ_t table[ids[t·N + n] - start, :] over the ids in the shard.
inline BagReference RefBagForward(const Values &ids, const Shape &ids_shape, const Values &table, std::int64_t rows,
                                  std::int64_t hidden, std::int64_t start) {
    const auto [bag, count] = BagsOf(ids_shape);
    BagReference ref{Values(static_cast<std::size_t>(count * hidden), 0.0), {}, {}};
    ref.terms = ref.abs_sum = ref.value;
    for (std::int64_t t = 0; t < bag; ++t) {
        for (std::int64_t n = 0; n < count; ++n) {
            const std::int64_t r = LocalRow(ids[static_cast<std::size_t>(t * count + n)], start, rows);
            for (std::int64_t h = 0; r >= 0 && h < hidden; ++h) {
                const double x = table[static_cast<std::size_t>(r * hidden + h)];
                const auto o = static_cast<std::size_t>(n * hidden + h);
                ref.value[o] += x;
                ref.terms[o] += 1.0;
                ref.abs_sum[o] += std::abs(x);
            }
        }
    }
    return ref;
}

/// dweight[v, :] = Σ_{(t, n) : ids[t·N + n] - start == v} dout[n, :].
inline BagReference RefBagBackward(const Values &ids, const Shape &ids_shape, const Values &dout, std::int64_t rows,
                                   std::int64_t hidden, std::int64_t start) {
    const auto [bag, count] = BagsOf(ids_shape);
    BagReference ref{Values(static_cast<std::size_t>(rows * hidden), 0.0), {}, {}};
    ref.terms = ref.abs_sum = ref.value;
    for (std::int64_t i = 0; i < bag * count; ++i) {
        const std::int64_t r = LocalRow(ids[static_cast<std::size_t>(i)], start, rows);
        for (std::int64_t h = 0; r >= 0 && h < hidden; ++h) {
            const double x = dout[static_cast<std::size_t>((i % count) * hidden + h)];
            const auto o = static_cast<std::size_t>(r * hidden + h);
            ref.value[o] += x;
            ref.terms[o] += 1.0;
            ref.abs_sum[o] += std::abs(x);
        }
    }
    return ref;
}

/// A gradient accumulated onto `before`: one more term each.
inline void AddPrevious(BagReference &ref, const Values &before) {
    for (std::size_t i = 0; i < before.size(); ++i) {
        ref.value[i] += before[i];
        ref.terms[i] += 1.0;
        ref.abs_sum[i] += std::abs(before[i]);
    }
}

/// What a result may lose: `output_roundings` roundings into its dtype, and `sum_roundings` times the fp32 summation
/// bound (below). The CUDA gather rounds correctly in fp32 (1, 1); cuBLASLt's tensor cores may truncate while
/// accumulating (sum 2), and its beta = 1 half kernels may round the epilogue in the output precision (output 2, as
/// kEpilogueRoundings).
struct BagBudget {
    double output_roundings = 1;
    double sum_roundings = 1;
};

/// |got - want| <= output_roundings·rtol(dtype)·|want| + the fp32 summation's error, which for k terms in any order (a
/// sequence, or partial sums added together) is at most k·2^-24·Σ|term| (rigorous, first order), times
/// sum_roundings. The CPU sums in fp64: its budget is the output rounding alone. Loose for long runs of real values,
/// which is why the long-run cases also run on integers, where every order is exact.
inline ::testing::AssertionResult WithinBound(const Values &got, const BagReference &want, DType dtype,
                                              const Device &device, BagBudget budget = {}) {
    const bool fp32_sums = device.is_cuda();
    const double rtol = RelativeTolerance(dtype) * budget.output_roundings;
    std::size_t bad = 0;
    std::size_t worst = 0;
    double worst_ratio = 0.0;
    if (got.size() != want.value.size()) {
        return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.value.size();
    }
    for (std::size_t i = 0; i < got.size(); ++i) {
        double allowed = rtol * std::abs(want.value[i]) + SubnormalTolerance(dtype) * budget.output_roundings;
        if (fp32_sums) {
            allowed += budget.sum_roundings * want.terms[i] * std::ldexp(1.0, -24) * want.abs_sum[i];
        }
        const double err = std::abs(got[i] - want.value[i]);
        if (!(err <= allowed)) {
            ++bad;
            if (!(err / allowed <= worst_ratio)) {
                worst_ratio = err / allowed;
                worst = i;
            }
        }
    }
    if (bad == 0) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements off; worst at " << worst
                                         << ": got " << got[worst] << ", want " << want.value[worst] << " ("
                                         << worst_ratio << "x the allowed error)";
}

/// Few distinct ids in long runs over [bag, count]: `offset` + 0..3, the first at half the positions (a run of ~131072
/// at 32 x 8192), the next at a quarter, then an eighth each.
inline Values FewDistinctIds(std::int64_t bag, std::int64_t count, std::int64_t offset) {
    Values ids(static_cast<std::size_t>(bag * count));
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto r = static_cast<unsigned>((i * 0x9E3779B97F4A7C15ULL) >> 61); // a fixed scatter: 0..7
        ids[i] = static_cast<double>(offset + (r < 4 ? 0 : r < 6 ? 1 : r < 7 ? 2 : 3));
    }
    return ids;
}

/// Forces one CUDA EmbeddingBag implementation for the scope (kernels::SetEmbeddingBagImpl), then restores the
/// previous one (also when an ASSERT returns early).
class ScopedEmbeddingBagImpl {
public:
    explicit ScopedEmbeddingBagImpl(kernels::EmbeddingBagImpl impl) : saved_(kernels::GetEmbeddingBagImpl()) {
        kernels::SetEmbeddingBagImpl(impl);
    }
    ~ScopedEmbeddingBagImpl() { kernels::SetEmbeddingBagImpl(saved_); }
    ScopedEmbeddingBagImpl(const ScopedEmbeddingBagImpl &) = delete;
    ScopedEmbeddingBagImpl &operator=(const ScopedEmbeddingBagImpl &) = delete;

private:
    kernels::EmbeddingBagImpl saved_;
};

} // namespace shardline::testing
