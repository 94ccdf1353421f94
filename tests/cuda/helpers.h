#pragma once

// The CUDA test fixture and the helpers the tests in tests/cuda share. Every CUDA test derives from CudaTest (or
// CudaParamTest<P>): without a GPU it skips with the reason; with one it runs with TF32 off (fp32 GEMMs are true fp32,
// so RelativeTolerance(kFloat32) holds whatever SHARDLINE_ALLOW_TF32 says) and with the provider environment cleared
// (each test says which provider it measures).

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/context.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>

#include "reference.h"

namespace shardline {
/// Readable parameter values in GoogleTest's output ("bfloat16", not "1-byte object <02>").
inline void PrintTo(DType dtype, std::ostream* os) {
    *os << DTypeName(dtype);
}
} // namespace shardline

namespace shardline::testing {

inline Device Gpu() {
    return Device::CUDA(0);
}

/// The dtypes the CUDA kernels take.
inline auto CudaDTypes() {
    return ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
}
inline auto HalfDTypes() {
    return ::testing::Values(DType::kFloat16, DType::kBFloat16);
}

/// "float32", "float16", "bfloat16" as the parameter's test name.
inline std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) {
    return std::string(DTypeName(info.param));
}

/// "fp32", "fp16", "bf16" for printed lines.
inline std::string_view ShortDTypeName(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return "fp32";
    case DType::kFloat16:
        return "fp16";
    case DType::kBFloat16:
        return "bf16";
    case DType::kFloat64:
        return "fp64";
    case DType::kInt64:
        return "i64";
    }
    return "?";
}

/// The tolerance of one check (plus SubnormalTolerance(dtype) per rounding, absolute): RelativeTolerance(dtype) (tests/common/reference.cc, the one place that holds the
/// per-dtype numbers) times the number of roundings to `dtype` the kernel may make on the way from exact inputs to
/// the output: 1 for a correctly rounded result (a plain GEMM with fp32 accumulation, an elementwise op, a reduction);
/// 2 where an intermediate is rounded first (a broadcast matmul grad before its batch sum); the named budgets below
/// for epilogues.
inline double Tolerance(DType dtype, int roundings = 1) {
    return RelativeTolerance(dtype) * roundings;
}

/// The budget of a GEMM output that passes through an epilogue (bias, GELU aux, bias grad) or adds beta·C: cuBLASLt's
/// half-precision kernels may run the epilogue in the output precision (measured on an H200: fp16 outputs of the
/// GELU_AUX, BGRADB and beta = 1 kernels up to ~1 ulp off, twice a correct rounding), so two roundings.
inline constexpr int kEpilogueRoundings = 2;
/// The budget of an output whose bias may be added after the GEMM output was rounded: round(round(X·Wᵀ) + b), as the
/// legacy provider computes it and as the default provider does when it falls back to separate epilogue kernels
/// (batched problems, an aux leading dimension not divisible by 8, no cuBLASLt algorithm). The error is up to
/// u·|X·Wᵀ| + u·|y|, and |X·Wᵀ| reaches about 3·rms(y) in the tails of random data. The fused path's own precision is
/// asserted separately (kernels_bias_epilogue_precision_test.cc, kernels_provider_test.cc).
inline constexpr int kUnfusedBiasRoundings = 3;
/// The budget of a GELU epilogue's activation (GELU_AUX forward, DGELU backward): the (possibly rounded)
/// pre-activation's error passes through gelu' (at most 1.13), cuBLASLt evaluates gelu/gelu' with its own approximation
/// (measured on an H200: fp32 DGELU up to 2.4e-5 relative), then the result is rounded.
inline constexpr int kGeluEpilogueRoundings = 4;

inline ::testing::AssertionResult ValuesMatch(const Values& actual, const Values& expected, DType dtype,
                                              int roundings = 1) {
    const std::string diff =
        CompareValues(actual, expected, Tolerance(dtype, roundings), SubnormalTolerance(dtype) * roundings);
    if (diff.empty()) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << diff;
}

inline ::testing::AssertionResult ValuesMatch(const Tensor& actual, const Values& expected, DType dtype,
                                              int roundings = 1) {
    return ValuesMatch(actual.ToDoubleVector(), expected, dtype, roundings);
}

/// A normal(mean, stddev) tensor on the GPU from the counter-based RNG.
inline Tensor RandomGpu(const Shape& shape, DType dtype, std::uint64_t seed, std::string_view name, double stddev = 1.0,
                        double mean = 0.0) {
    return RandomTensor(shape, dtype, Gpu(), seed, name, RandomDistribution::kNormal, mean, stddev);
}

/// Each value rounded to `dtype` (double → float → dtype, round to nearest even, as the library's host conversion).
inline Values RoundTo(const Values& values, DType dtype) {
    if (values.empty()) {
        return {};
    }
    const Tensor t = Tensor::FromVector(values, Shape{static_cast<std::int64_t>(values.size())}, DType::kFloat64);
    return t.To(dtype).ToDoubleVector();
}

/// Σ|v|: a random operand must not be all zeros (a test on zeros cannot fail).
inline double AbsSum(const Values& v) {
    double s = 0.0;
    for (double x : v) {
        s += x < 0 ? -x : x;
    }
    return s;
}

/// The raw bytes of a tensor, copied to the host.
inline std::vector<unsigned char> HostBytes(const Tensor& t) {
    const Tensor host = t.To(Device::CPU());
    const auto* p = static_cast<const unsigned char*>(host.data());
    return std::vector<unsigned char>(p, p + host.nbytes());
}

/// A copy of `src` whose data pointer sits `offset_elements` elements past the start of a pool allocation, so it is
/// not 16-byte aligned (pool allocations are). `view` borrows `backing`'s memory: keep the struct alive.
struct MisalignedTensor {
    Tensor backing;
    Tensor view;
};
inline MisalignedTensor MisalignedCopy(const Tensor& src, std::int64_t offset_elements = 1) {
    MisalignedTensor m;
    m.backing = Tensor::Empty(Shape{src.numel() + offset_elements}, src.dtype(), src.device());
    m.backing.Fill(0.0);
    char* base =
        static_cast<char*>(m.backing.data()) + offset_elements * static_cast<std::int64_t>(ElementSize(src.dtype()));
    m.view = Tensor::FromBlob(base, src.shape(), src.dtype(), src.device());
    m.view.CopyFrom(src);
    return m;
}

/// Sets (or, with nullopt, unsets) an environment variable for the scope's lifetime.
class ScopedEnv {
public:
    ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
        if (const char* old = std::getenv(name); old != nullptr) {
            old_ = std::string(old);
        }
        Apply(value);
    }
    ~ScopedEnv() { Apply(old_); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    void Apply(const std::optional<std::string>& value) {
        if (value.has_value()) {
            ::setenv(name_, value->c_str(), 1);
        } else {
            ::unsetenv(name_);
        }
    }
    const char* name_;
    std::optional<std::string> old_;
};

/// Skips without a GPU; otherwise TF32 off and the provider environment cleared for the test, restored after.
class CudaTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (CudaDeviceCount() == 0) {
            GTEST_SKIP() << "no CUDA device: shardline::CudaDeviceCount() == 0 (this build has CUDA, but no GPU or "
                            "driver is visible; run on a GPU host, see scripts/gpu_check.sh)";
        }
        CudaContext& ctx = CudaContext::Get(0);
        saved_tf32_ = ctx.allow_tf32();
        ctx.SetAllowTf32(false);
        provider_env_.emplace("SHARDLINE_PROVIDER", std::nullopt);
        linear_impl_env_.emplace("SHARDLINE_LINEAR_IMPL", std::nullopt);
        kernels::ResetProviderSelection();
        active_ = true;
    }

    void TearDown() override {
        if (!active_) {
            return;
        }
        Synchronize(Gpu());
        CudaContext::Get(0).SetAllowTf32(saved_tf32_);
        linear_impl_env_.reset();
        provider_env_.reset();
        kernels::ResetProviderSelection();
    }

private:
    bool active_ = false;
    bool saved_tf32_ = false;
    std::optional<ScopedEnv> provider_env_;
    std::optional<ScopedEnv> linear_impl_env_;
};

template <class Param> class CudaParamTest : public CudaTest, public ::testing::WithParamInterface<Param> {};

/// Selects a global provider for the scope, then returns to what the environment says (also when an ASSERT returns
/// early from the test).
class ScopedProvider {
public:
    explicit ScopedProvider(std::string_view provider) { kernels::SetProvider(provider); }
    ~ScopedProvider() { kernels::ResetProviderSelection(); }
    ScopedProvider(const ScopedProvider&) = delete;
    ScopedProvider& operator=(const ScopedProvider&) = delete;
};

} // namespace shardline::testing
