#pragma once

// Optimizers on local shards (every rank updates its own shard; a replicated parameter gets the same update on every
// rank because its gradient is the same). Half-precision parameters keep fp32 master weights and read fp32 main
// grads (Variable::AllocateMainGrad, which the optimizer sets up when missing); the updated master is cast back into
// the parameter. A step updates every parameter of a device in one multi-tensor kernel call (kernels::SgdStepMulti /
// AdamWStepMulti: few launches on CUDA, as torch's fused optimizers), bit for bit the per-parameter update.
//
// The optimizer holds the parameters (Variables), not the tensors it saw at construction: every step reads each
// parameter's current local tensor, so a value written in place or a tensor replaced by Variable::SetValue (a
// checkpoint load) is what the next step updates. A half parameter's fp32 master is re-derived from the parameter when
// its tensor was replaced; after writing a half parameter's values in place, call ReloadModelParams (Megatron's
// reload_model_params), or restore the master itself through State().

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <shardline/autograd/variable.h>

namespace shardline::nn {

using autograd::Variable;

class Optimizer {
public:
    explicit Optimizer(std::vector<Variable> parameters);
    virtual ~Optimizer() = default;
    /// One update of every parameter that has a gradient. Throws naming the parameter when its gradient is still
    /// Partial (a data-parallel GradSync that was not finished).
    virtual void Step() = 0;
    void ZeroGrad();
    double lr() const { return lr_; }
    void set_lr(double lr) { lr_ = lr; }
    /// Step() calls so far.
    std::int64_t steps() const { return steps_; }

    /// One parameter's state for checkpoints. The tensors alias the optimizer's own (same shape as the parameter's
    /// local shard), so writing into them restores the state in place. Names: "exp_avg", "exp_avg_sq" (AdamW),
    /// "momentum_buffer" (SGD with momentum), "master" (the fp32 master weights of a half parameter).
    struct ParamState {
        Variable param;
        std::vector<std::pair<std::string, Tensor>> tensors;
        std::int64_t step = 0; ///< updates this parameter has had
    };
    /// Every parameter's state, in construction order (masters first re-derived from replaced parameters).
    std::vector<ParamState> State();
    /// Restores the step counts: `param_steps` one per parameter (construction order) and steps().
    void LoadSteps(const std::vector<std::int64_t>& param_steps, std::int64_t steps);
    /// master = float32(param) for every half parameter: after the caller wrote a half parameter's values in place.
    void ReloadModelParams();

protected:
    struct Slot {
        Variable param;
        Tensor master; ///< fp32 master weights (half params only; fp32 params are updated in their own tensor)
        Tensor synced; ///< half params: the local tensor `master` was last derived from or written into
        Tensor state0; ///< momentum buffer / exp_avg
        Tensor state1; ///< exp_avg_sq
        bool half = false;
        /// Updates this parameter has had: its state starts at its first gradient, as torch's per-parameter state
        /// (a parameter without a gradient in early steps gets buf = g and bias corrections from t = 1 later).
        std::int64_t step = 0;
    };
    /// The tensor the kernels update: the fp32 master of a half parameter (re-derived first when the parameter's
    /// tensor was replaced), else the parameter's current local tensor.
    Tensor Master(Slot& s);
    /// The local gradient of slot `s` (fp32 for half params), or an undefined tensor when it has none.
    Tensor GradOf(Slot& s, const Tensor& master, const char* op) const;
    /// One parameter to update in this step: its slot, its gradient in the master's dtype and its model copy (the
    /// parameter's local tensor, refreshed from the master when the parameter is half).
    struct Update {
        Slot* slot = nullptr;
        Tensor master;
        Tensor grad;
        Tensor model;
    };
    /// This step's updates (the slots with a gradient, in order), one group per device: each group is one Multi
    /// kernel call. Every gradient is read first, so a Partial one throws before anything is updated.
    std::vector<std::vector<Update>> PendingUpdates(const char* op);
    /// After the kernels: one more step for every updated slot and for steps().
    void CountStep(const std::vector<std::vector<Update>>& updates);
    std::vector<Slot> slots_;
    double lr_ = 0.0;
    std::int64_t steps_ = 0;
};

struct SgdOptions {
    double lr = 0.01;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
};
/// torch.optim.SGD.
class SGD : public Optimizer {
public:
    SGD(std::vector<Variable> parameters, const SgdOptions& options);
    void Step() override;

private:
    SgdOptions options_;
};

struct AdamWOptions {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.01;
};
/// torch.optim.AdamW (decoupled weight decay, bias-corrected moments).
class AdamW : public Optimizer {
public:
    AdamW(std::vector<Variable> parameters, const AdamWOptions& options);
    void Step() override;

private:
    AdamWOptions options_;
};

} // namespace shardline::nn
