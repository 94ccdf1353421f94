#pragma once

// The helpers every kernel and core test shares, on every device: the dtypes each device's kernels take, value checks
// against the float64 references of reference.h with the rounding budgets they allow, and the fixtures that run a case
// on its device.
//
// A device-parameterised suite (tests/kernels) derives from DeviceTest<Param>, whose parameter starts with a
// DeviceDType, and is instantiated once per device by SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P: its cases are named
// `Cpu/<Suite>.<Case>/<param>` and `Cuda/<Suite>.<Case>/<param>`. The naming is the label rule of tests/CMakeLists.txt:
// a case whose full name starts with `Cuda` (that instantiation, or a suite of one device such as CudaTest) is a CUDA
// case (label cuda); every other case is a CPU case (label cpu). A CUDA case skips with the reason when no GPU is
// visible; with one it runs with TF32 off (fp32 GEMMs are true fp32, so RelativeTolerance(kFloat32) holds whatever
// SHARDLINE_ALLOW_TF32 says). Every case runs with the provider environment cleared: each test says which provider it
// measures.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/dispatcher.h>

#include "reference.h"

namespace shardline {
/// Readable parameter values in GoogleTest's output ("bfloat16", not "1-byte object <02>").
inline void PrintTo(DType dtype, std::ostream *os) { *os << DTypeName(dtype); }
inline void PrintTo(const Device &device, std::ostream *os) { *os << ToString(device); }
} // namespace shardline

namespace shardline::testing {

// ---------------------------------------------------------------------------------------------------------------------
// Dtypes

/// The dtypes the kernels of a device take: the CPU's float32 and float64; CUDA's float32, float16 and bfloat16.
inline std::vector<DType> KernelDTypes(DeviceType type) {
    if (type == DeviceType::kCPU) {
        return {DType::kFloat32, DType::kFloat64};
    }
    return {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
}

inline auto CpuDTypes() { return ::testing::ValuesIn(KernelDTypes(DeviceType::kCPU)); }
inline auto CudaDTypes() { return ::testing::ValuesIn(KernelDTypes(DeviceType::kCUDA)); }
inline auto HalfDTypes() { return ::testing::Values(DType::kFloat16, DType::kBFloat16); }

/// "float32", "float16", "bfloat16" as the parameter's test name.
inline std::string DTypeParamName(const ::testing::TestParamInfo<DType> &info) {
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

// ---------------------------------------------------------------------------------------------------------------------
// Value checks

/// The tolerance of one check (plus SubnormalTolerance(dtype) per rounding, absolute): RelativeTolerance(dtype)
/// (reference.cc, the one place that holds the per-dtype numbers) times the number of roundings to `dtype` the kernel
/// may make on the way from exact inputs to the output: 1 for a correctly rounded result (a plain GEMM with fp32
/// accumulation, an elementwise op, a reduction); 2 where an intermediate is rounded first (a broadcast matmul grad
/// before its batch sum); the named budgets below for epilogues.
inline double Tolerance(DType dtype, double roundings = 1) { return RelativeTolerance(dtype) * roundings; }

// The CUDA budgets. A device-parameterised case passes them through DeviceTest::OnCuda, so that the CPU keeps its
// single rounding: the CPU kernels apply epilogues in double or in the output's precision on a BLAS result, which the
// CPU dtypes' tolerances cover.

/// The budget of a GEMM output that passes through an epilogue (bias, GELU aux, bias grad) or adds beta·C: cuBLASLt's
/// half-precision kernels may run the epilogue in the output precision (measured on an H200: fp16 outputs of the
/// GELU_AUX, BGRADB and beta = 1 kernels up to ~1 ulp off, twice a correct rounding), so two roundings.
inline constexpr int kEpilogueRoundings = 2;
/// The budget of an output whose bias may be added after the GEMM output was rounded: round(round(X·Wᵀ) + b), as the
/// legacy provider computes it and as the default provider does when it falls back to separate epilogue kernels
/// (batched problems, an aux leading dimension not divisible by 8, no cuBLASLt algorithm). The error is up to
/// u·|X·Wᵀ| + u·|y|, and |X·Wᵀ| reaches about 3·rms(y) in the tails of random data. The fused path's own precision is
/// asserted separately (tests/cuda/kernels_bias_epilogue_precision_test.cc, tests/cuda/kernels_provider_test.cc).
inline constexpr int kUnfusedBiasRoundings = 3;
/// The budget of a GELU epilogue's activation (GELU_AUX forward, DGELU backward): the (possibly rounded)
/// pre-activation's error passes through gelu' (at most 1.13), cuBLASLt evaluates gelu/gelu' with its own
/// approximation (measured on an H200: fp32 DGELU's gelu' up to 2.4e-5 off), then the result is rounded. The CPU checks
/// hold the same budget.
inline constexpr int kGeluEpilogueRoundings = 4;

/// actual (any dtype, read back as float64) against a float64 reference: CompareValues with Tolerance(dtype,
/// roundings) and SubnormalTolerance(dtype) per rounding.
inline ::testing::AssertionResult ValuesMatch(const Values &actual, const Values &expected, DType dtype,
                                              double roundings = 1) {
    const std::string diff =
        CompareValues(actual, expected, Tolerance(dtype, roundings), SubnormalTolerance(dtype) * roundings);
    if (diff.empty()) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << diff;
}

inline ::testing::AssertionResult ValuesMatch(const Tensor &actual, const Values &expected, DType dtype,
                                              double roundings = 1) {
    return ValuesMatch(actual.ToDoubleVector(), expected, dtype, roundings);
}

/// cuBLASLt's fp32 DGELU epilogue evaluates gelu'(x) with its own approximation, up to ~2.4e-5 off in absolute terms
/// (docs/kernels.md): dx = g ⊙ gelu'(pre) then carries an error of that times |g|, which near gelu's zero of slope
/// (pre ≈ -0.75) no bound relative to dx itself covers. The half types round far more coarsely than that.
inline constexpr double kCublasLtFp32GeluGradError = 3e-5;

/// dx = g ⊙ gelu'(pre) (or Σ_rows of it: pass Σ_rows |g| as g_abs) against its float64 reference: ValuesMatch's bound
/// plus, for float32, kCublasLtFp32GeluGradError·|g| per element.
inline ::testing::AssertionResult GeluGradMatch(const Values &actual, const Values &expected, const Values &g_abs,
                                                DType dtype, double roundings) {
    if (dtype != DType::kFloat32) {
        return ValuesMatch(actual, expected, dtype, roundings);
    }
    // Take the approximation's share off each element's error, then hold the rest to the usual bound.
    Values shifted(actual.size());
    for (std::size_t i = 0; i < actual.size() && i < expected.size() && i < g_abs.size(); ++i) {
        const double err = actual[i] - expected[i];
        const double slack = kCublasLtFp32GeluGradError * std::abs(g_abs[i]);
        const double rest = std::abs(err) <= slack ? 0.0 : err - std::copysign(slack, err);
        shifted[i] = expected[i] + rest;
    }
    return ValuesMatch(actual.size() == expected.size() ? shifted : actual, expected, dtype, roundings);
}
inline ::testing::AssertionResult GeluGradMatch(const Tensor &actual, const Values &expected, const Values &g_abs,
                                                DType dtype, double roundings) {
    return GeluGradMatch(actual.ToDoubleVector(), expected, g_abs, dtype, roundings);
}

/// Σ|v|: a random operand must not be all zeros (a test on zeros cannot fail).
inline double AbsSum(const Values &v) {
    double s = 0.0;
    for (double x : v) {
        s += x < 0 ? -x : x;
    }
    return s;
}

/// a + scale·b, elementwise: the expectation of an accumulating kernel (old + new, old + step·new).
inline Values AddScaled(const Values &a, const Values &b, double scale = 1.0) {
    Values out(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
        out[i] = a[i] + scale * b[i];
    }
    return out;
}

/// Each value rounded to `dtype` (double → float → dtype, round to nearest even, as the library's host conversion).
inline Values RoundTo(const Values &values, DType dtype) {
    if (values.empty()) {
        return {};
    }
    const Tensor t = Tensor::FromVector(values, Shape{static_cast<std::int64_t>(values.size())}, DType::kFloat64);
    return t.To(dtype).ToDoubleVector();
}

/// The message of the ErrorType that `f` throws; fails the test (and returns "") when it throws nothing or another
/// type.
template <class ErrorType> std::string MessageOf(const std::function<void()> &f) {
    try {
        f();
    } catch (const ErrorType &e) {
        return e.what();
    } catch (const std::exception &e) {
        ADD_FAILURE() << "threw the wrong type: " << e.what();
        return {};
    }
    ADD_FAILURE() << "threw nothing";
    return {};
}

/// The dtype of a main grad (the float32 gradient accumulator of half or float32 parameters) on `device`: float32,
/// except for float64 parameters on the CPU, whose GEMM takes one dtype for all its operands and so accumulates
/// float64 data into a float64 grad.
inline DType MainGradDType(const Device &device, DType dtype) {
    return device.is_cpu() && dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// ---------------------------------------------------------------------------------------------------------------------
// Tensors

inline Device Gpu() { return Device::CUDA(0); }

/// A normal(mean, stddev) tensor on the GPU from the counter-based RNG.
inline Tensor RandomGpu(const Shape &shape, DType dtype, std::uint64_t seed, std::string_view name, double stddev = 1.0,
                        double mean = 0.0) {
    return RandomTensor(shape, dtype, Gpu(), seed, name, RandomDistribution::kNormal, mean, stddev);
}

/// The raw bytes of a tensor, copied to the host.
inline std::vector<unsigned char> HostBytes(const Tensor &t) {
    const Tensor host = t.To(Device::CPU());
    const auto *p = static_cast<const unsigned char *>(host.data());
    return std::vector<unsigned char>(p, p + host.nbytes());
}

/// A copy of `src` whose data pointer sits `offset_elements` elements past the start of an allocation, so it is not
/// 16-byte aligned (allocations are). `view` borrows `backing`'s memory: keep the struct alive.
struct MisalignedTensor {
    Tensor backing;
    Tensor view;
};
inline MisalignedTensor MisalignedCopy(const Tensor &src, std::int64_t offset_elements = 1) {
    MisalignedTensor m;
    m.backing = Tensor::Empty(Shape{src.numel() + offset_elements}, src.dtype(), src.device());
    m.backing.Fill(0.0);
    char *base =
        static_cast<char *>(m.backing.data()) + offset_elements * static_cast<std::int64_t>(ElementSize(src.dtype()));
    m.view = Tensor::FromBlob(base, src.shape(), src.dtype(), src.device());
    m.view.CopyFrom(src);
    return m;
}

// ---------------------------------------------------------------------------------------------------------------------
// Environment and providers

/// Sets (or, with nullopt, unsets) an environment variable for the scope's lifetime.
class ScopedEnv {
public:
    ScopedEnv(const char *name, std::optional<std::string> value) : name_(name) {
        if (const char *old = std::getenv(name); old != nullptr) {
            old_ = std::string(old);
        }
        Apply(value);
    }
    ~ScopedEnv() { Apply(old_); }
    ScopedEnv(const ScopedEnv &) = delete;
    ScopedEnv &operator=(const ScopedEnv &) = delete;

private:
    void Apply(const std::optional<std::string> &value) {
        if (value.has_value()) {
            ::setenv(name_, value->c_str(), 1);
        } else {
            ::unsetenv(name_);
        }
    }
    const char *name_;
    std::optional<std::string> old_;
};

/// Selects a global provider for the scope, then returns to what the environment says (also when an ASSERT returns
/// early from the test).
class ScopedProvider {
public:
    explicit ScopedProvider(std::string_view provider) { kernels::SetProvider(provider); }
    ~ScopedProvider() { kernels::ResetProviderSelection(); }
    ScopedProvider(const ScopedProvider &) = delete;
    ScopedProvider &operator=(const ScopedProvider &) = delete;
};

/// Why a test on `device` cannot run here (GTEST_SKIP's message), or "" when it can.
inline std::string DeviceUnavailableReason(const Device &device) {
    if (device.is_cpu()) {
        return {};
    }
    if (!SHARDLINE_HAVE_CUDA) {
        return "no CUDA device: this build has no CUDA (SHARDLINE_WITH_CUDA=OFF)";
    }
    if (CudaDeviceCount() == 0) {
        return "no CUDA device: shardline::CudaDeviceCount() == 0 (this build has CUDA, but no GPU or driver is "
               "visible; run on a GPU host, see scripts/gpu_check.sh)";
    }
    return {};
}

/// The environment of one test on its device, for the test's lifetime: the provider environment cleared, and on CUDA
/// TF32 off; everything restored when it ends (the fixture first waits for the device's queued work, so that a failure
/// there is the test's, not a destructor's).
class DeviceTestScope {
public:
    explicit DeviceTestScope(const Device &device) : device_(device) {
#if SHARDLINE_HAVE_CUDA
        if (device_.is_cuda()) {
            CudaContext &ctx = CudaContext::Get(device_.index);
            saved_tf32_ = ctx.allow_tf32();
            ctx.SetAllowTf32(false);
        }
#endif
        provider_env_.emplace("SHARDLINE_PROVIDER", std::nullopt);
        linear_impl_env_.emplace("SHARDLINE_LINEAR_IMPL", std::nullopt);
        kernels::ResetProviderSelection();
    }
    ~DeviceTestScope() {
#if SHARDLINE_HAVE_CUDA
        if (device_.is_cuda()) {
            CudaContext::Get(device_.index).SetAllowTf32(saved_tf32_);
        }
#endif
        linear_impl_env_.reset();
        provider_env_.reset();
        kernels::ResetProviderSelection();
    }
    DeviceTestScope(const DeviceTestScope &) = delete;
    DeviceTestScope &operator=(const DeviceTestScope &) = delete;

private:
    Device device_;
    [[maybe_unused]] bool saved_tf32_ = false;
    std::optional<ScopedEnv> provider_env_;
    std::optional<ScopedEnv> linear_impl_env_;
};

// ---------------------------------------------------------------------------------------------------------------------
// Fixtures

/// A test of one device's own behaviour on CUDA (a CUDA-only suite: `TEST_F(CudaTest, ...)`, or a CudaParamTest):
/// skips without a GPU; otherwise runs in a DeviceTestScope.
class CudaTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (const std::string reason = DeviceUnavailableReason(Gpu()); !reason.empty()) {
            GTEST_SKIP() << reason;
        }
        scope_.emplace(Gpu());
    }
    void TearDown() override {
        if (scope_.has_value()) {
            Synchronize(Gpu());
            scope_.reset();
        }
    }

private:
    std::optional<DeviceTestScope> scope_;
};

template <class Param> class CudaParamTest : public CudaTest, public ::testing::WithParamInterface<Param> {};

/// The device and dtype of one case of a device-parameterised suite: its parameter, or the first element of it.
struct DeviceDType {
    Device device;
    DType dtype;
};
inline void PrintTo(const DeviceDType &c, std::ostream *os) { *os << ToString(c.device) << " " << DTypeName(c.dtype); }

/// Every dtype the kernels of `type` take, on that device.
inline std::vector<DeviceDType> DeviceDTypeList(DeviceType type) {
    std::vector<DeviceDType> cases;
    for (const DType dtype : KernelDTypes(type)) {
        cases.push_back({type == DeviceType::kCPU ? Device::CPU() : Gpu(), dtype});
    }
    return cases;
}
inline auto DeviceDTypes(DeviceType type) { return ::testing::ValuesIn(DeviceDTypeList(type)); }
/// "float32": the case's name within its device's instantiation.
inline std::string DeviceDTypeName(const ::testing::TestParamInfo<DeviceDType> &info) {
    return std::string(DTypeName(info.param.dtype));
}

/// A case on every device: Param is a DeviceDType or a tuple that starts with one. A CUDA case skips without a GPU;
/// every case runs in a DeviceTestScope.
template <class Param = DeviceDType> class DeviceTest : public ::testing::TestWithParam<Param> {
protected:
    void SetUp() override {
        if (const std::string reason = DeviceUnavailableReason(device()); !reason.empty()) {
            GTEST_SKIP() << reason;
        }
        scope_.emplace(device());
    }
    void TearDown() override {
        if (scope_.has_value()) {
            Synchronize(device());
            scope_.reset();
        }
    }

    const DeviceDType &device_dtype() const {
        if constexpr (std::is_same_v<Param, DeviceDType>) {
            return this->GetParam();
        } else {
            return std::get<0>(this->GetParam());
        }
    }
    Device device() const { return device_dtype().device; }
    DType dtype() const { return device_dtype().dtype; }

    /// A tensor on the case's device filled by the counter-based RNG (normal(mean, stddev) by default): the same
    /// values on every device.
    Tensor Random(const Shape &shape, DType dtype, std::uint64_t seed, std::string_view name, double stddev = 1.0,
                  double mean = 0.0) const {
        return RandomTensor(shape, dtype, device(), seed, name, RandomDistribution::kNormal, mean, stddev);
    }
    /// Random garbage for an output the kernel must overwrite.
    Tensor Poison(const Shape &shape, DType dtype, std::string_view name = "poison") const {
        return Random(shape, dtype, 999, name, 100.0);
    }
    /// A host tensor (float64 values, `dtype`) moved to the case's device.
    Tensor OnDevice(const Values &values, const Shape &shape, DType dtype) const {
        return Tensor::FromVector(values, shape, DType::kFloat64).To(dtype).To(device());
    }
    /// A rounding budget of the CUDA kernels (the named budgets above) on CUDA; one rounding on the CPU.
    double OnCuda(double cuda_roundings) const { return device().is_cuda() ? cuda_roundings : 1.0; }

private:
    std::optional<DeviceTestScope> scope_;
};

/// The cases of a suite on `type`, for SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P: the device's dtypes combined with
/// the suite's own parameters.
template <class... Generators> auto DeviceCases(DeviceType type, Generators... generators) {
    if constexpr (sizeof...(Generators) == 0) {
        return DeviceDTypes(type);
    } else {
        return ::testing::Combine(DeviceDTypes(type), generators...);
    }
}

} // namespace shardline::testing

/// Instantiates a DeviceTest suite once per device, as `Cpu/<suite>...` and `Cuda/<suite>...` (the prefixes decide the
/// CTest label, see the top of this file). `cases` is a function DeviceType → the parameter generator; the optional
/// last argument names a case within its device's instantiation.
#define SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(suite, cases, ...)                                                   \
    INSTANTIATE_TEST_SUITE_P(Cpu, suite, cases(::shardline::DeviceType::kCPU) __VA_OPT__(, ) __VA_ARGS__);             \
    INSTANTIATE_TEST_SUITE_P(Cuda, suite, cases(::shardline::DeviceType::kCUDA) __VA_OPT__(, ) __VA_ARGS__)
