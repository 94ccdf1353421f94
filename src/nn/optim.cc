#include <shardline/core/error.h>
#include <shardline/kernels/optim.h>
#include <shardline/nn/optim.h>

namespace shardline::nn {

Optimizer::Optimizer(std::vector<Variable> parameters) {
    for (auto &p : parameters) {
        SHARDLINE_CHECK(p.defined() && p.is_leaf(), "Optimizer", "every parameter must be a defined leaf, got '{}'",
                        p.defined() ? p.name() : std::string("undefined"));
        Slot s{.param = p, .master = {}, .state0 = {}, .state1 = {}, .half = IsHalf(p.dtype()), .step = 0};
        if (s.half) {
            // fp32 master weights; the backward accumulates into an fp32 main grad (beta = 1).
            s.master = p.local().To(DType::kFloat32);
            if (!p.has_main_grad()) {
                p.AllocateMainGrad(DType::kFloat32);
            }
        } else {
            s.master = p.local();
        }
        slots_.push_back(std::move(s));
    }
}

void Optimizer::ZeroGrad() {
    for (auto &s : slots_) {
        s.param.ZeroGrad();
    }
}

Tensor Optimizer::GradOf(Slot &s, const char *op) const {
    const dist::DistTensor &g = s.param.grad();
    if (!g.defined()) {
        return {};
    }
    SHARDLINE_CHECK(!g.layout().IsPartial(), op,
                    "the gradient of '{}' is still Partial ({}): finish the data-parallel GradSync before the step",
                    s.param.name(), g.layout().ToString());
    if (g.dtype() == s.master.dtype()) {
        return g.local();
    }
    return g.local().To(s.master.dtype());
}

SGD::SGD(std::vector<Variable> parameters, const SgdOptions &options)
    : Optimizer(std::move(parameters)), options_(options) {
    lr_ = options.lr;
    if (options.momentum != 0.0) {
        for (auto &s : slots_) {
            s.state0 = Tensor::Zeros(s.master.shape(), s.master.dtype(), s.master.device());
        }
    }
}

void SGD::Step() {
    for (auto &s : slots_) {
        Tensor g = GradOf(s, "SGD::Step");
        if (!g.defined()) {
            continue;
        }
        Tensor model = s.param.local();
        kernels::SgdStep({.param = s.master,
                          .grad = g,
                          .momentum_buffer = options_.momentum != 0.0 ? &s.state0 : nullptr,
                          .lr = lr_,
                          .momentum = options_.momentum,
                          .dampening = options_.dampening,
                          .weight_decay = options_.weight_decay,
                          .nesterov = options_.nesterov,
                          .first_step = s.step == 0,
                          .model_param = s.half ? &model : nullptr});
        ++s.step;
    }
    ++steps_;
}

AdamW::AdamW(std::vector<Variable> parameters, const AdamWOptions &options)
    : Optimizer(std::move(parameters)), options_(options) {
    lr_ = options.lr;
    for (auto &s : slots_) {
        s.state0 = Tensor::Zeros(s.master.shape(), s.master.dtype(), s.master.device());
        s.state1 = Tensor::Zeros(s.master.shape(), s.master.dtype(), s.master.device());
    }
}

void AdamW::Step() {
    ++steps_;
    for (auto &s : slots_) {
        Tensor g = GradOf(s, "AdamW::Step");
        if (!g.defined()) {
            continue;
        }
        ++s.step;
        Tensor model = s.param.local();
        kernels::AdamWStep({.param = s.master,
                            .grad = g,
                            .exp_avg = s.state0,
                            .exp_avg_sq = s.state1,
                            .lr = lr_,
                            .beta1 = options_.beta1,
                            .beta2 = options_.beta2,
                            .eps = options_.eps,
                            .weight_decay = options_.weight_decay,
                            .step = s.step,
                            .model_param = s.half ? &model : nullptr});
    }
}

} // namespace shardline::nn
