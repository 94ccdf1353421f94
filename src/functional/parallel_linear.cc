// Column- and row-parallel Linear on caller-owned memory. Each entry point validates everything (before any
// collective), finds its configuration's rule answer and plans (linear_plan.h), wraps the caller's memory in tensors
// (Tensor::FromBlob) and runs one shared sequence: move the inputs as the rule's input plans say, run the local
// kernels, move the outputs as the rule's output plans say (DistTensor::Redistribute), add a bias the rule puts after
// a reduction. No collective is chosen here.

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/linear.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

#include "linear_plan.h"

namespace shardline::functional {

std::int64_t TensorView::numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < ndim && d < kMaxViewDims; ++d) {
        n *= shape[d];
    }
    return n;
}

TensorView View(void *data, std::initializer_list<std::int64_t> shape, DType dtype) {
    SHARDLINE_CHECK_AS(ShapeError, shape.size() <= static_cast<std::size_t>(kMaxViewDims), "functional::View",
                       "a view has at most {} dims, got {} ([{}])", kMaxViewDims, shape.size(), fmt::join(shape, ", "));
    TensorView view{.data = data, .dtype = dtype, .ndim = static_cast<int>(shape.size())};
    int d = 0;
    for (std::int64_t extent : shape) {
        view.shape[d++] = extent;
    }
    return view;
}

TensorView View(const void *data, std::initializer_list<std::int64_t> shape, DType dtype) {
    // Inputs are only read; the one view type keeps the argument structs simple.
    return View(const_cast<void *>(data), shape, dtype);
}

namespace {

using detail::LinearConfig;
using detail::LinearKind;
using detail::LinearPlan;

Shape ShapeOf(const TensorView &v) {
    return Shape(v.shape, v.shape + v.ndim);
}

/// "[s, b, h]" of a view, for messages.
std::string Dims(const TensorView &v) {
    return ShapeToString(ShapeOf(v));
}

Shape WithLast(Shape shape, std::int64_t last) {
    shape.push_back(last);
    return shape;
}

// ---------------------------------------------------------------------------------------------------------------------
// Validation. Every check runs on the calling rank before anything is issued, so a configuration that every rank gets
// wrong raises on every rank and none is left in a collective.

class Checker {
public:
    explicit Checker(std::string_view op) : op_(op) {}

    /// The layer's sizes, appended to shape errors ("in_features 16, out_features 24, tp 4").
    void SetSizes(std::string sizes) { sizes_ = std::move(sizes); }

    /// The group's tp size; the mesh dim must exist.
    std::int64_t TpSize(const TensorParallelGroup &group) const {
        const comm::DeviceMesh &mesh = group.mesh;
        SHARDLINE_CHECK(mesh.ndim() <= detail::kMaxMeshDims, op_, "the mesh may have at most {} dims, got [{}]",
                        detail::kMaxMeshDims, fmt::join(mesh.shape(), ", "));
        SHARDLINE_CHECK(group.tp_dim >= 0 && group.tp_dim < mesh.ndim(), op_,
                        "tp_dim ({}) must name a dim of the mesh [{}] (0 to {})", group.tp_dim,
                        fmt::join(mesh.shape(), ", "), mesh.ndim() - 1);
        return mesh.shape()[static_cast<std::size_t>(group.tp_dim)];
    }

    void Positive(std::int64_t value, std::string_view name) const {
        SHARDLINE_CHECK_AS(ShapeError, value > 0, op_, "{} must be > 0, got {}", name, value);
    }

    void Divisible(std::int64_t value, std::string_view name, std::int64_t tp) const {
        SHARDLINE_CHECK_AS(ShapeError, value % tp == 0, op_, "{} ({}) must be divisible by tp ({})", name, value, tp);
    }

    /// A view that must be given: a non-null pointer, 1..kMaxViewDims dims (at least `min_ndim`), no negative extent.
    void Required(const TensorView &v, std::string_view name, int min_ndim, std::string_view why = {}) const {
        SHARDLINE_CHECK(v.present(), op_, "{} is required{}, got a null data pointer (shape [{}])", name, why,
                        fmt::join(v.shape, v.shape + std::clamp(v.ndim, 0, kMaxViewDims), ", "));
        CheckDims(v, name, min_ndim);
    }

    /// A view that may be absent; when given, the same checks as Required.
    bool Optional(const TensorView &v, std::string_view name, int min_ndim) const {
        if (!v.present()) {
            return false;
        }
        CheckDims(v, name, min_ndim);
        return true;
    }

    /// The view's shape must be `expected`, which `formula` spells in the layer's terms.
    void Shaped(const TensorView &v, std::string_view name, const Shape &expected, std::string_view formula) const {
        SHARDLINE_CHECK_AS(ShapeError, ShapeOf(v) == expected, op_, "{} must be {} = {} ({}), got {}", name, formula,
                           ShapeToString(expected), sizes_, Dims(v));
    }

    void SameDType(const TensorView &v, std::string_view name, DType dtype, std::string_view reference) const {
        SHARDLINE_CHECK_AS(DTypeError, v.dtype == dtype, op_, "{} must have {}'s dtype {}, got {}", name, reference,
                           DTypeName(dtype), DTypeName(v.dtype));
    }

    /// A parameter gradient: the compute dtype, or a float32 main grad when accumulating.
    void GradDType(const TensorView &v, std::string_view name, DType dtype, GradMode mode) const {
        SHARDLINE_CHECK_AS(
            DTypeError, v.dtype == dtype || (mode == GradMode::kAccumulate && v.dtype == DType::kFloat32), op_,
            "{} must have the compute dtype {} (or be a float32 main grad with GradMode::kAccumulate), "
            "got {}{}",
            name, DTypeName(dtype), DTypeName(v.dtype),
            mode == GradMode::kOverwrite && v.dtype == DType::kFloat32 ? " with GradMode::kOverwrite" : "");
    }

    /// The dtypes the mesh's backend and kernels move: CPU/MPI float32, float64; CUDA/NCCL float32, float16, bfloat16.
    void DeviceDType(DType dtype, DeviceType device, std::string_view name) const {
        if (device == DeviceType::kCPU) {
            SHARDLINE_CHECK_AS(DTypeError, dtype == DType::kFloat32 || dtype == DType::kFloat64, op_,
                               "a CPU (MPI) mesh takes float32 or float64, got {} {} (half types run on CUDA only)",
                               name, DTypeName(dtype));
        } else {
            SHARDLINE_CHECK_AS(
                DTypeError, dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, op_,
                "a CUDA (NCCL) mesh takes float32, float16 or bfloat16, got {} {}", name, DTypeName(dtype));
        }
    }

    void Cuda(const CudaExecution &cuda) const {
        SHARDLINE_CHECK(
            (cuda.workspace == nullptr) == (cuda.workspace_bytes == 0), op_,
            "a cuBLASLt workspace needs both a pointer and a size (or neither, for the context's), got {} and {} bytes",
            cuda.workspace, cuda.workspace_bytes);
    }

    std::string_view op() const { return op_; }

private:
    void CheckDims(const TensorView &v, std::string_view name, int min_ndim) const {
        SHARDLINE_CHECK_AS(ShapeError, v.ndim >= min_ndim && v.ndim <= kMaxViewDims, op_,
                           "{} must have {} to {} dims, got ndim {}", name, min_ndim, kMaxViewDims, v.ndim);
        for (int d = 0; d < v.ndim; ++d) {
            SHARDLINE_CHECK_AS(ShapeError, v.shape[d] >= 0, op_, "{} has a negative extent: {}", name, Dims(v));
        }
    }

    std::string_view op_;
    std::string sizes_;
};

/// The mesh, tp dim, shape and dtype part of a configuration; the layer's flags are set by the overloads below.
LinearConfig MakeConfig(const TensorParallelGroup &group, const Shape &x_global, std::int64_t out_features,
                        DType dtype) {
    LinearConfig c;
    c.dtype = dtype;
    c.tp_dim = group.tp_dim;
    c.mesh_ndim = group.mesh.ndim();
    for (int d = 0; d < c.mesh_ndim; ++d) {
        c.mesh_shape[static_cast<std::size_t>(d)] = group.mesh.shape()[static_cast<std::size_t>(d)];
    }
    c.x_ndim = static_cast<int>(x_global.size());
    for (int d = 0; d < c.x_ndim; ++d) {
        c.x_shape[static_cast<std::size_t>(d)] = x_global[static_cast<std::size_t>(d)];
    }
    c.out_features = out_features;
    return c;
}

LinearConfig MakeConfig(const TensorParallelGroup &group, const Shape &x_global, DType dtype,
                        const ColumnParallelLinearOptions &o) {
    LinearConfig c = MakeConfig(group, x_global, o.out_features, dtype);
    c.kind = LinearKind::kColumn;
    c.bias = o.bias;
    c.gather_output = o.gather_output;
    c.sequence_parallel = o.sequence_parallel;
    return c;
}

LinearConfig MakeConfig(const TensorParallelGroup &group, const Shape &x_global, DType dtype,
                        const RowParallelLinearOptions &o) {
    LinearConfig c = MakeConfig(group, x_global, o.out_features, dtype);
    c.kind = LinearKind::kRow;
    c.bias = o.bias;
    c.input_is_parallel = o.input_is_parallel;
    c.sequence_parallel = o.sequence_parallel;
    return c;
}

// ---------------------------------------------------------------------------------------------------------------------
// Execution.

/// One call's device, mesh and the collectives it issued; on CUDA it also holds the stream/workspace override.
class Call {
public:
    Call(comm::DeviceMesh &mesh, const CudaExecution &cuda) : mesh_(mesh) {
        if (mesh.world().device_type() == DeviceType::kCUDA) {
#if SHARDLINE_HAVE_CUDA
            CudaContext &ctx = CudaContext::Current();
            device_ = Device::CUDA(ctx.device());
            scope_.emplace(ctx, cuda.stream, cuda.workspace, cuda.workspace_bytes);
#endif
        }
    }

    Device device() const {
        return device_;
    }
    int collectives() const {
        return collectives_;
    }

    Tensor Wrap(const TensorView &v) const {
        return v.present() ? Tensor::FromBlob(v.data, ShapeOf(v), v.dtype, device_) : Tensor();
    }

    /// This rank's shard shape of a global tensor in `layout`.
    Shape LocalShape(const Shape &global, const spmd::Layout &layout) const {
        return spmd::ComputeLocalShard(spmd::ProcessMesh(mesh_.shape()), global, layout, mesh_.coordinate()).shape;
    }

    /// `local` (this rank's shard of a global tensor in `layout`) moved by `plan`, a cached plan of the rule: nothing
    /// to do for an empty plan, else DistTensor::Redistribute runs exactly the plan's steps (no planning) on the mesh
    /// dims' groups and returns a tensor of its own.
    Tensor Move(const Tensor &local, const Shape &global, const spmd::Layout &layout,
                const spmd::RedistributePlan &plan) {
        if (plan.steps.empty()) {
            return local;
        }
        collectives_ += plan.NumCollectives();
        const dist::DistTensor t(local, global, layout, mesh_);
        return t.Redistribute(plan.steps.back().after, plan).local();
    }

private:
    comm::DeviceMesh &mesh_;
    Device device_ = Device::CPU();
    int collectives_ = 0;
#if SHARDLINE_HAVE_CUDA
    // A Call outlives every tensor of its call (they live in the Run* functions and their arguments), so temporaries
    // are released stream-ordered on the caller's stream before the previous stream is restored.
    std::optional<ScopedCudaOverride> scope_;
#endif
};

/// The tensor a kernel writes an output into: the caller's buffer when the rule's local shard is exactly it and no
/// plan moves it, else a temporary that the plan then moves (Redistribute returns a tensor of its own, which is then
/// copied into the caller's buffer).
Tensor OutputBuffer(const Tensor &caller, const Shape &local_shape) {
    if (caller.shape() == local_shape) {
        return caller;
    }
    return Tensor::Empty(local_shape, caller.dtype(), caller.device());
}

void Deliver(const Tensor &result, const Tensor &caller) {
    if (result.data() != caller.data()) {
        Tensor dst = caller;
        dst.CopyFrom(result);
    }
}

/// y[r, :] += bias for every row r: the bias the rule adds once, after the reduction of a Partial output.
void AddBiasRows(const Tensor &y, const Tensor &bias) {
    Tensor out = y;
    kernels::BiasAdd(kernels::BiasAddArgs{.x = y, .bias = bias, .out = out});
}

struct ForwardTensors {
    Tensor x{};
    Tensor weight{};
    Tensor bias{}; ///< undefined without a bias
    Tensor y{};
    Tensor x_total{}; ///< undefined unless the caller keeps the gathered input
};

ForwardInfo RunForward(Call &call, const LinearPlan &plan, const ForwardTensors &t) {
    const spmd::CachedRule &rule = *plan.forward;
    ForwardInfo info;

    // x into the layout of the local GEMM: all-gathered (column, sequence parallel), sliced locally (row, input not
    // parallel), or as given.
    Tensor x_used =
        call.Move(t.x, plan.x_shape, plan.x_layout, rule.input_plans[static_cast<std::size_t>(plan.forward_x)]);
    if (t.x_total.defined()) {
        Deliver(x_used, t.x_total);
        info.saved_input = SavedInput::kGatheredInput;
    }

    // The local GEMM gives y in the rule's layout (row parallel: Partial); the bias rides in its epilogue unless the
    // rule adds it after the reduction.
    const spmd::TensorSpec &y_rule = rule.info.outputs[0];
    const spmd::RedistributePlan &y_plan = rule.output_plans[0];
    const bool bias_after = t.bias.defined() && rule.info.bias_after_reduction;
    Tensor y_local = y_plan.steps.empty() ? t.y : OutputBuffer(t.y, call.LocalShape(plan.y_shape, y_rule.layout));
    kernels::LinearForward(kernels::LinearForwardArgs{
        .x = x_used, .weight = t.weight, .bias = t.bias.defined() && !bias_after ? &t.bias : nullptr, .y = y_local});
    // y to the caller's layout: all-reduced or reduce-scattered (row), all-gathered (column, gather_output).
    Deliver(call.Move(y_local, plan.y_shape, y_rule.layout, y_plan), t.y);
    if (bias_after) {
        AddBiasRows(t.y, t.bias);
    }
    info.collectives = call.collectives();
    return info;
}

struct BackwardTensors {
    Tensor dy{};
    Tensor x{};       ///< undefined when not needed
    Tensor x_total{}; ///< column, sequence parallel: the forward's gathered input, if kept
    Tensor weight{};  ///< undefined when not needed
    Tensor dx{};      ///< undefined: not wanted
    Tensor dweight{};
    Tensor dbias{};
    GradMode mode = GradMode::kOverwrite;
};

BackwardInfo RunBackward(Call &call, const LinearPlan &plan, const BackwardTensors &t) {
    const spmd::CachedRule &rule = *plan.grad;
    const bool want_dx = t.dx.defined();
    const bool want_dw = t.dweight.defined();
    const bool want_db = t.dbias.defined();
    if (!want_dx && !want_dw && !want_db) {
        return {};
    }
    // dy into the layout the rule wants: a local slice (column, gather_output), all-gathered (row, sequence
    // parallel), or as given.
    const Tensor dy_used =
        call.Move(t.dy, plan.y_shape, plan.y_layout, rule.input_plans[static_cast<std::size_t>(plan.grad_out_grad)]);

    // x into the layout of the wgrad GEMM: the forward's gathered input when kept, else all-gathered again (column,
    // sequence parallel), sliced locally (row, input not parallel), or as given.
    Tensor x_used;
    if (want_dw) {
        x_used = t.x_total.defined() ? t.x_total
                                     : call.Move(t.x, plan.x_shape, plan.x_layout,
                                                 rule.input_plans[static_cast<std::size_t>(plan.grad_x)]);
    }
    // dx = dy·W comes out in the grad rule's layout (column: Partial over tp) and goes back to x's layout after the
    // kernels: an all-reduce, a reduce-scatter (sequence parallel) or an all-gather (row, input not parallel).
    const auto o = static_cast<std::size_t>(plan.grad_x_grad);
    const spmd::TensorSpec &dx_rule = rule.info.outputs[o];
    const spmd::RedistributePlan &dx_plan = rule.output_plans[o];
    Tensor dx_local;
    if (want_dx) {
        dx_local = dx_plan.steps.empty() ? t.dx : OutputBuffer(t.dx, call.LocalShape(plan.x_shape, dx_rule.layout));
    }

    // One LinearBackward for what is wanted, so the kernels decide per shape whether the bias grad rides in the wgrad
    // GEMM or runs beside it. Parameter gradients stay in their parameters' layouts (checked when the plan was built):
    // no collective, and they accumulate straight into the caller's (main) grads. The kernel takes dbias in dweight's
    // dtype only; a float32 main grad for one and not the other gets its own column sum.
    const bool accumulate = t.mode == GradMode::kAccumulate;
    const bool bias_apart = want_db && want_dw && t.dbias.dtype() != t.dweight.dtype();
    Tensor dweight = t.dweight;
    Tensor dbias = t.dbias;
    kernels::LinearBackward(kernels::LinearBackwardArgs{.dy = dy_used,
                                                        .x = want_dw ? &x_used : nullptr,
                                                        .weight = want_dx ? &t.weight : nullptr,
                                                        .dx = want_dx ? &dx_local : nullptr,
                                                        .dweight = want_dw ? &dweight : nullptr,
                                                        .dbias = want_db && !bias_apart ? &dbias : nullptr,
                                                        .accumulate = accumulate});
    if (bias_apart) {
        kernels::LinearBackwardBias(
            kernels::LinearBackwardBiasArgs{.dy = dy_used, .dbias = dbias, .accumulate = accumulate});
    }
    if (want_dx) {
        Deliver(call.Move(dx_local, plan.x_shape, dx_rule.layout, dx_plan), t.dx);
    }
    return BackwardInfo{.collectives = call.collectives()};
}

std::string ColumnSizes(const ColumnParallelLinearOptions &o, std::int64_t tp) {
    return fmt::format("in_features {}, out_features {}, tp {}{}{}", o.in_features, o.out_features, tp,
                       o.sequence_parallel ? ", sequence_parallel" : "", o.gather_output ? ", gather_output" : "");
}

std::string RowSizes(const RowParallelLinearOptions &o, std::int64_t tp) {
    return fmt::format("in_features {}, out_features {}, tp {}{}{}", o.in_features, o.out_features, tp,
                       o.input_is_parallel ? ", input_is_parallel" : "",
                       o.sequence_parallel ? ", sequence_parallel" : "");
}

/// Checks shared by a layer's forward and backward: sizes, flags, the group and the stream/workspace.
std::int64_t CheckColumnLayer(const Checker &check, const ColumnParallelLinearOptions &o,
                              const TensorParallelGroup &group, const CudaExecution &cuda) {
    const std::int64_t tp = check.TpSize(group);
    check.Positive(o.in_features, "in_features");
    check.Positive(o.out_features, "out_features");
    check.Divisible(o.out_features, "out_features", tp);
    SHARDLINE_CHECK(!(o.gather_output && o.sequence_parallel), check.op(),
                    "gather_output and sequence_parallel exclude each other (a sequence-parallel column layer's output "
                    "stays split on out_features for the row-parallel layer that follows)");
    check.Cuda(cuda);
    return tp;
}

std::int64_t CheckRowLayer(const Checker &check, const RowParallelLinearOptions &o, const TensorParallelGroup &group,
                           const CudaExecution &cuda) {
    const std::int64_t tp = check.TpSize(group);
    check.Positive(o.in_features, "in_features");
    check.Positive(o.out_features, "out_features");
    check.Divisible(o.in_features, "in_features", tp);
    SHARDLINE_CHECK(!o.sequence_parallel || o.input_is_parallel, check.op(),
                    "sequence_parallel needs input_is_parallel (Megatron: the input of a sequence-parallel row layer "
                    "comes split on in_features from a column layer)");
    check.Cuda(cuda);
    return tp;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Column parallel.

ForwardInfo ColumnParallelLinearForward(const ColumnParallelLinearOptions &options,
                                        const ColumnParallelLinearForwardArgs &args, const TensorParallelGroup &group,
                                        const CudaExecution &cuda) {
    constexpr std::string_view kOp = "ColumnParallelLinearForward";
    Checker check(kOp);
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(ColumnSizes(options, tp));
    CheckColumnLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const bool sp = options.sequence_parallel;

    check.Required(args.x, "x", 2);
    check.Required(args.weight, "weight", 2);
    check.Required(args.y, "y", 2);
    const DType dtype = args.x.dtype;
    check.DeviceDType(dtype, group.mesh.world().device_type(), "x");
    Shape lead = ShapeOf(args.x);
    lead.pop_back();
    check.Shaped(args.x, "x", WithLast(lead, k), sp ? "[s/tp, ..., in_features]" : "[s, ..., in_features]");
    Shape global = lead;
    if (sp) {
        global[0] *= tp;
    }
    check.Shaped(args.weight, "weight", {n / tp, k}, "[out_features/tp, in_features]");
    check.SameDType(args.weight, "weight", dtype, "x");
    if (options.bias) {
        check.Required(args.bias, "bias", 1, " (options.bias is set)");
        check.Shaped(args.bias, "bias", {n / tp}, "[out_features/tp]");
        check.SameDType(args.bias, "bias", dtype, "x");
    } else {
        SHARDLINE_CHECK(!args.bias.present(), kOp, "bias is given but options.bias is false");
    }
    check.Shaped(args.y, "y", WithLast(global, options.gather_output ? n : n / tp),
                 options.gather_output ? "[s, ..., out_features]" : "[s, ..., out_features/tp]");
    check.SameDType(args.y, "y", dtype, "x");
    if (check.Optional(args.x_total, "x_total", 2)) {
        SHARDLINE_CHECK(sp, kOp,
                        "x_total is given but options.sequence_parallel is false (x itself is the whole input)");
        check.Shaped(args.x_total, "x_total", WithLast(global, k), "[s, ..., in_features]");
        check.SameDType(args.x_total, "x_total", dtype, "x");
    }

    const auto plan = detail::GetLinearPlan(MakeConfig(group, WithLast(global, k), dtype, options), kOp);
    Call call(group.mesh, cuda);
    return RunForward(call, *plan,
                      ForwardTensors{.x = call.Wrap(args.x),
                                     .weight = call.Wrap(args.weight),
                                     .bias = call.Wrap(args.bias),
                                     .y = call.Wrap(args.y),
                                     .x_total = call.Wrap(args.x_total)});
}

BackwardInfo ColumnParallelLinearBackward(const ColumnParallelLinearOptions &options,
                                          const ColumnParallelLinearBackwardArgs &args,
                                          const TensorParallelGroup &group, const CudaExecution &cuda) {
    constexpr std::string_view kOp = "ColumnParallelLinearBackward";
    Checker check(kOp);
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(ColumnSizes(options, tp));
    CheckColumnLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const bool sp = options.sequence_parallel;

    check.Required(args.dy, "dy", 2);
    const DType dtype = args.dy.dtype;
    check.DeviceDType(dtype, group.mesh.world().device_type(), "dy");
    Shape global = ShapeOf(args.dy);
    global.pop_back();
    check.Shaped(args.dy, "dy", WithLast(global, options.gather_output ? n : n / tp),
                 options.gather_output ? "[s, ..., out_features]" : "[s, ..., out_features/tp]");
    Shape lead = global;
    if (sp) {
        check.Divisible(global[0], "the sequence length dy.shape[0]", tp);
        lead[0] /= tp;
    }
    const std::string_view x_formula = sp ? "[s/tp, ..., in_features]" : "[s, ..., in_features]";
    const bool want_dx = check.Optional(args.dx, "dx", 2);
    const bool want_dw = check.Optional(args.dweight, "dweight", 2);
    const bool want_db = check.Optional(args.dbias, "dbias", 1);
    const bool have_total = check.Optional(args.x_total, "x_total", 2);
    if (have_total) {
        SHARDLINE_CHECK(sp, kOp,
                        "x_total is given but options.sequence_parallel is false (x itself is the whole input)");
        check.Shaped(args.x_total, "x_total", WithLast(global, k), "[s, ..., in_features]");
        check.SameDType(args.x_total, "x_total", dtype, "dy");
    }
    if (want_dw && !have_total) {
        check.Required(args.x, "x", 2, sp ? " for dweight (or x_total)" : " for dweight");
    }
    if (args.x.present()) {
        check.Optional(args.x, "x", 2);
        check.Shaped(args.x, "x", WithLast(lead, k), x_formula);
        check.SameDType(args.x, "x", dtype, "dy");
    }
    if (want_dx) {
        check.Required(args.weight, "weight", 2, " for dx");
        check.Shaped(args.dx, "dx", WithLast(lead, k), x_formula);
        check.SameDType(args.dx, "dx", dtype, "dy");
    }
    if (args.weight.present()) {
        check.Optional(args.weight, "weight", 2);
        check.Shaped(args.weight, "weight", {n / tp, k}, "[out_features/tp, in_features]");
        check.SameDType(args.weight, "weight", dtype, "dy");
    }
    if (want_dw) {
        check.Shaped(args.dweight, "dweight", {n / tp, k}, "[out_features/tp, in_features]");
        check.GradDType(args.dweight, "dweight", dtype, args.param_grads);
    }
    if (want_db) {
        SHARDLINE_CHECK(options.bias, kOp, "dbias is requested but options.bias is false");
        check.Shaped(args.dbias, "dbias", {n / tp}, "[out_features/tp]");
        check.GradDType(args.dbias, "dbias", dtype, args.param_grads);
    }

    const auto plan = detail::GetLinearPlan(MakeConfig(group, WithLast(global, k), dtype, options), kOp);
    Call call(group.mesh, cuda);
    return RunBackward(call, *plan,
                       BackwardTensors{.dy = call.Wrap(args.dy),
                                       .x = want_dw && !have_total ? call.Wrap(args.x) : Tensor(),
                                       .x_total = want_dw && have_total ? call.Wrap(args.x_total) : Tensor(),
                                       .weight = want_dx ? call.Wrap(args.weight) : Tensor(),
                                       .dx = call.Wrap(args.dx),
                                       .dweight = call.Wrap(args.dweight),
                                       .dbias = call.Wrap(args.dbias),
                                       .mode = args.param_grads});
}

// ---------------------------------------------------------------------------------------------------------------------
// Row parallel.

ForwardInfo RowParallelLinearForward(const RowParallelLinearOptions &options, const RowParallelLinearForwardArgs &args,
                                     const TensorParallelGroup &group, const CudaExecution &cuda) {
    constexpr std::string_view kOp = "RowParallelLinearForward";
    Checker check(kOp);
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(RowSizes(options, tp));
    CheckRowLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t k_local = options.input_is_parallel ? k / tp : k;

    check.Required(args.x, "x", 2);
    check.Required(args.weight, "weight", 2);
    check.Required(args.y, "y", 2);
    const DType dtype = args.x.dtype;
    check.DeviceDType(dtype, group.mesh.world().device_type(), "x");
    Shape global = ShapeOf(args.x);
    global.pop_back();
    check.Shaped(args.x, "x", WithLast(global, k_local),
                 options.input_is_parallel ? "[s, ..., in_features/tp]" : "[s, ..., in_features]");
    check.Shaped(args.weight, "weight", {n, k / tp}, "[out_features, in_features/tp]");
    check.SameDType(args.weight, "weight", dtype, "x");
    if (options.bias) {
        check.Required(args.bias, "bias", 1, " (options.bias is set)");
        check.Shaped(args.bias, "bias", {n}, "[out_features]");
        check.SameDType(args.bias, "bias", dtype, "x");
    } else {
        SHARDLINE_CHECK(!args.bias.present(), kOp, "bias is given but options.bias is false");
    }
    Shape y_lead = global;
    if (options.sequence_parallel) {
        check.Divisible(global[0], "the sequence length x.shape[0]", tp);
        y_lead[0] /= tp;
    }
    check.Shaped(args.y, "y", WithLast(y_lead, n),
                 options.sequence_parallel ? "[s/tp, ..., out_features]" : "[s, ..., out_features]");
    check.SameDType(args.y, "y", dtype, "x");

    const auto plan = detail::GetLinearPlan(MakeConfig(group, WithLast(global, k), dtype, options), kOp);
    Call call(group.mesh, cuda);
    return RunForward(call, *plan,
                      ForwardTensors{.x = call.Wrap(args.x),
                                     .weight = call.Wrap(args.weight),
                                     .bias = call.Wrap(args.bias),
                                     .y = call.Wrap(args.y)});
}

BackwardInfo RowParallelLinearBackward(const RowParallelLinearOptions &options,
                                       const RowParallelLinearBackwardArgs &args, const TensorParallelGroup &group,
                                       const CudaExecution &cuda) {
    constexpr std::string_view kOp = "RowParallelLinearBackward";
    Checker check(kOp);
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(RowSizes(options, tp));
    CheckRowLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t k_local = options.input_is_parallel ? k / tp : k;

    check.Required(args.dy, "dy", 2);
    const DType dtype = args.dy.dtype;
    check.DeviceDType(dtype, group.mesh.world().device_type(), "dy");
    Shape global = ShapeOf(args.dy);
    global.pop_back();
    check.Shaped(args.dy, "dy", WithLast(global, n),
                 options.sequence_parallel ? "[s/tp, ..., out_features]" : "[s, ..., out_features]");
    if (options.sequence_parallel) {
        global[0] *= tp;
    }
    const std::string_view x_formula = options.input_is_parallel ? "[s, ..., in_features/tp]" : "[s, ..., in_features]";
    const bool want_dx = check.Optional(args.dx, "dx", 2);
    const bool want_dw = check.Optional(args.dweight, "dweight", 2);
    const bool want_db = check.Optional(args.dbias, "dbias", 1);
    if (want_dw) {
        check.Required(args.x, "x", 2, " for dweight");
    }
    if (args.x.present()) {
        check.Optional(args.x, "x", 2);
        check.Shaped(args.x, "x", WithLast(global, k_local), x_formula);
        check.SameDType(args.x, "x", dtype, "dy");
    }
    if (want_dx) {
        check.Required(args.weight, "weight", 2, " for dx");
        check.Shaped(args.dx, "dx", WithLast(global, k_local), x_formula);
        check.SameDType(args.dx, "dx", dtype, "dy");
    }
    if (args.weight.present()) {
        check.Optional(args.weight, "weight", 2);
        check.Shaped(args.weight, "weight", {n, k / tp}, "[out_features, in_features/tp]");
        check.SameDType(args.weight, "weight", dtype, "dy");
    }
    if (want_dw) {
        check.Shaped(args.dweight, "dweight", {n, k / tp}, "[out_features, in_features/tp]");
        check.GradDType(args.dweight, "dweight", dtype, args.param_grads);
    }
    if (want_db) {
        SHARDLINE_CHECK(options.bias, kOp, "dbias is requested but options.bias is false");
        check.Shaped(args.dbias, "dbias", {n}, "[out_features]");
        check.GradDType(args.dbias, "dbias", dtype, args.param_grads);
    }

    const auto plan = detail::GetLinearPlan(MakeConfig(group, WithLast(global, k), dtype, options), kOp);
    Call call(group.mesh, cuda);
    return RunBackward(call, *plan,
                       BackwardTensors{.dy = call.Wrap(args.dy),
                                       .x = want_dw ? call.Wrap(args.x) : Tensor(),
                                       .weight = want_dx ? call.Wrap(args.weight) : Tensor(),
                                       .dx = call.Wrap(args.dx),
                                       .dweight = call.Wrap(args.dweight),
                                       .dbias = call.Wrap(args.dbias),
                                       .mode = args.param_grads});
}

} // namespace shardline::functional
