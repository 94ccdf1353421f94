#include <algorithm>
#include <vector>

#include <shardline/core/error.h>
#include <shardline/kernels/optim.h>
#include <shardline/nn/optim.h>

namespace shardline::nn {

Optimizer::Optimizer(std::vector<Variable> parameters) {
    for (auto &p : parameters) {
        SHARDLINE_CHECK(p.defined() && p.is_leaf(), "Optimizer", "every parameter must be a defined leaf, got '{}'",
                        p.defined() ? p.name() : std::string("undefined"));
        Slot s{
            .param = p, .master = {}, .synced = {}, .state0 = {}, .state1 = {}, .half = IsHalf(p.dtype()), .step = 0};
        if (s.half) {
            // fp32 master weights; the backward accumulates into an fp32 main grad (beta = 1).
            s.master = p.local().To(DType::kFloat32);
            s.synced = p.local();
            if (!p.has_main_grad()) {
                p.AllocateMainGrad(DType::kFloat32);
            }
        }
        slots_.push_back(std::move(s));
    }
}

void Optimizer::ZeroGrad() {
    for (auto &s : slots_) {
        s.param.ZeroGrad();
    }
}

namespace {

bool SameTensor(const Tensor &a, const Tensor &b) {
    return a.storage() == b.storage() && a.offset() == b.offset() && a.shape() == b.shape() && a.dtype() == b.dtype();
}

} // namespace

Tensor Optimizer::Master(Slot &s) {
    const Tensor &model = s.param.local();
    if (!s.half) {
        return model;
    }
    if (!SameTensor(model, s.synced)) {
        // The parameter's tensor was replaced (Variable::SetValue): its values are the model's now.
        s.master = model.To(DType::kFloat32);
        s.synced = model;
    }
    return s.master;
}

std::vector<Optimizer::ParamState> Optimizer::State() {
    std::vector<ParamState> states;
    states.reserve(slots_.size());
    for (auto &s : slots_) {
        ParamState state{.param = s.param, .tensors = {}, .step = s.step};
        if (s.state0.defined()) {
            state.tensors.emplace_back(s.state1.defined() ? "exp_avg" : "momentum_buffer", s.state0);
        }
        if (s.state1.defined()) {
            state.tensors.emplace_back("exp_avg_sq", s.state1);
        }
        if (s.half) {
            state.tensors.emplace_back("master", Master(s));
        }
        states.push_back(std::move(state));
    }
    return states;
}

void Optimizer::LoadSteps(const std::vector<std::int64_t> &param_steps, std::int64_t steps) {
    SHARDLINE_CHECK(param_steps.size() == slots_.size(), "Optimizer::LoadSteps",
                    "one step count per parameter ({}) expected, got {}", slots_.size(), param_steps.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) {
        SHARDLINE_CHECK(param_steps[i] >= 0 && param_steps[i] <= steps, "Optimizer::LoadSteps",
                        "the step count of '{}' must be in [0, {}], got {}", slots_[i].param.name(), steps,
                        param_steps[i]);
        slots_[i].step = param_steps[i];
    }
    steps_ = steps;
}

void Optimizer::ReloadModelParams() {
    for (auto &s : slots_) {
        if (s.half) {
            s.master = s.param.local().To(DType::kFloat32);
            s.synced = s.param.local();
        }
    }
}

Tensor Optimizer::GradOf(Slot &s, const Tensor &master, const char *op) const {
    const dist::DistTensor &g = s.param.grad();
    if (!g.defined()) {
        return {};
    }
    SHARDLINE_CHECK(!g.layout().IsPartial(), op,
                    "the gradient of '{}' is still Partial ({}): finish the data-parallel GradSync before the step",
                    s.param.name(), g.layout().ToString());
    if (g.dtype() == master.dtype()) {
        return g.local();
    }
    // A cast per step, which the kernels need (they take the master's dtype). Only a gradient the caller chose gets
    // here: a half main grad allocated for a half parameter, or a set_grad in another dtype. The main grads the
    // optimizer or a GradSync allocate for half parameters are fp32, the master's dtype (the README job's bf16 model).
    return g.local().To(master.dtype());
}

std::vector<std::vector<Optimizer::Update>> Optimizer::PendingUpdates(const char *op) {
    std::vector<std::vector<Update>> groups;
    for (auto &s : slots_) {
        Tensor master = Master(s);
        Tensor g = GradOf(s, master, op);
        if (!g.defined()) {
            continue;
        }
        for (const Tensor *state : {&s.state0, &s.state1}) {
            SHARDLINE_CHECK(
                !state->defined() || (state->shape() == master.shape() && state->device() == master.device()), op,
                "the state of '{}' is {}, its parameter's local tensor is now {}: replace a "
                "parameter by one of the same local shape and device",
                s.param.name(), state->ToString(), master.ToString());
        }
        const Device device = master.device();
        auto group = std::find_if(groups.begin(), groups.end(),
                                  [&](const std::vector<Update> &u) { return u.front().master.device() == device; });
        if (group == groups.end()) {
            group = groups.emplace(groups.end());
        }
        group->push_back({.slot = &s, .master = std::move(master), .grad = std::move(g), .model = s.param.local()});
    }
    return groups;
}

void Optimizer::CountStep(const std::vector<std::vector<Update>> &updates) {
    for (const auto &group : updates) {
        for (const Update &u : group) {
            ++u.slot->step;
        }
    }
    ++steps_;
}

SGD::SGD(std::vector<Variable> parameters, const SgdOptions &options)
    : Optimizer(std::move(parameters)), options_(options) {
    lr_ = options.lr;
    if (options.momentum != 0.0) {
        for (auto &s : slots_) {
            const Tensor master = Master(s);
            s.state0 = Tensor::Zeros(master.shape(), master.dtype(), master.device());
        }
    }
}

void SGD::Step() {
    std::vector<std::vector<Update>> updates = PendingUpdates("SGD::Step");
    for (auto &group : updates) {
        std::vector<kernels::SgdStepTensor> tensors;
        tensors.reserve(group.size());
        for (Update &u : group) {
            Slot &s = *u.slot;
            tensors.push_back({.param = u.master,
                               .grad = u.grad,
                               .momentum_buffer = options_.momentum != 0.0 ? &s.state0 : nullptr,
                               .first_step = s.step == 0,
                               .model_param = s.half ? &u.model : nullptr});
        }
        kernels::SgdStepMulti({.tensors = tensors,
                               .lr = lr_,
                               .momentum = options_.momentum,
                               .dampening = options_.dampening,
                               .weight_decay = options_.weight_decay,
                               .nesterov = options_.nesterov});
    }
    CountStep(updates);
}

AdamW::AdamW(std::vector<Variable> parameters, const AdamWOptions &options)
    : Optimizer(std::move(parameters)), options_(options) {
    lr_ = options.lr;
    for (auto &s : slots_) {
        const Tensor master = Master(s);
        s.state0 = Tensor::Zeros(master.shape(), master.dtype(), master.device());
        s.state1 = Tensor::Zeros(master.shape(), master.dtype(), master.device());
    }
}

void AdamW::Step() {
    std::vector<std::vector<Update>> updates = PendingUpdates("AdamW::Step");
    for (auto &group : updates) {
        std::vector<kernels::AdamWStepTensor> tensors;
        tensors.reserve(group.size());
        for (Update &u : group) {
            Slot &s = *u.slot;
            tensors.push_back({.param = u.master,
                               .grad = u.grad,
                               .exp_avg = s.state0,
                               .exp_avg_sq = s.state1,
                               .step = s.step + 1, // torch: state["step"] += 1 before the update
                               .model_param = s.half ? &u.model : nullptr});
        }
        kernels::AdamWStepMulti({.tensors = tensors,
                                 .lr = lr_,
                                 .beta1 = options_.beta1,
                                 .beta2 = options_.beta2,
                                 .eps = options_.eps,
                                 .weight_decay = options_.weight_decay});
    }
    CountStep(updates);
}

} // namespace shardline::nn
