// Grouped Linear ops: argument checks and the default kernels, compositions over GroupedGemm (and LinearBackwardBias /
// BiasAdd per group for the bias), so they serve every device type and every provider that supplies GroupedGemm.

#include <atomic>

#include <shardline/core/env.h>
#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/grouped_gemm.h>
#include <shardline/kernels/grouped_linear.h>
#include <shardline/kernels/linear.h>

#include "checks.h"
#include "grouped_internal.h"
#include "register.h"

namespace shardline::kernels {
namespace {

/// W [E, out, in] of a kernel dtype of its device.
void CheckGroupedWeight(const Tensor& weight, std::string_view op, std::string_view name) {
    CheckTensor(weight, op, name);
    CheckDeviceDType(weight, op, name);
    SHARDLINE_CHECK_AS(ShapeError, weight.rank() == 3, op, "{} must be [experts, out_features, in_features], got {}",
                       name, weight.ToString());
    SHARDLINE_CHECK_AS(ShapeError, weight.size(0) > 0 && weight.size(1) > 0 && weight.size(2) > 0, op,
                       "{} must have experts, out_features and in_features > 0, got {}", name, weight.ToString());
}

/// A [T, features] matrix of rows grouped by expert.
void CheckRows(const Tensor& t, std::int64_t features, const Tensor& like, std::string_view op, std::string_view name) {
    CheckLike(t, name, like, "weight", op);
    SHARDLINE_CHECK_AS(ShapeError, t.rank() == 2 && t.size(1) == features, op,
                       "{} must be [tokens, {}] (rows grouped by expert; flatten leading dims first), got {}", name,
                       features, t.ToString());
}

/// group_sizes: int64 [E] on the host or on `device`; host sizes are checked here (each >= 0, Σ = rows), device
/// sizes by the provider that reads them.
void CheckGroupSizes(const Tensor& sizes, std::int64_t experts, std::int64_t rows, Device device, std::string_view op) {
    CheckTensor(sizes, op, "group_sizes");
    CheckIndexDType(sizes, op, "group_sizes");
    SHARDLINE_CHECK_AS(ShapeError, sizes.rank() == 1 && sizes.size(0) == experts, op,
                       "group_sizes must be [experts] = [{}], got {}", experts, sizes.ToString());
    SHARDLINE_CHECK_AS(DeviceError, sizes.device().is_cpu() || sizes.device() == device, op,
                       "group_sizes must be on the host or on the op's device {}, got {}", ToString(device),
                       sizes.ToString());
    if (sizes.device().is_cpu()) {
        HostGroupSizes(sizes.data_as<std::int64_t>(), experts, sizes.device(), rows, op);
    }
}

std::vector<std::int64_t> SizesOf(const Tensor& sizes, std::int64_t rows, std::string_view op) {
    return HostGroupSizes(sizes.data_as<std::int64_t>(), sizes.numel(), sizes.device(), rows, op);
}

Tensor RowsView(const Tensor& t, std::int64_t first, std::int64_t count) {
    const std::int64_t cols = t.size(-1);
    auto* base = static_cast<char*>(t.data()) + first * cols * static_cast<std::int64_t>(ElementSize(t.dtype()));
    return Tensor::FromBlob(base, Shape{count, cols}, t.dtype(), t.device());
}

Tensor GroupView(const Tensor& t, std::int64_t group) {
    Shape shape(t.shape().begin() + 1, t.shape().end());
    const std::int64_t elements = Numel(shape);
    auto* base = static_cast<char*>(t.data()) + group * elements * static_cast<std::int64_t>(ElementSize(t.dtype()));
    return Tensor::FromBlob(base, std::move(shape), t.dtype(), t.device());
}

GroupedGemmParams Problem(const Tensor& sizes, std::int64_t total, Device device) {
    GroupedGemmParams p;
    p.group_count = sizes.numel();
    p.sizes = sizes.data_as<std::int64_t>();
    p.sizes_device = sizes.device();
    p.total = total;
    p.device = device;
    return p;
}

} // namespace

namespace detail {
GroupedGemmParams GroupedDgradProblem(const GroupedLinearBackwardInputArgs& args) {
    const std::int64_t out = args.weight.size(1);
    const std::int64_t in = args.weight.size(2);
    // Row-major dX_e[M_e,in] = dY_e[M_e,out]·W_e[out,in]. Column-major dX_eᶜ[in,M_e] = W_eᶜ[in,out]·dY_eᶜ[out,M_e]:
    // W_e viewed [in,out] (ld in), dY_e viewed [out,M_e] (ld out), no transposes.
    GroupedGemmParams p = Problem(args.group_sizes, args.dy.size(0), args.dx.device());
    p.grouped_dim = GroupedDim::kN;
    p.m = in;
    p.k = out;
    p.a = {.data = args.weight.data(), .ld = in, .group_stride = out * in};
    p.a_type = args.weight.dtype();
    p.b = {.data = args.dy.data(), .ld = out, .row_stride = out};
    p.b_type = args.dy.dtype();
    p.c = {.data = args.dx.data(), .ld = in, .row_stride = in};
    p.c_type = args.dx.dtype();
    if (args.input_activation == LinearActivation::kGeluTanh) {
        // dX_e = (dY_e·W_e) ⊙ gelu_tanh'(Z_e): Z packed like dX.
        p.epilogue = GemmEpilogue::kDGelu;
        p.aux = {.data = args.pre_activation->data(), .ld = in, .row_stride = in};
    }
    return p;
}

GroupedGemmParams GroupedWgradProblem(const GroupedLinearBackwardWeightArgs& args) {
    const std::int64_t out = args.dy.size(1);
    const std::int64_t in = args.x.size(1);
    // Row-major dW_e[out,in] = dY_e[M_e,out]ᵀ·X_e[M_e,in]. Column-major dW_eᶜ[in,out] = X_eᶜ[in,M_e]·dY_eᶜ[out,M_e]ᵀ:
    // X_e viewed [in,M_e] (ld in), dY_e viewed [out,M_e] (ld out) and transposed; the reduction k = M_e is the
    // group's rows (k = 0: dW_e = beta·dW_e, zero or untouched). accumulate: beta = 1 (e.g. an fp32 main grad).
    GroupedGemmParams p = Problem(args.group_sizes, args.dy.size(0), args.dweight.device());
    p.trans_b = true;
    p.grouped_dim = GroupedDim::kK;
    p.m = in;
    p.n = out;
    p.a = {.data = args.x.data(), .ld = in, .row_stride = in};
    p.a_type = args.x.dtype();
    p.b = {.data = args.dy.data(), .ld = out, .row_stride = out};
    p.b_type = args.dy.dtype();
    p.c = {.data = args.dweight.data(), .ld = in, .group_stride = out * in};
    p.c_type = args.dweight.dtype();
    p.beta = args.accumulate ? 1.0 : 0.0;
    return p;
}
} // namespace detail

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Default kernels.

void DefaultGroupedLinearForward(const GroupedLinearForwardArgs& args) {
    const std::int64_t out = args.weight.size(1);
    const std::int64_t in = args.weight.size(2);
    // Per group, row-major Y_e[M_e,out] = X_e[M_e,in]·W_e[out,in]ᵀ. Column-major Y_eᶜ[out,M_e] = W_eᶜᵀ·X_eᶜ: W_e
    // viewed [in,out] (ld in, transposed; out·in elements per expert), X_e viewed [in,M_e] (ld in, in elements per
    // row); D_e is Y's rows (ld out). kBias adds b_e per row of Y_eᶜ, i.e. per output feature.
    GroupedGemmParams p = Problem(args.group_sizes, args.x.size(0), args.y.device());
    p.trans_a = true;
    p.grouped_dim = GroupedDim::kN;
    p.m = out;
    p.k = in;
    p.a = {.data = args.weight.data(), .ld = in, .group_stride = out * in};
    p.a_type = args.weight.dtype();
    p.b = {.data = args.x.data(), .ld = in, .row_stride = in};
    p.b_type = args.x.dtype();
    p.c = {.data = args.y.data(), .ld = out, .row_stride = out};
    p.c_type = args.y.dtype();
    if (args.bias != nullptr) {
        p.epilogue = GemmEpilogue::kBias;
        p.bias = args.bias->data();
        p.bias_type = args.bias->dtype();
        p.bias_group_stride = out;
    }
    GroupedGemm(p);
}

void DefaultGroupedLinearBackwardInput(const GroupedLinearBackwardInputArgs& args) {
    GroupedGemm(detail::GroupedDgradProblem(args));
}

void DefaultGroupedLinearBackwardWeight(const GroupedLinearBackwardWeightArgs& args) {
    GroupedGemm(detail::GroupedWgradProblem(args));
    if (args.dbias != nullptr) {
        GroupedLinearBackwardBias(GroupedLinearBackwardBiasArgs{
            .dy = args.dy, .group_sizes = args.group_sizes, .dbias = *args.dbias, .accumulate = args.accumulate});
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Public entry points: checks, then dispatch.

void GroupedLinearForward(const GroupedLinearForwardArgs& args) {
    constexpr std::string_view kOp = GroupedLinearForwardOp::kName;
    CheckGroupedWeight(args.weight, kOp, "weight");
    const std::int64_t experts = args.weight.size(0);
    const std::int64_t out = args.weight.size(1);
    CheckRows(args.x, args.weight.size(2), args.weight, kOp, "x");
    CheckRows(args.y, out, args.weight, kOp, "y");
    SHARDLINE_CHECK_AS(ShapeError, args.y.size(0) == args.x.size(0), kOp, "y must have x's {} rows, got x {} and y {}",
                       args.x.size(0), args.x.ToString(), args.y.ToString());
    if (args.bias != nullptr) {
        CheckLike(*args.bias, "bias", args.weight, "weight", kOp);
        CheckShape(*args.bias, Shape{experts, out}, kOp, "bias");
    }
    CheckGroupSizes(args.group_sizes, experts, args.x.size(0), args.weight.device(), kOp);
    if (args.y.numel() == 0) {
        return;
    }
    Dispatch<GroupedLinearForwardOp>(args.y.device().type, args);
}

Tensor GroupedLinearForward(const Tensor& x, const Tensor& weight, const Tensor* bias, const Tensor& group_sizes) {
    CheckGroupedWeight(weight, GroupedLinearForwardOp::kName, "weight");
    CheckRows(x, weight.size(2), weight, GroupedLinearForwardOp::kName, "x");
    Tensor y = Tensor::Empty(Shape{x.size(0), weight.size(1)}, weight.dtype(), weight.device());
    GroupedLinearForward(
        GroupedLinearForwardArgs{.x = x, .weight = weight, .bias = bias, .group_sizes = group_sizes, .y = y});
    return y;
}

namespace {
void CheckBackwardInput(const GroupedLinearBackwardInputArgs& args, std::string_view kOp) {
    CheckGroupedWeight(args.weight, kOp, "weight");
    CheckRows(args.dy, args.weight.size(1), args.weight, kOp, "dy");
    CheckRows(args.dx, args.weight.size(2), args.weight, kOp, "dx");
    SHARDLINE_CHECK_AS(ShapeError, args.dx.size(0) == args.dy.size(0), kOp,
                       "dx must have dy's {} rows, got dy {} and dx {}", args.dy.size(0), args.dy.ToString(),
                       args.dx.ToString());
    CheckGroupSizes(args.group_sizes, args.weight.size(0), args.dy.size(0), args.weight.device(), kOp);
    if (args.input_activation != LinearActivation::kNone) {
        SHARDLINE_CHECK(args.pre_activation != nullptr, kOp,
                        "input_activation gelu_tanh needs the pre-activation ([tokens, in] = {}), got none",
                        ShapeToString(args.dx.shape()));
        CheckLike(*args.pre_activation, "pre_activation", args.dx, "dx", kOp);
        CheckShape(*args.pre_activation, args.dx.shape(), kOp, "pre_activation");
        SHARDLINE_CHECK(args.dx.numel() == 0 || args.pre_activation->data() != args.dx.data(), kOp,
                        "pre_activation must not be dx itself (the dgrad reads it while writing dx)");
    } else {
        SHARDLINE_CHECK(args.pre_activation == nullptr, kOp,
                        "pre_activation {} is given but input_activation is none (set input_activation = gelu_tanh)",
                        args.pre_activation->ToString());
    }
}

void CheckBackwardWeight(const GroupedLinearBackwardWeightArgs& args, std::string_view kOp) {
    CheckTensor(args.dweight, kOp, "dweight");
    SHARDLINE_CHECK_AS(ShapeError, args.dweight.rank() == 3 && args.dweight.numel() > 0, kOp,
                       "dweight must be [experts, out_features, in_features] with sizes > 0, got {}",
                       args.dweight.ToString());
    CheckOperands(args.x, "x", args.dy, "dy", kOp);
    const std::int64_t experts = args.dweight.size(0);
    const std::int64_t out = args.dweight.size(1);
    const std::int64_t in = args.dweight.size(2);
    CheckRows(args.x, in, args.x, kOp, "x");
    CheckRows(args.dy, out, args.x, kOp, "dy");
    SHARDLINE_CHECK_AS(ShapeError, args.x.size(0) == args.dy.size(0), kOp,
                       "x and dy must have the same rows, got x {} and dy {}", args.x.ToString(), args.dy.ToString());
    CheckSameDevice(args.dweight, "dweight", args.x, "x", kOp);
    SHARDLINE_CHECK_AS(DTypeError, args.dweight.dtype() == args.x.dtype() || args.dweight.dtype() == DType::kFloat32,
                       kOp, "dweight must have x's dtype {} (or be a float32 main grad), got {}",
                       DTypeName(args.x.dtype()), args.dweight.ToString());
    if (args.dbias != nullptr) {
        CheckLike(*args.dbias, "dbias", args.dweight, "dweight", kOp);
        CheckShape(*args.dbias, Shape{experts, out}, kOp, "dbias");
    }
    CheckGroupSizes(args.group_sizes, experts, args.x.size(0), args.x.device(), kOp);
}

void CheckBackwardBias(const GroupedLinearBackwardBiasArgs& args, std::string_view kOp) {
    CheckTensor(args.dy, kOp, "dy");
    CheckDeviceDType(args.dy, kOp, "dy");
    CheckTensor(args.dbias, kOp, "dbias");
    CheckSameDevice(args.dbias, "dbias", args.dy, "dy", kOp);
    SHARDLINE_CHECK_AS(DTypeError, args.dbias.dtype() == args.dy.dtype() || args.dbias.dtype() == DType::kFloat32, kOp,
                       "dbias must have dy's dtype {} or float32, got {}", DTypeName(args.dy.dtype()),
                       args.dbias.ToString());
    SHARDLINE_CHECK_AS(ShapeError,
                       args.dy.rank() == 2 && args.dbias.rank() == 2 && args.dbias.numel() > 0 &&
                           args.dbias.size(1) == args.dy.size(1),
                       kOp, "dy must be [tokens, out] and dbias [experts, out], got dy {} and dbias {}",
                       args.dy.ToString(), args.dbias.ToString());
    CheckGroupSizes(args.group_sizes, args.dbias.size(0), args.dy.size(0), args.dy.device(), kOp);
}

std::atomic<std::uint64_t>& ConcurrentBackwardRuns() {
    static std::atomic<std::uint64_t> runs{0};
    return runs;
}

std::atomic<bool>& ConcurrentBackwardFlag() {
    static std::atomic<bool> flag{env::GetBool("SHARDLINE_GROUPED_CONCURRENT_BWD", true)};
    return flag;
}
} // namespace

void GroupedLinearBackwardInput(const GroupedLinearBackwardInputArgs& args) {
    CheckBackwardInput(args, GroupedLinearBackwardInputOp::kName);
    if (args.dx.numel() == 0) {
        return;
    }
    Dispatch<GroupedLinearBackwardInputOp>(args.dx.device().type, args);
}

void GroupedLinearBackwardWeight(const GroupedLinearBackwardWeightArgs& args) {
    CheckBackwardWeight(args, GroupedLinearBackwardWeightOp::kName);
    Dispatch<GroupedLinearBackwardWeightOp>(args.dweight.device().type, args);
}

void GroupedLinearBackwardBias(const GroupedLinearBackwardBiasArgs& args) {
    CheckBackwardBias(args, GroupedLinearBackwardBiasOp::kName);
    Dispatch<GroupedLinearBackwardBiasOp>(args.dbias.device().type, args);
}

void GroupedLinearBackward(const GroupedLinearBackwardArgs& args) {
    constexpr std::string_view kOp = GroupedLinearBackwardOp::kName;
    CheckTensor(args.dy, kOp, "dy");
    SHARDLINE_CHECK(args.dx == nullptr || args.weight != nullptr, kOp, "dx needs the weight, got dx {} and no weight",
                    args.dx->ToString());
    SHARDLINE_CHECK(args.dweight == nullptr || args.x != nullptr, kOp, "dweight needs x, got dweight {} and no x",
                    args.dweight->ToString());
    SHARDLINE_CHECK(args.input_activation == LinearActivation::kNone || args.dx != nullptr, kOp,
                    "input_activation applies to dx, which is not wanted");
    if (args.dx != nullptr) {
        CheckBackwardInput({.dy = args.dy,
                            .weight = *args.weight,
                            .group_sizes = args.group_sizes,
                            .dx = *args.dx,
                            .input_activation = args.input_activation,
                            .pre_activation = args.pre_activation},
                           kOp);
    }
    if (args.dweight != nullptr) {
        // dbias apart: it may be float32 while dweight is not (or the reverse).
        CheckBackwardWeight({.dy = args.dy, .x = *args.x, .group_sizes = args.group_sizes, .dweight = *args.dweight},
                            kOp);
    }
    if (args.dbias != nullptr) {
        CheckBackwardBias({.dy = args.dy, .group_sizes = args.group_sizes, .dbias = *args.dbias}, kOp);
    }
    if (args.dx == nullptr && args.dweight == nullptr && args.dbias == nullptr) {
        return;
    }
    Dispatch<GroupedLinearBackwardOp>(args.dy.device().type, args);
}

bool GetGroupedConcurrentBackward() { return ConcurrentBackwardFlag().load(std::memory_order_relaxed); }
void SetGroupedConcurrentBackward(bool on) { ConcurrentBackwardFlag().store(on, std::memory_order_relaxed); }
std::uint64_t GroupedConcurrentBackwardRuns() { return ConcurrentBackwardRuns().load(std::memory_order_relaxed); }

void GroupedBiasAdd(const Tensor& y, const Tensor& bias, const Tensor& group_sizes) {
    constexpr std::string_view kOp = "GroupedBiasAdd";
    CheckTensor(y, kOp, "y");
    CheckDeviceDType(y, kOp, "y");
    CheckLike(bias, "bias", y, "y", kOp);
    SHARDLINE_CHECK_AS(ShapeError, y.rank() == 2 && bias.rank() == 2 && bias.size(1) == y.size(1), kOp,
                       "y must be [tokens, out] and bias [experts, out], got y {} and bias {}", y.ToString(),
                       bias.ToString());
    CheckGroupSizes(group_sizes, bias.size(0), y.size(0), y.device(), kOp);
    Dispatch<GroupedBiasAddOp>(y.device().type, GroupedBiasAddArgs{.y = y, .bias = bias, .group_sizes = group_sizes});
}

namespace detail {
void DefaultGroupedBiasAdd(const GroupedBiasAddArgs& args) {
    const std::vector<std::int64_t> sizes = SizesOf(args.group_sizes, args.y.size(0), GroupedBiasAddOp::kName);
    std::int64_t offset = 0;
    for (std::size_t e = 0; e < sizes.size(); ++e) {
        if (sizes[e] > 0) {
            Tensor rows = RowsView(args.y, offset, sizes[e]);
            BiasAdd(BiasAddArgs{.x = rows, .bias = GroupView(args.bias, static_cast<std::int64_t>(e)), .out = rows});
        }
        offset += sizes[e];
    }
}

void DefaultGroupedLinearBackwardBias(const GroupedLinearBackwardBiasArgs& args) {
    const std::vector<std::int64_t> sizes =
        SizesOf(args.group_sizes, args.dy.size(0), GroupedLinearBackwardBiasOp::kName);
    std::int64_t offset = 0;
    for (std::size_t e = 0; e < sizes.size(); ++e) {
        Tensor db = GroupView(args.dbias, static_cast<std::int64_t>(e));
        if (sizes[e] == 0) {
            if (!args.accumulate) {
                db.Fill(0.0); // a sum over no rows
            }
            continue;
        }
        LinearBackwardBias(LinearBackwardBiasArgs{
            .dy = RowsView(args.dy, offset, sizes[e]), .dbias = db, .accumulate = args.accumulate});
        offset += sizes[e];
    }
}

void CountGroupedConcurrentBackward() { ConcurrentBackwardRuns().fetch_add(1, std::memory_order_relaxed); }

void CompositeGroupedLinearBackward(const GroupedLinearBackwardArgs& args) {
    if (args.dx != nullptr) {
        GroupedLinearBackwardInput({.dy = args.dy,
                                    .weight = *args.weight,
                                    .group_sizes = args.group_sizes,
                                    .dx = *args.dx,
                                    .input_activation = args.input_activation,
                                    .pre_activation = args.pre_activation});
    }
    // The bias grad rides with the weight grad when both are in one dtype (GroupedLinearBackwardWeight's dbias).
    const bool bias_with_weight =
        args.dweight != nullptr && args.dbias != nullptr && args.dbias->dtype() == args.dweight->dtype();
    if (args.dweight != nullptr) {
        GroupedLinearBackwardWeight({.dy = args.dy,
                                     .x = *args.x,
                                     .group_sizes = args.group_sizes,
                                     .dweight = *args.dweight,
                                     .dbias = bias_with_weight ? args.dbias : nullptr,
                                     .accumulate = args.accumulate});
    }
    if (args.dbias != nullptr && !bias_with_weight) {
        GroupedLinearBackwardBias(
            {.dy = args.dy, .group_sizes = args.group_sizes, .dbias = *args.dbias, .accumulate = args.accumulate});
    }
}

void RegisterGroupedLinearCompositions() {
    for (DeviceType d : kBuiltDeviceTypes) {
        Register<GroupedLinearForwardOp>(d, kDefaultProvider, &DefaultGroupedLinearForward);
        Register<GroupedLinearBackwardInputOp>(d, kDefaultProvider, &DefaultGroupedLinearBackwardInput);
        Register<GroupedLinearBackwardWeightOp>(d, kDefaultProvider, &DefaultGroupedLinearBackwardWeight);
        Register<GroupedLinearBackwardBiasOp>(d, kDefaultProvider, &DefaultGroupedLinearBackwardBias);
        Register<GroupedLinearBackwardOp>(d, kDefaultProvider, &CompositeGroupedLinearBackward);
        Register<GroupedBiasAddOp>(d, kDefaultProvider, &DefaultGroupedBiasAdd);
    }
}
} // namespace detail

} // namespace shardline::kernels
