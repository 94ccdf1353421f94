#pragma once

// The float64 references of the optimizer kernel tests (kernels_optim_test.cc, kernels_optim_multi_test.cc):
// torch.optim's single-tensor SGD and AdamW formulas, and the aligned / misaligned placement of a tensor.

#include <cmath>
#include <cstdint>

#include "helpers.h"

namespace shardline::testing {

struct SgdConfig {
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
    bool nesterov;
};

/// torch.optim.SGD's _single_tensor_sgd for one step, in float64.
inline void RefSgdStep(Values &p, Values &buf, const Values &grad, const SgdConfig &c, bool first_step) {
    for (std::size_t i = 0; i < p.size(); ++i) {
        double d = grad[i];
        if (c.weight_decay != 0) {
            d += c.weight_decay * p[i];
        }
        if (c.momentum != 0) {
            buf[i] = first_step ? d : c.momentum * buf[i] + (1 - c.dampening) * d;
            d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
        }
        p[i] -= c.lr * d;
    }
}

struct AdamWConfig {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
};

/// torch.optim.AdamW's _single_tensor_adamw (amsgrad off) for step t, in float64.
inline void RefAdamWStep(Values &p, Values &m, Values &v, const Values &grad, const AdamWConfig &c, std::int64_t t) {
    const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(t));
    const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] *= 1 - c.lr * c.weight_decay;
        m[i] += (grad[i] - m[i]) * (1 - c.beta1); // exp_avg.lerp_(grad, 1 - beta1)
        v[i] = v[i] * c.beta2 + (1 - c.beta2) * grad[i] * grad[i];
        const double denom = std::sqrt(v[i]) / std::sqrt(bias_correction2) + c.eps;
        p[i] -= c.lr / bias_correction1 * m[i] / denom;
    }
}

/// A copy of t on its device, aligned as allocated (CUDA's 16-byte vectors) or one element off (CUDA's scalar path).
inline MisalignedTensor Place(const Tensor &t, bool misaligned) {
    if (misaligned) {
        return MisalignedCopy(t, 1);
    }
    MisalignedTensor m;
    m.backing = t.Clone();
    m.view = m.backing;
    return m;
}

} // namespace shardline::testing
