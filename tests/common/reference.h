#pragma once

// Naive float64 references for the kernel tests, and value comparison helpers. Everything here works on
// row-major std::vector<double> so a test can build its expectation from Tensor::ToDoubleVector().

#include <cstdint>
#include <string>
#include <vector>

#include <shardline/core/dtype.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

namespace shardline::testing {

using Values = std::vector<double>;

/// Y[M,N] = X[M,K]·W[N,K]ᵀ (+ b[N]).
Values RefLinearForward(const Values& x, const Values& w, const Values* b, std::int64_t m, std::int64_t n,
                        std::int64_t k);
/// dX[M,K] = dY[M,N]·W[N,K].
Values RefLinearBackwardInput(const Values& dy, const Values& w, std::int64_t m, std::int64_t n, std::int64_t k);
/// dW[N,K] = dY[M,N]ᵀ·X[M,K].
Values RefLinearBackwardWeight(const Values& dy, const Values& x, std::int64_t m, std::int64_t n, std::int64_t k);
/// db[N] = Σ_rows dY[M,N].
Values RefColumnSum(const Values& dy, std::int64_t m, std::int64_t n);
/// Cross-entropy of [n, c] logits: loss[i] = logsumexp(x[i, :]) - x[i, label] (a label outside [0, c): no target
/// term, as a vocab shard that does not own the label).
Values RefCrossEntropyLoss(const Values& x, const Values& labels, std::int64_t n, std::int64_t c);
/// Its gradient: dx[i, j] = scale·dloss[i]·(softmax(x[i, :])[j] - [j == label]); dloss of size 1 is broadcast.
Values RefCrossEntropyGrad(const Values& x, const Values& labels, const Values& dloss, double scale, std::int64_t n,
                           std::int64_t c);
/// C = op(A)·op(B) on one matrix pair: A is [m,k] ([k,m] if trans_a), B is [k,n] ([n,k] if trans_b).
Values RefMatmul(const Values& a, const Values& b, std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a,
                 bool trans_b);
/// torch.matmul with batch broadcasting and optional transposes of the last two dims.
Values RefBatchedMatmul(const Values& a, const Shape& a_shape, const Values& b, const Shape& b_shape, bool trans_a,
                        bool trans_b, Shape* out_shape);
double RefGeluTanh(double x);
double RefGeluErf(double x);
double RefGeluTanhGrad(double x);
double RefGeluErfGrad(double x);

/// A dense two-layer MLP of [m, hidden] x: h = x·W1ᵀ + b1 ([m, ffn]), a = gelu_tanh(h) (a = h when !gelu),
/// y = a·W2ᵀ + b2 ([m, hidden]), and from dY every gradient (a null bias adds nothing; db1, db2 are still given).
struct RefMlpResult {
    Values y, dx, dw1, db1, dw2, db2;
};
RefMlpResult RefMlp(const Values& x, const Values& w1, const Values* b1, const Values& w2, const Values* b2,
                    const Values& dy, std::int64_t m, std::int64_t hidden, std::int64_t ffn, bool gelu);

/// A tensor of `shape` filled by the counter-based RNG (normal(0, 1) by default), on `device`.
Tensor RandomTensor(const Shape& shape, DType dtype, Device device, std::uint64_t seed, std::string_view name,
                    RandomDistribution distribution = RandomDistribution::kNormal, double a = 0.0, double b = 1.0);

/// Relative tolerance by dtype, written once for all kernel tests: fp64 1e-12, fp32 1e-5 (TF32 1e-3),
/// fp16 1e-3, bf16 1.6e-2 (about one ulp of the output, scaled by the reduction size in the check below).
double RelativeTolerance(DType dtype);

/// Absolute error of one correct rounding to `dtype` below its smallest normal number, where the relative bound no
/// longer holds: half of the smallest subnormal. Only fp16 reaches there on test data (2^-25 ≈ 3e-8, e.g. softmax
/// grads scaled by 1/N); 0 for the other dtypes (their subnormals are below 1e-38).
double SubnormalTolerance(DType dtype);

/// The check every kernel test uses: |actual - expected| <= atol + rtol·max(|expected|, rms(expected))
/// elementwise. The rms term absorbs cancellation in long sums (an output near zero made of large terms carries
/// the rounding of those terms, and random-data outputs have rms ≈ √K·|term|). Returns a message naming the worst
/// element, or an empty string when all pass (NaN never passes).
std::string CompareValues(const Values& actual, const Values& expected, double rtol, double atol = 0.0);

/// The mean absolute error of `actual` against `expected`.
double MeanAbsError(const Values& actual, const Values& expected);

} // namespace shardline::testing
