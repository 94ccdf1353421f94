// Mixture-of-experts routing Functions on local Variables: Router, Permute and Unpermute over the kernels of
// kernels/moe.h. Each backward runs only the kernels of the gradients needed and saves only what they read.

#include <memory>
#include <utility>

#include <shardline/autograd/function.h>
#include <shardline/autograd/moe.h>
#include <shardline/core/error.h>
#include <shardline/kernels/moe.h>

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;

kernels::MoERouterConfig ConfigOf(const RouterOptions& o) {
    return {.num_experts = o.num_experts,
            .topk = o.topk,
            .score_function = o.score_function,
            .normalize_topk = o.normalize_topk,
            .aux_loss_coeff = o.aux_loss_coeff,
            .z_loss_coeff = o.z_loss_coeff};
}

/// Outputs: weights, then aux_loss when its coefficient is > 0, then z_loss when its coefficient is > 0. The indices
/// and the counts are not differentiable: the caller reads them from the Function after Apply.
class RouterFunction final : public Function {
public:
    explicit RouterFunction(const RouterOptions& options) : config_(ConfigOf(options)) {}
    std::string name() const override { return "RouterBackward"; }
    bool has_aux() const { return config_.aux_loss_coeff > 0.0; }
    bool has_z() const { return config_.z_loss_coeff > 0.0; }
    const Tensor& indices() const { return indices_; }
    const Tensor& tokens_per_expert() const { return tokens_per_expert_; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        logits_ = in[0].local().Contiguous();
        const std::int64_t tokens = logits_.size(0);
        const Device device = logits_.device();
        Tensor weights = Tensor::Empty(Shape{tokens, config_.topk}, logits_.dtype(), device);
        indices_ = Tensor::Empty(Shape{tokens, config_.topk}, DType::kInt64, device);
        tokens_per_expert_ = Tensor::Empty(Shape{config_.num_experts}, DType::kInt64, device);
        Tensor aux = has_aux() ? Tensor::Empty(Shape{}, logits_.dtype(), device) : Tensor();
        Tensor z = has_z() ? Tensor::Empty(Shape{}, logits_.dtype(), device) : Tensor();
        kernels::MoERouterForward({.logits = logits_,
                                   .config = config_,
                                   .weights = weights,
                                   .indices = indices_,
                                   .tokens_per_expert = tokens_per_expert_,
                                   .aux_loss = has_aux() ? &aux : nullptr,
                                   .z_loss = has_z() ? &z : nullptr});
        std::vector<DistTensor> out{DistTensor::Local(std::move(weights))};
        if (has_aux()) {
            out.push_back(DistTensor::Local(std::move(aux)));
        }
        if (has_z()) {
            out.push_back(DistTensor::Local(std::move(z)));
        }
        return out;
    }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(1);
        std::size_t next = 1;
        const DistTensor* daux = has_aux() ? &g[next++] : nullptr;
        const DistTensor* dz = has_z() ? &g[next++] : nullptr;
        const bool any = g[0].defined() || (daux != nullptr && daux->defined()) || (dz != nullptr && dz->defined());
        if (!needs_input_grad(0) || !any) {
            return grads;
        }
        const Tensor dw = g[0].defined() ? g[0].local().Contiguous() : Tensor();
        const Tensor da = daux != nullptr && daux->defined() ? daux->local().Contiguous() : Tensor();
        const Tensor dzl = dz != nullptr && dz->defined() ? dz->local().Contiguous() : Tensor();
        Tensor dlogits = Tensor::Empty(logits_.shape(), logits_.dtype(), logits_.device());
        kernels::MoERouterBackward({.logits = logits_,
                                    .config = config_,
                                    .indices = indices_,
                                    .tokens_per_expert = tokens_per_expert_,
                                    .dweights = dw.defined() ? &dw : nullptr,
                                    .daux_loss = da.defined() ? &da : nullptr,
                                    .dz_loss = dzl.defined() ? &dzl : nullptr,
                                    .dlogits = dlogits});
        grads[0].value = DistTensor::Local(std::move(dlogits));
        return grads;
    }
    void ReleaseSaved() override { logits_ = Tensor(); }

private:
    kernels::MoERouterConfig config_;
    Tensor logits_;
    Tensor indices_;
    Tensor tokens_per_expert_;
};

/// tokens = the kept copies of x's rows in expert order; backward dx[t] = Σ_j dtokens[row_map[t, j]].
class PermuteFunction final : public Function {
public:
    PermuteFunction(Tensor row_map, std::int64_t rows) : row_map_(std::move(row_map)), rows_(rows) {}
    std::string name() const override { return "PermuteBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        const Tensor x = in[0].local().Contiguous();
        x_shape_ = x.shape();
        Tensor tokens = Tensor::Empty(Shape{rows_, x.size(1)}, x.dtype(), x.device());
        kernels::MoEPermuteRows({.x = x, .row_map = row_map_, .out = tokens});
        return {DistTensor::Local(std::move(tokens))};
    }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(1);
        if (!g[0].defined() || !needs_input_grad(0)) {
            return grads;
        }
        const Tensor dtokens = g[0].local().Contiguous();
        Tensor dx = Tensor::Empty(x_shape_, dtokens.dtype(), dtokens.device());
        kernels::MoEUnpermuteRows({.tokens = dtokens, .row_map = row_map_, .y = dx});
        grads[0].value = DistTensor::Local(std::move(dx));
        return grads;
    }

private:
    Tensor row_map_;
    std::int64_t rows_;
    Shape x_shape_;
};

/// y[t] = Σ_j w[t, j]·tokens[row_map[t, j]]; saves tokens only for dweights and the weights only for dtokens.
class UnpermuteFunction final : public Function {
public:
    explicit UnpermuteFunction(Tensor row_map) : row_map_(std::move(row_map)) {}
    std::string name() const override { return "UnpermuteBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        tokens_ = in[0].local().Contiguous();
        weights_ = in[1].local().Contiguous();
        Tensor y = Tensor::Empty(Shape{row_map_.size(0), tokens_.size(1)}, tokens_.dtype(), tokens_.device());
        kernels::MoEUnpermuteRows({.tokens = tokens_, .row_map = row_map_, .weights = &weights_, .y = y});
        return {DistTensor::Local(std::move(y))};
    }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {
        tokens_shape_ = tokens_.shape();
        if (!needs_input_grad(1)) {
            tokens_ = Tensor();
        }
        if (!needs_input_grad(0)) {
            weights_ = Tensor();
        }
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (!g[0].defined()) {
            return grads;
        }
        const Tensor dy = g[0].local().Contiguous();
        if (needs_input_grad(0)) {
            Tensor dtokens = Tensor::Empty(tokens_shape_, dy.dtype(), dy.device());
            kernels::MoEPermuteRows({.x = dy, .row_map = row_map_, .weights = &weights_, .out = dtokens});
            grads[0].value = DistTensor::Local(std::move(dtokens));
        }
        if (needs_input_grad(1)) {
            Tensor dweights = Tensor::Empty(row_map_.shape(), weights_dtype_, dy.device());
            kernels::MoEUnpermuteWeightsGrad({.dy = dy, .tokens = tokens_, .row_map = row_map_, .dweights = dweights});
            grads[1].value = DistTensor::Local(std::move(dweights));
        }
        return grads;
    }
    void ReleaseSaved() override {
        tokens_ = Tensor();
        weights_ = Tensor();
    }

public:
    void set_weights_dtype(DType dtype) { weights_dtype_ = dtype; }

private:
    Tensor row_map_;
    Tensor tokens_;
    Tensor weights_;
    Shape tokens_shape_;
    DType weights_dtype_ = DType::kFloat32;
};

void CheckLocal(const Variable& v, std::string_view name, std::string_view op) {
    SHARDLINE_CHECK(v.defined(), op, "{} must be defined", name);
    SHARDLINE_CHECK(v.value().is_local(), op,
                    "takes local Variables (the MoE layer exchanges tokens itself), got {} {}", name,
                    v.value().ToString());
}

} // namespace

RouterOutput Router(const Variable& logits, const RouterOptions& options) {
    constexpr std::string_view kOp = "Router";
    CheckLocal(logits, "logits", kOp);
    const Tensor& l = logits.local();
    SHARDLINE_CHECK_AS(ShapeError, l.rank() == 2, kOp, "logits must be [tokens, experts], got {}", l.ToString());
    SHARDLINE_CHECK_AS(ShapeError, options.num_experts > 0 && l.size(1) == options.num_experts, kOp,
                       "logits must have num_experts ({}) columns, got {}", options.num_experts, l.ToString());
    SHARDLINE_CHECK_AS(ShapeError, options.topk >= 1 && options.topk <= options.num_experts, kOp,
                       "topk ({}) must be in [1, num_experts = {}]", options.topk, options.num_experts);
    auto fn = std::make_shared<RouterFunction>(options);
    std::vector<Variable> out = Function::Apply(fn, {logits});
    RouterOutput r;
    r.weights = out[0];
    r.indices = fn->indices();
    r.tokens_per_expert = fn->tokens_per_expert();
    std::size_t next = 1;
    const auto zero = [&] { return Variable(Tensor::Zeros(Shape{}, l.dtype(), l.device())); };
    r.aux_loss = fn->has_aux() ? out[next++] : zero();
    r.z_loss = fn->has_z() ? out[next++] : zero();
    return r;
}

PermuteOutput Permute(const Variable& x, const Tensor& indices, int num_experts, std::int64_t capacity,
                      bool host_sizes) {
    constexpr std::string_view kOp = "Permute";
    CheckLocal(x, "x", kOp);
    const Tensor& xl = x.local();
    SHARDLINE_CHECK_AS(ShapeError, xl.rank() == 2, kOp, "x must be [tokens, hidden], got {}", xl.ToString());
    SHARDLINE_CHECK(indices.defined(), kOp, "indices must be defined");
    SHARDLINE_CHECK_AS(DTypeError, indices.dtype() == DType::kInt64, kOp, "indices must be int64, got {}",
                       indices.ToString());
    SHARDLINE_CHECK_AS(ShapeError, indices.rank() == 2 && indices.size(0) == xl.size(0) && indices.size(1) >= 1, kOp,
                       "indices must be [tokens = {}, topk >= 1], got {}", xl.size(0), indices.ToString());
    SHARDLINE_CHECK_AS(DeviceError, indices.device() == xl.device(), kOp, "indices must be on x's device {}, got {}",
                       ToString(xl.device()), indices.ToString());
    SHARDLINE_CHECK_AS(ShapeError, num_experts > 0, kOp, "num_experts must be > 0, got {}", num_experts);
    SHARDLINE_CHECK(host_sizes || capacity < 0, kOp,
                    "without host_sizes the permutation must be dropless (capacity < 0, got {}): a capacity's row "
                    "count is known only on the device",
                    capacity);
    PermuteOutput r;
    const Tensor ids = indices.Contiguous();
    r.row_map = Tensor::Empty(ids.shape(), DType::kInt64, ids.device());
    r.group_sizes = Tensor::Empty(Shape{num_experts}, DType::kInt64, ids.device());
    kernels::MoEPermuteMap({.indices = ids,
                            .num_experts = num_experts,
                            .capacity = capacity,
                            .row_map = r.row_map,
                            .group_sizes = r.group_sizes});
    std::int64_t rows = ids.numel();
    if (host_sizes) {
        const Tensor host = r.group_sizes.device().is_cpu() ? r.group_sizes : r.group_sizes.To(Device::CPU());
        const auto* sizes = host.data_as<std::int64_t>();
        r.host_group_sizes.assign(sizes, sizes + num_experts);
        rows = 0;
        for (std::int64_t s : r.host_group_sizes) {
            rows += s;
        }
        r.dropped = ids.numel() - rows;
    }
    r.tokens = Function::Apply(std::make_shared<PermuteFunction>(r.row_map, rows), {x}).at(0);
    return r;
}

Variable Unpermute(const Variable& tokens, const Tensor& row_map, const Variable& weights) {
    constexpr std::string_view kOp = "Unpermute";
    CheckLocal(tokens, "tokens", kOp);
    CheckLocal(weights, "weights", kOp);
    SHARDLINE_CHECK(row_map.defined(), kOp, "row_map must be defined");
    SHARDLINE_CHECK_AS(ShapeError, row_map.rank() == 2 && weights.local().shape() == row_map.shape(), kOp,
                       "row_map must be [tokens, topk] and weights of its shape, got row_map {} and weights {}",
                       row_map.ToString(), weights.local().ToString());
    auto fn = std::make_shared<UnpermuteFunction>(row_map.Contiguous());
    fn->set_weights_dtype(weights.dtype());
    return Function::Apply(fn, {tokens, weights}).at(0);
}

} // namespace shardline::autograd
