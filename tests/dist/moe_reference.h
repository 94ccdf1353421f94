#pragma once

// The single-rank float64 dense reference of nn::MoEMLP (nn_moe_test.cc): a plain loop over tokens and their experts,
// every gradient written out by hand — through the experts' MLPs, the combine weights, the top-k renormalisation and
// the softmax into the gate. The batch is processed in `chunks` (the data-parallel shards: each rank routes, applies
// the capacity and computes its auxiliary loss on its own tokens).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "reference.h"

namespace shardline::moe_test {

using testing::Values;

struct MoeProblem {
    std::int64_t tokens = 0; ///< global T
    std::int64_t hidden = 0, ffn = 0, experts = 0;
    int topk = 1;
    int chunks = 1;               ///< data-parallel shards
    std::int64_t capacity = -1;   ///< per chunk and expert; -1 dropless
    bool gelu = true;             ///< tanh GELU between fc1 and fc2
    bool normalize = true;        ///< renormalise the chosen scores
    double aux_coeff = 0.0;       ///< Switch load-balancing loss coefficient
    double z_coeff = 0.0;         ///< z-loss coefficient
    Values x, wg, w1, b1, w2, b2; ///< x [T, H], wg [H, E], w1 [E, F, H], b1 [E, F], w2 [E, H, F], b2 [E, H]
    /// A given routing (both empty: the router's): indices [T, topk], weights [T, topk].
    std::vector<std::int64_t> indices;
    Values weights;
};

struct MoeResult {
    Values y, dx, dwg, dw1, db1, dw2, db2, dweights;
    double aux = 0.0;                  ///< the mean over chunks of (aux + z) loss
    std::vector<std::int64_t> dropped; ///< per chunk
};

/// y and, from dy (and d aux = daux), every gradient.
inline MoeResult ReferenceMoe(const MoeProblem &p, const Values &dy, double daux) {
    const std::int64_t t_all = p.tokens, h = p.hidden, f = p.ffn, e = p.experts;
    const int k = p.topk;
    MoeResult r;
    r.y.assign(static_cast<std::size_t>(t_all * h), 0.0);
    r.dx.assign(r.y.size(), 0.0);
    r.dwg.assign(static_cast<std::size_t>(h * e), 0.0);
    r.dw1.assign(static_cast<std::size_t>(e * f * h), 0.0);
    r.db1.assign(static_cast<std::size_t>(e * f), 0.0);
    r.dw2.assign(static_cast<std::size_t>(e * h * f), 0.0);
    r.db2.assign(static_cast<std::size_t>(e * h), 0.0);
    r.dweights.assign(static_cast<std::size_t>(t_all * k), 0.0);
    const bool routed = p.indices.empty();
    const std::int64_t per = t_all / p.chunks;
    auto at = [](const Values &v, std::int64_t i) { return v[static_cast<std::size_t>(i)]; };
    for (int c = 0; c < p.chunks; ++c) {
        std::vector<std::int64_t> load(static_cast<std::size_t>(e), 0);
        std::vector<double> prob_sum(static_cast<std::size_t>(e), 0.0);
        std::vector<Values> scores(static_cast<std::size_t>(per));
        std::vector<std::vector<std::int64_t>> chosen(static_cast<std::size_t>(per));
        std::vector<Values> logits(static_cast<std::size_t>(per));
        std::int64_t dropped = 0;
        for (std::int64_t i = 0; i < per; ++i) {
            const std::int64_t t = c * per + i;
            auto &idx = chosen[static_cast<std::size_t>(i)];
            if (routed) {
                Values &lg = logits[static_cast<std::size_t>(i)];
                lg.assign(static_cast<std::size_t>(e), 0.0);
                for (std::int64_t x = 0; x < e; ++x) {
                    for (std::int64_t d = 0; d < h; ++d) {
                        lg[static_cast<std::size_t>(x)] += at(p.x, t * h + d) * at(p.wg, d * e + x);
                    }
                }
                const double mx = *std::max_element(lg.begin(), lg.end());
                Values s(static_cast<std::size_t>(e));
                double sum = 0.0;
                for (std::int64_t x = 0; x < e; ++x) {
                    s[static_cast<std::size_t>(x)] = std::exp(lg[static_cast<std::size_t>(x)] - mx);
                    sum += s[static_cast<std::size_t>(x)];
                }
                for (double &v : s) {
                    v /= sum;
                }
                std::vector<std::int64_t> order(static_cast<std::size_t>(e));
                std::iota(order.begin(), order.end(), 0);
                std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
                    return s[static_cast<std::size_t>(a)] > s[static_cast<std::size_t>(b)];
                });
                idx.assign(order.begin(), order.begin() + k);
                scores[static_cast<std::size_t>(i)] = s;
                for (std::int64_t x = 0; x < e; ++x) {
                    prob_sum[static_cast<std::size_t>(x)] += s[static_cast<std::size_t>(x)];
                }
            } else {
                idx.assign(p.indices.begin() + t * k, p.indices.begin() + (t + 1) * k);
            }
        }
        // Weights (the chosen scores, renormalised) and the capacity in (t, j) order.
        std::vector<Values> w(static_cast<std::size_t>(per));
        std::vector<std::vector<bool>> kept(static_cast<std::size_t>(per));
        for (std::int64_t i = 0; i < per; ++i) {
            const std::int64_t t = c * per + i;
            const auto &idx = chosen[static_cast<std::size_t>(i)];
            Values &wi = w[static_cast<std::size_t>(i)];
            if (routed) {
                double s_sum = 0.0;
                for (std::int64_t ex : idx) {
                    s_sum += scores[static_cast<std::size_t>(i)][static_cast<std::size_t>(ex)];
                }
                for (std::int64_t ex : idx) {
                    const double s = scores[static_cast<std::size_t>(i)][static_cast<std::size_t>(ex)];
                    wi.push_back(p.normalize ? s / s_sum : s);
                }
            } else {
                wi.assign(p.weights.begin() + t * k, p.weights.begin() + (t + 1) * k);
            }
            for (std::int64_t ex : idx) {
                auto &n = load[static_cast<std::size_t>(ex)];
                const bool keep = p.capacity < 0 || n < p.capacity;
                kept[static_cast<std::size_t>(i)].push_back(keep);
                dropped += keep ? 0 : 1;
                n += keep ? 1 : 0;
            }
        }
        r.dropped.push_back(dropped);
        // Experts, forward and backward, and the weights' gradients.
        for (std::int64_t i = 0; i < per; ++i) {
            const std::int64_t t = c * per + i;
            const auto &idx = chosen[static_cast<std::size_t>(i)];
            Values dw(static_cast<std::size_t>(k), 0.0);
            for (int j = 0; j < k; ++j) {
                if (!kept[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)]) {
                    continue;
                }
                const std::int64_t ex = idx[static_cast<std::size_t>(j)];
                const double wj = w[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
                Values a(static_cast<std::size_t>(f)), g(static_cast<std::size_t>(f)), o(static_cast<std::size_t>(h));
                for (std::int64_t q = 0; q < f; ++q) {
                    double v = at(p.b1, ex * f + q);
                    for (std::int64_t d = 0; d < h; ++d) {
                        v += at(p.w1, (ex * f + q) * h + d) * at(p.x, t * h + d);
                    }
                    a[static_cast<std::size_t>(q)] = v;
                    g[static_cast<std::size_t>(q)] = p.gelu ? testing::RefGeluTanh(v) : v;
                }
                for (std::int64_t d = 0; d < h; ++d) {
                    double v = at(p.b2, ex * h + d);
                    for (std::int64_t q = 0; q < f; ++q) {
                        v += at(p.w2, (ex * h + d) * f + q) * g[static_cast<std::size_t>(q)];
                    }
                    o[static_cast<std::size_t>(d)] = v;
                    r.y[static_cast<std::size_t>(t * h + d)] += wj * v;
                    dw[static_cast<std::size_t>(j)] += at(dy, t * h + d) * v;
                }
                Values dg(static_cast<std::size_t>(f), 0.0);
                for (std::int64_t d = 0; d < h; ++d) {
                    const double dout = wj * at(dy, t * h + d);
                    r.db2[static_cast<std::size_t>(ex * h + d)] += dout;
                    for (std::int64_t q = 0; q < f; ++q) {
                        r.dw2[static_cast<std::size_t>((ex * h + d) * f + q)] += dout * g[static_cast<std::size_t>(q)];
                        dg[static_cast<std::size_t>(q)] += at(p.w2, (ex * h + d) * f + q) * dout;
                    }
                }
                for (std::int64_t q = 0; q < f; ++q) {
                    const double da = dg[static_cast<std::size_t>(q)] *
                                      (p.gelu ? testing::RefGeluTanhGrad(a[static_cast<std::size_t>(q)]) : 1.0);
                    r.db1[static_cast<std::size_t>(ex * f + q)] += da;
                    for (std::int64_t d = 0; d < h; ++d) {
                        r.dw1[static_cast<std::size_t>((ex * f + q) * h + d)] += da * at(p.x, t * h + d);
                        r.dx[static_cast<std::size_t>(t * h + d)] += at(p.w1, (ex * f + q) * h + d) * da;
                    }
                }
            }
            for (int j = 0; j < k; ++j) {
                r.dweights[static_cast<std::size_t>(t * k + j)] = dw[static_cast<std::size_t>(j)];
            }
        }
        if (!routed) {
            continue;
        }
        // The auxiliary losses of this chunk (each weighted 1/chunks in the mean) and the router's backward.
        const double n = static_cast<double>(per);
        double aux = 0.0;
        for (std::int64_t x = 0; x < e; ++x) {
            // f_e counts the routed copies before the capacity (the router's tokens_per_expert).
            double routed_copies = 0.0;
            for (std::int64_t i = 0; i < per; ++i) {
                for (std::int64_t ex : chosen[static_cast<std::size_t>(i)]) {
                    routed_copies += ex == x ? 1.0 : 0.0;
                }
            }
            const double fe = routed_copies / (n * k);
            aux += p.aux_coeff * static_cast<double>(e) * fe * prob_sum[static_cast<std::size_t>(x)] / n;
        }
        double z = 0.0;
        for (std::int64_t i = 0; i < per; ++i) {
            const Values &lg = logits[static_cast<std::size_t>(i)];
            const double mx = *std::max_element(lg.begin(), lg.end());
            double s = 0.0;
            for (double v : lg) {
                s += std::exp(v - mx);
            }
            const double lse = mx + std::log(s);
            z += p.z_coeff * lse * lse / n;
        }
        r.aux += (aux + z) / p.chunks;
        const double dloss = daux / p.chunks;
        for (std::int64_t i = 0; i < per; ++i) {
            const std::int64_t t = c * per + i;
            const auto &idx = chosen[static_cast<std::size_t>(i)];
            const Values &s = scores[static_cast<std::size_t>(i)];
            Values ds(static_cast<std::size_t>(e), 0.0);
            double s_sum = 0.0;
            for (std::int64_t ex : idx) {
                s_sum += s[static_cast<std::size_t>(ex)];
            }
            double dot = 0.0;
            for (int j = 0; j < k; ++j) {
                dot += r.dweights[static_cast<std::size_t>(t * k + j)] * s[static_cast<std::size_t>(idx[j])];
            }
            for (int j = 0; j < k; ++j) {
                const double dwj = r.dweights[static_cast<std::size_t>(t * k + j)];
                // (dw·S - Σ dw·s) / S²: exactly 0 for topk 1, whose renormalised weight is the constant 1.
                ds[static_cast<std::size_t>(idx[j])] += p.normalize ? (dwj * s_sum - dot) / (s_sum * s_sum) : dwj;
            }
            // The load-balancing loss through P_e = mean_t s[t, e] (f_e has no gradient).
            for (std::int64_t x = 0; x < e; ++x) {
                double routed_copies = 0.0;
                for (std::int64_t q = 0; q < per; ++q) {
                    for (std::int64_t ex : chosen[static_cast<std::size_t>(q)]) {
                        routed_copies += ex == x ? 1.0 : 0.0;
                    }
                }
                ds[static_cast<std::size_t>(x)] +=
                    dloss * p.aux_coeff * static_cast<double>(e) * routed_copies / (n * k) / n;
            }
            double sds = 0.0;
            for (std::int64_t x = 0; x < e; ++x) {
                sds += s[static_cast<std::size_t>(x)] * ds[static_cast<std::size_t>(x)];
            }
            const Values &lg = logits[static_cast<std::size_t>(i)];
            const double mx = *std::max_element(lg.begin(), lg.end());
            double se = 0.0;
            for (double v : lg) {
                se += std::exp(v - mx);
            }
            const double lse = mx + std::log(se);
            for (std::int64_t x = 0; x < e; ++x) {
                double dl = s[static_cast<std::size_t>(x)] * (ds[static_cast<std::size_t>(x)] - sds);
                dl += dloss * p.z_coeff * 2.0 * lse * s[static_cast<std::size_t>(x)] / n; // z-loss
                for (std::int64_t d = 0; d < h; ++d) {
                    r.dwg[static_cast<std::size_t>(d * e + x)] += at(p.x, t * h + d) * dl;
                    r.dx[static_cast<std::size_t>(t * h + d)] += at(p.wg, d * e + x) * dl;
                }
            }
        }
    }
    return r;
}

} // namespace shardline::moe_test
