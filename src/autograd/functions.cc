#include <shardline/autograd/functions.h>

#include <shardline/core/error.h>
#include <shardline/kernels/linear.h>

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;

Variable One(std::vector<Variable> outputs) { return std::move(outputs.at(0)); }

class LinearFunction final : public Function {
public:
    explicit LinearFunction(LinearOptions options) : options_(std::move(options)) {}
    std::string name() const override { return "LinearBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        dist::LinearForwardResult r = dist::LinearForward(
            in[0], in[1], in[2].defined() ? &in[2] : nullptr,
            {.output_layout = options_.output_layout, .skip_bias = options_.skip_bias});
        saved_ = std::move(r.saved);
        return {std::move(r.y)};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override {
        // Only what the requested gradients need: x for dW, W for dX.
        if (!needs_input_grad(1)) {
            saved_.x_used = DistTensor();
        }
        if (needs_input_grad(0)) {
            weight_ = in[1];
        }
        need_bias_ = needs_input_grad(2) && saved_.bias_added;
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        dist::LinearGrads grads = dist::LinearBackward({.dy = g[0],
                                                        .saved = saved_,
                                                        .weight = weight_.defined() ? &weight_ : nullptr,
                                                        .need_input = needs_input_grad(0),
                                                        .need_weight = needs_input_grad(1),
                                                        .need_bias = need_bias_,
                                                        .weight_sink = GradSinkFor(1),
                                                        .bias_sink = GradSinkFor(2)});
        return {std::move(grads.dx), std::move(grads.dweight), std::move(grads.dbias)};
    }
    void ReleaseSaved() override {
        saved_ = {};
        weight_ = DistTensor();
    }

private:
    LinearOptions options_;
    dist::LinearSaved saved_;
    DistTensor weight_;
    bool need_bias_ = false;
};

class GeluFunction final : public Function {
public:
    explicit GeluFunction(kernels::GeluApproximation a) : approximation_(a) {}
    std::string name() const override { return "GeluBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::GeluForward(in[0], approximation_)};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override { x_ = in[0]; }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::GeluBackward(g[0], x_, approximation_)}};
    }
    void ReleaseSaved() override { x_ = DistTensor(); }

private:
    kernels::GeluApproximation approximation_;
    DistTensor x_;
};

class AddFunction final : public Function {
public:
    explicit AddFunction(double alpha) : alpha_(alpha) {}
    std::string name() const override { return "AddBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::Add(in[0], in[1], alpha_)};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override {
        // The grad rule needs the operands' layouts only; keep them without their data.
        a_spec_ = in[0];
        b_spec_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::AddBackward(g[0], a_spec_, b_spec_, alpha_, needs_input_grad(0), needs_input_grad(1));
    }
    void ReleaseSaved() override {
        a_spec_ = DistTensor();
        b_spec_ = DistTensor();
    }

private:
    double alpha_;
    DistTensor a_spec_, b_spec_;
};

class BiasAddFunction final : public Function {
public:
    std::string name() const override { return "BiasAddBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::BiasAdd(in[0], in[1])};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>& out) override {
        x_ = in[0];
        bias_ = in[1];
        (void)out;
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (needs_input_grad(0)) {
            grads[0].value = g[0];
        }
        if (needs_input_grad(1)) {
            // db = Σ_rows dy: the bias grad of a Linear whose GEMM had no bias.
            dist::LinearSaved saved;
            saved.x_spec = x_.spec();
            saved.bias_spec = bias_.spec();
            saved.gemm_output_layout = x_.layout();
            saved.bias_after_output = true;
            saved.bias_added = true;
            if (x_.is_local()) {
                grads[1].value = DistTensor::Local(kernels::LinearBackwardBias(g[0].local()));
            } else {
                grads[1] = dist::LinearBackward({.dy = g[0], .saved = saved, .weight = nullptr, .need_input = false,
                                                 .need_weight = false, .need_bias = true,
                                                 .weight_sink = dist::GradSink{}, .bias_sink = GradSinkFor(1)})
                               .dbias;
            }
        }
        return grads;
    }
    void ReleaseSaved() override {
        x_ = DistTensor();
        bias_ = DistTensor();
    }

private:
    DistTensor x_, bias_;
};

class ScaleFunction final : public Function {
public:
    explicit ScaleFunction(double alpha) : alpha_(alpha) {}
    std::string name() const override { return "ScaleBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override { return {dist::Scale(in[0], alpha_)}; }
    void SetupContext(const std::vector<DistTensor>&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::Scale(g[0], alpha_)}};
    }

private:
    double alpha_;
};

class SumFunction final : public Function {
public:
    SumFunction(std::vector<int> dims, bool keepdim, bool mean) : dims_(std::move(dims)), keepdim_(keepdim), mean_(mean) {}
    std::string name() const override { return mean_ ? "MeanBackward" : "SumBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::Sum(in[0], dims_, keepdim_, mean_)};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override { x_ = in[0]; }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return {Grad{.value = dist::SumBackward(g[0], x_, dims_, keepdim_, mean_)}};
    }
    void ReleaseSaved() override { x_ = DistTensor(); }

private:
    std::vector<int> dims_;
    bool keepdim_;
    bool mean_;
    DistTensor x_;
};

class MatmulFunction final : public Function {
public:
    std::string name() const override { return "MatmulBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override { return {dist::Matmul(in[0], in[1])}; }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override {
        a_ = in[0];
        b_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::MatmulBackward(g[0], a_, b_, needs_input_grad(0), needs_input_grad(1));
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
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override { return {dist::Outer(in[0], in[1])}; }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override {
        x_ = in[0];
        y_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        return dist::OuterBackward(g[0], x_, y_, needs_input_grad(0), needs_input_grad(1));
    }
    void ReleaseSaved() override {
        x_ = DistTensor();
        y_ = DistTensor();
    }

private:
    DistTensor x_, y_;
};

class EmbeddingFunction final : public Function {
public:
    std::string name() const override { return "EmbeddingBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::EmbeddingForward(in[0], in[1])};
    }
    void SetupContext(const std::vector<DistTensor>& in, const std::vector<DistTensor>&) override {
        ids_ = in[0];
        weight_ = in[1];
    }
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        std::vector<Grad> grads(2);
        if (needs_input_grad(1)) {
            grads[1] = dist::EmbeddingBackward(g[0], ids_, weight_, GradSinkFor(1));
        }
        return grads;
    }
    void ReleaseSaved() override {
        ids_ = DistTensor();
        weight_ = DistTensor();
    }

private:
    DistTensor ids_, weight_;
};

class CrossEntropyFunction final : public Function {
public:
    explicit CrossEntropyFunction(dist::CrossEntropyOptions options) : options_(options) {}
    std::string name() const override { return "CrossEntropyBackward"; }

protected:
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        dist::CrossEntropyResult r = dist::CrossEntropyForward(in[0], in[1], options_);
        saved_ = std::move(r.saved);
        return {std::move(r.loss)};
    }
    void SetupContext(const std::vector<DistTensor>&, const std::vector<DistTensor>&) override {}
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
    std::vector<DistTensor> Forward(const std::vector<DistTensor>& in) override {
        return {dist::MoveToLayout(in[0], layout_)};
    }
    void SetupContext(const std::vector<DistTensor>&, const std::vector<DistTensor>&) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor>& g) override {
        // The gradient as it comes; Function::Apply moves it to the input's layout (without its Partials): the
        // all-reduce of a P->R forward has a free backward, an all-gather's backward is a slice.
        return {Grad{.value = g[0]}};
    }

private:
    spmd::Layout layout_;
};

} // namespace

Variable Linear(const Variable& x, const Variable& weight, const Variable& bias, const LinearOptions& options) {
    return One(Function::Apply(std::make_shared<LinearFunction>(options), {x, weight, bias}));
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
    return One(Function::Apply(std::make_shared<EmbeddingFunction>(), {ids, weight}));
}
Variable CrossEntropy(const Variable& logits, const Variable& labels, const dist::CrossEntropyOptions& options) {
    SHARDLINE_CHECK(!labels.requires_grad(), "autograd::CrossEntropy", "labels have no gradient; got labels requiring grad");
    return One(Function::Apply(std::make_shared<CrossEntropyFunction>(options), {logits, labels}));
}
Variable Redistribute(const Variable& x, const spmd::Layout& layout) {
    return One(Function::Apply(std::make_shared<RedistributeFunction>(layout), {x}));
}

} // namespace shardline::autograd
