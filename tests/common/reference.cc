#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include <shardline/kernels/matmul.h>

namespace shardline::testing {

Values RefLinearForward(const Values& x, const Values& w, const Values* b, std::int64_t m, std::int64_t n,
                        std::int64_t k) {
    Values y = RefMatmul(x, w, m, n, k, /*trans_a=*/false, /*trans_b=*/true);
    if (b != nullptr) {
        for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < n; ++j) {
                y[i * n + j] += (*b)[j];
            }
        }
    }
    return y;
}

Values RefLinearBackwardInput(const Values& dy, const Values& w, std::int64_t m, std::int64_t n, std::int64_t k) {
    return RefMatmul(dy, w, m, k, n, /*trans_a=*/false, /*trans_b=*/false);
}

Values RefLinearBackwardWeight(const Values& dy, const Values& x, std::int64_t m, std::int64_t n, std::int64_t k) {
    return RefMatmul(dy, x, n, k, m, /*trans_a=*/true, /*trans_b=*/false);
}

Values RefColumnSum(const Values& dy, std::int64_t m, std::int64_t n) {
    Values db(static_cast<std::size_t>(n), 0.0);
    for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
            db[j] += dy[i * n + j];
        }
    }
    return db;
}

namespace {
/// Row i's max and Σ exp(x - max).
std::pair<double, double> RowMaxAndSumExp(const Values& x, std::int64_t i, std::int64_t c) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < c; ++j) {
        m = std::max(m, x[i * c + j]);
    }
    double s = 0.0;
    for (std::int64_t j = 0; j < c; ++j) {
        s += std::exp(x[i * c + j] - m);
    }
    return {m, s};
}
} // namespace

Values RefCrossEntropyLoss(const Values& x, const Values& labels, std::int64_t n, std::int64_t c) {
    Values loss(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
        const auto [m, s] = RowMaxAndSumExp(x, i, c);
        const auto t = static_cast<std::int64_t>(labels[i]);
        loss[i] = std::log(s) + m - (t >= 0 && t < c ? x[i * c + t] : 0.0);
    }
    return loss;
}

Values RefCrossEntropyGrad(const Values& x, const Values& labels, const Values& dloss, double scale, std::int64_t n,
                           std::int64_t c) {
    Values dx(x.size());
    for (std::int64_t i = 0; i < n; ++i) {
        const auto [m, s] = RowMaxAndSumExp(x, i, c);
        const double g = scale * dloss[dloss.size() == 1 ? 0 : i];
        const auto t = static_cast<std::int64_t>(labels[i]);
        for (std::int64_t j = 0; j < c; ++j) {
            dx[i * c + j] = g * (std::exp(x[i * c + j] - m) / s - (j == t ? 1.0 : 0.0));
        }
    }
    return dx;
}

Values RefMatmul(const Values& a, const Values& b, std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a,
                 bool trans_b) {
    Values c(static_cast<std::size_t>(m * n), 0.0);
    for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
            double acc = 0.0;
            for (std::int64_t p = 0; p < k; ++p) {
                const double av = trans_a ? a[p * m + i] : a[i * k + p];
                const double bv = trans_b ? b[j * k + p] : b[p * n + j];
                acc += av * bv;
            }
            c[i * n + j] = acc;
        }
    }
    return c;
}

Values RefBatchedMatmul(const Values& a, const Shape& a_shape, const Values& b, const Shape& b_shape, bool trans_a,
                        bool trans_b, Shape* out_shape) {
    const Shape out =
        kernels::MatmulOutputShape(a_shape, b_shape, {.trans_a = trans_a, .trans_b = trans_b}, "RefBatchedMatmul");
    const std::int64_t m = out[out.size() - 2];
    const std::int64_t n = out.back();
    const std::int64_t k = trans_a ? a_shape[a_shape.size() - 2] : a_shape.back();
    const Shape batch(out.begin(), out.end() - 2);
    const std::int64_t batch_count = Numel(batch);
    auto offset = [&](std::int64_t flat, const Shape& own_shape) {
        const Shape own(own_shape.begin(), own_shape.end() - 2);
        const std::int64_t elems = own_shape[own_shape.size() - 2] * own_shape.back();
        std::int64_t off = 0;
        std::int64_t stride = elems;
        const std::size_t pad = batch.size() - own.size();
        for (std::size_t i = batch.size(); i-- > 0;) {
            const std::int64_t idx = flat % batch[i];
            flat /= batch[i];
            if (i >= pad) {
                if (own[i - pad] != 1) {
                    off += idx * stride;
                }
                stride *= own[i - pad];
            }
        }
        return off;
    };
    Values c;
    c.reserve(static_cast<std::size_t>(batch_count * m * n));
    const std::int64_t a_elems = m * k;
    const std::int64_t b_elems = k * n;
    for (std::int64_t bi = 0; bi < batch_count; ++bi) {
        const Values as(a.begin() + offset(bi, a_shape), a.begin() + offset(bi, a_shape) + a_elems);
        const Values bs(b.begin() + offset(bi, b_shape), b.begin() + offset(bi, b_shape) + b_elems);
        const Values cs = RefMatmul(as, bs, m, n, k, trans_a, trans_b);
        c.insert(c.end(), cs.begin(), cs.end());
    }
    if (out_shape != nullptr) {
        *out_shape = out;
    }
    return c;
}

namespace {
constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCoeff = 0.044715;
} // namespace

double RefGeluTanh(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x))); }
double RefGeluErf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double RefGeluTanhGrad(double x) {
    const double u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
    const double t = std::tanh(u);
    const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}
double RefGeluErfGrad(double x) {
    constexpr double kInvSqrt2Pi = 0.3989422804014327;
    return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

RefMlpResult RefMlp(const Values& x, const Values& w1, const Values* b1, const Values& w2, const Values* b2,
                    const Values& dy, std::int64_t m, std::int64_t hidden, std::int64_t ffn, bool gelu) {
    const Values h = RefLinearForward(x, w1, b1, m, ffn, hidden);
    Values a = h;
    Values dh = RefLinearBackwardInput(dy, w2, m, hidden, ffn);
    if (gelu) {
        for (std::size_t i = 0; i < h.size(); ++i) {
            a[i] = RefGeluTanh(h[i]);
            dh[i] *= RefGeluTanhGrad(h[i]);
        }
    }
    return {.y = RefLinearForward(a, w2, b2, m, hidden, ffn),
            .dx = RefLinearBackwardInput(dh, w1, m, ffn, hidden),
            .dw1 = RefLinearBackwardWeight(dh, x, m, ffn, hidden),
            .db1 = RefColumnSum(dh, m, ffn),
            .dw2 = RefLinearBackwardWeight(dy, a, m, hidden, ffn),
            .db2 = RefColumnSum(dy, m, hidden)};
}

Tensor RandomTensor(const Shape& shape, DType dtype, Device device, std::uint64_t seed, std::string_view name,
                    RandomDistribution distribution, double a, double b) {
    Tensor t = Tensor::Empty(shape, dtype, device);
    FillRandom(t, RandomSpec{.seed = seed, .name = name, .distribution = distribution, .a = a, .b = b});
    return t;
}

double RelativeTolerance(DType dtype) {
    switch (dtype) {
    case DType::kFloat64:
        return 1e-12;
    case DType::kFloat32:
        return 1e-5;
    case DType::kFloat16:
        return 1e-3;
    case DType::kBFloat16:
        return 1.6e-2;
    case DType::kInt64:
        return 0.0; // ids and labels are compared exactly
    }
    return 0.0;
}

double SubnormalTolerance(DType dtype) { return dtype == DType::kFloat16 ? std::ldexp(1.0, -25) : 0.0; }

std::string CompareValues(const Values& actual, const Values& expected, double rtol, double atol) {
    if (actual.size() != expected.size()) {
        return fmt::format("size mismatch: actual {} vs expected {}", actual.size(), expected.size());
    }
    double sq = 0.0;
    for (double e : expected) {
        sq += e * e;
    }
    const double rms = expected.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(expected.size()));
    std::size_t bad = 0;
    std::size_t worst = 0;
    double worst_ratio = 0.0;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        const double scale = std::max(std::abs(expected[i]), rms);
        const double allowed = atol + rtol * scale;
        const double err = std::abs(actual[i] - expected[i]);
        if (!(err <= allowed)) { // NaN fails
            ++bad;
            const double ratio = allowed > 0 ? err / allowed : INFINITY;
            if (!(ratio <= worst_ratio)) {
                worst_ratio = ratio;
                worst = i;
            }
        }
    }
    if (bad == 0) {
        return {};
    }
    return fmt::format("{} of {} elements off (rtol {}, atol {}); worst at {}: actual {} expected {} ({}x the "
                       "allowed error)",
                       bad, actual.size(), rtol, atol, worst, actual[worst], expected[worst], worst_ratio);
}

double MeanAbsError(const Values& actual, const Values& expected) {
    double sum = 0.0;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        sum += std::abs(actual[i] - expected[i]);
    }
    return actual.empty() ? 0.0 : sum / static_cast<double>(actual.size());
}

} // namespace shardline::testing
