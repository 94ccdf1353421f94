// Uses the installed shardline through its umbrella header: a Linear forward on the CPU against a hand-computed
// answer, and the weight gradient of an nn::Linear through autograd against dW = dYᵀ·X.

#include <cmath>
#include <cstdio>

#include <shardline/shardline.h>

int main() {
    using namespace shardline;
    Tensor x = Tensor::Empty({3, 5}, DType::kFloat32);
    Tensor w = Tensor::Empty({4, 5}, DType::kFloat32);
    Tensor b = Tensor::Empty({4}, DType::kFloat32);
    FillRandom(x, RandomSpec{.seed = 7, .name = "x"});
    FillRandom(w, RandomSpec{.seed = 7, .name = "w"});
    FillRandom(b, RandomSpec{.seed = 7, .name = "b"});
    const Tensor y = kernels::LinearForward(x, w, &b);
    const auto xv = x.ToDoubleVector();
    const auto wv = w.ToDoubleVector();
    const auto bv = b.ToDoubleVector();
    const auto yv = y.ToDoubleVector();
    double worst = 0.0;
    for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 4; ++j) {
            double ref = bv[j];
            for (int k = 0; k < 5; ++k) {
                ref += xv[i * 5 + k] * wv[j * 5 + k];
            }
            worst = std::fmax(worst, std::fabs(ref - yv[i * 4 + j]));
        }
    }

    // Backward from dY = 1: dW[j, k] = Σ_i X[i, k].
    nn::Linear layer({.in_features = 5, .out_features = 4}, {.seed = 7, .name = "consumer"});
    const autograd::Variable out = layer.Forward(autograd::Variable(x));
    const dist::DistTensor ones = dist::DistTensor::Local(Tensor::Full({3, 4}, 1.0, DType::kFloat32));
    out.Backward(&ones);
    const auto dw = layer.weight.grad().local().ToDoubleVector();
    for (int j = 0; j < 4; ++j) {
        for (int k = 0; k < 5; ++k) {
            const double ref = xv[k] + xv[5 + k] + xv[10 + k];
            worst = std::fmax(worst, std::fabs(ref - dw[j * 5 + k]));
        }
    }
    std::printf("consumer: max |error| %.3g\n", worst);
    return worst < 1e-5 ? 0 : 1;
}
