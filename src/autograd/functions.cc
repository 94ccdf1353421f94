#include <array>

#include <shardline/autograd/functions.h>
#include <shardline/core/error.h>
#include <shardline/kernels/linear.h>

#include "param_grads.h"

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;

Variable One(std::vector<Variable> outputs) { return std::move(outputs.at(0)); }

/// y = x·Wᵀ + b on local (undistributed) Variables: the kernels, no layouts and no collectives (the parallel layers
/// are in parallel_linear.cc, over the functional core). The backward runs kernels::LinearBackward for exactly the
/// gradients needed; that kernel decides per shape whether the bias grad rides in the wgrad GEMM.
class LinearFunction final : public Function {
public:
    std::string name() const override { return "LinearBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        return Output(DistTensor::Local(
            kernels::LinearForward(in[0].local(), in[1].local(), in[2].defined() ? &in[2].local() : nullptr)));
    }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        // Only what the requested gradients need: x for dW, W for dX; the shapes of those not saved.
        if (needs_input_grad(1)) {
            x_ = in[0].local();
        } else {
            x_shape_ = in[0].local().shape();
        }
        if (needs_input_grad(0)) {
            weight_ = in[1].local();
        } else {
            weight_shape_ = in[1].local().shape();
        }
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(3);
        const Tensor& dy = g[0].local();
        const Shape& weight_shape = weight_.defined() ? weight_.shape() : weight_shape_;
        const Shape& x_shape = x_.defined() ? x_.shape() : x_shape_;
        const std::array<detail::ParamGradRequest, 2> requests{
            detail::ParamGradRequest{
                .needed = needs_input_grad(1), .sink = GradSinkFor(1), .local_shape = weight_shape, .layout = {}},
            detail::ParamGradRequest{
                .needed = needs_input_grad(2), .sink = GradSinkFor(2), .local_shape = {weight_shape[0]}, .layout = {}}};
        const detail::ParamGradRequest& wreq = requests[0];
        const detail::ParamGradRequest& breq = requests[1];
        detail::ParamGradTargets params = detail::PlanParamGrads(nullptr, requests, dy.dtype(), dy.device());
        Tensor& dweight = params.grads[0];
        Tensor& dbias = params.grads[1];
        Tensor dx;
        if (needs_input_grad(0)) {
            dx = Tensor::Empty(x_shape, dy.dtype(), dy.device());
        }
        // The kernel takes dbias in dweight's dtype only: a float32 main grad for one of them and not the other gets
        // its own column sum.
        const bool bias_apart = dweight.defined() && dbias.defined() && dweight.dtype() != dbias.dtype();
        kernels::LinearBackward({.dy = dy,
                                 .x = needs_input_grad(1) ? &x_ : nullptr,
                                 .weight = needs_input_grad(0) ? &weight_ : nullptr,
                                 .dx = needs_input_grad(0) ? &dx : nullptr,
                                 .dweight = dweight.defined() ? &dweight : nullptr,
                                 .dbias = dbias.defined() && !bias_apart ? &dbias : nullptr,
                                 .accumulate = params.accumulate});
        if (bias_apart) {
            kernels::LinearBackwardBias({.dy = dy, .dbias = dbias, .accumulate = params.accumulate});
        }
        if (needs_input_grad(0)) {
            grads[0].value = DistTensor::Local(std::move(dx));
        }
        grads[1] = params.GradOf(0, nullptr, wreq, {});
        grads[2] = params.GradOf(1, nullptr, breq, {});
        return grads;
    }
    void ReleaseSaved() override {
        x_ = Tensor();
        weight_ = Tensor();
    }

private:
    Tensor x_;
    Tensor weight_;
    Shape x_shape_;
    Shape weight_shape_;
};

class GeluFunction final : public Function {
public:
    explicit GeluFunction(kernels::GeluApproximation a) : approximation_(a) {}
    std::string name() const override { return "GeluBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        return Output(dist::GeluForward(in[0], approximation_));
    }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override { x_ = in[0]; }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::GeluBackward(g[0], x_, approximation_)}};
    }
    void ReleaseSaved() override { x_ = DistTensor(); }

private:
    kernels::GeluApproximation approximation_;
    DistTensor x_;
};

/// What a grad rule reads of a forward operand: its spec on a mesh; for a local operand only its shape (a local
/// backward reads no layout), which costs no more than the DistTensor copy these Functions used to keep.
spmd::TensorSpec SpecForGrad(const DistTensor& t) {
    return t.is_local() ? spmd::TensorSpec{.shape = t.global_shape(), .layout = {}} : t.spec();
}

class AddFunction final : public Function {
public:
    explicit AddFunction(double alpha) : alpha_(alpha) {}
    std::string name() const override { return "AddBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::Add(in[0], in[1], alpha_)); }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        // The grad rule reads the operands' shapes and layouts only: their memory is not kept (torch's AddBackward
        // saves nothing either).
        a_spec_ = SpecForGrad(in[0]);
        b_spec_ = SpecForGrad(in[1]);
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::AddBackward({.dout = g[0],
                                  .a = a_spec_,
                                  .b = b_spec_,
                                  .alpha = alpha_,
                                  .need_a = needs_input_grad(0),
                                  .need_b = needs_input_grad(1)});
    }

private:
    double alpha_;
    spmd::TensorSpec a_spec_, b_spec_;
};

class BiasAddFunction final : public Function {
public:
    std::string name() const override { return "BiasAddBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::BiasAdd(in[0], in[1])); }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        // Like Add: the bias grad's rule reads shapes and layouts, never x's or the bias's values.
        if (needs_input_grad(1)) {
            x_spec_ = SpecForGrad(in[0]);
            bias_spec_ = SpecForGrad(in[1]);
        }
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (needs_input_grad(0)) {
            grads[0].value = g[0];
        }
        if (needs_input_grad(1)) {
            // db = Σ_rows dy (the bias grad of a Linear whose bias the caller adds: skip_bias_add).
            grads[1] = dist::BiasAddBackward(g[0], x_spec_, bias_spec_, GradSinkFor(1));
        }
        return grads;
    }

private:
    spmd::TensorSpec x_spec_, bias_spec_;
};

class ScaleFunction final : public Function {
public:
    explicit ScaleFunction(double alpha) : alpha_(alpha) {}
    std::string name() const override { return "ScaleBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::Scale(in[0], alpha_)); }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::Scale(g[0], alpha_)}};
    }

private:
    double alpha_;
};

/// The same values in another dtype, in the same layout; the gradient goes back in the input's dtype.
class CastFunction final : public Function {
public:
    explicit CastFunction(DType dtype) : dtype_(dtype) {}
    std::string name() const override { return "CastBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        from_ = in[0].dtype();
        return Output(in[0].WithLocal(in[0].local().To(dtype_)));
    }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = g[0].WithLocal(g[0].local().To(from_))}};
    }

private:
    DType dtype_;
    DType from_ = DType::kFloat32;
};

class SumFunction final : public Function {
public:
    SumFunction(std::vector<int> dims, bool keepdim, bool mean)
        : dims_(std::move(dims)), keepdim_(keepdim), mean_(mean) {}
    std::string name() const override { return mean_ ? "MeanBackward" : "SumBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        return Output(dist::Sum(in[0], {.dims = dims_, .keepdim = keepdim_, .mean = mean_}));
    }
    // The backward broadcasts dy back to x's shape in the rule's layout: x's spec, not its memory.
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override { x_spec_ = SpecForGrad(in[0]); }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::SumBackward(g[0], x_spec_, {.dims = dims_, .keepdim = keepdim_, .mean = mean_})}};
    }

private:
    std::vector<int> dims_;
    bool keepdim_;
    bool mean_;
    spmd::TensorSpec x_spec_;
};

class MatmulFunction final : public Function {
public:
    std::string name() const override { return "MatmulBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::Matmul(in[0], in[1])); }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        a_ = in[0];
        b_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::MatmulBackward(
            {.dout = g[0], .a = a_, .b = b_, .need_a = needs_input_grad(0), .need_b = needs_input_grad(1)});
    }
    void ReleaseSaved() override {
        a_ = DistTensor();
        b_ = DistTensor();
    }

private:
    DistTensor a_, b_;
};

class OuterFunction final : public Function {
public:
    std::string name() const override { return "OuterBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::Outer(in[0], in[1])); }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        x_ = in[0];
        y_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::OuterBackward(
            {.dout = g[0], .x = x_, .y = y_, .need_x = needs_input_grad(0), .need_y = needs_input_grad(1)});
    }
    void ReleaseSaved() override {
        x_ = DistTensor();
        y_ = DistTensor();
    }

private:
    DistTensor x_, y_;
};

/// A table lookup as a Function over its dist ops: Embedding (one row per id) and EmbeddingBag (the rows summed over
/// the ids' dim 0). The table's gradient needs the ids (and the table's layout); the ids get none.
using LookupForward = DistTensor (*)(const DistTensor& ids, const DistTensor& weight);
using LookupBackward = Grad (*)(const DistTensor& dout, const DistTensor& ids, const DistTensor& weight,
                                const dist::GradSink& sink);

class LookupFunction final : public Function {
public:
    LookupFunction(std::string name, LookupForward forward, LookupBackward backward)
        : name_(std::move(name)), forward_(forward), backward_(backward) {}
    std::string name() const override { return name_; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(forward_(in[0], in[1])); }
    void SetupContext(const Inputs& in, const std::vector<DistTensor>&) override {
        if (needs_input_grad(1)) {
            ids_ = in[0];
            weight_ = in[1];
        }
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (needs_input_grad(1)) {
            grads[1] = backward_(g[0], ids_, weight_, GradSinkFor(1));
        }
        return grads;
    }
    void ReleaseSaved() override {
        ids_ = DistTensor();
        weight_ = DistTensor();
    }

private:
    std::string name_;
    LookupForward forward_;
    LookupBackward backward_;
    DistTensor ids_, weight_;
};

class CrossEntropyFunction final : public Function {
public:
    explicit CrossEntropyFunction(dist::CrossEntropyOptions options) : options_(options) {}
    std::string name() const override { return "CrossEntropyBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override {
        dist::CrossEntropyResult r = dist::CrossEntropyForward(in[0], in[1], options_);
        saved_ = std::move(r.saved);
        return {std::move(r.loss)};
    }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (needs_input_grad(0)) {
            grads[0].value = dist::CrossEntropyBackward(g[0], saved_);
        }
        return grads;
    }
    void ReleaseSaved() override { saved_ = {}; }

private:
    dist::CrossEntropyOptions options_;
    dist::CrossEntropySaved saved_;
};

class RedistributeFunction final : public Function {
public:
    explicit RedistributeFunction(spmd::Layout layout) : layout_(std::move(layout)) {}
    std::string name() const override { return "RedistributeBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs& in) override { return Output(dist::MoveToLayout(in[0], layout_)); }
    void SetupContext(const Inputs&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        // The gradient as it comes; Function::Apply moves it to the input's layout (without its Partials): the
        // all-reduce of a P->R forward has a free backward, an all-gather's backward is a slice.
        return {Grad{.value = g[0]}};
    }

private:
    spmd::Layout layout_;
};

} // namespace

Variable Linear(const Variable& x, const Variable& weight, const Variable& bias) {
    constexpr const char* kOp = "autograd::Linear";
    for (const Variable* v : {&x, &weight, &bias}) {
        SHARDLINE_CHECK(!v->defined() || v->value().is_local(), kOp,
                        "takes local Variables (ColumnParallelLinear / RowParallelLinear run on a mesh), got {}",
                        v->value().ToString());
    }
    return One(Function::Apply(std::make_shared<LinearFunction>(), {x, weight, bias}));
}
Variable Gelu(const Variable& x, kernels::GeluApproximation approximation) {
    return One(Function::Apply(std::make_shared<GeluFunction>(approximation), {x}));
}
Variable Add(const Variable& a, const Variable& b, double alpha) {
    return One(Function::Apply(std::make_shared<AddFunction>(alpha), {a, b}));
}
Variable BiasAdd(const Variable& x, const Variable& bias) {
    return One(Function::Apply(std::make_shared<BiasAddFunction>(), {x, bias}));
}
Variable Scale(const Variable& x, double alpha) {
    return One(Function::Apply(std::make_shared<ScaleFunction>(alpha), {x}));
}
Variable Cast(const Variable& x, DType dtype) {
    SHARDLINE_CHECK(x.defined(), "autograd::Cast", "x is undefined");
    if (x.dtype() == dtype) {
        return x;
    }
    return One(Function::Apply(std::make_shared<CastFunction>(dtype), {x}));
}
Variable Sum(const Variable& x, const std::vector<int>& dims, bool keepdim) {
    return One(Function::Apply(std::make_shared<SumFunction>(dims, keepdim, false), {x}));
}
Variable Mean(const Variable& x, const std::vector<int>& dims, bool keepdim) {
    return One(Function::Apply(std::make_shared<SumFunction>(dims, keepdim, true), {x}));
}
Variable Matmul(const Variable& a, const Variable& b) {
    return One(Function::Apply(std::make_shared<MatmulFunction>(), {a, b}));
}
Variable Outer(const Variable& x, const Variable& y) {
    return One(Function::Apply(std::make_shared<OuterFunction>(), {x, y}));
}
Variable Embedding(const Variable& ids, const Variable& weight) {
    SHARDLINE_CHECK(!ids.requires_grad(), "autograd::Embedding", "ids have no gradient; got ids requiring grad");
    return One(Function::Apply(
        std::make_shared<LookupFunction>("EmbeddingBackward", &dist::EmbeddingForward, &dist::EmbeddingBackward),
        {ids, weight}));
}
Variable EmbeddingBag(const Variable& ids, const Variable& weight) {
    SHARDLINE_CHECK(!ids.requires_grad(), "autograd::EmbeddingBag", "ids have no gradient; got ids requiring grad");
    return One(Function::Apply(std::make_shared<LookupFunction>("EmbeddingBagBackward", &dist::EmbeddingBagForward,
                                                                &dist::EmbeddingBagBackward),
                               {ids, weight}));
}
Variable CrossEntropy(const Variable& logits, const Variable& labels, const dist::CrossEntropyOptions& options) {
    SHARDLINE_CHECK(!labels.requires_grad(), "autograd::CrossEntropy",
                    "labels have no gradient; got labels requiring grad");
    return One(Function::Apply(std::make_shared<CrossEntropyFunction>(options), {logits, labels}));
}
Variable Redistribute(const Variable& x, const spmd::Layout& layout) {
    return One(Function::Apply(std::make_shared<RedistributeFunction>(layout), {x}));
}

} // namespace shardline::autograd
