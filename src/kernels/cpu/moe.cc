// CPU mixture-of-experts kernels: router forward/backward, the permutation map, the gather, the combine and the
// combine's weight gradient. All math in fp64, one rounding to each output; every sum runs in a fixed order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::cpu {
namespace {

/// Sigmoid's renormalisation guard (Megatron's 1e-20).
constexpr double kSigmoidEps = 1e-20;

/// Calls f.template operator()<T>() with T float for float32 and double for float64.
template <class F> void WithFloat(DType dtype, F&& f) {
    if (dtype == DType::kFloat64) {
        f.template operator()<double>();
    } else {
        f.template operator()<float>();
    }
}

/// Calls f.template operator()<T, W>() for rows of dtype T and per-copy weights of dtype W (float32 or T's).
template <class F> void WithRowAndWeightTypes(DType rows, DType weights, F&& f) {
    if (rows == DType::kFloat64 && weights == DType::kFloat64) {
        f.template operator()<double, double>();
    } else if (rows == DType::kFloat64) {
        f.template operator()<double, float>();
    } else {
        f.template operator()<float, float>();
    }
}

/// One router row in fp64: the logits, the scores s, the normalised scores p of the aux loss, the max and logsumexp.
struct RouterRow {
    std::vector<double> logits, s, p;
    double lse = 0.0;
    double s_sum = 0.0; ///< Σ_e s (sigmoid's p denominator, without the guard)

    template <class T> void Load(const T* row, std::int64_t experts, MoEScoreFunction fn) {
        logits.assign(row, row + experts);
        s.resize(static_cast<std::size_t>(experts));
        p.resize(static_cast<std::size_t>(experts));
        double m = logits[0];
        for (double v : logits) {
            m = v > m ? v : m;
        }
        double sum_exp = 0.0;
        for (double v : logits) {
            sum_exp += std::exp(v - m);
        }
        lse = m + std::log(sum_exp);
        s_sum = 0.0;
        for (std::size_t e = 0; e < logits.size(); ++e) {
            const double softmax = std::exp(logits[e] - m) / sum_exp;
            s[e] = fn == MoEScoreFunction::kSoftmax ? softmax : 1.0 / (1.0 + std::exp(-logits[e]));
            s_sum += s[e];
        }
        for (std::size_t e = 0; e < logits.size(); ++e) {
            p[e] = fn == MoEScoreFunction::kSoftmax ? s[e] : s[e] / (s_sum + kSigmoidEps);
        }
    }
};

/// The topk experts of the largest logits, descending; on equal logits the lower id first.
void TopK(const std::vector<double>& logits, int topk, std::int64_t* out) {
    const auto experts = static_cast<std::int64_t>(logits.size());
    std::vector<bool> taken(logits.size(), false);
    for (int j = 0; j < topk; ++j) {
        std::int64_t best = -1;
        for (std::int64_t e = 0; e < experts; ++e) {
            if (!taken[static_cast<std::size_t>(e)] &&
                (best < 0 || logits[static_cast<std::size_t>(e)] > logits[static_cast<std::size_t>(best)])) {
                best = e;
            }
        }
        taken[static_cast<std::size_t>(best)] = true;
        out[j] = best;
    }
}

} // namespace

void MoERouterForward(const MoERouterForwardArgs& args) {
    const MoERouterConfig& c = args.config;
    const std::int64_t tokens = args.logits.size(0);
    const std::int64_t experts = c.num_experts;
    const int k = c.topk;
    const bool normalize = NormalizesTopk(c);
    auto* idx = args.indices.data_as<std::int64_t>();
    auto* counts = args.tokens_per_expert.data_as<std::int64_t>();
    std::fill(counts, counts + experts, std::int64_t{0});
    WithFloat(args.logits.dtype(), [&]<class T>() {
        const T* logits = static_cast<const T*>(args.logits.data());
        T* w = static_cast<T*>(args.weights.data());
        std::vector<double> p_sum(static_cast<std::size_t>(experts), 0.0);
        double lse_sq_sum = 0.0;
        RouterRow row;
        for (std::int64_t t = 0; t < tokens; ++t) {
            row.Load(logits + t * experts, experts, c.score_function);
            std::int64_t* ti = idx + t * k;
            TopK(row.logits, k, ti);
            double chosen = 0.0;
            for (int j = 0; j < k; ++j) {
                chosen += row.s[static_cast<std::size_t>(ti[j])];
                ++counts[ti[j]];
            }
            if (c.score_function == MoEScoreFunction::kSigmoid) {
                chosen += kSigmoidEps;
            }
            for (int j = 0; j < k; ++j) {
                const double s = row.s[static_cast<std::size_t>(ti[j])];
                w[t * k + j] = static_cast<T>(normalize ? s / chosen : s);
            }
            for (std::int64_t e = 0; e < experts; ++e) {
                p_sum[static_cast<std::size_t>(e)] += row.p[static_cast<std::size_t>(e)];
            }
            lse_sq_sum += row.lse * row.lse;
        }
        if (args.aux_loss != nullptr) {
            double aux = 0.0;
            if (tokens > 0) {
                for (std::int64_t e = 0; e < experts; ++e) {
                    aux += p_sum[static_cast<std::size_t>(e)] * static_cast<double>(counts[e]);
                }
                const auto td = static_cast<double>(tokens);
                aux *= c.aux_loss_coeff * static_cast<double>(experts) / (td * td * k);
            }
            *static_cast<T*>(args.aux_loss->data()) = static_cast<T>(aux);
        }
        if (args.z_loss != nullptr) {
            const double z = tokens > 0 ? c.z_loss_coeff * lse_sq_sum / static_cast<double>(tokens) : 0.0;
            *static_cast<T*>(args.z_loss->data()) = static_cast<T>(z);
        }
    });
}

void MoERouterBackward(const MoERouterBackwardArgs& args) {
    const MoERouterConfig& c = args.config;
    const std::int64_t tokens = args.logits.size(0);
    const std::int64_t experts = c.num_experts;
    const int k = c.topk;
    const bool normalize = NormalizesTopk(c);
    const bool sigmoid = c.score_function == MoEScoreFunction::kSigmoid;
    const auto* idx = args.indices.data_as<std::int64_t>();
    const auto* counts = args.tokens_per_expert.data_as<std::int64_t>();
    WithFloat(args.logits.dtype(), [&]<class T>() {
        const T* logits = static_cast<const T*>(args.logits.data());
        const T* dw = args.dweights != nullptr ? static_cast<const T*>(args.dweights->data()) : nullptr;
        const auto td = static_cast<double>(tokens);
        // d aux / d p[t, e] = coeff·E·count_e / (T²·topk), the same for every row.
        const double aux_scale = args.daux_loss != nullptr
                                     ? static_cast<double>(*static_cast<const T*>(args.daux_loss->data())) *
                                           c.aux_loss_coeff * static_cast<double>(experts) / (td * td * k)
                                     : 0.0;
        // d z / d lse_t = coeff·2·lse_t / T.
        const double z_scale =
            args.dz_loss != nullptr
                ? static_cast<double>(*static_cast<const T*>(args.dz_loss->data())) * c.z_loss_coeff * 2.0 / td
                : 0.0;
        T* dl = static_cast<T*>(args.dlogits.data());
        RouterRow row;
        // g: the gradient w.r.t. the scores (then back through softmax/sigmoid); direct: w.r.t. the logits.
        std::vector<double> g(static_cast<std::size_t>(experts));
        std::vector<double> direct(static_cast<std::size_t>(experts));
        const bool direct_softmax = normalize && !sigmoid;
        for (std::int64_t t = 0; t < tokens; ++t) {
            row.Load(logits + t * experts, experts, c.score_function);
            std::fill(g.begin(), g.end(), 0.0);
            std::fill(direct.begin(), direct.end(), 0.0);
            const std::int64_t* ti = idx + t * k;
            if (dw != nullptr) {
                // w_j = s_j / S (normalised) or s_j: ds_j = (dw_j - Σ_i w_i·dw_i) / S, or dw_j.
                double chosen = sigmoid ? kSigmoidEps : 0.0;
                for (int j = 0; j < k; ++j) {
                    chosen += row.s[static_cast<std::size_t>(ti[j])];
                }
                double w_dot_dw = 0.0;
                for (int j = 0; j < k; ++j) {
                    w_dot_dw += row.s[static_cast<std::size_t>(ti[j])] / chosen * static_cast<double>(dw[t * k + j]);
                }
                // Normalised softmax top-k is the softmax over the chosen logits alone: d l_j = w_j·(dw_j − w·dw) for
                // a chosen j, exactly 0 for the others (through the full softmax that 0 is a cancellation).
                for (int j = 0; j < k; ++j) {
                    const auto e = static_cast<std::size_t>(ti[j]);
                    const double d = static_cast<double>(dw[t * k + j]);
                    if (direct_softmax) {
                        direct[e] += row.s[e] / chosen * (d - w_dot_dw);
                    } else {
                        g[e] += normalize ? (d - w_dot_dw) / chosen : d;
                    }
                }
            }
            if (aux_scale != 0.0) {
                if (!sigmoid) { // p = s
                    for (std::int64_t e = 0; e < experts; ++e) {
                        g[static_cast<std::size_t>(e)] += aux_scale * static_cast<double>(counts[e]);
                    }
                } else { // p = s / D: ds_e = (a_e - Σ_f p_f·a_f) / D
                    const double d = row.s_sum + kSigmoidEps;
                    double p_dot_a = 0.0;
                    for (std::int64_t e = 0; e < experts; ++e) {
                        p_dot_a += row.p[static_cast<std::size_t>(e)] * aux_scale * static_cast<double>(counts[e]);
                    }
                    for (std::int64_t e = 0; e < experts; ++e) {
                        g[static_cast<std::size_t>(e)] += (aux_scale * static_cast<double>(counts[e]) - p_dot_a) / d;
                    }
                }
            }
            // Back through the scores: softmax ds → s_e·(g_e - Σ_f s_f·g_f); sigmoid ds → g_e·s_e·(1 - s_e).
            double s_dot_g = 0.0;
            for (std::int64_t e = 0; e < experts; ++e) {
                s_dot_g += row.s[static_cast<std::size_t>(e)] * g[static_cast<std::size_t>(e)];
            }
            for (std::int64_t e = 0; e < experts; ++e) {
                const auto ue = static_cast<std::size_t>(e);
                double d =
                    (sigmoid ? g[ue] * row.s[ue] * (1.0 - row.s[ue]) : row.s[ue] * (g[ue] - s_dot_g)) + direct[ue];
                // z: d lse_t / d logits[t, e] = softmax_e.
                const double softmax = std::exp(row.logits[ue] - row.lse);
                d += z_scale * row.lse * softmax;
                dl[t * experts + e] = static_cast<T>(d);
            }
        }
    });
}

void MoEPermuteMap(const MoEPermuteMapArgs& args) {
    const std::int64_t copies = args.indices.numel();
    const std::int64_t experts = args.num_experts;
    const auto* ids = args.indices.data_as<std::int64_t>();
    auto* row_map = args.row_map.data_as<std::int64_t>();
    auto* sizes = args.group_sizes.data_as<std::int64_t>();
    std::vector<std::int64_t> counts(static_cast<std::size_t>(experts), 0);
    for (std::int64_t i = 0; i < copies; ++i) {
        ++counts[static_cast<std::size_t>(ids[i])];
    }
    std::vector<std::int64_t> next(static_cast<std::size_t>(experts), 0); // the next row of each expert
    std::int64_t offset = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
        const std::int64_t n = counts[static_cast<std::size_t>(e)];
        sizes[e] = args.capacity < 0 ? n : std::min(n, args.capacity);
        next[static_cast<std::size_t>(e)] = offset;
        offset += sizes[e];
    }
    std::vector<std::int64_t> seen(static_cast<std::size_t>(experts), 0);
    for (std::int64_t i = 0; i < copies; ++i) {
        const auto e = static_cast<std::size_t>(ids[i]);
        row_map[i] = args.capacity < 0 || seen[e] < args.capacity ? next[e]++ : -1;
        ++seen[e];
    }
}

void MoEPermuteRows(const MoEPermuteRowsArgs& args) {
    const std::int64_t hidden = args.x.size(1);
    const std::int64_t copies = args.row_map.numel();
    const std::int64_t k = args.row_map.size(1);
    const auto* row_map = args.row_map.data_as<std::int64_t>();
    const DType wtype = args.weights != nullptr ? args.weights->dtype() : args.x.dtype();
    WithRowAndWeightTypes(args.x.dtype(), wtype, [&]<class T, class W>() {
        const T* x = static_cast<const T*>(args.x.data());
        const W* w = args.weights != nullptr ? static_cast<const W*>(args.weights->data()) : nullptr;
        T* out = static_cast<T*>(args.out.data());
        for (std::int64_t i = 0; i < copies; ++i) {
            if (row_map[i] < 0) {
                continue;
            }
            const T* src = x + (i / k) * hidden;
            T* dst = out + row_map[i] * hidden;
            if (w == nullptr) {
                std::memcpy(dst, src, static_cast<std::size_t>(hidden) * sizeof(T));
                continue;
            }
            const double scale = static_cast<double>(w[i]);
            for (std::int64_t h = 0; h < hidden; ++h) {
                dst[h] = static_cast<T>(scale * static_cast<double>(src[h]));
            }
        }
    });
}

void MoEUnpermuteRows(const MoEUnpermuteRowsArgs& args) {
    const std::int64_t hidden = args.tokens.size(1);
    const std::int64_t tokens = args.row_map.size(0);
    const std::int64_t k = args.row_map.size(1);
    const auto* row_map = args.row_map.data_as<std::int64_t>();
    const DType wtype = args.weights != nullptr ? args.weights->dtype() : args.tokens.dtype();
    WithRowAndWeightTypes(args.tokens.dtype(), wtype, [&]<class T, class W>() {
        const T* rows = static_cast<const T*>(args.tokens.data());
        const W* w = args.weights != nullptr ? static_cast<const W*>(args.weights->data()) : nullptr;
        T* y = static_cast<T*>(args.y.data());
        std::vector<double> acc(static_cast<std::size_t>(hidden));
        for (std::int64_t t = 0; t < tokens; ++t) {
            std::fill(acc.begin(), acc.end(), 0.0);
            for (std::int64_t j = 0; j < k; ++j) {
                const std::int64_t r = row_map[t * k + j];
                if (r < 0) {
                    continue;
                }
                const double scale = w != nullptr ? static_cast<double>(w[t * k + j]) : 1.0;
                const T* src = rows + r * hidden;
                for (std::int64_t h = 0; h < hidden; ++h) {
                    acc[static_cast<std::size_t>(h)] += scale * static_cast<double>(src[h]);
                }
            }
            for (std::int64_t h = 0; h < hidden; ++h) {
                y[t * hidden + h] = static_cast<T>(acc[static_cast<std::size_t>(h)]);
            }
        }
    });
}

void MoEUnpermuteWeightsGrad(const MoEUnpermuteWeightsGradArgs& args) {
    const std::int64_t hidden = args.dy.size(1);
    const std::int64_t copies = args.row_map.numel();
    const std::int64_t k = args.row_map.size(1);
    const auto* row_map = args.row_map.data_as<std::int64_t>();
    WithRowAndWeightTypes(args.dy.dtype(), args.dweights.dtype(), [&]<class T, class W>() {
        const T* dy = static_cast<const T*>(args.dy.data());
        const T* rows = static_cast<const T*>(args.tokens.data());
        W* dw = static_cast<W*>(args.dweights.data());
        for (std::int64_t i = 0; i < copies; ++i) {
            double dot = 0.0;
            if (row_map[i] >= 0) {
                const T* a = dy + (i / k) * hidden;
                const T* b = rows + row_map[i] * hidden;
                for (std::int64_t h = 0; h < hidden; ++h) {
                    dot += static_cast<double>(a[h]) * static_cast<double>(b[h]);
                }
            }
            dw[i] = static_cast<W>(dot);
        }
    });
}

} // namespace shardline::kernels::cpu
