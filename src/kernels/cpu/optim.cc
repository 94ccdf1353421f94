// CPU optimizer steps. Each element's update runs in fp64 from the stored (rounded) state, then param and the state
// are stored in the master's dtype (float32 or float64) and model_param, if any, gets the new param rounded to its own.
// The Multi ops are the single-tensor ones entry after entry (one implementation of the math).

#include <cmath>
#include <cstdint>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::cpu {
namespace {

/// Calls f.template operator()<T, M>() with T the master's C++ type and M model_param's (T when there is none).
template <class F> void WithMasterTypes(const Tensor &param, const Tensor *model_param, F &&f) {
    const bool p64 = param.dtype() == DType::kFloat64;
    const bool m64 = model_param != nullptr ? model_param->dtype() == DType::kFloat64 : p64;
    if (p64 && m64) {
        f.template operator()<double, double>();
    } else if (p64) {
        f.template operator()<double, float>();
    } else if (m64) {
        f.template operator()<float, double>();
    } else {
        f.template operator()<float, float>();
    }
}

} // namespace

void SgdStep(const SgdStepArgs &args) {
    const std::int64_t n = args.param.numel();
    const bool use_momentum = args.momentum != 0.0;
    WithMasterTypes(args.param, args.model_param, [&]<class T, class M>() {
        T *param = static_cast<T *>(args.param.data());
        const T *grad = static_cast<const T *>(args.grad.data());
        T *buf = use_momentum ? static_cast<T *>(args.momentum_buffer->data()) : nullptr;
        M *model = args.model_param != nullptr ? static_cast<M *>(args.model_param->data()) : nullptr;
        for (std::int64_t i = 0; i < n; ++i) {
            const double p = static_cast<double>(param[i]);
            double g = static_cast<double>(grad[i]) + args.weight_decay * p;
            if (use_momentum) {
                const double b =
                    args.first_step ? g : args.momentum * static_cast<double>(buf[i]) + (1.0 - args.dampening) * g;
                buf[i] = static_cast<T>(b);
                g = args.nesterov ? g + args.momentum * static_cast<double>(buf[i]) : static_cast<double>(buf[i]);
            }
            param[i] = static_cast<T>(p - args.lr * g);
            if (model != nullptr) {
                model[i] = static_cast<M>(param[i]);
            }
        }
    });
}

void AdamWStep(const AdamWStepArgs &args) {
    const std::int64_t n = args.param.numel();
    const double t = static_cast<double>(args.step);
    const double step_size = args.lr / (1.0 - std::pow(args.beta1, t));
    const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(args.beta2, t));
    const double decay = 1.0 - args.lr * args.weight_decay;
    WithMasterTypes(args.param, args.model_param, [&]<class T, class M>() {
        T *param = static_cast<T *>(args.param.data());
        const T *grad = static_cast<const T *>(args.grad.data());
        T *exp_avg = static_cast<T *>(args.exp_avg.data());
        T *exp_avg_sq = static_cast<T *>(args.exp_avg_sq.data());
        M *model = args.model_param != nullptr ? static_cast<M *>(args.model_param->data()) : nullptr;
        for (std::int64_t i = 0; i < n; ++i) {
            const double g = static_cast<double>(grad[i]);
            const double p = static_cast<double>(param[i]) * decay;
            exp_avg[i] = static_cast<T>(args.beta1 * static_cast<double>(exp_avg[i]) + (1.0 - args.beta1) * g);
            exp_avg_sq[i] =
                static_cast<T>(args.beta2 * static_cast<double>(exp_avg_sq[i]) + (1.0 - args.beta2) * g * g);
            const double denom = std::sqrt(static_cast<double>(exp_avg_sq[i])) / bias_correction2_sqrt + args.eps;
            param[i] = static_cast<T>(p - step_size * static_cast<double>(exp_avg[i]) / denom);
            if (model != nullptr) {
                model[i] = static_cast<M>(param[i]);
            }
        }
    });
}

void SgdStepMulti(const SgdStepMultiArgs &args) {
    for (const SgdStepTensor &t : args.tensors) {
        if (t.param.numel() > 0) {
            SgdStep({.param = t.param,
                     .grad = t.grad,
                     .momentum_buffer = t.momentum_buffer,
                     .lr = args.lr,
                     .momentum = args.momentum,
                     .dampening = args.dampening,
                     .weight_decay = args.weight_decay,
                     .nesterov = args.nesterov,
                     .first_step = t.first_step,
                     .model_param = t.model_param});
        }
    }
}

void AdamWStepMulti(const AdamWStepMultiArgs &args) {
    for (const AdamWStepTensor &t : args.tensors) {
        if (t.param.numel() > 0) {
            AdamWStep({.param = t.param,
                       .grad = t.grad,
                       .exp_avg = t.exp_avg,
                       .exp_avg_sq = t.exp_avg_sq,
                       .lr = args.lr,
                       .beta1 = args.beta1,
                       .beta2 = args.beta2,
                       .eps = args.eps,
                       .weight_decay = args.weight_decay,
                       .step = t.step,
                       .model_param = t.model_param});
        }
    }
}

} // namespace shardline::kernels::cpu
